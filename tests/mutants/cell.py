"""Mutants: the status cell after an update that fails inside the worker's loop (SPEC.md STATUS-FAILED-NOT-NORMAL;
issue 30: "the manager's own status is right in each case; the cell is not always").

Each keeps the manager's own ``status()`` right and gets the cell wrong, the way a loader that tells the cell
separately from its status does.
"""
from __future__ import annotations

from reference import hooks as _hooks
from reference import manager as _manager
from reference import storage as _storage
from reference import worker_loop as _loop
from reference.status import Status

from .base import Mutant

_real_after_commit = _hooks.after_commit
_real_recapture = _storage.recapture


class LoopFailureWritesNormal(Mutant):
    id = "cell_loop_failure_writes_normal"
    bug = ("the loop answers the API whatever happened, so that its request never hangs: after a failed update rank 0 "
           "writes NORMAL (and raises): the API's waiting update answers success and the cache manager rebuilds for "
           "weights that never loaded, while status() says UPDATING")
    kills = frozenset({"STATUS-FAILED-NOT-NORMAL"})

    def patches(self):
        def update(manager, cell, poll_s, before=None):
            try:
                if before is not None:
                    before()
                manager.update()
            except Exception:
                manager.cell.publish(Status.NORMAL, first_load=False)
                raise

        return {"reference.worker_loop.update": update}


class LoopFailureLeavesUpdating(Mutant):
    id = "cell_loop_failure_leaves_updating"
    bug = ("the reference before issue 30: an update that fails inside the loop raises and leaves the API's UPDATING in "
           "the cell: never NORMAL, but the API's waiting update times out and every later clear (403) and update (400) "
           "is refused until the cell is rewritten by hand (issue 19's stuck cell)")
    kills = frozenset({"STATUS-FAILED-NOT-NORMAL"})

    def patches(self):
        def update(manager, cell, poll_s, before=None):
            if before is not None:
                before()
            manager.update()

        return {"reference.worker_loop.update": update}


class LoopFailureClaimsCleared(Mutant):
    id = "cell_loop_failure_claims_cleared"
    bug = ("after a failed update the loop writes CLEARED so that the API may ask again, but keeps what the failed update "
           "left loaded: the cell says the weights are released while they hold the memory a colocated trainer was told "
           "is free")
    kills = frozenset({"STATUS-FAILED-NOT-NORMAL"})

    def patches(self):
        def update(manager, cell, poll_s, before=None):
            try:
                if before is not None:
                    before()
                manager.update()
            except Exception:
                manager.cell.publish(Status.CLEARED, first_load=False)
                raise

        return {"reference.worker_loop.update": update}


class HookFailurePublishesNormal(Mutant):
    id = "cell_hook_failure_publishes_normal"
    bug = ("the commit tells the cell NORMAL together with the status, before the stale-state hooks run: a hook that "
           "raises takes the status back to UPDATING, but the API already read NORMAL (and the loop's release writes "
           "CLEARED only afterwards): the failed update was answered success with the old cache served")
    kills = frozenset({"STATUS-FAILED-NOT-NORMAL"})

    def patches(self):
        def after_commit(manager):
            manager.cell.publish(Status.NORMAL, manager.first_load)
            _real_after_commit(manager)

        return {"reference.hooks.after_commit": after_commit}


class RecaptureAfterNormal(Mutant):
    id = "cell_recapture_after_normal"
    bug = ("the cell is told NORMAL as soon as the weights are in place, and the engine's graphs are recaptured after it: "
           "a recapture that fails leaves the update failed (status UPDATING) after the API read NORMAL and sent requests "
           "to graphs that read freed memory")
    kills = frozenset({"STATUS-FAILED-NOT-NORMAL"})

    def patches(self):
        def recapture(manager):
            if manager.commit_options.recapture is not None and manager._storage_before is not None \
                    and _storage.moved(manager._storage_before, manager.params):
                manager.cell.publish(Status.NORMAL, manager.first_load)
            _real_recapture(manager)

        return {"reference.storage.recapture": recapture}


class ReleaseLeavesKvUpdating(Mutant):
    id = "cell_release_leaves_kv_updating"
    bug = ("after an update that fails inside the loop, the loop releases the weights and rank 0 writes CLEARED, but the "
           "KV cache's cell is not told (it keeps the update's UPDATING): the cache manager keeps, or rebuilds, caches for "
           "weights that are gone, and the next update, starting from CLEARED without a clear, allocates them again")
    kills = frozenset({"STATUS-KV-CELL"})

    def patches(self):
        def release_failed(manager, cell, poll_s):
            manager.clear()
            if not manager.cell.writes:
                _loop.wait_while(cell, Status.UPDATING, manager.agreement.timeout_s, poll_s,
                                 f"rank {manager.rank} released the weights of its failed update")

        return {"reference.worker_loop.release_failed": release_failed}


class _StartupUntilCommitManager(_manager.WeightManager):
    def clear(self, publish: bool = True) -> None:
        first = self.first_load
        super().clear(publish)
        self.first_load = first  # the startup load ends only at a commit


class StartupLoadEndsOnlyAtCommit(Mutant):
    id = "cell_startup_load_ends_only_at_commit"
    bug = ("the reference before issue 30's blind batch: the first-load flag (no NORMAL written for the startup load) is "
           "cleared only when an update commits, so after a failed startup load the API's clear writes CLEARED and the "
           "committed update that follows writes nothing: the cell stays CLEARED over loaded weights, and in the worker "
           "loop rank 0 waits for its own NORMAL until its deadline and the API's update is answered 500")
    kills = frozenset({"STATUS-FIRST-LOAD-SILENT"})

    def patches(self):
        return {"reference.adapter.WeightManager": _StartupUntilCommitManager}


class _StartupEndsAtFailureManager(_manager.WeightManager):
    def update(self, version=None):
        try:
            return super().update(version)
        except BaseException:
            self.first_load = False  # the startup load ends at its failure
            raise


class StartupLoadEndsAtFailure(Mutant):
    id = "cell_startup_load_ends_at_failure"
    bug = ("the first-load flag is cleared when the startup load fails, as if the failed load had been the startup "
           "load: on the paths that clear first this only refuses a retry without clear(), but rsync and GDR retry in "
           "place, and the retried startup load writes NORMAL into the cell the engine set before the worker started")
    kills = frozenset({"STATUS-FIRST-LOAD-SILENT"})

    def patches(self):
        return {"reference.adapter.WeightManager": _StartupEndsAtFailureManager}
