"""The V1 control API: pause and resume, sleep and wakeup by tag, update_weights in place, the legacy pair routed
through them. Spec: SPEC.md § CTL (FastDeploy >= 2.6, fd-spec §2.8; issue 32).

The suite plays what surrounds the loader: the engine's KV cache and graph capture (``fixtures.engine.Engine``,
passed as ``options["engine"]`` and ``options["recapture"]``: every call recorded with what the test's probe saw
then), the trainer (any path's feed, ``conformance.paths.Route``), and the requests: :class:`Request` runs
``session.generate(step, steps)`` on a thread of its own, its ``step`` reading every parameter of the served
models (whether each holds data), and can hold a chosen step until the test releases it, so that a pause, a
sleep or a resume lands in that step. Every wait is bounded (``BOUND_S``): a call that never returns fails its
case naming it. Cases come from each rule's ``Modes:`` line (``conformance.modes.params``), each requiring the
capabilities its modes need. The multi-rank cases run two ranks in forked processes joined in one gloo group
(``two_ranks``): three in the quick run, every case with ``-m multirank``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass

import pytest

from conformance import check, harness, modes, thread_state
from conformance.rank_group import _free_port, _join  # the quick run's forked ranks join the same way
from conformance.paths import Route, route  # noqa: F401 (the fixture)
from weightsync.fixtures import engine as E
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S

MAIN = (("embed.weight", "float32", (4, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))
DRAFT = (("mtp_block.0.proj.weight", "float32", (4, 4)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))
SPECS = {"main": M.spec(*MAIN), "draft": M.spec(*MAIN, mtp=[DRAFT])}
STEPS = 5
POSITION = {"first": 0, "middle": 2, "last": 4, "first-step": 0, "middle-step": 2, "last-step": 4}
HOLD_S = 0.05  # how long the suite waits to see that a call which must wait has not returned
READ_S = 2.0  # is_paused() must answer within this, whatever runs (a loaded 2-core machine included)
BOUND_S = 10.0  # every wait for a call or a request


@dataclass
class Held:
    """One parameter's storage at a moment: its address (None: it holds no memory) and a view that keeps the memory
    alive, so that its address cannot be handed out again while a verdict needs it (as test_storage.py holds it)."""

    address: int | None
    keep: object = None


def hold(models) -> dict[str, Held]:
    import paddle

    out = {}
    with paddle.no_grad():
        for model in models:
            for name, p in model.state_dict().items():
                if math.prod(p.shape) == 0 or not p._is_initialized():
                    out[name] = Held(None)
                else:
                    out[name] = Held(p.data_ptr(), paddle.as_strided(p, list(p.shape), list(p.strides), p.offset))
    return out


def _caps(*more):
    return lambda combo: ["control.pause", *more]


# -- the session, its engine, its requests --------------------------------------------------------------
class Rig:
    """One worker's session on ``path`` (model main or main + draft), the engine the suite plays for it, and
    the trainer; version 1 loaded (checked). ``publish(v, missing=...)`` has the trainer publish version v,
    ``missing`` the names it leaves out."""

    def __init__(self, loader, route, *, model="main", path="single", options=None, rank=0, without=()):
        self.spec = SPECS[model]
        self.path = path
        self.engine = E.Engine()
        self.route = route(path)
        self.rank = rank
        opts = {"engine": self.engine, "recapture": self.engine.recapture, **(options or {})}
        self.session = self.route.open(self.spec, rank, options=opts, without=without)
        self.models = self.session.models
        self.states = {}
        self.publish(1)
        self.route.update(rank)
        self.expect(1, "the first load of version 1")

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.spec.all_params]

    def state(self, version: int) -> dict:
        if version not in self.states:
            self.states[version] = M.state(self.spec, version=version)
        return self.states[version]

    def publish(self, version: int, missing=(), layout=None) -> None:
        st = {n: a for n, a in self.state(version).items() if n not in set(missing)}
        self.route.publish(self.rank, st, version, layout)

    def loaded(self) -> dict[str, bool]:
        """name -> whether the parameter holds data (read from the layers, as a forward pass does)."""
        out = {}
        for model in self.models:
            for name, p in model.state_dict().items():
                out[name] = bool(p._is_initialized())
        return out

    def expect(self, version: int, where: str) -> None:
        check.params_equal(self.session.observe(), self.state(version), f"{self.path}: {where}")

    def released(self, where: str) -> None:
        still = sorted(n for n, up in self.loaded().items() if up)
        check.that(not still, f"{self.path}: {where}: parameters still loaded (must be released): {still}")

    def version_of(self) -> str:
        """Which published version every parameter holds: "v{N}", "released", or "mixed: ..."."""
        observed = self.session.observe()
        if all(observed[n].data is None for n in self.names):
            return "released"
        for version, st in self.states.items():
            if all(observed[n].data == st[n].tobytes() for n in self.names):
                return f"v{version}"
        return "mixed: " + ", ".join(f"{n}={'none' if observed[n].data is None else 'data'}" for n in self.names)


class Request(threading.Thread):
    """``session.generate(step, STEPS)`` on a thread of its own. Each step records when it started and whether
    every parameter held data then; step ``hold_at`` waits (bounded) until ``release`` is set."""

    def __init__(self, rig: Rig, hold_at: int | None = None, name: str = "request"):
        super().__init__(name=f"conformance-{name}", daemon=True)
        self.rig, self.hold_at = rig, hold_at
        self.started = [threading.Event() for _ in range(STEPS)]
        self.release = threading.Event()
        self.steps: list[tuple[int, float, bool]] = []  # (step, started at, every parameter loaded)
        self.result = self.error = None
        self.done = threading.Event()
        self.start()

    def _step(self, i: int) -> None:
        t = time.monotonic()
        whole = all(self.rig.loaded().values())
        self.started[i].set()
        if i == self.hold_at:
            self.release.wait(BOUND_S)
        whole = whole and all(self.rig.loaded().values())
        self.steps.append((i, t, whole))

    def run(self):
        try:
            self.result = tuple(self.rig.session.generate(self._step, STEPS))
        except BaseException as e:  # noqa: BLE001 (judged by the test)
            self.error = e
        finally:
            self.done.set()

    def wait_held(self, where: str) -> None:
        check.that(self.started[self.hold_at].wait(BOUND_S), f"{where}: the request never reached its step {self.hold_at}")

    def finish(self, where: str):
        self.release.set()
        check.that(self.done.wait(BOUND_S), f"{where}: generate() had not returned {BOUND_S:g}s on")
        check.that(self.error is None, f"{where}: generate() raised {type(self.error).__name__}: {self.error}")
        return self.result


class Call(threading.Thread):
    """One control call on a thread of its own; ``returned`` is set when it returns or raises."""

    def __init__(self, what: str, fn):
        super().__init__(name=f"conformance-{what}", daemon=True)
        self.what, self.fn = what, fn
        self.returned = threading.Event()
        self.error = self.value = None
        self.at = None
        self.start()

    def run(self):
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 (judged by the test)
            self.error = e
        finally:
            self.at = time.monotonic()
            self.returned.set()

    def join_ok(self, where: str):
        check.that(self.returned.wait(BOUND_S), f"{where}: {self.what} had not returned {BOUND_S:g}s on")
        check.that(self.error is None, f"{where}: {self.what} raised {type(self.error).__name__}: {self.error}")
        return self.value


def read_paused(session, where: str) -> bool:
    """``is_paused()`` from another thread, which must answer within ``READ_S``."""
    call = Call("is_paused()", session.is_paused)
    check.that(call.returned.wait(READ_S), f"{where}: is_paused() had not answered {READ_S:g}s on (it waits for the "
                                           "operation under way)")
    check.that(call.error is None, f"{where}: is_paused() raised {type(call.error).__name__}: {call.error}")
    return call.value


def served(rig: Rig, where: str) -> None:
    """A request arriving now runs every step on whole weights."""
    result = Request(rig, name="served").finish(where)
    check.equal(result, ("finished", STEPS), f"{where}: a request's answer")


def refused_request(rig: Rig, where: str) -> None:
    request = Request(rig, name="refused")
    check.equal(request.finish(where), ("aborted", 0), f"{where}: a request arriving while paused")
    check.equal(len(request.steps), 0, f"{where}: steps run by a request arriving while paused")


def settle(call: Call) -> None:
    """Give a call that must wait the time to show it: until its thread is blocked in a wait (or ended, or
    spinning), then ``HOLD_S`` more; never a bare delay from its start (on a loaded machine the thread may not
    have run at all yet, and the request held would go on as if nothing had been called)."""
    thread_state.blocked(call, BOUND_S)
    time.sleep(HOLD_S)


def pause_if_claimed(rig: Rig, caps) -> None:
    if "control.pause" in caps:
        rig.session.pause()


# -- CTL-PAUSE-ABORTS ------------------------------------------------------------------------------------
@pytest.mark.rule("CTL-PAUSE-ABORTS")
@pytest.mark.parametrize("combo", modes.params("CTL-PAUSE-ABORTS", requires=_caps()))
def test_pause_aborts_in_flight_and_refuses_new_work(loader, route, combo):
    rig = Rig(loader, route)
    session, phase, where = rig.session, combo["phase"], f"pause ({combo['phase']}, {combo['call']} pause)"
    if combo["call"] == "second":
        session.pause()
        second = Call("the second pause()", session.pause)
        second.join_ok(where)
        check.that(read_paused(session, where), f"{where}: is_paused() after a second pause: must stay True")
    if phase.endswith("-step"):
        k = POSITION[phase]
        request = Request(rig, hold_at=k)
        request.wait_held(where)
        pause = Call("pause()", session.pause)
        settle(pause)
        check.that(not pause.returned.is_set(), f"{where}: pause() returned while step {k} of a request was still running")
        released_at = time.monotonic()
        request.release.set()
        pause.join_ok(where)
        result = request.finish(where)
        check.equal(result, ("aborted", k + 1), f"{where}: the answer of the request in flight (held in step {k} of "
                                                f"{STEPS}) when pause() began")
        late = [i for i, t, _ in request.steps if t > released_at]
        check.that(not late, f"{where}: step(s) {late} started after pause() began waiting (must be none)")
    elif combo["call"] == "first":
        session.pause()
    check.that(read_paused(session, where), f"{where}: is_paused() after pause(): must be True")
    if phase == "arriving" or phase.endswith("-step"):
        refused_request(rig, where)
    session.resume()
    served(rig, f"{where}, then resume()")


# -- CTL-RESUME-NOOP -------------------------------------------------------------------------------------
@pytest.mark.rule("CTL-RESUME-NOOP")
@pytest.mark.parametrize("combo", modes.params("CTL-RESUME-NOOP", requires=_caps()))
def test_resume_when_not_paused_changes_nothing(loader, route, combo):
    rig = Rig(loader, route)
    session, where = rig.session, f"resume ({combo['state']}, request {combo['request']})"
    if combo["state"] == "resumed":
        session.pause()
        session.resume()
    request = Request(rig, hold_at=1) if combo["request"] == "in-flight" else None
    if request is not None:
        request.wait_held(where)
    Call("resume()", session.resume).join_ok(where)
    check.that(not read_paused(session, where), f"{where}: is_paused() after resume() of an engine not paused: must be False")
    if request is not None:
        check.equal(request.finish(where), ("finished", STEPS), f"{where}: the request in flight through resume()")
    served(rig, f"{where}, a request after")


# -- CTL-IS-PAUSED ---------------------------------------------------------------------------------------
def _is_paused_caps(combo):
    op, caps = combo["operation"], ["control.pause"]
    if op in ("sleep", "wakeup"):
        caps.append("control.sleep")
        if combo["moment"] == "during" or (op == "sleep" and combo["outcome"] == "failed"):
            caps.append("control.kv_cache")
    if op == "update":
        caps += ["control.update_in_place", "stream.rsync"]
    return caps


@pytest.mark.rule("CTL-IS-PAUSED")
@pytest.mark.parametrize("combo", modes.params("CTL-IS-PAUSED", requires=_is_paused_caps))
def test_is_paused_tells_the_truth_throughout(loader, route, combo):
    op, outcome, moment = combo["operation"], combo["outcome"], combo["moment"]
    where = f"is_paused() {moment} {op} ({outcome})"
    rig = Rig(loader, route, path="rsync" if op == "update" else "single")
    session = rig.session
    check.that(not read_paused(session, f"{where}: before anything"), f"{where}: is_paused() before any pause: must be False")
    during: list = []

    def probe_at(call):
        def probe(name):
            if name == call:
                during.append(read_paused(session, where))
        return probe

    if op == "pause":
        if moment == "during":
            request = Request(rig, hold_at=1)
            request.wait_held(where)
            pause = Call("pause()", session.pause)
            settle(pause)
            during.append(read_paused(session, where))
            request.finish(where)
            pause.join_ok(where)
        else:
            session.pause()
        want_after = True
    elif op == "resume":
        session.pause()
        session.resume()
        want_after = False
    elif op == "sleep":
        if moment == "during":
            rig.engine.probe = probe_at("release_kv_cache")
        if outcome == "failed":
            rig.engine.fail("release_kv_cache", RuntimeError("the suite's KV cache refuses to be released"))
        tags = ["weight", "kv_cache"] if (moment == "during" or outcome == "failed") else ["weight"]
        if outcome == "failed":
            with check.refused(Exception, where=where):
                session.sleep(tags)
        else:
            session.sleep(tags)
        want_after = True
    elif op == "wakeup":
        tags = ["weight", "kv_cache"] if moment == "during" else ["weight"]
        session.sleep(tags)
        rig.publish(2, missing=[rig.names[-1]] if outcome == "failed" else ())
        if moment == "during":
            rig.engine.probe = probe_at("rebuild_kv_cache")
        if outcome == "failed":
            with check.refused(Exception, where=where):
                session.wakeup(tags)
        else:
            session.wakeup(tags)
        want_after = outcome == "failed"
    else:  # update_weights
        session.pause()
        trainer = rig.route.feed._trainer(0)
        state = rig.state(2)
        fault = ("corrupt", 1) if outcome == "failed" else None
        trainer.serve(S.stream_of(state, fault=fault, pauses={len(state) - 1: 0.3} if moment == "during" else {}))
        update = Call("update_weights()", lambda: session.update_weights(version="2", verify_checksum=True))
        if moment == "during":
            check.that(trainer.wait_for(lambda: trainer.sent() >= len(state) - 1, BOUND_S),
                       f"{where}: the trainer never got to its last item")
            during.append(read_paused(session, where))
        check.that(update.returned.wait(BOUND_S), f"{where}: update_weights() had not returned")
        check.that((update.error is None) == (outcome == "ok"),
                   f"{where}: update_weights() {'raised ' + repr(update.error) if update.error else 'returned'}")
        want_after = True
    if moment == "during" and op != "pause":  # (during the pause's drain: either answer, read in time)
        check.that(during and all(during), f"{where}: is_paused() read during the operation: {during} (must be True)")
    check.equal(read_paused(session, where), want_after, f"{where}: is_paused() after it")


# -- the update in place: CTL-UPDATE-* -------------------------------------------------------------------
def _stream_rig(loader, route, model="main") -> Rig:
    return Rig(loader, route, model=model, path="rsync")


def _serve(rig: Rig, version: int, fault=None) -> None:
    rig.route.feed._trainer(rig.rank).serve(S.stream_of(rig.state(version), fault=fault))


def _version(rig: Rig, caps):
    """``version()`` where the loader claims ``version`` (a loader need not report the first load's: the
    streamed first load carries none in-band), else None."""
    return rig.session.version() if "version" in caps else None


def _reported(rig: Rig, caps, want, where: str) -> None:
    if "version" in caps:
        check.equal(rig.session.version(), want, f"{where}: version()")


@pytest.mark.rule("CTL-UPDATE-PAUSED-ONLY")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-UPDATE-PAUSED-ONLY", requires=lambda c: ["control.pause", "control.update_in_place", "stream.rsync"]))
def test_update_weights_is_refused_unless_paused(loader, route, impl, combo):
    rig = _stream_rig(loader, route)
    session, verify = rig.session, combo["verify"] == "on"
    where = f"update_weights on an engine {combo['state']} (verify_checksum {verify})"
    if combo["state"] == "resumed":
        session.pause()
        session.resume()
    trainer = rig.route.feed._trainer(0)
    hellos = len(trainer.of("hello"))
    _serve(rig, 2)
    before = session.version() if "version" in impl.capabilities else None
    with check.raises(Exception, match=r"(?i)pause", where=where):
        session.update_weights(version="2", verify_checksum=verify)
    rig.expect(1, f"{where}: after the refusal")
    _reported(rig, impl.capabilities, before, where)
    check.equal(len(trainer.of("hello")), hellos, f"{where}: streams the trainer was asked for by the refused call")
    served(rig, f"{where}: a request after the refusal")
    session.pause()
    result = session.update_weights(version="2", verify_checksum=verify)
    check.equal(str(result["version"]), "2", f"{where}: then paused, the same call's result")
    rig.expect(2, f"{where}: then paused, the same call")


@pytest.mark.rule("CTL-UPDATE-IN-PLACE")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-UPDATE-IN-PLACE",
    requires=lambda c: ["control.update_in_place", "stream.rsync", *(["mtp"] if c["model"] == "draft" else [])]))
def test_update_weights_keeps_every_storage(loader, route, impl, combo):
    rig = _stream_rig(loader, route, combo["model"])
    pause_if_claimed(rig, impl.capabilities)
    calls = {"first": 1, "second": 2, "third": 3}[combo["call"]]
    for n in range(calls):
        version = n + 2
        where = f"update_weights to version {version} ({combo['call']} update, {combo['model']})"
        before = hold(rig.models)
        objects = _objects(rig)
        _serve(rig, version)
        rig.session.update_weights(version=str(version), verify_checksum=False)
        rig.expect(version, where)
        after, now = hold(rig.models), _objects(rig)
        moved = sorted(n for n in before if before[n].address != after[n].address or objects[n] is not now[n])
        check.that(not moved, f"{where}: parameter(s) left the storage they had (name, address before, after, same "
                              f"object): {[(n, before[n].address, after[n].address, objects[n] is now[n]) for n in moved]}; "
                              "an update in place keeps it")


def _objects(rig: Rig) -> dict:
    return {name: p for model in rig.models for name, p in model.state_dict().items()}


@pytest.mark.rule("CTL-UPDATE-NO-RESUME")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-UPDATE-NO-RESUME", requires=lambda c: ["control.pause", "control.update_in_place", "stream.rsync"]))
def test_update_weights_never_resumes(loader, route, combo):
    rig = _stream_rig(loader, route)
    session = rig.session
    session.pause()
    calls = 1 if combo["call"] == "first" else 2
    for n in range(calls):
        last = n == calls - 1
        fail = last and combo["outcome"] == "failed"
        where = f"update_weights {n + 1} of {calls} ({'failed' if fail else 'ok'})"
        _serve(rig, n + 2, fault=("corrupt", 1) if fail else None)
        if fail:
            with check.refused(Exception, where=where):
                session.update_weights(version=str(n + 2), verify_checksum=True)
        else:
            session.update_weights(version=str(n + 2), verify_checksum=True)
        check.that(read_paused(session, where), f"{where}: is_paused() after update_weights: must stay True")
        refused_request(rig, where)
    session.resume()
    served(rig, f"after {calls} update(s) and resume()")


@pytest.mark.rule("CTL-UPDATE-VERSION")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-UPDATE-VERSION", requires=lambda c: ["control.update_in_place", "stream.rsync"]))
def test_update_weights_stamps_its_version(loader, route, impl, combo):
    rig = _stream_rig(loader, route)
    pause_if_claimed(rig, impl.capabilities)
    count = {"first": 1, "second": 2, "third": 3}[combo["call"]]
    served_version, reported = 1, _version(rig, impl.capabilities)
    for n in range(count):
        version = n + 2
        fail = n == count - 1 and combo["outcome"] == "failed"
        where = f"update_weights(version='{version}') ({'failed' if fail else 'ok'}, update {n + 1})"
        _serve(rig, version, fault=("corrupt", 0) if fail else None)
        if fail:
            with check.refused(Exception, where=where):
                rig.session.update_weights(version=str(version), verify_checksum=True)
        else:
            result = rig.session.update_weights(version=str(version), verify_checksum=True)
            check.that(isinstance(result, dict) and str(result.get("version")) == str(version),
                       f"{where}: the result's version: got {result!r}, expected {version!r}")
            served_version = reported = version
        rig.expect(served_version, where)
        _reported(rig, impl.capabilities, reported, where)


@pytest.mark.rule("CTL-UPDATE-VERSION")
@pytest.mark.requires("control.update_in_place", "stream.rsync")
@pytest.mark.parametrize("outcome", [pytest.param(o, marks=pytest.mark.modes(outcome=o, call="second"), id=o)
                                     for o in ("ok", "failed")])
def test_the_version_asked_for_is_that_calls_only(loader, route, impl, outcome):
    """A session configured without a version (each update's step from version.yaml, as a bootstrap's):
    ``update_weights(version='2')``, which commits or fails, asks for step 2 in that call only; the next
    ``update_weights()`` without a version asks for the step version.yaml names then (3), and stamps it."""
    rig = Rig(loader, route, path="rsync", without=("version",))
    pause_if_claimed(rig, impl.capabilities)
    first = f"update_weights(version='2') ({outcome}{': the trainer failing the stream after 1 item' if outcome == 'failed' else ''})"
    _serve(rig, 2, fault=("fail", 1) if outcome == "failed" else None)
    if outcome == "failed":
        with check.refused(Exception, where=first):
            rig.session.update_weights(version="2")
    else:
        rig.session.update_weights(version="2")
    S.write_version_file(loader.model_dir, "step: 3\n")
    # The step also as FastDeploy read it before #7171 (version.txt): this rule judges which call a version
    # belongs to; the file that names the step is RSYNC-VERSION's.
    with open(os.path.join(loader.model_dir, "version.txt"), "w", encoding="utf-8") as f:
        f.write("3\n")
    _serve(rig, 3)
    where = f"update_weights() without a version after {first}, version.yaml (and version.txt) naming step 3"
    result = rig.session.update_weights()
    check.that(isinstance(result, dict) and str(result.get("version")) == "3",
               f"{where}: the result's version: got {result!r}, expected '3' (a version asked for by an earlier call "
               "is that call's only)")
    rig.expect(3, where)  # (version(): a step read from version.yaml is RSYNC-VERSION's)


@pytest.mark.rule("CTL-UPDATE-CHECKSUM")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-UPDATE-CHECKSUM",
    requires=lambda c: ["control.update_in_place", "stream.rsync", *(["mtp"] if c["model"] == "draft" else [])]))
def test_update_weights_refuses_a_bad_checksum(loader, route, impl, combo):
    rig = _stream_rig(loader, route, combo["model"])
    pause_if_claimed(rig, impl.capabilities)
    served_version, reported = 1, _version(rig, impl.capabilities)
    if combo["call"] == "second":
        _serve(rig, 2)
        rig.session.update_weights(version="2", verify_checksum=True)
        served_version = reported = 2
    names = rig.names
    # the corrupted item: the draft's first parameter, or the first / middle / last of the stream's order
    draft = [i for i, n in enumerate(names) if n.startswith("mtp_")]
    pick = {"first": 0, "middle": len(names) // 2, "last": len(names) - 1}[combo["position"]]
    k = draft[min(pick, len(draft) - 1)] if combo["model"] == "draft" else pick
    version = served_version + 1
    where = f"update_weights(version='{version}', verify_checksum=True), item {k} ({names[k]}) corrupted"
    _serve(rig, version, fault=("corrupt", k))
    with check.raises(Exception, match=r"(?i)checksum", where=where):
        rig.session.update_weights(version=str(version), verify_checksum=True)
    rig.expect(served_version, f"{where}: the weights served before")
    _reported(rig, impl.capabilities, reported, where)
    _serve(rig, version + 1)
    rig.session.update_weights(version=str(version + 1), verify_checksum=True)
    rig.expect(version + 1, f"{where}: the next, healthy update")


# -- sleep: CTL-SLEEP-* ----------------------------------------------------------------------------------
TAGSETS = {"weight": ["weight"], "kv_cache": ["kv_cache"], "both": ["weight", "kv_cache"]}


def _tag_caps(*tagsets, more=()):
    caps = ["control.sleep", *more]
    if any(t in ("kv_cache", "both") for t in tagsets):
        caps.append("control.kv_cache")
    return caps


def _kv_calls(rig: Rig) -> list[str]:
    return [c.name for c in rig.engine.calls if c.name != "recapture"]


@pytest.mark.rule("CTL-SLEEP-RELEASES")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-SLEEP-RELEASES", requires=lambda c: _tag_caps(c["tag"], more=["mtp"] if c["model"] == "draft" else [])))
def test_sleep_releases_exactly_its_tags(loader, route, combo):
    rig = Rig(loader, route, model=combo["model"])
    session, tags = rig.session, TAGSETS[combo["tag"]]
    if combo["call"] == "second":
        session.sleep(tags)
        session.wakeup(tags)
        rig.expect(1, f"sleep {tags} and wakeup: version 1 back")
    where = f"sleep({tags}) ({combo['call']} sleep, {combo['model']})"
    kv_before = len(_kv_calls(rig))
    session.sleep(tags)
    if "weight" in tags:
        rig.released(where)
    else:
        rig.expect(1, f"{where}: the weights (untouched)")
    kv = _kv_calls(rig)[kv_before:]
    check.equal(kv, ["release_kv_cache"] if "kv_cache" in tags else [], f"{where}: the engine's KV-cache calls")


@pytest.mark.rule("CTL-SLEEP-PAUSES-FIRST")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-SLEEP-PAUSES-FIRST", requires=lambda c: _tag_caps(c["tag"], more=["control.pause"])))
def test_sleep_pauses_before_it_releases(loader, route, combo):
    rig = Rig(loader, route)
    session, tags = rig.session, TAGSETS[combo["tag"]]
    where = f"sleep({tags}) with request {combo['request']}"
    stepping = []
    rig.engine.probe = lambda name: {"stepping": bool(stepping)}
    request = None
    if combo["request"] == "in-flight":
        request = Request(rig, hold_at=1)
        request.wait_held(where)
        stepping.append(1)
    sleep = Call("sleep()", lambda: session.sleep(tags))
    if request is not None:
        settle(sleep)
        check.that(not sleep.returned.is_set(), f"{where}: sleep() returned while a step of a request was running")
        if "weight" in tags:
            check.that(all(rig.loaded().values()), f"{where}: the weights were released while a step was running")
        check.equal(_kv_calls(rig), [], f"{where}: the engine's KV-cache calls while a step was running")
        stepping.clear()
        result = request.finish(where)
        check.equal(result, ("aborted", 2), f"{where}: the request in flight (held in step 1 of {STEPS})")
        torn = [i for i, _, whole in request.steps if not whole]
        check.that(not torn, f"{where}: step(s) {torn} read released parameters")
    sleep.join_ok(where)
    released = [c for c in rig.engine.of("release_kv_cache") if c.seen.get("stepping")]
    check.that(not released, f"{where}: the engine's KV cache was released while a step was running")
    check.that(read_paused(session, where), f"{where}: is_paused() after sleep: must be True")
    refused_request(rig, where)


# -- wakeup: CTL-WAKEUP-* --------------------------------------------------------------------------------
@pytest.mark.rule("CTL-WAKEUP-RELOADS")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-WAKEUP-RELOADS",
    requires=lambda c: ["control.sleep", modes.CAPABILITY_OF_PATH[c["path"]], *(["mtp"] if c["model"] == "draft" else [])]))
def test_wakeup_reloads_and_verifies(loader, route, combo):
    rig = Rig(loader, route, model=combo["model"], path=combo["path"])
    session = rig.session
    session.sleep(["weight"])
    rig.released(f"sleep(['weight']) on {combo['path']}")
    where = f"wakeup(['weight']) on {combo['path']} ({combo['model']}, source {combo['source']})"
    if combo["source"] == "missing":
        owner = [n for n in rig.names if n.startswith("mtp_")] if combo["model"] == "draft" else [p.name for p in rig.spec.main]
        gone = owner[-1]
        rig.publish(2, missing=[gone])
        with check.refused(Exception, where=f"{where}: {gone} missing from the source"):
            session.wakeup(["weight"])
        rig.publish(3)
        session.wakeup(["weight"])
        rig.expect(3, f"{where}: the next wakeup, from the whole source")
    else:
        rig.publish(2)
        session.wakeup(["weight"])
        rig.expect(2, where)


@pytest.mark.rule("CTL-WAKEUP-RECAPTURES")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-WAKEUP-RECAPTURES",
    requires=lambda c: ["control.sleep", "model.recapture", modes.CAPABILITY_OF_PATH[c["path"]],
                        *(["mtp"] if c["model"] == "draft" else [])]))
def test_wakeup_recaptures_before_it_returns(loader, route, combo):
    rig = Rig(loader, route, model=combo["model"], path=combo["path"])
    session = rig.session
    session.sleep(["weight"])
    rig.publish(2)
    rig.engine.probe = lambda name: {"held": hold(rig.models)} if name == "recapture" else None
    recaptures = len(rig.engine.of("recapture"))
    returned = Call("wakeup()", lambda: session.wakeup(["weight"]))
    returned.join_ok(f"wakeup on {combo['path']}")
    where = f"wakeup(['weight']) on {combo['path']} ({combo['model']})"
    rig.expect(2, where)
    calls = rig.engine.of("recapture")[recaptures:]
    check.that(len(calls) >= 1, f"{where}: options['recapture'] was not called (the reloaded weights have new memory)")
    final = hold(rig.models)
    holding = sorted(n for n, h in final.items() if h.address is not None)
    covered = set()
    for call in calls:
        seen = call.seen["held"]
        covered |= {n for n in call.names if n in final and n in seen and seen[n].address == final[n].address}
    missing = sorted(set(holding) - covered)
    check.that(not missing, f"{where}: parameter(s) {missing} not named by a recapture call made after they reached "
                            f"the storage they end in (calls named {[list(c.names) for c in calls]})")


def _fault_caps(combo):
    return ["control.sleep", "control.pause", *(["control.kv_cache"] if combo["fault"] == "kv-rebuild" else [])]


@pytest.mark.rule("CTL-WAKEUP-RESUMES")
@pytest.mark.parametrize("combo", modes.params("CTL-WAKEUP-RESUMES", requires=_fault_caps))
def test_wakeup_resumes_only_after_success(loader, route, combo):
    rig = Rig(loader, route)
    session, fault = rig.session, combo["fault"]
    tags = ["weight", "kv_cache"] if fault == "kv-rebuild" else ["weight"]
    version = 1
    if combo["call"] == "second":
        session.sleep(tags)
        rig.publish(2)
        session.wakeup(tags)
        version = 2
        served(rig, "after a first sleep/wakeup cycle")
    session.sleep(tags)
    version += 1
    where = f"wakeup({tags}) ({combo['call']} cycle, fault {fault})"
    if fault == "none":
        rig.publish(version)
        session.wakeup(tags)
        check.that(not read_paused(session, where), f"{where}: is_paused() after a successful wakeup: must be False")
        rig.expect(version, where)
        served(rig, where)
        return
    if fault == "reload":
        rig.publish(version, missing=[rig.names[-1]])
    else:
        rig.publish(version)
        rig.engine.fail("rebuild_kv_cache", RuntimeError("the suite's KV cache cannot be rebuilt"))
    with check.refused(Exception, where=where):
        session.wakeup(tags)
    check.that(read_paused(session, where), f"{where}: is_paused() after the failed wakeup: must stay True")
    refused_request(rig, where)
    rig.publish(version + 1)
    session.wakeup(tags)
    check.that(not read_paused(session, f"{where}, then a wakeup that succeeded"),
               f"{where}, then a wakeup that succeeded: is_paused() must be False")
    rig.expect(version + 1, f"{where}, then a wakeup that succeeded")
    served(rig, f"{where}, then a wakeup that succeeded")


def _asleep_kv(rig: Rig) -> bool:
    return rig.engine.kv == E.RELEASED


@pytest.mark.rule("CTL-WAKEUP-RESTORES")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-WAKEUP-RESTORES", requires=lambda c: _tag_caps("both")))
def test_wakeup_restores_exactly_what_slept(loader, route, combo):
    rig = Rig(loader, route)
    slept, woken = TAGSETS[combo["slept"]], TAGSETS[combo["woken"]]
    rig.session.sleep(slept)
    rig.publish(2)
    before = len(_kv_calls(rig))
    rig.session.wakeup(woken)
    where = f"sleep({slept}) then wakeup({woken})"
    kv = _kv_calls(rig)[before:]
    restored, asleep = set(slept) & set(woken), set(slept) - set(woken)
    check.equal(kv, ["rebuild_kv_cache"] if "kv_cache" in restored else [], f"{where}: the engine's KV-cache calls by the wakeup")
    check.equal(_asleep_kv(rig), "kv_cache" in asleep, f"{where}: the KV cache still released")
    want = "v2" if "weight" in restored else ("released" if "weight" in asleep else "v1")
    check.equal(rig.version_of(), want, f"{where}: what the weights hold")


@pytest.mark.rule("CTL-TAGS-ONE-AT-A-TIME")
@pytest.mark.parametrize("combo", modes.params("CTL-TAGS-ONE-AT-A-TIME", requires=lambda c: _tag_caps("both")))
def test_several_tags_behave_as_one_at_a_time(loader, route, combo):
    rig = Rig(loader, route)
    session, op, before = rig.session, combo["operation"], combo["before"]
    tags = {"weight-first": ["weight", "kv_cache"], "kv-first": ["kv_cache", "weight"], "default": None}[combo["order"]]
    where = f"{op}({tags}) with {before} already {'asleep' if op == 'sleep' else 'awake'}"
    if op == "sleep":
        if before != "none":
            session.sleep([before])
    else:
        # both asleep, then the tag ``before`` woken alone: wakeup of both must still restore the other
        session.sleep(["weight", "kv_cache"])
        rig.publish(2)
        if before != "none":
            session.wakeup([before])
        rig.publish(3)
    calls = len(_kv_calls(rig))
    (session.sleep if op == "sleep" else session.wakeup)(tags)
    kv = _kv_calls(rig)[calls:]
    if op == "sleep":
        rig.released(where)
        check.equal(_asleep_kv(rig), True, f"{where}: the KV cache released")
        check.equal(kv, [] if before == "kv_cache" else ["release_kv_cache"], f"{where}: the engine's KV-cache calls")
    else:
        check.equal(_asleep_kv(rig), False, f"{where}: the KV cache rebuilt")
        check.equal(kv, [] if before == "kv_cache" else ["rebuild_kv_cache"], f"{where}: the engine's KV-cache calls")
        check.equal(rig.version_of(), "v2" if before == "weight" else "v3", f"{where}: what the weights hold")


@pytest.mark.rule("CTL-WAKEUP-ORDER")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-WAKEUP-ORDER", requires=lambda c: _tag_caps("both", more=["model.recapture"])))
def test_kv_cache_before_the_weights_graphs(loader, route, impl, combo):
    graphs = combo["graphs"] == "on"
    rig = Rig(loader, route, options={"cuda_graph": graphs})
    session, tags = rig.session, TAGSETS[combo["tags"]]
    session.sleep(["weight", "kv_cache"])
    rig.publish(2)
    where = f"wakeup({tags}) with both asleep, graphs {combo['graphs']}"
    calls = len(rig.engine.calls)
    if graphs and tags == ["weight"]:
        with check.raises(RuntimeError, match="kv_cache", where=where):
            session.wakeup(tags)
        rig.released(f"{where}: after the refusal")
        check.equal(_asleep_kv(rig), True, f"{where}: after the refusal, the KV cache released")
        check.equal([c.name for c in rig.engine.calls[calls:]], [], f"{where}: the engine's calls by the refused wakeup")
        if "control.pause" in impl.capabilities:
            check.that(read_paused(session, where), f"{where}: is_paused() after the refusal: must stay True")
        return
    session.wakeup(tags)
    rig.expect(2, where)
    made = rig.engine.calls[calls:]
    recaptures = [c for c in made if c.name == "recapture"]
    check.that(recaptures, f"{where}: no recapture after the reload")
    if graphs:
        stale = [c.kv_before for c in recaptures if c.kv_before != E.ALLOCATED]
        check.that(not stale, f"{where}: graphs recaptured with the KV cache {stale} (it must be rebuilt first); "
                              f"the engine's calls: {[c.name for c in made]}")
    check.equal(_asleep_kv(rig), "kv_cache" not in tags, f"{where}: the KV cache still released")


# -- CTL-STATUS-CONSISTENT -------------------------------------------------------------------------------
@pytest.mark.rule("CTL-STATUS-CONSISTENT")
@pytest.mark.parametrize("combo", modes.params(
    "CTL-STATUS-CONSISTENT",
    requires=lambda c: ["control.sleep", "status", *(["status.cell"] if c["cell"] == "shared" else [])]))
def test_status_and_loop_agree_with_what_sleeps(loader, route, combo):
    from weightsync.fixtures import status_cell as C

    with contextlib.ExitStack() as stack:
        options = {}
        cell = None
        if combo["cell"] == "shared":
            cell = C.Cell(C.NORMAL)
            stack.callback(cell.unlink)
            options["status_cell"] = cell.name
        rig = Rig(loader, route, options=options)
        session = rig.session
        runs: list = []

        def loop(where):
            if cell is None:
                return
            got = session.worker_iteration(lambda: runs.append(where), block=False, sync=lambda v: v)
            return got

        where = f"sleep(['weight']) (cell {combo['cell']})"
        session.sleep(["weight"])
        check.status_is(session, "CLEARED", where)
        if cell is not None:
            check.equal(C.name_of(cell.read()), "CLEARED", f"{where}: the status cell")
            loop(where)
            check.equal(runs, [], f"{where}: model runs of the worker loop while the weights sleep")
        failed = combo["outcome"] == "failed"
        rig.publish(2, missing=[rig.names[-1]] if failed else ())
        where = f"wakeup(['weight']) ({combo['outcome']}, cell {combo['cell']})"
        if failed:
            with check.refused(Exception, where=where):
                session.wakeup(["weight"])
            check.status_not(session, "NORMAL", where)
            if cell is not None:
                check.that(cell.read() != C.NORMAL, f"{where}: the status cell reads NORMAL after the failed wakeup")
                loop(where)
                check.equal(runs, [], f"{where}: model runs of the worker loop after the failed wakeup")
            return
        session.wakeup(["weight"])
        check.status_is(session, "NORMAL", where)
        if cell is not None:
            check.equal(C.name_of(cell.read()), "NORMAL", f"{where}: the status cell")
            loop(where)
            check.equal(runs, [where], f"{where}: model runs of the worker loop after the wakeup")


# -- CTL-ROUTED-LEGACY -----------------------------------------------------------------------------------
def _routed_caps(combo):
    caps = ["control.routed", "control.pause"]
    if combo["state"] in ("sleeping", "waking") or (combo["request"] == "clear" and combo["outcome"] == "failed"):
        caps.append("control.kv_cache")
    return caps


def _routed_valid(combo):
    # a failure needs the operation to run: a clear from serving, an update from asleep
    if combo.get("outcome") == "failed" and "state" in combo and "request" in combo:
        return (combo["request"], combo["state"]) in (("clear", "serving"), ("update", "asleep"))
    return True


@pytest.mark.rule("CTL-ROUTED-LEGACY")
@pytest.mark.parametrize("combo", modes.params("CTL-ROUTED-LEGACY", requires=_routed_caps, valid=_routed_valid))
def test_routed_legacy_pair_answers_as_the_legacy_api(loader, route, combo):
    rig = Rig(loader, route)
    session, api = rig.session, rig.session.routed_control()
    request, state, failed = combo["request"], combo["state"], combo["outcome"] == "failed"
    ask = api.clear_load_weight if request == "clear" else api.update_model_weight
    where = f"routed {request} while {state} ({combo['outcome']})"
    if state == "asleep":
        check.equal(api.clear_load_weight(5.0), (200, "clear model weight successfully"), f"{where}: the clear before")
        rig.publish(2, missing=[rig.names[-1]] if failed else ())
    if state in ("sleeping", "waking"):
        if state == "waking":
            session.sleep(["weight", "kv_cache"])
            rig.publish(2)
        held, go = threading.Event(), threading.Event()
        name = "release_kv_cache" if state == "sleeping" else "rebuild_kv_cache"

        def probe(call):
            if call == name:
                held.set()
                go.wait(BOUND_S)

        rig.engine.probe = probe
        running = Call(f"the {'sleep' if state == 'sleeping' else 'wakeup'}",
                       (lambda: session.sleep(["weight", "kv_cache"])) if state == "sleeping"
                       else (lambda: session.wakeup(["weight", "kv_cache"])))
        check.that(held.wait(BOUND_S), f"{where}: the engine's {name} was never called")
        answer = ask(5.0)
        go.set()
        rig.engine.probe = None
        running.join_ok(where)
        want = {("clear", "sleeping"): (400, "worker is clearing model weight already"),
                ("update", "sleeping"): (403, "worker is clearing model weight, cannot update now"),
                ("update", "waking"): (400, "worker is updating model weight already"),
                ("clear", "waking"): (403, "worker is updating model weight, cannot clear now")}[(request, state)]
        check.equal(tuple(answer), want, f"{where}: the answer")
        return
    cause = None
    if failed and request == "clear":
        cause = "refuses to be released"
        rig.engine.fail("release_kv_cache", RuntimeError(f"the suite's KV cache {cause}"))
    elif failed:
        cause = rig.names[-1]  # the parameter the source lacks
    answer = tuple(ask(5.0))
    if failed:
        check.that(answer[0] != 200 and cause in answer[1],
                   f"{where}: the answer {answer}: a failure is never 200, and its message names it ({cause!r})")
        check.that(read_paused(session, where), f"{where}: is_paused() after the failure: must stay True")
        if request == "update":
            rig.publish(3)
            check.equal(tuple(api.update_model_weight(5.0)), (200, "update model weight successfully"),
                        f"{where}: the next update, from a whole source")
            rig.expect(3, f"{where}: the next update, from a whole source")
        return
    want = {("clear", "serving"): (200, "clear model weight successfully"),
            ("clear", "asleep"): (200, "model weight is cleared"),
            ("update", "serving"): (200, "model weight is updated"),
            ("update", "asleep"): (200, "update model weight successfully")}[(request, state)]
    check.equal(answer, want, f"{where}: the answer")
    if (request, state) == ("clear", "serving") or (request, state) == ("clear", "asleep"):
        rig.released(where)
        check.that(read_paused(session, where), f"{where}: is_paused() after the routed clear: must be True")
    elif state == "asleep":
        rig.expect(2, where)
        check.that(not read_paused(session, where), f"{where}: is_paused() after the routed update: must be False")
    else:
        rig.publish(2)
        rig.expect(1, f"{where}: reloads nothing")


# -- CTL-EVERY-RANK: two ranks in forked processes, one gloo group ---------------------------------------


def two_ranks(script, timeout_s: float = 60.0) -> list[dict]:
    """``script(rank) -> JSON-able`` in two forked processes joined in one gloo group; each child's result (or
    its error) comes back through a pipe, every wait bounded; a child still running at the deadline is killed."""
    port, endpoints = _free_port(), [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    children = []
    for rank in range(2):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                _join(rank, 2, port, endpoints)
                out = {"ok": True, "value": script(rank)}
            except BaseException as e:  # noqa: BLE001 (handed to the parent)
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            os.write(write_end, json.dumps(out).encode())
            os._exit(0)  # at once: a collective stuck in a thread must not hold the child
        os.close(write_end)
        children.append((pid, read_end))
    import select

    results, deadline = [], time.monotonic() + timeout_s
    for pid, read_end in children:
        chunks = []
        while True:
            left = deadline - time.monotonic()
            ready = select.select([read_end], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                break
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(read_end)
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        os.waitpid(pid, 0)
        results.append(json.loads(b"".join(chunks) or b'{"ok": false, "error": "no result before the deadline"}'))
    return results


QUICK_RANK_CASES = ({"operation": "wakeup", "rank": "follower", "call": "first"},
                    {"operation": "update", "rank": "rank0", "call": "first"})


def _rank_caps(combo):
    caps = ["multirank", "control.sleep"]
    if combo["operation"] == "sleep":
        caps.append("control.kv_cache")
    if combo["operation"] == "update":
        caps = ["multirank", "control.update_in_place", "stream.rsync"]
    else:
        caps.append("snapshot.parts")
    return caps


def _rank_params():
    out = []
    for p in modes.params("CTL-EVERY-RANK", requires=_rank_caps):
        combo = p.values[0]
        tier = [] if combo in QUICK_RANK_CASES else [pytest.mark.multirank]
        out.append(pytest.param(*p.values, marks=[*p.marks, *tier], id=p.id))
    return out


def _digests(session) -> dict:
    return {n: (None if o.data is None else hashlib.sha256(o.data).hexdigest()) for n, o in session.observe().items()}


def _sha(state) -> dict:
    return {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in state.items()}


@contextlib.contextmanager
def _rank_rig(impl, tmp_path, rank: int, path: str):
    """In rank ``rank``'s process: its rig on ``path``, every rank's shard in one model directory, the rest of its
    files its own; its sessions, trainers and environment undone on the way out."""
    from _pytest.monkeypatch import MonkeyPatch

    from conformance.harness import Loader

    patch = MonkeyPatch()
    os.makedirs(tmp_path / f"rank{rank}", exist_ok=True)
    loader = Loader(impl, tmp_path / f"rank{rank}", patch)
    loader.model_dir = str(tmp_path / "model")  # every rank's shard in one directory
    os.makedirs(loader.model_dir, exist_ok=True)
    rig = Rig(loader, lambda p: Route(loader, p), path=path, rank=rank)
    try:
        yield rig
    finally:
        loader.close_all()
        rig.route.close()
        patch.undo()


@pytest.mark.rule("CTL-EVERY-RANK")
@pytest.mark.parametrize("combo", _rank_params())
def test_every_rank_fails_together(impl, tmp_path, combo):
    """Two ranks (rank 0 and rank 1 on physical GPUs 0 and 1), each its own session on its own shard; the
    operation fails on ``combo["rank"]``'s rank at its ``combo["call"]`` cycle; then a healthy call."""
    op, failing = combo["operation"], 0 if combo["rank"] == "rank0" else 1
    cycles = 1 if combo["call"] == "first" else 2
    caps = impl.capabilities
    spec = SPECS["main"]
    path = "rsync" if op == "update" else "parts"

    def script(rank):
        with _rank_rig(impl, tmp_path, rank, path) as rig:
            pause = "control.pause" in caps
            events = []

            def record(what, fn):
                try:
                    fn()
                    error = None
                except Exception as e:  # noqa: BLE001 (reported)
                    error = f"{type(e).__name__}: {e}"
                events.append({"what": what, "error": error, "digests": _digests(rig.session),
                               "paused": rig.session.is_paused() if pause else None})

            version = 1
            for cycle in range(cycles):
                fail_here = cycle == cycles - 1 and rank == failing
                if op == "update":
                    if pause:
                        rig.session.pause()
                    version += 1
                    _serve(rig, version, fault=("corrupt", 1) if fail_here else None)
                    record(f"update {version}", lambda: rig.session.update_weights(version=str(version), verify_checksum=True))
                elif op == "wakeup":
                    record(f"sleep {cycle}", lambda: rig.session.sleep(["weight"]))
                    version += 1
                    rig.publish(version, missing=[rig.names[-1]] if fail_here else ())
                    record(f"wakeup {version}", lambda: rig.session.wakeup(["weight"]))
                else:
                    if fail_here:
                        rig.engine.fail("release_kv_cache", RuntimeError(f"rank {rank}'s KV cache refuses to be released"))
                    record(f"sleep {cycle}", lambda: rig.session.sleep(["kv_cache"]))
                    if not fail_here and cycle < cycles - 1:
                        record(f"wakeup {cycle}", lambda: rig.session.wakeup(["kv_cache"]))
            # the healthy call after the failure
            version += 1
            if op == "update":
                _serve(rig, version)
                record(f"update {version} (healthy)", lambda: rig.session.update_weights(version=str(version), verify_checksum=True))
            elif op == "wakeup":
                rig.publish(version)
                record(f"wakeup {version} (healthy)", lambda: rig.session.wakeup(["weight"]))
            else:
                record("sleep (healthy)", lambda: rig.session.sleep(["kv_cache"]))
            return {"events": events, "kv": rig.engine.kv, "want": _sha(rig.state(version)),
                    "kept": _sha(rig.state(version - 1))}

    harness._calls["adapter"] += 1  # the ranks drive the implementation in their own processes
    results = two_ranks(script)
    where = f"{op} failing on rank {failing} at cycle {cycles}"
    for rank, r in enumerate(results):
        check.that(r["ok"], f"{where}: rank {rank} did not report: {r.get('error')}")
    reports = [r["value"] for r in results]
    failed_step = -2  # every script ends: [..., the failing call, the healthy call]
    for rank, rep in enumerate(reports):
        at = f"{where}, rank {rank}"
        event = rep["events"][failed_step]
        check.that(event["error"] is not None, f"{at}: {event['what']} returned normally although rank {failing} failed it")
        if rank != failing and event["error"] is not None:
            check.that(f"rank {failing}" in event["error"], f"{at}: the error does not name the failing rank {failing}: "
                                                            f"{event['error']!r}")
        if event["paused"] is not None:
            check.that(event["paused"], f"{at}: is_paused() after the failed {op}: must be True (no rank serves it)")
        healthy = rep["events"][-1]
        check.that(healthy["error"] is None, f"{at}: the healthy call after the failure raised {healthy['error']}")
        if op != "sleep":
            check.equal(healthy["digests"], rep["want"], f"{at}: sha256 of every parameter after the healthy call")
        if op == "sleep":
            check.equal(rep["kv"], E.RELEASED, f"{at}: the KV cache after the healthy sleep")


# The KV cache of the rank whose own part succeeded while its peer failed: one sleep and one wakeup of the tag
# kv_cache in one group of two ranks, each failing on one rank (the sleep on the first named, the wakeup on the
# second), each followed by the healthy call. Both ranks are judged in each role.
KV_UNDO_CASES = (("follower", "rank0"), ("rank0", "follower"))


def _kv_undo_params():
    out = []
    for i, (sleep_fails, wakeup_fails) in enumerate(KV_UNDO_CASES):
        tier = [] if i == 0 else [pytest.mark.multirank]  # the first in the quick run
        out.append(pytest.param(sleep_fails, wakeup_fails, id=f"sleep-fails-on-{sleep_fails}-wakeup-on-{wakeup_fails}",
                                marks=[pytest.mark.requires("multirank", "control.sleep", "control.kv_cache",
                                                            "snapshot.parts"), *tier]))
    return out


@pytest.mark.rule("CTL-EVERY-RANK")
@pytest.mark.modes(operation=("sleep", "wakeup"), call="first")
@pytest.mark.parametrize("sleep_fails, wakeup_fails", _kv_undo_params())
def test_kv_cache_as_recorded_after_a_peer_failed(impl, tmp_path, sleep_fails, wakeup_fails):
    """Two ranks, each with the engine the suite plays: ``sleep(["kv_cache"])`` with one rank's release refusing,
    the healthy sleep, ``wakeup(["kv_cache"])`` with one rank's rebuild refusing, the healthy wakeup. Every rank's
    engine, after each failed call, holds the KV cache as it was before it (the rank's tag did not change state), and
    each healthy call then releases (rebuilds) it exactly once; no call ever releases a released cache or rebuilds
    an allocated one."""
    failing = {"sleep": 0 if sleep_fails == "rank0" else 1, "wakeup": 0 if wakeup_fails == "rank0" else 1}

    def script(rank):
        with _rank_rig(impl, tmp_path, rank, "parts") as rig:
            steps = []

            def step(what, fn):
                first = len(rig.engine.calls)
                try:
                    fn()
                    error = None
                except Exception as e:  # noqa: BLE001 (reported)
                    error = f"{type(e).__name__}: {e}"
                steps.append({"what": what, "error": error, "kv": rig.engine.kv,
                              "calls": [[c.name, c.kv_before] for c in rig.engine.calls[first:]]})

            if rank == failing["sleep"]:
                rig.engine.fail("release_kv_cache", RuntimeError(f"rank {rank}'s KV cache refuses to be released"))
            step(f"sleep(['kv_cache']) failing on rank {failing['sleep']}", lambda: rig.session.sleep(["kv_cache"]))
            step("the healthy sleep(['kv_cache'])", lambda: rig.session.sleep(["kv_cache"]))
            if rank == failing["wakeup"]:
                rig.engine.fail("rebuild_kv_cache", RuntimeError(f"rank {rank}'s KV cache cannot be rebuilt"))
            step(f"wakeup(['kv_cache']) failing on rank {failing['wakeup']}", lambda: rig.session.wakeup(["kv_cache"]))
            step("the healthy wakeup(['kv_cache'])", lambda: rig.session.wakeup(["kv_cache"]))
            return steps

    harness._calls["adapter"] += 1  # the ranks drive the implementation in their own processes
    results = two_ranks(script)
    where = f"kv_cache: the sleep failing on rank {failing['sleep']}, the wakeup on rank {failing['wakeup']}"
    for rank, r in enumerate(results):
        check.that(r["ok"], f"{where}: rank {rank} did not report: {r.get('error')}")
    # After each step: the KV cache as the rank records it, and the healthy step's one engine call (None: the
    # failed step, whose calls may be none, or a release and its undo) with the KV cache before it.
    want = [(E.ALLOCATED, None), (E.RELEASED, ["release_kv_cache", E.ALLOCATED]),
            (E.RELEASED, None), (E.ALLOCATED, ["rebuild_kv_cache", E.RELEASED])]
    sound = {"release_kv_cache": E.ALLOCATED, "rebuild_kv_cache": E.RELEASED}  # the cache each call acts on
    for rank, r in enumerate(results):
        for (kv, call), st in zip(want, r["value"]):
            op = "sleep" if "sleep" in st["what"] else "wakeup"
            role = "healthy" if call is not None else "the failing rank" if rank == failing[op] else "its own part succeeded"
            at = f"{where}: rank {rank} ({role}), {st['what']} (engine calls: {st['calls']})"
            double = [c for c in st["calls"] if c[1] != sound[c[0]]]
            check.that(not double, f"{at}: a release of a released KV cache or a rebuild of an allocated one: {double}")
            if call is None:
                undone = "released is rebuilt" if op == "sleep" else "rebuilt is released again"
                check.that(st["error"] is not None, f"{at}: returned normally although rank {failing[op]} failed it")
                check.equal(st["kv"], kv, f"{at}: the engine's KV cache after the failed {op} (as before it: the rank "
                                          f"records the tag as it was, so the KV cache it {undone})")
            else:
                check.that(st["error"] is None, f"{at}: the healthy call raised {st['error']}")
                check.equal((st["calls"], st["kv"]), ([call], kv),
                            f"{at}: the healthy {op}'s engine calls (exactly one) and the KV cache after it")
