"""The status cell after an update that fails inside the worker's loop, and the API asking again. Spec: SPEC.md
STATUS-FAILED-NOT-NORMAL.

The manager's own ``status()`` after a failure is judged elsewhere (LIFE-FAILED-NOT-NORMAL, MODEL-HOOK-FAILURE);
here it is the cell, what the API and the cache manager read. Each case runs the engine's cycle in this process:
the worker's loop is ``session.worker_iteration`` called by this thread (each call bounded by a thread with a
deadline), and the API is the adapter's ``control`` in a thread of its own, writing its request and waiting for
the worker, as FastDeploy's EngineClient does. A follower (tensor-parallel rank 1 of 2) is fed rank 0's broadcast
through ``sync`` while this process plays rank 0, the slower: a little after the follower's loop has read the API's
request, rank 0 writes what it did (CLEARED, NORMAL), having read that the cell still holds the request (a follower
never writes it).

The fault is the suite's input: the trainer's source (a wrong dtype, a missing parameter, the source gone), a
stale-state hook it registers that raises, or the recapture callable it hands the loader that raises. The suite's
hooks and recapture read the cell while they run.

The same cycle, with the KV cache's status cell handed to the loop (``options["kv_cache_cell"]``, capability
``loop.runner``), proves STATUS-KV-CELL on the failure path: the release after a failed update is a clear the loop
makes, and the cache manager learns of it only from the KV cell.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from conformance import check, modes
from conformance import loop_schedule as L
from conformance.loop_driver import LoopThread
from conformance.thread_state import looked_again
from conformance.paths import route  # noqa: F401 (the fixture)
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)),
              ("norm.bias", "float16", (4,)))
RULE = "STATUS-FAILED-NOT-NORMAL"
RANK0_AFTER_S = 0.03  # rank 0, slower than a follower, writes this long after the follower's loop read the request
BLOCKED_S = 1.0  # a follower's loop that has not reached its sync by then is blocked in its check (reads the cell itself)
API_S = 10.0  # the API's wait for a healthy request, on a loaded machine (a loop that raises ends it at once)
API_FAILED_S = 2.0  # the API's wait for the failing update: FastDeploy's guard waits this out (any answer but 200)
ITERATION_S = 10.0  # one worker_iteration, on a loaded machine
HOOKS = ("reset_prefix_cache", "recapture_graphs", "reset_mtp_cache")  # the middle one raises
OLD, BAD, FIXED = 1, 2, 3


def _requires(combo) -> list[str]:
    caps = ["status.cell", modes.CAPABILITY_OF_PATH[combo["path"]]]
    if combo["rank"] == "rank0":
        caps.append("control")
    caps += {"hook": ["model.hooks"], "recapture": ["model.recapture"]}.get(combo["fault"], [])
    return caps


class Worker:
    """One session on the cell, its faults armed by the suite (hooks, recapture), and what they saw; its loop runs
    in a thread of its own (:meth:`start`), as the engine's worker runs it."""

    def __init__(self, rt, cell: C.Cell, rank: int, fault: str, kv: C.Cell | None = None):
        self.rt, self.cell, self.rank, self.fault = rt, cell, rank, fault
        self.broken = False  # the hook or the recapture raises while set
        self.seen: list[tuple[str, str, str]] = []  # (call, cell, status) inside each hook / recapture call
        self.loop: LoopThread | None = None  # the loop, once started; ``results``: what each pass returned or raised
        self.results: list = []
        options = {"status_cell": cell.name, **({"tp_size": 2} if rank else {})}
        if kv is not None:  # STATUS-KV-CELL's cases (capability loop.runner)
            options["kv_cache_cell"] = kv.name
        if fault == "recapture":
            options["recapture"] = self._recapture
        self.session = rt.open(SPEC, rank=rank, options=options)
        if fault == "hook":
            for name in HOOKS:
                self.session.register_hook(name, lambda name=name: self._hook(name))

    def _note(self, what: str) -> None:
        self.seen.append((what, C.name_of(self.cell.read()), self.session.status()))

    def _hook(self, name: str) -> None:
        self._note(f"hook {name}")
        if self.broken and name == HOOKS[1]:
            raise RuntimeError("prefix cache reset ran out of memory")

    def _recapture(self, names) -> None:
        self._note("recapture")
        if self.broken:
            raise RuntimeError("graph capture ran out of memory")

    def start(self) -> None:
        self.loop = LoopThread(self.session).start()
        self.results = self.loop.results

    def finish(self) -> None:
        self.loop.finish(ITERATION_S)

    def until(self, predicate, timeout_s: float = ITERATION_S) -> bool:
        return self.loop.until(predicate, timeout_s)


def _publish(rt, rank: int, version: int, fault: str | None = None) -> str:
    """Version ``version`` of rank ``rank``'s shard, with the source fault ``fault`` (dtype, missing, gone)."""
    st = dict(sorted(M.state(SPEC, version=version).items()))
    names = list(st)
    layout = None
    if fault == "dtype":
        st[names[1]] = st[names[1]].astype(np.float64)
    elif fault == "missing":
        del st[names[-1]]
    elif fault == "gone" and rt.path.id == "bucket":
        layout = lambda update: setattr(update, "fault", ("abort", 1))  # noqa: E731 (the trainer gives up after bucket 0)
    elif fault == "gone" and rt.path.in_place:
        layout = ("cancel", 1) if rt.path.id == "rsync" else ("fail", 1)
    where = rt.publish(rank, st, version, layout)
    if fault == "dtype":
        where += f", {names[1]} as float64"
    elif fault == "missing":
        where += f", without {names[-1]}"
    elif fault == "gone" and rt.path.id == "ipc":
        rt.feed.exports[rank].close()  # the trainer exits: its segments are freed
        where += ", its segments freed"
    elif fault == "gone" and not rt.path.in_place and rt.path.id != "bucket":
        for path in rt.feed.written.pop(rank):
            os.remove(path)
        where += ", then removed"
    return where


def _api(worker: Worker, request: str, timeout_s: float = None, fail_fast: bool = True):
    """The API's ``request``, answered while the worker's loop runs: (the answer, what the loop's passes returned
    or raised meanwhile)."""
    control = worker.rt.loader.adapter.control(worker.cell.name)
    return worker.loop.ask(getattr(control, request), API_S if timeout_s is None else timeout_s, fail_fast=fail_fast)


def _released(worker: Worker) -> bool:
    return all(o.data is None for o in worker.session.observe().values())


def _as_follower(worker: Worker, request: int, written: int, done=None, act=None):
    """Rank 0's ``request``: written to the cell, and broadcast to the follower's loop at its next ``sync`` (rank 0
    read it, whatever the follower reads by then). Rank 0 (this process), the slower, writes ``written`` (what it
    did: CLEARED, NORMAL) ``RANK0_AFTER_S`` after that ``sync`` (or, if no pass reaches it, ``BLOCKED_S`` on and once
    the loop's thread is seen waiting twice without reaching it: a loop that blocks in its check reads the request
    itself), having read the cell first. Returns once rank 0 has written
    and a pass of the follower's loop did something since the request, or, failing that within ``BLOCKED_S``,
    ``done(worker)`` holds (a clear's pass that blocks at CLEARED never returns, yet the follower has cleared):
    (what its passes returned or raised since the request, the cell just before rank 0 wrote). ``act``: wait for
    that result (a pass still retrying the request before passes it saw raised)."""
    before, wrote, started = [], threading.Event(), threading.Event()
    lock = threading.Lock()

    def rank0():
        before.append(C.name_of(worker.cell.read()))
        worker.cell.write(written)
        wrote.set()

    def start_rank0():
        with lock:
            if started.is_set():
                return
            started.set()
        threading.Timer(RANK0_AFTER_S, rank0).start()

    def on_sync(value):
        # Rank 0 broadcasts what it reads in the cell, not what the follower read: a pass that syncs before the
        # request is written gets the value before it (the request installed here, then written: a loaded machine
        # ran a whole follower update between the two, and its loop, given the request before the cell held it,
        # saw it again once the cell did).
        if worker.loop.on_sync is not on_sync:
            return None
        read = worker.cell.read()
        if read != request:
            return read
        worker.loop.on_sync = None  # once: rank 0 broadcasts each request once
        start_rank0()
        return request

    stop = threading.Event()

    def blocked_in_its_check():
        # BLOCKED_S on, and then only once the loop's thread is seen waiting twice without having reached its sync:
        # a loop that passes through its sync does so between two of its waits, so one that waits twice without it
        # is blocked in its check (a slow loop on a loaded machine is not yet that).
        if stop.wait(BLOCKED_S):
            return
        tid = worker.loop.thread.native_id
        if tid is not None:
            looked_again(os.getpid(), tid, times=2, timeout_s=ITERATION_S,
                         between=lambda: started.is_set() or stop.is_set())
        if not stop.is_set():
            start_rank0()

    first = len(worker.results)
    worker.loop.on_sync = on_sync
    worker.cell.write(request)
    fallback = threading.Thread(target=blocked_in_its_check, name="conformance-rank0-fallback", daemon=True)
    fallback.start()
    acted = lambda: wrote.is_set() and (act in worker.results[first:] if act else _acts(worker.results[first:]))  # noqa: E731
    finished = worker.until(acted, BLOCKED_S + RANK0_AFTER_S + 0.5) or (
        worker.until(lambda: acted() or (wrote.is_set() and done is not None and done(worker))))
    stop.set()
    worker.loop.on_sync = None
    return (worker.results[first:] if finished else worker.results[first:] + ["(nothing more within the deadline)"]), before


_acts = LoopThread.acts


def _shown(result) -> str:
    return f"raised {type(result).__name__}: {result}" if isinstance(result, BaseException) else repr(result)


def _loaded(worker: Worker, version: int, where: str) -> None:
    check.params_equal(worker.session.observe(), M.state(SPEC, version=version), where)


@pytest.mark.rule("STATUS-FAILED-NOT-NORMAL")
@pytest.mark.parametrize("combo", modes.params(RULE, requires=_requires))
def test_cell_after_a_failed_update(route, loader, combo):
    path, fault, follower = combo["path"], combo["fault"], combo["rank"] == "follower"
    rank = 1 if follower else 0
    rt = route(path)
    with C.Cell(C.NORMAL) as cell:
        worker = Worker(rt, cell, rank, fault)
        session = worker.session
        rt.publish(rank, M.state(SPEC, version=OLD), OLD)
        session.update()  # the startup load (writes no status)
        rt.feed.settle(rank)
        who = f"{path}: {'rank 1 of 2 (a follower)' if follower else 'rank 0'}"
        worker.start()
        try:
            _failed_then_recovered(worker, rt, cell, who, follower)
        finally:
            worker.finish()


def _failed_then_recovered(worker: Worker, rt, cell: C.Cell, who: str, follower: bool) -> None:
    session, fault, rank = worker.session, worker.fault, worker.rank
    # The API's clear, then its update of a version that fails.
    if follower:
        results, before = _as_follower(worker, C.CLEARING, C.CLEARED, done=_released)
        check.equal((before, C.name_of(cell.read()), _released(worker)), (["CLEARING"], "CLEARED", True),
                    f"{who}: rank 0's CLEARING: the cell before rank 0's CLEARED and after, every parameter released "
                    f"(the loop's passes: {_acts(results)})")
    else:
        answer, results = _api(worker, "clear_load_weight")
        check.equal((answer, C.name_of(cell.read())), ((200, "clear model weight successfully"), "CLEARED"),
                    f"{who}: the API's clear and the cell (the loop's passes meanwhile: {_acts(results)})")
    where = _publish(rt, rank, BAD, fault if fault in ("dtype", "missing", "gone") else None)
    worker.broken = True
    worker.seen.clear()
    at = f"{who}: after the update of {where} failed ({fault})"
    if follower:  # rank 0 failed too; it releases its weights and writes CLEARED, after the follower read the request
        answer, (results, before) = None, _as_follower(worker, C.UPDATING, C.CLEARED)
    else:
        first = len(worker.results)
        answer, _ = _api(worker, "update_model_weight", API_FAILED_S, fail_fast=False)
        worker.until(lambda: _acts(worker.results[first:]))
        results = worker.results[first:]
    rt.feed.settle(rank)
    check.that(_acts(results) and "updated" not in results,
               f"{at}: the loop's passes did {_acts(results)}; a failed update is never 'updated'")
    check.status_not(session, "NORMAL", at)
    if fault in ("hook", "recapture"):
        check.that(worker.seen, f"{at}: the suite's {fault} was never called: the fault did not happen")
    # Inside the hooks and the recapture the cell holds the API's UPDATING (a follower's may already hold rank 0's
    # CLEARED, written RANK0_AFTER_S after its loop read the request), never NORMAL.
    inside = [s for s in worker.seen if s[1] not in (("UPDATING", "CLEARED") if follower else ("UPDATING",))]
    check.that(not inside, f"{at}: the cell inside the failing update's {fault} calls {worker.seen}: never NORMAL")
    if follower:
        check.equal((before, C.name_of(cell.read())), (["UPDATING"], "CLEARED"),
                    f"{at}: the cell just before rank 0 wrote CLEARED, and after the follower's pass (a follower never "
                    "writes it)")
    else:
        check.that(not (isinstance(answer, tuple) and answer[0] == 200),
                   f"{at}: the API's update answered {answer}: a failed update is never answered success")
        check.equal(C.name_of(cell.read()), "CLEARED",
                    f"{at}: the cell (the API answered {answer}): never NORMAL, and not left UPDATING, where the API "
                    "could neither clear nor update again")
    check.not_loaded(session.observe(), [p.name for p in SPEC.all_params],
                     f"{at}: what the failed update left, released (the cell says CLEARED)")
    worker.broken = False  # (only now: a loop that retries the request must not be judged on a retry that succeeded)

    # Recovery: a fixed version, and the API asks again.
    where = _publish(rt, rank, FIXED)
    at = f"{who}: the update of {where} after the failed one"
    if follower:
        results, before = _as_follower(worker, C.UPDATING, C.NORMAL, act="updated")
        check.equal((_acts(results)[-1:], before), (["updated"], ["UPDATING"]),
                    f"{at}: rank 0's UPDATING: what the loop's passes did ({results}), the cell before rank 0's NORMAL")
    else:
        answer, _ = _api(worker, "clear_load_weight")
        check.that(answer in ((200, "model weight is cleared"), (200, "clear model weight successfully")),
                   f"{at}: the API's clear answered {answer}")
        answer, results = _api(worker, "update_model_weight")
        check.equal(answer, (200, "update model weight successfully"),
                    f"{at}: the API's update (the loop's passes meanwhile: {[_shown(r) for r in results]})")
    rt.feed.settle(rank)
    _loaded(worker, FIXED, at)
    check.status_is(session, "NORMAL", at)
    check.equal(C.name_of(cell.read()), "NORMAL", f"{at}: the cell")


# -- STATUS-KV-CELL: the KV cache's cell at the release of a failed update -----------------------------------
KV_SAMPLE_S = 0.0005  # how often the suite's cache manager stand-in looks at the two cells


class KvWatch:
    """The cache manager's view while the failing update runs, in a thread until :meth:`stop`: the KV cell, the
    status cell, the KV cell again, every ``KV_SAMPLE_S``. ``values``: the KV cell's values in the order seen (repeats
    left out); ``stale``: the samples in which the status cell read CLEARED between two reads of UPDATING in the KV
    cell (rank 0's loop announced the weights released while the KV cell still held the update's value: a loop that
    writes CLEARING to the KV cell before its CLEARED, as before every clear, never shows one)."""

    def __init__(self, cell: C.Cell, kv: C.Cell):
        self.cell, self.kv = cell, kv
        self.values: list[str] = []
        self.stale: list[tuple[str, str, str]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="conformance-kv-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            before, now, after = C.name_of(self.kv.read()), C.name_of(self.cell.read()), C.name_of(self.kv.read())
            for value in (before, after):
                if not self.values or self.values[-1] != value:
                    self.values.append(value)
            if now == "CLEARED" and before == after == "UPDATING" and len(self.stale) < 3:
                self.stale.append((before, now, after))
            time.sleep(KV_SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(ITERATION_S)


def _kv_params():
    out = []
    for fault in ("missing", "hook"):
        for rank in ("rank0", "follower"):
            caps = ["status.cell", "loop.runner", L.ANY_LEVEL, *(["control"] if rank == "rank0" else []),
                    *(["model.hooks"] if fault == "hook" else [])]
            out.append(pytest.param(fault, rank, marks=pytest.mark.requires(*caps), id=f"{fault}-{rank}"))
    return out


@pytest.mark.rule("STATUS-KV-CELL")
@pytest.mark.modes(op=("clear", "update"), call=("first", "second"), outcome="failed")
@pytest.mark.parametrize("fault, rank", _kv_params())
def test_kv_cache_cell_at_the_release_of_a_failed_update(route, loader, fault, rank):
    """STATUS-FAILED-NOT-NORMAL's cycle with the KV cache's cell: the API's clear, an update failing in its source
    (the last parameter missing: the others may have landed) or in a stale-state hook after the commit, the loop's
    release, then the API's clear and update of a fixed version. Where the loop left the weights released (rank 0:
    it wrote CLEARED; a follower: every parameter unloaded), the KV cell reads CLEARING by then and when the failing
    pass ends, and UPDATING after the recovery; where it kept what the failed update left (a loop that only raises:
    STATUS-FAILED-NOT-NORMAL's to judge), the update's UPDATING."""
    follower = rank == "follower"
    rt = route(L.level_of(loader.adapter))
    with C.Cell(C.NORMAL) as cell, C.Cell(C.NORMAL, name=f"{cell.name}-kv") as kv:
        worker = Worker(rt, cell, 1 if follower else 0, fault, kv=kv)
        r = worker.rank
        rt.publish(r, M.state(SPEC, version=OLD), OLD)
        worker.session.update()  # the startup load (writes no status, and nothing to the KV cell)
        rt.feed.settle(r)
        who = f"{rt.path.id}: {'rank 1 of 2 (a follower)' if follower else 'rank 0'}, KV cache's cell {kv.name}"
        check.equal(C.name_of(kv.read()), "NORMAL", f"{who}: the KV cache's cell after the startup load (the loop's only)")
        worker.start()
        watch = None
        try:
            # The API's clear (the healthy clear's KV cell is test_worker_loop.py's), then its update of a version
            # that fails.
            if follower:
                results, _ = _as_follower(worker, C.CLEARING, C.CLEARED, done=_released)
            else:
                _, results = _api(worker, "clear_load_weight")
            check.equal(C.name_of(cell.read()), "CLEARED", f"{who}: the cell after the API's clear (the loop's passes: "
                                                          f"{_acts(results)})")
            where = _publish(rt, r, BAD, fault if fault == "missing" else None)
            worker.broken = True
            at = f"{who}: after the update of {where} failed ({fault})"
            watch = KvWatch(cell, kv)
            if follower:
                results, _ = _as_follower(worker, C.UPDATING, C.CLEARED)
            else:
                first = len(worker.results)
                _api(worker, "update_model_weight", API_FAILED_S, fail_fast=False)
                worker.until(lambda: _acts(worker.results[first:]))
                results = worker.results[first:]
            rt.feed.settle(r)
            watch.stop()
            after = C.name_of(kv.read())
            if follower:
                released = _released(worker)
                claim = "every parameter unloaded" if released else "some parameter still loaded"
            else:
                released = C.name_of(cell.read()) == "CLEARED"
                claim = "rank 0 wrote CLEARED" if released else f"the cell reads {C.name_of(cell.read())}"
            at += f" (the loop's passes: {_acts(results)}; {claim}; the KV cell's values meanwhile: {watch.values})"
            if released:
                check.equal(after, "CLEARING", f"{at}: the KV cache's cell once the failing pass ended (the loop released "
                                               "the weights: the cache manager must free its caches with them)")
                check.that(follower or not watch.stale,
                           f"{at}: the cell read CLEARED (the weights announced released) while the KV cache's cell "
                           f"still read UPDATING ({watch.stale}): the loop writes CLEARING to it before its CLEARED")
            else:
                check.equal(after, "UPDATING", f"{at}: the KV cache's cell (the loop kept what the failed update left: "
                                               "the update's value)")
            worker.broken = False
            if released:  # the API asks again: the next update is announced afresh
                where = _publish(rt, r, FIXED)
                if follower:
                    results, _ = _as_follower(worker, C.UPDATING, C.NORMAL, act="updated")
                else:
                    _api(worker, "clear_load_weight")
                    _, results = _api(worker, "update_model_weight")
                rt.feed.settle(r)
                _loaded(worker, FIXED, f"{who}: the update of {where} after the failed one (the loop's passes: "
                                       f"{_acts(results)})")
                check.equal(C.name_of(kv.read()), "UPDATING",
                            f"{who}: the KV cache's cell after the update of {where} that followed the failed one (the "
                            "loop's UPDATING; NORMAL is the cache manager's)")
            seen = watch.values + [C.name_of(kv.read())]
            foreign = [v for v in seen if v not in ("CLEARING", "UPDATING")]
            check.that(not foreign, f"{who}: the KV cache's cell held {seen} from the failing update on: the loop writes "
                                    "CLEARING and UPDATING only (NORMAL and CLEARED are the cache manager's)")
        finally:
            if watch is not None:
                watch.stop()
            worker.finish()
