"""Has the thread that runs a worker's loop looked at the status cell again? The kernel's view of that
thread (Linux ``/proc``), so that the suite's API side waits for the worker, never for a wall-clock delay.

Why: FastDeploy's loop, once its own clear has written CLEARED, spins ``while value != CLEARED: sleep(10 ms)``
(a follower spins there until rank 0's CLEARED). An UPDATING written before that spin has read the cell
once is never seen: the loop waits for CLEARED for ever. A real API writes UPDATING only after its own
poll (once a second) saw CLEARED and the trainer pushed the new weights, long after the worker looked.
The suite's schedules write it 0 to 100 ms after CLEARED, and on a loaded machine that could land before
the worker's next read: the verdict of every rule judged on such a cycle then depended on the scheduler
(FastDeploy #4402's version lost STATUS-BLOCK-WAITS in a full run and passed it alone). So before such a
write the API side waits until the worker has *looked again* (``looked_again``):

* the thread is seen *waiting*: blocked in a sleep, a poll, a select or a blocking read (the syscall it
  is in, ``/proc/PID/task/TID/syscall``; where that cannot be read, its wait channel, then its state);
  a thread blocked on a lock (the GIL: a futex) is not waiting, it is about to run;
* then seen waiting again after having blocked once more (its count of voluntary context switches went
  up): it woke from the first wait and went back to waiting, and between two waits a polling loop has
  evaluated its condition: it has read the cell since the moment the watch began.

A thread that never waits (a busy loop) counts as having looked once it has run ``busy_s`` of CPU time
since that moment; a thread that has ended has looked. Every wait is bounded (``timeout_s``): past it
``looked_again`` returns False and the caller goes on (the cycle is then judged as before).

``others_asleep`` is the same view before a fork (loop_driver.LoopChild): a thread that has ended in
Python may still be leaving the kernel, freeing Paddle's per-thread state under Paddle's locks, and a
child forked then inherits a lock nobody will release (it hung at its first allocation, 1 run in 4 of
STATUS-BLOCK-WAITS on a loaded machine, the reference's and FastDeploy's alike).
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass

# Syscalls in which a thread waits for time or for input, by machine (the numbers of the kernel's ABI).
_WAITS = {
    "x86_64": {0: "read", 7: "poll", 23: "select", 35: "nanosleep", 230: "clock_nanosleep", 232: "epoll_wait",
               270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 441: "epoll_pwait2"},
    "aarch64": {63: "read", 72: "pselect6", 73: "ppoll", 22: "epoll_pwait", 101: "nanosleep",
                115: "clock_nanosleep", 441: "epoll_pwait2"},
}
WAIT_SYSCALLS = _WAITS.get(platform.machine(), {})
# Wait channels of the same waits, where the syscall file cannot be read (a futex wait is none of them).
WAIT_CHANNELS = ("nanosleep", "poll", "select", "pipe_read", "pipe_wait", "wait_woken", "ep_poll")
BUSY_S = 0.5  # CPU time after which a thread that never waits has surely read the cell (a busy loop)
POLL_S = 0.001


@dataclass(frozen=True)
class Sample:
    waiting: bool
    switches: int  # voluntary context switches so far (each block on a wait or a lock)
    cpu_ns: int  # time on a CPU so far


def _libc():
    """libc's open, read and close called through ``ctypes.PyDLL``: the calls keep the GIL (module docstring of
    ``sample``); None where there is no such libc."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        libc.open.argtypes, libc.open.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_int
        libc.read.argtypes, libc.read.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_ssize_t
        libc.close.argtypes, libc.close.restype = [ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_CHUNK = 4096


def _read(path: str, keep_gil: bool = False) -> str | None:
    """The file's text, or None where it cannot be read. ``keep_gil``: read without letting go of the GIL (where
    libc can be called so; ``/proc`` files are made when read and never block): ``sample``'s reads. A thread of this
    process that wants the GIL meanwhile is seen blocked on it (a futex: not a wait of ``WAIT_SYSCALLS``, but a
    sleep to ``others_asleep``, whose reads let go of it)."""
    if _LIBC is None or not keep_gil:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return f.read()
        except OSError:
            return None
    fd = _LIBC.open(os.fsencode(path), os.O_RDONLY | os.O_CLOEXEC)
    if fd < 0:
        return None
    try:
        buf, chunks = ctypes.create_string_buffer(_CHUNK), []
        while True:
            n = _LIBC.read(fd, buf, _CHUNK)
            if n < 0:
                return None
            if n == 0:
                return b"".join(chunks).decode("ascii", errors="replace")
            chunks.append(buf.raw[:n])
    finally:
        _LIBC.close(fd)


def task_dir(pid: int, tid: int | None = None) -> str:
    """``/proc/PID/task/TID``: the thread ``tid`` of process ``pid`` (its main thread by default)."""
    return f"/proc/{pid}/task/{pid if tid is None else tid}"


def _waiting(folder: str) -> bool | None:
    syscall = _read(f"{folder}/syscall", keep_gil=True)
    if syscall is not None and WAIT_SYSCALLS:
        first = syscall.split(maxsplit=1)[0] if syscall.strip() else ""
        if first.lstrip("-").isdigit():
            return int(first) in WAIT_SYSCALLS
        return False  # "running"
    channel = (_read(f"{folder}/wchan", keep_gil=True) or "").strip()
    if channel and channel != "0":
        return any(name in channel for name in WAIT_CHANNELS)
    stat = _read(f"{folder}/stat", keep_gil=True)
    if stat is None:
        return None
    return stat.rpartition(")")[2].split()[0] == "S"  # the state after the command name


def _switches(status: str) -> int:
    return next((int(line.split()[1]) for line in status.splitlines()
                 if line.startswith("voluntary_ctxt_switches:")), 0)


def sample(folder: str) -> Sample | None:
    """The thread's state now, or None once it has ended. Its reads keep the GIL (``_read``): a read that let go
    of it waited for it again behind the process's busy threads, tens of milliseconds between two reads of the
    same thread's status on an idle machine with four of them, longer than a poller's 10 ms sleep, so that nearly
    every sample saw a new wait between its reads and was not one (``looked_again`` ran out of its 20 s)."""
    status = _read(f"{folder}/status", keep_gil=True)
    if status is None:
        return None
    waiting = _waiting(folder)
    again = _read(f"{folder}/status", keep_gil=True)
    if waiting is None or again is None:
        return None
    switches = _switches(status)
    if waiting and _switches(again) != switches:
        # The thread blocked again between the reads: the wait seen is not the one the count was read in (a
        # count from its lock wait before it read the cell, with the sleep after the read: one look counted
        # twice, seen on a loaded machine). Not a sample of one wait; the next one is.
        waiting = False
    schedstat = _read(f"{folder}/schedstat", keep_gil=True)
    if schedstat:
        cpu_ns = int(schedstat.split()[0])
    else:
        fields = (_read(f"{folder}/stat", keep_gil=True) or ")").rpartition(")")[2].split()
        ticks = int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0
        cpu_ns = ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return Sample(waiting, switches, cpu_ns)


def looked_again(pid: int, tid: int | None = None, *, times: int = 1, timeout_s: float = 5.0,
                 busy_s: float = BUSY_S, between=None) -> bool:
    """Wait until thread ``tid`` of process ``pid`` (its main thread by default) has gone from waiting back to
    waiting ``times`` times since this call (module docstring), has run ``busy_s`` of CPU time since this
    call, or has ended: True. False after ``timeout_s``. ``between()``, when given, is called at every
    sample (the driver answering the worker's hooks, so that a worker waiting at one can go on); a true
    result from it ends the wait at once (True: what the caller waited for came another way)."""
    folder = task_dir(pid, tid)
    deadline = time.monotonic() + timeout_s
    first_cpu = None
    last_wait = None  # the switch count at the last sample that found the thread waiting
    seen = 0
    while True:
        if between is not None and between():
            return True
        now = sample(folder)
        if now is None:
            return True
        if first_cpu is None:
            first_cpu = now.cpu_ns
        if now.waiting:
            if last_wait is not None and now.switches > last_wait:
                seen += 1
                if seen >= times:
                    return True
            last_wait = now.switches
        if now.cpu_ns - first_cpu >= busy_s * 1e9:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def _in_python_wait(ident: int | None) -> bool:
    """Whether the thread's innermost Python frame is a wait of ``threading`` (an Event, a Condition, a queue,
    a join): blocked on a lock the kernel shows only as a futex, as a thread waiting for the GIL is."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return frame is not None and frame.f_code.co_filename == threading.__file__ and \
        frame.f_code.co_name in ("wait", "_wait_for_tstate_lock", "join")


def blocked(thread: threading.Thread, timeout_s: float = 5.0, busy_s: float = BUSY_S) -> bool:
    """Wait until ``thread`` (of this process), a call the suite started, is blocked in a wait (a sleep, a poll,
    a read, or a wait of ``threading``), has ended, or has run ``busy_s`` of CPU time (a loop that never
    waits): True; False after ``timeout_s``. So a test checks that a call which must wait has not returned
    once the call is waiting, never a fixed delay after it started (a started thread may not have run yet
    on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    first_cpu = None
    while True:
        if not thread.is_alive():
            return True
        tid = thread.native_id
        now = sample(task_dir(os.getpid(), tid)) if tid is not None else None
        if now is not None:
            first_cpu = now.cpu_ns if first_cpu is None else first_cpu
            if now.waiting or _in_python_wait(thread.ident) or now.cpu_ns - first_cpu >= busy_s * 1e9:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def others_asleep(timeout_s: float = 5.0) -> bool:
    """Wait until every other thread of this process is asleep or gone (True), at most ``timeout_s`` (False).
    Before a fork: a thread that has ended in Python may still be running its exit in the kernel's view
    (thread-local destructors: Paddle frees its per-thread state there, under its allocator's lock), and
    a fork copies the locks held at that moment into a child that will never see them released."""
    me = threading.get_native_id()
    deadline = time.monotonic() + timeout_s
    while True:
        busy = []
        for name in os.listdir(f"/proc/{os.getpid()}/task"):
            if int(name) == me:
                continue
            stat = _read(f"/proc/{os.getpid()}/task/{name}/stat")
            if stat is not None and stat.rpartition(")")[2].split()[0] not in ("S", "I", "Z", "X", "T", "t"):
                busy.append(name)
        if not busy:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
