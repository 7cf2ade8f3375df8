"""Mutants of the worker identity used in file names (fd-spec §1.4, rule 12)."""
from __future__ import annotations

import os

from .base import Mutant


class GpuOrdinalAsId(Mutant):
    id = "gpu_ordinal_as_id"
    bug = ("file id taken from FLAGS_selected_gpus (the ordinal) instead of the physical GPU in "
           "CUDA_VISIBLE_DEVICES: with CUDA_VISIBLE_DEVICES=2,3,4 the worker reads tp0.1 instead of tp0.3")
    kills = frozenset({"SNAP-GPU-ID"})

    def patches(self):
        return {"reference.identity.physical_gpu_id": lambda env=None: int((env or os.environ).get("FLAGS_selected_gpus", "0"))}


class BareIntGpuId(Mutant):
    id = "bare_int_gpu_id"
    bug = ("int(CUDA_VISIBLE_DEVICES.split(',')[int(FLAGS_selected_gpus)]) with no check: a UUID entry gives "
           "\"invalid literal for int()\" and an out-of-range selection a bare IndexError, neither naming the variable")
    kills = frozenset({"SNAP-GPU-ID-INVALID"})

    def patches(self):
        def physical_gpu_id(env=None):
            env = os.environ if env is None else env
            return int(env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[int(env.get("FLAGS_selected_gpus", "0"))])

        return {"reference.identity.physical_gpu_id": physical_gpu_id}
