"""wire.arrival: every rank counted at a collective before it starts, so that a deadline longer than gloo's own
30 s holds; on a store of this test's (the counting, the deadline, a dead peer), and on two real ranks whose peer
comes later than gloo's 30 s (the reference's vote, FastDeploy's barrier, the harness's broadcast)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests import early
from wire import arrival

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Store:
    """Paddle's TCPStore as ``arrival`` uses it (add, set, get), in a dict; ``peers`` add their marks when asked."""

    def __init__(self):
        self.values: dict[str, int | bytes] = {}
        self.calls = 0

    def add(self, key: str, n: int) -> int:
        self.calls += 1
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key]

    def name(self, rank: int, host: str, pid: int) -> None:
        """Rank ``rank`` says where it runs, as its own first arrival would."""
        self.set(f"{arrival.PREFIX}/who/{rank}", f"{host} {pid}".encode())
        self.add(f"{arrival.PREFIX}/named/{rank}", 1)

    def mark(self, kind: str, index: int, rank: int) -> None:
        self.add(f"{arrival.PREFIX}/{kind}/{index}/{rank}", 1)


@pytest.fixture
def counting(monkeypatch):
    """Counting on with short deadlines (gloo's own taken as 0 s here) and fresh counters."""
    monkeypatch.setattr(arrival, "GLOO_TIMEOUT_S", 0.0)
    monkeypatch.setattr(arrival, "_next", type(arrival._next)(arrival._next.default_factory))
    monkeypatch.setattr(arrival, "_named", set())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("timeout_s", [arrival.GLOO_TIMEOUT_S - 1, arrival.GLOO_TIMEOUT_S])
def test_a_deadline_within_gloos_own_counts_nothing(timeout_s):
    """Gloo's own deadline is not the shorter one: nothing is counted, the store is not touched."""

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the store was used ({name}) with a deadline of {timeout_s}s")

    assert arrival.arrive("k", timeout_s, group=(Untouchable(), 0, 2)) is True


def test_one_past_gloos_deadline_counts(monkeypatch):
    """A deadline just past gloo's own is counted: a peer that never comes is waited for (here its wait is cut
    short by the clock, so the test does not wait 30 s)."""
    monkeypatch.setattr(arrival, "_next", type(arrival._next)(arrival._next.default_factory))
    monkeypatch.setattr(arrival, "_named", set())
    clock = iter([0.0] + [arrival.GLOO_TIMEOUT_S + 2] * 1000)
    monkeypatch.setattr(arrival.time, "monotonic", lambda: next(clock))
    store = Store()
    assert arrival.arrive("k", arrival.GLOO_TIMEOUT_S + 1, group=(store, 0, 2)) is False
    assert store.values.get(f"{arrival.PREFIX}/k/0/0") == 1, store.values


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("rank", ["first", "last"])
def test_every_rank_marked_is_an_arrival(counting, world, rank):
    """Every other rank already marked at the same collective: True, with this rank's mark added; the next
    collective of the kind is the next key, which nobody has reached yet."""
    me = 0 if rank == "first" else world - 1
    store = Store()
    for r in range(world):
        if r != me:
            store.mark("k", 0, r)
    assert arrival.arrive("k", 5.0, group=(store, me, world)) is True
    assert store.values[f"{arrival.PREFIX}/k/0/{me}"] == 1
    started = time.monotonic()
    assert arrival.arrive("k", 0.2, group=(store, me, world)) is False  # nobody at k/1
    assert time.monotonic() - started >= 0.2
    assert store.values[f"{arrival.PREFIX}/k/1/{me}"] == 1


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_missing_is_waited_for_until_the_deadline(counting, world):
    """All ranks but one (the last, alive on this host) marked: False, once the deadline has passed, not before."""
    store = Store()
    store.name(world - 1, socket.gethostname(), os.getpid())  # alive
    for r in range(1, world - 1):
        store.mark("k", 0, r)
    started = time.monotonic()
    assert arrival.arrive("k", 0.3, group=(store, 0, world)) is False
    assert time.monotonic() - started >= 0.3


def test_kinds_are_counted_apart(counting):
    """A mark at one kind's collective is not an arrival at another's."""
    store = Store()
    store.mark("harness", 0, 1)
    assert arrival.arrive("agreement", 0.2, group=(store, 0, 2)) is False
    assert arrival.arrive("harness", 0.2, group=(store, 0, 2)) is True


def test_a_peer_that_comes_during_the_wait_ends_it(counting):
    """The peer marks itself while this rank waits: True as soon as it does, long before the deadline."""
    import threading

    store = Store()
    started = time.monotonic()
    threading.Timer(0.2, store.mark, ("k", 0, 1)).start()
    assert arrival.arrive("k", 30.0, group=(store, 0, 2)) is True
    assert 0.2 <= time.monotonic() - started < 10.0


@pytest.mark.parametrize("where", ["this host, gone", "this host, exited, not reaped", "this host, alive",
                                   "another host", "never named"])
def test_a_missing_peer_whose_process_is_gone_ends_the_wait(counting, where):
    """A missing peer on this host whose process has exited (reaped or still a zombie: the forked ranks' parent
    reaps them only at the end) ends the wait at once (True: the collective then fails as gloo's does on a closed
    connection); alive, on another host, or never named, it is waited for."""
    store, zombie = Store(), None
    if where == "this host, exited, not reaped":
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        while not os.path.exists(f"/proc/{zombie.pid}") or open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.01)
        pid = zombie.pid
    else:
        pid = _dead_pid() if where == "this host, gone" else os.getpid()
    if where != "never named":
        store.name(1, "elsewhere.invalid" if where == "another host" else socket.gethostname(), pid)
    started = time.monotonic()
    came = arrival.arrive("k", 2.0, group=(store, 0, 2))
    waited = time.monotonic() - started
    if zombie is not None:
        zombie.wait()
    if where.startswith("this host, e") or where == "this host, gone":
        assert came is True and waited < 1.0, (where, came, waited)
    else:
        assert came is False and waited >= 2.0, (where, came, waited)


@pytest.mark.parametrize("fails_at", [1, 2, 5])
def test_a_store_that_stops_answering_is_a_peer_gone(counting, fails_at):
    """The store lives in rank 0's process: when it stops answering (Paddle raises "TCP send error"), at this
    rank's first call, its own mark or while it waits, the wait ends (True) and the collective fails as gloo's
    does; it never raises out of ``arrive``."""

    class Gone(Store):
        def add(self, key, n):
            if self.calls + 1 >= fails_at:
                raise ValueError("(InvalidArgument) TCP send error. Details: Broken pipe.")
            return super().add(key, n)

    started = time.monotonic()
    assert arrival.arrive("k", 5.0, group=(Gone(), 0, 2)) is True
    assert time.monotonic() - started < 2.0


def test_a_rank_names_itself_once_per_store(counting):
    store = Store()
    for _ in range(3):
        arrival.arrive("k", 0.01, group=(store, 1, 2))
    assert store.values[f"{arrival.PREFIX}/named/1"] == 1
    assert store.values[f"{arrival.PREFIX}/who/1"] == f"{socket.gethostname()} {os.getpid()}".encode()


def test_without_a_group_nothing_is_counted(counting):
    """No process group in this process (the quick run's one-process cases): True at once."""
    assert arrival.arrive("k", 60.0) is True


# -- two real ranks, a peer later than gloo's own deadline ---------------------------------------------------
LATE_S = arrival.GLOO_TIMEOUT_S + 2.0  # past gloo's own deadline: without the count the waiting rank's collective fails
DEADLINE_S = 2 * LATE_S

_LATE = """
import json, sys, time
from tests.test_agreement import two_ranks
late_s, deadline_s, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]

def script(rank, _agreement):
    import paddle.distributed as dist
    from conformance.impls.fastdeploy.world import bounded
    from conformance.rank_worker import Collective
    from reference.agreement import Agreement
    seen = {}

    def phase(name, late_rank, call):
        if rank == late_rank:
            time.sleep(late_s)
        started = time.monotonic()
        try:
            seen[name] = {"value": call(), "waited": time.monotonic() - started}
        except Exception as e:
            seen[name] = {"error": f"{type(e).__name__}: {e}", "waited": time.monotonic() - started}

    phase("vote", 1, lambda: [v.ok for v in Agreement(deadline_s).vote("late", True)])
    phase("barrier", 0, lambda: bounded(dist.barrier, deadline_s, "paddle.distributed.barrier"))
    phase("broadcast", 1, lambda: Collective(deadline_s).word_of_rank0(7 if rank == 0 else 3))
    return seen

with open(out, "w") as f:
    json.dump(two_ranks(script, timeout_s=4 * late_s + 60, in_process=False), f)
"""


@early.job("late_peers")
def _late_peers(tmp_path_factory):
    """Two ranks in a process of their own, each collective with a peer LATE_S late: it mostly sleeps (no core)."""
    out = tmp_path_factory.mktemp("late-peers") / "result.json"
    proc = early.run([sys.executable, "-c", _LATE, str(LATE_S), str(DEADLINE_S), str(out)], REPO,
                     timeout=4 * LATE_S + 120, cores=0)
    if not out.exists():
        return {"error": f"exit {proc.returncode}, no result:\n{(proc.stdout + proc.stderr)[-3000:]}"}
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def late_peers(tmp_path_factory):
    return early.result("late_peers", tmp_path_factory)


@pytest.mark.timeout(4 * LATE_S + 180)
@pytest.mark.parametrize("collective, late, expected", [
    ("vote", 1, [True, True]),  # the reference's agreement (reference/agreement.py)
    ("barrier", 0, None),  # FastDeploy's barrier as the adapter runs it (conformance/impls/fastdeploy/world.py)
    ("broadcast", 1, 7),  # the multirank tier harness's word of rank 0 (conformance/rank_worker.py)
])
def test_a_peer_later_than_gloos_deadline_is_met_within_the_callers(late_peers, collective, late, expected):
    """Each rank's collective completes with the other's data, though the peer came LATE_S (past gloo's 30 s)
    after it: the waiting rank waited at least that long and less than its deadline."""
    assert "error" not in late_peers, late_peers["error"]
    for rank, seen in enumerate(late_peers):
        got = seen[collective]
        where = f"{collective}, rank {rank} (rank {late} {LATE_S:g}s late, deadline {DEADLINE_S:g}s)"
        assert "error" not in got, f"{where}: {got['error']} after {got['waited']:.1f}s"
        assert got["value"] == expected, f"{where}: {got['value']!r}, expected {expected!r}"
        if rank != late:
            assert LATE_S - 1.0 <= got["waited"] < DEADLINE_S, f"{where}: waited {got['waited']:.1f}s"
