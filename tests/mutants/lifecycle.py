"""Mutants of validation, apply, the manager lifecycle and memory (SPEC.md APPLY, LIFE, MEM): bugs an
outside implementer plausibly writes, each caught by the cases of conformance/test_apply.py,
test_lifecycle.py and test_memory.py (positions first/middle/last, every source, every aftermath).

Patches follow tests/mutants/snapshot.py: module attributes looked up at call time, or a
``WeightManager`` subclass put where the adapter builds it.
"""
from __future__ import annotations

import math

import numpy as np
import paddle

from reference import apply as _apply
from reference import manager as _manager
from reference import snapshot_plan
from reference.dtypes import ITEMSIZE, dtype_name
from reference.status import Status

from .base import Mutant

_real_apply_tensors = _apply.apply_tensors
_real_check_match = _apply.check_match
_real_mismatch = _apply.mismatch
_real_list_dir = snapshot_plan.list_dir


def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


# -- validation ---------------------------------------------------------------------------------
class ValidateOnlyFirstTensor(Mutant):
    id = "validate_only_first_tensor"
    bug = ("dtype/shape checked on the first tensor of each file only (a sanity probe of the file's "
           "layout): a mismatch in any later tensor is adopted as is")
    kills = frozenset({"APPLY-DTYPE-MISMATCH", "APPLY-SHAPE-MISMATCH", "APPLY-DTYPE-BEFORE-SHAPE", "APPLY-VALIDATE-FIRST"})

    def patches(self):
        first: dict = {}

        def mismatch(name, src_dtype, src_shape, dst, source=""):  # (every path's validation asks apply.mismatch)
            if first.setdefault(source, name) == name:
                return _real_mismatch(name, src_dtype, src_shape, dst, source)
            return None

        return {"reference.apply.mismatch": mismatch}


class ByteLengthCompare(Mutant):
    id = "byte_length_compare"
    bug = ("a tensor is accepted when its byte length equals the parameter's (what a raw buffer copy "
           "needs): same-itemsize dtypes (bf16/fp16, int32/fp32, uint8/bool/fp8) and same-size shapes "
           "([4,4] vs [16], transposed) are reinterpreted, and a size difference is a ValueError even when "
           "the dtype is wrong")
    kills = frozenset({"APPLY-DTYPE-MISMATCH", "APPLY-SHAPE-MISMATCH", "APPLY-DTYPE-BEFORE-SHAPE", "APPLY-VALIDATE-FIRST"})

    def patches(self):
        def nbytes(dtype, shape):
            return math.prod(shape) * ITEMSIZE[dtype]

        def check_match(name, src_dtype, src_shape, dst, source=""):
            if nbytes(src_dtype, tuple(src_shape)) != nbytes(dtype_name(dst), tuple(dst.shape)):
                raise ValueError(f"Size mismatch for {name}: {src_dtype}{list(src_shape)} vs {dtype_name(dst)}{list(dst.shape)}")

        def apply_tensors(targets, tensors, source):
            def reinterpret():
                for name, t in tensors:
                    target = targets.get(name)
                    if target is not None and (t.dtype != target.dtype or tuple(t.shape) != tuple(target.shape)):
                        check_match(name, dtype_name(t), t.shape, target, source)
                        t = t.view(target.dtype).reshape(target.shape) if t.dtype != target.dtype else t.reshape(target.shape)
                    yield name, t

            return _real_apply_tensors(targets, reinterpret(), source)

        return {"reference.apply.check_match": check_match, "reference.apply.apply_tensors": apply_tensors}


class _NoPrecheck:
    """``reference.apply`` as the snapshot strategy sees it, minus the header pre-check."""

    def __getattr__(self, attr):
        if attr == "check_match":
            return lambda *args, **kwargs: None
        return getattr(_apply, attr)


class ValidateWhileApplying(Mutant):
    id = "validate_while_applying"
    bug = ("each tensor validated just before it is adopted, with no pass over the headers first "
           "(FastDeploy's _update_model_from_state, fd-spec rule 17): a mismatch in the last tensor or the "
           "last part leaves every earlier one applied")
    kills = frozenset({"APPLY-VALIDATE-FIRST"})

    def patches(self):
        def apply_tensors(targets, tensors, source):
            applied = seen = 0
            unknown = []
            with paddle.no_grad():
                for name, tensor in tensors:
                    seen += 1
                    target = targets.get(name)
                    if target is None:
                        unknown.append(name)
                        continue
                    _apply.check_match(name, dtype_name(tensor), tensor.shape, target, source)
                    _apply.adopt(name, tensor, target)
                    applied += 1
            return applied, seen, unknown

        return {"reference.snapshot.apply": _NoPrecheck(), "reference.apply.apply_tensors": apply_tensors}


class UnknownPrefixStripped(Mutant):
    id = "unknown_prefix_stripped"
    bug = ("training-side names are mapped by stripping a leading 'model.' (HF -> serving names) before "
           "lookup: an unknown 'model.norm.bias' of another dtype is validated against norm.bias and fails "
           "the update, one that fits overwrites the real parameter")
    kills = frozenset({"APPLY-UNKNOWN-IGNORED"})

    def patches(self):
        def apply_tensors(targets, tensors, source):
            def renamed():
                for name, t in tensors:
                    short = name.removeprefix("model.")
                    yield (short if short in targets else name), t

            return _real_apply_tensors(targets, renamed(), source)

        return {"reference.apply.apply_tensors": apply_tensors}


class LargeTensorTailDropped(Mutant):
    id = "large_tensor_tail_dropped"
    bug = ("tensors over 128 KiB are copied in 64 KiB chunks and the last, partial chunk is dropped (an "
           "off-by-one in the chunk count): small tensors are exact, large ones end in zeros")
    kills = frozenset({"APPLY-ROUNDTRIP-DTYPES"})

    def patches(self):
        chunk = 64 << 10

        def apply_tensors(targets, tensors, source):
            def chunked():
                for name, t in tensors:
                    nbytes = math.prod(t.shape) * ITEMSIZE[dtype_name(t)]
                    if nbytes > 2 * chunk and dtype_name(t) in ("float32", "uint8", "int64", "float64", "int32"):
                        arr = np.ascontiguousarray(t.numpy()).copy()
                        arr.reshape(-1).view(np.uint8)[(nbytes // chunk) * chunk :] = 0
                        t = paddle.to_tensor(arr)
                    yield name, t

            return _real_apply_tensors(targets, chunked(), source)

        return {"reference.apply.apply_tensors": apply_tensors}


# -- verification and status ------------------------------------------------------------------------
class VerifyByIsInitialized(Mutant):
    id = "verify_by_is_initialized"
    bug = ("the update is verified with param._is_initialized() alone (FastDeploy's _verify_parameters): "
           "Paddle never marks a zero-element tensor initialized, so a snapshot with a [0, 4] parameter "
           "always fails as 'missing'")
    kills = frozenset({"APPLY-ROUNDTRIP-DTYPES"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                missing = [n for n, p in self.params.items() if not p._is_initialized()]
                if missing:
                    raise RuntimeError("Model Parameter update verification failed: not loaded: " + ", ".join(missing))
                self.status = Status.NORMAL

        return _manager_patch(Manager)


class MissingFirstNameOnly(Mutant):
    id = "missing_first_name_only"
    bug = "the verification error names only the first missing parameter (raise on the first one found)"
    kills = frozenset({"APPLY-MISSING-FAILS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                missing = _apply.unloaded(self.params)
                if missing:
                    raise RuntimeError(f"Model Parameter update verification failed: {missing[0]} not loaded")
                self.status = Status.NORMAL

        return _manager_patch(Manager)


class NormalBeforeVerify(Mutant):
    id = "normal_before_verify"
    bug = ("status written NORMAL as soon as the last source is applied, before the verification that "
           "then raises: a snapshot missing parameters fails but reads as success")
    kills = frozenset({"APPLY-MISSING-FAILS", "LIFE-FAILED-NOT-NORMAL"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                self.status = Status.NORMAL
                super().finalize()

        return _manager_patch(Manager)


class ClearStaysClearing(Mutant):
    id = "clear_stays_clearing"
    bug = ("clear() writes CLEARING and never CLEARED (the final status write forgotten); update() accepts "
           "CLEARING, so loading works, but a trainer polling for CLEARED waits forever")
    kills = frozenset({"LIFE-STATUS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def clear(self):
                super().clear()
                self.status = Status.CLEARING

            def update(self):
                if self.status == Status.CLEARING:
                    self.status = Status.CLEARED
                super().update()

        return _manager_patch(Manager)


class StickyFailure(Mutant):
    id = "sticky_failure"
    bug = ("a failed update sets a 'broken' flag that clear() never resets: every later update re-raises "
           "the old error, so a fixed snapshot can only be loaded by restarting the engine")
    kills = frozenset({"LIFE-RECOVERY"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                if self.last_error is not None:
                    raise RuntimeError(f"previous update failed: {self.last_error}")
                super().update()

        return _manager_patch(Manager)


class MtpOnlyFirstUpdate(Mutant):
    id = "mtp_only_first_update"
    bug = ("the MTP draft model is loaded by the first update only (as the runner's load_model does); "
           "later updates apply and verify model_list[0] alone, so after clear() + update() the draft has "
           "no weights and nothing says so (fd-spec §1.3, 'a draft model left on old weights')")
    kills = frozenset({"APPLY-MTP-LOADED", "LIFE-RELOAD-LATEST", "LIFE-RECOVERY"})

    def patches(self):
        class Manager(_manager.WeightManager):
            _loaded_once = False

            def _main_only(self):
                main = set(self.model_list[0].state_dict())
                return {n: p for n, p in self.params.items() if n in main}

            def apply(self, tensors, label, source):
                if not self._loaded_once:
                    return super().apply(tensors, label, source)
                full, self.params = self.params, self._main_only()
                try:
                    return super().apply(tensors, label, source)
                finally:
                    self.params = full

            def finalize(self):
                if not self._loaded_once:
                    super().finalize()
                    self._loaded_once = True
                    return
                full, self.params = self.params, self._main_only()
                try:
                    super().finalize()
                finally:
                    self.params = full

        return _manager_patch(Manager)


# -- listing and memory ----------------------------------------------------------------------------
class ListingCached(Mutant):
    id = "listing_cached"
    bug = ("the snapshot directory is listed once, at the first update, and the listing reused: when the "
           "trainer writes another number of parts (or switches between parts and one file) the loader "
           "opens files that are gone and misses new ones")
    kills = frozenset({"LIFE-RELOAD-LATEST"})

    def patches(self):
        cache: dict = {}

        def list_dir(path):
            if path not in cache:
                cache[path] = _real_list_dir(path)
            return cache[path]

        return {"reference.snapshot.list_dir": list_dir}


class HoldsAllParts(Mutant):
    id = "holds_all_parts"
    bug = ("every part is read into one merged state dict before anything is applied (the pre-#6852 "
           "loader), and each tensor is then copied into its parameter: the host peak is about twice the "
           "model, whatever the number of parts")
    kills = frozenset({"MEM-SNAPSHOT-PEAK"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                self._staged = []
                try:
                    super().update()
                finally:
                    self._staged = []

            def apply(self, tensors, label, source):
                items = list(tensors)
                if not items:
                    raise ValueError(f"No parameter found in state dict from {source or label} ({label})")
                self._staged.extend(items)
                self.trace.append(_manager.LoadEvent(label, source, sum(n in self.params for n, _ in items), len(items)))
                return len(items)

            def finalize(self):
                staged = self._staged
                _apply.apply_tensors(self.params, ((n, t.clone()) for n, t in staged), "merged state dict")
                super().finalize()

        return _manager_patch(Manager)


class HoldsEverySource(Mutant):
    id = "holds_every_source"
    bug = ("every source is read before any is applied, and applied at the end without a copy (each known tensor "
           "adopted as it is): when every tensor is the model's this costs no more than the model, but the tensors "
           "no parameter takes, of every file, stay alive until the last file is read")
    kills = frozenset({"MEM-SNAPSHOT-PEAK"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                self._sources = []
                try:
                    super().update()
                finally:
                    self._sources = []

            def apply(self, tensors, label, source):
                items = list(tensors)
                if not items:
                    raise ValueError(f"No parameter found in state dict from {source or label} ({label})")
                self._sources.append((items, source or label))
                self.trace.append(_manager.LoadEvent(label, source, sum(n in self.params for n, _ in items), len(items)))
                return len(items)

            def finalize(self):
                held, self._sources = self._sources, []
                for items, source in held:
                    _real_apply_tensors(self.params, items, source)
                del held, items
                super().finalize()

        from .gaps import _reads_every_tensor

        return {**_manager_patch(Manager), **_reads_every_tensor()}


class FailureForAnotherReason(Mutant):
    id = "failed_update_raises_its_own_crash"
    bug = ("the error path of update() crashes while it logs the failure (an attribute of a source that was never "
           "opened), so every failed update raises an AttributeError that names nothing: the status and the version "
           "stay right, but the operator never learns which tensor, file or field was at fault")
    kills = frozenset({"LIFE-FAILED-NOT-NORMAL", "LIFE-RECOVERY", "MODEL-TRANSFORM-FAILED", "MODEL-HOOKS",
                       "VER-FAILED-KEEPS", "STAGE-ATOMIC", "STREAM-NO-LEAK"})
    zoo_args = ("-k", "not test_multirank")  # the single-process tests of these rules are enough

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                try:
                    return super().update()
                except Exception:
                    raise AttributeError("'NoneType' object has no attribute 'name'") from None

        return _manager_patch(Manager)


class TraceAccumulates(Mutant):
    id = "trace_accumulates"
    bug = ("the list of applied sources is created once per session and never reset: after the second update "
           "the trace still lists the first update's files, so an operator reads stale provenance")
    kills = frozenset({"LIFE-RELOAD-LATEST"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                earlier = list(self.trace)
                try:
                    super().update()
                finally:
                    self.trace[:0] = earlier

        return _manager_patch(Manager)


# -- every update, not only the first (LIFE-EVERY-UPDATE) ------------------------------------------------
class CommitFirstLoadOnly(Mutant):
    id = "commit_first_load_only"
    bug = ("the commit (verification, the ranks' agreement, the version, NORMAL) runs for the first load only, "
           "as checkpoint-engine's barrier held for the first update only: later updates land their bytes and "
           "never commit, so the worker stays UPDATING")
    kills = frozenset({"LIFE-EVERY-UPDATE"})
    zoo_args = ("-k", "every_update")

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                if self.first_load:
                    super().finalize()

        return _manager_patch(Manager)


class SnapshotPlannedOnce(Mutant):
    id = "snapshot_planned_once"
    bug = ("the snapshot's files are planned at the first load and the plan kept for the run (the file set taken "
           "as fixed): a later update with another part count reads parts that are gone and misses new ones")
    kills = frozenset({"LIFE-EVERY-UPDATE"})
    zoo_args = ("-k", "every_update")

    def patches(self):
        from reference import snapshot as _snapshot

        real, plans = _snapshot.plan_snapshot, {}

        def plan_snapshot(model_dir, listing, shared_dir, shared_listing, rank, gpu_id):
            key = (model_dir, shared_dir, rank, gpu_id)
            if key not in plans:
                plans[key] = real(model_dir, listing, shared_dir, shared_listing, rank, gpu_id)
            return plans[key]

        return {"reference.snapshot.plan_snapshot": plan_snapshot}


class StreamFillsEmptyOnly(Mutant):
    id = "stream_fills_empty_only"
    bug = ("the streamed update writes only parameters that hold nothing (the bootstrap load's rule applied to "
           "every update): the first load lands, every in-place update after it changes nothing")
    kills = frozenset({"LIFE-EVERY-UPDATE"})
    zoo_args = ("-k", "every_update")

    def patches(self):
        from reference import rsync as _rsync

        real = _rsync.store

        def store(received, params, bootstrap):
            real({k: t for k, t in received.items() if not params[k]._is_initialized()}, params, bootstrap)

        return {"reference.rsync.store": store}


# -- ignored names reported (APPLY-UNKNOWN-REPORTED) ---------------------------------------------------
class _IgnoredReport:
    """``reference.manager.log`` with its report of ignored tensors rewritten by ``rewrite(args)``: None
    drops to DEBUG, else the new (format, *args) at WARNING; every other record as it was."""

    def __init__(self, rewrite):
        self.rewrite = rewrite

    def warning(self, msg, *args, **kwargs):
        if isinstance(msg, str) and msg.startswith("Ignored "):
            new = self.rewrite(args)
            if new is None:
                return _manager.log.debug(msg, *args, **kwargs)
            return _manager.log.warning(*new, **kwargs)
        return _manager.log.warning(msg, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(_manager.log, name)


class UnknownNamesAtDebug(Mutant):
    id = "unknown_names_at_debug"
    bug = "ignored tensors are logged at DEBUG, one line each, as FastDeploy does: a drifted name goes unseen"
    kills = frozenset({"APPLY-UNKNOWN-REPORTED"})
    zoo_args = ("-k", "unknown_names")

    def patches(self):
        return {"reference.manager.log": _IgnoredReport(lambda args: None)}


class UnknownNamesFirstOnly(Mutant):
    id = "unknown_names_first_only"
    bug = "the warning names the first ignored tensor only ('3 tensors ignored, e.g. X'): the others go unseen"
    kills = frozenset({"APPLY-UNKNOWN-REPORTED"})
    zoo_args = ("-k", "unknown_names")

    def patches(self):
        def rewrite(args):
            count, source, names = args
            return ("%d tensor(s) ignored from %s, e.g. %s", count, source, names.split(", ")[0])

        return {"reference.manager.log": _IgnoredReport(rewrite)}


class UnknownNamesCounted(Mutant):
    id = "unknown_names_counted"
    bug = "the warning gives how many tensors were ignored, not which: the operator cannot tell what drifted"
    kills = frozenset({"APPLY-UNKNOWN-REPORTED"})
    zoo_args = ("-k", "unknown_names")

    def patches(self):
        return {"reference.manager.log": _IgnoredReport(lambda args: ("%d tensor(s) ignored from %s", args[0], args[1]))}


class StagedIgnoresTies(Mutant):
    id = "staged_ignores_ties"
    bug = ("a staged update's completeness check counts the staged names only: a tied alias the source does not carry "
           "(lm_head.weight, sharing embed.weight's storage) reads as missing, and every staged update of a model with "
           "a tie fails (found by the MODEL rules' staged cases)")
    kills = frozenset({"MODEL-TIED", "MODEL-FORWARD"})
    zoo_args = ("-k", "staged")

    def patches(self):
        import types

        return {"reference.manager.ties": types.SimpleNamespace(
            missing=lambda params, present: [name for name in params if name not in set(present)])}
