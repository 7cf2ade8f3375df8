"""Mutants of the V1 control surface (SPEC.md § CTL, reference/control_v1.py): pause and resume, sleep and wakeup by
tag, update_weights in place, the routed legacy pair. Each is a bug an engine's control path plausibly ships
(several are FastDeploy's own: the early ``return``s of its runner's tag loops, fd-spec rule 35), caught by
conformance/test_control_v1.py.

Each puts a subclass of ``reference.control_v1.Control`` (or ``RoutedControl``) where the adapter builds it.
"""
from __future__ import annotations

from reference import control_v1 as _c
from reference.agreement import RankFailure
from reference.status import Status

from .base import Mutant


def _control(cls):
    return {"reference.adapter.Control": cls}


# -- pause and resume ----------------------------------------------------------------------------------
class PauseNoAbort(Mutant):
    id = "ctl_pause_no_abort"
    bug = ("pause stops new requests but lets the ones in flight run to their end (vLLM's mode='wait' taken for "
           "FastDeploy's abort): a request in flight finishes, and a sleep releases what its steps read")
    kills = frozenset({"CTL-PAUSE-ABORTS", "CTL-SLEEP-PAUSES-FIRST"})

    def patches(self):
        class Control(_c.Control):
            def pause(self):
                with self._cond:
                    self._paused = True
                    self._cond.wait_for(lambda: not self._requests, _c.PAUSE_TIMEOUT_S)

        return _control(Control)


class PauseNoWait(Mutant):
    id = "ctl_pause_no_wait"
    bug = ("pause flags the requests aborted and returns at once, without waiting for the step under way: the "
           "change that follows (a sleep, an update) runs under a live step")
    kills = frozenset({"CTL-PAUSE-ABORTS", "CTL-SLEEP-PAUSES-FIRST"})

    def patches(self):
        class Control(_c.Control):
            def pause(self):
                with self._cond:
                    self._paused = True
                    for request in self._requests.values():
                        request.aborted = True

        return _control(Control)


class PauseAdmitsArrivals(Mutant):
    id = "ctl_pause_admits_arrivals"
    bug = ("pause aborts the requests in flight but a request arriving while paused is scheduled anyway (the "
           "engine's drop of new requests forgotten)")
    kills = frozenset({"CTL-PAUSE-ABORTS", "CTL-UPDATE-NO-RESUME", "CTL-WAKEUP-RESUMES", "CTL-SLEEP-PAUSES-FIRST"})

    def patches(self):
        class Control(_c.Control):
            def generate(self, step, steps):
                with self._cond:
                    was = (self._paused, self._rejecting)
                    self._paused = self._rejecting = False
                try:
                    return super().generate(step, steps)
                finally:
                    with self._cond:
                        self._paused, self._rejecting = was[0] or self._paused, was[1] or self._rejecting

        return _control(Control)


class PauseNotReentrant(Mutant):
    id = "ctl_pause_not_reentrant"
    bug = "a second pause raises 'already paused' instead of returning (FastDeploy's pause is re-entrant)"
    kills = frozenset({"CTL-PAUSE-ABORTS"})

    def patches(self):
        class Control(_c.Control):
            def pause(self):
                if self.is_paused():
                    raise RuntimeError("the engine is already paused")
                super().pause()

        return _control(Control)


class PauseDeliversLastStep(Mutant):
    id = "ctl_pause_delivers_last_step"
    bug = ("a request whose last step was running when the pause began is answered as finished (the abort is "
           "checked only before a step, never after the last)")
    kills = frozenset({"CTL-PAUSE-ABORTS"})

    def patches(self):
        class Control(_c.Control):
            def generate(self, step, steps):
                outcome, done = super().generate(step, steps)
                return ("finished", done) if done == steps else (outcome, done)

        return _control(Control)


class ResumeToggles(Mutant):
    id = "ctl_resume_toggles"
    bug = "resume flips the pause flag instead of clearing it: a resume of an engine not paused pauses it"
    kills = frozenset({"CTL-RESUME-NOOP"})

    def patches(self):
        class Control(_c.Control):
            def resume(self):
                with self._cond:
                    self._paused = not self._paused
                    self._cond.notify_all()

        return _control(Control)


class ResumeResetsScheduler(Mutant):
    id = "ctl_resume_resets_scheduler"
    bug = ("resume resets the scheduler, aborting the requests in flight, even when the engine was not paused "
           "(the reset of pause run again)")
    kills = frozenset({"CTL-RESUME-NOOP"})

    def patches(self):
        class Control(_c.Control):
            def resume(self):
                with self._cond:
                    for request in self._requests.values():
                        request.aborted = True
                super().resume()

        return _control(Control)


class IsPausedWaitsForOperation(Mutant):
    id = "ctl_is_paused_waits"
    bug = "is_paused takes the lock the control operations hold, so it answers only once the operation under way ends"
    kills = frozenset({"CTL-IS-PAUSED"})

    def patches(self):
        class Control(_c.Control):
            def is_paused(self):
                with self._op:
                    return super().is_paused()

        return _control(Control)


class IsPausedStaleAfterResume(Mutant):
    id = "ctl_is_paused_stale_after_resume"
    bug = "resume lets requests run again but leaves the flag is_paused reads set: the engine says it is paused while it serves"
    kills = frozenset({"CTL-IS-PAUSED", "CTL-UPDATE-PAUSED-ONLY", "CTL-WAKEUP-RESUMES"})

    def patches(self):
        class Control(_c.Control):
            def resume(self):
                super().resume()
                self.resumed_at_least_once = True

            def is_paused(self):
                return super().is_paused() or getattr(self, "resumed_at_least_once", False)

        return _control(Control)


# -- update_weights ------------------------------------------------------------------------------------
class UpdateWeightsResumes(Mutant):
    id = "ctl_update_weights_resumes"
    bug = "update_weights resumes the engine after a successful update (FastDeploy documents that it never does)"
    kills = frozenset({"CTL-UPDATE-NO-RESUME", "CTL-IS-PAUSED"})

    def patches(self):
        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                result = super()._update_weights(version, verify_checksum)
                self.resume()
                return result

        return _control(Control)


class UpdateWeightsWithoutPause(Mutant):
    id = "ctl_update_weights_without_pause"
    bug = "update_weights runs on an engine that is not paused (the engine's check forgotten), under live requests"
    kills = frozenset({"CTL-UPDATE-PAUSED-ONLY"})

    def patches(self):
        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                with self._cond:
                    was, self._paused = self._paused, True
                try:
                    return super()._update_weights(version, verify_checksum)
                finally:
                    with self._cond:
                        self._paused = was

        return _control(Control)


class UpdateWeightsPauseCheckedLate(Mutant):
    id = "ctl_update_weights_pause_checked_late"
    bug = ("update_weights receives the stream first and checks the pause only before applying it: the refused "
           "call has taken the trainer's stream, which the next call then waits for in vain")
    kills = frozenset({"CTL-UPDATE-PAUSED-ONLY"})

    def patches(self):
        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                if not self.is_paused():
                    from reference import stream_config, transfer_lib

                    lib, _ = transfer_lib.library()
                    who = stream_config.worker_identity(self.manager.env)
                    handle = transfer_lib.ensure(self.manager, lambda: lib.CheckpointTransfer(
                        **stream_config.rsync_kwargs(stream_config.settings(self.manager.options), who)))
                    for _ in handle.receive_stream(step_id=str(version), verify_checksum=verify_checksum):
                        pass
                return super()._update_weights(version, verify_checksum)

        return _control(Control)


class UpdateWeightsByClear(Mutant):
    id = "ctl_update_weights_by_clear"
    bug = ("update_weights releases the weights and loads the new ones afresh (a clear and a bootstrap load) "
           "instead of writing into them: every parameter gets new storage under the engine's graphs")
    kills = frozenset({"CTL-UPDATE-IN-PLACE"})

    def patches(self):
        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                self.manager.clear()
                return super()._update_weights(version, verify_checksum)

        return _control(Control)


class UpdateWeightsVersionNotStamped(Mutant):
    id = "ctl_update_weights_version_not_stamped"
    bug = "update_weights loads the version asked for but the session keeps reporting the version it had"
    kills = frozenset({"CTL-UPDATE-VERSION"})

    def patches(self):
        real = _c._step_version

        def no_step(version):
            real(version)  # still refused when not a step number
            return None

        return {"reference.control_v1._step_version": no_step}


class UpdateWeightsIgnoresVersion(Mutant):
    id = "ctl_update_weights_ignores_version"
    bug = ("update_weights drops the version argument and asks for the session's configured step (the bootstrap "
           "version), reporting that one")
    kills = frozenset({"CTL-UPDATE-VERSION"})

    def patches(self):
        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                return super()._update_weights(None, verify_checksum)

        return _control(Control)


class UpdateWeightsDropsChecksum(Mutant):
    id = "ctl_update_weights_drops_checksum"
    bug = "update_weights never passes verify_checksum on (the library is always asked not to verify)"
    kills = frozenset({"CTL-UPDATE-CHECKSUM"})

    def patches(self):
        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                return super()._update_weights(version, False)

        return _control(Control)


class UpdateWeightsStampsOnFailure(Mutant):
    id = "ctl_update_weights_stamps_on_failure"
    bug = "update_weights stamps the version it was asked for before the transfer, and keeps it when the transfer fails"
    kills = frozenset({"CTL-UPDATE-VERSION", "CTL-UPDATE-CHECKSUM"})

    def patches(self):
        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                step = _c._step_version(version)
                try:
                    return super()._update_weights(version, verify_checksum)
                finally:
                    if step is not None and self.is_paused():
                        self.manager.version = step

        return _control(Control)


# -- sleep -------------------------------------------------------------------------------------------------
class SleepWeightLeavesDraft(Mutant):
    id = "ctl_sleep_weight_leaves_draft"
    bug = ("sleep of 'weight' releases the main model's parameters only: the draft (MTP) model stays loaded, its "
           "memory never given back (a runner that clears self.model and forgets the proposer's)")
    kills = frozenset({"CTL-SLEEP-RELEASES"})

    def patches(self):
        class Control(_c.Control):
            def _sleep(self, wanted):
                if "weight" not in wanted or "weight" in self.asleep or len(self.manager.model_list) < 2:
                    return super()._sleep(wanted)
                self.pause()
                draft = {n for model in self.manager.model_list[1:] for n in model.state_dict()}
                for name, param in self.manager.params.items():
                    if name not in draft:
                        param._clear_data()
                self.manager.status = Status.CLEARED
                self.asleep.add("weight")
                return super()._sleep([t for t in wanted if t != "weight"])

        return _control(Control)


class SleepTagLoopReturnsEarly(Mutant):
    id = "ctl_sleep_tag_loop_returns_early"
    bug = ("sleep returns from the whole call when a tag is already asleep, skipping the tags after it "
           "(FastDeploy's runner, fd-spec rule 35): sleep of weight and kv_cache with the weights asleep keeps the KV cache")
    kills = frozenset({"CTL-TAGS-ONE-AT-A-TIME"})

    def patches(self):
        class Control(_c.Control):
            def _sleep(self, wanted):
                self.pause()
                for tag in wanted:
                    if tag in self.asleep:
                        return
                    super()._sleep([tag])

        return _control(Control)


class WakeupTagLoopReturnsEarly(Mutant):
    id = "ctl_wakeup_tag_loop_returns_early"
    bug = ("wakeup returns from the whole call when a tag is not asleep, skipping the tags after it (FastDeploy's "
           "runner, fd-spec rule 35): wakeup of weight and kv_cache with the KV cache awake never reloads the weights")
    kills = frozenset({"CTL-TAGS-ONE-AT-A-TIME", "CTL-WAKEUP-RESTORES"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                for tag in ("kv_cache", "weight"):
                    if tag in wanted and tag not in self.asleep:
                        return
                super()._wakeup(wanted)

        return _control(Control)


class SleepWithoutPause(Mutant):
    id = "ctl_sleep_without_pause"
    bug = "sleep releases what its tags name without pausing first: requests keep running on released memory"
    kills = frozenset({"CTL-SLEEP-PAUSES-FIRST", "CTL-IS-PAUSED"})

    def patches(self):
        class Control(_c.Control):
            def pause(self):
                if self.running == "sleep":
                    return
                super().pause()

        return _control(Control)


class SleepKvTakesWeights(Mutant):
    id = "ctl_sleep_kv_takes_weights"
    bug = "sleep of 'kv_cache' also releases the weights (one release for every tag)"
    kills = frozenset({"CTL-SLEEP-RELEASES"})

    def patches(self):
        class Control(_c.Control):
            def _sleep(self, wanted):
                super()._sleep(tuple(dict.fromkeys([*wanted, "weight"])))

        return _control(Control)


class SleepKvReleasedAgain(Mutant):
    id = "ctl_sleep_kv_released_again"
    bug = "sleep releases the KV cache whenever its tag is named, also when it already sleeps (a double free)"
    kills = frozenset({"CTL-TAGS-ONE-AT-A-TIME"})

    def patches(self):
        class Control(_c.Control):
            def _sleep(self, wanted):
                again = "kv_cache" in wanted and "kv_cache" in self.asleep
                super()._sleep(wanted)
                if again:
                    self._kv(release=True)

        return _control(Control)


# -- wakeup --------------------------------------------------------------------------------------------------
class WakeupResumesAfterFailure(Mutant):
    id = "ctl_wakeup_resumes_after_failure"
    bug = "wakeup resumes the engine whatever happened (a resume in a finally): a failed reload is then served"
    kills = frozenset({"CTL-WAKEUP-RESUMES", "CTL-IS-PAUSED", "CTL-ROUTED-LEGACY"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                try:
                    super()._wakeup(wanted)
                finally:
                    self.resume()

        return _control(Control)


class WakeupMarksAwakeWithoutReload(Mutant):
    id = "ctl_wakeup_marks_awake_without_reload"
    bug = ("wakeup marks the weights awake and resumes without reloading them when the manager says its first load "
           "is done (FastDeploy's reload_model_weights returns at once while first_load is set: a reload of nothing)")
    kills = frozenset({"CTL-WAKEUP-RELOADS", "CTL-WAKEUP-RESTORES"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                if "weight" in wanted:
                    self.asleep.discard("weight")
                super()._wakeup(wanted)

        return _control(Control)


class WakeupDoesNotVerify(Mutant):
    id = "ctl_wakeup_does_not_verify"
    bug = ("wakeup reloads from the source without the verification of a commit (FastDeploy's runner calls "
           "reload_model_weights, never finalize_update): a source lacking a parameter wakes up with it unloaded")
    kills = frozenset({"CTL-WAKEUP-RELOADS", "CTL-WAKEUP-RESUMES", "CTL-STATUS-CONSISTENT", "CTL-ROUTED-LEGACY",
                       "CTL-IS-PAUSED", "CTL-EVERY-RANK"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                try:
                    super()._wakeup(wanted)
                except (RuntimeError, RankFailure) as e:
                    if "verification failed" not in str(e) and not isinstance(e, RankFailure):
                        raise
                    self.asleep.discard("weight")
                    self.resume()

        return _control(Control)


class WakeupRecapturesBeforeReload(Mutant):
    id = "ctl_wakeup_recaptures_before_reload"
    bug = ("wakeup recaptures the graphs before it reloads the weights (on the released memory), not after the "
           "last parameter landed")
    kills = frozenset({"CTL-WAKEUP-RECAPTURES"})

    def patches(self):
        import dataclasses

        class Control(_c.Control):
            def _wakeup(self, wanted):
                manager, options = self.manager, self.manager.commit_options
                if options.recapture is None or "weight" not in wanted or "weight" not in self.asleep:
                    return super()._wakeup(wanted)
                options.recapture(sorted(manager.params))
                manager.commit_options = dataclasses.replace(options, recapture=None)
                try:
                    super()._wakeup(wanted)
                finally:
                    manager.commit_options = options

        return _control(Control)


class WakeupIgnoresGraphOrder(Mutant):
    id = "ctl_wakeup_ignores_graph_order"
    bug = ("with CUDA graphs, wakeup of the weights alone while the KV cache sleeps reloads and recaptures anyway "
           "(on no KV cache), and a wakeup of both reloads the weights first")
    kills = frozenset({"CTL-WAKEUP-ORDER"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                if "weight" in wanted and "weight" in self.asleep:
                    if self.manager.status != Status.CLEARED:
                        self.manager.clear()
                    self.manager.update()
                    self.asleep.discard("weight")
                super()._wakeup(wanted)

        return _control(Control)


class WakeupRestoresAwakeTags(Mutant):
    id = "ctl_wakeup_restores_awake_tags"
    bug = ("wakeup rebuilds and reloads every tag it names, awake or not: a second KV cache is allocated and the "
           "weights reloaded although they never slept")
    kills = frozenset({"CTL-WAKEUP-RESTORES", "CTL-TAGS-ONE-AT-A-TIME"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                self.asleep |= set(wanted)
                super()._wakeup(wanted)

        return _control(Control)


class SleepLeavesStatus(Mutant):
    id = "ctl_sleep_leaves_status"
    bug = ("sleep of the weights writes nothing to the status (FastDeploy's V1 path: clear_model_weight writes no "
           "cell): the legacy API and the worker loop believe the weights are served")
    kills = frozenset({"CTL-STATUS-CONSISTENT"})

    def patches(self):
        class Control(_c.Control):
            def _sleep(self, wanted):
                before = self.manager.status
                clear = self.manager.clear
                self.manager.clear = lambda: clear(publish=False)
                try:
                    super()._sleep(wanted)
                finally:
                    del self.manager.clear
                if "weight" in wanted:
                    self.manager.status = before

        return _control(Control)


# -- ranks -------------------------------------------------------------------------------------------------
class PeerFailureSwallowed(Mutant):
    id = "ctl_peer_failure_swallowed"
    bug = ("a rank whose own wakeup or update succeeded returns normally although a peer failed it (the fan-in "
           "read as 'my part is done'): the engine resumes on a mix of ranks")
    kills = frozenset({"CTL-EVERY-RANK"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                try:
                    super()._wakeup(wanted)
                except RankFailure:
                    self.asleep.discard("weight")

            def _update_weights(self, version, verify_checksum):
                try:
                    return super()._update_weights(version, verify_checksum)
                except RankFailure:
                    return {"version": version}

        return _control(Control)


class PeerFailureNotUndone(Mutant):
    id = "ctl_peer_failure_not_undone"
    bug = ("a rank whose own KV cache release (or rebuild) succeeded raises when a peer failed the sleep (wakeup), but "
           "does not undo its own part: it records the tag as before (awake after the failed sleep) while its engine's "
           "KV cache is released, and the next healthy sleep releases the released cache again (a double free; a "
           "rebuild of a rebuilt one after a failed wakeup)")
    kills = frozenset({"CTL-EVERY-RANK"})

    def patches(self):
        class Control(_c.Control):
            def _agreed(self, what, apply, undo=None):
                super()._agreed(what, apply)

        return _control(Control)


# -- the routed legacy pair --------------------------------------------------------------------------------
class RoutedUpdateAlwaysWakes(Mutant):
    id = "ctl_routed_update_always_wakes"
    bug = ("the routed update_model_weight always runs a wakeup and answers 'update model weight successfully', "
           "also when nothing sleeps (the legacy answer from NORMAL lost)")
    kills = frozenset({"CTL-ROUTED-LEGACY"})

    def patches(self):
        class Routed(_c.RoutedControl):
            def update_model_weight(self, timeout_s):
                return self._answer("update", False, "", self.control.wakeup)

        return {"reference.adapter.RoutedControl": Routed}


class RoutedFailureIs200(Mutant):
    id = "ctl_routed_failure_is_200"
    bug = "the routed pair answers 200 whatever the sleep or wakeup did (the error logged, not returned)"
    kills = frozenset({"CTL-ROUTED-LEGACY"})

    def patches(self):
        class Routed(_c.RoutedControl):
            def _answer(self, verb, done, already, operation):
                code, message = super()._answer(verb, done, already, operation)
                return (200, message) if code == 500 else (code, message)

        return {"reference.adapter.RoutedControl": Routed}


class RoutedWaitsForOperation(Mutant):
    id = "ctl_routed_no_refusals"
    bug = ("the routed pair answers a request made while the other operation runs as if nothing ran (the legacy "
           "400 / 403 refusals lost): a clear during a wakeup is told the weights are cleared")
    kills = frozenset({"CTL-ROUTED-LEGACY"})

    def patches(self):
        class Routed(_c.RoutedControl):
            REFUSED = {}

        return {"reference.adapter.RoutedControl": Routed}


class UpdateWeightsSharesBuffers(Mutant):
    id = "ctl_update_weights_shares_buffers"
    bug = ("update_weights hands each received tensor's buffer to its parameter (_share_buffer_to, zero-copy) "
           "instead of writing into the parameter's memory: the values are right, every storage is new")
    kills = frozenset({"CTL-UPDATE-IN-PLACE"})

    def patches(self):
        from reference import rsync as _rsync

        real_store = _rsync.store

        def store(received, params, bootstrap):
            for key, new in received.items():
                if params[key]._is_initialized():
                    new.contiguous()._share_buffer_to(params[key])
            real_store({k: v for k, v in received.items() if not params[k]._is_initialized()}, params, bootstrap)

        class Control(_c.Control):
            def _update_weights(self, version, verify_checksum):
                _rsync.store = store
                try:
                    return super()._update_weights(version, verify_checksum)
                finally:
                    _rsync.store = real_store

        return _control(Control)


class WakeupNeverRecaptures(Mutant):
    id = "ctl_wakeup_never_recaptures"
    bug = ("wakeup reloads the weights without the engine's graph recapture (the capture_model() after "
           "reload_model_weights forgotten): the graphs read the released memory")
    kills = frozenset({"CTL-WAKEUP-RECAPTURES", "CTL-WAKEUP-ORDER"})

    def patches(self):
        import dataclasses

        class Control(_c.Control):
            def _wakeup(self, wanted):
                manager, options = self.manager, self.manager.commit_options
                manager.commit_options = dataclasses.replace(options, recapture=None)
                try:
                    super()._wakeup(wanted)
                finally:
                    manager.commit_options = options

        return _control(Control)


class WakeupRefusesBothWithGraphs(Mutant):
    id = "ctl_wakeup_refuses_both_with_graphs"
    bug = ("with CUDA graphs, every wakeup that reloads the weights while the KV cache sleeps is refused, also one "
           "that names the KV cache too (FastDeploy's check tested on the state, not on the tags asked for)")
    kills = frozenset({"CTL-WAKEUP-ORDER"})

    def patches(self):
        class Control(_c.Control):
            def _wakeup(self, wanted):
                if self.cuda_graph and "weight" in wanted and {"weight", "kv_cache"} <= self.asleep:
                    raise RuntimeError(_c.GRAPH_ORDER)
                super()._wakeup(wanted)

        return _control(Control)


class SleepKvNotAgreed(Mutant):
    id = "ctl_sleep_kv_not_agreed"
    bug = ("the KV cache is released and rebuilt on each rank alone, without the ranks' agreement: a rank whose "
           "release fails fails alone, the others report a sleep that did not happen everywhere")
    kills = frozenset({"CTL-EVERY-RANK"})

    def patches(self):
        class Control(_c.Control):
            def _kv(self, release):
                if self.engine is not None:
                    (self.engine.release_kv_cache if release else self.engine.rebuild_kv_cache)()

        return _control(Control)
