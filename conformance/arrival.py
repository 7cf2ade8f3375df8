"""Arrival before a collective whose deadline is longer than gloo's own.

Paddle's gloo process group has a fixed timeout of 30 s (``ProcessGroupGloo.create`` takes none): a
collective whose peer comes later than that fails on the rank that came first, whatever deadline the
engine configured. An adapter that stands in for the engine's process group (the FastDeploy adapter's
barriers and broadcast, ``conformance/impls/fastdeploy/world.py``) honours a longer deadline by waiting
first for every rank to arrive, here, and only then entering the collective, which the ranks then meet at
once. With a deadline of 30 s or less, gloo's own timeout and the adapter's bound on the collective are
the deadline, and nothing here is used.

The ranks meet in a directory they share, which the harness that launched them names in the
``WEIGHTSYNC_ARRIVAL_DIR`` environment variable (one directory per job: the quick run's ``Job``). Each
rank creates the file ``<n>.<rank>`` on its n-th collective (counted per session, from 0), then looks for
its peers' files until the deadline: a file costs a create and a few ``stat`` calls, never a request to a
server that could itself stop answering. Without the variable, the collectives are gloo's alone.

    arrival = Arrival.from_env(rank, ranks)        # None without WEIGHTSYNC_ARRIVAL_DIR
    left = arrival.wait(60.0, "paddle.distributed.barrier")   # TimeoutError naming the ranks that never came
"""
from __future__ import annotations

import os
import time

ENV = "WEIGHTSYNC_ARRIVAL_DIR"
GLOO_TIMEOUT_S = 30.0  # Paddle's gloo process group: fixed (gloo's kDefaultTimeout)
_POLL_S = (0.001, 0.02)  # the first look's pause, doubled after each look up to the second


class Arrival:
    """The arrivals of one rank's collectives in ``directory`` (see the module docstring)."""

    def __init__(self, directory: str, rank: int, ranks: int):
        self.directory, self.rank, self.ranks = directory, rank, ranks
        self.count = 0  # the collectives this rank has entered

    @classmethod
    def from_env(cls, rank: int, ranks: int) -> "Arrival | None":
        directory = os.environ.get(ENV)
        return cls(directory, rank, ranks) if directory else None

    def wait(self, timeout_s: float, what: str) -> float:
        """Arrive at this rank's next collective and wait until every rank has arrived at it; the seconds of
        ``timeout_s`` left then. ``TimeoutError`` naming the ranks still missing at the deadline."""
        deadline = time.monotonic() + timeout_s
        n, self.count = self.count, self.count + 1
        with open(self._path(n, self.rank), "x"):
            pass
        pause, missing = _POLL_S[0], self._missing(n)
        while missing:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: rank(s) {missing} did not arrive within {timeout_s:g}s (the process "
                                   f"group's timeout; rank {self.rank}, collective {n} of its session)")
            time.sleep(min(pause, left))
            pause = min(2 * pause, _POLL_S[1])
            missing = self._missing(n)
        return deadline - time.monotonic()

    def _missing(self, n: int) -> list[int]:
        return [r for r in range(self.ranks) if r != self.rank and not os.path.exists(self._path(n, r))]

    def _path(self, n: int, rank: int) -> str:
        return os.path.join(self.directory, f"{n}.{rank}")
