"""Requests served across an update: a forward pass never sees two versions, nor cleared weights. Spec: SPEC.md
§ SERVE (SERVE-NO-MIXED-VERSIONS; reef #86, one response mixing weight versions; Miles PR #2589).

The suite's forward pass (``Forward``) runs through ``session.serve(fn)`` (capability ``serve``) on a thread of
its own, as an engine runs a request beside the worker that changes the weights. ``fn`` reads every parameter of
the served model (the layers handed to ``open``) one layer at a time, the last-loaded first, and records which
version each layer held: ``v1``, ``v2``, ``cleared`` or ``other`` (bytes of neither version). After its first
layer it pauses: a pass in flight when a change begins pauses ``GAP_S`` (longer than the change takes, so a
change that does not wait for it lands under it); a pass that arrived during a change pauses until the cycle's
update has returned (bounded), so that a pass let in mid-change reads both sides of it. Whether a held pass ever
(wrongly) started is given ``HOLD_S`` to show before the test moves on. The interleavings are forced: the
trainer holds the update at a chosen point (``ipc_bucket``: before its last bucket; GDR: the model's loader
before its last item; rsync: the stream pauses before its last item), and every wait is bounded from outside,
so a pass or a change that never returns fails the case naming it. A second test fails the update after part
of it landed and checks that no pass runs before the recovery commits.
"""
from __future__ import annotations

import threading
import time

import pytest

from conformance import check, modes
from conformance.paths import PATHS, cases, route, staged_options  # noqa: F401 (the fixture)
from weightsync.fixtures import models as M

# embed.weight fills one 1 KiB bucket, the other three share the next one (ipc_bucket: two buckets)
SPEC = M.spec(("embed.weight", "float32", (16, 16)), ("layers.0.mlp.weight", "bfloat16", (4, 4)),
              ("layers.1.mlp.weight", "float16", (4, 4)), ("norm.bias", "float32", (4,)))
ORDER = [p.name for p in reversed(SPEC.main)]  # the forward's layers: the one every path loads last, first
GAP_S = 0.04  # an in-flight pass's pause after its first layer: a clear or update here takes milliseconds
HOLD_S = 0.02  # how long a pass that must be held is given to start (wrongly) before the test goes on
LATE_GAP_S = 1.0  # a pass that arrived during a change pauses until the update returned, at most this long
RSYNC_PAUSE_S = 0.05  # the rsync trainer's pause before its last item (longer than HOLD_S)
BOUND_S = 10.0  # every wait for a change or a pass to return


class Change(threading.Thread):
    """``clear()`` or ``update()`` on a thread of its own; ``returned`` is set when it returns or raises."""

    def __init__(self, what: str, fn, returned: threading.Event):
        super().__init__(name=f"conformance-{what}", daemon=True)
        self.what, self.fn, self.returned, self.error = what, fn, returned, None
        self.start()

    def run(self):
        try:
            self.fn()
        except BaseException as e:  # noqa: BLE001 (judged by the test)
            self.error = e
        finally:
            self.returned.set()


class Forward(threading.Thread):
    """One forward pass through ``session.serve``: reads ``ORDER`` one layer at a time; ``seen`` holds
    ``(layer, version)`` per read, ``first`` is set once the first layer was read."""

    def __init__(self, session, phase: str, versions: dict, gap_until: threading.Event, gap_s: float):
        super().__init__(name=f"conformance-forward-{phase}", daemon=True)
        self.session, self.phase, self.versions = session, phase, versions
        self.gap_until, self.gap_s = gap_until, gap_s
        self.seen: list[tuple[str, str]] = []
        self.first, self.done = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.start()

    def read(self, name: str) -> str:
        param = self.session.models[0].state_dict()[name]  # looked up afresh: a loader may put new objects in
        if not param._is_initialized():
            return "cleared"
        data = param.numpy().tobytes()
        return next((f"v{v}" for v, state in self.versions.items() if state[name] == data), "other")

    def _pass(self) -> str:
        for i, name in enumerate(ORDER):
            if i == 1:
                self.gap_until.wait(self.gap_s)
            self.seen.append((name, self.read(name)))
            self.first.set()
        return "served"

    def run(self):
        try:
            self.session.serve(self._pass)
        except BaseException as e:  # noqa: BLE001 (judged by the test)
            self.error = e
        finally:
            self.done.set()


def _returned(thing, deadline: float, where: str) -> None:
    event = thing.returned if isinstance(thing, Change) else thing.done
    name = thing.what if isinstance(thing, Change) else f"the forward pass {thing.phase}"
    check.that(event.wait(max(0.0, deadline - time.monotonic())),
               f"{where}: {name} had not returned {BOUND_S:g}s on (left behind: a pass and a change waiting for "
               f"each other, or a pass held for ever)")
    if isinstance(thing, Change):
        check.that(thing.error is None, f"{where}: {thing.what} raised {type(thing.error).__name__}: {thing.error}")


def _judge(fwd: Forward, want: str, why: str, where: str) -> None:
    check.that(fwd.error is None, f"{where}: serve() of the forward pass {fwd.phase} raised "
                                  f"{type(fwd.error).__name__}: {fwd.error} (a pass is drained or held, never refused)")
    got = ", ".join(f"{name}: {what}" for name, what in fwd.seen)
    check.that(len(fwd.seen) == len(ORDER) and all(what == want for _, what in fwd.seen),
               f"{where}: the forward pass {fwd.phase} read [{got}]; it must read every layer of {want} ({why})")


def _hold_update(rt, path: str, session, v2: dict):
    """Publish version 2 so that its update stops at a point the test chooses; returns (what the hold is,
    wait until the update is there, release it) or None where the path's trainer cannot hold it."""
    if path == "bucket":
        from weightsync.fixtures import buckets as B

        pub = rt.feed._publisher(0)
        update = B.pack(dict(v2), 2, rt.feed.BUCKET_BYTES)
        pub.serve(update, hold_before=len(update.buckets) - 1)
        return ("with every bucket but the last landed", lambda: pub.holding.wait(BOUND_S), pub.release.set)
    if path == "gdr":
        rt.publish(0, v2, 2)
        loader = session.models[0].load_weights  # the suite's model loader (fixtures.streams.ModelLoader)
        loader.hold_at = len(v2) - 1
        return ("with every item but the last loaded", lambda: loader.holding.wait(BOUND_S), loader.release.set)
    if path == "rsync":
        from weightsync.fixtures import streams as S

        trainer = rt.feed._trainer(0)
        trainer.serve(S.stream_of(dict(v2), pauses={len(v2) - 1: RSYNC_PAUSE_S}))
        return ("with every item but the last received (the trainer pausing before it)",
                lambda: trainer.wait_for(lambda: len(trainer._open) >= 2 and trainer.sent() >= len(v2) - 1, BOUND_S),
                lambda: None)
    rt.publish(0, v2, 2)
    return None


def _serve_cases(staged: bool):
    """Every path (and, with ``staged``, every path a loader can stage, staged), with the operations it changes the
    weights by: a clear, then the update into cleared parameters; on the streamed paths the update in place, and
    also a clear() before a bootstrap load (``clears``)."""
    out = []
    for p in cases(extra=("serve",), staged=staged):
        in_place = PATHS[p.values[0]].in_place
        out.append(pytest.param(*p.values, False, id=p.id, marks=[*p.marks, pytest.mark.modes(
            op="update" if in_place else ("clear", "update"))]))
        if in_place and not p.values[-1]:
            out.append(pytest.param(*p.values, True, id=f"{p.id}:clear-first",
                                    marks=[*p.marks, pytest.mark.modes(op=("clear", "update"))]))
    return out


@pytest.mark.rule("SERVE-NO-MIXED-VERSIONS")
@pytest.mark.parametrize("path,staged,clears", modes.quick_split("SERVE-NO-MIXED-VERSIONS", _serve_cases(staged=True)))
def test_forward_passes_never_mix_versions(route, loader, path, staged, clears):  # noqa: F811 (route: the fixture)
    rt = route(path)
    in_place = rt.path.in_place and not clears  # a streamed session cleared first: its update fills cleared parameters
    session = rt.open(SPEC, options=staged_options(staged))
    v1, v2 = M.state(SPEC, version=1), M.state(SPEC, version=2)
    versions = {1: {n: a.tobytes() for n, a in v1.items()}, 2: {n: a.tobytes() for n, a in v2.items()}}
    claims_status = "status" in loader.adapter.capabilities
    where = f"{path}"

    # Before the first load: nothing to serve, the pass is held until the load commits.
    loaded = threading.Event()
    rt.publish(0, v1, 1)
    f0 = Forward(session, "arriving before the first load", versions, loaded, LATE_GAP_S)
    f0.first.wait(HOLD_S)
    first = Change("the first load (update())", lambda: rt.update(0), loaded)
    deadline = time.monotonic() + BOUND_S
    _returned(first, deadline, where)
    _returned(f0, deadline, where)
    _judge(f0, "v1", "held until the first load committed: before it the parameters hold nothing", where)

    # A pass in flight when the change begins (a clear, or the in-place update): drained on version 1.
    changed, updated = threading.Event(), threading.Event()
    hold = _hold_update(rt, path, session, v2) if in_place else None
    try:
        gap_s = GAP_S + (RSYNC_PAUSE_S if path == "rsync" else 0.0)  # (longer than rsync's paused update)
        a = Forward(session, f"in flight when {'the update' if in_place else 'the clear'} begins", versions,
                    updated if in_place else changed, gap_s)
        deadline = time.monotonic() + BOUND_S
        check.that(a.first.wait(BOUND_S), f"{where}: a forward pass on the loaded version 1 did not start within "
                                          f"{BOUND_S:g}s (nothing was changing: it must run at once)")
        forwards = [(a, "v1", "drained: it began on version 1 and must end on it before any byte changes")]
        change = (Change("the in-place update()", lambda: rt.update(0), updated) if in_place
                  else Change("clear()", session.clear, changed))
        if claims_status:  # once the status says the change began, a pass that arrives is held
            status = "NORMAL"
            while status == "NORMAL" and not change.returned.is_set() and time.monotonic() < deadline:
                status = session.status()
                time.sleep(0.001 if status == "NORMAL" else 0)
            moment = (f"once status() read {status} (the change begun, the pass in flight draining)" if status != "NORMAL"
                      else f"after {change.what} returned, status() having read NORMAL throughout")
            b = Forward(session, f"arriving {moment}", versions, updated, LATE_GAP_S)
            forwards.append((b, "v2", "held: it arrived once the change had begun, and must run on the new version whole"))
        if not in_place:
            _returned(change, deadline, where)
            c = Forward(session, "arriving at CLEARED, before the update", versions, updated, LATE_GAP_S)
            forwards.append((c, "v2", "held: no pass runs on cleared parameters; it runs once the update committed"))
            c.first.wait(HOLD_S)
            hold = _hold_update(rt, path, session, v2)
            change = Change("update()", lambda: rt.update(0), updated)
        if hold is not None:
            what, reached, release = hold
            try:
                check.that(reached(), f"{where}: the update never reached the point the trainer holds it at ({what})")
                d = Forward(session, f"arriving mid-update, {what}", versions, updated, LATE_GAP_S)
                forwards.append((d, "v2", "held: it arrived while the bytes were changing; it runs once the update committed"))
                d.first.wait(HOLD_S)
            finally:
                release()
                hold = None
        deadline = time.monotonic() + BOUND_S
        _returned(change, deadline, where)
        for fwd, _, _ in forwards:
            _returned(fwd, deadline, where)
        for fwd, want, why in forwards:
            _judge(fwd, want, why, where)
        check.params_equal(session.observe(), v2, f"{where}: after the update")
        if claims_status:
            check.equal(session.status(), "NORMAL", f"{where}: status() after the update returned")
    finally:  # a case that failed half-way leaves no update held by the trainer
        if hold is not None:
            hold[2]()


def _publish_failing(rt, path: str, v2: dict) -> str:
    """Version 2 published so that its update fails after part of it landed: what fails."""
    if path == "bucket":
        def abort_before_last(update):
            update.fault = ("abort", len(update.buckets) - 1)

        rt.publish(0, v2, 2, abort_before_last)
        return "the trainer aborting before its last bucket (the first landed)"
    if rt.path.in_place:
        rt.publish(0, v2, 2, ("fail", len(v2) - 1))
        return "the trainer failing the stream before its last item"
    rt.publish(0, {n: a for n, a in v2.items() if n != ORDER[0]}, 2)
    return f"{ORDER[0]} missing from the source (the others landed)"


class _FailingHook:
    """A stale-state hook (capability ``model.hooks``) that raises at its first call, as an engine whose prefix
    cache could not be reset, and runs healthy after; ``calls`` counts them."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("the suite's stale-state hook failed (the prefix cache could not be reset)")


@pytest.mark.rule("SERVE-NO-MIXED-VERSIONS")
@pytest.mark.modes(op="update")
@pytest.mark.parametrize("path", cases(extra=("serve",)))
def test_a_failed_update_keeps_passes_held(route, loader, path):  # noqa: F811 (route: the fixture)
    """A pass held through an update that fails, and one arriving after the failure, run on no partial model:
    they wait until an update commits (the recovery), then read it whole."""
    _failed_update_keeps_passes_held(route, loader, path, hook=None)


@pytest.mark.rule("SERVE-NO-MIXED-VERSIONS")
@pytest.mark.modes(op="update")
@pytest.mark.parametrize("path", cases(extra=("serve", "model.hooks")))
def test_a_failed_hook_keeps_passes_held(route, loader, path):  # noqa: F811 (route: the fixture)
    """Every byte of version 2 lands and commits, then the stale-state hook raises (MODEL-HOOK-FAILURE): the
    update failed, and the state the hook had to reset is stale, so a pass held through it, and one arriving after
    it, still wait until an update commits with its hooks done (the recovery), then read it whole."""
    _failed_update_keeps_passes_held(route, loader, path, hook=_FailingHook())


def _failed_update_keeps_passes_held(rt_fixture, loader, path: str, hook: _FailingHook | None) -> None:
    rt = rt_fixture(path)
    session = rt.open(SPEC)
    states = {v: M.state(SPEC, version=v) for v in (1, 2, 3)}
    versions = {v: {n: a.tobytes() for n, a in st.items()} for v, st in states.items()}
    rt.publish(0, states[1], 1)
    rt.update(0)
    if hook is not None:  # (after the first load: its first call is version 2's commit)
        session.register_hook("conformance-failing-hook", hook)
    recovered = threading.Event()
    forwards = []
    if not rt.path.in_place:
        rt.clear(0)
        h = Forward(session, "arriving at CLEARED, before an update that fails", versions, recovered, LATE_GAP_S)
        forwards.append(h)
        h.first.wait(HOLD_S)
    if hook is None:
        fault = _publish_failing(rt, path, states[2])
    else:
        rt.publish(0, states[2], 2)
        fault = "every byte landed, then the stale-state hook raising"
    where = f"{path}: the update of version 2 failing ({fault})"
    failed = Change("the failing update()", lambda: rt.update(0), threading.Event())
    deadline = time.monotonic() + BOUND_S
    check.that(failed.returned.wait(BOUND_S), f"{where}: the update had not returned {BOUND_S:g}s on")
    check.that(failed.error is not None, f"{where}: the update returned without an error")
    if hook is not None:
        check.equal(hook.calls, 1, f"{where}: the stale-state hook's calls by the failing update's end")
    late = Forward(session, "arriving after the update failed", versions, recovered, LATE_GAP_S)
    forwards.append(late)
    late.first.wait(HOLD_S)
    for fwd in forwards:
        check.that(not fwd.seen, f"{where}: the forward pass {fwd.phase} ran on the weights the failed update left "
                                 f"(read {fwd.seen}); it must wait until an update commits")
    rt.clear(0)
    rt.publish(0, states[3], 3)
    recovery = Change("the recovery update() (version 3)", lambda: rt.update(0), recovered)
    _returned(recovery, deadline, where)
    for fwd in forwards:
        _returned(fwd, deadline, where)
        _judge(fwd, "v3", "held through the failed update: it runs once the recovery committed", where)
    check.params_equal(session.observe(), states[3], f"{where}: after the recovery")
