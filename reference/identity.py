"""Who this worker is: its global rank and the physical GPU id used in file names.

FastDeploy names snapshot files ``model_state.tp{rank}.{id}`` where ``rank`` is the *global* rank
(``paddle.distributed.get_rank()``, i.e. ``PADDLE_TRAINER_ID``) and ``id`` is the *physical* GPU
index: the entry of ``CUDA_VISIBLE_DEVICES`` selected by ``FLAGS_selected_gpus``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import paddle.distributed

from .errors import GpuIdError


def global_rank() -> int:
    return int(paddle.distributed.get_rank())


def physical_gpu_id(env: Mapping[str, str] | None = None) -> int:
    """``int(CUDA_VISIBLE_DEVICES.split(",")[FLAGS_selected_gpus])``, each default "0".

    UUID-style entries (``GPU-…``/``MIG-…``) and an out-of-range selection raise GpuIdError naming
    both variables and their values, instead of a bare ``int()``/``IndexError``.
    """
    env = os.environ if env is None else env
    visible_raw = env.get("CUDA_VISIBLE_DEVICES", "0")
    selected_raw = env.get("FLAGS_selected_gpus", "0")
    visible = [v.strip() for v in visible_raw.split(",")]
    selected_text = selected_raw.strip()
    if not (selected_text.isascii() and selected_text.isdigit()):  # int() would take "-1", "+1", "1_0", "١"
        raise GpuIdError(f"FLAGS_selected_gpus={selected_raw!r} is not a non-negative integer index")
    selected = int(selected_text)
    if selected >= len(visible):
        raise GpuIdError(
            f"FLAGS_selected_gpus={selected} is out of range for CUDA_VISIBLE_DEVICES={visible_raw!r} "
            f"({len(visible)} entries)"
        )
    entry = visible[selected]
    if not (entry.isascii() and entry.isdigit()):
        raise GpuIdError(
            f"CUDA_VISIBLE_DEVICES entry {selected} is {entry!r} (CUDA_VISIBLE_DEVICES={visible_raw!r}); "
            "snapshot and IPC file names need a numeric physical GPU index, not a UUID"
        )
    return int(entry)
