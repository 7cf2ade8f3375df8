"""Where a run waits: each test's wall time against its process's CPU time, summed per module.

    WAIT_PROBE_OUT=/tmp/probe .venv/bin/python -m pytest conformance --impl=reference -n 2 -p benchmarks.wait_probe
    .venv/bin/python -m benchmarks.wait_probe /tmp/probe

Each process (each xdist worker) writes ``OUT.<pid>.json`` (an earlier run's files of the same ``OUT`` are removed
as the run starts, so that the summary is this run's alone): per test its node id, the wall seconds of its whole
protocol (setup, call, teardown) and the CPU seconds (``getrusage`` of the process, its threads, and the children
it reaped) in them. The summary prints, per module, the wall time that was not the process's CPU: a deadline
waited out, a peer held late, a forked rank's work (the pool's ranks are not reaped per case, so it counts here).
Under ``-n 2`` a worker that waits leaves its core idle.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time

import pytest

_rows: list = []


def _cpu() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.monotonic(), _cpu()
    yield
    _rows.append((item.nodeid, time.monotonic() - wall, _cpu() - cpu))


def pytest_sessionstart(session):
    """In the process that starts the run (the xdist controller, or the only process), before any worker writes."""
    out = os.environ.get("WAIT_PROBE_OUT")
    if out and not hasattr(session.config, "workerinput"):
        for path in glob.glob(f"{out}.*.json"):
            os.remove(path)


def pytest_sessionfinish(session):
    out = os.environ.get("WAIT_PROBE_OUT")
    if out and _rows:
        with open(f"{out}.{os.getpid()}.json", "w", encoding="utf-8") as f:
            json.dump(_rows, f)


def summarize(out: str, top: int = 12) -> str:
    modules: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for path in glob.glob(f"{out}.*.json"):
        with open(path, encoding="utf-8") as f:
            for nodeid, wall, cpu in json.load(f):
                m = modules[nodeid.split("::")[0]]
                m[0], m[1], m[2] = m[0] + wall, m[1] + cpu, m[2] + 1
    wall, cpu, n = (sum(m[i] for m in modules.values()) for i in range(3))
    lines = [f"{n} tests: wall {wall:.1f} s, CPU {cpu:.1f} s, waiting {wall - cpu:.1f} s"]
    for name, (w, c, k) in sorted(modules.items(), key=lambda kv: kv[1][1] - kv[1][0])[:top]:
        lines.append(f"  waiting {w - c:6.1f} s  wall {w:6.1f} s  CPU {c:6.1f} s  {k:5d} tests  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
