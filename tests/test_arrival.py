"""conformance.arrival: ranks that meet in a shared directory before a collective whose deadline is longer
than gloo's fixed 30 s, and the FastDeploy adapter's bounded collectives that use it (world.bounded).

The quick cases drive ``Arrival`` from threads (one per rank) and ``bounded`` with a stand-in arrival; one
case (about 35 s) shows on two real gloo ranks both why it exists and that it works: a barrier whose peer
comes 32 s late fails at gloo's 30 s straight into gloo, and completes on both ranks after their arrival."""
from __future__ import annotations

import threading
import time

import pytest

from conformance import arrival as A
from conformance.impls.fastdeploy import world
from conformance.rank_group import RankGroup


def _ranks(directory, ranks: int, script) -> dict[int, dict]:
    """``script(rank, Arrival) -> dict`` on one thread per rank; each rank's result, or what it raised."""
    out: dict[int, dict] = {}

    def run(rank):
        try:
            out[rank] = script(rank, A.Arrival(str(directory), rank, ranks))
        except Exception as e:  # noqa: BLE001 (judged by the test)
            out[rank] = {"raised": e}

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank's wait did not return"
    return out


def test_a_late_peer_is_waited_for_and_both_get_what_is_left(tmp_path):
    def script(rank, arrival):
        if rank == 1:
            time.sleep(0.3)
        start = time.monotonic()
        left = arrival.wait(5.0, "barrier")
        return {"left": left, "waited": time.monotonic() - start}

    out = _ranks(tmp_path, 2, script)
    assert 0.25 <= out[0]["waited"] < 5.0 and 0 < out[0]["left"] <= 5.0 - out[0]["waited"] + 0.01, out
    assert out[1]["waited"] < 0.25 and out[1]["left"] > 4.0, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.0", "0.1"]


def test_a_peer_that_never_comes_is_named_at_the_deadline(tmp_path):
    def script(rank, arrival):
        if rank == 2:
            return {"absent": True}
        start = time.monotonic()
        try:
            arrival.wait(0.5, "paddle.distributed.barrier")
        except TimeoutError as e:
            return {"raised": str(e), "waited": time.monotonic() - start}
        return {"raised": None}

    out = _ranks(tmp_path, 3, script)
    for rank in (0, 1):
        assert out[rank]["raised"] == (f"paddle.distributed.barrier: rank(s) [2] did not arrive within 0.5s (the "
                                       f"process group's timeout; rank {rank}, collective 0 of its session)"), out
        assert 0.5 <= out[rank]["waited"] < 1.5, out


def test_an_arrival_counts_for_its_own_collective_only(tmp_path):
    """Rank 1 arrives at the first collective only: rank 0's second wait times out naming it (an earlier
    arrival is not a later one), and each collective has its own file."""
    def script(rank, arrival):
        arrival.wait(2.0, "first")
        if rank == 1:
            return {}
        try:
            arrival.wait(0.3, "second")
        except TimeoutError as e:
            return {"raised": str(e)}
        return {"raised": None}

    out = _ranks(tmp_path, 2, script)
    assert out[0]["raised"].startswith("second: rank(s) [1] did not arrive within 0.3s"), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.0", "0.1", "1.0"]


def test_without_the_directory_there_is_no_arrival(monkeypatch, tmp_path):
    monkeypatch.delenv(A.ENV, raising=False)
    assert A.Arrival.from_env(0, 2) is None
    monkeypatch.setenv(A.ENV, str(tmp_path))
    made = A.Arrival.from_env(1, 3)
    assert (made.directory, made.rank, made.ranks, made.count) == (str(tmp_path), 1, 3, 0)


class _Arrival:
    """A stand-in arrival: records each wait, returns ``left``."""

    def __init__(self, left: float):
        self.left, self.waits = left, []

    def wait(self, timeout_s, what):
        self.waits.append((timeout_s, what))
        return self.left


@pytest.mark.parametrize("timeout_s, arrives", [(A.GLOO_TIMEOUT_S, False), (A.GLOO_TIMEOUT_S + 0.5, True)])
def test_bounded_arrives_only_past_gloos_own_timeout(timeout_s, arrives):
    """At gloo's 30 s or less, gloo's own timeout and the bound on the collective are the deadline; past it,
    every rank arrives first."""
    stand_in = _Arrival(10.0)
    assert world.bounded(lambda: "done", timeout_s, "barrier", stand_in) == "done"
    assert stand_in.waits == ([(timeout_s, "barrier")] if arrives else [])


def test_after_the_arrival_the_collective_gets_what_is_left_and_at_least_its_floor(monkeypatch):
    monkeypatch.setattr(world, "COLLECTIVE_S", 0.2)
    late = A.GLOO_TIMEOUT_S + 1

    def sleeps(s):
        return lambda: time.sleep(s) or "done"

    assert world.bounded(sleeps(0.05), late, "barrier", _Arrival(0.01)) == "done"  # the floor, not 0.01 s
    with pytest.raises(TimeoutError, match=r"^barrier: the other ranks did not arrive within 0.2s"):
        world.bounded(sleeps(0.6), late, "barrier", _Arrival(0.01))
    assert world.bounded(sleeps(0.4), late, "barrier", _Arrival(0.8)) == "done"  # what is left, past the floor


# -- two real gloo ranks ---------------------------------------------------------------------------------------
LATE_S = A.GLOO_TIMEOUT_S + 2.0  # rank 1 enters its barrier this late
DEADLINE_S = LATE_S + 13.0


def _late_barrier(ctx, directory: str | None) -> dict:
    import paddle.distributed as dist

    if ctx.rank == 1:
        time.sleep(LATE_S)
    meet = A.Arrival(directory, ctx.rank, ctx.ranks) if directory else None
    start = time.monotonic()
    try:
        world.bounded(dist.barrier, DEADLINE_S, "paddle.distributed.barrier", meet)
        return {"raised": None, "waited": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 (judged by the test)
        return {"raised": f"{type(e).__name__}: {e}", "waited": time.monotonic() - start}


def test_a_peer_later_than_gloos_timeout_meets_its_barrier_after_arriving(tmp_path):
    """Rank 1 comes 32 s late to a barrier whose deadline is 45 s. Straight into gloo, rank 0 fails at gloo's
    own 30 s; after the arrival, both complete, rank 0 having waited for rank 1."""
    straight = RankGroup(2, {"late_barrier": _late_barrier}).launch()
    met = RankGroup(2, {"late_barrier": _late_barrier}).launch()
    with straight, met:
        for rank in (0, 1):
            straight.start(rank, "late_barrier", directory=None)
            met.start(rank, "late_barrier", directory=str(tmp_path))
        bound = LATE_S + DEADLINE_S + 10.0
        gloo, ours = straight.wait([0, 1], bound), met.wait([0, 1], bound)
    assert all(r["ok"] for r in [*gloo.values(), *ours.values()]), (gloo, ours)
    zero = gloo[0]["value"]
    assert zero["raised"] and "TIMEOUT" in zero["raised"], zero
    assert A.GLOO_TIMEOUT_S - 1 <= zero["waited"] < LATE_S, zero
    assert [ours[r]["value"]["raised"] for r in (0, 1)] == [None, None], ours
    assert LATE_S - 1 <= ours[0]["value"]["waited"] < DEADLINE_S and ours[1]["value"]["waited"] < 5.0, ours
