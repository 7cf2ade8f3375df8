"""SIGINT and SIGTERM in the simulator: every exit clean, at any phase of a run.

The orchestrator (``python -m sim roundtrip``) turns the first of either signal into
:class:`Interrupted` in its main thread; ``Roundtrip``'s context manager then stops the trainers, sweeps
their shared-memory segments and removes its directory on the way out, and the CLI exits with
128 + the signal number (130, 143). Bookkeeping that must not be cut in half (spawning a trainer and
recording it, the cleanup itself) runs :func:`shielded`: a signal arriving there is raised when it ends.

Trainers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the orchestrator decides)
and unwind on SIGTERM. They are spawned with both signals blocked (:func:`blocked`: the mask survives
the exec), so none lands in their start-up, and unblock them once their handlers are set
(:func:`trainer_signals`), which also makes the kernel send them SIGTERM if the orchestrator dies.
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SLICE_S = 0.1  # the longest a main thread's wait goes without running Python's signal handlers
HOLD_S = 120.0  # a --hold-at pause ends by itself after this long
UNWIND_S = 5  # a trainer told to stop is ended by the kernel (SIGALRM) if it is still running this long after
PR_SET_PDEATHSIG = 1


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the orchestrator. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way out mistakes it for a failed update."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


_state = {"signum": None, "raised": False, "shield": 0}


def _handler(signum, frame) -> None:
    if _state["signum"] is not None:
        return  # one interruption per run; the cleanup it started is not interrupted again
    _state["signum"] = signum
    if _state["shield"] == 0:
        _raise()


def _raise() -> None:
    _state["raised"] = True
    raise Interrupted(_state["signum"])


def install() -> None:
    """Route SIGINT and SIGTERM to :class:`Interrupted` (again after importing Paddle, which installs
    a C handler of its own for SIGTERM that dumps a stack and kills the process)."""
    _state.update(signum=None, raised=False, shield=0)
    for s in SIGNALS:
        signal.signal(s, _handler)


def sliced(wait, timeout_s: float) -> bool:
    """``wait(seconds)`` (true when what it waits for has come), in waits of at most ``SLICE_S`` until
    ``timeout_s`` pass; what the last one returned. Every long wait of a main thread goes through here:
    the kernel gives a process's signal to any of its threads that does not block it (an update thread, a
    trainer's parent watcher; zmq's own threads block every signal), whose C handler only flags it; the
    main thread runs the Python handler when it next runs bytecode, which one wait of 60 s in C put off by
    up to 60 s (a CLI that waited out its worker's timeout after SIGTERM; a trainer that outlived its CLI's
    stop)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if wait(min(max(left, 0.0), SLICE_S)):
            return True
        if left <= SLICE_S:
            return False


def pending() -> bool:
    """A signal has been received in this run."""
    return _state["signum"] is not None


@contextlib.contextmanager
def shielded():
    """Defer an interruption until the block ends (it is raised then, once)."""
    _state["shield"] += 1
    try:
        yield
    finally:
        _state["shield"] -= 1
    if _state["shield"] == 0 and _state["signum"] is not None and not _state["raised"]:
        _raise()


@contextlib.contextmanager
def blocked():
    """Block SIGINT and SIGTERM in this thread: a process spawned here starts with them blocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# Looked up once, here: a launcher's preexec_fn calls die_with_parent in a child forked from a threaded
# process, where looking up a library (dlopen's lock) could deadlock.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(signum: int) -> None:
    """The kernel sends this process ``signum`` when its parent dies (Linux; elsewhere nothing), whatever
    Python is doing then. Cleared in a forked child: each process arms its own."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)


def trainer_signals(on_sigterm, parent_pid: int) -> None:
    """In a trainer: ignore SIGINT, run ``on_sigterm`` on SIGTERM (once: a second SIGTERM must not interrupt the
    first one's unwinding), get SIGTERM when the orchestrator dies, then unblock both (a SIGTERM that arrived
    during start-up is delivered now). SIGUSR1 dumps every thread's stack to stderr (how a test shows where a
    trainer that outlived its orchestrator was)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the stop's deadline: terminates, whatever Python is doing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    install_sigterm(on_sigterm)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the orchestrator died before the death signal was armed: nothing is
        os._exit(143)                # created yet, and no exit handler of the forked parent's may run here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    # The death signal alone is not enough: trainers of a SIGKILLed orchestrator were seen alive, re-parented,
    # SIGTERM caught and none pending. A watcher sends the SIGTERM itself when the parent is gone and no
    # SIGTERM came within a second. Neither the handler nor the watcher can end a process whose unwinding
    # hangs where no Python code runs (interpreter finalization stops daemon threads), so each arms a kernel
    # timer first: SIGALRM, left at its default action, ends the process UNWIND_S later.
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


_sigterm_seen = threading.Event()


def install_sigterm(on_sigterm) -> None:
    """SIGTERM runs ``on_sigterm`` the first time only (again after a library replaced the handler)."""
    def handler(signum, frame):
        if _sigterm_seen.is_set():
            return
        _sigterm_seen.set()
        _deadline()
        on_sigterm(signum, frame)

    signal.signal(signal.SIGTERM, handler)


def _deadline(seconds: int = UNWIND_S) -> None:
    """End this process ``seconds`` from now unless it exits first (an earlier deadline is kept)."""
    left = signal.alarm(seconds)
    if left and left < seconds:
        signal.alarm(left)


def _watch_parent(parent_pid: int, interval_s: float = 0.2, wait_s: float = 1.0, grace_s: float = 5.0) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    _deadline(int(wait_s + grace_s) + 1)
    # Released now, not only before the forced exit: nobody can use them once the orchestrator is gone, and a
    # loaded machine once let the deadline end a trainer before its grace was over (its segments left behind).
    for release in _before_forced_exit:
        release()
    if not _sigterm_seen.wait(wait_s):
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer's own handler: unlink what it made, then leave
    time.sleep(grace_s)
    for last in _before_forced_exit:  # the main thread never finished unwinding (it may not even have begun)
        last()
    os._exit(143)


_before_forced_exit: list = []


def before_forced_exit(fn) -> None:
    """Run ``fn`` (from the parent watcher's thread) as soon as the orchestrator is gone, and again before it
    ends a trainer whose unwinding did not end (``fn`` must be idempotent)."""
    _before_forced_exit.append(fn)


def hold(phase: str, who: str) -> None:
    """Pause at ``phase`` (``--hold-at``), saying so on stderr, until a signal ends it or HOLD_S pass:
    how the tests put a signal at an exact phase of a run."""
    print(f"holding at {phase} ({who}, pid {os.getpid()})", file=sys.stderr, flush=True)
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


def exit_process(code: int) -> None:
    """Exit with ``code``. After an interruption an update thread may still wait on a trainer that is
    gone (its timeout is the worker's, seconds away); everything outside this process is released by
    then, so do not wait for it: flush and leave."""
    sys.stdout.flush()
    sys.stderr.flush()
    waiting = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if waiting:
        os._exit(code)
    sys.exit(code)
