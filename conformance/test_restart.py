"""A worker killed mid-cycle, then restarted against the cell it left. Spec: SPEC.md STATUS-RESTART-RECOVERS.

Worker A runs in a forked child: it opens its session, loads at startup, and runs its loop against the
cell while this process plays the API (``adapter.control``) and the trainer (``conformance.paths``). A is
SIGKILLed at one phase of a cycle, leaving the cell at NORMAL, CLEARING, CLEARED or UPDATING. Worker B, a
fresh session in a new forked child, loads at startup and runs its loop; within a deadline the cell must
read the truth, the API's pending request be answered, and the API's next clear and update work, B
ending with the newest version bit for bit. The children talk to this process through pipes (JSON
lines, no pickle); every wait has a deadline and a child that outlives its case is killed.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import threading
import time

import numpy as np
import pytest

from conformance import check, harness, modes
from conformance.loop_driver import LoopThread
from conformance.paths import PATHS, Route, worker
from conformance.thread_state import looked_again
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C

SPEC = M.spec(("embed.weight", "float32", (64, 8)), ("layers.0.mlp.weight", "bfloat16", (16, 16)),
              ("norm.bias", "float16", (16,)))  # 2 KiB + 512 B + 32 B: three buckets of 1 KiB
EVENT_S = 20.0  # the longest wait for one event of a child (a startup load on a loaded machine)
RECOVER_S = 10.0  # B's loop has this long, after its startup load, to bring the cell to the truth
API_S = 60.0  # the API's pending request outlives the restart: B answers it

# (value left, phase of the kill): where worker A dies
PHASES = {
    ("NORMAL", "model-run"): "at a model run, the cell NORMAL",
    ("CLEARING", "before-clear"): "after the API's CLEARING reached the loop, before the clear",
    ("CLEARED", "after-clear"): "idle at CLEARED after its clear, before any update was asked",
    ("UPDATING", "before-first-byte"): "after the API's UPDATING reached the loop, before any byte moved",
    ("UPDATING", "mid-transfer"): "mid-transfer: bucket 0 acknowledged, the trainer holding bucket 1",
    ("UPDATING", "after-commit"): "after the commit, in a stale-state hook, before the cell's NORMAL",
    ("CLEARED", "update-during-restart"): ("idle at CLEARED after its clear; the trainer publishes version 2 and the API "
                                           "asks for it after B's startup load, before B's loop looked at the cell"),
    ("CLEARED", "update-while-recovering"): ("idle at CLEARED after its clear; the API asks for version 2 just after B's "
                                             "loop read CLEARED, while B releases its startup load"),
}
# What worker_iteration returns (docs/adapters.md, capability status.cell).
RESULTS = ("ran", "cleared", "updated", "idle")


def _digests(version: int) -> dict[str, str]:
    return {n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
            for n, a in M.state(SPEC, version=version).items()}


def _model_digest(data: dict) -> str:
    """sha256 over every parameter's name and bytes (a parameter not loaded counts as absent)."""
    h = hashlib.sha256()
    for name in sorted(data):
        h.update(name.encode() + b"\0" + (b"-" if data[name] is None else b"+" + data[name]))
    return h.hexdigest()


def _version_digest(version: int) -> str:
    return _model_digest({n: np.ascontiguousarray(a).tobytes() for n, a in M.state(SPEC, version=version).items()})


class Child:
    """A worker in a forked child: open, startup load, then its loop (non-blocking) until stopped.
    ``stop_at``: an event (``("sync", value)``, ``("run",)``, ``("hook",)``) at which it reports and then
    waits forever (the test kills it there)."""

    def __init__(self, loader, route, cell, *, stop_at=None, hook_after: int = 1, hold_loop: bool = False,
                 hold_first_sync: bool = False):
        self.events: list[dict] = []
        options = {**route.feed.options(0), "status_cell": cell.name}  # the trainer side exists in this process
        if route.path.id == "rsync":  # every load a bootstrap load (version.yaml), so one fills cleared weights
            options.pop("version", None)  # (RSYNC-IN-PLACE: with a version argument rsync writes in place only)
            with open(os.path.join(loader.model_dir, "version.yaml"), "w", encoding="utf-8") as f:
                f.write("step: 1\n")
        ev_r, ev_w = os.pipe()
        ctl_r, ctl_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(ev_r)
                os.close(ctl_w)
                self._run(loader, route, options, stop_at, hook_after, hold_loop, hold_first_sync, ev_w, ctl_r)
            except BaseException:  # noqa: BLE001
                code = 70
            finally:
                os._exit(code)
        os.close(ev_w)
        os.close(ctl_r)
        self.pid, self._ev, self._ctl, self._buffer = pid, ev_r, ctl_w, b""

    # -- in the child ---------------------------------------------------------------------------------
    @staticmethod
    def _run(loader, route, options, stop_at, hook_after, hold_loop, hold_first_sync, ev_w, ctl_r) -> None:
        def emit(**event):
            os.write(ev_w, (json.dumps(event) + "\n").encode())

        def halt(**event):
            emit(**event)
            while True:
                os.read(ctl_r, 1)  # the parent kills this process here

        def stopped() -> bool:
            ready, _, _ = select.select([ctl_r], [], [], 0)
            return bool(ready)

        try:
            session = loader.open(SPEC, strategy=route.path.strategy, worker=worker(0), options=options)
            route.feed.opened(session)
            commits = [0]
            if stop_at == ("hook",):
                def hook():
                    commits[0] += 1
                    if commits[0] > hook_after:
                        halt(kind="hook")
                session.register_hook("restart-probe", hook)
            session.update()  # the startup load
            emit(kind="loaded", status=session.status())
            if hold_loop:
                os.read(ctl_r, 1)  # the parent's go: the loop starts

            held = [hold_first_sync]

            def sync(value):
                if stop_at == ("sync", value):
                    halt(kind="sync", value=value)
                emit(kind="sync", value=value)
                if held[0]:  # the loop has read the cell; the parent's go once the API wrote its request
                    held[0] = False
                    os.read(ctl_r, 1)
                return value

            def run_model():
                if stop_at == ("run",):
                    halt(kind="run")
                emit(kind="run")

            while not stopped():
                result = session.worker_iteration(run_model, block=False, sync=sync)
                observed = session.observe()
                loaded = sum(o.data is not None for o in observed.values())
                emit(kind="end", result=result, loaded=loaded, model=_model_digest(
                    {n: o.data for n, o in observed.items()}))
                time.sleep(0.002)
            emit(kind="report", status=session.status(), version=session.version() if hasattr(session, "version") else None, adapter_calls=harness.adapter_calls(),
                 digests={n: None if o.data is None else hashlib.sha256(o.data).hexdigest()
                          for n, o in session.observe().items()})
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            emit(kind="error", error=f"{type(e).__name__}: {e}")

    # -- in the parent --------------------------------------------------------------------------------
    def next(self, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._ev], [], [], left)
            if ready:
                chunk = os.read(self._ev, 65536)
                if not chunk:
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        event = json.loads(line)
        self.events.append(event)
        return event

    def wait_for(self, kind: str, where: str, timeout_s: float = EVENT_S, **match) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            event = self.next(max(0.0, deadline - time.monotonic()))
            if event is None:
                self.kill()
                raise AssertionError(f"{where}: no {kind} {match or ''} from the worker within {timeout_s}s "
                                     f"(last events {self.events[-6:]})")
            if event["kind"] == "error":
                self.kill()
                raise AssertionError(f"{where}: the worker raised: {event['error']} (events {self.events[-6:]})")
            if event["kind"] == kind and all(event.get(k) == v for k, v in match.items()):
                return event

    def stop(self, where: str) -> dict:
        os.write(self._ctl, b"s")
        try:
            report = self.wait_for("report", f"{where}: stopping the worker")
            harness._calls["adapter"] += report.get("adapter_calls", 0)  # the child's calls count here
            return report
        finally:
            self.kill()

    def kill(self) -> None:
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        for fd in (self._ev, self._ctl):
            try:
                os.close(fd)
            except OSError:
                pass
        self.pid = None


class Api:
    """A request of the API in a thread of this process (it waits for the worker)."""

    def __init__(self, control, request: str, timeout_s: float = API_S):
        self.answer = None
        self.thread = threading.Thread(target=self._call, args=(getattr(control, request), timeout_s), daemon=True)
        self.thread.start()

    def _call(self, fn, timeout_s):
        self.answer = fn(timeout_s)

    def result(self, timeout_s: float):
        self.thread.join(timeout_s)
        return self.answer


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _kill_a(loader, impl, path_id, cell, left, phase):
    """Worker A dies at ``phase``; returns (the route B will use, the API's pending request or None,
    the version published last)."""
    route = Route(loader, path_id)
    control = impl.control(cell.name)
    where = f"{path_id}: worker A, {PHASES[(left, phase)]}"
    route.publish(0, M.state(SPEC, version=1), 1)
    stop_at = {"model-run": ("run",), "before-clear": ("sync", C.CLEARING), "after-clear": ("sync", C.CLEARED),
               "update-during-restart": ("sync", C.CLEARED), "update-while-recovering": ("sync", C.CLEARED),
               "before-first-byte": ("sync", C.UPDATING), "after-commit": ("hook",)}.get(phase)
    a = Child(loader, route, cell, stop_at=stop_at)
    pending, version = None, 1
    try:
        a.wait_for("loaded", f"{where}: startup load")
        route.feed.settle(0)
        if left == "NORMAL":
            a.wait_for("run", where)
        elif left == "CLEARING":
            pending = Api(control, "clear_load_weight")
            a.wait_for("sync", where, value=C.CLEARING)
        else:
            check.equal(control.clear_load_weight(EVENT_S), (200, "clear model weight successfully"), f"{where}: the API's clear")
            if left == "CLEARED":
                a.wait_for("sync", where, value=C.CLEARED)
            else:
                version = 2
                if phase == "mid-transfer":  # the trainer sends bucket 0, then holds before bucket 1
                    publisher = _serve_held(route, 2)
                else:
                    route.publish(0, M.state(SPEC, version=2), 2)
                pending = Api(control, "update_model_weight")
                if phase == "mid-transfer":
                    check.that(publisher.holding.wait(EVENT_S), f"{where}: the trainer never reached bucket 1")
                elif phase == "before-first-byte":
                    # A's halt at UPDATING, not an earlier pass's sync CLEARED still queued (killed on that one,
                    # A could die before the API wrote UPDATING: a verdict decided by the race)
                    a.wait_for("sync", where, value=C.UPDATING)
                else:
                    a.wait_for("hook", where)
    finally:
        a.kill()  # SIGKILL, wherever it is
    if phase == "mid-transfer":
        route.feed._publisher(0).release.set()
    check.equal(C.name_of(cell.read()), left, f"{where}: the cell the dead worker left")
    return route, pending, version


def _serve_held(route, version: int):
    """The bucket trainer serves ``version``, holding before bucket 1: returned, ``holding`` is set once it is
    there and ``release`` lets it go on."""
    from weightsync.fixtures import buckets as B

    publisher = route.feed._publisher(0)
    publisher.serve(B.pack(M.state(SPEC, version=version), version, route.feed.BUCKET_BYTES), hold_before=1)
    return publisher


def _publish_held(route, late: bool):
    """Version 2 for the new worker. On the bucket path of the late case, its trainer holds before bucket 1
    (returned), so the cell can be read while B reloads."""
    if late and route.path.id == "bucket":
        return _serve_held(route, 2)
    route.publish(0, M.state(SPEC, version=2), 2)
    return None


def _restart_case(loader, impl, path_id, left, phase):
    where = f"{path_id}: worker B restarted after worker A died {PHASES[(left, phase)]}"
    with C.Cell(C.NORMAL) as cell:
        route, pending, version = _kill_a(loader, impl, path_id, cell, left, phase)
        routes = [route]
        try:
            if path_id in ("bucket", "rsync", "gdr"):
                route = Route(loader, path_id)  # a trainer for the new worker (A's may still be mid-stream)
                routes.append(route)
                route.publish(0, M.state(SPEC, version=version), version)
            late = phase == "update-during-restart"
            racing = phase == "update-while-recovering"
            b = Child(loader, route, cell, hold_loop=late, hold_first_sync=racing)
            try:
                b.wait_for("loaded", f"{where}: startup load")
                route.feed.settle(0)
                if late or racing:  # a new version and the API's request for it, after B loaded
                    held = _publish_held(route, late)
                    if racing:  # B's loop has read CLEARED; the request lands before B acts on it
                        b.wait_for("sync", f"{where}: B's first pass", value=C.CLEARED)
                    pending, left = Api(impl.control(cell.name), "update_model_weight"), "UPDATING"
                    check.that(_until(lambda: cell.read() == C.UPDATING, EVENT_S), f"{where}: the API never wrote UPDATING")
                    os.write(b._ctl, b"g")
                    if held is not None:  # B reloads; mid-transfer the cell still says what the API asked
                        check.that(held.holding.wait(EVENT_S), f"{where}: B never reached bucket 1 of version 2")
                        check.equal(C.name_of(cell.read()), "UPDATING",
                                    f"{where}: the cell while B reloads (bucket 0 of version 2 acknowledged)")
                        held.release.set()
                    b.wait_for("end", f"{where}: B holding version 2, the one asked for after its startup load",
                               RECOVER_S, model=_version_digest(2))
                want = {"UPDATING": "NORMAL", "CLEARING": "CLEARED", "CLEARED": "CLEARED", "NORMAL": "NORMAL"}[left]
                ok = _until(lambda: C.name_of(cell.read()) == want, RECOVER_S)
                check.that(ok, f"{where}: the cell reads {C.name_of(cell.read())} {RECOVER_S}s after B's startup load, "
                               f"expected {want} (B's events {b.events[-6:]})")
                if want == "CLEARED":  # the weights the API believes released are released
                    b.wait_for("end", f"{where}: B's loop at CLEARED with nothing loaded", RECOVER_S, loaded=0)
                else:
                    b.wait_for("run", f"{where}: B runs the model once NORMAL", RECOVER_S)
                if pending is not None:
                    verb = "update" if left == "UPDATING" else "clear"
                    check.equal(pending.result(RECOVER_S), (200, f"{verb} model weight successfully"),
                                f"{where}: the API's {verb}, still waiting when A died")
                control = impl.control(cell.name)
                cleared = control.clear_load_weight(EVENT_S)
                check.that(cleared in ((200, "clear model weight successfully"), (200, "model weight is cleared")),
                           f"{where}: the API's next clear answered {cleared}")
                route.publish(0, M.state(SPEC, version=3), 3)
                check.equal(control.update_model_weight(EVENT_S), (200, "update model weight successfully"),
                            f"{where}: the API's next update (version 3)")
                route.feed.settle(0)
                report = b.stop(where)
            finally:
                b.kill()
            check.equal(report["digests"], _digests(3), f"{where}: B's parameters after the next update (sha256)")
            odd = [e["result"] for e in b.events if e["kind"] == "end" and e["result"] not in RESULTS]
            check.equal(odd, [], f"{where}: worker_iteration results outside {RESULTS}")
            check.equal((report["status"], C.name_of(cell.read())), ("NORMAL", "NORMAL"), f"{where}: B's status and the cell")
        finally:
            for r in routes:
                r.close()


def _cases():
    out = []
    for path_id, path in PATHS.items():
        for left, phase in PHASES:
            if phase == "mid-transfer" and path_id != "bucket":
                continue  # the only path whose trainer can hold mid-transfer (see SPEC's Proven by)
            extra = ("model.hooks",) if phase == "after-commit" else ()
            quick = (path_id, left, phase) in QUICK
            race = {"update-during-restart": "before-read", "update-while-recovering": "at-read"}.get(phase, "none")
            marks = [pytest.mark.requires("status.cell", "control", *path.capabilities, *extra),
                     pytest.mark.modes(left=left, race=race, rank="rank0")]
            if not quick:
                marks.append(pytest.mark.restart)
            out.append(pytest.param(path_id, left, phase, marks=marks, id=f"{path_id}:{left}:{phase}"))
    return out


# In the quick run: the case on the snapshot and bucket paths; the rest in the restart tier.
QUICK = {("single", "UPDATING", "before-first-byte"), ("bucket", "UPDATING", "mid-transfer"),
         ("parts", "CLEARED", "after-clear"), ("parts", "CLEARED", "update-during-restart")}


@pytest.mark.rule("STATUS-RESTART-RECOVERS")
@pytest.mark.parametrize("path_id,left,phase", _cases())
def test_restarted_worker_recovers_the_cell(loader, impl, path_id, left, phase):
    _restart_case(loader, impl, path_id, left, phase)


# -- the same recovery in one process, raced by the API ---------------------------------------------------------
# The dead worker's leftover is written as the engine finds it (a value in the cell, or the API's request still
# waiting in a thread of this process), the new worker is a fresh session whose loop passes this test calls (each
# bounded), and the API's next request lands at a moment chosen deterministically: at a Python call event of the
# startup load (in-load) or of the first pass after its read (in-pass: the k-th call, calls of builtins counted),
# at the first pass's read (at-read: its ``sync``), or between the startup load and the first pass (before-read).
INPROCESS = "STATUS-RESTART-RECOVERS"
PASS_S = 10.0  # the startup load, on a loaded machine
K_POINTS = (1, 4, 16, 64, 256)  # the call event at which the API writes (in-load, in-pass), by path


def _inprocess_requires(combo) -> list[str]:
    return ["status.cell", "control", *PATHS[combo["path"]].capabilities]


class _At:
    """``action()`` once, at the ``k``-th call event (of a Python function or a builtin) of the thread that
    installs :meth:`probe` with ``sys.setprofile``; ``fire()`` runs it if it has not run (the work ended first)."""

    def __init__(self, k: int, action):
        self.k, self.action, self.count, self.fired, self.late = k, action, 0, False, False
        self.lock = threading.Lock()

    def probe(self, frame, event, arg):
        if self.fired or event not in ("call", "c_call"):
            return
        self.count += 1
        if self.count >= self.k:
            self._once(late=False)

    def fire(self) -> None:
        self._once(late=True)

    def _once(self, late: bool) -> None:
        with self.lock:
            if self.fired:
                return
            self.fired, self.late = True, late
        self.action()


def _bounded(fn, what: str, profile=None, timeout_s: float = PASS_S):
    """``fn()`` in a thread with a deadline (``profile`` installed there first): what it returned or raised."""
    import sys

    box: dict = {}

    def run():
        if profile is not None:
            sys.setprofile(profile)
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 (judged by the caller)
            box["result"] = e
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=run, name="conformance-worker", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"{what} did not return within {timeout_s:g}s", pytrace=False)
    return box["result"]


class _Watch(threading.Thread):
    """The cell's values, in the order seen, every half millisecond until stopped."""

    def __init__(self, cell):
        super().__init__(name="conformance-cell-watch", daemon=True)
        self.cell, self.seen, self.done = cell, [C.name_of(cell.read())], threading.Event()
        self.start()

    def run(self):
        while not self.done.wait(0.0005):
            try:
                now = C.name_of(self.cell.read())
            except OSError:  # the case ended (it failed first) and its cell is gone: nothing more to watch
                return
            if now != self.seen[-1]:
                self.seen.append(now)

    def stop(self) -> list[str]:
        self.done.set()
        self.join(2.0)
        now = C.name_of(self.cell.read())
        if now != self.seen[-1]:
            self.seen.append(now)
        return self.seen


def _api_writes(control, cell, request: str, value: int) -> Api:
    """The API's ``request`` in a thread; returns once it has written ``value`` (or answered without writing)."""
    api = Api(control, request)
    deadline = time.monotonic() + EVENT_S
    while api.thread.is_alive() and cell.read() != value and time.monotonic() < deadline:
        time.sleep(0.0005)
    return api


def _rank0_params() -> list:
    """Rank 0's cases: every pair of path, value left and race (the rule's other axes; a follower's cases are
    ``test_restarted_follower_in_one_process``'s), each marked rank0."""
    axes = {axis: values for axis, values in modes.declaration(INPROCESS).axes.items() if axis != "rank"}
    return [pytest.param(*p.values, marks=[*p.marks, pytest.mark.modes(rank="rank0")], id=p.id)
            for p in modes.params(INPROCESS, axes=axes, requires=_inprocess_requires)]


def _restarted(loader, route, path_id: str, cell, rank: int):
    """The new worker's session as rank ``rank``, on ``cell`` (its startup load not yet made); on rsync every load a
    bootstrap load (version.yaml), so that one fills cleared weights."""
    options = {**route.feed.options(rank), "status_cell": cell.name}
    if path_id == "rsync":
        options.pop("version", None)
        with open(os.path.join(loader.model_dir, "version.yaml"), "w", encoding="utf-8") as f:
            f.write("step: 1\n")
    session = loader.open(SPEC, strategy=route.path.strategy, worker=worker(rank), options=options)
    route.feed.opened(session)
    return session


@pytest.mark.rule("STATUS-RESTART-RECOVERS")
@pytest.mark.parametrize("combo", _rank0_params())
def test_restart_in_one_process(loader, impl, combo):
    path_id, left, race = combo["path"], combo["left"], combo["race"]
    k = K_POINTS[list(PATHS).index(path_id) % len(K_POINTS)]
    route = Route(loader, path_id)
    where = f"{path_id}: a new worker against a cell left {left}, the API's request {race}" + (
        f" (call event {k})" if race in ("in-load", "in-pass") else "")
    try:
        with C.Cell(C.NORMAL) as cell:
            control = impl.control(cell.name)
            # What the dead worker left: a value in the cell, or the API's request still waiting for it.
            # (in-load: the trainer published version 2 before the new worker started; the API asks while it loads)
            version = 2 if left == "UPDATING" or (left == "CLEARED" and race == "in-load") else 1
            route.publish(0, M.state(SPEC, version=version), version)
            pending = None
            if left == "CLEARING":
                pending = _api_writes(control, cell, "clear_load_weight", C.CLEARING)
            elif left == "UPDATING":
                cell.write(C.CLEARED)
                pending = _api_writes(control, cell, "update_model_weight", C.UPDATING)
            elif left == "CLEARED":
                cell.write(C.CLEARED)
            check.equal(C.name_of(cell.read()), left, f"{where}: the cell as the dead worker left it")

            # The API's next request, which races the new worker: from CLEARED an update of version 2 (published
            # first), from NORMAL a clear.
            asked: dict = {}
            request, value = ("update_model_weight", C.UPDATING) if left == "CLEARED" else ("clear_load_weight", C.CLEARING)

            def ask():
                if left == "CLEARED" and race != "in-load":  # in-load: published before the worker started
                    route.publish(0, M.state(SPEC, version=2), 2)
                asked["watch"] = _Watch(cell)  # from just before the request on
                asked["api"] = _api_writes(control, cell, request, value)

            at = _At(k, ask) if race in ("in-load", "in-pass") else None
            session = _restarted(loader, route, path_id, cell, 0)
            loaded = _bounded(session.update, f"{where}: the startup load", at.probe if race == "in-load" else None)
            check.that(not isinstance(loaded, BaseException), f"{where}: the startup load raised {loaded!r}")
            route.feed.settle(0)
            if at is not None and race == "in-load":
                at.fire()
            if race == "before-read":
                ask()

            # The new worker's loop (a thread): its first pass raced at its read or inside it, then the passes
            # until the cell reads what it must.
            def first_sync(value_read):
                if race == "at-read":
                    ask()
                elif race == "in-pass":
                    import sys

                    sys.setprofile(at.probe)  # from here on, in the loop's thread, until the pass returns
                return value_read

            runs = []
            loop = LoopThread(session, run_model=lambda: runs.append(1), first_sync=first_sync).start()
            try:
                loop.until(lambda: loop.results)  # the first pass returned (a loop that blocks: the deadline)
                if race == "in-pass":
                    at.fire()
                if race == "at-read" and "api" not in asked:
                    ask()  # (a loop that never called sync: the request lands after its first pass)
                api = asked.get("api") or pending
                if left == "CLEARED" and race != "none" or left == "UPDATING":
                    want, version = "NORMAL", 2
                elif left == "CLEARING" or (left == "NORMAL" and race != "none"):
                    want = "CLEARED"
                else:
                    want = left
                loop.until(lambda: any(isinstance(r, BaseException) for r in loop.results) or (
                    C.name_of(cell.read()) == want and (api is None or not api.thread.is_alive())
                    and (want != "NORMAL" or left != "NORMAL" or runs)))
                route.feed.settle(0)
                results = list(loop.results)
                seen = asked["watch"].stop() if "watch" in asked else None
                raised = [r for r in results if isinstance(r, BaseException)]
                check.that(not raised, f"{where}: the loop raised {raised[:1]} (passes {LoopThread.acts(results)})")
                odd = [r for r in results if r not in RESULTS]
                check.equal(odd, [], f"{where}: worker_iteration results outside {RESULTS}")
                late = " (the pass ended before that event: the request came after it)" if at is not None and at.late else ""
                check.equal(C.name_of(cell.read()), want,
                            f"{where}{late}: the cell after {len(results)} pass(es) that did {LoopThread.acts(results)}")
                if seen is not None:  # the request reads in the cell until the worker's own answer to it
                    answer, asked_for = {C.UPDATING: "NORMAL", C.CLEARING: "CLEARED"}[value], C.name_of(value)
                    tail = seen[seen.index(asked_for):] if asked_for in seen else seen[1:]  # (a request served at once)
                    check.that(tail in ([asked_for, answer], [answer]),
                               f"{where}{late}: the cell's values from the API's request on: {seen} (read every half "
                               f"millisecond): {asked_for} until the worker's {answer}, nothing in between")
                if api is not None:
                    verb = "update" if api is not pending and request == "update_model_weight" or left == "UPDATING" else "clear"
                    check.equal(api.result(EVENT_S), (200, f"{verb} model weight successfully"),
                                f"{where}{late}: the API's {verb}, waiting for the new worker")
                if want == "CLEARED":
                    check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{where}: the weights, released")
                else:
                    check.params_equal(session.observe(), M.state(SPEC, version=version), f"{where}: the weights")
                    if left == "NORMAL":
                        check.that(runs, f"{where}: the model never ran at NORMAL (passes {LoopThread.acts(results)})")

                _next_cycle(loop, control, route, 3, where)
            finally:
                loop.finish()
            _ended_normal(session, cell, 3, where)
    finally:
        route.close()


def _next_cycle(loop, control, route, version: int, where: str) -> None:
    """The API's next clear and update (of ``version``, which the trainer publishes in between), the loop running."""
    cleared, _ = loop.ask(control.clear_load_weight, EVENT_S)
    check.that(cleared in ((200, "clear model weight successfully"), (200, "model weight is cleared")),
               f"{where}: the API's next clear answered {cleared}")
    route.publish(0, M.state(SPEC, version=version), version)
    updated, passes = loop.ask(control.update_model_weight, EVENT_S)
    check.equal(updated, (200, "update model weight successfully"),
                f"{where}: the API's next update (version {version}; the loop's passes meanwhile: "
                f"{LoopThread.acts(passes)})")
    route.feed.settle(0)


def _ended_normal(session, cell, version: int, where: str) -> None:
    check.params_equal(session.observe(), M.state(SPEC, version=version),
                       f"{where}: after the next update (version {version})")
    check.equal((session.status(), C.name_of(cell.read())), ("NORMAL", "NORMAL"), f"{where}: the status and the cell")


def _failed_startup_cases() -> list:
    return [pytest.param(path_id, marks=[pytest.mark.requires("status.cell", "control", *path.capabilities),
                                         pytest.mark.modes(path=path_id, left="UPDATING", race="none", rank="rank0")],
                         id=path_id) for path_id, path in PATHS.items()]


@pytest.mark.rule("STATUS-RESTART-RECOVERS")
@pytest.mark.parametrize("path_id", _failed_startup_cases())
def test_restart_after_a_failed_startup_load(loader, impl, path_id):
    """Issue 19's cell (UPDATING, the API's update waiting) found by a new worker whose startup load fails (the
    trainer's version 2 lacks a parameter): it has nothing to answer from. The trainer then publishes a whole version
    3; the loop must load it before the cell reads NORMAL and the waiting update is answered, and the API's next clear
    and update (version 4) then work as after any recovery."""
    route = Route(loader, path_id)
    where = f"{path_id}: a new worker against a cell left UPDATING, its startup load failing (version 2 lacks norm.bias)"
    try:
        with C.Cell(C.NORMAL) as cell:
            control = impl.control(cell.name)
            route.publish(0, {n: a for n, a in M.state(SPEC, version=2).items() if n != "norm.bias"}, 2)
            cell.write(C.CLEARED)
            pending = _api_writes(control, cell, "update_model_weight", C.UPDATING)
            check.equal(C.name_of(cell.read()), "UPDATING", f"{where}: the cell as the dead worker left it")
            session = _restarted(loader, route, path_id, cell, 0)
            loaded = _bounded(session.update, f"{where}: the startup load")
            route.feed.settle(0)
            check.that(isinstance(loaded, Exception), f"{where}: the startup load of a version lacking norm.bias "
                       f"returned {loaded!r} instead of raising (the case's premise)")
            check.status_not(session, "NORMAL", f"{where}: after the failed startup load")
            route.publish(0, M.state(SPEC, version=3), 3)
            loop = LoopThread(session).start()
            try:
                loop.until(lambda: not pending.thread.is_alive() or any(
                    isinstance(r, BaseException) for r in loop.results), RECOVER_S)
                route.feed.settle(0)
                acts = LoopThread.acts(loop.results)
                check.equal(pending.result(1.0), (200, "update model weight successfully"),
                            f"{where}: the API's waiting update, the trainer having published version 3 (passes {acts})")
                check.params_equal(session.observe(), M.state(SPEC, version=3),
                                   f"{where}: the weights once the waiting update was answered (passes {acts})")
                check.equal(C.name_of(cell.read()), "NORMAL", f"{where}: the cell once the waiting update was answered")
                _next_cycle(loop, control, route, 4, where)
            finally:
                loop.finish()
            _ended_normal(session, cell, 4, where)
    finally:
        route.close()


# -- a restarted follower: it acts once on what its first pass finds, then waits for rank 0's answer -------------
# Tensor-parallel rank 1 of 2 never writes the cell (STATUS-RANK0-WRITES). The suite plays the API and rank 0, the
# slower: the dead worker's leftover is written into the cell as the engine finds it, a request racing the restart
# lands at the moments test_restart_in_one_process places the API's (a call event of the startup load or of the
# first pass, between the load and the first read, at that read), the follower's loop is fed rank 0's broadcast
# (what the cell reads when the follower syncs; at-read: what it read before the API wrote), and rank 0 answers each
# request it broadcast (NORMAL after an update, CLEARED after a clear) once, FOLLOWER_RANK0_S (at least three of the
# follower's startup loads) after the follower's loop read it, having read that the cell still holds it. A follower
# that acts and returns at once reads the request again in its next pass and acts on it twice (a second update for
# one request: on a path that needs cleared weights it fails and releases them; rank 0 meanwhile says NORMAL).
FOLLOWER_RANK0_S = 0.15
NEXT_RANK0_S = 0.03  # rank 0's answers in the API's next cycle (STATUS-FOLLOWERS-WAIT judges that wait in full)
FOLLOWER_LOAD_EVENT = 256  # in-load: the API's update at this call event of the startup load (the reference's has
# about 19 000 on the single file, and reads the cell at about the 20th: the request lands after that read)
# (value left, race), one per path in PATHS order: every value left, every race and every path once for a follower.
FOLLOWER_SITUATIONS = (
    ("UPDATING", "none"),  # parts: the API's update asked before the startup load (issue 19): that load answers it
    ("CLEARED", "in-load"),  # single: the API's update written while the startup load ran (perhaps a newer version)
    ("CLEARING", "none"),  # legacy: the clear carried out
    ("CLEARED", "none"),  # shared: the startup load released; no request, nothing to wait for
    ("NORMAL", "before-read"),  # ipc: the API's clear between the startup load and the first read
    ("UPDATING", "none"),  # bucket: issue 19's cell again, where the trainer counts the transfers
    ("CLEARED", "at-read"),  # rsync: the API's update just after the first read (which acts on CLEARED)
    ("NORMAL", "in-pass"),  # gdr: the API's clear inside the first pass (which runs the model)
)
_VALUE_OF = {"NORMAL": C.NORMAL, "CLEARING": C.CLEARING, "CLEARED": C.CLEARED, "UPDATING": C.UPDATING}


def _follower_cases() -> list:
    return [pytest.param(path_id, left, race, marks=[pytest.mark.requires("status.cell", *path.capabilities),
                                                     pytest.mark.modes(left=left, race=race, rank="follower")],
                         id=f"{path_id}-{left}-{race}")
            for (path_id, path), (left, race) in zip(PATHS.items(), FOLLOWER_SITUATIONS, strict=True)]


BLOCKED_S = 1.0  # a request no pass of the follower has synced by then, its loop's thread seen waiting twice since,
# is read by a loop that stays in its check (blocking at CLEARED: STATUS-NONBLOCK-RETURNS's to judge): rank 0 answers it


class _Rank0:
    """The suite as tensor-parallel rank 0 beside a follower's loop (:meth:`start`). :meth:`ask` writes the API's
    request into the cell; :meth:`sync` sees what each pass of the follower synced: the first pass that reads an open
    request starts rank 0's answer, ``delay_s`` later (a loop that stays in its check and syncs nothing: once it is
    seen waiting, ``BLOCKED_S`` on). ``answers``: one dict per answer (the request, the cell just before rank 0 wrote,
    the follower's passes returned by then since the one that read it, the number of passes returned when it wrote,
    when). ``blocked``: a phase ended with the loop inside its check at CLEARED (its clear's pass not returned)."""

    ANSWER = {C.UPDATING: C.NORMAL, C.CLEARING: C.CLEARED}

    def __init__(self, cell, delay_s: float):
        self.cell, self.delay_s, self.loop = cell, delay_s, None
        self.open = None  # (request, event set once a pass synced it): written and not yet read by the follower
        self.asked: list[str] = []
        self.written: set[str] = set()
        self.answers: list[dict] = []
        self.timers: list[threading.Timer] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.blocked = False
        self.started_at = None
        self.answer_of = dict(self.ANSWER)  # what rank 0 writes for each request (CLEARED after an update it failed)

    def start(self, loop: LoopThread) -> None:
        self.loop, self.started_at = loop, time.monotonic()
        loop.on_sync = self.sync
        loop.start()
        with self.lock:
            waiting = self.open
        if waiting is not None:
            self._unsynced(*waiting)

    def ask(self, request: int) -> None:
        synced = threading.Event()
        with self.lock:
            self.open = (request, synced)
            self.asked.append(C.name_of(request))
            self.written.add(C.name_of(request))
        self.cell.write(request)
        if self.loop is not None and self.started_at is not None:
            self._unsynced(request, synced)

    def sync(self, value: int) -> None:
        """Rank 0 broadcasts what the cell reads (``value``); returns None (the value as read)."""
        with self.lock:
            if self.open is None or value != self.open[0]:
                return None
            self.open[1].set()
            self.open = None
            self._schedule(value)
        return None

    def _schedule(self, request: int) -> None:
        read_in = len(self.loop.results)  # the index of the pass that read it
        timer = threading.Timer(self.delay_s, self._answer, (request, read_in, self.delay_s))
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _unsynced(self, request: int, synced: threading.Event) -> None:
        def watch():
            if synced.wait(BLOCKED_S) or self.stopped.is_set():
                return
            tid = self.loop.thread.native_id
            if tid is not None:
                looked_again(os.getpid(), tid, times=2, timeout_s=PASS_S,
                             between=lambda: synced.is_set() or self.stopped.is_set())
            with self.lock:
                if synced.is_set() or self.stopped.is_set() or self.open is None or self.open[1] is not synced:
                    return
                synced.set()
                self.open = None
                self._schedule(request)

        threading.Thread(target=watch, name="conformance-rank0-unsynced", daemon=True).start()

    def _answer(self, request: int, read_in: int, delay_s: float) -> None:
        if self.stopped.is_set():
            return
        before = C.name_of(self.cell.read())
        passes = len(self.loop.results)
        answer = self.answer_of[request]
        with self.lock:
            self.written.add(C.name_of(answer))
        self.cell.write(answer)
        self.answers.append({"request": C.name_of(request), "answer": C.name_of(answer), "before": before,
                             "returned": passes - read_in, "passes": passes, "delay_s": delay_s, "at": time.monotonic()})

    def settled(self, want: str, released) -> bool:
        """Every request answered, and two passes of the follower returned since the last answer (one of them a model
        run where the cell ends NORMAL), or a pass raised; or, the cell ending CLEARED, the weights ``released()``
        ``BLOCKED_S`` after the last answer with the pass that cleared still inside (``blocked``)."""
        results = list(self.loop.results)
        if any(isinstance(r, BaseException) for r in results):
            return True
        if len(self.answers) < len(self.asked):
            return False
        last = self.answers[-1] if self.answers else None
        after = results[last["passes"] if last else 0:]
        if len(after) >= 2 and (want != "NORMAL" or "ran" in after):
            return True
        since = last["at"] if last else self.started_at
        if want == "CLEARED" and time.monotonic() - since >= BLOCKED_S and released():
            self.blocked = True
            return True
        return False

    def stop(self) -> None:
        self.stopped.set()
        for timer in self.timers:
            timer.cancel()


def _counted(route, rank: int) -> int | None:
    """The transfers the trainer has served ``rank`` so far (its hellos), where the path's trainer counts them."""
    feed = route.feed
    if route.path.id == "bucket":
        publisher = feed.publishers.get(rank)
        return len(publisher.replies("hello")) if publisher is not None else 0
    if route.path.id in ("rsync", "gdr"):
        trainer = feed.trainers.get(rank)
        return len(trainer.of("hello")) if trainer is not None else 0
    return None


def _judge_answers(where: str, rank0: _Rank0, first_answer: int, acts: list) -> None:
    """Every answer of rank 0 from ``first_answer`` on found the request still in the cell and the pass that read it
    not yet returned (``acts``: the follower's passes, for the message)."""
    for answer in rank0.answers[first_answer:]:
        check.equal(answer["before"], answer["request"],
                    f"{where}: the cell just before rank 0 wrote {answer['answer']} (a follower never writes it)")
        check.that(answer["returned"] == 0,
                   f"{where}: the pass that read {answer['request']} returned before rank 0 wrote {answer['answer']} "
                   f"({answer['delay_s']:.2f}s after that read; {answer['returned']} pass(es) returned by then): a follower "
                   f"waits for rank 0's answer, its own update failed or not, else its next pass reads the request again "
                   f"and repeats it (passes {acts})")


def _judge_follower_acts(where: str, rank0: _Rank0, results: list, first_answer: int, updates: int, clears: int,
                         release: bool, blocked: bool = False) -> None:
    """Every answer of rank 0 from ``first_answer`` on found the request still in the cell and the pass that read it
    not yet returned; and the follower's passes (``results``) did ``updates`` "updated" and ``clears`` "cleared" (plus
    at most one "cleared" where it ``release``s its startup load; one fewer where the pass that cleared is still
    inside its check at CLEARED, ``blocked``), nothing raised."""
    acts = LoopThread.acts(results)
    _judge_answers(where, rank0, first_answer, acts)
    got = {"updated": acts.count("updated"), "cleared": acts.count("cleared")}
    other = [a for a in acts if a not in ("updated", "cleared")]
    cleared_ok = max(0, clears - blocked) <= got["cleared"] <= clears + release
    check.that(not other and got["updated"] == updates and cleared_ok,
               f"{where}: the follower's passes did {acts} (model runs and idle passes left out), expected "
               f"{updates} update(s) and {clears} clear(s){' (and at most one release of its startup load)' if release else ''}, "
               "once per request and nothing raised")


@pytest.mark.rule("STATUS-RESTART-RECOVERS")
@pytest.mark.parametrize("path_id,left,race", _follower_cases())
def test_restarted_follower_in_one_process(loader, monkeypatch, path_id, left, race):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    caps = loader.adapter.capabilities
    k = FOLLOWER_LOAD_EVENT if race == "in-load" else K_POINTS[list(PATHS).index(path_id) % len(K_POINTS)]
    update_asked = left == "UPDATING" or (left == "CLEARED" and race != "none")
    clear_asked = left == "CLEARING" or (left == "NORMAL" and race != "none")
    want = "NORMAL" if update_asked or left == "NORMAL" and not clear_asked else "CLEARED"
    version = 2 if update_asked else 1
    route = Route(loader, path_id)
    where = f"{path_id}: rank 1 of 2 (a follower) restarted against a cell left {left}, the API's request {race}" + (
        f" (call event {k})" if race in ("in-load", "in-pass") else "")
    rank0, loop = None, None
    try:
        with C.Cell(C.NORMAL) as cell:
            rank0 = _Rank0(cell, FOLLOWER_RANK0_S)
            # The trainer publishes before the new worker starts what the API's update asks for, where it asks before
            # the worker's first read (before it, or while the startup load runs); the others publish when they ask.
            early = left == "UPDATING" or (update_asked and race == "in-load")
            route.publish(1, M.state(SPEC, version=2 if early else 1), 2 if early else 1)
            if left in ("UPDATING", "CLEARING"):
                rank0.ask(_VALUE_OF[left])  # the API's request, still waiting when the worker died
            else:
                cell.write(_VALUE_OF[left])
                rank0.written.add(left)
            request = C.UPDATING if left == "CLEARED" else C.CLEARING  # the API's next, racing the restart

            def ask():
                if request == C.UPDATING and race != "in-load":
                    route.publish(1, M.state(SPEC, version=2), 2)
                rank0.ask(request)

            at = _At(k, ask) if race in ("in-load", "in-pass") else None
            session = _restarted(loader, route, path_id, cell, 1)
            commits: list[int] = []
            if "model.hooks" in caps:  # each committed update, counted
                session.register_hook("restart-follower-count", lambda: commits.append(1))
            watch = _Watch(cell)
            started = time.monotonic()
            loaded = _bounded(session.update, f"{where}: the startup load", at.probe if race == "in-load" else None)
            load_s = time.monotonic() - started
            check.that(not isinstance(loaded, BaseException), f"{where}: the startup load raised {loaded!r}")
            route.feed.settle(1)
            base_commits, base_transfers = len(commits), _counted(route, 1)
            rank0.delay_s = max(FOLLOWER_RANK0_S, 3 * load_s)  # rank 0, the slower, loads too
            if at is not None and race == "in-load":
                at.fire()
            if race == "before-read":
                ask()

            def first_sync(value_read):
                if race == "at-read":  # rank 0 read before the API wrote: it broadcasts that
                    ask()
                    return value_read
                if race == "in-pass":
                    import sys

                    sys.setprofile(at.probe)  # from here on, in the loop's thread, until the pass returns
                rank0.sync(value_read)
                return value_read

            runs = []
            loop = LoopThread(session, run_model=lambda: runs.append(1), first_sync=first_sync)
            rank0.start(loop)
            released = lambda: all(o.data is None for o in session.observe().values())  # noqa: E731
            if race in ("in-pass", "at-read"):
                loop.until(lambda: loop.results)  # the first pass returned (a loop that blocks: the deadline)
            if race == "in-pass":
                at.fire()
            if race == "at-read" and rank0.asked[-1:] != [C.name_of(request)]:
                ask()  # (a loop that never called sync: the request lands after its first pass)
            loop.until(lambda: rank0.settled(want, released))
            route.feed.settle(1)
            seen = watch.stop()
            results = list(loop.results)
            late = " (the pass ended before that event: the request came after it)" if at is not None and at.late else ""
            where += late
            check.that(len(rank0.answers) == len(rank0.asked),
                       f"{where}: rank 0 answered {[a['request'] for a in rank0.answers]} of the requests "
                       f"{rank0.asked}: the follower's loop never read the others (passes {LoopThread.acts(results)})")
            _judge_follower_acts(where, rank0, results, 0, int(update_asked), int(clear_asked), left == "CLEARED",
                                 rank0.blocked)
            foreign = [v for v in seen if v not in rank0.written]
            check.equal(foreign, [], f"{where}: values in the cell that neither the API nor rank 0 wrote (seen {seen})")
            check.equal(C.name_of(cell.read()), want, f"{where}: the cell after {len(results)} pass(es)")
            # The startup load may answer an UPDATING written before it read the cell, or the worker load again
            # instead (where the request landed inside the load, before or after that read, is the loader's).
            unsure = left == "UPDATING" or race == "in-load"
            if "model.hooks" in caps:
                most = 1 if update_asked else 0
                least = 0 if unsure else most
                check.that(least <= len(commits) - base_commits <= most,
                           f"{where}: the follower committed {len(commits) - base_commits} update(s) after its startup "
                           f"load, expected {least if least == most else f'{least} or {most}'} (one request)")
            if base_transfers is not None:
                transfers = _counted(route, 1) - base_transfers
                most = 1 if update_asked else 0
                least = 0 if unsure else most
                check.that(least <= transfers <= most,
                           f"{where}: the trainer served the follower {transfers} transfer(s) after its startup load, "
                           f"expected {least if least == most else f'{least} or {most}'} (one request)")
            if want == "CLEARED":
                check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{where}: the weights, released")
            else:
                check.params_equal(session.observe(), M.state(SPEC, version=version), f"{where}: the weights")
                mark = rank0.answers[-1]["passes"] if rank0.answers else 0
                check.that("ran" in results[mark:], f"{where}: no model run after rank 0's answer (passes "
                                                    f"{LoopThread.acts(results)}, {len(runs)} model run(s) in all)")
            if "status" in caps:
                check.status_is(session, want, f"{where}: after the recovery")

            # The API's next cycle (its clear, when there is anything to clear, then its update), rank 0 answering.
            rank0.delay_s, first, passes, rank0.blocked = NEXT_RANK0_S, len(rank0.answers), len(loop.results), False
            cycle = [C.CLEARING] if want == "NORMAL" else []
            for step in (*cycle, C.UPDATING):
                if step == C.UPDATING:
                    route.publish(1, M.state(SPEC, version=3), 3)
                rank0.ask(step)
                loop.until(lambda step=step: rank0.settled("NORMAL" if step == C.UPDATING else "CLEARED", released))
                route.feed.settle(1)
            next_where = f"{where}; then the API's next cycle ({', '.join(C.name_of(s) for s in (*cycle, C.UPDATING))})"
            _judge_follower_acts(next_where, rank0, list(loop.results)[passes:], first, 1, len(cycle), False, rank0.blocked)
            check.params_equal(session.observe(), M.state(SPEC, version=3), f"{next_where}: the weights (version 3)")
            check.equal(C.name_of(cell.read()), "NORMAL", f"{next_where}: the cell (rank 0's NORMAL)")
            if "status" in caps:
                check.status_is(session, "NORMAL", f"{next_where}: after the update")
    finally:
        _end_follower(loop, rank0, route)


def _end_follower(loop, rank0, route) -> None:
    """A follower case's end: its loop finished and rank 0 stopped (whichever was started), its route closed."""
    try:
        if loop is not None:
            loop.finish()
        if rank0 is not None:
            rank0.stop()
    finally:
        route.close()


def _failed_follower_cases() -> list:
    return [pytest.param(path_id, marks=[pytest.mark.requires("status.cell", *path.capabilities),
                                         pytest.mark.modes(path=path_id, left="UPDATING", race="none", rank="follower")],
                         id=path_id) for path_id, path in PATHS.items()]


# The versions the trainer publishes in test_restarted_follower_whose_loads_fail: (version, the parameter it lacks)
FAILING_VERSIONS = ((2, "norm.bias"), (3, "embed.weight"))


@pytest.mark.rule("STATUS-RESTART-RECOVERS")
@pytest.mark.parametrize("path_id", _failed_follower_cases())
def test_restarted_follower_whose_loads_fail(loader, monkeypatch, path_id):
    """A follower (rank 1 of 2) restarted against issue 19's UPDATING, whose startup load fails (version 2 lacks
    norm.bias), and whose loop's load for that request fails too (the trainer serves version 2 again); rank 0,
    whose loads failed alike, answers CLEARED. Right after, a second failure: the trainer publishes version 3 lacking
    embed.weight and rank 0 asks UPDATING, then answers CLEARED. Then version 4, whole: rank 0's UPDATING, its NORMAL.
    For each request the follower acts once, the pass that read it returns only once rank 0's answer is in the cell
    (else its next pass reads the request again and repeats it), a failed update is never reported "updated", the
    follower writes nothing and releases every parameter; after the third the weights are version 4 bit for bit."""
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    caps = loader.adapter.capabilities
    route = Route(loader, path_id)
    where = f"{path_id}: rank 1 of 2 (a follower) restarted against a cell left UPDATING, its startup load failing"
    rank0, loop = None, None
    try:
        with C.Cell(C.NORMAL) as cell:
            rank0 = _Rank0(cell, FOLLOWER_RANK0_S)
            rank0.answer_of[C.UPDATING] = C.CLEARED  # rank 0's own loads fail the same way
            version, lacks = FAILING_VERSIONS[0]
            route.publish(1, {n: a for n, a in M.state(SPEC, version=version).items() if n != lacks}, version)
            rank0.ask(C.UPDATING)  # the API's update, still waiting when the worker died
            session = _restarted(loader, route, path_id, cell, 1)
            commits: list[int] = []
            if "model.hooks" in caps:
                session.register_hook("restart-follower-count", lambda: commits.append(1))
            watch = _Watch(cell)
            started = time.monotonic()
            loaded = _bounded(session.update, f"{where}: the startup load")
            rank0.delay_s = max(FOLLOWER_RANK0_S, 3 * (time.monotonic() - started))
            route.feed.settle(1)
            check.that(isinstance(loaded, Exception), f"{where}: the startup load of version {version} lacking {lacks} "
                       f"returned {loaded!r} instead of raising (the case's premise)")
            loop = LoopThread(session)
            for step, (version, lacks) in enumerate((*FAILING_VERSIONS, (4, None))):
                state = M.state(SPEC, version=version)
                route.publish(1, {n: a for n, a in state.items() if n != lacks}, version)  # (version 2: served again)
                # (counted before the request: a pass that reads it and returns before this line is still its pass)
                first, passes = len(rank0.answers), len(loop.results)
                if step == 0:
                    rank0.start(loop)
                else:
                    rank0.delay_s = NEXT_RANK0_S  # (the loop's own waits: STATUS-FAILED-NOT-NORMAL's, in full)
                    if lacks is None:
                        rank0.answer_of[C.UPDATING] = C.NORMAL
                    rank0.ask(C.UPDATING)
                loop.until(lambda: len(rank0.answers) == len(rank0.asked)
                           and len(loop.results) >= rank0.answers[-1]["passes"] + 2)
                route.feed.settle(1)
                results = list(loop.results)[passes:]
                acts = LoopThread.acts(results)
                shown = acts if len(acts) <= 6 else [*acts[:6], f"... {len(acts) - 6} more"]
                here = (f"{where}; {'its loop load of' if step == 0 else 'rank 0 then asking for'} version {version}"
                        + (f" (lacking {lacks}: rank 0 answers CLEARED)" if lacks else " (whole)"))
                check.that(len(rank0.answers) == len(rank0.asked), f"{here}: the follower's loop never read rank 0's "
                           f"request (passes {shown})")
                _judge_answers(here, rank0, first, shown)
                if lacks is None:
                    check.equal(shown, ["updated"], f"{here}: the follower's passes (model runs and idle passes left "
                                                   "out): one update for the one request")
                    check.params_equal(session.observe(), M.state(SPEC, version=version), f"{here}: the weights")
                    check.equal(C.name_of(cell.read()), "NORMAL", f"{here}: the cell (rank 0's NORMAL)")
                    if "status" in caps:
                        check.status_is(session, "NORMAL", f"{here}: after the update")
                else:
                    check.that(len(acts) == 1 and acts[0] != "updated",
                               f"{here}: the follower's passes did {shown} (model runs and idle passes left out): its "
                               "failed update acted on once and never reported \"updated\"")
                    check.not_loaded(session.observe(), [p.name for p in SPEC.all_params],
                                     f"{here}: the weights, released after the failed update")
                    check.equal(C.name_of(cell.read()), "CLEARED", f"{here}: the cell (rank 0's CLEARED)")
                    if "status" in caps:
                        check.status_not(session, "NORMAL", f"{here}: after the failed update")
                if "model.hooks" in caps:
                    check.equal(len(commits), 0 if lacks else 1, f"{here}: the follower's committed updates")
            seen = watch.stop()
            foreign = [v for v in seen if v not in rank0.written]
            check.equal(foreign, [], f"{where}: values in the cell that neither the API nor rank 0 wrote (seen {seen})")
    finally:
        _end_follower(loop, rank0, route)
