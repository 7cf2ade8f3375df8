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

from conformance import check, harness
from conformance.paths import PATHS, Route, worker
from fixtures import models as M
from fixtures import status_cell as C

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
    from fixtures import buckets as B

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
            marks = [pytest.mark.requires("status.cell", "control", *path.capabilities, *extra)]
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
