"""The device stand-in's IPC side: the trainer's ``share_array`` and a CPU ``_new_shared_cuda``.

The handle format, the segments and the device rule both ends agree on are in ``wire.handles``
(re-exported here for the simulator's callers); the receiver's checks of a stored meta are in
``reference.ipc_meta``. ``open_tensor_meta`` is a complete CPU ``LoDTensor._new_shared_cuda`` for the
simulator and the unit tests; ``share_array`` is what a trainer does to publish one tensor.
"""
from __future__ import annotations

import math

from weightsync.wire.handles import (  # noqa: F401  (re-exported: the simulator's view of the transport)
    HANDLE_SIZE,
    META_FIELDS,
    PHI_DTYPE_CODES_PADDLE3,
    PREFIX,
    SHM_DIR,
    HandleError,
    Segment,
    attach_on_device,
    current_device,
    handle_name,
    leaked_segments,
    make_handle,
    phi_dtype_codes,
    set_current_device,
)


def numpy_dtype(name: str):
    """numpy dtype for a canonical dtype name (ml_dtypes for bfloat16 and fp8)."""
    import ml_dtypes
    import numpy as np

    special = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
    return np.dtype(special.get(name, name))


def dtype_of_code(type_idx) -> str | None:
    """Canonical dtype name for a phi DataType int, or None when this project does not carry it."""
    for name, code in phi_dtype_codes().items():
        if code == type_idx:
            return name
    return None


def open_tensor_meta(meta: tuple, *, device: int | None = None):
    """CPU stand-in for ``LoDTensor._new_shared_cuda(meta)``: a numpy array *copy* of the tensor.

    Like CUDA, the handle is opened on the process's current device (``device``, default
    ``FLAGS_selected_gpus``), so a meta still carrying the trainer's device_id is refused. Unlike
    CUDA, the bytes are copied and the mapping closed: Paddle on CPU cannot adopt memory mapped from
    another process's allocation, so the worker must own its copy (on GPU, FastDeploy's parameters
    alias the trainer's memory instead). The byte range is checked against the segment, since
    reading past a mapping is not an error we could report afterwards.
    """
    import numpy as np

    if not isinstance(meta, tuple) or len(meta) != len(META_FIELDS):
        got = f"{len(meta)} fields in a {type(meta).__name__}" if isinstance(meta, (tuple, list)) else type(meta).__name__
        # Paddle's own wording, plus what was wrong with it.
        raise HandleError(f"Invalid Tensor meta info for shared cuda tensor! (got {got}, expected a {len(META_FIELDS)}-field tuple)")
    handle, offset, size, type_idx, dims, _lod, device_id = meta
    if not isinstance(handle, bytes):
        raise HandleError(f"field handle must be bytes for _new_shared_cuda, got {type(handle).__name__}")
    dtype_name = dtype_of_code(type_idx)
    if dtype_name is None:
        raise HandleError(f"field type_idx {type_idx!r} is not a known phi DataType")
    dtype = numpy_dtype(dtype_name)
    if size != math.prod(dims) * dtype.itemsize:
        raise HandleError(f"field size {size} disagrees with dims {list(dims)} of {dtype_name}")
    with attach_on_device(handle, device_id, device=device) as seg:
        if offset + size > seg.size:
            raise HandleError(
                f"field offset_bytes {offset} + size {size} = {offset + size} lies outside segment "
                f"{seg.name!r} of {seg.size} bytes"
            )
        out = np.empty(dims, dtype=dtype)
        if size:
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(seg.buf[offset : offset + size], np.uint8)
    return out


def share_array(seg: "Segment", offset: int, array, *, device_id: int = 0) -> list:
    """Trainer side: copy ``array`` into ``seg`` at ``offset``; return its stored meta (FastDeploy
    format: a list, handle as a latin-1 str, empty lod)."""
    import numpy as np

    arr = np.asarray(array)
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        arr = arr.copy()
    nbytes = arr.nbytes
    if offset < 0 or offset + nbytes > seg.size:
        raise HandleError(f"{nbytes} bytes at offset {offset} do not fit segment {seg.name!r} of {seg.size} bytes")
    if nbytes:
        seg.buf[offset : offset + nbytes] = arr.reshape(-1).view(np.uint8).tobytes()
    code = phi_dtype_codes()[arr.dtype.name]
    return [seg.handle.decode("latin-1"), offset, nbytes, code, list(arr.shape), [], int(device_id)]
