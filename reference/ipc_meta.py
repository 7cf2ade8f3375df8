"""The ``ipc`` strategy: a metadata file of shared handles (fd-spec §3.3).

``{shared_dir}/ipc_metas_{id}`` (id = physical GPU id) is a ``paddle.save`` pickle of
``name -> [handle, offset_bytes, size, type_idx, dims, lod, device_id]``. The update runs in three
steps so that a bad entry changes no parameter:

1. plan (pure): read the file with no pickle globals admitted, normalise every meta (device_id
   replaced by this worker's ``FLAGS_selected_gpus``) -- the metas of names the model does not have
   included --, check dtype and shape against the model;
2. load: open the handle of every tensor the model has, check its byte range against the segment,
   copy the bytes once, straight into a Paddle tensor the worker owns, and unmap;
3. apply: one source, label ``raw``, source = the meta file path.

The receiver's checks live here; ``wire.handles`` holds only what both ends agree on (the handle
format, segments, the meta's fields and dtype codes, the device a handle opens on).
"""
from __future__ import annotations

import math
import os

import numpy as np
import paddle

from weightsync.wire.handles import HANDLE_SIZE, META_FIELDS, HandleError, attach_on_device, phi_dtype_codes

from .dtypes import ITEMSIZE, paddle_dtype
from .errors import MetaError, brief
from .host_memory import writable_bytes
from .safe_pickle import load_restricted

LABEL = "raw"


def meta_path(shared_dir: str, gpu_id: int) -> str:
    return os.path.join(shared_dir, f"ipc_metas_{gpu_id}")


def worker_device(manager) -> int:
    """The CUDA ordinal this worker opens handles on: ``FLAGS_selected_gpus`` (as the session was
    opened with), not the physical id."""
    return int(manager.env.get("FLAGS_selected_gpus", "0"))


PADDLE_NAME_TABLE = "StructuredToParameterName@@"


def read_metas(path: str) -> dict:
    """The stored dict of metas. Plain lists, strings and ints need no pickle global, so none is admitted."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"IPC metadata file {path} not found (the trainer writes ipc_metas_{{gpu id}} there)")
    obj = load_restricted(path, allow_arrays=False)
    if not isinstance(obj, dict):
        raise MetaError(f"{path}: expected a dict of tensor name -> meta, found {type(obj).__name__}")
    if isinstance(obj.get(PADDLE_NAME_TABLE), dict):  # paddle.save's own bookkeeping (an empty dict gets one)
        obj = {k: v for k, v in obj.items() if k != PADDLE_NAME_TABLE}
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise MetaError(f"{path}: tensor names must be str, found {', '.join(brief(k) for k in bad[:5])}"
                        + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return obj


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def dtype_of_code(type_idx) -> str | None:
    """Canonical dtype name of a phi DataType int (the installed Paddle's table), None when not carried."""
    if not _is_int(type_idx):
        return None
    for name, code in phi_dtype_codes().items():
        if code == type_idx:
            return name
    return None


def normalize_meta(meta, *, name: str, device: int) -> tuple:
    """A stored meta -> the checked 7-tuple ``_new_shared_cuda`` takes, device_id set to ``device``.

    FastDeploy's conversion (``meta[0].encode("latin-1")``, ``meta[6] = FLAGS_selected_gpus``), done
    without mutating ``meta`` and checked field by field. Accepted on purpose: a tuple as well as a
    list, and the handle as ``bytes`` as well as a latin-1 ``str`` (``_share_cuda()`` itself returns
    a tuple holding bytes; both spellings are unambiguous). MetaError names the tensor and field.
    """
    where = f"IPC meta of tensor {name!r}"
    if not isinstance(meta, (list, tuple)):
        raise MetaError(f"{where} is a {type(meta).__name__}, expected a list of 7 fields {list(META_FIELDS)}")
    if len(meta) != len(META_FIELDS):
        raise MetaError(
            f"{where} has {len(meta)} fields, expected 7 fields {list(META_FIELDS)} (Paddle's _share_cuda() tuple)"
        )
    handle, offset, size, type_idx, dims, lod, _trainer_device = meta
    if isinstance(handle, str):
        try:
            handle = handle.encode("latin-1")
        except UnicodeEncodeError:
            raise MetaError(f"{where}: field handle is a str with characters outside latin-1; expected the "
                            f"{HANDLE_SIZE} handle bytes decoded as latin-1") from None
    elif isinstance(handle, (bytes, bytearray)):
        handle = bytes(handle)
    else:
        raise MetaError(f"{where}: field handle is a {type(handle).__name__}, expected a latin-1 str or bytes")
    if len(handle) != HANDLE_SIZE:
        raise MetaError(f"{where}: field handle has {len(handle)} bytes, expected {HANDLE_SIZE}")
    for field, value in (("offset_bytes", offset), ("size", size)):
        if not _is_int(value) or value < 0:
            raise MetaError(f"{where}: field {field} is {brief(value)}, expected a non-negative int")
    dtype = dtype_of_code(type_idx)
    if dtype is None:
        raise MetaError(f"{where}: field type_idx is {brief(type_idx)}, not a phi DataType this loader carries {phi_dtype_codes()}")
    if not isinstance(dims, (list, tuple)) or not all(_is_int(d) and d >= 0 for d in dims):
        raise MetaError(f"{where}: field dims is {brief(dims)}, expected a list of non-negative ints")
    numel = math.prod(dims)
    want = numel * ITEMSIZE[dtype]
    if size != want:
        raise MetaError(
            f"{where}: field size is {size} bytes but dims {list(dims)} of {dtype} need {want} "
            f"({numel} x {ITEMSIZE[dtype]})"
        )
    return (handle, offset, size, type_idx, list(dims), lod, int(device))


def plan_metas(path: str, metas: dict, device: int, params) -> list[tuple[str, tuple | None]]:
    """Normalise and check every meta before anything is opened; errors name file, tensor and field.

    Every meta is checked, those of names the model does not have included (a malformed entry means a
    broken trainer); those are planned as ``None``: ignored, their handles never opened. dtype and
    shape against the model are checked by ``apply.apply_tensors``, for the whole source before any
    tensor is adopted.
    """
    planned = []  # (an empty file: manager.apply raises "No parameter found", naming the file)
    bad = []
    for name, meta in metas.items():
        try:
            fixed = normalize_meta(meta, name=name, device=device)
        except MetaError as e:  # every bad meta of the file is named, not only the first (APPLY-EVERY-PROBLEM)
            bad.append(e)
            continue
        planned.append((name, fixed if name in params else None))
    if len(bad) == 1:
        raise MetaError(f"{path}: {bad[0]}") from None
    if bad:
        raise MetaError(f"{path}: {len(bad)} bad metas: " + "; ".join(str(e) for e in bad)) from None
    return planned


def open_tensor(name: str, meta: tuple, path: str) -> paddle.Tensor:
    """Open ``meta``'s handle on its device, check the byte range, copy the bytes once into a Paddle
    tensor this worker owns, and unmap. Errors name the file, the tensor and the field."""
    handle, offset, size, type_idx, dims, _lod, device_id = meta
    dtype = paddle_dtype(dtype_of_code(type_idx))
    try:
        seg = attach_on_device(handle, device_id)
    except HandleError as e:
        raise MetaError(f"{path}: cannot open IPC handle of tensor {name!r}: {e}") from None
    with seg:
        if offset + size > seg.size:
            raise MetaError(
                f"{path}: tensor {name!r}: field offset_bytes {offset} + size {size} lies outside its segment "
                f"{seg.name!r} of {seg.size} bytes"
            )
        if size == 0:
            return paddle.empty(dims, dtype=dtype)
        flat = paddle.empty([size], dtype=paddle.uint8)
        np.copyto(writable_bytes(flat, size), np.frombuffer(seg.buf[offset : offset + size], np.uint8))
    return flat.view(dtype).reshape(dims)


def update_from_ipc_meta(manager) -> None:
    path = meta_path(manager.shared_dir, manager.gpu_id)
    planned = plan_metas(path, read_metas(path), worker_device(manager), manager.params)
    # Open everything before applying: a vanished trainer or a range outside its segment must not
    # leave half the parameters replaced. Peak host memory is one copy of the model.
    tensors, bad = [], []
    for name, meta in planned:
        try:
            tensors.append((name, None if meta is None else open_tensor(name, meta, path)))
        except MetaError as e:  # every handle that cannot be opened or read is named
            bad.append(e)
    if len(bad) > 1:
        raise MetaError(f"{len(bad)} metas of {path} cannot be read: " + "; ".join(str(e) for e in bad))
    if bad:
        raise bad[0]
    manager.apply(tensors, LABEL, path)  # (logs "Updated n/m parameters from raw source {path}")
