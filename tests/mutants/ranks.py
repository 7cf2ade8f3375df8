"""Mutants of the status state machine, staged commits, versions, multi-rank agreement and the resources
of repeated cycles (SPEC.md STATUS, STAGE, VER, MR, CYCLE): the reference with one real bug put back,
each the way a worker written from the contract plausibly gets it wrong (FastDeploy #5249, #5493,
#5527 are three of them, found in production).

Patches follow tests/mutants/lifecycle.py: module attributes looked up at call time. Mutants of the
multi-rank rules patch the reference in the pytest process; the rank processes resolve the same mutant
by name (``--impl=tests.mutants:mutant --impl-opt name=ID``), so the patch is in every rank.
"""
from __future__ import annotations

import time

from reference import agreement as _agreement
from reference import apply as _apply
from reference import commit as _commit
from reference import control
from reference import ipc_meta as _ipc_meta
from reference import manager as _manager
from reference import transforms as _transforms
from reference import worker_loop as _loop
from reference.commit import CommitOptions, Stage
from reference.control import WeightControl
from reference.status import Status
from reference.status_cell import CellWriter, StatusCell

from sim import rank_trainer as _rank_trainer  # noqa: F401 (patched by the trainer mutant)
from sim import trainer as _trainer

from .base import Mutant

_real_iteration = _loop.iteration
_real_check_status = _loop.check_status
_real_wait_while = _loop.wait_while
_real_read_version_file = _commit.read_version_file
_real_adopt = _apply.adopt
_real_open_tensor = _ipc_meta.open_tensor
_real_after_load = _transforms.after_load


# -- the worker loop (STATUS) ---------------------------------------------------------------------
class WritesBackReadStatus(Mutant):
    id = "loop_writes_back_read_status"
    bug = ("the worker writes the value it read (and broadcast) back into the cell before acting on it, as "
           "FastDeploy's loop did before #5493: an UPDATING written by the API during the broadcast of a stale "
           "CLEARED is erased, and the update times out")
    kills = frozenset({"STATUS-REQUEST-KEPT"})

    def patches(self):
        def iteration(manager, run_model, *, block, sync=None, poll_s=_loop.POLL_S, runner=None):
            name = manager.commit_options.status_cell
            with StatusCell(name) as cell:
                value = cell.read()
                value = sync(value) if sync is not None else manager.agreement.broadcast(value)
                if value != Status.NORMAL and manager.cell.writes:
                    cell.write(value)
                if value == Status.NORMAL:
                    run_model()
                    return "ran"
                return _loop.check_status(manager, cell, value, block=block, poll_s=poll_s, runner=runner)

        return {"reference.worker_loop.iteration": iteration}


class NonBlockingWaits(Mutant):
    id = "loop_nonblocking_waits_for_update"
    bug = ("block=False is ignored: the loop stays inside after CLEARED until the next update, as before "
           "FastDeploy #5249 (the worker cannot keep its communication group alive while idle)")
    kills = frozenset({"STATUS-NONBLOCK-RETURNS"})

    def patches(self):
        def check_status(manager, cell, value, *, block, poll_s=_loop.POLL_S, runner=None):
            return _real_check_status(manager, cell, value, block=True, poll_s=poll_s, runner=runner)

        return {"reference.worker_loop.check_status": check_status}


class BlockingReturnsAtCleared(Mutant):
    id = "loop_blocking_returns_at_cleared"
    bug = "block=True is ignored: the blocking loop returns at CLEARED like the non-blocking one"
    kills = frozenset({"STATUS-BLOCK-WAITS"})

    def patches(self):
        def check_status(manager, cell, value, *, block, poll_s=_loop.POLL_S, runner=None):
            return _real_check_status(manager, cell, value, block=False, poll_s=poll_s, runner=runner)

        return {"reference.worker_loop.check_status": check_status}


class RunsModelAfterChange(Mutant):
    id = "loop_runs_model_after_change"
    bug = ("after a clear or an update the iteration falls through to the model run instead of continuing, as "
           "before FastDeploy #5527 (EP crashed on the missing weights and cache)")
    kills = frozenset({"STATUS-NO-RUN-AFTER-CHANGE"})

    def patches(self):
        def iteration(manager, run_model, *, block, sync=None, poll_s=_loop.POLL_S, runner=None):
            result = _real_iteration(manager, run_model, block=block, sync=sync, poll_s=poll_s, runner=runner)
            if result in ("cleared", "updated"):
                run_model()
            return result

        return {"reference.worker_loop.iteration": iteration}


class SlowWriteBack(Mutant):
    id = "loop_writes_back_after_idle"
    bug = ("an idle iteration (CLEARED) re-asserts CLEARED into the cell after a short wait, 'to be safe': an "
           "UPDATING the API wrote meanwhile is lost (the #5493 race outside the broadcast)")
    kills = frozenset({"STATUS-REQUEST-KEPT"})

    def patches(self):
        def check_status(manager, cell, value, *, block, poll_s=_loop.POLL_S, runner=None):
            if value == Status.CLEARED and not block:
                time.sleep(0.0005)
                if manager.cell.writes:
                    cell.write(Status.CLEARED)
                return "idle"
            return _real_check_status(manager, cell, value, block=block, poll_s=poll_s, runner=runner)

        return {"reference.worker_loop.check_status": check_status}


# -- what surrounds a change of the weights (STATUS-REQUESTS-CLEARED, -COMM-GROUPS, -KV-CELL, -ONCE-PER-REQUEST)
_real_stop_requests = _loop._stop_requests


class RequestsClearedOnlyBeforeClear(Mutant):
    id = "loop_requests_cleared_only_before_clear"
    bug = ("the runner's in-flight requests are stopped before a clear but not before an update, as FastDeploy "
           "did between #3601 and #4286 / #4402: requests admitted at CLEARED run into the update")
    kills = frozenset({"STATUS-REQUESTS-CLEARED"})

    def patches(self):
        def stop_requests(manager, runner, kv_value):
            return _real_stop_requests(manager, runner if kv_value == Status.CLEARING else None, kv_value)

        return {"reference.worker_loop._stop_requests": stop_requests}


class RequestsClearedAfterClear(Mutant):
    id = "loop_requests_cleared_after_clear"
    bug = "the loop stops the runner's requests only once the clear is done: requests in flight ran on weights being cleared"
    kills = frozenset({"STATUS-REQUESTS-CLEARED"})

    def patches(self):
        real_clear = _manager.WeightManager.clear

        def check_status(manager, cell, value, *, block, poll_s=_loop.POLL_S, runner=None):
            if value != Status.CLEARING or runner is None:
                return _real_check_status(manager, cell, value, block=block, poll_s=poll_s, runner=runner)

            class Late:
                def clear_requests(self):
                    pass

                def __getattr__(self, name):
                    return getattr(runner, name)

            def clear_then_stop(self):
                real_clear(self)
                runner.clear_requests()

            manager.clear = clear_then_stop.__get__(manager)
            try:
                return _real_check_status(manager, cell, value, block=block, poll_s=poll_s, runner=Late())
            finally:
                del manager.clear

        return {"reference.worker_loop.check_status": check_status}


class RequestsClearedAgainAtTheRelease(Mutant):
    id = "loop_requests_cleared_again_at_the_release"
    bug = ("after an update that fails inside the loop, the release of what it left stops the runner's requests again "
           "(\"requests stopped before every change of the weights\"): at a moment some parameters already hold the "
           "failed update's values, and a second time for one request (issue 30's blind batch)")
    kills = frozenset({"STATUS-REQUESTS-CLEARED"})

    def patches(self):
        def check_status(manager, cell, value, *, block, poll_s=_loop.POLL_S, runner=None):
            real_release = _loop.release_failed

            def release_failed(manager_, cell_, poll_s_):
                if runner is not None:
                    runner.clear_requests()
                return real_release(manager_, cell_, poll_s_)

            _loop.release_failed = release_failed
            try:
                return _real_check_status(manager, cell, value, block=block, poll_s=poll_s, runner=runner)
            finally:
                _loop.release_failed = real_release

        return {"reference.worker_loop.check_status": check_status}


class GroupsShutDownOnEveryClear(Mutant):
    id = "loop_shuts_groups_down_on_every_clear"
    bug = ("every clear shuts the communication groups down and every update restarts them, whether or not the "
           "worker idles in its check, as before FastDeploy #5433: a worker back in its event loop broadcasts on a "
           "group that is gone")
    kills = frozenset({"STATUS-COMM-GROUPS"})

    def patches(self):
        def stop_requests(manager, runner, kv_value):
            _real_stop_requests(manager, runner, kv_value)
            if runner is not None:
                (runner.shutdown_process_group if kv_value == Status.CLEARING else runner.restart_process_group)("default")

        return {"reference.worker_loop._stop_requests": stop_requests}


class GroupsRestartedAfterLoad(Mutant):
    id = "loop_restarts_groups_after_the_load"
    bug = ("a blocking worker shuts its groups down at the clear but restarts them only after the new weights "
           "are in: the update's collectives run on a group that is down")
    kills = frozenset({"STATUS-COMM-GROUPS"})

    def patches(self):
        def check_status(manager, cell, value, *, block, poll_s=_loop.POLL_S, runner=None):
            result = _real_check_status(manager, cell, value, block=block, poll_s=poll_s, runner=runner)
            if block and runner is not None and result == "updated":
                runner.restart_process_group("default")
            return result

        def stop_requests(manager, runner, kv_value):
            _real_stop_requests(manager, runner, kv_value)
            if runner is not None and kv_value == Status.CLEARING and _loop_block[0]:
                runner.shutdown_process_group("default")

        _loop_block = [False]

        def iteration(manager, run_model, *, block, sync=None, poll_s=_loop.POLL_S, runner=None):
            _loop_block[0] = block
            return _real_iteration(manager, run_model, block=block, sync=sync, poll_s=poll_s, runner=runner)

        return {"reference.worker_loop.check_status": check_status, "reference.worker_loop._stop_requests": stop_requests,
                "reference.worker_loop.iteration": iteration}


class KvCellNeverTold(Mutant):
    id = "loop_kv_cell_never_told"
    bug = ("the loop changes the weights without telling the KV cache's status cell, as before FastDeploy #5930 / "
           "#5934: the cache transfer manager never frees or rebuilds its caches")
    kills = frozenset({"STATUS-KV-CELL"})

    def patches(self):
        def stop_requests(manager, runner, kv_value):
            if runner is not None:
                runner.clear_requests()

        return {"reference.worker_loop._stop_requests": stop_requests}


class KvCellToldAfterClear(Mutant):
    id = "loop_kv_cell_told_after_the_change"
    bug = "the KV cache's cell is set only after the loop stopped the requests and changed the weights"
    kills = frozenset({"STATUS-KV-CELL"})

    def patches(self):
        def stop_requests(manager, runner, kv_value):
            if runner is not None:
                runner.clear_requests()
            name = manager.commit_options.kv_cache_cell
            if name is not None:
                with StatusCell(name) as kv:
                    kv.write(kv_value)

        return {"reference.worker_loop._stop_requests": stop_requests}


class FollowerActsAgain(Mutant):
    id = "loop_follower_acts_again"
    bug = ("after its own clear or update a rank goes round its check again without waiting for rank 0's write, as "
           "FastDeploy did between #5249 and #5710: a rank faster than rank 0 clears (and shuts its group down) twice")
    kills = frozenset({"STATUS-ONCE-PER-REQUEST"})

    def patches(self):
        def wait_while(cell, value, timeout_s, poll_s, why):
            time.sleep(poll_s)  # one look, then round the check again: a request still there is done again
            return cell.read()

        return {"reference.worker_loop.wait_while": wait_while}


# -- who writes the cell (STATUS) -----------------------------------------------------------------
class _SilentFirstLoadIgnored(CellWriter):
    def publish(self, status, first_load):
        return super().publish(status, False)


class FirstLoadWritesNormal(Mutant):
    id = "status_first_load_writes_normal"
    bug = ("the first load writes NORMAL like every later one, overwriting whatever the engine's API wrote while "
           "the worker was starting (FastDeploy's finalize_update skips it, fd-spec rule 32)")
    kills = frozenset({"STATUS-FIRST-LOAD-SILENT"})

    def patches(self):
        return {"reference.manager.CellWriter": _SilentFirstLoadIgnored}


class _EveryRankWriter(CellWriter):
    @property
    def writes(self):
        return self.name is not None


class EveryRankWrites(Mutant):
    id = "status_every_rank_writes"
    bug = "every rank writes the cell, not only tensor-parallel rank 0 (fd-spec rule 30): ranks race on it"
    kills = frozenset({"STATUS-RANK0-WRITES"})

    def patches(self):
        return {"reference.manager.CellWriter": _EveryRankWriter}


class _GlobalRankOptions(CommitOptions):
    def tp_rank(self, rank, world_size):
        return rank


class TpRankIsGlobalRank(Mutant):
    id = "status_tp_rank_is_global_rank"
    bug = ("the writer is global rank 0 instead of tensor-parallel rank 0: with several tensor-parallel groups "
           "(data parallel) the other groups' cells are never written")
    kills = frozenset({"STATUS-RANK0-WRITES"})

    def patches(self):
        return {"reference.commit.CommitOptions": _GlobalRankOptions}


class _ReloadingControl(WeightControl):
    def update_model_weight(self, timeout_s):
        if self._read() == Status.NORMAL:
            self.clear_load_weight(timeout_s)
        return super().update_model_weight(timeout_s)


class UpdateWhileNormalReloads(Mutant):
    id = "control_update_while_normal_reloads"
    bug = ("update_model_weight() while NORMAL forces a reload (clear, then update) instead of answering that the "
           "weights are current: a no-op request reloads the model")
    kills = frozenset({"STATUS-UPDATE-WHILE-NORMAL"})
    control_class = _ReloadingControl


class _UnguardedControl(WeightControl):
    def _call(self, request, done, ok, verb, timeout_s):
        if self._read() == done:
            return 200, ok
        self._request(request)
        if control._wait_for(self.cell_name, done, None, timeout_s, self.poll_s) == "done":
            return 200, f"{verb} model weight successfully"
        return 404, f"{verb} model weight timeout"

    def clear_load_weight(self, timeout_s):
        return self._call(Status.CLEARING, Status.CLEARED, "model weight is cleared", "clear", timeout_s)

    def update_model_weight(self, timeout_s):
        return self._call(Status.UPDATING, Status.NORMAL, "model weight is updated", "update", timeout_s)


class ControlIgnoresState(Mutant):
    id = "control_requests_in_any_state"
    bug = ("the API writes its request whatever the cell holds (no EngineClient guard): a clear requested mid-update "
           "overwrites UPDATING, an update requested mid-clear overwrites CLEARING")
    kills = frozenset({"STATUS-UPDATE-WHILE-NORMAL"})
    control_class = _UnguardedControl


# -- staged commits and versions (STAGE, VER) ---------------------------------------------------------
class _NeverStaged(CommitOptions):
    @classmethod
    def parse(cls, options):
        parsed = CommitOptions.parse.__func__(cls, options)
        return cls(False, parsed.status_cell, parsed.agree_timeout_s, parsed.tp_size)


class StagedAdoptsAsItLands(Mutant):
    id = "staged_adopts_as_it_lands"
    bug = ("options['staged'] is accepted but ignored: each source is adopted as it lands, so a failure in a later "
           "part leaves the earlier parts applied")
    kills = frozenset({"STAGE-ATOMIC"})

    def patches(self):
        return {"reference.commit.CommitOptions": _NeverStaged}


class _FirstWinsStage(Stage):
    def _land(self, name, tensor, target):
        self.tensors.setdefault(name, tensor)


class StageKeepsFirstDuplicate(Mutant):
    id = "stage_keeps_first_duplicate"
    bug = "the stage keeps the first tensor landed under a name: a later part's duplicate is dropped at the commit"
    kills = frozenset({"STAGE-ATOMIC"})

    def patches(self):
        return {"reference.commit.Stage": _FirstWinsStage}


class _EarlyStampManager(_manager.WeightManager):
    def announce(self, version):
        super().announce(version)
        if version is not None:
            self.version = version


class VersionStampedAtAnnounce(Mutant):
    id = "version_stamped_before_commit"
    bug = ("the version is stamped as soon as the update announces it, before anything is loaded: a reader sees "
           "the new version with the old (or no) weights, and a failed update reports the version it never loaded")
    kills = frozenset({"VER-STAMP-AT-COMMIT", "VER-FAILED-KEEPS"})

    def patches(self):
        return {"reference.adapter.WeightManager": _EarlyStampManager}


class _StickyPendingManager(_manager.WeightManager):
    """The announced version is cleared only by the commit that stamps it, not when an update starts."""

    @property
    def _pending_version(self):
        return self.__dict__.get("_sticky_version")

    @_pending_version.setter
    def _pending_version(self, version):
        if version is not None:  # the reset at the start of an update is lost
            self.__dict__["_sticky_version"] = version

    def finalize(self):
        committed = self._committed
        super().finalize()
        if self._committed and not committed:
            self.__dict__["_sticky_version"] = None  # consumed by this commit


class FailedVersionStampedLater(Mutant):
    id = "version_of_failed_update_stamped_later"
    bug = ("the version a failed update announced stays pending (cleared only by a commit): the next update that "
           "carries no version (no version.yaml) is stamped with the failed update's version, which never loaded")
    kills = frozenset({"VER-FAILED-KEEPS"})

    def patches(self):
        return {"reference.adapter.WeightManager": _StickyPendingManager}


class VersionGoesBackwards(Mutant):
    id = "version_goes_backwards"
    bug = "any announced version is accepted: a stale trainer moves the reported version (and the weights) back"
    kills = frozenset({"VER-MONOTONIC"})

    def patches(self):
        return {"reference.commit.check_forward": lambda new, reported, where: None}


class LenientVersionFile(Mutant):
    id = "version_file_lenient"
    bug = ("an unreadable version.yaml counts as no version (FastDeploy's read_model_version_from_file returns None): "
           "a broken trainer's update loads, and the version stays whatever it was")
    kills = frozenset({"VER-MONOTONIC"})

    def patches(self):
        def read_version_file(directory):
            try:
                return _real_read_version_file(directory)
            except ValueError:
                return None

        return {"reference.commit.read_version_file": read_version_file}


# -- the window between a rank's own check and the ranks' vote ----------------------------------------------------
class _VoteWindowManager(_manager.WeightManager):
    """Runs ``early()`` once this rank's own checks of an update passed, just before the ranks' vote on it."""

    def early(self) -> None:
        raise NotImplementedError

    def finalize(self):
        if self._committed:
            return super().finalize()
        real = self.agreement.require_all

        def require_all(what):
            if what == "update":
                self.early()
            return real(what)

        self.agreement.require_all = require_all
        try:
            return super().finalize()
        finally:
            del self.agreement.require_all


_done_early: set[int] = set()  # the PostLoad of a manager that already ran its steps this update


def _after_load_unless_done(post):
    if id(post) in _done_early:
        _done_early.discard(id(post))
        return
    _real_after_load(post)


class _TransformsBeforeVoteManager(_VoteWindowManager):
    def early(self):
        _real_after_load(self.post_load)  # "this rank's weights are all here": transposed, fused, dequantised
        _done_early.add(id(self.post_load))


class TransformsBeforeTheVote(Mutant):
    id = "transforms_before_the_vote"
    bug = ("the post-load steps run once this rank's own shard passed its checks, before the ranks' vote: when a peer "
           "fails the update, the healthy rank's fused and dequantised buffers (and its transposes) already hold the "
           "failed update's values (issue 30's blind batch)")
    kills = frozenset({"MODEL-TRANSFORM-FAILED"})

    def patches(self):
        return {"reference.adapter.WeightManager": _TransformsBeforeVoteManager,
                "reference.transforms.after_load": _after_load_unless_done}


class _AdoptBeforeVoteManager(_VoteWindowManager):
    def early(self):
        if self._stage is not None:
            self._stage.commit(self.params)
            self._stage = None


class StagedAdoptedBeforeTheVote(Mutant):
    id = "staged_adopted_before_the_vote"
    bug = ("a staged update adopts its tensors once this rank's own shard passed its checks, before the ranks' vote: "
           "a peer's failure leaves the healthy rank holding the failed update's tensors (issue 30's blind batch; the "
           "loop's release after the failure clears them, which hid it)")
    kills = frozenset({"STAGE-ATOMIC"})

    def patches(self):
        return {"reference.adapter.WeightManager": _AdoptBeforeVoteManager}


class _KeptAfterVoteManager(_manager.WeightManager):
    """The version a failed update announced is forgotten only when the failure came before this rank's vote."""

    _kept = None

    def update(self, version=None):
        try:
            result = super().update(version)
        except BaseException:
            self._kept = self._pending_version if self._voted else None
            raise
        self._kept = None
        return result

    def announce(self, version):
        super().announce(version)
        if version is None and self._pending_version is None and self._kept is not None:
            self._pending_version = self._kept


class VersionKeptAfterTheVote(Mutant):
    id = "version_kept_after_the_vote"
    bug = ("the version an update announced is forgotten on a failure before this rank's vote only: after one at or "
           "past it (a peer's failure, the engine's recapture raising) the next update carrying no version stamps the "
           "failed update's version, which never loaded (issue 30's blind batch)")
    kills = frozenset({"VER-FAILED-KEEPS"})

    def patches(self):
        return {"reference.adapter.WeightManager": _KeptAfterVoteManager}


# -- ranks (MR) ---------------------------------------------------------------------------------------
class _EarlyNormalManager(_manager.WeightManager):
    def finalize(self):
        if not self._committed and not [n for n in _apply.unloaded(self.params)
                                        if not (self._stage is not None and self._stage.holds(n))]:
            self.cell.publish(Status.NORMAL, self.first_load)  # "this rank is done": before the others agree
        super().finalize()


class NormalBeforeAgreement(Mutant):
    id = "rank0_normal_before_agreement"
    bug = ("tensor-parallel rank 0 writes NORMAL as soon as its own shard is loaded, before the ranks agree: the API "
           "serves while another rank is still loading, or has failed")
    kills = frozenset({"MR-AGREE-BEFORE-NORMAL", "MR-FAILURE-EVERY-RANK"})
    zoo_args = ("-k", "quick or bucket")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return {"reference.adapter.WeightManager": _EarlyNormalManager}


class _EarlyClearedManager(_manager.WeightManager):
    def clear(self):
        agree = self.agreement.require_all

        def require_all(what):
            if what == "clear":  # "this rank has cleared": published before the others said so
                self.status = Status.CLEARED
                self.cell.publish(Status.CLEARED, self.first_load)
            agree(what)

        self.agreement.require_all = require_all
        try:
            super().clear()
        finally:
            del self.agreement.require_all


class ClearedBeforeAgreement(Mutant):
    id = "rank0_cleared_before_agreement"
    bug = ("tensor-parallel rank 0 writes CLEARED as soon as its own parameters are cleared, before the ranks agree "
           "that every rank cleared: the API reports the weights cleared while another rank still holds them")
    kills = frozenset({"MR-AGREE-BEFORE-NORMAL"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return {"reference.adapter.WeightManager": _EarlyClearedManager}


class _VoteBeforeCheckManager(_manager.WeightManager):
    def finalize(self):
        if self._committed or self._voted:
            return super().finalize()
        self._voted = True
        self.agreement.require_all("update")  # "my transfer ended": voted before checking every parameter arrived
        self.agreement.require_all = lambda what: None  # (the vote is cast)
        try:
            return super().finalize()
        finally:
            del self.agreement.require_all


class VoteBeforeCompletenessCheck(Mutant):
    id = "rank_votes_before_checking_complete"
    bug = ("a rank votes success once its transfer ended, before checking that every parameter arrived: a rank whose "
           "well-formed shard lacks a tensor agrees, the other ranks commit (NORMAL, the new version), and only then "
           "does it fail its own check")
    kills = frozenset({"MR-FAILURE-EVERY-RANK", "MR-AGREE-BEFORE-NORMAL", "STAGE-ATOMIC"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return {"reference.adapter.WeightManager": _VoteBeforeCheckManager}


class _OwnVoteOnly(_agreement.Agreement):
    def require_all(self, what):
        self.vote(what, True)  # takes part, but only its own success counts


class FailureReportedAsSuccess(Mutant):
    id = "rank_failure_reported_as_success"
    bug = ("a rank commits when its own update succeeded, whatever the other ranks voted: another rank's failure is "
           "reported as success here (NORMAL, the new version) and the ranks serve different weights")
    kills = frozenset({"MR-FAILURE-EVERY-RANK", "MR-AGREE-BEFORE-NORMAL"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return {"reference.manager.Agreement": _OwnVoteOnly}


class _SilentFailure(_agreement.Agreement):
    def report_failure(self, what, error):
        return None  # the others are not told: they wait for this rank's vote


class FailedRankStaysSilent(Mutant):
    id = "failed_rank_does_not_vote"
    bug = ("a rank whose update fails raises at once without telling the others: they wait at the agreement for a "
           "vote that never comes (until its deadline), and then the ranks are out of step")
    kills = frozenset({"MR-FAILURE-EVERY-RANK"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return {"reference.manager.Agreement": _SilentFailure}


class _Unbounded(_agreement.Agreement):
    def _bounded(self, what, fn):
        return fn()  # a collective with no deadline: gloo waits for the peer as long as it takes


class AgreementWithoutDeadline(Mutant):
    id = "agreement_without_deadline"
    bug = ("collectives run without a deadline (a plain barrier, as FastDeploy's): a rank stuck in its transfer holds "
           "every other rank at the agreement for as long as it is stuck")
    kills = frozenset({"MR-DEADLINE"})

    def patches(self):
        return {"reference.manager.Agreement": _Unbounded}


class _EarlyCommitManager(_manager.WeightManager):
    def finalize(self):
        if self._stage is not None and not self._committed:
            self._stage.commit(self.params)  # adopted before the others agreed
            self._stage = None
        super().finalize()


class StagedCommitBeforeAgreement(Mutant):
    id = "staged_commit_before_agreement"
    bug = ("a staged update is adopted as soon as this rank has it all, before the ranks agree: a failure on another "
           "rank leaves this rank's parameters replaced")
    kills = frozenset({"STAGE-ATOMIC"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return {"reference.adapter.WeightManager": _EarlyCommitManager}


class _EarlyVersionManager(_manager.WeightManager):
    def finalize(self):
        if self._pending_version is not None:
            self.version = self._pending_version  # stamped when this rank is done, not at the commit
        super().finalize()


class VersionStampedBeforeAgreement(Mutant):
    id = "version_stamped_before_agreement"
    bug = "the version is stamped once this rank has loaded, before the ranks agree: a failed update reports it"
    kills = frozenset({"MR-FAILURE-EVERY-RANK"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        return {"reference.adapter.WeightManager": _EarlyVersionManager}


class EveryRankLoadsRankZeroShard(Mutant):
    id = "every_rank_loads_rank0_shard"
    bug = ("every rank reads rank 0's identity (rank 0, its physical GPU), as FastDeploy did before #6852: all ranks "
           "load the first shard")
    kills = frozenset({"MR-OWN-SHARD"})
    zoo_args = ("-k", "quick or snapshot")  # the quick run's forked ranks; else one path of the job

    def patches(self):
        def physical_gpu_id(env=None):
            import os

            env = os.environ if env is None else env
            return int(env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])

        return {"reference.identity.global_rank": lambda: 0, "reference.identity.physical_gpu_id": physical_gpu_id}


# -- failures on every rank, in every operation (MR-FAILURE-EVERY-RANK, MR-FAILED-CLEAR, MR-BROKEN-GROUP) ----------
class LoopFailureBeforeChangeNotVoted(Mutant):
    id = "loop_failure_before_change_not_voted"
    bug = ("what the worker loop does before it clears or updates (the KV cache's cell, the runner's clear_requests()) "
           "may fail without a vote, as in the reference before issue 30: the failing rank raises at once and never "
           "reaches manager.clear() or update(), so its peers, already at the agreement, wait out its deadline")
    kills = frozenset({"MR-FAILED-CLEAR", "MR-FAILURE-EVERY-RANK"})

    def patches(self):
        def before(manager, runner, kv_value, what):
            _loop._stop_requests(manager, runner, kv_value)

        return {"reference.worker_loop._before": before}


class _FirstFailureNamed(_agreement.Agreement):
    def require_all(self, what):
        failed = _agreement.failures(self.vote(what, True))
        if failed:  # the message is built from the first failed vote only
            raise _agreement.RankFailure(f"rank {self.rank()}: {what} failed on {len(failed)} other rank(s): "
                                         f"{_agreement.describe(failed[:1])}")


class OnlyFirstFailingRankNamed(Mutant):
    id = "only_first_failing_rank_named"
    bug = ("a healthy rank's error names the first failing rank only (its vote's error, 'and N others'): when two "
           "ranks fail at once, the second is named nowhere on the healthy ranks")
    kills = frozenset({"MR-FAILURE-EVERY-RANK", "MR-FAILED-CLEAR"})

    def patches(self):
        return {"reference.manager.Agreement": _FirstFailureNamed}


class _OwnErrorOnly(_manager.WeightManager):
    def failed(self, what, error):
        self.agreement.report_failure(what, error)  # votes, but raises its own error whatever the others said
        return error


class FailingRankNamesOnlyItself(Mutant):
    id = "failing_rank_names_only_itself"
    bug = ("a failing rank votes its failure and raises its own error, never saying that other ranks failed the same "
           "operation (the reference before issue 30): with two failing ranks, each names only itself")
    kills = frozenset({"MR-FAILURE-EVERY-RANK", "MR-FAILED-CLEAR"})

    def patches(self):
        return {"reference.adapter.WeightManager": _OwnErrorOnly}


class _RetriesBrokenGroup(_agreement.Agreement):
    def _bounded(self, what, fn):
        self.broken = None  # "try again": a group that missed a deadline is waited on once more
        return super()._bounded(what, fn)


class BrokenGroupWaitsAgain(Mutant):
    id = "broken_group_waits_again"
    bug = ("a collective that missed its deadline leaves nothing behind: the next operation runs its collectives on the "
           "group in an unknown state and waits out the whole deadline again (and again), as FastDeploy's barriers do")
    kills = frozenset({"MR-BROKEN-GROUP"})

    def patches(self):
        return {"reference.manager.Agreement": _RetriesBrokenGroup}


class _ShortDeadline(_agreement.Agreement):
    def _bounded(self, what, fn):
        timeout, self.timeout_s = self.timeout_s, min(self.timeout_s, 0.5)  # a fixed half-second bound on a collective
        try:
            return super()._bounded(what, fn)
        finally:
            self.timeout_s = timeout


class AgreementDeadlineFixedShort(Mutant):
    id = "agreement_deadline_fixed_short"
    bug = ("every collective is bounded by a fixed half second whatever options['agree_timeout_s'] says: a peer slow "
           "but healthy (a second late) breaks the group, and an update every rank could finish fails on all of them")
    kills = frozenset({"MR-DEADLINE"})

    def patches(self):
        return {"reference.manager.Agreement": _ShortDeadline}


class _FollowerVotesFirstManager(_manager.WeightManager):
    def clear(self, publish=True):
        if self.commit_options.tp_rank(self.rank, self.agreement.declared_world_size()) == 0:
            return super().clear(publish)
        self.agreement.require_all("clear")  # the follower says "cleared" first, then releases its parameters
        agree = self.agreement.require_all
        self.agreement.require_all = lambda what: None if what == "clear" else agree(what)
        try:
            return super().clear(publish)
        finally:
            del self.agreement.require_all


class FollowerVotesBeforeReleasing(Mutant):
    id = "follower_votes_before_releasing"
    bug = ("a follower (a rank that does not write the cell) votes that its clear is done before it releases its "
           "parameters: rank 0 writes CLEARED while the follower still holds its weights")
    kills = frozenset({"MR-AGREE-BEFORE-NORMAL"})

    def patches(self):
        return {"reference.adapter.WeightManager": _FollowerVotesFirstManager}


class _VotedFlagKeptManager(_manager.WeightManager):
    @property
    def _voted(self):
        return self.__dict__.get("_voted_flag", False)

    @_voted.setter
    def _voted(self, value):
        if value or self.__dict__.get("_committed_flag"):  # reset only after a commit, not when an update starts
            self.__dict__["_voted_flag"] = value

    @property
    def _committed(self):
        return self.__dict__.get("_committed_flag", False)

    @_committed.setter
    def _committed(self, value):
        self.__dict__["_committed_flag"] = value


class VotedFlagKeptAfterFailure(Mutant):
    id = "voted_flag_kept_after_failure"
    bug = ("'this rank has voted on the update' is cleared by a commit only, not when the next update starts: a rank "
           "that voted in an update another rank failed does not vote when its own next update fails (it believes it "
           "did), and its peers wait out their deadline: the second failure in a row is the one that hangs")
    kills = frozenset({"MR-FAILURE-EVERY-RANK"})

    def patches(self):
        return {"reference.adapter.WeightManager": _VotedFlagKeptManager}


# -- cycles (CYCLE) -----------------------------------------------------------------------------------
_kept: list = []


class KeepsEveryUpdate(Mutant):
    id = "cycle_worker_keeps_each_update"
    bug = ("the worker keeps a reference to every tensor it adopts (a 'last update' list never trimmed): clear() "
           "releases the parameters but not their memory, one model per cycle")
    kills = frozenset({"CYCLE-NO-LEAK"})
    zoo_args = ("-k", "snapshot")  # one path of the multi-rank job is enough

    def patches(self):
        def adopt(name, new, target):
            _kept.append(new)
            _real_adopt(name, new, target)

        return {"reference.apply.adopt": adopt}


class KeepsTrainerMappings(Mutant):
    id = "cycle_worker_keeps_mappings"
    bug = ("the worker never unmaps a trainer's buffer (slime #1731): each update's segment stays mapped, pinning the "
           "trainer's memory after it freed it")
    kills = frozenset({"CYCLE-NO-LEAK"})
    zoo_args = ("-k", "meta")  # one path of the multi-rank job is enough

    def patches(self):
        def release(attached):
            _kept.extend(attached.segments.values())
            attached.segments.clear()

        def open_tensor(name, meta, path):
            from sim.ipc_handles import attach_on_device

            _kept.append(attach_on_device(meta[0], meta[6]))
            return _real_open_tensor(name, meta, path)

        return {"reference.buckets.release": release, "reference.ipc_meta.open_tensor": open_tensor}


class _LeakyMetaTrainer(_trainer.MetaTrainer):
    def release(self):
        if self.segment is not None:
            self.segment.close()  # unmapped but never unlinked: the segment outlives its version
            self.segment = None


class TrainerLeaksSegments(Mutant):
    id = "cycle_trainer_leaks_segments"
    bug = ("the trainer (the simulator's side) frees each version's segment without unlinking it: a segment per "
           "cycle accumulates in /dev/shm. Proves the rule watches the trainer side as well")
    kills = frozenset({"CYCLE-NO-LEAK"})
    zoo_args = ("-k", "meta")  # one path of the multi-rank job is enough

    def patches(self):
        return {"sim.rank_trainer.MetaTrainer": _LeakyMetaTrainer}


class _DescriptorPerUpdateManager(_manager.WeightManager):
    """Each update opens the model directory to watch it and never closes it."""

    def update(self):
        import os

        if self.model_dir and os.path.isdir(self.model_dir):
            _kept.append(os.open(self.model_dir, os.O_RDONLY))
        else:
            _kept.append(os.open(os.devnull, os.O_RDONLY))
        return super().update()


class KeepsDescriptorPerUpdate(Mutant):
    id = "cycle_worker_keeps_a_descriptor"
    bug = ("every update opens a descriptor (the model directory, watched for the trainer's next version) and never "
           "closes it: one descriptor per cycle, until the worker runs out after enough RL steps")
    kills = frozenset({"CYCLE-NO-LEAK"})
    zoo_args = ("-k", "few_cycles")  # the quick run's cycles are enough

    def patches(self):
        return {"reference.adapter.WeightManager": _DescriptorPerUpdateManager}


class _ThreadPerUpdateManager(_manager.WeightManager):
    """Each update starts a thread that waits for the next one, and nothing ever stops it."""

    def update(self):
        import threading

        stop = threading.Event()
        _kept.append(stop)
        threading.Thread(target=stop.wait, name="next-version-watch", daemon=True).start()
        return super().update()


class KeepsThreadPerUpdate(Mutant):
    id = "cycle_worker_keeps_a_thread"
    bug = "every update starts a watcher thread that nothing stops: one thread per cycle"
    kills = frozenset({"CYCLE-NO-LEAK"})
    zoo_args = ("-k", "few_cycles")  # the quick run's cycles are enough

    def patches(self):
        return {"reference.adapter.WeightManager": _ThreadPerUpdateManager}


class _UncheckedOptions(CommitOptions):
    @classmethod
    def parse(cls, options):
        return cls(options.get("staged", False), options.get("status_cell"), options.get("agree_timeout_s", 60.0),
                   options.get("tp_size"))


class OptionsUnchecked(Mutant):
    id = "lifecycle_options_unchecked"
    bug = ("the lifecycle options are taken as given: a string 'yes' turns staging on, a zero deadline or tp_size "
           "fails (or divides by zero) only when the first collective or cell write needs it")
    kills = frozenset({"STATUS-OPTIONS"})

    def patches(self):
        return {"reference.commit.CommitOptions": _UncheckedOptions}


class FollowerAssumesWrite(Mutant):
    id = "loop_follower_does_not_wait"
    bug = ("after its own clear or update a rank assumes rank 0 has written the cell and returns: a follower's next "
           "iteration reads the request again and repeats it (a second update fails: the weights are not cleared)")
    kills = frozenset({"STATUS-FOLLOWERS-WAIT"})

    def patches(self):
        def wait_while(cell, value, timeout_s, poll_s, why):
            return {Status.UPDATING: Status.NORMAL, Status.CLEARING: Status.CLEARED}.get(value, cell.read())

        return {"reference.worker_loop.wait_while": wait_while}


class FollowerWaitsForever(Mutant):
    id = "loop_follower_waits_forever"
    bug = "a rank waits for rank 0's write without a deadline: if rank 0 died, it spins for ever"
    kills = frozenset({"STATUS-FOLLOWERS-WAIT"})

    def patches(self):
        def wait_while(cell, value, timeout_s, poll_s, why):
            return _real_wait_while(cell, value, 3600.0, poll_s, why)

        return {"reference.worker_loop.wait_while": wait_while}
