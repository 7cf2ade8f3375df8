"""Seconds per phase of a clear/update cycle, for benchmarks (``benchmarks/rank_cycle.py``); no rule reads them."""
from __future__ import annotations

import time
from contextlib import contextmanager


class Phases(dict):
    """Raw spans by name: ``clear``, ``clear_agree``, ``update`` (the whole load and commit), and within
    it ``apply``, ``update_agree`` and ``finalize``; ``cycle()`` turns them into the benchmark's phases."""

    @contextmanager
    def timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self[name] = self.get(name, 0.0) + seconds

    def cycle(self) -> dict[str, float]:
        """clear, transfer (the update less what is counted apart), apply, agree (both votes), finalize."""
        inner = self.get("apply", 0.0) + self.get("update_agree", 0.0) + self.get("finalize", 0.0)
        return {"clear": self.get("clear", 0.0), "transfer": self.get("update", 0.0) - inner,
                "apply": self.get("apply", 0.0), "agree": self.get("clear_agree", 0.0) + self.get("update_agree", 0.0),
                "finalize": self.get("finalize", 0.0)}


def pulled(items, phases: Phases, name: str):
    """``items``, the time spent producing each one (a file read lazily) taken off phase ``name``: reading is
    the transfer's, not the phase that consumes them."""
    items = iter(items)
    while True:
        start = time.perf_counter()
        try:
            item = next(items)
        except StopIteration:
            phases.add(name, start - time.perf_counter())
            return
        phases.add(name, start - time.perf_counter())
        yield item
