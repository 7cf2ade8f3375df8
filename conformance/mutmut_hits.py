"""mutmut bookkeeping: a function reached in a forked child counts for the test that forked it.

mutmut (the project's mutation tool, ``mutation/report.py``) runs, for each mutant, only the tests that reached
the mutated function while it recorded its stats (``MUTANT_UNDER_TEST=stats``). It records a reach in the process
that makes it, and many tests run the implementation in a forked child: the bounded harness, the memory and
read-cap measurements, the restart tier's workers, the ranks of ``tests/test_agreement.py``. Reaches made there
were lost, so a mutant that only such a test kills was never judged by it and read as a survivor.

This plugin, inert outside mutmut's stats run, has every process other than pytest's own append its reaches to a
file, and adds them to the current test's reaches at its teardown, before mutmut files them (``tryfirst``). A
shared page holds a counter the parent bumps after each test, so a long-lived child reports a function again for
the next test that makes it reach it.
"""
from __future__ import annotations

import mmap
import os
import struct
import tempfile

import pytest

_STATS = "stats"
_forward: dict = {}  # main_pid, path, epoch (the shared page); set in the stats run only


def _epoch() -> int:
    return struct.unpack_from("<Q", _forward["epoch"])[0]


def _forwarding(record):
    seen: set[str] = set()
    key = [None]  # (pid, epoch) the names in ``seen`` were reported for

    def forwarding_record(name, caller=None):
        record(name, caller=caller)
        pid = os.getpid()
        if pid == _forward["main_pid"]:
            return
        if key[0] != (pid, _epoch()):
            seen.clear()
            key[0] = (pid, _epoch())
        if name in seen:
            return
        seen.add(name)
        # Opened per name (rare: once per name, child and test): the parent renames the file to read it.
        fd = os.open(_forward["path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (name + "\n").encode())
        finally:
            os.close(fd)

    forwarding_record.forwards = True
    return forwarding_record


def pytest_configure(config):
    if os.environ.get("MUTANT_UNDER_TEST") != _STATS or _forward:
        return
    try:
        from mutmut.mutation import trampoline
    except ImportError:
        return
    fd, path = tempfile.mkstemp(prefix="mutmut-hits-")
    os.close(fd)
    os.unlink(path)
    _forward.update(main_pid=os.getpid(), path=path, epoch=mmap.mmap(-1, 8))
    if not getattr(trampoline.record_trampoline_hit, "forwards", False):
        trampoline.record_trampoline_hit = _forwarding(trampoline.record_trampoline_hit)


def _collect() -> set[str]:
    reading = _forward["path"] + ".reading"
    try:
        os.rename(_forward["path"], reading)
    except FileNotFoundError:
        names = set()
    else:
        with open(reading, encoding="utf-8") as f:
            names = set(f.read().split())
        os.unlink(reading)
    struct.pack_into("<Q", _forward["epoch"], 0, _epoch() + 1)
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    if not _forward or os.getpid() != _forward["main_pid"]:
        return
    from mutmut.state import state

    state()._stats.update(_collect())


def pytest_unconfigure(config):
    if _forward and os.getpid() == _forward["main_pid"]:
        for path in (_forward["path"], _forward["path"] + ".reading"):
            if os.path.exists(path):
                os.unlink(path)
