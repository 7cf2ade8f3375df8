"""A fork server for the pytest runs the project's tests start: import once, fork per run.

A cold ``python -m pytest conformance ...`` pays about 2 CPU-s before its first test (Paddle, pytest's
plugins, hypothesis, collecting and assertion-rewriting the suite), and ``pytest tests`` starts some sixty
such runs: the gates, the FastDeploy generations, the sandboxes. The server pays once, at the first run
(``tests/zoo_runner.py`` does the same for the kill matrix); each run is a forked child that is what the
subprocess would have been:

* its own session (a process group: a timeout kills it whole, its xdist workers and ranks included; its pid
  is reported once the group exists, so a kill right after never misses a run still leaving the server's),
  its priority (``nice``), working directory, environment, ``sys.argv`` and the ``sys.path`` Python would
  give ``python -m pytest`` there (the directory, then ``PYTHONPATH``);
* stdout and stderr are pipes the client made and passed over the socket (SCM_RIGHTS);
* SIGINT, SIGTERM and SIGCHLD at the interpreter's defaults (SIGINT ignored where the server inherited it
  ignored, as a subprocess would); at the end ``atexit`` runs, then the exit.

A run whose environment differs from the server's in what an import reads once (Paddle's ``FLAGS_``,
devices, threads, the interpreter's own variables) would not be that subprocess: it runs as one.

    proc = pytest_server.run(["conformance", "--impl=reference"], cwd=REPO, timeout=300)
    # subprocess.CompletedProcess, as subprocess.run([python, "-m", "pytest", ...], capture_output=True, text=True)

The server is ``python -m tests.pytest_server SOCKET``; it ends when its stdin closes (the session
ended, or died), killing what still runs. Messages are JSON, one per packet (SOCK_SEQPACKET): no pickle on any wire.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_S = 120  # the server's warm-up on a loaded machine (about 3 s idle)
# Read once, at import or interpreter start: a run whose environment changes one of these runs as a subprocess.
IMPORT_TIME = ("FLAGS_", "CUDA_", "PADDLE_", "OMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON", "CUSTOM_DEVICE", "XPU_",
               "MALLOC_", "GLIBC_", "HYPOTHESIS")


def _import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in ("PYTHONPATH",)}


# -- the server ----------------------------------------------------------------------------------------------
def _warm() -> None:
    """Import Paddle, collect the suite once, then freeze the heap (a child's collections skip it and do not
    copy its pages). The collection imports the pytest plugins (the suite's, hypothesis', xdist's) and the
    test modules through pytest's assertion rewriting, as a fresh run would: imported before it, a plugin
    would stay unrewritten, and each run would warn that it cannot rewrite it."""
    import paddle  # noqa: F401
    import pytest

    from tests.gc_frozen import freeze_heap
    from tests.zoo_runner import silenced

    with silenced():
        pytest.main(["conformance", "--collect-only", "-q", "-p", "no:cacheprovider", "--impl=reference"])

    freeze_heap()


# What `python -m pytest` started by the test process gets: Python's handler, or SIGINT ignored where the test
# process was started with it ignored (a background job of a shell): the server was exec'd as such a child is.
_SIGINT = signal.SIG_IGN if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else signal.default_int_handler


def _child(request: dict, fds: list[int], closing: list, grouped: int) -> None:
    code = 70
    try:
        for thing in closing:
            thing.close()
        os.setsid()
        os.close(grouped)  # the server reports the pid once its group exists: killpg never misses the run
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # not the server's control pipe
        os.close(devnull)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        for signum, handler in ((signal.SIGINT, _SIGINT), (signal.SIGTERM, signal.SIG_DFL),
                                (signal.SIGCHLD, signal.SIG_DFL)):
            signal.signal(signum, handler)
        if request["nice"]:
            os.nice(request["nice"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # what Python gives `python -m pytest` there: the directory, PYTHONPATH, then the installation's paths
        extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *_INSTALLED]
        import pytest

        sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), *request["args"]]
        code = int(pytest.main(request["args"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # report, never fall back into the server's loop
        print(f"pytest server: the run crashed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


_INSTALLED: list[str] = []  # sys.path beyond the script's directory and the server's own PYTHONPATH


def serve(path: str) -> None:
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _INSTALLED[:] = [p for p in sys.path[1:] if os.path.abspath(p) not in own]
    _warm()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    conns: set[socket.socket] = set()  # connections whose request has not come yet, or whose run is going
    children: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (connection, pid)
    print("ready", flush=True)
    try:
        while True:
            for key, _ in sel.select():
                what = key.data
                if what == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return
                elif what == "accept":
                    conn, _ = listener.accept()
                    conns.add(conn)
                    sel.register(conn, selectors.EVENT_READ, "conn")
                elif what == "conn":
                    conn = key.fileobj
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
                    if not msg:
                        sel.unregister(conn)
                        conns.discard(conn)
                        conn.close()
                        continue
                    request = json.loads(msg)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    grouped_r, grouped_w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        os.close(grouped_r)
                        _child(request, fds, [sel, listener, *conns], grouped_w)
                    os.close(grouped_w)
                    os.read(grouped_r, 1)  # EOF once the child has its own session (or died before)
                    os.close(grouped_r)
                    for fd in fds:
                        os.close(fd)
                    sel.unregister(conn)
                    conn.sendall(json.dumps({"pid": pid}).encode())
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = (conn, pid)
                    sel.register(pidfd, selectors.EVENT_READ, "child")
                else:  # a child ended
                    pidfd = key.fd
                    sel.unregister(pidfd)
                    conn, pid = children.pop(pidfd)
                    os.close(pidfd)
                    _, status = os.waitpid(pid, 0)
                    try:
                        conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                    except OSError:
                        pass  # the client gave up (its timeout) and left
                    conns.discard(conn)
                    conn.close()
    finally:
        for conn, pid in children.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# -- the client ----------------------------------------------------------------------------------------------
class _Server:
    """The server process, started with ``env`` (its runs' import-time variables must match it)."""

    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="pytest-server-")
        self.path = os.path.join(self.dir, "socket")
        self.env = dict(env)
        self.log = os.path.join(self.dir, "server.log")  # its own output (Paddle's import warnings, a crash)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.pytest_server", self.path], cwd=REPO,
                                         env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         start_new_session=True)
        # "ready" after the warm-up; bounded: a server stuck in it fails the run that started it, saying so
        ready = self.proc.stdout.readline() if select.select([self.proc.stdout], [], [], START_S)[0] else b""
        if ready.strip() != b"ready":
            self.proc.kill()
            with open(self.log, errors="replace") as f:
                raise RuntimeError(f"the pytest server did not start (exit {self.proc.wait()}):\n{f.read()[-3000:]}")

    def close(self) -> None:
        self.proc.stdin.close()  # the server kills what still runs and ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


_server: _Server | None = None
_lock = threading.Lock()


def _the_server() -> _Server:
    """The session's server, started at its first run with the environment the session's jobs got (never a
    variable a test set for a moment: tests/early.py)."""
    global _server
    from tests import early

    with _lock:
        if _server is None:
            _server = _Server(early.environment())
        return _server


def stop() -> None:
    """The session's end: the server ends, and with it any run still going."""
    global _server
    with _lock:
        if _server is not None:
            _server.close()
        _server = None


class Running:
    """A run in the server: ``pid`` is its process group (what ``early.stop`` kills)."""

    def __init__(self, pid: int):
        self.pid = pid


def run(args: list[str], cwd: str, timeout: float, env: dict | None = None, nice: int = 0,
        started=None, server: _Server | None = None) -> subprocess.CompletedProcess:
    """``python -m pytest *args`` in ``cwd`` as ``subprocess.run(..., capture_output=True, text=True, timeout=...)``
    does it, forked from the server (the session's unless given). ``started(Running)`` is called with the run's
    process group once it exists."""
    env = dict(os.environ if env is None else env)
    cmd = [sys.executable, "-m", "pytest", *args]
    server = server or _the_server()
    if _import_time_env(env) != _import_time_env(server.env):
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(server.path)
        request = {"args": list(args), "cwd": os.path.abspath(cwd), "env": env, "nice": nice}
        socket.send_fds(conn, [json.dumps(request).encode()], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        out_w = err_w = -1
        return _collect(conn, cmd, out_r, err_r, timeout, started)
    finally:
        conn.close()
        for fd in (out_r, err_r, out_w, err_w):
            if fd >= 0:
                os.close(fd)


def _collect(conn, cmd, out_r: int, err_r: int, timeout: float, started) -> subprocess.CompletedProcess:
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(out_r, selectors.EVENT_READ, 1)
    sel.register(err_r, selectors.EVENT_READ, 2)
    sel.register(conn, selectors.EVENT_READ, 0)
    chunks = {1: [], 2: []}
    pid, code, timed_out = None, None, False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            if pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + 30  # the killed group's pipes close; bounded all the same
            continue
        if left <= 0:
            break
        for key, _ in sel.select(left):
            if key.data == 0:
                data = conn.recv(65536)
                if not data:
                    sel.unregister(conn)
                    continue
                message = json.loads(data)
                if "pid" in message:
                    pid = message["pid"]
                    if started is not None:
                        started(Running(pid))
                else:
                    code = message["exit"]
            else:
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.data].append(data)
                else:
                    sel.unregister(key.fd)
    out = b"".join(chunks[1]).decode(errors="replace")
    err = b"".join(chunks[2]).decode(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    if code is None:
        raise RuntimeError(f"the pytest server gave no exit status for {cmd}:\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, code, out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
