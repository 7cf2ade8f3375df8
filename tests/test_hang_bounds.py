"""Nothing an implementation does can hang the run (issue 19): a case that can block inside the
implementation runs in a forked child with a deadline (``harness.in_child``), so that a hang is a
failed rule naming the case, and Ctrl-C ends the run at once.

The loaders under test are tests/naive_loader.py's: ``Adapter`` (``os.path.exists`` and
``safetensors.paddle.load_file``, which opens a FIFO in Rust with the GIL held: the whole process
blocks, no watcher thread and no SIGALRM handler runs, and SIGINT is retried away) and
``HoldingAdapter`` (opens it read-write and reads it through ``ctypes.PyDLL``: blocked until killed).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conformance import harness
from tests.conftest import sigint_at_default
from tests.processes import ended

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULE = "LEVEL-CANDIDATE-NOT-FILE"
FIFO_CASES = {"single:fifo", "part1-of-0-1-2:fifo"}  # the legacy one needs snapshot.shared_fallback
OUTER_TIMEOUT_S = 240  # a hung run is killed here and fails the test; a bounded one ends in seconds


def _suite(adapter, *args):
    return [sys.executable, "-m", "pytest", "conformance", f"--impl=tests/naive_loader.py:{adapter}",
            "-p", "no:cacheprovider", "-q", *args]


def _env():
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


@pytest.mark.parametrize("adapter,expected", [
    ("Adapter", "the loader opened the FIFO for reading"),
    ("HoldingAdapter", "the update blocked for"),
])
def test_a_loader_that_blocks_on_a_fifo_gets_failed_rules_not_a_hung_run(tmp_path, adapter, expected):
    """The issue's run: every case of LEVEL-CANDIDATE-NOT-FILE, on both cores; it finishes with the
    rule failed and each FIFO case's message naming its FIFO and saying what happened."""
    report = str(tmp_path / "report.json")
    started = time.monotonic()
    try:
        proc = subprocess.run(_suite(adapter, "--rule", RULE, "-n", "2", "--conformance-report", report), cwd=REPO,
                              env=_env(), capture_output=True, text=True, timeout=OUTER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{adapter}: the run hung: still running after {OUTER_TIMEOUT_S}s\n{(e.stdout or b'')[-3000:]!r}")
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"{adapter}: exit {proc.returncode} after {elapsed:.1f}s, expected 1 (a rule failed)\n{out[-3000:]}"
    with open(report, encoding="utf-8") as f:
        data = json.load(f)
    rule = next(r for r in data["rules"] if r["id"] == RULE)
    assert rule["status"] == "failed", (adapter, rule["status"])
    fifo = {t["nodeid"].rsplit("[", 1)[1].rstrip("]"): t for t in rule["tests"] if t["nodeid"].endswith(":fifo]")}
    for case in FIFO_CASES:
        test = fifo[case]
        name = "model_state.tp2.3.part1.pdparams" if case.startswith("part1") else "model_state.tp2.3.pdparams"
        assert test["actual"] == "failed" and expected in test["message"] and name in test["message"] \
            and "is a fifo" in test["message"], (adapter, case, test["actual"], test["message"][:600])


def _blocked_child(proc, deadline):
    """The forked child of the pytest process once it is blocked reading the FIFO, or None."""
    parent = psutil.Process(proc.pid)
    while time.monotonic() < deadline and proc.poll() is None:
        for child in parent.children():
            if "read" in harness.blocked_in(child.pid):
                return child
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("whom", ["the-pytest-process", "the-process-group"])
def test_ctrl_c_ends_a_run_blocked_inside_the_implementation(whom):
    """SIGINT to the run (or to its whole process group, as a terminal's Ctrl-C) while a case is blocked
    inside the implementation, holding the GIL in a read that retries on EINTR: the run ends (within
    30 s; the process's own exit takes seconds on a loaded machine), interrupted in the wait for the
    case's child, and the blocked child does not outlive it."""
    proc = subprocess.Popen(_suite("HoldingAdapter", "--rule", RULE, "-k", "single and fifo", "--full-trace"), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=sigint_at_default)
    try:
        child = _blocked_child(proc, time.monotonic() + OUTER_TIMEOUT_S)
        assert child is not None, f"no case was seen blocked (exit {proc.poll()})"
        if whom == "the-pytest-process":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGINT to {whom}: the run was still going 30 s later (blocked in {harness.blocked_in(child.pid)})")
        took = time.monotonic() - sent
        assert ended(child), f"SIGINT to {whom}: the blocked child {child.pid} outlived the run"
        # Ended by Ctrl-C, in the wait for the child: not by the case's deadline (its message is absent). With
        # --full-trace pytest prints every entry of the KeyboardInterrupt's traceback: one is harness.py's wait
        # loop, whatever the innermost frame (the standard library it calls, "<frozen codecs>" once, or the case's
        # own watcher, which the loop calls: conformance/test_snapshot_levels.py once, in CI).
        frames = re.findall(r"^(\S+?):\d+: ", out, re.M)
        in_wait = any(f.endswith(os.path.join("conformance", "harness.py")) for f in frames)
        assert in_wait and "the update blocked for" not in out, \
            f"SIGINT to {whom}: ended after {took:.1f}s, exit {proc.returncode}, but not interrupted in the wait:\n{out[-2000:]}"
        assert proc.returncode == 2, (proc.returncode, out[-2000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- in_child itself ------------------------------------------------------------------------------------
def _hold_the_gil_reading_a_fifo(path):
    import ctypes

    libc = ctypes.PyDLL(None, use_errno=True)
    fd = libc.open(path.encode(), os.O_RDWR)
    buf = ctypes.create_string_buffer(1)
    while libc.read(fd, buf, 1) < 0 and ctypes.get_errno() == 4:
        pass


def test_in_child_kills_a_child_blocked_in_native_code_and_says_where(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(harness.ChildTimedOut, match=r"ran past 2\.0s and was killed \(blocked in \S*pipe_read in read\)") as e:
        harness.in_child(_hold_the_gil_reading_a_fifo, fifo, timeout_s=2.0)  # (time to reach the read, loaded)
    assert 2.0 <= e.value.seconds < 10 and time.monotonic() - started < 20, (e.value.seconds, time.monotonic() - started)


def test_in_child_kills_the_child_when_the_wait_is_interrupted(tmp_path):
    """Ctrl-C in the test process while it waits: KeyboardInterrupt propagates, the child is killed."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    seen = []

    def interrupt(pid):
        seen.append(pid)
        if "read" in harness.blocked_in(pid):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        harness.in_child(_hold_the_gil_reading_a_fifo, fifo, timeout_s=30, watch=interrupt, watch_interval_s=0.02)
    pid = seen[-1]
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped already: killed and waited for
    assert not os.path.exists(f"/proc/{pid}"), f"child {pid} still exists"


def _segment_then_hang(pid_file):
    from weightsync.wire.handles import Segment

    segment = Segment.create(1024)  # a trainer's bucket, as fixtures.buckets.Publisher makes in a forked case
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {segment.name}")
    time.sleep(60)


def test_in_child_sweeps_what_a_killed_child_left_in_shared_memory(tmp_path):
    """A child killed at its deadline cannot unlink the segments it made: in_child removes them once it has
    reaped it (a leak of the suite's, never the implementation's business); another process's are left alone."""
    from weightsync.wire.handles import Segment

    mine = Segment.create(1024)  # this process's: alive, not the child's
    try:
        with pytest.raises(harness.ChildTimedOut):
            harness.in_child(_segment_then_hang, str(tmp_path / "pid"), timeout_s=1.0)
        pid, name = (tmp_path / "pid").read_text().split()
        left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"wscf_{pid}_"))
        assert not left, f"the killed child {pid}'s segments are still in /dev/shm: {left} (it made {name})"
        assert os.path.exists(f"/dev/shm/{mine.name}"), f"this process's own segment {mine.name} was removed"
    finally:
        mine.close()
        mine.unlink()


def test_ast_parse_is_serialized_and_a_fork_never_inherits_its_lock_held():
    """The plugin runs ``ast.parse`` one call at a time (CPython 3.11's AST constructor shares its recursion depth
    between threads: gh-106905, an INTERNALERROR that loses the run's report), and a child forked while another
    thread holds that lock parses at once: a case's forked child that prints a traceback never deadlocks."""
    import ast
    import threading

    from conformance import plugin

    plugin._serialize_ast_parse()
    assert getattr(ast.parse, "_conformance_serialized", False), "ast.parse is not the plugin's serialized one"
    harness.in_child(lambda: None)  # in_child's own first imports (which this process may parse) done before the hold
    holding, release = threading.Event(), threading.Event()

    def hold():
        with plugin._AST_LOCK:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(10), "the holding thread never took the lock"
        got = harness.in_child(lambda: type(ast.parse("x = 1").body[0]).__name__, timeout_s=10.0)
        assert got == "Assign", got
    finally:
        release.set()
        holder.join(10)


def test_a_device_read_without_end_is_stopped_by_the_memory_cap():
    """LEVEL-CANDIDATE-NOT-FILE's watch kills a child whose memory grows past the cap (a loader reading
    ``/dev/zero`` to its end), failing the case naming the device."""
    from conformance.test_snapshot_levels import RSS_CAP_MIB, _Watch

    def read_to_the_end():
        with open("/dev/zero", "rb") as f:
            return len(f.read())

    with pytest.raises(AssertionError, match=r"w: the update read \d+ MiB from /dev/zero \(a char-device\) and was killed") as e:
        harness.in_child(read_to_the_end, timeout_s=60, watch=_Watch("/dev/zero", "char-device", "w"))
    assert not isinstance(e.value, harness.ChildFailed), "the cap, not the child's own failure, must end it"
    assert int(re.search(r"read (\d+) MiB", str(e.value)).group(1)) > RSS_CAP_MIB


def test_concurrently_bounds_calls_that_never_return_once_for_all():
    stuck = {name: (lambda: time.sleep(8)) for name in "abcd"}
    started = time.monotonic()
    out = harness.concurrently({**stuck, "quick": lambda: None}, bound_s=1.0)
    took = time.monotonic() - started
    assert all(isinstance(out[name][0], harness.StillRunning) for name in stuck) and out["quick"][0] is None, out
    assert "a: still running after 1s" in str(out["a"][0]), out
    assert took < 3.0, f"four stuck calls cost {took:.2f}s: one shared bound of 1 s, not 1 s each"
