"""Cycles that lose nothing: at least 20 clear/update cycles in a row on every path, both sides (each
inference rank and each trainer), resources compared between the first cycle and the last. Spec:
SPEC.md § CYCLE.

Tier ``cycles``: ``pytest conformance --impl=NAME -m cycles`` (with ``-m "multirank or cycles"`` the
multi-rank job runs once for both tiers). The cycles are the multi-rank job's (``multirank_plan``):
two ranks, each with a 4 MiB shard of its own, so that keeping one shard per cycle (19 more by the last
cycle) is far beyond 2% of a rank's resident memory.

In the quick run, a few cycles in this process on every path (the trainer the suite's fixture, in this process
too) compare what a leak shows exactly, by count: descriptors, sockets, threads, shared-memory mappings and
mappings of the snapshot files; resident memory needs the tier's 20 cycles.
"""
import os
import time

import pytest

from conformance import check, harness, modes
from conformance import multirank_plan as P
from conformance.paths import route  # noqa: F401 (the fixture)
from weightsync.fixtures import models as M

RSS_TOLERANCE = 0.02
COUNTS = ("fds", "sockets", "threads")


def _paths():
    return [pytest.param(path, marks=[pytest.mark.requires(*P.NEEDS, cap), pytest.mark.modes(path=modes.PATH_OF_CAPABILITY[cap])],
                         id=path) for path, cap in P.PATH_CAPS.items()]


def _cycles(rank_job, path):
    p = P.path_result(rank_job, path)
    harness._calls["adapter"] += P.reported(p)
    cycles = P.cycles(rank_job, p)
    check.that(len(cycles) >= 20, f"{path}: {len(cycles)} cycles ran, at least 20 are needed")
    bad = [(c["version"], r, e["event"]) for c in cycles for r, e in c["update"].items()
           if e["event"] != "updated" or e["digests"] != c["sent"][r]]
    check.that(not bad, f"{path}: cycles whose update did not load every rank's shard bit for bit: {bad[:5]}")
    return cycles[0], cycles[-1]


def _compare(first: dict, last: dict, where: str) -> None:
    grown = (last["rss_kib"] - first["rss_kib"]) / first["rss_kib"]
    check.that(grown <= RSS_TOLERANCE, f"{where}: resident memory {first['rss_kib']} KiB after the first cycle, "
               f"{last['rss_kib']} KiB after the last ({grown:+.1%}; at most {RSS_TOLERANCE:.0%})")
    for key in COUNTS:
        check.equal(last[key], first[key], f"{where}: {key} after the last cycle vs after the first")
    for key in ("segments", "shm_maps"):
        if key in first:  # names change per update (a trainer's segment per version); the count must not
            check.equal(len(last[key]), len(first[key]), f"{where}: {key} after the last cycle (first: {first[key]}, "
                        f"last: {last[key]})")


SIDES = {"rank": lambda c: {r: e["resources"] for r, e in c["update"].items()}, "trainer": lambda c: c["trainers"]}


@pytest.mark.rule("CYCLE-NO-LEAK")
@pytest.mark.cycles
@pytest.mark.timeout(900)
@pytest.mark.parametrize("side", sorted(SIDES))
@pytest.mark.parametrize("path", _paths())
def test_nothing_kept_across_cycles(rank_job, path, side):
    first, last = _cycles(rank_job, path)
    before = SIDES[side](first)
    for r, after in SIDES[side](last).items():
        _compare(before[r], after, f"{path}, {side} {r}: {len(P.path_result(rank_job, path)['cycles'])} cycles")


# -- a few cycles in one process (the quick run) -----------------------------------------------------------------
SPEC = M.spec(("embed.weight", "float32", (16, 8)), ("layers.0.mlp.weight", "bfloat16", (8, 8)),
              ("norm.bias", "float16", (8,)))
WARM = 2  # cycles before the first count (handles, contexts and caches a path keeps for good are made by then)
MORE = 3  # cycles between the counts: a leak of one per cycle shows as 3
SETTLE_S = 3.0  # a count that grew is taken again for this long (a thread of another test ending, a socket closing)


def _counts(loader) -> dict[str, int]:
    """What this process holds that a leak per cycle grows: descriptors, sockets, threads (native ones included),
    shared-memory mappings, mappings of the files of the model and shared directories."""
    fds, sockets = 0, 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (the listing's own descriptor, closed by now)
        fds += 1
        sockets += target.startswith("socket:")
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        maps = f.read().splitlines()
    shm = sum("/dev/shm/" in line for line in maps)
    files = sum(loader.model_dir in line or loader.shared_dir in line for line in maps)
    return {"descriptors": fds, "sockets": sockets, "threads": len(os.listdir("/proc/self/task")),
            "shared-memory mappings": shm, "snapshot-file mappings": files}


def _grown(before: dict, loader) -> dict:
    """What grew since ``before`` (name -> (before, now)), taken again for up to ``SETTLE_S`` while anything has."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = _counts(loader)
        grown = {k: (before[k], now[k]) for k in before if now[k] > before[k]}
        if not grown or time.monotonic() >= deadline:
            return grown
        time.sleep(0.02)


@pytest.mark.rule("CYCLE-NO-LEAK")
@pytest.mark.parametrize("combo", modes.params("CYCLE-NO-LEAK"))
def test_few_cycles_keep_nothing(route, loader, combo):
    path = combo["path"]
    rt = route(path)
    session = rt.open(SPEC)
    counted = None
    for version in range(1, WARM + MORE + 1):
        rt.clear(0) if version > 1 else None
        where = rt.publish(0, M.state(SPEC, version=version), version)
        rt.update(0)
        if version in (1, WARM + MORE):
            check.params_equal(session.observe(), M.state(SPEC, version=version), f"{path}: cycle {version} ({where})")
        if version == WARM:
            counted = _counts(loader)
    grown = _grown(counted, loader)
    check.that(not grown, f"{path}: {MORE} more clear/update cycles in one process grew {grown} (after cycle {WARM}, "
                          f"after cycle {WARM + MORE}): a leak per cycle")
