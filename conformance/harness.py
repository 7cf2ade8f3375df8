"""What a conformance test holds: the adapter, a worker identity, and sessions on fresh models."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .adapter import LoaderConfig

_calls = {"adapter": 0}


def reset() -> None:
    _calls["adapter"] = 0


def adapter_calls() -> int:
    return _calls["adapter"]


def credit(calls: int) -> None:
    """Count for the running case ``calls`` adapter calls that a batch run once for several cases (a module
    fixture, before any case's call began) made for the operation this case judges."""
    _calls["adapter"] += calls


class RecordedSession:
    """Forwards to the implementation's session and counts the calls (vacuity guard)."""

    def __init__(self, inner, models):
        self._inner = inner
        self.models = models  # keep the Paddle layers alive as long as the session

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            _calls["adapter"] += 1
            return attr(*args, **kwargs)

        return call


def set_worker_env(environ, rank: int, visible: str, selected: str) -> None:
    """Put a worker identity in ``environ`` and drop Paddle's cached parallel env so that
    ``paddle.distributed.get_rank()`` reads it afresh."""
    environ["PADDLE_TRAINER_ID"] = str(rank)
    environ["PADDLE_TRAINERS_NUM"] = str(max(rank + 1, int(environ.get("PADDLE_TRAINERS_NUM", "1"))))
    environ["CUDA_VISIBLE_DEVICES"] = visible
    environ["FLAGS_selected_gpus"] = selected
    from paddle.distributed import parallel

    parallel._global_parallel_env = None


@dataclass
class Worker:
    rank: int = 0
    visible: str = "0"
    selected: str = "0"

    @property
    def gpu_id(self) -> int:
        return int(self.visible.split(",")[int(self.selected)])


def _set_device(selected) -> None:
    """Make the worker's CUDA ordinal the device stand-in's current device, as an engine's
    ``set_device`` at worker start does; it then stays put when the environment changes."""
    from weightsync.wire import handles as ipc_handles

    try:
        ipc_handles.set_current_device(int(selected))
    except (TypeError, ValueError):  # an invalid selection is the test's subject, not a device
        ipc_handles.set_current_device(None)


def removes_case_dir(config, passed: bool) -> bool:
    """Whether a case's directory goes as the case ends, by pytest's ``tmp_path_retention_policy``: "all" (its
    default) keeps every one, "failed" removes those of the cases that passed, "none" removes every one."""
    policy = config.getini("tmp_path_retention_policy")
    return policy == "none" or (policy == "failed" and passed)


def open_session(adapter, model_spec, config: LoaderConfig, worker: Worker) -> RecordedSession:
    """A session of ``adapter`` on fresh models of ``model_spec``, opened as ``worker``: its identity put in this
    process's environment (Paddle's cached parallel env dropped), its CUDA ordinal the current device. The
    caller restores the environment (``Loader.open``) or owns the process (a forked rank, ``rank_group``)."""
    set_worker_env(os.environ, worker.rank, worker.visible, worker.selected)
    _set_device(worker.selected)
    from weightsync.fixtures.models import build_models

    # A spec that builds its own layers (fixtures.tiny_transformer: declarations, buffers, ties) does so.
    models = model_spec.build_models() if hasattr(model_spec, "build_models") else build_models(model_spec)
    _calls["adapter"] += 1
    return RecordedSession(adapter.open(models, config), models)


class Loader:
    """Opens sessions of the implementation under test on models built from a spec."""

    def __init__(self, adapter, tmp_path, monkeypatch):
        self.adapter = adapter
        self.model_dir = str(tmp_path / "model")
        self.shared_dir = str(tmp_path / "shared_ipc_meta")
        os.makedirs(self.model_dir, exist_ok=True)
        os.makedirs(self.shared_dir, exist_ok=True)
        self._monkeypatch = monkeypatch
        self._sessions: list[RecordedSession] = []
        # The legacy tp0{id} file is written in the format the loader's era reads (optional adapter
        # attribute ``snapshot_formats``, e.g. {"legacy": "paddle.save"}; default safetensors).
        from weightsync.fixtures import snapshot

        snapshot.set_legacy_format(dict(getattr(adapter, "snapshot_formats", None) or {}).get("legacy", "safetensors"))

    def open(self, model_spec, *, strategy="ipc_snapshot", worker: Worker | None = None, model_dir=None, options=None):
        worker = worker or Worker()
        for key in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus"):
            self._monkeypatch.setenv(key, os.environ.get(key, "0"))  # restored after the test
        config = LoaderConfig(strategy, model_dir or self.model_dir, self.shared_dir, dict(options or {}))
        session = open_session(self.adapter, model_spec, config, worker)
        self._sessions.append(session)
        return session

    def close_all(self) -> None:
        for s in self._sessions:
            close = getattr(s._inner, "close", None)
            if close:
                close()
        self._sessions.clear()
        _set_device(None)
        from paddle.distributed import parallel

        parallel._global_parallel_env = None


# -- observing a session from outside: status mid-update, a forked child ---------------------------
class StatusWatcher:
    """Polls ``session.status()`` from a background thread while the test drives the session (the
    adapter protocol requires ``status()`` to be callable from another thread during ``update()``).

        with harness.StatusWatcher(session) as watch:
            session.update()
        check.that("UPDATING" in watch.seen, ...)

    ``seen`` lists the distinct statuses in the order observed (consecutive repeats collapsed);
    ``errors`` holds what ``status()`` raised, if anything; ``polls`` counts the calls."""

    def __init__(self, session, interval_s: float = 0.0002):
        import threading

        self._session = session
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conformance-status-watcher", daemon=True)
        self.seen: list[str] = []
        self.errors: list[BaseException] = []
        self.polls = 0

    def _poll(self) -> None:
        try:
            status = self._session.status()
        except BaseException as e:  # noqa: BLE001 (reported to the test, never swallowed)
            if len(self.errors) < 5:
                self.errors.append(e)
            return
        finally:
            self.polls += 1
        if not self.seen or self.seen[-1] != status:
            self.seen.append(status)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self._interval)

    def __enter__(self) -> "StatusWatcher":
        self._poll()  # the status before the action, from this thread
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll()  # the status after the action
        return None


class ChildFailed(AssertionError):
    """The function run by ``in_child`` raised (its message and traceback are in this error's text;
    ``child_error`` is the child's ``Type: message`` alone, ``child_traceback`` its traceback)."""

    def __init__(self, message: str, child_error: str = "", child_traceback: str = ""):
        super().__init__(message)
        self.child_error, self.child_traceback = child_error, child_traceback


class ChildTimedOut(ChildFailed):
    """The child ran past its deadline and was killed; ``blocked_in`` says where each of its threads
    was waiting (the kernel's wait channel and system call), ``seconds`` how long it ran."""

    def __init__(self, message: str, seconds: float, blocked_in: str):
        super().__init__(message)
        self.seconds, self.blocked_in = seconds, blocked_in


# The system calls a blocked loader is found in, by number (/proc/PID/syscall), per architecture.
_SYSCALLS = {
    "x86_64": {0: "read", 2: "open", 7: "poll", 9: "mmap", 17: "pread64", 19: "readv", 23: "select", 35: "nanosleep",
               61: "wait4", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 257: "openat", 270: "pselect6",
               271: "ppoll", 281: "epoll_pwait", 295: "preadv", 327: "preadv2", 437: "openat2"},
    "aarch64": {22: "epoll_pwait", 56: "openat", 63: "read", 65: "readv", 67: "pread64", 69: "preadv", 72: "pselect6",
                73: "ppoll", 98: "futex", 101: "nanosleep", 115: "clock_nanosleep", 222: "mmap", 260: "wait4",
                286: "preadv2", 437: "openat2"},
}.get(os.uname().machine, {})
_SYSCALLS = {str(k): v for k, v in _SYSCALLS.items()}


def blocked_in(pid: int) -> str:
    """Where the threads of process ``pid`` wait, from ``/proc`` (no tracing): e.g. ``wait_for_partner
    in openat`` (a FIFO's open waiting for a writer), ``pipe_read in read``. Empty if unknown."""
    seen = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return ""
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan", encoding="ascii") as f:
                wchan = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/syscall", encoding="ascii") as f:
                fields = f.read().split()
        except OSError:
            continue
        call = _SYSCALLS.get(fields[0], f"system call {fields[0]}") if fields and fields[0].isdigit() else (fields[0] if fields else "?")
        where = f"{wchan or '?'} in {call}"
        if where not in seen and (wchan not in ("", "0") or call not in ("running", "?")):
            seen.append(where)
    return ", ".join(seen)


def _reap(pid: int, grace_s: float = 5.0):
    """Wait for a child that was sent SIGKILL, at most ``grace_s`` (a process in uninterruptible sleep
    dies only when it wakes): its wait status, or None if it is still there (left for init to reap)."""
    import time

    deadline = time.monotonic() + grace_s
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if done:
            return status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)


def in_child(fn, *args, timeout_s: float = 60.0, watch=None, watch_interval_s: float = 0.01, **kwargs):
    """Run ``fn(*args, **kwargs)`` in a forked child of the test process and return its result,
    which must be JSON-serializable (no pickle crosses the pipe). The child's adapter calls and
    checks count for the test (vacuity guard). If ``fn`` raises, the test fails with the child's
    error; a child that dies fails it too, and one that runs past ``timeout_s`` is killed and fails
    it with ``ChildTimedOut`` (saying where it was blocked). Fork, never spawn: the child shares the
    suite's imports and costs milliseconds. Memory rules run the update in a child so that the
    kernel's high-water mark (``peak_rss_kib``) is the child's own.

    This is how a case that can block *inside* the implementation is bounded from outside it: a
    loader blocked in native code that holds the GIL (opening a FIFO in Rust, a read that never
    returns) stops every thread of its process, and a signal handler never runs; the child is
    killed from here, and this process, waiting in ``select``, stays responsive to Ctrl-C (the
    child is killed on the way out). ``watch(pid)``, if given, is called every ``watch_interval_s``
    while the child runs (e.g. to see a FIFO opened by it)."""
    import json
    import select
    import signal
    import time
    import traceback

    from . import check

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(read_end)
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it (the parent kills it anyway)
            reset()
            check.reset()
            try:
                payload = {"ok": True, "value": fn(*args, **kwargs)}
            except BaseException as e:  # noqa: BLE001 (handed to the parent)
                payload = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            payload["adapter_calls"] = adapter_calls()
            payload["checks"] = check.count()
            try:
                data = json.dumps(payload).encode()
            except (TypeError, ValueError) as e:
                data = json.dumps({"ok": False, "error": f"in_child: result is not JSON-serializable ({e})",
                                   "traceback": "", "adapter_calls": adapter_calls(), "checks": check.count()}).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(write_end, view):]
        except BaseException:  # noqa: BLE001
            code = 70
        finally:
            os._exit(code)
    os.close(write_end)
    name = getattr(fn, "__name__", fn)
    started = time.monotonic()
    chunks, deadline, timed_out, where, wait_status = [], started + timeout_s, False, "", None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out, where = True, blocked_in(pid)
                break
            ready, _, _ = select.select([read_end], [], [], min(left, watch_interval_s) if watch else left)
            if watch:
                watch(pid)
            if not ready:
                continue
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        wait_status = os.waitpid(pid, 0)[1] if not timed_out else None
    finally:
        os.close(read_end)
        if wait_status is None:  # timed out, or this process was interrupted (Ctrl-C): never leave it running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_status = _reap(pid)
        from sim.leftovers import sweep_pid

        sweep_pid(pid)  # what the child created and could not unlink, killed (a trainer's segments, a cell)
    if timed_out:
        seconds = time.monotonic() - started
        raise ChildTimedOut(f"in_child({name}): the child ran past {timeout_s}s and was killed"
                            + (f" (blocked in {where})" if where else ""), seconds, where)
    if not chunks:
        raise ChildFailed(f"in_child({name}): the child died without a result "
                          f"(wait status {wait_status}, signal {os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None})")
    payload = json.loads(b"".join(chunks))
    _calls["adapter"] += payload.get("adapter_calls", 0)
    for _ in range(payload.get("checks", 0)):
        check._count()
    if not payload["ok"]:
        raise ChildFailed(f"in the forked child: {payload['error']}\n{payload['traceback']}", payload["error"],
                          payload["traceback"])
    return payload["value"]


def rss_mib(pid: int) -> int | None:
    """Process ``pid``'s resident set size now (``VmRSS``), in MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def peak_rss_kib() -> int:
    """This process's peak resident set size (``VmHWM`` in ``/proc/self/status``), in KiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmHWM line")


def rss_kib() -> int:
    """This process's current resident set size (``VmRSS``), in KiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmRSS line")


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark to the current RSS (``echo 5 > /proc/self/clear_refs``),
    so that a later ``peak_rss_kib()`` measures from here."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


class StillRunning(AssertionError):
    """A call run by ``concurrently`` had not returned by the deadline."""


def concurrently(calls: dict, bound_s: float = 30.0) -> dict:
    """Run each ``name -> fn()`` on its own thread at once (sessions waiting out timeouts together, so
    that the phases of a stall cost one timeout, not one each); returns ``name -> (exception or None,
    seconds)``. The threads are joined against one deadline of ``bound_s``: calls that never return cost
    that once, not once each; one still running then has ``StillRunning`` as its exception (its thread, a
    daemon, is left behind). The waits bounded this way (sockets, ZMQ) release the GIL."""
    import threading
    import time

    results: dict = {}

    def run(name, fn):
        started = time.monotonic()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            results[name] = (e, time.monotonic() - started)
        else:
            results[name] = (None, time.monotonic() - started)

    threads = [threading.Thread(target=run, args=item, name=f"conformance-{item[0]}", daemon=True) for item in calls.items()]
    for t in threads:
        t.start()
    started = time.monotonic()
    for t in threads:
        t.join(max(0.0, started + bound_s - time.monotonic()))
    out = dict(results)  # (a thread left behind that returns later changes nothing here)
    for name in calls:
        if name not in out:
            out[name] = (StillRunning(f"{name}: still running after {bound_s:g}s (left behind)"), time.monotonic() - started)
    return out


class Call:
    """``fn()`` on a thread of its own (``thread``), started at once (a second caller of a session, say): ``done``
    is set when it returned or raised, ``error`` holds what it raised (None: it returned), ``result`` what it
    returned, ``ended_at`` when (``time.monotonic()``). :meth:`wait` bounds the wait from outside; a call that never
    returns is left behind (a daemon thread) and the test fails naming it (``concurrently`` for many at once)."""

    def __init__(self, name: str, fn):
        import threading

        self.name, self.fn = name, fn
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"conformance-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import time

        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 (judged by the test)
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.done.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether it has returned (or raised) within ``timeout_s``."""
        return self.done.wait(max(0.0, timeout_s))

    def outcome(self) -> str:
        """In words, for messages: ``returned``, ``raised Type: message`` or ``still running``."""
        if not self.done.is_set():
            return "still running"
        return "returned" if self.error is None else f"raised {type(self.error).__name__}: {self.error}"
