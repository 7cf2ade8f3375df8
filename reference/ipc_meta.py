"""The ``ipc`` strategy: a metadata file of shared handles (fd-spec §3.3).

``{shared_dir}/ipc_metas_{id}`` (id = physical GPU id) is a ``paddle.save`` pickle of
``name -> [handle, offset_bytes, size, type_idx, dims, lod, device_id]``. The update runs in three
steps so that a bad entry changes no parameter:

1. plan (pure): read the file with no pickle globals admitted, normalise every meta (device_id
   replaced by this worker's ``FLAGS_selected_gpus``), check dtype and shape against the model;
2. load: open every handle and copy its bytes into a tensor the worker owns;
3. apply: one source, label ``raw``, source = the meta file path.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import paddle

from sim.ipc_handles import HandleError, MetaError, current_device, dtype_of_code, normalize_meta, open_tensor_meta

from . import apply
from .dtypes import paddle_dtype
from .safe_pickle import load_restricted

log = logging.getLogger("reference.ipc_meta")

LABEL = "raw"


def meta_path(shared_dir: str, gpu_id: int) -> str:
    return os.path.join(shared_dir, f"ipc_metas_{gpu_id}")


def worker_device(manager) -> int:
    """The CUDA ordinal this worker opens handles on: ``FLAGS_selected_gpus``, not the physical id."""
    return current_device(manager.env)


def read_metas(path: str) -> dict:
    """The stored dict of metas. Plain lists, strings and ints need no pickle global, so none is admitted."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"IPC metadata file {path} not found (the trainer writes ipc_metas_{{gpu id}} there)")
    obj = load_restricted(path, allow_arrays=False)
    if not isinstance(obj, dict):
        raise MetaError(f"{path}: expected a dict of tensor name -> meta, found {type(obj).__name__}")
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise MetaError(f"{path}: tensor names must be str, found {bad[:3]!r}")
    return obj


def plan_metas(path: str, metas: dict, device: int, params) -> list[tuple[str, tuple]]:
    """Normalise and check every meta before anything is opened; errors name file, tensor and field."""
    if not metas:
        raise ValueError(f"No parameter found in state dict from {path} ({LABEL}): the meta file is empty")
    planned = []
    for name, meta in metas.items():
        try:
            fixed = normalize_meta(meta, name=name, device=device)
        except MetaError as e:
            raise MetaError(f"{path}: {e}") from None
        target = params.get(name)
        if target is not None:
            _, _, _, type_idx, dims, _, _ = fixed
            apply.check_match(name, dtype_of_code(type_idx), dims, target, path)
        planned.append((name, fixed))
    return planned


def to_paddle(arr: np.ndarray) -> paddle.Tensor:
    """A Paddle tensor owning a copy of ``arr``'s bytes (bf16 and fp8 included, via a uint8 view)."""
    dtype = paddle_dtype(arr.dtype.name)
    shape = list(arr.shape)
    if arr.size == 0:
        return paddle.empty(shape, dtype=dtype)
    flat = paddle.to_tensor(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    return flat.view(dtype).reshape(shape)


def open_tensor(name: str, meta: tuple, path: str) -> paddle.Tensor:
    try:
        arr = open_tensor_meta(meta)
    except (HandleError, MetaError) as e:
        raise MetaError(f"{path}: cannot open IPC handle of tensor {name!r}: {e}") from None
    return to_paddle(arr)


def update_from_ipc_meta(manager) -> None:
    path = meta_path(manager.shared_dir, manager.gpu_id)
    planned = plan_metas(path, read_metas(path), worker_device(manager), manager.params)
    # Open everything before applying: a vanished trainer or a range outside its segment must not
    # leave half the parameters replaced. Peak host memory is one copy of the model.
    tensors = [(name, open_tensor(name, meta, path)) for name, meta in planned]
    manager.apply(tensors, LABEL, path)
    log.info("IPC update parameters completed from file: %s", path)
