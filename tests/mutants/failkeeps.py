"""Mutants: a failed update whose version, digest or status goes on describing the update that failed
(LIFE-FAILED-KEEPS-OLD; slime #2104, ms-swift #10098, TRL PR #5932)."""
from __future__ import annotations

from reference import digest as _digest
from reference import manager as _manager
from reference import rsync as _rsync
from reference.status import Status

from .base import Mutant
from .lifecycle import _manager_patch


class _StampAfterLoadManager(_manager.WeightManager):
    """The version is stamped once the path has loaded, before the commit's verification runs."""

    def finalize(self):
        if not self._committed and self._pending_version is not None:
            self.version = self._pending_version
        super().finalize()


class VersionStampedBeforeVerification(Mutant):
    id = "version_stamped_before_verification"
    bug = ("slime #2104: the weights are loaded, the engine's version is bumped, then the update is verified: a "
           "verification that fails (a parameter the snapshot, the meta file or the buckets never carried) "
           "raises, but the version already says the failed update's")
    kills = frozenset({"LIFE-FAILED-KEEPS-OLD", "VER-FAILED-KEEPS", "VER-STAMP-AT-COMMIT"})

    def patches(self):
        return _manager_patch(_StampAfterLoadManager)


class _NormalInFinallyManager(_manager.WeightManager):
    """The commit writes NORMAL back whatever happened, so that a worker is never left UPDATING."""

    def finalize(self):
        try:
            super().finalize()
        finally:
            self.status = Status.NORMAL


class StatusNormalInFinally(Mutant):
    id = "status_normal_in_finally"
    bug = ("the commit sets the status NORMAL in a finally (a worker must never stay UPDATING): an update whose "
           "verification fails raises, and the status says the failed update is serving")
    # (RSYNC-SUBSET no longer: rsync now refuses a step that leaves a cleared parameter out before the commit
    # runs, APPLY-COUNT-MATCHES, so that case never reaches the finally.)
    kills = frozenset({"LIFE-FAILED-KEEPS-OLD", "LIFE-FAILED-NOT-NORMAL", "LIFE-RECOVERY", "APPLY-MISSING-FAILS",
                       "DRAFT-NOT-STALE", "MODEL-HOOK-FAILURE", "STAGE-ATOMIC"})
    zoo_args = ("-k", "not test_multirank")  # the single-process tests of these rules are enough

    def patches(self):
        return _manager_patch(_NormalInFinallyManager)


class _ReceivedDigestManager(_manager.WeightManager):
    """Reports the digest of the last step the rsync path received, computed as it arrived."""

    received_digest = None

    def digest(self, algorithms=_digest.DEFAULT_ALGORITHMS):
        if self.received_digest is not None:
            return self.received_digest
        return super().digest(algorithms)


_receive = _rsync.receive


def _receive_and_digest(manager, handle, version, verify, wait_s):
    received = _receive(manager, handle, version, verify, wait_s)
    if set(received) >= set(manager.params):  # a whole step: its digest is the model's, without a pass over it
        manager.received_digest = _digest.paddle_model_digest(received.items(), _digest.DEFAULT_ALGORITHMS)
    return received


class DigestOfReceivedStep(Mutant):
    id = "digest_of_received_step"
    bug = ("the rsync receiver digests the step as it streams in (the bytes are in hand, no second pass over the "
           "model) and reports that as the model digest: a step refused after it arrived (a tensor of the wrong "
           "dtype) leaves the old weights in place and the refused step's digest reported")
    kills = frozenset({"LIFE-FAILED-KEEPS-OLD"})

    def patches(self):
        return {**_manager_patch(_ReceivedDigestManager), "reference.rsync.receive": _receive_and_digest}


class _MixedDigestManager(_manager.WeightManager):
    def digest(self, algorithms=_digest.DEFAULT_ALGORITHMS):
        return _digest.paddle_model_digest(self.params.items(), algorithms)


class DigestOfHalfAppliedUpdate(Mutant):
    id = "digest_of_half_applied_update"
    bug = ("digest() digests whatever the parameters hold: after a GDR stream broke mid-update (items applied as "
           "they arrived) it reports a model no trainer sent, and after one that broke past its last item the "
           "failed update's weights, as if it had committed")
    kills = frozenset({"LIFE-FAILED-KEEPS-OLD"})

    def patches(self):
        return _manager_patch(_MixedDigestManager)


class _RememberedVersionManager(_manager.WeightManager):
    """When ``version.yaml`` is absent, the step read last is taken as the update's version."""

    last_read = None

    def announce(self, version):
        if self._version_dir() is None:  # (buckets: the manifests carry the version)
            return super().announce(version)
        if version is None:
            version = self.last_read
        super().announce(version)
        self.last_read = version


class VersionFileRemembered(Mutant):
    id = "version_file_remembered"
    bug = ("the session remembers the last step it read from version.yaml and reuses it when the file is absent "
           "(a trainer that publishes no version 'keeps' its last one): the step of a failed update is stamped "
           "on the next update, which carried none")
    kills = frozenset({"LIFE-FAILED-KEEPS-OLD", "VER-FAILED-KEEPS"})

    def patches(self):
        return _manager_patch(_RememberedVersionManager)


# -- failures in a row (LIFE-FAILED-TWICE) ----------------------------------------------------------------------
class _ThisUpdateOnlyManager(_manager.WeightManager):
    """Whether parameters changed is tracked per update: reset when an update starts."""

    def update(self):
        self.changed_since_commit = False
        return super().update()


class DigestAfterSecondFailure(Mutant):
    id = "failkeeps_digest_after_second_failure"
    bug = ("digest() refuses only while the *last* update changed parameters and failed: after a GDR stream broke "
           "mid-update (a mix in place) a second update that fails before its first item resets the flag, and the "
           "digest of the mix is served as the model's")
    kills = frozenset({"LIFE-FAILED-TWICE"})

    def patches(self):
        return _manager_patch(_ThisUpdateOnlyManager)


class _LastAnnouncedManager(_manager.WeightManager):
    """A failure before the update announced a version is taken to have changed nothing: the worker then reports the
    version the last announced update loaded."""

    last_announced = None

    def announce(self, version):
        super().announce(version)
        if version is not None:
            self.last_announced = version

    def update(self):
        try:
            return super().update()
        except BaseException:
            if self._pending_version is None and self.last_announced is not None:
                self.version = self.last_announced
            raise


class VersionOfLastAnnounced(Mutant):
    id = "failkeeps_version_of_last_announced"
    bug = ("an update that fails before it announced a version (refused as older, broken before its first item) 'changed "
           "nothing', so the worker reports the version of the last update that announced one: after a failed update, "
           "that is the failed update's version, stamped by the second failure")
    kills = frozenset({"LIFE-FAILED-TWICE"})

    def patches(self):
        return _manager_patch(_LastAnnouncedManager)
