"""Seeded schedules of API writes against a worker loop in a forked child (``loop_driver``).

Each seed is one clear/update cycle. The seed picks where the API's writes fall between the worker's
steps: the CLEARING after ``a`` of the worker's hooks at NORMAL, the UPDATING ``b`` hooks after the
worker's CLEARED is seen (``hooks`` mode, the worker waits at each hook while the parent writes), or
``delay_us`` microseconds after it, the worker running free (``timed`` mode, for the moments between
hooks), counted from the moment the worker has looked at the cell again after its CLEARED
(``thread_state.looked_again``: an API writes UPDATING only after it saw CLEARED, long after the worker
did; written sooner, a loop that spins until it reads CLEARED never sees it, and whether it did depended
on the scheduler). Whether a non-blocking loop returned at CLEARED is judged the same way: no hook after
the worker has gone back to waiting ``STAYS`` times, never a wall-clock limit alone. The trainer (this
process) publishes the next version before the UPDATING. While the schedule
runs, the parent reads the cell at every event and records each violation of the loop's rules by
invariant, with the seed and the events leading to it, so a failure names its rerun:
``CONFORMANCE_LOOP_SEED=N`` runs that seed alone.
"""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S
from weightsync.fixtures import status_cell as C

from .loop_driver import END_RESULTS, DriverError, LoopChild
from .thread_state import looked_again

EVENT_TIMEOUT_S = 5.0  # a healthy worker answers in milliseconds (an update: a second on a loaded machine); this bounds a stuck one
NONBLOCK_RETURN_S = 1.0  # how long a non-blocking worker may stay in an iteration once the cell reads CLEARED
BLOCK_RELEASE_S = 0.1  # a long wait at CLEARED for a blocking loop: ten of FastDeploy's 10 ms polls (STATUS-BLOCK-WAITS)
STAYS = 3  # a loop that has gone back to waiting this many times at CLEARED without returning stays there (NONBLOCK)

# Invariants, one per rule.
KEPT = "request-kept"  # STATUS-REQUEST-KEPT
NO_RUN = "no-run"  # STATUS-NO-RUN-AFTER-CHANGE
NONBLOCK = "nonblock-returns"  # STATUS-NONBLOCK-RETURNS
BLOCK = "block-waits"  # STATUS-BLOCK-WAITS
PROGRESS = "progress"  # the cycle could not complete (a consequence of another violation, or a stuck loop)


@dataclass(frozen=True)
class Schedule:
    seed: int
    mode: str  # "hooks" | "timed"
    clear_after: int  # hooks at NORMAL before the CLEARING is written
    update_after: int  # hooks (hooks mode) or microseconds (timed mode) after CLEARED before the UPDATING

    @classmethod
    def from_seed(cls, seed: int, block: bool) -> "Schedule":
        rng = random.Random(seed)
        mode = "timed" if block or rng.random() < 0.25 else "hooks"
        later = rng.choice([0, 50, 200, 1000, 3000, 12000]) if mode == "timed" else rng.randrange(6)
        return cls(seed, mode, rng.randrange(4), later)

    def describe(self) -> str:
        after = "hook(s) after CLEARED" if self.mode == "hooks" else "us after the worker read CLEARED"
        return (f"seed {self.seed} ({self.mode}: CLEARING after {self.clear_after} hook(s) at NORMAL, UPDATING "
                f"{self.update_after} {after})")


@dataclass
class Outcome:
    violations: dict[str, list[str]] = field(default_factory=dict)
    cycles: int = 0
    report: dict | None = None
    versions: list[int] = field(default_factory=list)
    events: list = field(default_factory=list)

    def add(self, invariant: str, schedule: Schedule, text: str, events) -> None:
        tail = ", ".join(f"{k}:{_show(k, v)}" for k, v, _ in events[-10:])
        self.violations.setdefault(invariant, []).append(
            f"{schedule.describe()}: {text} (last events: {tail}; rerun: CONFORMANCE_LOOP_SEED={schedule.seed})")


def _show(kind: str, value: int) -> str:
    if kind == "end":
        return END_RESULTS[value] if 0 <= value < len(END_RESULTS) else str(value)
    return C.name_of(value)


def seeds(count: int, base: int) -> list[int]:
    only = os.environ.get("CONFORMANCE_LOOP_SEED")
    return [int(only)] if only else [base + i for i in range(count)]


# The loop's rules hold whatever snapshot level the loader reads: the first of these it claims.
LEVELS = (("single", "snapshot.single"), ("legacy", "snapshot.legacy"), ("parts", "snapshot.parts"))
ANY_LEVEL = "|".join(cap for _, cap in LEVELS)  # for @pytest.mark.requires: any one will do


def level_of(adapter) -> str:
    """The snapshot level the loop's tests write for ``adapter`` (``LEVELS``)."""
    caps = set(adapter.capabilities)
    return next(level for level, cap in LEVELS if cap in caps)


def publish(model_dir: str, spec, version: int, level: str = "single", rank: int = 0, gpu: int = 0) -> None:
    """The trainer's next version: the snapshot of (rank, GPU) at ``level`` (default the single file of rank 0, GPU 0)."""
    S.write_level(level, model_dir, None, rank, gpu, dict(sorted(M.state(spec, version=version).items())))


class Runner:
    def __init__(self, loop: LoopChild, cell: C.Cell, model_dir: str, spec, block: bool, outcome: Outcome,
                 level: str = "single"):
        self.loop, self.cell, self.model_dir, self.spec, self.block = loop, cell, model_dir, spec, block
        self.level = level
        self.outcome = outcome
        self.version = 1
        self.cleared_by_sync = False  # this iteration synced CLEARING


    def event(self, schedule: Schedule, phase: str, timeout_s: float = EVENT_TIMEOUT_S):
        event = self.loop.next_event(timeout_s)
        if event is None:
            return None
        kind, value, flag = event
        if kind == "run" and (value != C.NORMAL or not flag):
            self.outcome.add(NO_RUN, schedule, f"the model ran in an iteration that synced {C.name_of(value)} "
                             f"with {'every' if flag else 'NOT every'} parameter loaded ({phase})", self.loop.events)
        elif kind == "sync":
            self.cleared_by_sync = value == C.CLEARING
        elif kind == "end" and self.cleared_by_sync and self.block and value != END_RESULTS.index("updated"):
            result = END_RESULTS[value] if 0 <= value < len(END_RESULTS) else value
            self.outcome.add(BLOCK, schedule, f"the blocking iteration that synced CLEARING returned {result!r}: it "
                             "must stay until the next update has committed", self.loop.events)
        return event

    def cycle(self, s: Schedule) -> bool:
        """One clear/update cycle; False when it could not complete (recorded)."""
        loop, cell, out = self.loop, self.cell, self.outcome
        # 1. NORMAL: let `clear_after` hooks pass, then the API writes CLEARING.
        for _ in range(s.clear_after):
            if self.event(s, "NORMAL") is None:
                out.add(PROGRESS, s, "the loop stopped answering at NORMAL", loop.events)
                return False
            loop.answer()
        if self.event(s, "NORMAL") is None:
            out.add(PROGRESS, s, "the loop stopped answering at NORMAL", loop.events)
            return False
        self.version += 1
        publish(self.model_dir, self.spec, self.version, self.level)
        cell.write(C.CLEARING)
        loop.answer()
        # 2. until the worker's CLEARED: a CLEARING is never overwritten by a value read before it.
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while True:
            now = cell.read()
            if now == C.CLEARED:
                break
            if now != C.CLEARING:
                out.add(KEPT, s, f"the cell read {C.name_of(now)} after the API wrote CLEARING, before the worker's "
                        "CLEARED: the worker wrote back a value it had read", loop.events)
                return False
            if time.monotonic() > deadline:
                out.add(PROGRESS, s, "the worker did not clear within the deadline", loop.events)
                return False
            event = self.event(s, "CLEARING", timeout_s=0.002)
            if event is not None:
                loop.answer()
        return self.after_cleared(s)

    def after_cleared(self, s: Schedule) -> bool:
        loop, cell, out = self.loop, self.cell, self.outcome
        if s.mode == "hooks":
            # The worker goes back to its loop at CLEARED (non-blocking) and must keep coming back.
            for k in range(s.update_after + 1):
                event = self.hook_at_cleared(s)
                if event is None:
                    last = "no hook after CLEARED" if k == s.update_after else f"hook {k} after CLEARED never came"
                    out.add(NONBLOCK, s, f"{last}: the worker went back to waiting {STAYS} times at CLEARED without "
                            "returning (it waits for the next update): the non-blocking loop did not return at CLEARED",
                            loop.events)
                    cell.write(C.UPDATING)  # release a worker that waits: the cycle goes on, judged on the rest
                    return self.until_normal(s)
                if k == s.update_after:
                    break
                if cell.read() != C.CLEARED:
                    out.add(KEPT, s, f"the cell read {C.name_of(cell.read())} while CLEARED and no request", loop.events)
                    return False
                loop.answer()
            cell.write(C.UPDATING)  # the worker waits at a hook: it returned, so it has read CLEARED
            loop.answer()
        else:
            # Free-running: the worker is inside its iteration (blocking) or between iterations. The delay
            # runs from the moment it has looked at the cell again (module docstring).
            looked_again(loop.pid, timeout_s=EVENT_TIMEOUT_S, between=lambda: self.answer_any(s, "CLEARED"))
            start = time.perf_counter()
            while (time.perf_counter() - start) * 1e6 < s.update_after:
                self.answer_any(s, "CLEARED")
            cell.write(C.UPDATING)
        return self.until_normal(s)

    def answer_any(self, s: Schedule, phase: str) -> None:
        """Answer the worker's next hook, if it has reached one (it waits there otherwise)."""
        if self.event(s, phase, timeout_s=0) is not None:
            self.loop.answer()

    def hook_at_cleared(self, s: Schedule):
        """The worker's next hook while the cell reads CLEARED, or None when it stays in its iteration: no
        hook within ``NONBLOCK_RETURN_S`` and, by then or later, none before it has gone back to waiting
        ``STAYS`` times (a loaded machine can keep a returning worker off a CPU for longer than any delay)."""
        event = self.event(s, "CLEARED", timeout_s=NONBLOCK_RETURN_S)
        if event is not None:
            return event
        got = []

        def arrived() -> bool:
            if not got:
                event = self.event(s, "CLEARED", timeout_s=0)
                if event is not None:
                    got.append(event)
            return bool(got)

        looked_again(self.loop.pid, times=STAYS, timeout_s=EVENT_TIMEOUT_S, between=arrived)
        return got[0] if got or arrived() else None

    def until_normal(self, s: Schedule) -> bool:
        loop, cell, out = self.loop, self.cell, self.outcome
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        updated = False
        while True:
            now = cell.read()
            if now not in (C.UPDATING, C.NORMAL):
                out.add(KEPT, s, f"the cell read {C.name_of(now)} after the API wrote UPDATING: the worker overwrote "
                        "the request", loop.events)
                return False
            if now == C.NORMAL and updated:
                out.versions.append(self.version)
                return True
            if time.monotonic() > deadline:
                out.add(PROGRESS, s, f"no committed update within {EVENT_TIMEOUT_S:g}s of the UPDATING (cell reads "
                        f"{C.name_of(now)})", loop.events)
                return False
            event = self.event(s, "UPDATING", timeout_s=0.002)
            if event is not None:
                if event[0] == "end" and event[1] == END_RESULTS.index("updated"):
                    updated = True
                    if cell.read() != C.NORMAL:
                        out.add(KEPT, s, f"the iteration that updated returned with the cell at "
                                f"{C.name_of(cell.read())}, not NORMAL", loop.events)
                        return False
                loop.answer()


def prologue(session, cell: C.Cell, model_dir: str, spec, outcome: Outcome, level: str = "single",
             block: bool = False) -> int:
    """One cycle of the loop in this process, in the test's mode, before the child takes over: the loop runs
    the model at NORMAL, then, non-blocking, clears at CLEARING, idles at CLEARED, updates at UPDATING, each
    in its own iteration; blocking, the iteration at CLEARING stays until the update (UPDATING written as
    soon as the worker has looked at the cell's CLEARED again; one that returns at CLEARED is a BLOCK violation, and the cycle goes on
    with an UPDATING iteration). (A tool that traces calls, coverage or mutation testing, sees the loop's
    functions called by the test this way; the child's calls die with it.) Each iteration runs in a thread
    with a deadline, so a loop that never returns fails the test instead of hanging it. A non-blocking loop
    that stays at CLEARED (``NONBLOCK_RETURN_S``, and ``STAYS`` waits of its thread there) is released with an
    UPDATING (a NONBLOCK violation only; the cycle is complete once it has updated). Returns the version loaded (0: failed)."""
    steps = [(C.NORMAL, "ran", C.NORMAL, 1), (C.CLEARING, "cleared", C.CLEARED, 0), (C.CLEARED, "idle", C.CLEARED, 0),
             (C.UPDATING, "updated", C.NORMAL, 0)]
    if block:
        steps = [(C.NORMAL, "ran", C.NORMAL, 1), (C.CLEARING, "updated", C.NORMAL, 0)]
    for request, want, after, runs in steps:  # (a list: a blocking loop that returned at CLEARED gets one more step)
        if request != C.NORMAL:
            cell.write(request)
        if request == C.CLEARING:
            publish(model_dir, spec, 2, level)
        ran: list = []
        box: dict = {}

        # The first iteration uses the loop's own broadcast (sync=None: on one rank, the value itself).
        sync = None if request == C.NORMAL else (lambda value: value)

        def iterate():
            try:
                box["result"] = session.worker_iteration(lambda: ran.append(1), block=block, sync=sync)
            except BaseException as e:  # noqa: BLE001 (reported below)
                box["result"] = f"raised {type(e).__name__}: {e}"

        # A loop that does not return at CLEARED would wait for ever: release it after a while (at once
        # when blocking: the API's UPDATING as soon as the worker has looked at its CLEARED).
        thread = threading.Thread(target=iterate, name="conformance-prologue", daemon=True)
        thread.start()
        release = _Release(cell, thread, 0.0 if block else NONBLOCK_RETURN_S, 1 if block else STAYS)
        thread.join(NONBLOCK_RETURN_S + 2 * EVENT_TIMEOUT_S)  # a clear and an update, on a loaded machine
        release.cancel()
        result = box.get("result", f"did not return within {NONBLOCK_RETURN_S + 2 * EVENT_TIMEOUT_S:g}s")
        if block and request == C.CLEARING and result == "cleared" and len(ran) == runs:
            outcome.violations.setdefault(BLOCK, []).append(
                "in-process iteration at CLEARING: the blocking iteration returned 'cleared': it must stay until the "
                "update has committed")
            steps.append((C.UPDATING, "updated", C.NORMAL, 0))  # the cycle goes on, judged on the rest
            continue
        if not block and request == C.CLEARING and result == "updated" and len(ran) == runs \
                and C.name_of(cell.read()) == "NORMAL":
            outcome.violations.setdefault(NONBLOCK, []).append(
                f"in-process iteration at CLEARING: it stayed through CLEARED (at least {NONBLOCK_RETURN_S:g}s, "
                f"going back to waiting {STAYS} times) until released by an UPDATING, and returned 'updated'")
            return 2
        if result != want or C.name_of(cell.read()) != C.name_of(after) or len(ran) != runs:
            invariant = NONBLOCK if request == C.CLEARING and result == "updated" else NO_RUN if len(ran) != runs else PROGRESS
            outcome.violations.setdefault(invariant, []).append(
                f"in-process iteration at {C.name_of(request)}: {result!r} with the cell at {C.name_of(cell.read())} "
                f"and {len(ran)} model run(s); expected {want!r}, {C.name_of(after)}, {runs}")
            outcome.violations.setdefault(PROGRESS, []).append("the in-process cycle before the schedules failed")
            return 0
    return 2


class _Release(threading.Thread):
    """Writes UPDATING (the API's next request) into the cell once it has read CLEARED for ``after_s`` seconds
    and the iteration's thread ``worker``, still inside, has gone back to waiting ``times`` times since
    (thread_state.looked_again: it has read the CLEARED), until cancelled."""

    def __init__(self, cell: C.Cell, worker: threading.Thread, after_s: float, times: int):
        super().__init__(name="conformance-release", daemon=True)
        self.cell, self.worker, self.after_s, self.times, self.done = cell, worker, after_s, times, threading.Event()
        self.start()

    def run(self):
        since = None
        while not self.done.wait(0.002):
            if self.cell.read() != C.CLEARED:
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since >= self.after_s:
                looked_again(os.getpid(), self.worker.native_id, times=self.times, timeout_s=EVENT_TIMEOUT_S,
                             between=self.done.is_set)
                if not self.done.is_set() and self.worker.is_alive() and self.cell.read() == C.CLEARED:
                    self.cell.write(C.UPDATING)
                return

    def cancel(self):
        self.done.set()
        self.join(1.0)


def run(session, cell: C.Cell, model_dir: str, spec, *, block: bool, seed_list, level: str = "single") -> Outcome:
    """Every seed's cycle against one worker loop; the child is stopped at the end and its report
    (digests, status, version) kept in the outcome."""
    outcome = Outcome()
    version = prologue(session, cell, model_dir, spec, outcome, level, block)
    if not version:
        return outcome
    with LoopChild(session, block=block) as loop:
        runner = Runner(loop, cell, model_dir, spec, block, outcome, level)
        runner.version = version
        try:
            for seed in seed_list:
                if not runner.cycle(Schedule.from_seed(seed, block)):
                    break
                outcome.cycles += 1
        except DriverError as e:
            outcome.violations.setdefault(PROGRESS, []).append(str(e))
        outcome.report = loop.stop(timeout_s=10.0)  # (a healthy child stops in milliseconds; a loaded one later)
        outcome.events = loop.events
    return outcome
