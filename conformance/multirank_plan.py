"""What the multi-rank job does, path by path, and how the tests read its result.

Two ranks (``python -m paddle.distributed.launch``, gloo) against two trainers per path. Each path's
steps, after the first load of version 1:

====  ==================================================  ===========================================
ver   what the trainers publish                           what it proves
====  ==================================================  ===========================================
2     healthy (bucket: rank 1's trainer slow); rank 1      own shards; NORMAL only after every rank;
      held 0.3 s inside the clear before it                CLEARED only after every rank cleared
3     a trainer killed (snapshot: mid-write; meta: after   failure mid-transfer
      publishing; bucket: while packing bucket 1)
4     healthy                                              recovery
5     rank 1's shard missing                               failure on the last rank reaches every rank
6     healthy                                              recovery
7     rank 0's last tensor in the wrong dtype             failure on the first rank
8     healthy                                              recovery
9     rank 1's shard lacks its last tensor (well formed)   an incomplete rank that nothing else fails
10    healthy                                              recovery
11    rank 0's shard lacks its last tensor (well formed)   the same on the rank that writes the cell
12    healthy                                              recovery
====  ==================================================  ===========================================

On two hosts (``--hosts 2``: two network namespaces, ``sim.hosts``) the job is 2 hosts x 2 ranks: ranks 2
and 3 on the second host are its local ranks 0 and 1, on the same physical GPUs (4, 2) as ranks 0 and 1;
"rank 1" above is then the last rank, 3, on the second host. Before the paths, every rank also loads its
own shard at each snapshot level from one directory holding every rank's (SNAP-RANK-OWN-SHARD).

then ``CYCLES`` healthy cycles when the cycle tier is selected (resources after the first and the last),
and last, on the bucket path, a trainer that never answers: its rank stays in its transfer past the
agreement's deadline while the other waits at the agreement. A rank's failure must reach every rank,
the cell must never read NORMAL after a failed update, and no rank may hang.
"""
from __future__ import annotations

from sim.ranks import Job, PathPlan, Step, default_params

RANKS = 2  # per host
MODEL_MIB = 4.0  # per rank; a leak of one shard per cycle is then far beyond 2% of a rank's memory
CYCLES = 20
# The deadlines a healthy step must never meet, on a loaded machine too: a rank held in its clear or starved by
# its neighbours (four busy processes on two cores) reaches the agreement seconds late; 4 s of agreement was met
# so by a healthy rank beside a CI run. Only the faults wait them out (the stalled trainer, a FastDeploy peer that
# is told nothing and waits in its barrier).
AGREE_TIMEOUT_S = 10.0
TRANSFER_TIMEOUT_S = 2.0
STALL_TIMEOUT_S = 20.0  # the stalled rank's own transfer deadline: well past the agreement's
PATH_CAPS = {"snapshot": "snapshot.parts", "meta": "ipc.meta", "bucket": "ipc.buckets"}
NEEDS = ("multirank", "status.cell")
LEVEL_CAPS = {"parts": "snapshot.parts", "single": "snapshot.single", "legacy": "snapshot.legacy",
              "shared": "snapshot.shared_fallback"}
# The rank of each role is the last rank (1 on one host, 3 on the second of two): never rank 0, which
# writes the cell, and on two hosts a rank whose local rank (1) is not its global one.
KILL_FIRST = ("bucket",)  # bucket: the last rank has the long (stall) deadline, so rank 0's trainer is killed
LAST_STEP = 12


def last_rank(ranks: int = RANKS) -> int:
    return ranks - 1


def steps(path: str, ranks: int = RANKS) -> list[Step]:
    # The kill comes early: its trainer is replaced by a fresh process, which has published several
    # versions by the time the cycles measure it (its allocator settles after its first two).
    last = last_rank(ranks)
    return [Step(1), Step(2, slow_rank=last if path == "bucket" else None, slow_clear_rank=last),
            Step(3, "kill", 0 if path in KILL_FIRST else last), Step(4), Step(5, "missing", last), Step(6),
            Step(7, "bad-dtype", 0), Step(8), Step(9, "partial", last), Step(10),
            Step(11, "partial", 0), Step(12)]


def plans(paths, cycles: int, hang: bool, staged: bool, ranks: int = RANKS) -> list[PathPlan]:
    return [PathPlan(path, default_params(MODEL_MIB), steps(path, ranks), cycles=cycles,
                     hang_rank=last_rank(ranks) if hang and path == "bucket" else None,
                     options={"staged": True} if staged else {})
            for path in PATH_CAPS if path in paths]


def run(adapter, config, selected) -> dict:
    """Run what the selected tests need (their paths; the cycles and the stalled trainer only when a
    selected test judges them); ``{"skipped": why}`` when no selected test can run."""
    caps = set(adapter.capabilities)
    markexpr = config.getoption("markexpr", "") or ""
    wanted = [i for i in selected if any(m.name in markexpr for m in i.iter_markers() if m.name in ("multirank", "cycles"))]
    hosts = config.getoption("--hosts")
    paths = {i.callspec.params.get("path") for i in wanted if hasattr(i, "callspec")}
    paths = {p for p in paths if p in PATH_CAPS and PATH_CAPS[p] in caps}
    # The snapshot levels every rank loads before the paths: only on two hosts (on one, local and global
    # ranks are one, and the quick run's SNAP-RANK-OWN-SHARD covers it).
    levels = {i.callspec.params.get("level") for i in wanted if hasattr(i, "callspec") and i.get_closest_marker("hosts")}
    levels = [lvl for lvl in LEVEL_CAPS if lvl in levels and LEVEL_CAPS[lvl] in caps] if hosts > 1 else []
    if not (paths or levels) or not set(NEEDS) <= caps:
        return {"skipped": "no selected test needs the job"}
    rules = {m.args[0] for i in wanted for m in i.iter_markers("rule")}
    cycles = CYCLES if any(r.startswith("CYCLE-") for r in rules) else 0
    impl = config.getoption("--impl")
    impl_opts = dict(kv.partition("=")[::2] for kv in config.getoption("--impl-opt"))
    ranks = RANKS * hosts
    job = Job(impl, plans(paths, cycles, "MR-DEADLINE" in rules, "staged" in caps, ranks), ranks=ranks, impl_opts=impl_opts,
              agree_timeout_s=AGREE_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S, stall_timeout_s=STALL_TIMEOUT_S,
              hosts=hosts, levels=levels, snapshot_formats=getattr(adapter, "snapshot_formats", None))
    result = job.run()
    result["version_claimed"] = "version" in caps  # the ranks report version() only where it is claimed
    return result


def path_result(job: dict, path: str) -> dict:
    """The part of the job's result for ``path``; a job that failed before reaching it fails the caller
    with its error."""
    for p in job.get("paths", []):
        if p["path"] == path and "first" in p:
            return p
    raise AssertionError(f"the multi-rank job has no result for path {path}: "
                         f"{job.get('error') or job.get('skipped') or 'not run'}")


def step(job: dict, p: dict, key) -> dict:
    """Step ``key`` (a version, or "hang") of a path; the job's error when it did not get that far."""
    found = p.get("hang") if key == "hang" else next((s for s in p["steps"] if s["version"] == key), None)
    if found is None or "update" not in found:
        raise AssertionError(f"the multi-rank job stopped before {p['path']} step {key}: {job.get('error', 'not run')}")
    return found


def reached_steps(job: dict, p: dict) -> list[dict]:
    """The steps after the first load (versions 2 to ``LAST_STEP``) that the job reached, in order. A job
    that stopped in the aftermath of a faulty step (its ranks left while the next step was awaited) ends
    the list there: what a failure leaves behind is MR-FAILURE-EVERY-RANK's verdict, not that of every
    rule judged on later steps. A job that stopped during a faulty step ends it before that step. A job that
    stopped with no fault before it fails the caller."""
    planned = {s.version: s.fault for s in steps(p["path"])}
    reached = []
    for version in range(2, LAST_STEP + 1):
        found = next((s for s in p["steps"] if s["version"] == version), None)
        if found is None or "update" not in found:
            if any(s["fault"] for s in reached) or planned.get(version):
                return reached  # it stopped during a faulty step or in its aftermath
            raise AssertionError(f"the multi-rank job stopped before {p['path']} step {version}: {job.get('error', 'not run')}")
        reached.append(found)
    return reached


def held_until(event: dict, version: int) -> float | None:
    """When the rank's harness let it go on after holding it inside the clear before ``version``."""
    held = event.get("held_until") or {}
    return held.get(str(version), held.get(version))


def cycles(job: dict, p: dict) -> list:
    if job.get("error") and len(p["cycles"]) < CYCLES:
        raise AssertionError(f"the multi-rank job stopped after {len(p['cycles'])} cycles on {p['path']}: {job['error']}")
    return p["cycles"]


def reported(p: dict) -> int:
    """How many rank events a path's result holds (each is a call of the implementation)."""
    count = len(p["first"]) + len(p.get("ended", {}))
    for s in p["steps"] + p["cycles"] + ([p["hang"]] if "hang" in p else []):
        count += len(s.get("clear", {})) + len(s.get("update", {}))
    return count
