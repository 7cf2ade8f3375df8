"""What the worker loop does around a change of the weights: in-flight requests, communication groups,
the KV cache's status cell, and acting once per request. Spec: SPEC.md § STATUS (the loop's fixes).

The suite passes the loop a runner (capability ``loop.runner``): a ``Probe`` that records every call the
loop makes to it (``clear_requests``, ``shutdown_process_group``, ``restart_process_group``) with what held at
that moment: the weights (version 1, version 2, cleared, or a mix), the status cell and the KV cache's cell.
A worker thread runs iteration after iteration as the worker's event loop does, the test playing the API
(and, for a follower, rank 0); every wait is bounded, so a loop that never returns fails the case naming it.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter

import pytest

from conformance import check
from conformance import loop_schedule as L
from conformance.harness import Worker
from conformance.thread_state import looked_again
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))
NEEDS = ("status.cell", "loop.runner", L.ANY_LEVEL)
CYCLE_TIMEOUT_S = 10.0  # a healthy cycle takes milliseconds; this bounds a stuck loop on a loaded machine
IDLE_S = 0.03  # how long the API waits at CLEARED before it writes UPDATING (idle iterations in between), from
# the moment the worker has looked at the CLEARED (thread_state.looked_again: an UPDATING written before then is
# lost on a loop that spins until it reads CLEARED, as the scheduler decides, not the rule)
MODES = pytest.mark.parametrize("block", [pytest.param(False, id="non-blocking"), pytest.param(True, id="blocking")])


class Probe:
    """The suite's runner: each call recorded as ``(what, weights, cell, kv)`` at the moment it is made."""

    def __init__(self, session, cell: C.Cell, kv: C.Cell | None = None):
        self.session, self.cell, self.kv = session, cell, kv
        self.versions = {v: {n: a.tobytes() for n, a in M.state(SPEC, version=v).items()} for v in (1, 2, 3)}
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def weights(self) -> str:
        observed = {n: o.data for n, o in self.session.observe().items()}
        if all(d is None for d in observed.values()):
            return "cleared"
        for v, state in self.versions.items():
            if observed == state:
                return f"v{v}"
        return "mixed"

    def note(self, what: str) -> None:
        entry = (what, self.weights(), C.name_of(self.cell.read()), C.name_of(self.kv.read()) if self.kv else None)
        with self.lock:
            self.calls.append(entry)

    def clear_requests(self) -> None:
        self.note("clear_requests")

    def shutdown_process_group(self, group="default") -> None:
        self.note(f"shutdown:{group}")

    def restart_process_group(self, group="default") -> None:
        self.note(f"restart:{group}")

    def of(self, prefix: str) -> list[tuple]:
        with self.lock:
            return [c for c in self.calls if c[0].startswith(prefix)]

    def show(self) -> str:
        with self.lock:
            return "; ".join(f"{w} ({weights}, cell {cell}{f', kv {kv}' if kv else ''})" for w, weights, cell, kv in self.calls)


class WorkerThread(threading.Thread):
    """The worker's event loop: iterations until one returns "updated" (or raises, or ``stop``)."""

    def __init__(self, session, probe: Probe, block: bool):
        super().__init__(name="conformance-worker-loop", daemon=True)
        self.session, self.probe, self.block = session, probe, block
        self.results: list[str] = []
        self.stop = threading.Event()
        self.start()

    def run(self):
        while not self.stop.is_set():
            try:
                result = self.session.worker_iteration(lambda: self.probe.note("run"), block=self.block,
                                                       sync=lambda value: value, runner=self.probe)
            except BaseException as e:  # noqa: BLE001 (judged by the test)
                self.results.append(f"raised {type(e).__name__}: {e}")
                return
            self.probe.note(f"end:{result}")
            self.results.append(result)
            if result == "updated":
                return
            time.sleep(0.002)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def _finish(worker: WorkerThread, cell: C.Cell) -> None:
    """Wait for the worker's last iteration; one still inside after ``CYCLE_TIMEOUT_S`` is released with NORMAL
    in the cell (so that it stops polling) and judged on what it had returned by then."""
    worker.join(CYCLE_TIMEOUT_S)
    worker.stop.set()
    if worker.is_alive():
        cell.write(C.NORMAL)
        worker.join(2.0)


def _loaded(loader, cell, **options):
    """Rank 0 of one on ``cell``, version 1 loaded, version 2 published for the cycle."""
    level = L.level_of(loader.adapter)
    L.publish(loader.model_dir, SPEC, 1, level)
    session = loader.open(SPEC, options={"status_cell": cell.name, **options})
    session.update()
    L.publish(loader.model_dir, SPEC, 2, level)
    return session


def _cycles(session, cell: C.Cell, probe: Probe, block: bool, loader) -> str:
    """Two of :func:`_cycle` (versions 2 and 3): the loop's first and second clear and update (modes: call)."""
    _, first = _cycle(session, cell, probe, block)
    L.publish(loader.model_dir, SPEC, 3, L.level_of(loader.adapter))
    _, second = _cycle(session, cell, probe, block, version=3)
    return f"{first}; then {second}"


def _cycle(session, cell: C.Cell, probe: Probe, block: bool, version: int = 2) -> tuple[WorkerThread, str]:
    """The API's clear, then its update once the cell reads CLEARED; the worker loop runs throughout.
    Returns the worker and where it ran, after checking the cycle completed with ``version`` loaded."""
    mode = "blocking" if block else "non-blocking"
    worker = WorkerThread(session, probe, block)
    cell.write(C.CLEARING)
    cleared = _wait_for(lambda: cell.read() == C.CLEARED or not worker.is_alive(), CYCLE_TIMEOUT_S)
    looked_again(os.getpid(), worker.native_id, timeout_s=CYCLE_TIMEOUT_S)
    time.sleep(IDLE_S)
    cell.write(C.UPDATING)
    _finish(worker, cell)
    where = f"{mode} worker loop, one clear/update cycle (iterations: {worker.results}; runner: {probe.show()})"
    check.that(cleared and not worker.is_alive() and worker.results[-1:] == ["updated"],
               f"{where}: the cycle did not complete within {CYCLE_TIMEOUT_S:g}s (cell {C.name_of(cell.read())})")
    check.params_equal(session.observe(), M.state(SPEC, version=version), f"{where}: after the update")
    return worker, where


@pytest.mark.rule("STATUS-REQUESTS-CLEARED")
@pytest.mark.requires(*NEEDS)
@pytest.mark.modes(op=("clear", "update"), call=("first", "second"))
@MODES
def test_requests_cleared_before_the_weights_change(loader, block):
    with C.Cell(C.NORMAL) as cell:
        session = _loaded(loader, cell)
        probe = Probe(session, cell)
        where = _cycles(session, cell, probe, block, loader)
        calls = probe.of("clear_requests")
        before_clear = [c for c in calls if c[1] in ("v1", "v2") and c[2] == "CLEARING"]  # a version whole, loaded
        before_update = [c for c in calls if c[1:3] == ("cleared", "UPDATING")]
        wrong = [c for c in calls if c not in before_clear and c not in before_update]
        check.that(before_clear and before_update and not wrong,
                   f"{where}: clear_requests() must come before each clear (a version loaded whole, cell CLEARING) and "
                   f"before the update (weights cleared, cell UPDATING), never once the weights changed or in an "
                   f"iteration that changes nothing; got {len(before_clear)} before the clear, {len(before_update)} "
                   f"before the update, at the wrong moment: {wrong}")


@pytest.mark.rule("STATUS-REQUESTS-CLEARED")
@pytest.mark.requires(*NEEDS)
@pytest.mark.modes(op="update", call=("first", "second"))
@MODES
def test_requests_not_cleared_again_after_a_failed_update(loader, block):
    """A cycle whose update fails (version 2's snapshot lacks its last parameter: the others land first), then the
    API's update of a fixed version 3: the requests are stopped once before the clear and once before each update
    (weights cleared, cell UPDATING), and never again, not while the loop releases what the failed update left nor
    in the passes that idle at the CLEARED it then writes."""
    level = L.level_of(loader.adapter)
    with C.Cell(C.NORMAL) as cell:
        session = _loaded(loader, cell)
        state = dict(sorted(M.state(SPEC, version=2).items()))
        lacking = list(state)[-1]
        from weightsync.fixtures import snapshot as S

        S.write_level(level, loader.model_dir, None, 0, 0, {n: a for n, a in state.items() if n != lacking})
        probe = Probe(session, cell)
        worker = WorkerThread(session, probe, block)
        cell.write(C.CLEARING)
        _wait_for(lambda: cell.read() == C.CLEARED or not worker.is_alive(), CYCLE_TIMEOUT_S)
        looked_again(os.getpid(), worker.native_id, timeout_s=CYCLE_TIMEOUT_S)
        time.sleep(IDLE_S)
        cell.write(C.UPDATING)
        # The failing pass raises (or returns something else than "updated"); then passes may idle at what the loop
        # wrote. Wait for the failure, then a while at the cell it leaves.
        _wait_for(lambda: not worker.is_alive() or (cell.read() != C.UPDATING and len(worker.results) >= 3),
                  CYCLE_TIMEOUT_S)
        time.sleep(IDLE_S)
        worker.stop.set()
        worker.join(CYCLE_TIMEOUT_S)
        failed = f"{'blocking' if block else 'non-blocking'} worker loop, an update lacking {lacking} " \
                 f"(iterations: {worker.results}; runner: {probe.show()})"
        check.that("updated" not in worker.results, f"{failed}: an iteration returned 'updated'")
        _stopped_once_each(probe, 1, failed)
        if cell.read() != C.CLEARED:  # the loop kept what the failed update left: STATUS-FAILED-NOT-NORMAL's to judge
            return
        # The API asks again (from the CLEARED the loop wrote): one more stop, before that update.
        L.publish(loader.model_dir, SPEC, 3, level)
        worker = WorkerThread(session, probe, block)
        cell.write(C.UPDATING)
        _finish(worker, cell)
        again = f"{failed}; then the update of version 3 (iterations: {worker.results}; runner: {probe.show()})"
        check.that(worker.results[-1:] == ["updated"], f"{again}: the cycle did not complete")
        check.params_equal(session.observe(), M.state(SPEC, version=3), again)
        _stopped_once_each(probe, 2, again)


def _stopped_once_each(probe: Probe, updates: int, where: str) -> None:
    """clear_requests() came once before the one clear (version 1 loaded, cell CLEARING) and once before each of
    ``updates`` updates (weights cleared, cell UPDATING), and at no other moment."""
    calls = probe.of("clear_requests")
    before_clear = [c for c in calls if c[1] == "v1" and c[2] == "CLEARING"]
    before_update = [c for c in calls if c[1:3] == ("cleared", "UPDATING")]
    wrong = [c for c in calls if c not in before_clear and c not in before_update]
    check.that(len(before_clear) == 1 and len(before_update) == updates and not wrong,
               f"{where}: clear_requests() must come once before the clear (version 1 loaded, cell CLEARING) and once "
               f"before each of {updates} update(s) (weights cleared, cell UPDATING), never once the weights changed nor "
               f"at the release of the failed update's weights; got {len(before_clear)} before the clear, "
               f"{len(before_update)} before an update, at the wrong moment: {wrong}")


@pytest.mark.rule("STATUS-COMM-GROUPS")
@pytest.mark.requires(*NEEDS)
@pytest.mark.modes(op=("clear", "update"), call=("first", "second"))
@MODES
def test_comm_groups_shut_down_only_when_asked(loader, block):
    with C.Cell(C.NORMAL) as cell:
        session = _loaded(loader, cell)
        probe = Probe(session, cell)
        where = _cycles(session, cell, probe, block, loader)
        shut = probe.of("shutdown:")
        restarted = probe.of("restart:")
        if not block:
            check.that(not shut and not restarted,
                       f"{where}: a worker that goes back to its loop after the clear (block=False: "
                       f"shutdown_comm_group_if_worker_idle off) needs its groups: none may be shut down or restarted")
            return
        down = {c[0].partition(":")[2] for c in shut}
        up = {c[0].partition(":")[2] for c in restarted if c[1] == "cleared"}
        late = [c for c in restarted if c[1] != "cleared"]
        check.that(down <= up and not late,
                   f"{where}: every group shut down at the clear ({sorted(down)}) must be restarted before the new "
                   f"weights load (restarted while cleared: {sorted(up)}; restarted after the weights changed: {late})")


@pytest.mark.rule("STATUS-KV-CELL")
@pytest.mark.requires(*NEEDS)
@pytest.mark.modes(op=("clear", "update"), call=("first", "second"), outcome="ok")  # failed: test_status_failures.py
@MODES
def test_kv_cache_cell_told_before_the_weights_change(loader, block):
    with C.Cell(C.NORMAL) as cell, C.Cell(C.NORMAL, name=f"{cell.name}-kv") as kv:
        session = _loaded(loader, cell, kv_cache_cell=kv.name)
        probe = Probe(session, cell, kv)
        check.equal(C.name_of(kv.read()), "NORMAL", "the KV cache's cell after the first load (the loop's only)")
        where = _cycles(session, cell, probe, block, loader)
        calls = probe.of("clear_requests") + probe.of("end:")
        late = [c for c in probe.of("clear_requests") if (c[2], c[3]) not in (("CLEARING", "CLEARING"), ("UPDATING", "UPDATING"))]
        foreign = [c for c in calls if c[3] not in ("NORMAL", "CLEARING", "UPDATING")]
        cleared_end = [c for c in probe.of("end:cleared") if c[3] != "CLEARING"]
        check.that(not late and not foreign and not cleared_end,
                   f"{where}: the KV cache's cell {kv.name} must read CLEARING by the time the loop stops requests for "
                   f"a clear and UPDATING for an update (wrong: {late}), CLEARING when the clearing iteration returns "
                   f"(wrong: {cleared_end}), and never a value the loop does not write ({foreign})")
        check.equal(C.name_of(kv.read()), "UPDATING",
                    f"{where}: the KV cache's cell after the cycle (the loop's UPDATING; NORMAL is the cache manager's)")


RANK0_AFTER_S = 0.15  # rank 0 writes this long after the follower started its clear (it clears more slowly)


@pytest.mark.rule("STATUS-ONCE-PER-REQUEST")
@pytest.mark.requires(*NEEDS)
@pytest.mark.modes(op=("clear", "update"))
@MODES
def test_follower_acts_once_per_request(loader, monkeypatch, block):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    level = L.level_of(loader.adapter)
    L.publish(loader.model_dir, SPEC, 1, level, 1, 6)
    with C.Cell(C.NORMAL) as cell:
        session = loader.open(SPEC, worker=Worker(1, "5,6", "1"), options={"status_cell": cell.name})
        started = time.monotonic()
        session.update()
        load_s = time.monotonic() - started  # rank 0 finishes its update well after this rank's
        L.publish(loader.model_dir, SPEC, 2, level, 1, 6)
        probe = Probe(session, cell)
        worker = WorkerThread(session, probe, block)
        timeline = []

        def rank0_after(request_seen, value, wait_s):
            # wait_s after the follower began (however long a loaded machine takes it to begin), never
            # sooner: rank 0 is the slower. (Waiting at most wait_s for it to begin, rank 0 once wrote NORMAL
            # before a starved follower had looked at UPDATING, and the run judged the follower for a race
            # the rule does not set.)
            _wait_for(request_seen, CYCLE_TIMEOUT_S)
            time.sleep(wait_s)
            timeline.append((C.name_of(value), round(time.monotonic() - started, 3)))
            cell.write(value)

        cell.write(C.CLEARING)
        # the follower's clear began: it stopped its requests, or (a loop without that step) shut a group down
        rank0_after(lambda: probe.of("clear_requests") or probe.of("shutdown:"), C.CLEARED, RANK0_AFTER_S)
        if not block:
            _wait_for(lambda: probe.of("end:"), L.NONBLOCK_RETURN_S)
        looked_again(os.getpid(), worker.native_id, times=2, timeout_s=CYCLE_TIMEOUT_S)  # it polls for rank 0's CLEARED
        time.sleep(IDLE_S)
        cell.write(C.UPDATING)
        rank0_after(lambda: [c for c in probe.of("") if c[2] == "UPDATING"], C.NORMAL, max(RANK0_AFTER_S, 3 * load_s))
        _finish(worker, cell)
        where = (f"rank 1 of 2 ({'blocking' if block else 'non-blocking'}), rank 0 writing {timeline} s after its start "
                 f"(iterations: {worker.results}; runner: {probe.show()})")
        check.that(not worker.is_alive() and worker.results[-1:] == ["updated"], f"{where}: the cycle did not complete")
        requests = Counter(c[2] for c in probe.of("clear_requests"))
        groups = Counter(c[0] for c in probe.calls if c[0].startswith(("shutdown:", "restart:")))
        twice = {k: n for k, n in {**requests, **groups}.items() if n > 1}
        check.that(not twice, f"{where}: a rank that finishes before rank 0 must act once per request (one clear, one "
                              f"update, each group shut down and restarted at most once); repeated: {twice}")
        check.params_equal(session.observe(), M.state(SPEC, version=2), f"{where}: after the update")
        check.equal(C.name_of(cell.read()), "NORMAL", f"{where}: the cell (rank 0's NORMAL; a follower never writes)")
