"""The status state machine: the shared status cell and the worker's loop against it. Spec: SPEC.md § STATUS.

The cell is a real shared-memory int32 created by the suite as the engine does (``fixtures.status_cell``);
the worker's loop runs in a forked child (``loop_driver``) while this process plays the API and the
trainer, writing CLEARING and UPDATING at the moments a seeded schedule picks (``loop_schedule``): at
the worker's hooks (its broadcast of the value it read, the model run, the end of an iteration) or a
seeded number of microseconds after its CLEARED. Every failure names its seed and schedule;
``CONFORMANCE_LOOP_SEED=N`` reruns that seed alone.
"""
import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

from conformance import check, modes
from conformance import loop_schedule as L
from conformance.harness import Worker
from conformance.loop_driver import END_RESULTS, LoopChild
from conformance.path_sources import CAPS, Sources
from conformance.paths import ALL_PATHS, route  # noqa: F401 (the fixture)
from conformance.thread_state import looked_again
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))
LOOP = ("status.cell", L.ANY_LEVEL)  # on whichever snapshot level the loader reads (loop_schedule.LEVELS)
VALUES = {"NORMAL": C.NORMAL, "UPDATING": C.UPDATING, "CLEARING": C.CLEARING, "CLEARED": C.CLEARED, "UNKNOWN(7)": 7}


@pytest.fixture
def cell():
    with C.Cell(C.NORMAL) as c:
        yield c


def _loaded(loader, cell, spec=SPEC, **options):
    """A session of (rank 0, GPU 0) on ``cell``, first load of version 1 done."""
    L.publish(loader.model_dir, spec, 1, L.level_of(loader.adapter))
    session = loader.open(spec, options={"status_cell": cell.name, **options})
    session.update()
    return session


def _digests(spec, version):
    return {n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in M.state(spec, version=version).items()}


def _judged(loader, cell, invariant, *, block, count, base):
    """Run ``count`` seeded cycles from seed ``base`` against a loop in mode ``block``; fail on any
    violation of ``invariant``, a cycle that could not complete, or weights that are not the last
    version's. Returns the outcome and where it ran (for further checks)."""
    session = _loaded(loader, cell)
    seed_list = L.seeds(count, base)
    outcome = L.run(session, cell, loader.model_dir, SPEC, block=block, seed_list=seed_list, level=L.level_of(loader.adapter))
    outcome.session = session  # this process's copy (the child's died with it)
    where = f"worker loop (block={block}), seeds {seed_list[0]}..{seed_list[-1]}"
    found = outcome.violations.get(invariant, [])
    check.that(not found, f"{where}: {len(found)} violation(s):\n  " + "\n  ".join(found[:5]))
    stuck = outcome.violations.get(L.PROGRESS, [])
    check.that(not stuck and outcome.cycles == len(seed_list),
               f"{where}: {outcome.cycles}/{len(seed_list)} cycles completed; " + "; ".join(stuck[:3]))
    report = outcome.report or {}
    check.that("error" not in report, f"{where}: the worker loop failed: {report.get('error')}")
    last = outcome.versions[-1] if outcome.versions else 1
    check.equal(report.get("digests"), _digests(SPEC, last), f"{where}: sha256 of every parameter after the last cycle (version {last})")
    return outcome, where


def _modes(non_blocking: int, blocking: int):
    """(block, number of seeds) for both loop modes."""
    return pytest.mark.parametrize("block,count", [
        pytest.param(False, non_blocking, marks=pytest.mark.requires(*LOOP), id="non-blocking"),
        pytest.param(True, blocking, marks=pytest.mark.requires(*LOOP), id="blocking")])


@pytest.mark.rule("STATUS-REQUEST-KEPT")
@pytest.mark.modes(op=("clear", "update"), call=("first", "second"))  # (every seed runs several cycles)
@_modes(24, 6)
def test_request_never_overwritten(loader, cell, block, count):
    _judged(loader, cell, L.KEPT, block=block, count=count, base=500 if block else 100)


@pytest.mark.rule("STATUS-NO-RUN-AFTER-CHANGE")
@pytest.mark.modes(op=("clear", "update"), call=("first", "second"))
@_modes(6, 2)
def test_model_never_runs_in_the_changing_iteration(loader, cell, block, count):
    outcome, where = _judged(loader, cell, L.NO_RUN, block=block, count=count, base=600 if block else 200)
    runs = sum(1 for kind, _, _ in outcome.events if kind == "run")
    check.that(runs > 0, f"{where}: the loop never ran the model at NORMAL: the rule was not exercised")


@pytest.mark.rule("STATUS-NONBLOCK-RETURNS")
@pytest.mark.requires(*LOOP)
@pytest.mark.modes(call=("first", "second"))
def test_nonblocking_loop_returns_at_cleared(loader, cell):
    _judged(loader, cell, L.NONBLOCK, block=False, count=5, base=300)


@pytest.mark.rule("STATUS-BLOCK-WAITS")
@pytest.mark.requires(*LOOP)
@pytest.mark.modes(call=("first", "second"))
def test_blocking_loop_stays_until_updated(loader, cell):
    outcome, where = _judged(loader, cell, L.BLOCK, block=True, count=3, base=700)
    # The seeds write UPDATING at most 12 ms after CLEARED: a loop that polls every 10 ms and returns at CLEARED
    # may still see it. One more cycle, in this process after the child (no fork follows), waits longer.
    session = outcome.session
    version = (outcome.versions[-1] if outcome.versions else 1) + 1
    L.publish(loader.model_dir, SPEC, version, L.level_of(loader.adapter))
    cell.write(C.CLEARING)

    box = {}

    def later():
        # BLOCK_RELEASE_S after the worker has looked at its CLEARED again (thread_state): sooner, a loop that
        # spins until it reads CLEARED could miss it, as the scheduler decides.
        deadline = time.monotonic() + L.EVENT_TIMEOUT_S
        while (cell.read() != C.CLEARED or "tid" not in box) and time.monotonic() < deadline:
            time.sleep(0.002)
        if "tid" in box:
            looked_again(os.getpid(), box["tid"], timeout_s=L.EVENT_TIMEOUT_S)
        time.sleep(L.BLOCK_RELEASE_S)
        cell.write(C.UPDATING)

    release = threading.Thread(target=later, daemon=True)
    release.start()
    box, _, runs = _bounded_iteration(session, cell=cell, block=True, box=box)
    release.join(2 * L.EVENT_TIMEOUT_S + 1)
    where = f"blocking worker loop, UPDATING {L.BLOCK_RELEASE_S:g}s after it read CLEARED"
    check.equal(box.get("result", box.get("error", box.get("stuck"))), "updated", f"{where}: what the iteration that synced CLEARING returned")
    check.that(runs == 0, f"{where}: {runs} model run(s) in the iteration")
    check.params_equal(session.observe(), M.state(SPEC, version=version), f"{where}: after the update")


# -- who writes the cell, and when --------------------------------------------------------------------
def _cycle(loader, sources, session, spec, version):
    session.clear()
    sources.publish(spec, version)
    session.update()
    sources.settle()


@pytest.mark.rule("STATUS-FIRST-LOAD-SILENT")
@pytest.mark.parametrize(
    "kind,initial",
    [pytest.param("snapshot", name, marks=pytest.mark.requires("status.cell", *CAPS["snapshot"]), id=f"snapshot:{name}")
     for name in VALUES]
    + [pytest.param(kind, "UPDATING", marks=pytest.mark.requires("status.cell", *CAPS[kind]), id=f"{kind}:UPDATING")
       for kind in ("ipc", "bucket")],
)
def test_first_load_writes_no_status(loader, kind, initial):
    sources = Sources(loader, kind)
    with C.Cell(VALUES[initial]) as cell:
        try:
            sources.publish(SPEC, 1)
            session = sources.open(SPEC, status_cell=cell.name)
            session.update()
            sources.settle()
            where = f"{kind}: the first load of {sources.where}"
            check.params_equal(session.observe(), M.state(SPEC, version=1), where)
            check.equal(C.name_of(cell.read()), initial, f"{where}: the cell the engine set to {initial} afterwards")
            _cycle(loader, sources, session, SPEC, 2)
            check.equal(C.name_of(cell.read()), "NORMAL", f"{kind}: the cell after clear() and a second update")
        finally:
            sources.close()


@pytest.mark.rule("STATUS-FIRST-LOAD-SILENT")
@pytest.mark.parametrize(
    "kind,retry",
    [pytest.param(kind, retry, marks=pytest.mark.requires("status.cell", *CAPS[kind]), id=f"{kind}:{retry}")
     for kind in ("snapshot", "ipc", "bucket") for retry in ("clear", "retry-then-clear")],
)
def test_failed_first_load_ends_at_the_clear(loader, kind, retry):
    """A first load that fails leaves the startup load unfinished: an update without a clear() is still the first
    load (refused, or loaded writing no status); once a clear() has run, the next committed update writes NORMAL."""
    sources = Sources(loader, kind)
    with C.Cell(7) as cell:  # a value no worker writes: any write shows
        try:
            sources.publish(SPEC, 1, fault="missing")
            session = sources.open(SPEC, status_cell=cell.name)
            where = f"{kind}: a first load of {sources.where} lacking a parameter"
            exc_type, match, names = sources.failure(SPEC, "missing")
            with check.raises(exc_type, match=match, names=names, where=where):
                session.update()
            sources.settle()
            check.that(cell.read() != C.NORMAL and session.status() != "NORMAL",
                       f"{where}: the cell reads {C.name_of(cell.read())}, status() {session.status()}: neither may be NORMAL")
            if retry == "retry-then-clear":
                before = cell.read()
                sources.publish(SPEC, 1)
                try:
                    session.update()
                except Exception:  # noqa: BLE001 (outside the contract without a clear(): LIFE-FAILED-RETRY)
                    check.that(session.status() != "NORMAL", f"{where}, retried without clear(): refused, yet status() NORMAL")
                else:
                    check.params_equal(session.observe(), M.state(SPEC, version=1), f"{where}, retried without clear()")
                    check.equal(C.name_of(cell.read()), C.name_of(before),
                                f"{where}: the cell after the retried first load (still the first load: no write)")
                sources.settle()
            session.clear()
            check.equal(C.name_of(cell.read()), "CLEARED", f"{where}: the cell after clear()")
            sources.publish(SPEC, 2)
            session.update()
            sources.settle()
            check.params_equal(session.observe(), M.state(SPEC, version=2), f"{where}: clear() and an update of version 2")
            check.equal(C.name_of(cell.read()), "NORMAL",
                        f"{where}: the cell after clear() and a committed update (the startup load ended at the clear)")
        finally:
            sources.close()


@pytest.mark.rule("STATUS-FIRST-LOAD-SILENT")
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.requires("status.cell", *ALL_PATHS[p].capabilities), id=f"{p}:retry-in-place")
     for p in ("rsync", "gdr")],
)
def test_failed_streamed_first_load_retried_in_place_writes_no_status(route, loader, path):
    """rsync and GDR update in place: a failed first load is retried without a clear(), and the retry is still the
    startup load (no write into the cell the engine set before the worker started); its commit ends it, and the next
    update in place writes NORMAL. A loader that refuses the retry ends the startup load at the clear() it needs."""
    rt = route(path)
    with C.Cell(7) as cell:  # a value no worker writes: any write shows
        session = rt.open(SPEC, options={"status_cell": cell.name})
        first = M.state(SPEC, version=1)
        where = f"{path}: a first load of {rt.publish(0, first, 1, ('fail', len(first)))}"  # broken after its last item
        with check.raises(ConnectionError, match=r"\S", where=where):
            rt.update(0)
        check.that(cell.read() != C.NORMAL and session.status() != "NORMAL",
                   f"{where}: the cell reads {C.name_of(cell.read())}, status() {session.status()}: neither may be NORMAL")
        before = cell.read()
        where = f"{where}, retried in place ({rt.publish(0, first, 1)})"
        try:
            rt.update(0)
        except Exception:  # noqa: BLE001 (a loader may refuse a retry it cannot trust: LIFE-FAILED-RETRY)
            check.that(session.status() != "NORMAL", f"{where}: refused, yet status() NORMAL")
            session.clear()
            check.equal(C.name_of(cell.read()), "CLEARED", f"{where}: refused; the cell after clear()")
            then = "clear() and an update"
        else:
            check.params_equal(session.observe(), first, where)
            check.equal(C.name_of(cell.read()), C.name_of(before),
                        f"{where}: the cell after the retried first load (still the startup load: no write)")
            then = "an update in place"
        rt.publish(0, M.state(SPEC, version=2), 2)
        rt.update(0)
        check.params_equal(session.observe(), M.state(SPEC, version=2), f"{where}: {then} to version 2")
        check.equal(C.name_of(cell.read()), "NORMAL", f"{where}: the cell after {then} to version 2 (the startup load is over)")


WRITERS = [  # (rank, world, tp_size option, writes)
    (0, 1, None, True), (1, 2, None, False), (3, 4, None, False), (2, 4, 2, True), (3, 4, 2, False), (1, 4, 1, True)]


@pytest.mark.rule("STATUS-RANK0-WRITES")
@pytest.mark.parametrize(
    "rank,world,tp_size,writes",
    [pytest.param(*w, marks=[pytest.mark.requires("status.cell", L.ANY_LEVEL),
                             pytest.mark.modes(op=("clear", "update"), rank="rank0" if w[3] else "follower")],
                  id=f"rank{w[0]}of{w[1]}:tp{w[2] or 'world'}") for w in WRITERS],
)
def test_only_tensor_parallel_rank0_writes(loader, monkeypatch, rank, world, tp_size, writes):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(world))
    gpu = 5 + rank  # physical id != ordinal != rank
    level = L.level_of(loader.adapter)
    who = f"rank {rank} of {world} (tp_size {tp_size or world}: tensor-parallel rank {rank % (tp_size or world)})"
    with C.Cell(7) as cell:  # a value no worker writes: any write shows
        options = {"status_cell": cell.name, **({"tp_size": tp_size} if tp_size else {})}
        L.publish(loader.model_dir, SPEC, 1, level, rank, gpu)
        visible = ",".join(str(5 + r) for r in range(world))
        session = loader.open(SPEC, worker=Worker(rank, visible, str(rank)), options=options)
        session.update()
        check.params_equal(session.observe(), M.state(SPEC, version=1), f"{who}: first load of its {level} snapshot")
        check.equal(cell.read(), 7, f"{who}: the cell after the first load")
        for step, want in (("clear()", C.CLEARED), ("update()", C.NORMAL), ("clear()", C.CLEARED)):
            (session.update if step == "update()" else session.clear)()
            expected = want if writes else 7
            check.equal(C.name_of(cell.read()), C.name_of(expected), f"{who}: the cell after {step}")


# -- the API side: what a request does in each state ------------------------------------------------
def _runs(loop, count, timeout_s=3.0):
    """Wait for ``count`` more model runs of a free-running loop; returns the results seen meanwhile."""
    seen, runs, deadline = [], 0, time.monotonic() + timeout_s
    while runs < count and time.monotonic() < deadline:
        event = loop.next_event(0.05)
        if event is not None:
            seen.append(event)
            runs += event[0] == "run"
    return seen


@pytest.mark.rule("STATUS-UPDATE-WHILE-NORMAL")
@pytest.mark.requires("status.cell", "control", L.ANY_LEVEL)
@pytest.mark.modes(call=("first", "second"))  # (an update requested while NORMAL, twice in one session)
def test_update_while_normal_reloads_nothing(loader, impl, cell):
    session = _loaded(loader, cell)
    control = impl.control(cell.name)
    level = L.level_of(loader.adapter)
    L.publish(loader.model_dir, SPEC, 2, level)  # the trainer has a new version on disk
    with LoopChild(session, block=False) as loop:
        check.that(loop.next_event(L.EVENT_TIMEOUT_S) is not None, "the worker loop never started")
        loop.free()
        answer = control.update_model_weight(2.0)
        check.equal(answer, (200, "model weight is updated"), "update_model_weight() while NORMAL")
        seen = _runs(loop, 5)
        changed = [e for e in seen if e[0] == "end" and e[1] != END_RESULTS.index("ran")]
        check.that(not changed and C.name_of(cell.read()) == "NORMAL",
                   f"after update_model_weight() while NORMAL: the cell reads {C.name_of(cell.read())} and the loop did "
                   f"{[END_RESULTS[e[1]] for e in changed]} (expected only model runs, cell NORMAL)")
        check.equal(control.clear_load_weight(5.0), (200, "clear model weight successfully"), "clear_load_weight() while NORMAL")
        check.equal(control.clear_load_weight(5.0), (200, "model weight is cleared"), "clear_load_weight() while CLEARED")
        check.equal(control.update_model_weight(5.0), (200, "update model weight successfully"), "update_model_weight() while CLEARED")
        L.publish(loader.model_dir, SPEC, 3, level)
        check.equal(control.update_model_weight(2.0), (200, "model weight is updated"), "update_model_weight() while NORMAL again")
        _runs(loop, 3)
        report = loop.stop()
    check.equal(report.get("digests"), _digests(SPEC, 2),
                "after update while NORMAL with version 3 on disk: every parameter still version 2 (sha256)")


GUARDS = [  # cell value, request, answer; the worker is absent: nothing else writes the cell
    ("UPDATING", "clear_load_weight", (403, "worker is updating model weight, cannot clear now")),
    ("UPDATING", "update_model_weight", (400, "worker is updating model weight already")),
    ("CLEARING", "clear_load_weight", (400, "worker is clearing model weight already")),
    ("CLEARING", "update_model_weight", (403, "worker is clearing model weight, cannot update now")),
    ("NORMAL", "clear_load_weight", (404, "clear model weight timeout")),
    ("CLEARED", "update_model_weight", (404, "update model weight timeout")),
    ("UNKNOWN(7)", "clear_load_weight", (500, "model weight status is 7, not a ModelWeightsStatus value")),
    ("UNKNOWN(7)", "update_model_weight", (500, "model weight status is 7, not a ModelWeightsStatus value")),
]


@pytest.mark.rule("STATUS-UPDATE-WHILE-NORMAL")
@pytest.mark.parametrize("state,request_name,answer",
                         [pytest.param(*g, marks=pytest.mark.requires("control", "snapshot.single"), id=f"{g[0]}:{g[1]}")
                          for g in GUARDS])
def test_request_guards(loader, impl, state, request_name, answer):
    session = loader.open(SPEC)  # a worker that never serves the cell
    L.publish(loader.model_dir, SPEC, 1)
    with C.Cell(VALUES[state]) as cell:
        got = getattr(impl.control(cell.name), request_name)(0.05)
        check.equal(got, answer, f"{request_name}() with the cell at {state} and no worker serving it")
        requested = {"clear_load_weight": "CLEARING", "update_model_weight": "UPDATING"}[request_name]
        want = requested if answer[0] == 404 else state  # a request is written only from NORMAL/CLEARED
        check.equal(C.name_of(cell.read()), want, f"the cell after {request_name}() at {state}")
    check.status_is(session, "CLEARED", f"the worker after {request_name}() at {state}: nothing loaded")


# -- the lifecycle's options ----------------------------------------------------------------------------
BAD_OPTIONS = [
    ("staged", "yes", "staged"), ("staged", 1, "staged"),
    ("agree_timeout_s", 0, "agree_timeout_s"), ("agree_timeout_s", -1.0, "agree_timeout_s"),
    ("agree_timeout_s", float("nan"), "agree_timeout_s"), ("agree_timeout_s", True, "agree_timeout_s"),
    ("agree_timeout_s", "5", "agree_timeout_s"),
    ("tp_size", 0, "tp_size"), ("tp_size", -2, "tp_size"), ("tp_size", True, "tp_size"), ("tp_size", 2.0, "tp_size"),
    ("status_cell", 7, "status_cell"), ("status_cell", "dir/cell", "dir/cell"), ("status_cell", ".", "'.'"),
    ("status_cell", "..", ".."),
    ("status_cell", "model_weights_status.nowhere", "model_weights_status.nowhere"),
    ("kv_cache_cell", 7, "kv_cache_cell"), ("kv_cache_cell", "kv_cache_status.nowhere", "kv_cache_status.nowhere"),
]


def _option_case(key, value, named):
    needs = {"staged": "staged", "agree_timeout_s": "multirank", "tp_size": "status.cell", "status_cell": "status.cell",
             "kv_cache_cell": "loop.runner"}[key]
    return pytest.param(key, value, named, marks=pytest.mark.requires(needs, L.ANY_LEVEL), id=f"{key}={value!r}")


#: The ranks each option is checked on (the rule's Modes: line): rank 0, which writes the cell, and a follower, which
#: never writes it and must refuse a bad cell at open all the same, not at its first update or loop pass.
RANKS = modes.params("STATUS-OPTIONS")


class _Rank:
    """The worker a STATUS-OPTIONS case opens as: rank 0 of 1 on GPU 0, or rank 1 of 2 on physical GPU 6 (its
    tensor-parallel rank 1, unless ``tp_size`` says otherwise: a follower, which never writes the cell)."""

    def __init__(self, loader, monkeypatch, mode):
        self.loader, self.level = loader, L.level_of(loader.adapter)
        self.follower = mode["rank"] == "follower"
        if self.follower:
            monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
        self.rank, self.gpu = (1, 6) if self.follower else (0, 0)
        self.worker = Worker(1, "5,6", "1") if self.follower else Worker()
        self.who = "a follower (rank 1 of 2, tensor-parallel rank 1)" if self.follower else "rank 0 of 1"

    def publish(self, version=1):
        L.publish(self.loader.model_dir, SPEC, version, self.level, self.rank, self.gpu)

    def open(self, options):
        return self.loader.open(SPEC, worker=self.worker, options=options)


@pytest.mark.rule("STATUS-OPTIONS")
@pytest.mark.parametrize("key,value,named", [_option_case(*c) for c in BAD_OPTIONS])
@pytest.mark.parametrize("mode", RANKS)
def test_bad_lifecycle_option_is_refused_at_open(loader, monkeypatch, mode, key, value, named):
    who = _Rank(loader, monkeypatch, mode)
    who.publish()
    with check.raises(ValueError, match=r"\S", names=[named], where=f"open() as {who.who} with options[{key!r}] = {value!r}"):
        who.open({key: value})


@pytest.mark.rule("STATUS-OPTIONS")
@pytest.mark.requires("status.cell", L.ANY_LEVEL)
@pytest.mark.parametrize("mode", RANKS)
def test_loop_without_a_cell_is_refused(loader, monkeypatch, mode):
    who = _Rank(loader, monkeypatch, mode)
    who.publish()
    session = who.open({})
    session.update()
    ran = []
    with check.raises(Exception, match=r"status_cell",
                      where=f"worker_iteration() of {who.who}'s session opened without options['status_cell']"):
        session.worker_iteration(lambda: ran.append(1), block=False, sync=lambda value: value)
    check.that(not ran, f"{who.who}: the loop without a cell ran the model {len(ran)} time(s)")


@pytest.mark.rule("STATUS-OPTIONS")
@pytest.mark.requires("status.cell", "staged", "multirank", L.ANY_LEVEL)
@pytest.mark.parametrize("mode", RANKS)
def test_short_cell_and_boundary_options(loader, monkeypatch, mode):
    who = _Rank(loader, monkeypatch, mode)
    who.publish()
    short = C.Cell(C.NORMAL)
    try:
        with open(short.path, "r+b") as f:
            f.truncate(2)
        with check.raises(ValueError, match=r"2 bytes", names=[short.name],
                          where=f"open() as {who.who} with options['status_cell'] = {short.name!r}, a 2-byte cell"):
            who.open({"status_cell": short.name})
    finally:
        short.unlink()
    # tp_size 1 would make rank 1 of 2 the rank 0 of its own group (a writer): a follower keeps tp_size 2.
    tp_size = 2 if who.follower else 1
    with C.Cell(C.NORMAL) as cell:
        session = who.open({"status_cell": cell.name, "staged": False, "agree_timeout_s": 0.001, "tp_size": tp_size})
        session.update()
        check.params_equal(session.observe(), M.state(SPEC, version=1),
                           f"{who.who}: the smallest valid options (tp_size {tp_size}, a 1 ms deadline, staged False)")


CELL_PATHS = ["traversal", "subdir"]  # how a name with a '/' reaches a real cell


@contextlib.contextmanager
def _cell_reached_through_a_path(shape):
    """(a real 4-byte cell, a name with a ``/`` whose path under /dev/shm is that cell): ``../shm/{cell}``, or
    ``{dir}/{cell}`` for a directory made under /dev/shm. Either way the file exists and is a valid cell, so only
    the name's form is wrong: a loader that checks existence and size alone accepts it."""
    if shape == "traversal":
        with C.Cell(C.NORMAL) as cell:
            yield cell, f"../{os.path.basename(C.SHM_DIR)}/{cell.name}"
        return
    folder = tempfile.mkdtemp(prefix="model_weights_status.wscfdir", dir=C.SHM_DIR)
    try:
        name = os.path.basename(folder) + "/model_weights_status.inside"
        with C.Cell(C.NORMAL, name=name) as cell:
            yield cell, name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.rule("STATUS-OPTIONS")
@pytest.mark.parametrize("key", [pytest.param("status_cell", marks=pytest.mark.requires("status.cell", L.ANY_LEVEL)),
                                 pytest.param("kv_cache_cell", marks=pytest.mark.requires("loop.runner", L.ANY_LEVEL))])
@pytest.mark.parametrize("shape", CELL_PATHS)
@pytest.mark.parametrize("mode", RANKS)
def test_cell_name_with_a_path_is_refused_even_where_it_reaches_a_cell(loader, monkeypatch, mode, key, shape):
    """A name with a ``/`` whose path under /dev/shm is a valid cell (``../shm/{cell}``; ``{dir}/{cell}``) is
    refused at open, naming it: a shared-memory name is one component, and a ``/`` reaches outside the engine's
    cells. The same cell by its plain name opens (the other side: only the name's form is refused)."""
    who = _Rank(loader, monkeypatch, mode)
    who.publish()
    with _cell_reached_through_a_path(shape) as (cell, name):
        check.that(C.Cell.existing(name).read() == C.NORMAL, f"{name!r}: the fixture's cell is not reachable")
        with check.raises(ValueError, match=r"\S", names=[name], where=f"open() as {who.who} with options[{key!r}] = {name!r}"):
            who.open({key: name})
    with C.Cell(C.NORMAL) as plain:
        session = who.open({key: plain.name})
        session.update()
        check.params_equal(session.observe(), M.state(SPEC, version=1),
                           f"open() as {who.who} with options[{key!r}] = {plain.name!r}")


# -- ranks that do not write the cell -----------------------------------------------------------------
RANK0_DELAY_S = 0.08


def _bounded_iteration(session, timeout_s=10.0, cell=None, sync=lambda value: value, block=False, box=None):
    """One iteration (non-blocking unless ``block``) in a thread: (what it returned or raised (with ``"end"``, the monotonic
    time it did), seconds, model runs). An iteration still inside after ``timeout_s`` (a loop that does not
    return at CLEARED) is released with NORMAL in ``cell``, so that it stops polling; the test judges what
    it had returned by then (nothing). ``box`` (given: filled in place) has the thread's ``"tid"`` from its start."""
    box, ran = ({} if box is None else box), []

    def iterate():
        box["tid"] = threading.get_native_id()
        try:
            box["result"] = session.worker_iteration(lambda: ran.append(1), block=block, sync=sync)
        except BaseException as e:  # noqa: BLE001 (judged by the test)
            box["error"] = e
        box["end"] = time.monotonic()

    start = time.monotonic()
    thread = threading.Thread(target=iterate, daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.monotonic() - start
    if thread.is_alive() and cell is not None:
        value = cell.read()
        cell.write(C.NORMAL)
        thread.join(2.0)
        box.setdefault("stuck", f"still inside after {timeout_s:g}s with the cell at {C.name_of(value)} (released with NORMAL)")
        box.pop("result", None)
        box.pop("end", None)
    return box, seconds, len(ran)


def _rank0_writes(cell, value, box, delay_s=0.0) -> threading.Thread:
    """Rank 0's write of ``value``, once this rank's iteration (``box``, filled by ``_bounded_iteration``) has
    started and been seen waiting (looked at the cell again: thread_state), then ``delay_s`` on; never a timer
    from the test's start, which a loaded machine fires before the iteration has read the request at all.
    ``"at"`` in the returned thread's ``wrote``: when it wrote. Join it before writing the cell again."""
    wrote: dict = {}

    def write():
        deadline = time.monotonic() + L.EVENT_TIMEOUT_S
        while "tid" not in box and time.monotonic() < deadline:
            time.sleep(0.001)
        if "tid" in box:
            looked_again(os.getpid(), box["tid"], timeout_s=L.EVENT_TIMEOUT_S)
        time.sleep(delay_s)
        wrote["at"] = time.monotonic()
        cell.write(value)

    thread = threading.Thread(target=write, name="conformance-rank0-write", daemon=True)
    thread.wrote = wrote
    thread.start()
    return thread


class _Trainer:
    """The trainer of rank 1 on physical GPU 6, at the snapshot level the loader reads."""

    def __init__(self, loader):
        self.loader, self.level = loader, L.level_of(loader.adapter)

    def publish(self, spec, version):
        L.publish(self.loader.model_dir, spec, version, self.level, 1, 6)


def _follower(loader, monkeypatch, cell, **options):
    """Rank 1 of 2 (tensor-parallel rank 1: it never writes the cell) on ``cell``, version 1 loaded."""
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    sources = _Trainer(loader)
    sources.publish(SPEC, 1)
    session = loader.open(SPEC, worker=Worker(1, "5,6", "1"), options={"status_cell": cell.name, **options})
    session.update()
    return sources, session


@pytest.mark.rule("STATUS-FOLLOWERS-WAIT")
@pytest.mark.requires("status.cell", L.ANY_LEVEL)
@pytest.mark.modes(op=("clear", "update"))
def test_follower_waits_for_rank0_write(loader, monkeypatch, cell):
    sources, session = _follower(loader, monkeypatch, cell, agree_timeout_s=5.0)
    for request, written, want, version in ((C.CLEARING, C.CLEARED, "cleared", None), (C.UPDATING, C.NORMAL, "updated", 2)):
        if version:
            sources.publish(SPEC, version)
        cell.write(request)
        box: dict = {}
        rank0 = _rank0_writes(cell, written, box, RANK0_DELAY_S)  # rank 0, done a little later
        box, seconds, runs = _bounded_iteration(session, cell=cell, box=box)
        rank0.join(L.EVENT_TIMEOUT_S + 1.0)
        wrote = rank0.wrote
        where = f"rank 1 of 2, {C.name_of(request)} in the cell, rank 0 writing {C.name_of(written)} after {RANK0_DELAY_S}s"
        check.equal(box.get("result", box.get("error", box.get("stuck"))), want, f"{where}: what the iteration returned")
        early = "before rank 0 wrote at all" if "at" not in wrote or "end" not in box else \
            f"{wrote['at'] - box['end']:.3f}s before rank 0's write" if box["end"] < wrote["at"] else None
        check.that(early is None and runs == 0,
                   f"{where}: the iteration returned {early}, with {runs} model run(s); it must "
                   "wait for that write (else its next iteration reads the request again and repeats it) and run nothing")
    check.params_equal(session.observe(), M.state(SPEC, version=2), "rank 1 after the cycle it followed")


FOLLOWER_DEADLINE_S = 0.15  # a follower's agree_timeout_s where rank 0 never writes: waited out once per case


@pytest.mark.rule("STATUS-FOLLOWERS-WAIT")
@pytest.mark.requires("status.cell", "multirank", L.ANY_LEVEL)
@pytest.mark.parametrize("request_value", [pytest.param(C.CLEARING, marks=pytest.mark.modes(op="clear"), id="CLEARING"),
                                           pytest.param(C.UPDATING, marks=pytest.mark.modes(op="update"), id="UPDATING")])
def test_follower_gives_up_at_its_deadline(loader, monkeypatch, cell, request_value):
    sources, session = _follower(loader, monkeypatch, cell, agree_timeout_s=FOLLOWER_DEADLINE_S)
    if request_value == C.UPDATING:  # rank 0 wrote CLEARED; the follower cleared; now it updates alone
        cell.write(C.CLEARING)
        box: dict = {}
        rank0 = _rank0_writes(cell, C.CLEARED, box)
        _bounded_iteration(session, cell=cell, box=box)
        rank0.join(L.EVENT_TIMEOUT_S + 1.0)  # (its CLEARED never lands on the request below)
        sources.publish(SPEC, 2)
    cell.write(request_value)  # rank 0 never answers
    box, seconds, runs = _bounded_iteration(session, cell=cell)
    where = f"rank 1 of 2 after its own {'clear' if request_value == C.CLEARING else 'update'}, rank 0 never writing (agree_timeout_s {FOLLOWER_DEADLINE_S})"
    error = box.get("error")
    check.that(isinstance(error, TimeoutError) and cell.name in str(error) and "rank 1" in str(error),
               f"{where}: expected a TimeoutError naming the cell {cell.name} and rank 1, got {box}")
    check.that(FOLLOWER_DEADLINE_S <= seconds < 5.0 and runs == 0, f"{where}: gave up after {seconds:.2f}s with {runs} model run(s)")
    check.equal(C.name_of(cell.read()), C.name_of(request_value), f"{where}: the cell (a follower never writes)")


@pytest.mark.rule("STATUS-FOLLOWERS-WAIT")
@pytest.mark.requires("status.cell", "status", L.ANY_LEVEL)
def test_follower_acts_on_rank0s_value(loader, monkeypatch, cell):
    """The loop acts on what ``sync`` returned (rank 0's read, broadcast), not on its own read: rank 0 read
    CLEARING, cleared and already wrote CLEARED by the time this rank's loop looks at the cell again. A rank
    that went by the cell would see CLEARED, do nothing, and keep the old weights through the update."""
    sources, session = _follower(loader, monkeypatch, cell, agree_timeout_s=5.0)
    cell.write(C.CLEARED)  # rank 0's write after its own clear; this rank's broadcast says CLEARING
    box, _, runs = _bounded_iteration(session, timeout_s=3.0, cell=cell, sync=lambda value: C.CLEARING)
    where = f"rank 1 of 2, {cell.name} reading CLEARED, rank 0's broadcast CLEARING"
    check.equal(box.get("result", box.get("error", box.get("stuck"))), "cleared", f"{where}: what the iteration returned")
    check.that(not runs, f"{where}: the model ran {runs} time(s) in the iteration that cleared")
    check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], where)
    check.status_is(session, "CLEARED", where)
    check.equal(C.name_of(cell.read()), "CLEARED", f"{where}: the cell (a follower never writes)")
