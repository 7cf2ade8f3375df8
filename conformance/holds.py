"""Holding an implementation's clear or update at a chosen point, from outside it (SPEC.md LIFE-CONCURRENT).

A rule about what happens *while* an operation runs needs the operation to stay running until the test has
done what it must (call the session from another thread, look at it), on an idle machine or a loaded one.
Nothing here touches the implementation: each hold is in an input the suite hands it, at a point every
correct loader passes through.

* :class:`EventHold`: the trainer or the model's own loader stops and waits (``fixtures.buckets.Publisher``
  before bucket k, ``sim.stream_trainer.Stream`` before item k, ``fixtures.streams.ModelLoader`` at item k):
  each exposes a ``holding`` and a ``release`` event.
* :class:`LeaseHold`: a snapshot file (or an ipc meta file) under a write lease (``fcntl F_SETLEASE``) held by
  a small process of its own: the loader's ``open()`` of it blocks in the kernel until the lease is let go.
  The test process tells the holder every 0.1 s that it still runs; a loader that keeps the interpreter lock
  while its ``open()`` blocks stops every thread of the test process, the holder hears nothing for
  ``grace_s`` and lets go by itself, and the hold says so (``lost``) instead of hanging the run.
* :class:`CallHold`: a callable the suite hands the loader (``options["recapture"]``, capability
  ``model.recapture``: called after the last parameter moved and before NORMAL; a stale-state hook,
  capability ``model.hooks``: called after the commit, before ``update()`` returns) that blocks once armed.
* :class:`DrainHold`: a forward pass in flight through ``session.serve`` (capability ``serve``): a clear, or an
  update in place, begins and then waits for it (drained, SERVE-NO-MIXED-VERSIONS).

Every wait is bounded; a hold that is never let go lets go on its own (``HOLD_MAX_S``), so a case that failed
half-way leaves no operation held for ever.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

HOLD_MAX_S = 60.0  # the longest any hold keeps an operation, let go or not

_LEASE_HOLDER = r'''
import fcntl, os, select, signal, sys, time
path, grace, longest = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
broken = []
signal.signal(signal.SIGIO, lambda *a: broken.append(1))  # the kernel's word: someone opens the file
try:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
except OSError as e:
    print(f"error {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
print("leased", flush=True)
end, heard, told, why = time.monotonic() + longest, time.monotonic(), False, "released"
while True:
    if select.select([sys.stdin], [], [], 0.002)[0]:
        line = sys.stdin.readline()
        if line != "alive\n":
            break  # "release", or the test process is gone
        heard = time.monotonic()
    if broken and not told:
        print("broken", flush=True)
        told = True
    now = time.monotonic()
    if told and now - heard > grace:
        why = "lost"  # the test process has not run for grace_s since the loader reached the lease
        break
    if now > end:
        break
print(why, flush=True)  # before the lease goes: a loader that held the interpreter lock finds the word there
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
os.close(fd)
'''


class HoldError(Exception):
    """A hold could not be put in place (the file is open elsewhere, the filesystem has no leases)."""


class Hold:
    """``where``: the point, in words. ``reached(timeout_s)``: whether the operation is stopped there now.
    ``release()``: let it go on (idempotent). ``close()``: let go and free what the hold holds."""

    where = ""

    def reached(self, timeout_s: float) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.release()


class EventHold(Hold):
    """A trainer or loader of the suite's that stops with ``holding`` set until ``release`` is set."""

    def __init__(self, holding: threading.Event, release: threading.Event, where: str):
        self.holding, self._release, self.where = holding, release, where

    def reached(self, timeout_s: float) -> bool:
        return self.holding.wait(timeout_s)

    def release(self) -> None:
        self._release.set()


class LeaseHold(Hold):
    """A write lease on ``path``, held by a process of its own: the first ``open()`` of the file by anyone
    blocks until :meth:`release` (or ``HOLD_MAX_S`` in all). Needs the file's owner and no other descriptor of
    the file open (:class:`HoldError` otherwise). ``lost``: the holder heard nothing from this process for
    ``grace_s`` once the loader reached the lease, and let go (the loader held the interpreter lock while
    blocked: no thread of this process ran)."""

    def __init__(self, path: str, where: str, grace_s: float = 3.0):
        self.path, self.where, self.grace_s = path, where, grace_s
        self.lost = False
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LEASE_HOLDER, path, str(grace_s),
                                       str(HOLD_MAX_S)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = b""
        self._stop = threading.Event()
        first = self._line(10.0)
        if first != "leased":
            self.close()
            raise HoldError(f"no write lease on {path}: {first or 'the holder said nothing within 10 s'} (a lease "
                            "needs the file's owner and no other descriptor of the file open)")
        self._alive = threading.Thread(target=self._keep_alive, name="conformance-lease-alive", daemon=True)
        self._alive.start()

    def _keep_alive(self) -> None:
        while not self._stop.wait(0.1):
            if not self._tell(b"alive\n"):
                return

    def _tell(self, line: bytes) -> bool:
        if self._proc.poll() is not None:
            return False
        try:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def _line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            if not select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))[0]:
                return ""
            chunk = os.read(fd, 4096)
            if not chunk:
                return ""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def reached(self, timeout_s: float) -> bool:
        if self._line(timeout_s) != "broken":
            return False
        self.lost = self._line(0.0) == "lost"  # already let go: this process did not run meanwhile
        return True

    def let_go(self) -> bool:
        """Whether the holder has let go by itself since :meth:`reached` (this process silent for ``grace_s``)."""
        self.lost = self.lost or self._line(0.0) == "lost"
        return self.lost

    def openers_reach(self, count: int, timeout_s: float) -> int | None:
        """Poll :meth:`blocked_openers` until it reaches ``count`` or ``timeout_s`` passes; the most seen (a
        thread entering the wait shows no wait channel for a moment)."""
        deadline, most = time.monotonic() + timeout_s, None
        while True:
            now = self.blocked_openers()
            most = now if most is None or (now is not None and now > most) else most
            if most is None or most >= count or time.monotonic() > deadline:
                return most
            time.sleep(0.002)

    @staticmethod
    def blocked_openers() -> int | None:
        """How many threads of this process wait in an ``open()`` for a lease to break (their kernel wait
        channel, ``/proc/self/task/*/wchan``: ``__break_lease``); None where the kernel shows no wait channels.
        A second call that blocks here too is reading the files the held operation reads: it runs beside it."""
        count, named = 0, False
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/wchan", encoding="ascii") as f:
                    wchan = f.read().strip()
            except OSError:
                continue
            named = named or wchan not in ("", "0")
            count += "lease" in wchan
        return count if named else None

    def release(self) -> None:
        self._stop.set()
        self._tell(b"release\n")

    def close(self) -> None:
        self.release()
        try:
            self._proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class CallHold(Hold):
    """A callable handed to the loader (a recapture callable, a stale-state hook): a no-op until :meth:`arm`,
    then its next call stops until :meth:`release`. ``calls`` counts every call."""

    def __init__(self, where: str):
        self.where = where
        self.holding, self._release = threading.Event(), threading.Event()
        self._armed = False
        self.calls = 0

    def arm(self) -> None:
        self.holding.clear()
        self._release.clear()
        self._armed = True

    def __call__(self, *args, **kwargs) -> None:
        self.calls += 1
        if not self._armed:
            return
        self._armed = False
        self.holding.set()
        self._release.wait(HOLD_MAX_S)

    def reached(self, timeout_s: float) -> bool:
        return self.holding.wait(timeout_s)

    def release(self) -> None:
        self._armed = False
        self._release.set()


class DrainHold(Hold):
    """A forward pass in flight (``session.serve(fn)`` on a thread of its own, ``fn`` waiting to be let go):
    a clear or an in-place update that begins must wait for it. :meth:`start` puts the pass in flight;
    :meth:`reached` says whether ``op`` (a :class:`conformance.harness.Call`) has begun and is waiting: it has
    not returned, and ``status()`` has left NORMAL (or ``settle_s`` passed with the operation still running)."""

    def __init__(self, session, where: str, settle_s: float = 0.2):
        self.session, self.where, self.settle_s = session, where, settle_s
        self.inside, self._release = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.op = None
        self._thread = threading.Thread(target=self._serve, name="conformance-drain-hold", daemon=True)

    def _pass(self):
        self.inside.set()
        self._release.wait(HOLD_MAX_S)

    def _serve(self):
        try:
            self.session.serve(self._pass)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e

    def start(self, timeout_s: float) -> bool:
        """Put the pass in flight; whether it runs (it must: nothing is changing)."""
        self._thread.start()
        return self.inside.wait(timeout_s)

    def reached(self, timeout_s: float) -> bool:
        from . import thread_state
        from .harness import Call

        deadline = time.monotonic() + timeout_s
        if self.op is not None:  # its thread has begun and waits (a started thread may not have run yet, loaded)
            thread_state.blocked(self.op.thread, timeout_s)
        settled = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            if self.op is not None and self.op.done.is_set():
                return False  # it did not wait for the pass in flight
            asked = Call("status()", self.session.status)  # (bounded: a status() that waits is the test's to judge)
            if not asked.wait(max(0.0, deadline - time.monotonic())) or asked.result != "NORMAL":
                return True
            if time.monotonic() > settled:
                return True
            time.sleep(0.001)
        return False

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self.release()
        self._thread.join(HOLD_MAX_S)
