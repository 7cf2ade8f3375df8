"""Every rank at a collective before it starts, within the deadline the caller configured.

Paddle's gloo process group (the CPU build's) gives up on a collective whose peers have not come within a fixed
30 s (``GLOO_TIMEOUT_S``: gloo's own default; ``ProcessGroupGloo.create`` takes no timeout), whatever deadline the
caller set. A healthy rank 30 s behind its peer on a loaded machine then failed a barrier the engine's process
group (NCCL, ``pg_timeout`` 30 minutes by default) waits for: FastDeploy's parts loader, two ranks on two hosts,
its first load, with a 60 s deadline. So a caller whose deadline is longer than gloo's first counts the ranks at
the collective on the group's store (the default group's TCPStore): ``arrive(kind, timeout_s)`` marks this rank at
its ``kind``'s next collective and returns True once every rank of the group is marked there, False at the
deadline. The collective then starts with every rank present, and gloo's 30 s never runs out.

* The caller runs its collective either way: after a missed deadline in a thread it no longer waits for, as it did
  before counting, so a rank that comes later still meets it there within gloo's own time.
* A peer that has died does not leave the others waiting out the deadline: each rank names its host and process
  on the store at its first collective, and a missing peer on this host whose process is gone ends the wait (True:
  the collective then fails at once, as gloo's does on a closed connection).
* Each rank numbers the collectives of a kind in the order it calls them (one counter per process and kind):
  ranks that call the same collectives in the same order meet at the same key, as gloo pairs them by order too.
* The store lives in rank 0's process: a store that no longer answers is a peer gone (True, as above).
* Nothing to count (True at once): a deadline within gloo's own, a group of one, no store, a backend not gloo.
"""
from __future__ import annotations

import collections
import itertools
import os
import socket
import time

GLOO_TIMEOUT_S = 30.0  # gloo's own deadline for a peer's message: not configurable through Paddle
PREFIX = "weightsync/arrival"
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.0002, 0.005  # between two reads of the marks (most peers come within a few ms)
_LIVENESS_S = 0.05  # between two looks at a missing peer's process

_next = collections.defaultdict(itertools.count)  # kind -> this process's next collective of that kind
_named: set = set()  # the stores this process has named itself on


def _group():
    """(store, rank, world size) of the default gloo group; None where there is nothing to count."""
    import paddle.distributed as dist
    from paddle.distributed import collective

    store = getattr(collective, "_default_store", None)
    if store is None or not dist.is_initialized() or int(dist.get_world_size()) < 2:
        return None
    try:
        backend = str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001 (no backend to read: counting is harmless)
        backend = "gloo"
    if backend != "gloo":
        return None
    return store, int(dist.get_rank()), int(dist.get_world_size())


def _who(store, rank: int) -> tuple[str, int] | None:
    """Where rank ``rank`` said it runs (host, pid), or None before it said so (a get would block until then)."""
    if store.add(f"{PREFIX}/named/{rank}", 0) < 1:
        return None
    host, _, pid = store.get(f"{PREFIX}/who/{rank}").decode().rpartition(" ")
    return host, int(pid)


def _gone(host_pid: tuple[str, int] | None) -> bool:
    """The process has exited (a zombie its parent has not reaped yet included); False for a peer on another
    machine, where only the deadline tells."""
    import psutil

    if host_pid is None or host_pid[0] != socket.gethostname():
        return False
    try:
        return psutil.Process(host_pid[1]).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def arrive(kind: str, timeout_s: float, *, group=None) -> bool:
    """Mark this rank at its next collective of ``kind`` and wait until every rank is marked there or a missing
    one's process is gone (True), or ``timeout_s`` has passed (False); see the module docstring. ``group``:
    (store, rank, world size), the default gloo group's by default."""
    if timeout_s <= GLOO_TIMEOUT_S:
        return True
    group = _group() if group is None else group
    if group is None:
        return True
    store, rank, world = group
    key = f"{PREFIX}/{kind}/{next(_next[kind])}"
    deadline = time.monotonic() + timeout_s
    try:
        return _wait(store, rank, world, key, deadline)
    except Exception:  # noqa: BLE001 (the store's process, rank 0's, is gone: the collective fails as gloo's does)
        return True


def _wait(store, rank: int, world: int, key: str, deadline: float) -> bool:
    if id(store) not in _named:
        store.set(f"{PREFIX}/who/{rank}", f"{socket.gethostname()} {os.getpid()}".encode())
        store.add(f"{PREFIX}/named/{rank}", 1)
        _named.add(id(store))
    store.add(f"{key}/{rank}", 1)
    missing = [r for r in range(world) if r != rank]
    pause, looked = _FIRST_PAUSE_S, time.monotonic()
    while True:
        missing = [r for r in missing if store.add(f"{key}/{r}", 0) < 1]
        if not missing:
            return True
        now = time.monotonic()
        if now - looked >= _LIVENESS_S:
            looked = now
            if any(_gone(_who(store, r)) for r in missing):
                return True
        if now >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE_S)
