"""Mutants of the digests (SPEC.md § DIGEST): a digest that misses what it should see, or a debug line
that is not FastDeploy's. Each patches ``reference.digest`` (looked up at call time) or the manager."""
from __future__ import annotations

import hashlib

import numpy as np
import xxhash

from reference import apply as _apply
from reference import digest as _digest
from reference import manager as _manager

from .base import Mutant

_tensor_hashes = _digest.tensor_hashes
_header = _digest.tensor_header
_debug = _digest.debug_digest
_paddle_model_digest = _digest.paddle_model_digest
LANDED, SENSITIVE, INCOMPLETE = "DIGEST-MODEL-LANDED", "DIGEST-MODEL-SENSITIVE", "DIGEST-MODEL-INCOMPLETE"
DEBUG, EDGE = "DIGEST-DEBUG-FORMAT", "DIGEST-DEBUG-EDGE"
FLOATS = {"float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


def _rehashed(transform):
    """``tensor_hashes`` over ``transform(dtype, bytes)`` instead of the tensor's bytes."""
    def tensor_hashes(name, dtype, shape, data, algorithms):
        return _tensor_hashes(name, dtype, shape, transform(dtype, bytes(memoryview(data).cast("B"))), algorithms)

    return {"reference.digest.tensor_hashes": tensor_hashes}


class DigestOmitsDtype(Mutant):
    id = "digest_omits_dtype"
    bug = "the tensor digest hashes name, shape and bytes but not the dtype: bf16 and fp16 of the same bits digest alike"
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        return {"reference.digest.tensor_header": lambda name, dtype, shape: _header(name, "", shape)}


class DigestOmitsShape(Mutant):
    id = "digest_omits_shape"
    bug = "the tensor digest hashes name, dtype and bytes but not the shape: [16, 16] and [8, 32] digest alike"
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        return {"reference.digest.tensor_header": lambda name, dtype, shape: _header(name, dtype, ())}


class DigestOmitsName(Mutant):
    id = "digest_omits_name"
    bug = "the tensor digest hashes dtype, shape and bytes only (a content hash): two tensors with the same bytes share it"
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        return {"reference.digest.tensor_header": lambda name, dtype, shape: _header("", dtype, shape)}


class DigestSamplesBytes(Mutant):
    id = "digest_samples_bytes"
    bug = ("a 'fast' digest of large tensors: the first and last 64 bytes of a tensor longer than 256 bytes, so a "
           "change in the middle goes unseen")
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        return _rehashed(lambda dtype, data: data if len(data) <= 256 else data[:64] + data[-64:])


class DigestSamplesLargeTensors(Mutant):
    id = "digest_samples_large_tensors"
    bug = ("a digest that samples tensors above 1 MiB (the first and the last 512 KiB, and the length): exact for "
           "every small tensor, blind to a change in the middle of a large one")
    kills = frozenset({SENSITIVE})

    def patches(self):
        half = 512 << 10

        def sample(dtype, data):
            return data if len(data) <= 2 * half else data[:half] + data[-half:] + len(data).to_bytes(8, "little")

        return _rehashed(sample)


class DigestCanonicalValues(Mutant):
    id = "digest_canonical_values"
    bug = ("values canonicalised before hashing so that equal values digest alike: every NaN made the same NaN and "
           "-0.0 made +0.0, so a NaN payload or a sign bit that changed goes unseen")
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        from fixtures.models import NUMPY_DTYPES

        def canonical(dtype, data):
            if dtype not in FLOATS:
                return data
            dt = NUMPY_DTYPES[dtype]
            values = np.frombuffer(data, dt).astype(np.float32)
            values = np.where(np.isnan(values), np.float32(np.nan), values + np.float32(0.0))
            return values.astype(dt).tobytes()

        return _rehashed(canonical)


class DigestCaptureOrder(Mutant):
    id = "digest_model_capture_order"
    bug = "the model digest combines tensor digests in the order the model lists them, not by name"
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        def combine(tensors, algorithm):
            h = _digest.ALGORITHMS[algorithm]()
            for name in tensors:
                h.update(b"%s\0%s\n" % (name.encode(), tensors[name][algorithm].encode()))
            return h.hexdigest()

        return {"reference.digest.combine": combine}


class DigestXxh64(Mutant):
    id = "digest_xxh3_64"
    bug = "XXH3's 64-bit variant where the spec says XXH3-128: the digests never match a trainer that follows the spec"
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        return {"reference.digest.ALGORITHMS": {"xxh3": xxhash.xxh3_64, "md5": hashlib.md5}}


class DigestMd5IsXxh3(Mutant):
    id = "digest_md5_is_xxh3"
    bug = "the MD5 column computed with XXH3 (one hasher constructor copied for both algorithms)"
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        return {"reference.digest.ALGORITHMS": {"xxh3": xxhash.xxh3_128, "md5": xxhash.xxh3_128}}


class DigestCached(Mutant):
    id = "digest_cached"
    bug = "the model digest is computed once per session and cached: after the next update it describes the old weights"
    kills = frozenset({LANDED, SENSITIVE})

    def patches(self):
        class Manager(_manager.WeightManager):
            def digest(self, *args, **kwargs):
                if not hasattr(self, "_cached"):
                    self._cached = super().digest(*args, **kwargs)
                return self._cached

        return _manager_patch(Manager)


class DigestOfLoadedOnly(Mutant):
    id = "digest_of_loaded_only"
    bug = "the model digest skips parameters that are not loaded, so a cleared or half-loaded model still gets a digest"
    kills = frozenset({INCOMPLETE})

    def patches(self):
        class Manager(_manager.WeightManager):
            def digest(self, algorithms=_digest.DEFAULT_ALGORITHMS):
                return _paddle_model_digest(((n, p) for n, p in self.params.items() if _apply.is_loaded(p)), algorithms)

        return _manager_patch(Manager)


class DigestEmptyUnloaded(Mutant):
    id = "digest_empty_is_unloaded"
    bug = ("'loaded' read as Paddle's _is_initialized(), which a zero-element parameter never is: the digest of a "
           "loaded model with an empty tensor is refused")
    kills = frozenset({LANDED, SENSITIVE, INCOMPLETE})

    def patches(self):
        class Manager(_manager.WeightManager):
            def digest(self, algorithms=_digest.DEFAULT_ALGORITHMS):
                missing = [n for n, p in self.params.items() if not p._is_initialized()]
                if missing:
                    raise RuntimeError(f"cannot digest: not loaded: {', '.join(missing)}")
                return super().digest(algorithms)

        return _manager_patch(Manager)


# -- the debug digest ----------------------------------------------------------------------------
class DebugCanonicalDtype(Mutant):
    id = "debug_canonical_dtype"
    bug = "the debug line prints a Paddle tensor's dtype without its prefix (bfloat16, not paddle.bfloat16)"
    kills = frozenset({DEBUG})

    def patches(self):
        def debug_digest(tensor):
            d = _debug(tensor)
            return {**d, "dtype": d["dtype"].removeprefix("paddle.")}

        return {"reference.digest.debug_digest": debug_digest}


class DebugSumFloat64(Mutant):
    id = "debug_sum_float64"
    bug = "the debug sum accumulated in float64 (more exact, not FastDeploy's): [1e8, 1, -1e8, 1] sums to 2.0, not 1.0"
    kills = frozenset({DEBUG})

    def patches(self):
        def debug_digest(tensor):
            d = _debug(tensor)
            if d["sum"] is not None:
                arr = np.asarray(tensor.numpy() if _digest.is_paddle_tensor(tensor) else tensor)
                d["sum"] = float(np.ascontiguousarray(arr).astype(np.float64).sum())
            return d

        return {"reference.digest.debug_digest": debug_digest}


class DebugSumOfValues(Mutant):
    id = "debug_sum_of_values"
    bug = ("the debug sum of a Paddle bf16/fp8 tensor taken over its values (astype float32 in Paddle), where "
           "FastDeploy sums the bit patterns .numpy() returns: the lines differ between the two")
    kills = frozenset({DEBUG})

    def patches(self):
        def debug_digest(tensor):
            d = _debug(tensor)
            if _digest.is_paddle_tensor(tensor) and d["nbytes"]:
                d["sum"] = float(tensor.astype("float32").numpy().sum())
            return d

        return {"reference.digest.debug_digest": debug_digest}


class DebugMemoryOrder(Mutant):
    id = "debug_memory_order"
    bug = "the debug MD5 taken over the array's memory as it lies (a transposed view in column order), not C order"
    kills = frozenset({DEBUG, EDGE})

    def patches(self):
        def debug_digest(tensor):
            d = _debug(tensor)
            if not _digest.is_paddle_tensor(tensor):
                arr = np.asarray(tensor)
                raw = arr.ravel(order="K").view(np.uint8) if arr.size else np.empty(0, np.uint8)
                d["md5"] = hashlib.md5(raw.tobytes()).hexdigest()
            return d

        return {"reference.digest.debug_digest": debug_digest}


class DebugMemoryviewCast(Mutant):
    id = "debug_memoryview_cast"
    bug = ("FastDeploy's own hashing, md5(memoryview(array).cast('B')): a TypeError on a zero-element tensor and a "
           "ValueError on a bf16/fp8 numpy array")
    kills = frozenset({EDGE})

    def patches(self):
        def debug_digest(tensor):
            d = _debug(tensor)
            arr = np.ascontiguousarray(np.asarray(tensor.numpy() if _digest.is_paddle_tensor(tensor) else tensor))
            hashlib.md5(memoryview(arr).cast("B"))  # raises where FastDeploy's does
            return d

        return {"reference.digest.debug_digest": debug_digest}
