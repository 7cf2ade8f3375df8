"""Long setups of the project's tests, started in the background as soon as the first test starts.

Three fixtures are most of ``pytest tests``' time: the reference's full conformance run (``reference_report``),
the FastDeploy gates' runs (``reports``: they mostly wait on the status machine's deadlines) and the kill
matrix (``mutant_runs``: every mutant through the fork server). Each is one job whose result many tests read.
Declared with ``@early.job("fixture")``, such a job starts in a thread once the session's first test starts
(``tests/conftest.py``; after the modules that judge the whole machine) if a selected test uses its fixture,
and those tests run last: the rest of the suite runs while the jobs work. Run alone (``pytest
tests/test_mutant_zoo.py -k reference``), a job starts the same way; a fixture whose job did not start (a test
selected by hand after a plugin changed the selection) runs it there and then.

A job's processes get the environment as it was when the jobs started (never a variable a test set for a
moment) and run in their own process group, which is killed when the session ends (Ctrl-C included).

The jobs' processes together never ask for more than ``CORES`` cores: each process a job starts takes the cores
it says it uses (a whole-suite run under ``-n 2``, the kill matrix's workers: two) from a pool of ``CORES`` first,
in the order they asked, and gives them back when it ends. The foreground keeps its own core. Started all at once,
nine whole-suite runs beside the kill matrix gave each a tenth of a core, and the cases' few-second deadlines (a
peer's answer, a follower's broadcast, a held file) broke, differently in every run: a verdict of the suite must
not depend on how many other suites the project's tests run beside it.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import threading
from typing import Callable

# fixture name -> the job computing its value, in the order the jobs start (and their tests run)
JOBS: dict[str, Callable] = {}
_PREPARE: dict[str, Callable] = {}
_LAST: set[str] = set()  # jobs that start once every other job is done
_futures: dict[str, concurrent.futures.Future] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_env: dict[str, str] | None = None
_running: set[subprocess.Popen] = set()
_lock = threading.Lock()
_stopping = threading.Event()

READER_TIMEOUT_S = 3600  # a test reading a job's result: the wait for the job and the jobs queued before it
CORES = 2  # the machine's (2 cores, 24 GiB): what the jobs' processes use at once, all of them together


class Cores:
    """``with pool.take(n):`` holds ``n`` of the pool's cores (at most all of them) until the block ends; callers
    are served in the order they asked, so a run that needs two is never passed over by later runs needing one."""

    def __init__(self, size: int):
        self.size, self.free = size, size
        self._turn = threading.Condition()
        self._queue: list[object] = []

    def take(self, n: int):
        if n <= 0:  # a process of the foreground's (the jobs' own tests): the pool is the jobs'
            return contextlib.nullcontext(0)
        n = min(n, self.size)
        ticket = object()

        @contextlib.contextmanager
        def held():
            with self._turn:
                self._queue.append(ticket)
                try:
                    self._turn.wait_for(lambda: self._queue[0] is ticket and self.free >= n)
                finally:
                    self._queue.remove(ticket)
                    self._turn.notify_all()
                self.free -= n
            try:
                yield n
            finally:
                with self._turn:
                    self.free += n
                    self._turn.notify_all()

        return held()


_cores = Cores(CORES)


def job(fixture: str, prepare: Callable | None = None, after_the_others: bool = False):
    """Declare ``fn(tmp_path_factory)`` as the job behind ``fixture`` (the fixture calls ``result``). ``prepare()``,
    if given, runs before any job starts, on a machine not yet loaded by them (a probe that the jobs would slow
    down a hundredfold: the zoo's network namespaces took 60 s beside them). ``after_the_others``: the job starts
    once every other job of the session is done (a job of deadlines, which the others' load would break, that
    mostly waits: it overlaps the foreground's last tests instead of adding to them)."""

    def register(fn):
        JOBS[fixture] = fn
        if prepare is not None:
            _PREPARE[fixture] = prepare
        if after_the_others:
            _LAST.add(fixture)
        return fn

    return register


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def reorder(items) -> None:
    """Reorder ``items`` in place: first the modules that judge the whole machine (``RUNS_BEFORE_THE_JOBS = True``:
    every process and /dev/shm segment, where a job's would be counted as theirs; cold reads from the disk, which
    the jobs fill with writes), then the rest, then the tests that read a job's result, grouped by job in the order
    the jobs start, and last the modules whose deadlines need a machine the jobs no longer load
    (``RUNS_AFTER_THE_JOBS = True``: ranks that must join within seconds, trainers that must unwind within
    theirs), those of them that read a job's result after the rest. No verdict depends on the order: each test
    reads the same results, and leaves the environment as it found it."""
    order = list(JOBS)

    def rank(item):
        module = getattr(item, "module", None)
        if getattr(module, "RUNS_BEFORE_THE_JOBS", False):
            return -1
        used = [i for i, name in enumerate(order) if _uses(item, name)]
        if getattr(module, "RUNS_AFTER_THE_JOBS", False):
            return len(order) + (2 if used else 1)  # a reader of a job started after the others: last of all
        return min(used) + 1 if used else 0

    items.sort(key=rank)


def start(items, tmp_path_factory) -> None:
    """Start every job whose fixture a selected test uses (once per session)."""
    global _pool, _env
    if _pool is not None:
        return
    _env = dict(os.environ)
    tmp_path_factory.getbasetemp()  # made once, here: the jobs' threads call mktemp at once, and its first call makes it
    wanted = [name for name in JOBS if any(_uses(item, name) for item in items)]
    for name in wanted:
        if name in _PREPARE:
            _PREPARE[name]()
    _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(wanted)), thread_name_prefix="early")
    for name in wanted:
        if name not in _LAST:
            _futures[name] = _pool.submit(JOBS[name], tmp_path_factory)
    others = list(_futures.values())
    for name in wanted:
        if name in _LAST:
            _futures[name] = _pool.submit(_after, others, JOBS[name], tmp_path_factory)


def _after(others, fn, tmp_path_factory):
    concurrent.futures.wait(others)  # their results (or errors) are their readers' to judge
    if _stopping.is_set():  # an interrupted session: the others were killed, and this one never starts
        raise RuntimeError("the session ended before this job started")
    return fn(tmp_path_factory)


def result(fixture: str, tmp_path_factory):
    """The job's value: from the background when it started there, else computed now."""
    future = _futures.get(fixture)
    return future.result() if future is not None else JOBS[fixture](tmp_path_factory)


def environment() -> dict[str, str]:
    """The environment for a job's processes: os.environ as it was when the jobs started."""
    return dict(_env if _env is not None else os.environ)


# A job's processes run at this priority (nice). The pool above bounds what they take (two cores); at a lower
# priority than the foreground's they got a tenth of a core whenever two foreground processes ran (a history run's
# two versions, a gate's rerun), and the whole-suite runs' few-second deadlines broke there. The foreground and the
# jobs share the machine as equals.
NICE = 0


def run(cmd: list[str], cwd: str, timeout: float, nice: int = NICE, env: dict | None = None,
        cores: int = 1) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a job: the jobs' environment (or ``env``) and
    priority (``nice``), its own process group (killed whole when it runs past ``timeout``, then TimeoutExpired, or
    when the session ends), started once ``cores`` of the jobs' cores are free (``timeout`` counts from then; ``0``:
    a foreground test's process, which takes none)."""
    with _cores.take(cores):
        return _run(cmd, cwd, timeout, nice, env)


def _run(cmd, cwd, timeout, nice, env) -> subprocess.CompletedProcess:
    if _stopping.is_set():
        raise RuntimeError("the session ended before this job's process started")
    proc = subprocess.Popen(["nice", "-n", str(nice), *cmd], cwd=cwd, env=environment() if env is None else env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    with _lock:
        _running.add(proc)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        with _lock:
            _running.discard(proc)


def run_pytest(args: list[str], cwd: str, timeout: float, cores: int = 1) -> subprocess.CompletedProcess:
    """``python -m pytest *args`` for a job, as ``run`` runs a command, forked from the project's pytest server
    (tests/pytest_server.py: no interpreter start-up, no import, no collection of its own)."""
    with _cores.take(cores):
        if _stopping.is_set():
            raise RuntimeError("the session ended before this job's run started")
        return _run_pytest(args, cwd, timeout)


def _run_pytest(args, cwd, timeout) -> subprocess.CompletedProcess:
    from tests import pytest_server

    handles = []

    def started(handle):
        handles.append(handle)
        with _lock:
            _running.add(handle)

    try:
        return pytest_server.run(args, cwd, timeout, env=environment(), nice=NICE, started=started)
    finally:
        with _lock:
            _running.difference_update(handles)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop() -> None:
    """At the session's end: kill what still runs (an interrupted session), then let the threads end."""
    global _pool
    _stopping.set()
    with _lock:
        for proc in list(_running):
            _kill(proc)
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
    _pool = None
    _futures.clear()
    _stopping.clear()
