"""Digests of tensors and of whole models, computed the same way by the trainer and by the receiver.

SPEC.md § DIGEST is the normative description; this module is its executable form, and the one module
both ends import: the simulator's trainer digests what it sends, the reference's ``WeightManager``
digests what landed. It needs numpy and xxhash only; a Paddle tensor is recognised without importing
Paddle (a process that never imported Paddle holds none), so a trainer stays free of it.

- The debug digest is FastDeploy's (fd-spec §4.3): ``shape=[..], dtype=.., nbytes=.., md5=.., sum=..``,
  MD5 over the raw bytes in C order.
- The model digest: per tensor, a hash of its name, dtype, shape and bytes (C order, little-endian);
  for the model, a hash of every tensor's digest in name order. XXH3-128 (fast) and MD5 side by side.

Bytes are hashed where they lie: a C-contiguous array or a CPU tensor is read through a memoryview
of its own memory, never copied; only a non-contiguous or byte-swapped array is copied into C order.
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


# -- bytes in C order, without copying -------------------------------------------------------------
def _paddle_tensor_type():
    paddle = sys.modules.get("paddle")  # not imported: the object cannot be a Paddle tensor
    return getattr(paddle, "Tensor", None)


def is_paddle_tensor(obj) -> bool:
    cls = _paddle_tensor_type()
    return cls is not None and isinstance(obj, cls)


@dataclass(frozen=True)
class HostBytes:
    """A tensor's dtype name, shape and bytes in C order. ``owner`` keeps the memory alive as long
    as ``view`` is used (a temporary host copy of a device tensor)."""

    dtype: str
    shape: tuple[int, ...]
    view: memoryview
    owner: object = None


def _paddle_bytes(name: str, t) -> HostBytes:
    dtype = str(t.dtype).removeprefix("paddle.")
    shape = tuple(int(d) for d in t.shape)
    if math.prod(shape) == 0:  # no allocation to read (and never "initialized" in Paddle)
        return HostBytes(dtype, shape, memoryview(b""))
    if not t._is_initialized():
        raise ValueError(f"tensor {name!r} ({dtype}{list(shape)}) holds no data: it is not loaded")
    if not t.place.is_cpu_place():
        t = t.cpu()
    t = t.contiguous()  # a no-op (the same tensor) when it already is
    nbytes = math.prod(shape) * t.element_size()
    view = memoryview((ctypes.c_uint8 * nbytes).from_address(t.data_ptr())).cast("B")
    return HostBytes(dtype, shape, view, t)


def _numpy_bytes(name: str, a) -> HostBytes:
    a = np.asarray(a)
    if a.dtype.hasobject:
        raise ValueError(f"tensor {name!r} holds Python objects ({a.dtype}), not numbers: it has no bytes to digest")
    shape = tuple(a.shape)
    if a.dtype.byteorder == ">":  # big-endian data on this little-endian host: digest the values little-endian
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)  # copies only a non-contiguous (e.g. transposed) array
    return HostBytes(a.dtype.name, shape, memoryview(a.reshape(-1).view(np.uint8)), a)


def host_bytes(name: str, tensor) -> HostBytes:
    """Dtype name (``bfloat16``, ``float8_e4m3fn``...), shape and C-order bytes of a numpy array or a
    Paddle tensor (a device tensor is copied to the host first)."""
    if is_paddle_tensor(tensor):
        return _paddle_bytes(name, tensor)
    return _numpy_bytes(name, tensor)


# -- the model digest ------------------------------------------------------------------------------
def _hashers(algorithms: Iterable[str]) -> dict:
    algorithms = tuple(algorithms)
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise ValueError(f"digest algorithms {list(algorithms)}: choose one or more of {list(ALGORITHMS)}")
    return {a: ALGORITHMS[a]() for a in algorithms}


def tensor_header(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """What precedes a tensor's bytes in its digest: name, dtype and shape, each NUL-terminated."""
    if "\0" in name:
        raise ValueError(f"tensor name {name!r} contains a NUL byte")
    return b"%s\0%s\0%s\0" % (name.encode("utf-8"), dtype.encode("ascii"), ",".join(map(str, shape)).encode("ascii"))


@dataclass(frozen=True)
class TensorDigest:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    hashes: Mapping[str, str]  # algorithm -> hex digest


def tensor_digest(name: str, tensor, algorithms: Iterable[str] = DEFAULT_ALGORITHMS) -> TensorDigest:
    hashers = _hashers(algorithms)
    data = host_bytes(name, tensor)
    header = tensor_header(name, data.dtype, data.shape)
    for h in hashers.values():
        h.update(header)
        h.update(data.view)
    return TensorDigest(name, data.dtype, data.shape, data.view.nbytes, {a: h.hexdigest() for a, h in hashers.items()})


@dataclass(frozen=True)
class ModelDigest:
    tensors: Mapping[str, TensorDigest]
    hashes: Mapping[str, str]  # algorithm -> hex digest of the whole model

    def as_dict(self) -> dict:
        """Plain data (msgpack/JSON): ``{"model": {alg: hex}, "tensors": {name: {alg: hex}}}``."""
        return {"model": dict(self.hashes), "tensors": {n: dict(t.hashes) for n, t in self.tensors.items()}}


def combine(tensor_hashes: Mapping[str, str], algorithm: str) -> str:
    """The model's digest from its tensors' digests of one algorithm: every ``name NUL hex LF``, in
    ascending order of name, hashed with that algorithm."""
    h = ALGORITHMS[algorithm]()
    for name in sorted(tensor_hashes):
        h.update(b"%s\0%s\n" % (name.encode("utf-8"), tensor_hashes[name].encode("ascii")))
    return h.hexdigest()


def model_digest(tensors: Mapping | Iterable, algorithms: Iterable[str] = DEFAULT_ALGORITHMS) -> ModelDigest:
    """Digest of every (name, tensor) pair; a name given twice is a ValueError."""
    algorithms = tuple(algorithms)
    _hashers(algorithms)  # validate once, before any tensor is read
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out: dict[str, TensorDigest] = {}
    for name, tensor in items:
        if name in out:
            raise ValueError(f"tensor {name!r} given twice")
        out[name] = tensor_digest(name, tensor, algorithms)
    return ModelDigest(out, {a: combine({n: t.hashes[a] for n, t in out.items()}, a) for a in algorithms})


def differences(sent: Mapping, landed: Mapping) -> list[str]:
    """Names whose digests differ between two ``as_dict()`` digests (a name on one side only counts),
    then ``"(model)"`` if the model digests differ; only algorithms both sides computed are compared."""
    names = sorted(set(sent["tensors"]) | set(landed["tensors"]))
    out = [n for n in names if _differ(sent["tensors"].get(n), landed["tensors"].get(n))]
    if _differ(sent["model"], landed["model"]):
        out.append("(model)")
    return out


def _differ(a: Mapping | None, b: Mapping | None) -> bool:
    if a is None or b is None:
        return True
    common = set(a) & set(b)
    return not common or any(a[k] != b[k] for k in common)


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
    array = np.ascontiguousarray(array)
    try:
        total = float(array.astype("float32").sum())
    except Exception:  # noqa: BLE001 (FastDeploy reports None for any failure)
        total = None
    md5 = hashlib.md5(memoryview(array.reshape(-1).view(np.uint8))).hexdigest()
    return {"shape": shape, "dtype": dtype, "nbytes": int(array.nbytes), "md5": md5, "sum": total}


def format_debug_digest(digest: Mapping) -> str:
    return (f"shape={digest['shape']}, dtype={digest['dtype']}, nbytes={digest['nbytes']}, "
            f"md5={digest['md5']}, sum={digest['sum']}")
