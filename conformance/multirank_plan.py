"""What the multi-rank job does, path by path, and how the tests read its result.

Two ranks (``python -m paddle.distributed.launch``, gloo) against two trainers per path. Each path's
steps, after the first load of version 1:

====  ==================================================  ===========================================
ver   what the trainers publish                           what it proves
====  ==================================================  ===========================================
2     healthy (bucket: rank 1's trainer slow)              own shards; NORMAL only after every rank
3     rank 1's shard missing                               failure on the last rank reaches every rank
4     healthy                                              recovery
5     rank 0's last tensor in the wrong dtype             failure on the first rank
6     healthy                                              recovery
7     a trainer killed (snapshot: mid-write; meta: after   failure mid-transfer
      publishing; bucket: while packing bucket 1)
8     healthy                                              recovery
====  ==================================================  ===========================================

then ``CYCLES`` healthy cycles when the cycle tier is selected (resources after the first and the last),
and last, on the bucket path, a trainer that never answers: its rank stays in its transfer past the
agreement's deadline while the other waits at the agreement. A rank's failure must reach every rank,
the cell must never read NORMAL after a failed update, and no rank may hang.
"""
from __future__ import annotations

from sim.ranks import Job, PathPlan, Step, default_params

RANKS = 2
MODEL_MIB = 4.0  # per rank; a leak of one shard per cycle is then far beyond 2% of a rank's memory
CYCLES = 20
AGREE_TIMEOUT_S = 3.0
TRANSFER_TIMEOUT_S = 0.5
STALL_TIMEOUT_S = 8.0  # the stalled rank's own transfer deadline: well past the agreement's
PATH_CAPS = {"snapshot": "snapshot.parts", "meta": "ipc.meta", "bucket": "ipc.buckets"}
NEEDS = ("multirank", "status.cell")
KILL_RANK = {"snapshot": 1, "meta": 1, "bucket": 0}  # bucket: rank 1 has the long (stall) deadline
HANG_RANK = 1


def steps(path: str) -> list[Step]:
    return [Step(1), Step(2, slow_rank=1 if path == "bucket" else None), Step(3, "missing", 1), Step(4),
            Step(5, "bad-dtype", 0), Step(6), Step(7, "kill", KILL_RANK[path]), Step(8)]


def plans(capabilities, cycles: int, staged: bool) -> list[PathPlan]:
    out = []
    for path, cap in PATH_CAPS.items():
        if cap in capabilities:
            out.append(PathPlan(path, default_params(MODEL_MIB), steps(path), cycles=cycles,
                                hang_rank=HANG_RANK if path == "bucket" else None,
                                options={"staged": True} if staged else {}))
    return out


def run(adapter, config, selected) -> dict:
    """Run the job the selected tests need; ``{"skipped": why}`` when none can run."""
    caps = set(adapter.capabilities)
    markexpr = config.getoption("markexpr", "") or ""
    wanted = [i for i in selected if any(m.name in markexpr for m in i.iter_markers() if m.name in ("multirank", "cycles"))]
    if not wanted or not set(NEEDS) <= caps:
        return {"skipped": "no selected test needs the job"}
    cycles = CYCLES if any(i.get_closest_marker("cycles") for i in wanted) and "cycles" in markexpr else 0
    impl = config.getoption("--impl")
    impl_opts = dict(kv.partition("=")[::2] for kv in config.getoption("--impl-opt"))
    job = Job(impl, plans(caps, cycles, "staged" in caps), ranks=RANKS, impl_opts=impl_opts,
              agree_timeout_s=AGREE_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S, stall_timeout_s=STALL_TIMEOUT_S)
    return job.run()


def path_result(job: dict, path: str) -> dict:
    """The part of the job's result for ``path``; a job that failed fails the caller with its error."""
    if "error" in job:
        raise AssertionError(f"the multi-rank job could not be driven: {job['error']}")
    for p in job.get("paths", []):
        if p["path"] == path:
            return p
    raise AssertionError(f"the multi-rank job has no result for path {path} ({job.get('skipped', 'not run')})")


def reported(p: dict) -> int:
    """How many rank events a path's result holds (each is a call of the implementation)."""
    count = len(p["first"]) + len(p.get("ended", {}))
    for step in p["steps"] + p["cycles"] + ([p["hang"]] if "hang" in p else []):
        count += len(step["clear"]) + len(step["update"])
    return count
