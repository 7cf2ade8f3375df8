"""Mutants of the one-operation-at-a-time guard (SPEC.md LIFE-CONCURRENT): the guards an outside implementer
writes when a second thread starts calling ``clear()`` and ``update()``, each caught by
conformance/test_concurrent.py (every ordered pair of operations, held at its start, mid-transfer, before and
after the commit, on every path).

Each is a ``WeightManager`` subclass put where the adapter builds it (tests/mutants/lifecycle.py's manner), or
its guard (``reference.operations.OperationGuard``) replaced by one with the bug.
"""
from __future__ import annotations

import time

from reference import commit as _commit
from reference import manager as _manager
from reference.operations import OperationGuard

from .base import Mutant


def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


class _NoGuard(OperationGuard):
    def claim(self, operation):
        return self  # every call goes ahead, and none is recorded


class _NoGuardManager(_manager.WeightManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.operations = _NoGuard()


class NoGuard(Mutant):
    id = "concurrent_no_guard"
    bug = ("no guard at all (the reference before issue 30, and FastDeploy's manager, whose worker loop is its only "
           "caller): a clear from another thread while an update runs is carried out beside it, and the update then "
           "either fails its verification or commits NORMAL over cleared parameters; a second update resets the "
           "first one's version and stage")
    kills = frozenset({"LIFE-CONCURRENT"})

    def patches(self):
        return _manager_patch(_NoGuardManager)


class _SilentRefusalManager(_manager.WeightManager):
    def clear(self, publish=True):
        if self.operations.running is not None:
            return None  # busy: "the weights are being dealt with"
        return super().clear(publish)

    def update(self):
        if self.operations.running is not None:
            return None
        return super().update()


class SilentRefusal(Mutant):
    id = "concurrent_silent_refusal"
    bug = ("a call that arrives while another runs returns at once without doing anything and without an error: "
           "the caller of clear() is told the weights are released while the update goes on loading them")
    kills = frozenset({"LIFE-CONCURRENT"})

    def patches(self):
        return _manager_patch(_SilentRefusalManager)


class _UpdateOnlyGuard(OperationGuard):
    def claim(self, operation):
        if operation == "clear":
            return _NoGuard()  # "a clear only frees memory: it needs no lock"
        return super().claim(operation)


class _UpdateOnlyGuardManager(_manager.WeightManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.operations = _UpdateOnlyGuard()


class GuardOnUpdateOnly(Mutant):
    id = "concurrent_guard_update_only"
    bug = ("only update() takes the guard (two updates cannot overlap); clear() runs whenever it is called, so a "
           "clear during an update releases what the update has landed and the update commits over it")
    kills = frozenset({"LIFE-CONCURRENT"})

    def patches(self):
        return _manager_patch(_UpdateOnlyGuardManager)


class _EarlyReleaseManager(_manager.WeightManager):
    def finalize(self):
        self.operations.release()  # "every byte is in: the next caller may come"
        return super().finalize()


class GuardReleasedBeforeCommit(Mutant):
    id = "concurrent_guard_released_before_commit"
    bug = ("the update lets go of the guard once every byte landed, before its commit (verification, recapture, "
           "the version, NORMAL, the stale-state hooks): a clear arriving then runs, and the update goes on to say "
           "NORMAL over the released parameters")
    kills = frozenset({"LIFE-CONCURRENT"})

    def patches(self):
        return _manager_patch(_EarlyReleaseManager)


class _WaitThenSkipManager(_manager.WeightManager):
    def _waited(self) -> bool:
        """Wait until no operation runs; whether there was one to wait for."""
        if self.operations.running is None:
            return False
        deadline = time.monotonic() + 60.0
        while self.operations.running is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        return True

    def clear(self, publish=True):
        if self._waited():
            return None  # "the operation in flight has just dealt with the weights"
        return super().clear(publish)

    def update(self):
        if self._waited():
            return None
        return super().update()


class WaitThenSkip(Mutant):
    id = "concurrent_wait_then_skip"
    bug = ("a call that arrives while another runs waits for it, then returns without doing its own work (as if "
           "the one it waited for had done it): a clear queued behind an update returns with the weights loaded and "
           "NORMAL, an update queued behind a clear returns with nothing loaded")
    kills = frozenset({"LIFE-CONCURRENT"})


    def patches(self):
        return _manager_patch(_WaitThenSkipManager)


class _GuardAfterResetManager(_manager.WeightManager):
    def update(self):
        # the per-update state is reset first, then the guard refuses: the refused call spoils the one in flight
        self._voted = self._committed = False
        self._pending_version = None
        self._stage = _commit.Stage() if self.commit_options.staged else None
        return super().update()


class GuardAfterReset(Mutant):
    id = "concurrent_guard_after_reset"
    bug = ("update() resets its per-update state (the version it announced, the staged tensors, the commit flags) "
           "before it asks the guard: a second update is refused with a clear error, yet the first one loses its "
           "version (never stamped) or its staged tensors (its verification fails)")
    kills = frozenset({"LIFE-CONCURRENT"})

    def patches(self):
        return _manager_patch(_GuardAfterResetManager)
