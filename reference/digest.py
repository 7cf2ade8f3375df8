"""Digests of tensors and of whole models, defined once for the trainer and the receiver.

SPEC.md § DIGEST is the normative description; this module is its executable form and the one both ends
import: the simulator's trainer digests what it sends (``sim.trainer.state_digest``: numpy arrays
to C-order little-endian bytes, then :func:`tensor_hashes`), the reference's ``WeightManager`` digests
what landed (:func:`paddle_model_digest`). It needs numpy and xxhash only; a Paddle tensor is recognised
without importing Paddle (a process that never imported Paddle holds none), so a trainer stays free of it.

- The model digest: per tensor, XXH3-128 and MD5 over its name, dtype and shape (each NUL-terminated)
  then its bytes in C order, little-endian; for the model, each algorithm over ``name NUL hex LF`` of
  every tensor in name order.
- The debug digest is FastDeploy's (fd-spec §4.3): ``shape=[..], dtype=.., nbytes=.., md5=.., sum=..``,
  MD5 over the raw bytes in C order.

Bytes are hashed where they lie: a CPU tensor through a view of its own allocation, never copied.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import xxhash

ALGORITHMS = {"xxh3": xxhash.xxh3_128, "md5": hashlib.md5}
DEFAULT_ALGORITHMS = ("xxh3", "md5")


def is_paddle_tensor(obj) -> bool:
    paddle = sys.modules.get("paddle")  # not imported: the object cannot be a Paddle tensor
    return paddle is not None and isinstance(obj, paddle.Tensor)


# -- the model digest ------------------------------------------------------------------------------
def tensor_header(name: str, dtype: str, shape) -> bytes:
    """What precedes a tensor's bytes in its digest: name, dtype and shape, each NUL-terminated."""
    return b"%s\0%s\0%s\0" % (name.encode(), dtype.encode(), ",".join(map(str, shape)).encode())


def tensor_hashes(name: str, dtype: str, shape, data, algorithms: Iterable[str]) -> dict[str, str]:
    """algorithm -> hex digest of one tensor; ``data`` is its bytes in C order, little-endian (any
    buffer, hashed in place)."""
    header = tensor_header(name, dtype, shape)
    out = {}
    for algorithm in algorithms:
        h = ALGORITHMS[algorithm]()
        h.update(header)
        h.update(data)
        out[algorithm] = h.hexdigest()
    return out


def paddle_tensor_hashes(name: str, t, algorithms: Iterable[str]) -> dict[str, str]:
    """:func:`tensor_hashes` of a Paddle tensor, read in place (a CPU tensor is its own host copy).
    A tensor that holds no data (not loaded) is a RuntimeError naming it; a zero-element one holds none
    and has nothing to load."""
    dtype = str(t.dtype).removeprefix("paddle.")
    shape = tuple(int(d) for d in t.shape)
    count = math.prod(shape)
    if count == 0:
        return tensor_hashes(name, dtype, shape, b"", algorithms)
    if not t._is_initialized():
        raise RuntimeError(f"no digest of a model that is not loaded: parameter {name!r} ({dtype}{list(shape)}) holds no data")
    t = t.cpu()  # the same tensor when it is on the CPU
    if not t.is_contiguous():
        # A strided parameter (a column-major FP8 scale) is read in C order from a copy: ``t.contiguous()`` would
        # make the parameter itself row-major, in new memory (Paddle 3.3 changes the tensor it is called on).
        t = t.clone()
    data = (ctypes.c_uint8 * (count * t.element_size())).from_address(t.data_ptr())
    return tensor_hashes(name, dtype, shape, data, algorithms)


def combine(tensors: Mapping[str, Mapping[str, str]], algorithm: str) -> str:
    """The model's digest of one algorithm: ``name NUL hex LF`` of every tensor, in name order, hashed."""
    h = ALGORITHMS[algorithm]()
    for name in sorted(tensors):
        h.update(b"%s\0%s\n" % (name.encode(), tensors[name][algorithm].encode()))
    return h.hexdigest()


@dataclass(frozen=True)
class ModelDigest:
    tensors: Mapping[str, Mapping[str, str]]  # name -> algorithm -> hex
    model: Mapping[str, str]  # algorithm -> hex

    def as_dict(self) -> dict:
        """Plain data (msgpack/JSON): ``{"model": {alg: hex}, "tensors": {name: {alg: hex}}}``."""
        return {"model": dict(self.model), "tensors": {n: dict(h) for n, h in self.tensors.items()}}


def model_digest(tensors: Mapping[str, Mapping[str, str]], algorithms: Iterable[str]) -> ModelDigest:
    """The model digest from every tensor's :func:`tensor_hashes`."""
    return ModelDigest(dict(tensors), {a: combine(tensors, a) for a in algorithms})


def paddle_model_digest(params: Iterable, algorithms: Iterable[str]) -> ModelDigest:
    """The model digest of (name, Paddle tensor) pairs: what a receiver holds."""
    algorithms = tuple(algorithms)
    return model_digest({name: paddle_tensor_hashes(name, t, algorithms) for name, t in params}, algorithms)


# -- FastDeploy's debug digest ---------------------------------------------------------------------
def debug_digest(tensor) -> dict:
    """FastDeploy's ``_tensor_debug_digest``: shape and dtype as the tensor reports them
    (``paddle.bfloat16`` for a Paddle tensor, numpy's name otherwise), then of the host array
    (``tensor.numpy()`` for Paddle: bf16 comes back as uint16 bits, fp8 as int8) in C order: nbytes,
    the MD5 of its raw bytes and ``float(array.astype("float32").sum())`` (None if that fails).
    Unlike FastDeploy's, it digests zero-element tensors and ml_dtypes arrays (bf16, fp8) too."""
    if is_paddle_tensor(tensor):
        shape, dtype = list(tensor.shape), str(tensor.dtype)
        array = np.asarray(tensor.numpy())
    else:
        array = np.asarray(tensor)
        shape, dtype = list(array.shape), str(array.dtype)
    array = np.ascontiguousarray(array)  # at least 1-d, so that it has a uint8 view
    try:
        total = float(array.astype("float32").sum())
    except Exception:  # noqa: BLE001 (FastDeploy reports None for any failure)
        total = None
    return {"shape": shape, "dtype": dtype, "nbytes": int(array.nbytes), "md5": hashlib.md5(array.view(np.uint8)).hexdigest(),
            "sum": total}


def format_debug_digest(digest: Mapping) -> str:
    return (f"shape={digest['shape']}, dtype={digest['dtype']}, nbytes={digest['nbytes']}, "
            f"md5={digest['md5']}, sum={digest['sum']}")
