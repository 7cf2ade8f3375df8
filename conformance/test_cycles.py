"""Cycles that lose nothing: at least 20 clear/update cycles in a row on every path, both sides (each
inference rank and each trainer), resources compared between the first cycle and the last. Spec:
SPEC.md § CYCLE.

Tier ``cycles``: ``pytest conformance --impl=NAME -m cycles`` (with ``-m "multirank or cycles"`` the
multi-rank job runs once for both tiers). The cycles are the multi-rank job's (``multirank_plan``):
two ranks, each with a 4 MiB shard of its own, so that keeping one shard per cycle (19 more by the last
cycle) is far beyond 2% of a rank's resident memory.
"""
import pytest

from conformance import check, harness
from conformance import multirank_plan as P

pytestmark = [pytest.mark.cycles, pytest.mark.timeout(900)]  # the job runs in the first test's setup
RSS_TOLERANCE = 0.02
COUNTS = ("fds", "sockets", "threads")


def _paths():
    return [pytest.param(path, marks=pytest.mark.requires(*P.NEEDS, cap), id=path) for path, cap in P.PATH_CAPS.items()]


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
    check.that(abs(grown) <= RSS_TOLERANCE, f"{where}: resident memory {first['rss_kib']} KiB after the first cycle, "
               f"{last['rss_kib']} KiB after the last ({grown:+.1%}; at most {RSS_TOLERANCE:.0%})")
    for key in COUNTS:
        check.equal(last[key], first[key], f"{where}: {key} after the last cycle vs after the first")
    for key in ("segments", "shm_maps"):
        if key in first:  # names change per update (a trainer's segment per version); the count must not
            check.equal(len(last[key]), len(first[key]), f"{where}: {key} after the last cycle (first: {first[key]}, "
                        f"last: {last[key]})")


SIDES = {"rank": lambda c: {r: e["resources"] for r, e in c["update"].items()}, "trainer": lambda c: c["trainers"]}


@pytest.mark.rule("CYCLE-NO-LEAK")
@pytest.mark.parametrize("side", sorted(SIDES))
@pytest.mark.parametrize("path", _paths())
def test_nothing_kept_across_cycles(rank_job, path, side):
    first, last = _cycles(rank_job, path)
    before = SIDES[side](first)
    for r, after in SIDES[side](last).items():
        _compare(before[r], after, f"{path}, {side} {r}: {len(P.path_result(rank_job, path)['cycles'])} cycles")
