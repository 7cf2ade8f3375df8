"""Mutants that live where two modes meet (issue 30, "Modes crossing rules"): a loader right in each mode its
author tried and wrong in a crossing of them (staged and an unknown name, the draft model and a count, a strided
parameter and the digest, a buffer swapped under the same parameter object and the recapture). Each rule's cases
are generated over every pair of its declared modes (SPEC.md ``Modes:`` lines, ``conformance.modes``), which is
what kills these: most of them survive the hand-picked cases the rules had before (issue 30).

Patches follow tests/mutants/base.py: module attributes the reference looks up at call time (a class replaced by
a subclass where the bug sits in a method).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import types

import paddle

from reference import apply as _apply
from reference import commit as _commit
from reference import digest as _digest
from reference import manager as _manager
from reference import storage as _storage
from reference import transforms as _transforms

from .base import Mutant

_real_apply_tensors = _apply.apply_tensors
_real_adopt = _apply.adopt
_real_moved = _storage.moved
_real_recapture = _storage.recapture
_real_after_load = _transforms.after_load
_real_tensor_hashes = _digest.paddle_tensor_hashes
_manager_log = logging.getLogger("reference.manager")


def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


@contextlib.contextmanager
def _replaced(module, attr, value):
    real = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, real)


def _draft_routed(name: str) -> bool:
    """A name a loader that routes by prefix sends to the draft model: its first component is ``mtp``."""
    return name.split(".")[0] == "mtp"


def _main_names(manager) -> set[str]:
    return set(manager.model_list[0].state_dict())


# -- unknown names (APPLY-UNKNOWN-IGNORED, APPLY-UNKNOWN-REPORTED) ----------------------------------------------
class _IgnoredFilter(logging.Filter):
    """Rewrites or drops the manager's report of ignored tensors: ``keep(names)`` -> the names still reported."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def filter(self, record):
        if not (isinstance(record.msg, str) and record.msg.startswith("Ignored ")):
            return True
        count, source, names = record.args
        kept = self.keep(names.split(", "))
        if not kept:
            return False
        record.args = (len(kept), source, ", ".join(kept))
        return True


class UnknownUnreportedWhenStaged(Mutant):
    id = "unknown_unreported_when_staged"
    bug = ("a staged update lands the known tensors and drops the rest without a word: the stage returns no list "
           "of ignored names (only the default mode's apply reports them), so a drifted trainer under staged "
           "updates shows nowhere")
    kills = frozenset({"APPLY-UNKNOWN-REPORTED"})

    def patches(self):
        class Stage(_commit.Stage):
            def apply(self, targets, tensors, source):
                applied, seen, _unknown = super().apply(targets, tensors, source)
                return applied, seen, []

        return {"reference.commit.Stage": Stage}


class UnknownKeptByStage(Mutant):
    id = "unknown_kept_by_stage"
    bug = ("the stage keeps every tensor of a source, known or not, and the commit looks each one up among the "
           "parameters: a tensor under a name no parameter takes is ignored in the default mode and a KeyError at "
           "a staged commit")
    kills = frozenset({"APPLY-UNKNOWN-IGNORED"})

    def patches(self):
        class Stage(_commit.Stage):
            def apply(self, targets, tensors, source):
                tensors = list(tensors)
                applied, seen, unknown = super().apply(targets, tensors, source)
                self.tensors.update((name, t) for name, t in tensors if name in unknown)
                return applied, seen, unknown

            def commit(self, targets):
                with paddle.no_grad():
                    for name, tensor in self.tensors.items():
                        _apply.adopt(name, tensor, targets[name])

        return {"reference.commit.Stage": Stage}


class UnknownDraftNamesRefused(Mutant):
    id = "unknown_draft_names_refused"
    bug = ("names under the draft model's prefix (`mtp.`) are routed to the draft model, which must have them: one "
           "it lacks (a scale, a second MTP model the engine does not run) fails the update, where the main model's "
           "strangers are ignored")
    kills = frozenset({"APPLY-UNKNOWN-IGNORED"})

    def patches(self):
        def apply_tensors(targets, tensors, source, land=None):
            tensors = list(tensors)
            lacking = [name for name, _ in tensors if name not in targets and _draft_routed(name)]
            if lacking:
                raise KeyError(f"the draft model has no parameter {lacking[0]} (from {source})")
            return _real_apply_tensors(targets, tensors, source, land=land)

        return {"reference.apply.apply_tensors": apply_tensors}


class UnknownDraftNamesUnreported(Mutant):
    id = "unknown_draft_names_unreported"
    bug = ("names under the draft model's prefix are the draft loader's business: the main loader's report of "
           "ignored tensors leaves them out, so a draft checkpoint whose names drifted goes unseen")
    kills = frozenset({"APPLY-UNKNOWN-REPORTED"})

    def patches(self):
        def apply_tensors(targets, tensors, source, land=None):
            applied, seen, unknown = _real_apply_tensors(targets, tensors, source, land=land)
            return applied, seen, [name for name in unknown if not _draft_routed(name)]

        return {"reference.apply.apply_tensors": apply_tensors}


class UnknownReportedAtFirstLoadOnly(Mutant):
    id = "unknown_reported_at_first_load_only"
    bug = ("the ignored tensors are reported by the start-up check of the first load only (\"the names cannot "
           "change afterwards\"): a trainer whose names drift at a later update goes unseen")
    kills = frozenset({"APPLY-UNKNOWN-REPORTED"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def apply(self, tensors, label, source):
                if self.first_load:
                    return super().apply(tensors, label, source)
                quiet = _IgnoredFilter(lambda names: [])
                _manager_log.addFilter(quiet)
                try:
                    return super().apply(tensors, label, source)
                finally:
                    _manager_log.removeFilter(quiet)

        return _manager_patch(Manager)


class UnknownReportedOncePerName(Mutant):
    id = "unknown_reported_once_per_name"
    bug = ("each ignored name is reported once per session (a set of names already warned about, to keep the log "
           "short): the same drifted name at every later update is silent")
    kills = frozenset({"APPLY-UNKNOWN-REPORTED"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def apply(self, tensors, label, source):
                told = self.__dict__.setdefault("_told", set())

                def keep(names):
                    new = [n for n in names if n not in told]
                    told.update(names)
                    return new

                once = _IgnoredFilter(keep)
                _manager_log.addFilter(once)
                try:
                    return super().apply(tensors, label, source)
                finally:
                    _manager_log.removeFilter(once)

        return _manager_patch(Manager)


class UnknownRefusedOnceLoaded(Mutant):
    id = "unknown_refused_once_loaded"
    bug = ("strangers are tolerated at the first load (a checkpoint may carry an optimizer's state) and refused "
           "afterwards (\"the trainer's names are known by now\"): every later update of a source with an extra "
           "tensor fails")
    kills = frozenset({"APPLY-UNKNOWN-IGNORED"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def apply(self, tensors, label, source):
                tensors = list(tensors)
                strangers = [name for name, _ in tensors if name not in self.params]
                if strangers and not self.first_load:
                    raise ValueError(f"{source or label}: tensors no parameter takes: {', '.join(strangers)}")
                return super().apply(tensors, label, source)

        return _manager_patch(Manager)


# -- what an update owes (APPLY-COUNT-MATCHES, APPLY-MISSING-FAILS, APPLY-EMPTY-REFUSED) -------------------------
class StagedTrustedComplete(Mutant):
    id = "staged_trusted_complete"
    bug = ("a staged update is taken as complete: every tensor was checked when it landed, so the verification "
           "asks the stage, which answers for every parameter: a staged update short of a parameter commits NORMAL "
           "with that parameter unloaded")
    kills = frozenset({"APPLY-COUNT-MATCHES", "APPLY-MISSING-FAILS", "DRAFT-NOT-STALE"})

    def patches(self):
        # The manager's verification of a staged update asks which parameters the stage's tensors carry
        # (reference.manager.finalize: ties.missing over the stage): answered "none missing".
        answers_all = types.SimpleNamespace(missing=lambda params, present: [])
        return {"reference.manager.ties": answers_all}


class FirstLoadUnverified(Mutant):
    id = "first_load_unverified"
    bug = ("the first load is not verified (\"the engine's warm-up checks the start-up weights\"): a first update "
           "short of a parameter serves NORMAL with it unloaded; every later update is verified")
    kills = frozenset({"APPLY-COUNT-MATCHES", "APPLY-MISSING-FAILS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                if not self.first_load:
                    return super().finalize()
                with _replaced(_apply, "unloaded", lambda params: []):
                    return super().finalize()

        return _manager_patch(Manager)


class VerifyMainModelOnly(Mutant):
    id = "verify_main_model_only"
    bug = ("the verification walks the main model's parameters (the one model a loader without a draft has): a "
           "draft parameter no source carried is never found missing, and the draft serves unloaded under NORMAL")
    kills = frozenset({"APPLY-COUNT-MATCHES", "APPLY-MISSING-FAILS", "DRAFT-NOT-STALE"})

    def patches(self):
        real_unloaded = _apply.unloaded

        class Manager(_manager.WeightManager):
            def finalize(self):
                main = _main_names(self)
                with _replaced(_apply, "unloaded", lambda params: [n for n in real_unloaded(params) if n in main]):
                    return super().finalize()

        return _manager_patch(Manager)


class CountSentMainModelOnly(Mutant):
    id = "count_sent_main_model_only"
    bug = ("a whole update is taken to owe the main model's parameters: the count a short update reports leaves the "
           "draft model out (`3 of 3` for a model and draft of four, one missing)")
    kills = frozenset({"APPLY-COUNT-MATCHES"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def landed_of_sent(self, landed, sent=None, verb="landed"):
                if sent is None:
                    sent = len(_main_names(self))
                    landed = min(landed, sent)
                return super().landed_of_sent(landed, sent, verb)

        return _manager_patch(Manager)


class MissingUnnamedWhenStaged(Mutant):
    id = "missing_unnamed_when_staged"
    bug = ("a staged update short of a parameter fails with the stage's own error, which counts what landed and "
           "names nothing (\"staged update incomplete\"): which parameter the trainer did not send is lost")
    kills = frozenset({"APPLY-MISSING-FAILS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                if self._stage is None:
                    return super().finalize()
                missing = [n for n in _apply.unloaded(self.params) if not self._stage.holds(n)]
                if missing:
                    raise RuntimeError(f"staged update incomplete: {self.landed_of_sent(len(self.params) - len(missing))}")
                return super().finalize()

        return _manager_patch(Manager)


def _empty_swallowed(when):
    """``reference.snapshot.update_from_snapshot`` and ``reference.ipc_meta.update_from_ipc_meta`` with a source of
    no tensor taken as nothing to do when ``when(manager)``: the update goes on to its commit."""
    from reference import ipc_meta, snapshot

    def wrap(real):
        def update(manager):
            try:
                return real(manager)
            except ValueError as e:
                if "No parameter found" in str(e) and when(manager):
                    return None
                raise
        return update

    return {"reference.snapshot.update_from_snapshot": wrap(snapshot.update_from_snapshot),
            "reference.ipc_meta.update_from_ipc_meta": wrap(ipc_meta.update_from_ipc_meta)}


class EmptyFirstLoadAccepted(Mutant):
    id = "empty_first_load_accepted"
    bug = ("a first load whose source holds nothing is taken as 'nothing new' (the engine's own start-up weights "
           "stand): into an engine's allocated weights it reports success, having loaded nothing")
    kills = frozenset({"APPLY-EMPTY-REFUSED"})

    def patches(self):
        return _empty_swallowed(lambda manager: manager.first_load)


class EmptyStagedAccepted(Mutant):
    id = "empty_staged_accepted"
    bug = ("a staged update adds each source's tensors to the stage and leaves judging to the commit: a source of "
           "no tensor adds nothing and is no error, so into loaded weights a staged update of nothing commits and "
           "reports success")
    kills = frozenset({"APPLY-EMPTY-REFUSED"})

    def patches(self):
        return _empty_swallowed(lambda manager: manager._stage is not None)


# -- the draft model (DRAFT-*) --------------------------------------------------------------------------------
class StagedCommitMainOnly(Mutant):
    id = "staged_commit_main_only"
    bug = ("a staged update commits its stage into the main model (the model the loader was written for): the "
           "draft's staged tensors are checked, counted and dropped, and after a clear the draft serves unloaded "
           "under NORMAL")
    kills = frozenset({"DRAFT-PAIR-UPDATED"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                stage = self._stage
                if stage is not None:
                    main, real = _main_names(self), stage.commit

                    def commit(targets):
                        stage.tensors = {n: t for n, t in stage.tensors.items() if n in main}
                        real(targets)

                    stage.commit = commit
                return super().finalize()

        return _manager_patch(Manager)


# -- the model digest (DIGEST-MODEL-*) ---------------------------------------------------------------------------
def _hashes_of_memory(name, t, algorithms):
    """The tensor's bytes as they lie in its memory, from its address on (no copy, no reorder)."""
    dtype = str(t.dtype).removeprefix("paddle.")
    shape = tuple(int(d) for d in t.shape)
    count = math.prod(shape)
    if count == 0 or not t._is_initialized():
        return _real_tensor_hashes(name, t, algorithms)
    data = (ctypes.c_uint8 * (count * t.element_size())).from_address(t.data_ptr())
    return _digest.tensor_hashes(name, dtype, shape, data, algorithms)


class DigestMemoryOrder(Mutant):
    id = "digest_memory_order"
    bug = ("the digest hashes each parameter's memory as it lies (its bytes from its address on, the fast path of a "
           "contiguous tensor): a column-major FP8 scale is hashed transposed, and its digest is not the trainer's C-order "
           "one")
    kills = frozenset({"DIGEST-MODEL-LANDED", "DIGEST-MODEL-SENSITIVE"})

    def patches(self):
        return {"reference.digest.paddle_tensor_hashes": _hashes_of_memory}


class DigestContiguousInPlace(Mutant):
    id = "digest_contiguous_in_place"
    bug = ("the digest reads a strided parameter through `t.contiguous()`, which Paddle 3.3 applies to the tensor it "
           "is called on: the digest is right, but the parameter is row-major in new memory afterwards, under the "
           "engine's captured graphs and kernels that read its strides (the reference's own bug until issue 30)")
    kills = frozenset({"DIGEST-MODEL-LANDED"})

    def patches(self):
        def paddle_tensor_hashes(name, t, algorithms):
            if t._is_initialized() and math.prod(t.shape):
                t = t.cpu().contiguous()
            return _real_tensor_hashes(name, t, algorithms)

        return {"reference.digest.paddle_tensor_hashes": paddle_tensor_hashes}


class DigestCachedUntilClear(Mutant):
    id = "digest_cached_until_clear"
    bug = ("the model digest is cached and the cache dropped by clear() (\"weights change only after a clear\"): an "
           "update in place (rsync, GDR) leaves the digest of the version before")
    kills = frozenset({"DIGEST-MODEL-LANDED", "DIGEST-MODEL-SENSITIVE"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def digest(self, *args, **kwargs):
                if getattr(self, "_cached", None) is None:
                    self._cached = super().digest(*args, **kwargs)
                return self._cached

            def clear(self, *args, **kwargs):
                self._cached = None
                return super().clear(*args, **kwargs)

        return _manager_patch(Manager)


class DigestMainModelOnly(Mutant):
    id = "digest_main_model_only"
    bug = ("the model digest covers the main model (the one the trainer's digest was first written for): the draft's "
           "tensors are neither digested nor checked for being loaded")
    kills = frozenset({"DIGEST-MODEL-LANDED", "DIGEST-MODEL-INCOMPLETE"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def digest(self, algorithms=_digest.DEFAULT_ALGORITHMS):
                main = _main_names(self)
                return _digest.paddle_model_digest(((n, p) for n, p in self.params.items() if n in main), algorithms)

        return _manager_patch(Manager)


class DigestDraftOnce(Mutant):
    id = "digest_draft_once"
    bug = ("the draft model's tensor digests are computed once and kept (\"the draft is a copy of the main model's "
           "head\"): after the next update the draft's part of the digest describes the old weights")
    kills = frozenset({"DIGEST-MODEL-LANDED", "DIGEST-MODEL-SENSITIVE"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def digest(self, algorithms=_digest.DEFAULT_ALGORITHMS):
                fresh = super().digest(algorithms)
                main = _main_names(self)
                kept = self.__dict__.setdefault("_draft_digests", {})
                tensors = dict(fresh.tensors)
                for name in tensors:
                    if name not in main:
                        tensors[name] = kept.setdefault(name, tensors[name])
                return _digest.model_digest(tensors, algorithms)

        return _manager_patch(Manager)


# -- storage under captured graphs (MODEL-STORAGE-KEPT) ----------------------------------------------------------
class RecaptureByIdentity(Mutant):
    id = "recapture_by_identity"
    bug = ("a parameter counts as moved when it is another parameter object than before, or held no memory: a buffer "
           "swapped under the same object (an engine's loader doing `_share_buffer_to` or `param.data = ...`) keeps "
           "its object, and the graphs captured on its old memory are not recaptured")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        def moved(before, params):
            out = []
            for name, p in params.items():
                if math.prod(p.shape) == 0 or not p._is_initialized():
                    continue
                was = before.get(name)
                if was is None or was[1] is None or was[0] != id(p):
                    out.append(name)
            return sorted(out)

        return {"reference.storage.moved": moved}


class RecaptureOnlyAfterClear(Mutant):
    id = "recapture_only_after_clear"
    bug = ("the recapture is asked for only when the update began from cleared weights (the loader's own in-place "
           "writes never move memory, so it does not look): memory an engine's loader moved during an update in place "
           "stays uncaptured")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        def recapture(manager):
            before = manager._storage_before or {}
            if before and any(was[1] is None for was in before.values()):
                _real_recapture(manager)

        return {"reference.storage.recapture": recapture}


class RecaptureMainModelOnly(Mutant):
    id = "recapture_main_model_only"
    bug = ("the recapture names the main model's moved parameters (its graphs are the runner's; the draft's are the "
           "proposer's, and forgotten): after a clear the draft's graphs read freed memory")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        def recapture(manager):
            hook, before = manager.commit_options.recapture, manager._storage_before
            if hook is None or before is None:
                return
            main = _main_names(manager)
            names = [n for n in _real_moved(before, manager.params) if n in main]
            if names:
                hook(names)

        return {"reference.storage.recapture": recapture}


class RecaptureSkippedAtFirstLoad(Mutant):
    id = "recapture_skipped_at_first_load"
    bug = ("no recapture at the first load (\"the engine captures its graphs after start-up\"): graphs captured on "
           "the engine's placeholders read freed memory once a first update moved them")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        def recapture(manager):
            if not manager.first_load:
                _real_recapture(manager)

        return {"reference.storage.recapture": recapture}


class StridedReallocatedInPlace(Mutant):
    id = "strided_reallocated_in_place"
    bug = ("a strided target is always given fresh memory in its own layout before the copy (the #6722 fix applied "
           "whether or not the target was cleared), and the recapture is tied to the clear: a first load into an "
           "engine's strided placeholders moves them under the captured graphs unrecaptured")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        def adopt(name, new, target):
            if (target._is_initialized() and math.prod(target.shape)
                    and list(new.contiguous().stride()) != list(target.stride())):
                _apply.allocate_strided(target)
                target[...] = new.contiguous()
                return
            _real_adopt(name, new, target)

        def recapture(manager):
            before = manager._storage_before or {}
            if before and all(was[1] is None for was in before.values()):
                _real_recapture(manager)

        return {"reference.apply.adopt": adopt, "reference.storage.recapture": recapture}


class RecaptureBeforeTransforms(Mutant):
    id = "recapture_before_transforms"
    bug = ("the graphs are recaptured once the weights are loaded and verified, before the post-load steps, and the "
           "transpose swaps its result in (FastDeploy's process_weight_transpose): the transposed weight moves after "
           "the recapture that named it")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        def transpose(t):
            new = None
            if math.prod(t.served):
                axes = list(range(len(t.loaded)))
                new = paddle.transpose(t.param, axes[:-2] + [axes[-1], axes[-2]]).contiguous()
            _transforms._set_shape(t.param, t.served)
            if new is not None:
                new._share_buffer_to(t.param)

        def after_load(post):
            pending.append(post)

        def recapture(manager):
            _real_recapture(manager)
            while pending:
                _real_after_load(pending.pop())

        pending: list = []
        return {"reference.transforms.transpose": transpose, "reference.transforms.after_load": after_load,
                "reference.storage.recapture": recapture}


# -- strided targets (APPLY-STRIDED-TARGET, APPLY-STRIDED-CLEARED) ----------------------------------------------
class StagedCommitShares(Mutant):
    id = "staged_commit_shares"
    bug = ("the staged tensors are fresh copies the loader owns, so the commit adopts each zero-copy "
           "(`_share_buffer_to`) whatever the target's strides: a staged update serves a column-major FP8 scale "
           "transposed, where the default mode copies into its layout")
    kills = frozenset({"APPLY-STRIDED-TARGET", "APPLY-STRIDED-CLEARED"})

    def patches(self):
        class Stage(_commit.Stage):
            def commit(self, targets):
                with paddle.no_grad():
                    for name, tensor in self.tensors.items():
                        if math.prod(targets[name].shape):
                            tensor.contiguous()._share_buffer_to(targets[name])

        return {"reference.commit.Stage": Stage}


class DraftSetStateDict(Mutant):
    id = "draft_set_state_dict"
    bug = ("the draft model's tensors are set with `param.set_value(array)` of their host copy (the proposer's own "
           "`set_state_dict` way): Paddle rewrites a strided parameter row-major, so the draft's column-major scales "
           "lose their layout where the main model's keep it")
    kills = frozenset({"APPLY-STRIDED-TARGET", "APPLY-STRIDED-CLEARED"})

    def patches(self):
        def adopt(name, new, target):
            if _draft_routed_any(name) and math.prod(target.shape):
                target.set_value(new.contiguous().numpy())
                return
            _real_adopt(name, new, target)

        return {"reference.apply.adopt": adopt}


def _draft_routed_any(name: str) -> bool:
    """A draft name as the suite's draft models spell them (``mtp.``, ``mtp_block.``, MTP layer 2)."""
    first = name.split(".")[0]
    return first.startswith("mtp") or name.startswith("model.layers.2.")


class StagedPickleAdoptsEarly(Mutant):
    id = "staged_pickle_adopts_early"
    bug = ("a staged update stages what it reads from safetensors, but the shared fallback's paddle.save pickle is "
           "read whole into memory and adopted at once, as the default mode does: a staged update of a pickle that "
           "then fails leaves every parameter read before the failure loaded")
    kills = frozenset({"STAGE-ATOMIC"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def apply(self, tensors, label, source):
                if self._stage is None or self.load_strategy != "ipc_snapshot" or not str(source).startswith(
                        str(self.shared_dir)):
                    return super().apply(tensors, label, source)
                stage, self._stage = self._stage, None
                try:
                    return super().apply(tensors, label, source)
                finally:
                    self._stage = stage

        return _manager_patch(Manager)
