"""Mutants of issue 17's "gaps found by broken loaders written outside the project": for each class of bug
the earlier cases let through, a variant that the sharpened case must fail (and the earlier one did not).

- ipc metas in tuple form on a worker whose device is not 0 (IPC-META-TUPLE);
- host memory when the files carry tensors no parameter takes (MEM-SNAPSHOT-PEAK);
- the model digest of tensors above 1 MiB changed only in the middle (DIGEST-MODEL-SENSITIVE);
- a version given to a failed update and stamped on a later update that carries none (VER-FAILED-KEEPS);
- CLEARED published before every rank cleared (MR-AGREE-BEFORE-NORMAL, multirank tier).
"""
from __future__ import annotations

import os

from reference import apply as _apply
from reference import commit as _commit
from reference import digest as _digest
from reference import ipc_meta as _ipc_meta
from reference import manager as _manager
from reference.status import Status

from .base import Mutant

_tensor_hashes = _digest.tensor_hashes
_normalize = _ipc_meta.normalize_meta
_real_apply_tensors = _apply.apply_tensors


def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


def _rehashed(transform):
    """``tensor_hashes`` over ``transform(bytes)`` instead of the tensor's bytes."""
    def tensor_hashes(name, dtype, shape, data, algorithms):
        return _tensor_hashes(name, dtype, shape, transform(bytes(memoryview(data).cast("B"))), algorithms)

    return {"reference.digest.tensor_hashes": tensor_hashes}


# -- digests ---------------------------------------------------------------------------------------
class DigestSamplesAbove4MiB(Mutant):
    id = "gaps_digest_samples_above_4mib"
    bug = ("a model digest that samples only tensors above 4 MiB (the first and last 512 KiB, and the length): exact "
           "for tensors of a few MiB, blind to a change in the middle of a large weight")
    kills = frozenset({"DIGEST-MODEL-SENSITIVE"})

    def patches(self):
        half = 512 << 10

        def sample(data):
            return data if len(data) <= 4 << 20 else data[:half] + data[-half:] + len(data).to_bytes(8, "little")

        return _rehashed(sample)


# -- versions --------------------------------------------------------------------------------------
class _RefusedVersionPendingManager(_manager.WeightManager):
    """The version read from version.yaml is recorded as pending before it is compared with the reported one;
    the error handler forgets it after a failed load, but a refusal of the version itself comes first."""

    @property
    def _pending_version(self):
        return self.__dict__.get("_recorded_version")

    @_pending_version.setter
    def _pending_version(self, version):
        if version is not None:  # the reset at the start of an update is lost: only a commit consumes it
            self.__dict__["_recorded_version"] = version

    def announce(self, version):
        if version is None:
            return
        self.__dict__["_recorded_version"] = version  # recorded first ...
        try:
            _commit.check_forward(version, self.version, f"{self.load_strategy} update on rank {self.rank}")
        except ValueError:
            self.__dict__["_refused"] = True  # ... and left there when the comparison refuses it
            raise

    def update(self):
        try:
            return super().update()
        except BaseException:
            if not self.__dict__.pop("_refused", False):
                self.__dict__["_recorded_version"] = None  # a failed load forgets its version
            raise

    def finalize(self):
        committed = self._committed
        super().finalize()
        if self._committed and not committed:
            self.__dict__["_recorded_version"] = None  # consumed by this commit


class RefusedVersionStampedLater(Mutant):
    id = "gaps_refused_version_stamped_later"
    bug = ("the version of version.yaml is recorded as pending before it is compared with the reported one, and only "
           "a failed load forgets it: an update refused as older leaves its version pending, and the next update that "
           "carries none (no version.yaml) is stamped with it, so the reported version goes back")
    kills = frozenset({"VER-FAILED-KEEPS"})

    def patches(self):
        return _manager_patch(_RefusedVersionPendingManager)


# -- ipc metas -------------------------------------------------------------------------------------
class TupleDeviceFromEnvironment(Mutant):
    id = "gaps_ipc_tuple_device_from_environment"
    bug = ("metas stored as tuples (what _share_cuda() returns) go through a conversion of their own, which asks the "
           "environment for FLAGS_selected_gpus when it rebuilds the tuple, while a list's device_id is set to the "
           "device the worker started on: a tuple's handle opens on whatever ordinal the environment names at the "
           "update, not the worker's")
    kills = frozenset({"IPC-META-TUPLE"})

    def patches(self):
        def normalize(meta, *, name, device):
            if isinstance(meta, tuple):
                device = int(os.environ.get("FLAGS_selected_gpus", "0"))
            return _normalize(meta, name=name, device=device)

        return {"reference.ipc_meta.normalize_meta": normalize}


# -- host memory -----------------------------------------------------------------------------------
class _KeepsUnknownManager(_manager.WeightManager):
    """Each source is applied as it is read, but the tensors no parameter takes are kept until the update
    ends, in case a later model claims them (the names alone would do for the report)."""

    def update(self):
        self._unclaimed = []
        try:
            return super().update()
        finally:
            self._unclaimed = []

    def apply(self, tensors, label, source):
        kept = []

        def watched():
            for name, tensor in tensors:
                if name not in self.params:
                    kept.append((name, tensor))
                yield name, tensor

        try:
            return super().apply(watched(), label, source)
        finally:
            self._unclaimed.extend(kept)


class KeepsUnclaimedTensors(Mutant):
    id = "gaps_keeps_unclaimed_tensors"
    bug = ("every source is applied as it is read, but the tensors no parameter takes are kept, with their data, until "
           "the update ends (for a model that might claim them later, or for the report): the host holds every file's "
           "unknown tensors at once beside the model")
    kills = frozenset({"MEM-SNAPSHOT-PEAK"})

    def patches(self):
        return {**_manager_patch(_KeepsUnknownManager), **_reads_every_tensor()}


def _reads_every_tensor():
    """The snapshot path reading every tensor of a file, the model's or not (as most loaders do: a file is read
    whole), where the reference reads only the model's (``iter_safetensors(wanted=...)``): without it a mutant that
    keeps what no parameter takes would keep names, not data."""
    from reference import snapshot_load

    real = snapshot_load.iter_safetensors

    def iter_safetensors(path, expect=None, wanted=None):
        return real(path, expect=expect)

    return {"reference.snapshot.iter_safetensors": iter_safetensors}


# -- ranks: CLEARED before every rank cleared (multirank tier) --------------------------------------
class _AgreesBeforeReleasingManager(_manager.WeightManager):
    def clear(self, publish=True):
        self.status = Status.CLEARING
        self.agreement.require_all("clear")  # "clearing": the peers are told before this rank released anything
        agree = self.agreement.require_all
        self.agreement.require_all = lambda what: None if what == "clear" else agree(what)
        try:
            return super().clear(publish)
        finally:
            del self.agreement.require_all


class AgreesBeforeReleasing(Mutant):
    id = "gaps_rank_agrees_before_releasing"
    bug = ("each rank tells its peers it is clearing (the barrier of the clear) before it releases its parameters, and "
           "rank 0 writes CLEARED once every rank has said so: the cell reads CLEARED while a rank still holds its "
           "weights (a rank held at the start of its clear, before the barrier, shows nothing)")
    kills = frozenset({"MR-AGREE-BEFORE-NORMAL"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return _manager_patch(_AgreesBeforeReleasingManager)


class _FollowerKeepsWeightsManager(_manager.WeightManager):
    def clear(self, publish=True):
        if self.commit_options.tp_rank(self.rank, self.agreement.declared_world_size()) == 0:
            return super().clear(publish)
        params, self.params = self.params, {}  # a follower "clears" nothing: the next update overwrites in place
        try:
            return super().clear(publish)
        finally:
            self.params = params


class FollowerKeepsWeightsAtClear(Mutant):
    id = "gaps_follower_keeps_weights_at_clear"
    bug = ("a rank that does not write the cell leaves its parameters in place at a clear (the next update writes over "
           "them) and reports the clear done: every rank agrees, the cell reads CLEARED, and that rank still holds the "
           "whole old shard, the memory the clear is there to free")
    kills = frozenset({"MR-AGREE-BEFORE-NORMAL"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return _manager_patch(_FollowerKeepsWeightsManager)


# -- ranks: a rank voting before it checked that every parameter arrived (multirank tier) -----------
class _WriterChecksAtPublishManager(_manager.WeightManager):
    def finalize(self):
        writer = self.commit_options.tp_rank(self.rank, self.agreement.declared_world_size()) == 0
        if not writer or self._committed or self._voted:
            return super().finalize()
        self._voted = True
        self.agreement.require_all("update")  # the writer votes first: it checks when it is about to write NORMAL
        self.agreement.require_all = lambda what: None  # (the vote is cast)
        try:
            return super().finalize()
        finally:
            del self.agreement.require_all


class WriterChecksAtPublish(Mutant):
    id = "gaps_writer_votes_before_checking"
    bug = ("every rank checks that each of its parameters arrived before it votes, except the one that writes the cell, "
           "which checks right before it writes NORMAL, after the agreement: when its own well-formed shard lacks a "
           "tensor, the other ranks commit (NORMAL, the new version) and only the writer fails")
    kills = frozenset({"MR-FAILURE-EVERY-RANK"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return _manager_patch(_WriterChecksAtPublishManager)
