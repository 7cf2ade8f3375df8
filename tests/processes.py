"""Waiting for processes that are not this one's children (a CLI's trainers, a job's ranks).

A process that has exited stays a zombie until its parent reaps it; an orphan's parent is init, and this
machine's init (the VM's agent) reaps about 1.3 s late. ``psutil.wait_procs`` waits for the reaping, so every
check of "nothing left running" paid that second and more; these count the exit itself.
"""
from __future__ import annotations

import time

import psutil


def ended(proc: psutil.Process) -> bool:
    """Exited: gone, its pid taken by another process, or a zombie (exited, not yet reaped)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_ended(procs, timeout: float, interval: float = 0.02) -> tuple[list, list]:
    """``psutil.wait_procs(procs, timeout)`` counting a zombie as ended: (ended, still running)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if not ended(p)]
        if not alive or time.monotonic() >= deadline:
            return [p for p in procs if p not in alive], alive
        time.sleep(interval)
