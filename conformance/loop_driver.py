"""A worker's event loop in a forked child, driven step by step from the test process.

The child calls ``session.worker_iteration(run_model, block=..., sync=...)`` over and over. Two of its
moments are hooks that report to the parent and, while the driver is *locked*, wait for its word:

* ``sync``: the loop's broadcast of the value it read (in a real job, a collective that takes time: the
  window in which FastDeploy #5493 lost an UPDATING); the child returns the value it was given, as
  rank 0 of one rank would;
* ``run``: the model is run (reported with the value the iteration synced and whether every
  parameter was loaded).

After each iteration the child reports ``end`` with what the iteration returned. While locked, the
parent may write the cell before it answers, so a seeded schedule decides exactly where the API's
writes fall between the worker's steps; the interleaving is reproducible from the seed. *Free*, the
child does not wait (the API side runs against a live loop); a slow iteration is then bounded only by
the parent's deadlines. The child reports its parameters' digests, status and version when stopped.

No pickle crosses the pipes: events are fixed-size structs, the final report JSON.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import struct
import time
import traceback

from . import harness, thread_state

EVENT = struct.Struct("=ci?")  # kind, value, flag
KINDS = {b"s": "sync", b"r": "run", b"e": "end", b"x": "error"}
END_RESULTS = ("ran", "updated", "cleared", "idle")
GO, FREE, STOP = b"g", b"f", b"s"


class DriverError(AssertionError):
    """The child broke the protocol, died, or stayed silent past a deadline."""


class _Stop(BaseException):
    pass


def digests(observed) -> dict[str, str | None]:
    return {n: (None if o.data is None else hashlib.sha256(o.data).hexdigest()) for n, o in observed.items()}


class LoopChild:
    """``with LoopChild(session, block=...) as loop:``; the parent must not use ``session`` itself
    while the child runs (the child owns the forked copy)."""

    def __init__(self, session, *, block: bool, pace_s: float = 0.0005):
        self.session = session
        self.block = block
        self.pace_s = pace_s
        self.events: list[tuple[str, int, bool]] = []
        self.report: dict | None = None
        self.pid = None
        self.locked = True

    # -- child ---------------------------------------------------------------------------------------
    def _child(self, ev_w: int, ctl_r: int, rep_w: int) -> None:
        locked = [True]
        synced = [None]

        def send(kind: bytes, value: int = 0, flag: bool = False) -> None:
            os.write(ev_w, EVENT.pack(kind, value, flag))
            if locked[0]:
                word = os.read(ctl_r, 1)
            else:
                ready, _, _ = select.select([ctl_r], [], [], 0)
                word = os.read(ctl_r, 1) if ready else GO
            if word == STOP or word == b"":
                raise _Stop()
            if word == FREE:
                locked[0] = False
            elif word == b"l":
                locked[0] = True

        def sync(value: int) -> int:
            synced[0] = value
            send(b"s", value)
            return value

        def run_model() -> None:
            observed = self.session.observe()
            loaded = all(o.data is not None for o in observed.values())
            send(b"r", -99 if synced[0] is None else synced[0], loaded)

        report: dict = {}
        try:
            while True:
                synced[0] = None
                result = self.session.worker_iteration(run_model, block=self.block, sync=sync)
                send(b"e", END_RESULTS.index(result) if result in END_RESULTS else -1)
                if not locked[0] and self.pace_s:
                    time.sleep(self.pace_s)
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            report["error"] = f"{type(e).__name__}: {e}"
            report["traceback"] = traceback.format_exc()
            try:
                os.write(ev_w, EVENT.pack(b"x", 0, False))
            except OSError:
                pass
        try:
            report.update(status=self.session.status(), digests=digests(self.session.observe()),
                          version=self.session.version() if hasattr(self.session, "version") else None)
        except BaseException as e:  # noqa: BLE001
            report.setdefault("error", f"after the loop: {type(e).__name__}: {e}")
        report["adapter_calls"] = harness.adapter_calls()
        data = json.dumps(report).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(rep_w, view):]

    # -- parent --------------------------------------------------------------------------------------
    def __enter__(self) -> "LoopChild":
        # A thread that has just ended (the prologue's iterations) may still be leaving the kernel, freeing
        # Paddle's thread-local state under Paddle's locks: a fork then copies a lock held, and the child
        # hangs at its first allocation (1 run in 4 of STATUS-BLOCK-WAITS on a loaded machine).
        thread_state.others_asleep()
        ev_r, ev_w = os.pipe()
        ctl_r, ctl_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for fd in (ev_r, ctl_w, rep_r):
                    os.close(fd)
                self._child(ev_w, ctl_r, rep_w)
            except BaseException:  # noqa: BLE001
                code = 70
            finally:
                os._exit(code)
        for fd in (ev_w, ctl_r, rep_w):
            os.close(fd)
        self.pid, self._ev, self._ctl, self._rep = pid, ev_r, ctl_w, rep_r
        self._buffer = b""
        return self

    def next_event(self, timeout_s: float) -> tuple[str, int, bool] | None:
        """The child's next event, or None if none came within ``timeout_s`` (0: one that has come already)."""
        deadline = time.monotonic() + timeout_s
        while len(self._buffer) < EVENT.size:
            # At least one look, so that timeout_s=0 polls (an event already sent is taken, none waited for).
            ready, _, _ = select.select([self._ev], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self._ev, 4096)
            if not chunk:
                raise DriverError(f"the worker loop child died (events so far: {self.events[-12:]})")
            self._buffer += chunk
        raw, self._buffer = self._buffer[: EVENT.size], self._buffer[EVENT.size :]
        kind, value, flag = EVENT.unpack(raw)
        event = (KINDS.get(kind, "?"), value, flag)
        self.events.append(event)
        if event[0] == "error":
            self.stop()
            raise DriverError(f"worker_iteration raised in the child: {self.report.get('error')}\n"
                              f"{self.report.get('traceback', '')}")
        return event

    def answer(self, word: bytes = GO) -> None:
        os.write(self._ctl, word)

    def free(self) -> None:
        """Let the child run without waiting (it was waiting at its last event)."""
        self.answer(FREE)

    def stop(self, timeout_s: float = 10.0) -> dict:
        """Stop the child at its next hook and return its final report."""
        if self.report is not None:
            return self.report
        try:
            os.write(self._ctl, STOP * 4)
        except BrokenPipeError:
            pass
        chunks, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._rep, self._ev], [], [], deadline - time.monotonic())
            if self._ev in ready:
                if not os.read(self._ev, 65536):
                    self._ev_closed = True
            if self._rep in ready:
                chunk = os.read(self._rep, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        else:
            os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        for fd in (self._ev, self._ctl, self._rep):
            try:
                os.close(fd)
            except OSError:
                pass
        self.report = json.loads(b"".join(chunks)) if chunks else {"error": "the child left no report"}
        harness._calls["adapter"] += self.report.get("adapter_calls", 0)
        return self.report

    def __exit__(self, *exc) -> None:
        self.stop()


class LoopThread:
    """A worker's event loop in a thread of the test process (the session stays usable from the test, as the engine's
    other threads use it): ``session.worker_iteration`` over and over until :meth:`finish`, each pass's result (or
    the exception it raised: the engine's loop goes on) appended to ``results``. ``sync`` is the loop's broadcast:
    ``on_sync(value)`` when set (the suite playing rank 0) returns the value rank 0 broadcast, or None for the value
    read; ``first_sync`` replaces it for the first
    pass only (a race placed at that pass's read, ``sys.setprofile`` installed there for one inside it). A loop that
    does not return (a blocking one) is never waited for past the test's own deadlines."""

    def __init__(self, session, *, block: bool = False, run_model=lambda: None, first_sync=None, pause_s: float = 0.001):
        import threading

        self.session, self.block, self.run_model, self.pause_s = session, block, run_model, pause_s
        self.first_sync = first_sync
        self.results: list = []
        self.on_sync = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="conformance-worker-loop", daemon=True)

    def _sync(self, value):
        hook = self.on_sync
        broadcast = hook(value) if hook is not None else None
        return value if broadcast is None else broadcast

    def _run(self) -> None:
        import sys

        first = True
        while not self.stop.is_set():
            sync = self.first_sync if first and self.first_sync is not None else self._sync
            first = False
            try:
                result = self.session.worker_iteration(self.run_model, block=self.block, sync=sync)
            except BaseException as e:  # noqa: BLE001 (judged by the test)
                result = e
            finally:
                sys.setprofile(None)
            self.results.append(result)
            time.sleep(self.pause_s)

    def start(self) -> "LoopThread":
        self.thread.start()
        return self

    def finish(self, timeout_s: float = 10.0) -> None:
        self.stop.set()
        self.thread.join(timeout_s)

    def until(self, predicate, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def ask(self, request, timeout_s: float, *, fail_fast: bool = True):
        """The API's ``request(timeout_s)`` (a bound ``control`` method) in a thread while the loop runs: (its answer,
        what the loop's passes returned or raised meanwhile). ``fail_fast``: a pass that raises ends the wait at once
        (the answer is then ``"no answer: the loop raised ..."``), so an implementation whose loop cannot serve the
        request costs no API timeout."""
        import threading

        box: dict = {}
        first = len(self.results)
        thread = threading.Thread(target=lambda: box.update(answer=request(timeout_s)), name="conformance-api", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s + 2.0
        while thread.is_alive() and time.monotonic() < deadline:
            raised = [r for r in self.results[first:] if isinstance(r, BaseException)]
            if fail_fast and raised:
                return f"no answer: the loop raised {type(raised[0]).__name__}: {raised[0]}", self.results[first:]
            thread.join(0.005)
        return box.get("answer", f"no answer within {timeout_s + 2:g}s"), self.results[first:]

    @staticmethod
    def acts(results) -> list:
        """What passes did, idle passes and model runs left out (an exception as ``raised Type: message``)."""
        return [r if isinstance(r, str) else f"raised {type(r).__name__}: {r}" for r in results if r not in ("ran", "idle")]
