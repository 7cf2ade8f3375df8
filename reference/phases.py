"""Seconds per phase of a clear/update cycle, for benchmarks (``benchmarks/rank_cycle.py`` turns them into
the cycle's phases); no rule reads them, so mutation testing leaves this module out (pyproject.toml)."""
from __future__ import annotations

import time


class Span:
    def __init__(self, phases: "Phases", name: str):
        self.phases, self.name, self.start = phases, name, time.perf_counter()

    def end(self) -> None:
        self.phases.add(self.name, time.perf_counter() - self.start)


class Phases(dict):
    """Spans by name: ``clear``, ``clear_agree``, ``update`` (the whole load and commit), and within it
    ``apply``, ``update_agree`` and ``finalize``. A span is started and ended by statements of their own
    (``span = self.phases.span(...)``, ``span.end()``), which mutation testing leaves alone (pyproject.toml)."""

    def span(self, name: str) -> Span:
        return Span(self, name)

    def add(self, name: str, seconds: float) -> None:
        self[name] = self.get(name, 0.0) + seconds


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
