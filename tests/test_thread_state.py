"""conformance.thread_state: whether a worker's thread has looked at the cell again since a moment, judged from
the kernel's view of the thread, never from a delay."""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from conformance import thread_state as T

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")


class Poller(threading.Thread):
    """A loop that polls a value as FastDeploy's does (read, then sleep ``poll_s`` while it is not the one
    it waits for), recording every value it read in order."""

    def __init__(self, poll_s: float, want: int = 99):
        super().__init__(daemon=True)
        self.value, self.want, self.poll_s, self.reads = 0, want, poll_s, []
        self.start()

    def run(self):
        while True:
            now = self.value
            self.reads.append(now)
            if now == self.want:
                return
            time.sleep(self.poll_s)


def _stop(poller: Poller) -> None:
    poller.value = poller.want
    poller.join(5)


@pytest.mark.parametrize("poll_s", [0.001, 0.01, 0.05])
@pytest.mark.parametrize("times", [1, 3])
def test_a_polling_thread_has_read_the_new_value_when_it_returns(poll_s, times):
    poller = Poller(poll_s)
    try:
        time.sleep(0.02)  # inside its loop
        for round_ in range(5):
            poller.value = round_ + 1
            assert T.looked_again(os.getpid(), poller.native_id, times=times, timeout_s=10.0)
            read = list(poller.reads)
            assert read.count(round_ + 1) >= times, (
                f"poll every {poll_s}s: returned before the loop had read {round_ + 1} {times} time(s): {read[-8:]}")
    finally:
        _stop(poller)


def test_under_cpu_load_it_waits_for_the_read_not_for_a_delay():
    """Four busy threads contend for the interpreter with the poller: whatever the delay before the
    poller runs again, the answer comes after its read."""
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            sum(range(2000))

    burners = [threading.Thread(target=burn, daemon=True) for _ in range(4)]
    for b in burners:
        b.start()
    poller = Poller(0.01)
    try:
        for round_ in range(10):
            poller.value = round_ + 1
            assert T.looked_again(os.getpid(), poller.native_id, timeout_s=20.0)
            assert round_ + 1 in poller.reads, f"round {round_}: {poller.reads[-5:]}"
    finally:
        stop.set()
        _stop(poller)
        for b in burners:
            b.join(5)


def test_a_thread_blocked_on_a_lock_has_not_looked():
    lock = threading.Lock()
    lock.acquire()
    blocked = threading.Thread(target=lock.acquire, daemon=True)
    blocked.start()
    try:
        time.sleep(0.05)
        started = time.monotonic()
        assert not T.looked_again(os.getpid(), blocked.native_id, timeout_s=0.3)
        assert time.monotonic() - started >= 0.3
    finally:
        lock.release()
        blocked.join(5)


@contextlib.contextmanager
def _spinning():
    """A thread that never waits (a busy loop), stopped on leaving."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    try:
        yield busy
    finally:
        stop.set()
        busy.join(5)


def test_a_busy_loop_counts_once_it_has_used_its_cpu_time():
    with _spinning() as busy:
        assert T.looked_again(os.getpid(), busy.native_id, timeout_s=30.0, busy_s=0.05)


def test_an_ended_thread_has_looked_and_between_can_end_the_wait():
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    assert T.looked_again(os.getpid(), done.native_id, timeout_s=0.1)
    sleeper = Poller(1.0)
    try:
        calls = []
        assert T.looked_again(os.getpid(), sleeper.native_id, timeout_s=5.0, between=lambda: calls.append(1) or True)
        assert calls == [1]
        assert not T.looked_again(os.getpid(), sleeper.native_id, timeout_s=0.2, between=lambda: False)
    finally:
        _stop(sleeper)


def test_a_forked_child_waiting_in_a_pipe_read_is_seen_waiting():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(w)
            os.read(r, 1)
        finally:
            os._exit(0)
    try:
        os.close(r)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = T.sample(T.task_dir(pid))
            if seen is not None and seen.waiting:
                break
            time.sleep(0.01)
        assert seen is not None and seen.waiting, seen
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


def test_before_a_fork_it_waits_for_a_busy_thread_and_not_for_a_sleeping_one():
    sleeper = Poller(0.05)
    stop = threading.Event()
    block = bytes(8 << 20)

    def spin():  # busy outside the GIL, as a native thread finishing its exit is: hashing releases it
        while not stop.is_set():
            hashlib.sha256(block).digest()

    try:
        assert T.others_asleep(timeout_s=10.0), "only threads asleep: no wait"
        busy = threading.Thread(target=spin, daemon=True)
        busy.start()
        started = time.monotonic()
        assert not T.others_asleep(timeout_s=0.3) and time.monotonic() - started >= 0.3
        threading.Timer(0.2, stop.set).start()
        assert T.others_asleep(timeout_s=10.0), "the busy thread ended: gone"
        busy.join(5)
    finally:
        stop.set()
        _stop(sleeper)


# -- blocked: a call the suite started is waiting ----------------------------------------------------------------
def test_blocked_sees_a_call_waiting_in_threading_in_a_sleep_or_gone_and_not_one_on_a_plain_lock():
    """``blocked`` is what a test waits for before it checks that a call which must wait has not returned: a
    thread in an Event's wait or a sleep is waiting, an ended one is done; a thread waiting for a plain lock (as one
    waiting for the interpreter lock before it ran at all) is not yet either, and the wait says so at its bound."""
    release = threading.Event()

    def sleeps():
        while not release.is_set():
            time.sleep(0.05)

    for target in (lambda: release.wait(300.0), sleeps):  # (each waits past the bound below: seen, never ended)
        waiter = threading.Thread(target=target, daemon=True)
        waiter.start()
        assert T.blocked(waiter, timeout_s=20.0), "a thread in a wait was not seen blocked"
        assert waiter.is_alive()
    release.set()
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    assert T.blocked(done, timeout_s=0.1)
    lock = threading.Lock()
    lock.acquire()
    on_lock = threading.Thread(target=lock.acquire, daemon=True)
    on_lock.start()
    try:
        started = time.monotonic()
        assert not T.blocked(on_lock, timeout_s=0.3), "a thread blocked on a plain lock was taken for a waiting call"
        assert time.monotonic() - started >= 0.3
    finally:
        lock.release()
        on_lock.join(5)


def test_blocked_counts_a_spinning_call_once_it_used_its_cpu_time():
    with _spinning() as busy:
        assert T.blocked(busy, timeout_s=30.0, busy_s=0.05)
        assert not T.blocked(busy, timeout_s=0.2, busy_s=1000.0)


def test_a_sample_whose_count_moved_between_its_reads_is_not_a_wait(monkeypatch):
    """A sample reads the thread's switch count and then what it waits in: if the thread left a lock wait, read
    the cell and went back to sleep between the two reads, the sleep seen does not go with the count read, and
    the next sample's count (one up, in the same sleep) would count that one look twice (seen on a loaded
    machine: ``looked_again(times=3)`` returned after two reads). So such a sample is no wait; a count that
    holds across the reads is."""
    nanosleep = next(n for n, name in T.WAIT_SYSCALLS.items() if name in ("nanosleep", "clock_nanosleep"))
    for counts, waiting in (((7, 8), False), ((8, 8), True)):
        statuses = iter(f"voluntary_ctxt_switches:\t{n}\n" for n in counts)
        files = {"syscall": f"{nanosleep} 0x0 0x0\n", "schedstat": "12345 0 0\n"}
        held = []

        def read(path, keep_gil=False):
            held.append(keep_gil)
            return next(statuses) if path.endswith("/status") else files[path.rsplit("/", 1)[1]]

        monkeypatch.setattr(T, "_read", read)
        got = T.sample("/proc/0/task/0")
        assert got is not None and got.waiting is waiting and got.switches == counts[0], (counts, got)
        assert held and all(held), f"a sample's reads must keep the GIL (test_a_read_that_keeps_the_gil...): {held}"


def test_a_read_that_keeps_the_gil_is_the_file_and_lets_no_thread_of_this_process_run(tmp_path):
    """``_read(keep_gil=True)`` gives the file's text as a plain read does (a file of several chunks included;
    None for one that is not there), and no other thread of this process runs while it reads: reading a FIFO
    whose writer (another process) comes 0.3 s later, a thread counting meanwhile counts a small fraction of what
    it counts while a plain read of the same waits."""
    assert T._LIBC is not None, "no libc to call with the GIL kept on this Linux"
    big = tmp_path / "big"
    big.write_text("".join(f"line {i}\n" for i in range(3 * T._CHUNK // 5)))
    for path in (str(big), "/proc/self/cmdline"):
        assert T._read(path, keep_gil=True) == T._read(path) is not None, path
    assert T._read(str(tmp_path / "absent"), keep_gil=True) is None

    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    counted, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    meanwhile = {}
    try:
        for keep_gil in (True, False):
            writer = subprocess.Popen([sys.executable, "-c",
                                       f"import time; time.sleep(0.3); open({fifo!r}, 'w').write('hello')"])
            before = counted[0]
            text = T._read(fifo, keep_gil=keep_gil)
            meanwhile[keep_gil] = counted[0] - before
            writer.wait(30)
            assert text == "hello", (keep_gil, text)
    finally:
        stop.set()
        counter.join(5)
    assert meanwhile[True] * 5 < meanwhile[False], f"counted while a read kept the GIL / let it go: {meanwhile}"
