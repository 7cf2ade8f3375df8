"""Loading for ``ipc_snapshot``: bytes on disk to Paddle tensors, one file at a time.

``read_header`` looks at names, dtypes and shapes without materialising data, so the manager can
validate every file of a plan before it changes any parameter. ``iter_tensors`` yields one tensor
at a time; the caller keeps at most one file's tensors alive.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import paddle
import safetensors

from .dtypes import SAFETENSORS_TO_NAME, paddle_dtype
from .errors import SnapshotFormatError
from .safe_pickle import load_restricted

# paddle.save adds this bookkeeping entry next to the tensors; it is not a parameter.
PADDLE_NAME_TABLE = "StructuredToParameterName@@"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]


def _open(path: str):
    size = os.path.getsize(path)
    if size == 0:
        raise SnapshotFormatError(f"{path}: file is empty (0 bytes), expected a safetensors snapshot")
    try:
        return safetensors.safe_open(path, framework="paddle")
    except Exception as e:  # SafetensorError for bad headers, truncated data, bad offsets
        raise SnapshotFormatError(f"{path}: not a valid safetensors file ({e})") from None


def read_header(path: str) -> list[TensorInfo]:
    """Names, dtypes and shapes of a safetensors file; SnapshotFormatError if unreadable."""
    with _open(path) as f:
        infos = []
        for name in f.keys():
            sl = f.get_slice(name)
            raw = sl.get_dtype()
            if raw not in SAFETENSORS_TO_NAME:
                raise SnapshotFormatError(f"{path}: tensor {name!r} has dtype {raw}, which Paddle cannot hold")
            infos.append(TensorInfo(name, SAFETENSORS_TO_NAME[raw], tuple(sl.get_shape())))
        return infos


def iter_safetensors(path: str) -> Iterator[tuple[str, paddle.Tensor]]:
    """Yield (name, tensor) from a safetensors file, each tensor owning its memory."""
    with _open(path) as f:
        for name in f.keys():
            sl = f.get_slice(name)
            shape = list(sl.get_shape())
            if 0 in shape:
                # safetensors' Paddle bridge fails to view a 0-byte buffer; build it directly.
                yield name, paddle.empty(shape, dtype=paddle_dtype(SAFETENSORS_TO_NAME[sl.get_dtype()]))
                continue
            try:
                # get_tensor returns a view of the file's mmap, never read until used: copy it so the
                # parameter owns its memory and a trainer rewriting or truncating the file in place
                # cannot change or SIGBUS it. The view dies here; the mapping goes when f closes.
                yield name, f.get_tensor(name).clone()
            except Exception as e:
                raise SnapshotFormatError(f"{path}: cannot read tensor {name!r} ({e})") from None


def load_pickle_state_dict(path: str) -> dict[str, paddle.Tensor]:
    """Read a ``paddle.save`` state dict without executing anything but array reconstruction."""
    obj = load_restricted(path, allow_arrays=True)
    if not isinstance(obj, dict):
        raise SnapshotFormatError(f"{path}: expected a dict of arrays, found {type(obj).__name__}")
    out = {}
    for name, value in obj.items():
        if name == PADDLE_NAME_TABLE:
            continue
        if not isinstance(value, np.ndarray):
            raise SnapshotFormatError(f"{path}: entry {name!r} is {type(value).__name__}, expected an array")
        # paddle.save stores bfloat16 as uint16 bits; paddle.to_tensor maps uint16 back to bfloat16,
        # exactly as paddle.load does.
        out[name] = paddle.to_tensor(value)
    return out
