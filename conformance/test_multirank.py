"""Multi-rank updates: N inference ranks under ``python -m paddle.distributed.launch`` (gloo on the CPU)
against N simulator trainers, on every path. Spec: SPEC.md § MR (and the multi-rank case of STAGE-ATOMIC).

Tier ``multirank``: skipped in the quick run, run with ``pytest conformance --impl=NAME -m multirank``.
One job (``multirank_plan``: its steps, faults and deadlines) runs once per session; each test judges
one rule on one path from what every rank reported, what every trainer sent, and the status cell's
history (read every 0.2 ms by the orchestrator).

With ``--hosts 2`` the job is 2 hosts x 2 ranks (two network namespaces joined by a veth pair, one
``paddle.distributed.launch --nnodes 2`` on each): every test runs there, ranks 2 and 3 being local ranks 0
and 1 of the second host, and the ``hosts`` tests (SNAP-RANK-OWN-SHARD on every snapshot level) run only there.
"""
import pytest

from conformance import check, harness
from conformance import multirank_plan as P
from sim.ranks import CLEARED, HOLD_S, NORMAL, UPDATING

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]  # the job runs in the first test's setup
NAMES = {NORMAL: "NORMAL", UPDATING: "UPDATING", -1: "CLEARING", -2: "CLEARED"}
FAILURE_STEPS = [(3, "kill", None), (5, "missing", 1), (7, "bad-dtype", 0), (9, "partial", 1), (11, "partial", 0)]
FAILURE_IDS = ["kill", "missing", "bad-dtype", "partial", "partial-rank0"]
SLACK_S = 20.0  # a failure must reach every rank well within this after the UPDATING (loaded machine)


def _paths(*more):
    return [pytest.param(path, marks=pytest.mark.requires(*P.NEEDS, cap, *more), id=path) for path, cap in P.PATH_CAPS.items()]


def _path(rank_job, path):
    p = P.path_result(rank_job, path)
    harness._calls["adapter"] += P.reported(p)  # the ranks drove the implementation for this test
    return p




def _every_rank(rank_job, reports, where):
    """Every rank of the job reported (a loop over no report checks nothing)."""
    check.equal(sorted(int(r) for r in reports), list(range(rank_job["ranks"])), f"{where}: ranks that reported")


def _cell(history):
    return [NAMES.get(v, v) for _, v in history]


def _healthy(rank_job, p):
    """(where, sent by rank, what each rank reported) for the first load and every healthy update."""
    yield "first load of version 1", p["first_sent"], p["first"], 1
    for s in P.reached_steps(rank_job, p) + p["cycles"]:
        if s["fault"] is None:
            yield f"update to version {s['version']}", s["sent"], s["update"], s["version"]


@pytest.mark.rule("MR-OWN-SHARD")
@pytest.mark.parametrize("path", _paths())
def test_every_rank_loads_its_own_shard(rank_job, path):
    p = _path(rank_job, path)
    for where, sent, got, version in _healthy(rank_job, p):
        _every_rank(rank_job, got, f"{path}: {where}")
        for rank, event in got.items():
            rank = int(rank)
            at = f"{path}, rank {rank} (physical GPU {rank_job['visible'][rank]}): {where}"
            check.equal(event["event"], "updated" if version > 1 else "loaded", f"{at}: what the rank reported ({event.get('error')})")
            check.equal(event["digests"], sent[str(rank)] if str(rank) in sent else sent[rank], f"{at}: sha256 of every parameter vs its trainer's")
            if rank_job.get("version_claimed", True):
                check.equal(event["version"], version, f"{at}: version()")
            others = [r for r in sent if int(r) != rank]
            check.that(all(event["digests"] != sent[r] for r in others), f"{at}: the rank holds another rank's shard")


def _cleared_after_every_rank(rank_job, path, s):
    """The clear before ``s``: every rank reported it, the cell ends CLEARED, and when a rank was held inside
    its clear, the cell read CLEARED only after that rank was let go (before that it had not cleared)."""
    where = f"{path}: the clear before version {s['version']}"
    _every_rank(rank_job, s["clear"], f"{where}: the clear")
    check.that(all(e["event"] == "cleared" for e in s["clear"].values()),
               f"{where}: what each rank reported: {[(r, e['event'], e.get('error')) for r, e in s['clear'].items()]}")
    held = {r: sorted(n for n, d in e.get("digests", {}).items() if d is not None) for r, e in s["clear"].items()}
    check.that(not any(held.values()), f"{where}: parameters each rank still holds after it reported its clear "
               f"(a rank that says it cleared must hold none): {held}")
    history = _cell(s["cell_clear"])
    check.that(history[-1:] == ["CLEARED"], f"{where}: the cell after every rank reported: {history}")
    slow = s.get("slow_clear_rank")
    if slow is None:
        return
    event = s["clear"].get(slow, s["clear"].get(str(slow)))
    released = P.held_until(event, s["version"])
    check.that(released is not None, f"{where}: rank {slow} was to be held {HOLD_S:g}s inside its clear, but its "
               "status() never read CLEARING while one of its parameters was released, during the iteration that "
               "cleared")
    t_cleared = min(t for t, v in s["cell_clear"] if v == CLEARED)
    check.that(t_cleared >= released,
               f"{where}: the cell read CLEARED {released - t_cleared:.3f}s before rank {slow} could have cleared "
               f"(held {HOLD_S:g}s inside its clear): CLEARED was published before every rank had cleared")


@pytest.mark.rule("MR-AGREE-BEFORE-NORMAL")
@pytest.mark.parametrize("path", _paths())
def test_normal_only_after_every_rank(rank_job, path):
    p = _path(rank_job, path)
    for s in P.reached_steps(rank_job, p):
        _cleared_after_every_rank(rank_job, path, s)
        history = _cell(s["cell"])
        where = f"{path}: update to version {s['version']}" + (f" with {s['fault']} on rank {s['rank']}" if s["fault"] else "")
        if s["fault"]:
            check.that("NORMAL" not in history, f"{where}: the cell read NORMAL after the UPDATING ({history}) although a rank failed")
            continue
        check.that(history[-1:] == ["NORMAL"], f"{where}: the cell after every rank reported: {history}")
        _every_rank(rank_job, s["update"], where)
        check.that(all(e["status"] == "NORMAL" for e in s["update"].values()),
                   f"{where}: statuses {[e['status'] for e in s['update'].values()]}")
        if s["slow_rank"] is not None:
            # The slow rank's trainer sent its end message at t_end; no rank may publish NORMAL before it.
            t_normal = min(t for t, v in s["cell"] if v == NORMAL)
            ends = [e["t_end"] for e in (s["served"].get(str(s["slow_rank"])) or s["served"].get(s["slow_rank"]) or [])
                    if e["version"] == s["version"]]
            check.that(len(ends) == 1 and t_normal >= ends[0],
                       f"{where}: NORMAL at {t_normal:.4f}, the slow rank {s['slow_rank']}'s trainer sent its end at {ends}: "
                       "NORMAL came before that rank had even received its last bucket")


@pytest.mark.rule("MR-FAILURE-EVERY-RANK")
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("version,fault,rank", FAILURE_STEPS, ids=FAILURE_IDS)
def test_failure_reaches_every_rank(rank_job, path, version, fault, rank):
    p = _path(rank_job, path)
    s = P.step(rank_job, p, version)
    failing = s["rank"]
    where = f"{path}: version {version} with {fault} on rank {failing}"
    _every_rank(rank_job, s["update"], where)
    for r, event in s["update"].items():
        at = f"{where}, rank {r}"
        check.equal(event["event"], "failed", f"{at}: what the rank reported ({event.get('status')}, {event.get('version')})")
        check.that(event["status"] != "NORMAL", f"{at}: status {event['status']} after the failed update")
        if rank_job.get("version_claimed", True):
            check.equal(event["version"], version - 1, f"{at}: version() after the failed update")
        check.that(event["t"] - s["t_update"] < SLACK_S, f"{at}: reported {event['t'] - s['t_update']:.1f}s after the UPDATING")
        if int(r) != failing:
            check.that(f"rank {failing}" in event["error"], f"{at}: the error does not name the failing rank {failing}: {event['error']!r}")
    check.that("NORMAL" not in _cell(s["cell"]), f"{where}: the cell after the UPDATING: {_cell(s['cell'])}")
    nxt = P.step(rank_job, p, version + 1)
    check.that(sorted(int(r) for r in nxt["update"]) == list(range(rank_job["ranks"]))
               and all(e["event"] == "updated" and e["digests"] == nxt["sent"][r] for r, e in nxt["update"].items()),
               f"{where}: the recovery (clear, then version {version + 1}) on every rank: "
               f"{[(r, e['event'], e.get('error')) for r, e in nxt['update'].items()]}")


@pytest.mark.rule("MR-DEADLINE")
@pytest.mark.parametrize("path", [pytest.param("bucket", marks=pytest.mark.requires(*P.NEEDS, "ipc.buckets"), id="bucket")])
def test_no_rank_waits_past_its_deadline(rank_job, path):
    p = _path(rank_job, path)
    s = P.step(rank_job, p, "hang")
    stalled = s["rank"]
    where = f"{path}: rank {stalled}'s trainer never answers (its transfer deadline {P.STALL_TIMEOUT_S:g}s, the agreement's {P.AGREE_TIMEOUT_S:g}s)"
    _every_rank(rank_job, s["update"], where)
    times = {int(r): e["t"] - s["t_update"] for r, e in s["update"].items()}
    for r, event in s["update"].items():
        check.equal(event["event"], "failed", f"{where}: rank {r} reported ({event.get('error')})")
        check.that(event["status"] != "NORMAL", f"{where}: rank {r} status {event['status']}")
    waiting = [r for r in times if r != stalled]
    check.that(all(times[r] < P.STALL_TIMEOUT_S for r in waiting) and times[stalled] >= P.STALL_TIMEOUT_S,
               f"{where}: seconds after the UPDATING at which each rank reported its failure: {times}; the ranks that "
               "waited at the agreement must give up at its deadline, before the stalled rank's own transfer deadline")
    check.that("NORMAL" not in _cell(s["cell"]), f"{where}: the cell after the UPDATING: {_cell(s['cell'])}")
    check.that(sorted(int(r) for r in rank_job["exit"]) == list(range(rank_job["ranks"])) and rank_job["launch_rc"] == 0,
               f"{where}: every rank left the job and the launcher exited 0 (exit events {rank_job['exit']}, rc {rank_job['launch_rc']})")


@pytest.mark.rule("STAGE-ATOMIC")
@pytest.mark.parametrize("path", _paths("staged"))
def test_failure_on_one_rank_changes_no_rank(rank_job, path):
    p = _path(rank_job, path)
    for version, fault, _ in FAILURE_STEPS:
        s = P.step(rank_job, p, version)
        _every_rank(rank_job, s["update"], f"{path}: version {version} with {fault}")
        for r, event in s["update"].items():
            loaded = sorted(n for n, d in event["digests"].items() if d is not None)
            check.that(not loaded, f"{path}: version {version} with {fault} on rank {s['rank']}: rank {r} holds "
                       f"{loaded} after the failed staged update (every parameter was cleared before it)")


@pytest.mark.rule("SNAP-RANK-OWN-SHARD")
@pytest.mark.hosts
@pytest.mark.parametrize("level", [pytest.param(lvl, marks=pytest.mark.requires(*P.NEEDS, cap), id=lvl)
                                   for lvl, cap in P.LEVEL_CAPS.items()])
def test_every_rank_on_every_host_loads_its_own_shard(rank_job, level):
    """2 hosts x 2 ranks, every rank's shard at ``level`` in one directory (the legacy level, keyed by the
    GPU alone: each host's own): ranks 2 and 3 (local ranks 0 and 1, on the same physical GPUs as ranks 0
    and 1) each end with their own shard, never the one of the rank whose number is their local rank."""
    result = (rank_job.get("levels") or {}).get(level)
    if result is None:
        raise AssertionError(f"the multi-rank job has no result for level {level}: "
                             f"{rank_job.get('error') or rank_job.get('skipped') or 'not run'}")
    harness._calls["adapter"] += len(result["got"])  # each rank opened and updated a session
    _every_rank(rank_job, result["got"], f"{level} on {rank_job.get('hosts', 1)} hosts")
    per_host = rank_job["ranks"] // rank_job.get("hosts", 1)
    sent = {int(r): d for r, d in result["sent"].items()}
    for rank, event in sorted(result["got"].items(), key=lambda kv: int(kv[0])):
        rank = int(rank)
        host, local = divmod(rank, per_host)
        at = (f"{level}: rank {rank} (host {host + 1} of {rank_job.get('hosts', 1)}, local rank {local}, physical GPU {rank_job['visible'][rank]}) "
              f"with every rank's shard beside its own")
        check.that(not event.get("error"), f"{at}: update() raised {event.get('error')}")
        check.equal(event["digests"], sent[rank], f"{at}: sha256 of every parameter vs its own shard's")
        if local != rank:
            check.that(event["digests"] != sent[local], f"{at}: it holds rank {local}'s shard (its local rank taken for its global one)")
