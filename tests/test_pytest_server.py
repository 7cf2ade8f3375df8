"""tests/pytest_server.py: a run forked from the server is the ``python -m pytest`` subprocess it replaces (the
same working directory, environment, path, argv, signals, stdin, exit status and output), its own process
group, killed whole at its timeout; a run whose environment an import would read differently is a real
subprocess; the server ends with everything it started."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests import pytest_server

PROBE = '''
import json, os, signal, sys

def test_probe():
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({
            "cwd": os.getcwd(),
            "path": sys.path[:2],
            "argv0": os.path.basename(sys.argv[0]),
            "probe": os.environ.get("PROBE_VALUE"),
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "stdin": sys.__stdin__.buffer.read() if sys.__stdin__ is not None else None,
            "own_group": os.getpgid(0) == os.getpid(),
            "nice": os.nice(0),
            "parent": os.getppid(),
        }, f, default=repr)
'''


def _probe_dir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "test_probe.py").write_text(PROBE)
    (tmp_path / "extra").mkdir()
    return work


def _env(tmp_path, out, **more):
    env = dict(os.environ, PROBE_OUT=str(out), PROBE_VALUE="set for this run", PYTHONPATH=str(tmp_path / "extra"))
    env.update(more)
    return env


def test_a_run_is_the_subprocess_it_replaces(tmp_path):
    work = _probe_dir(tmp_path)
    args = ["-q", "-p", "no:cacheprovider", "test_probe.py"]
    forked = pytest_server.run(args, str(work), timeout=120, env=_env(tmp_path, tmp_path / "forked.json"), nice=3)
    plain = subprocess.run(["nice", "-n", "3", sys.executable, "-m", "pytest", *args], cwd=work,
                           env=_env(tmp_path, tmp_path / "plain.json"), capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    assert forked.returncode == plain.returncode == 0, (forked.stdout + forked.stderr, plain.stdout + plain.stderr)
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("forked", "plain"))
    assert a.pop("parent") != os.getpid() and b.pop("parent") == os.getpid(), "the forked run is the server's child"
    assert a == b, f"forked {a} != subprocess {b}"
    assert a["path"] == [str(work), str(tmp_path / "extra")] and a["nice"] == os.nice(0) + 3, a
    assert "1 passed" in forked.stdout and forked.stdout.count("\n") == plain.stdout.count("\n"), forked.stdout


def test_exit_status_and_output_are_the_runs(tmp_path):
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert 1 == 2, 'the failure text'\n")
    failed = pytest_server.run(["-q", "-p", "no:cacheprovider", "test_fails.py"], str(tmp_path), timeout=120)
    assert failed.returncode == 1 and "the failure text" in failed.stdout and "1 failed" in failed.stdout, failed
    usage = pytest_server.run(["-q", "-p", "no:cacheprovider", "--no-such-option"], str(tmp_path), timeout=120)
    assert usage.returncode == 4 and "--no-such-option" in usage.stderr, usage


def test_a_run_past_its_timeout_dies_with_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild"
    (tmp_path / "test_hangs.py").write_text(
        "import subprocess, time\n"
        "def test_hangs():\n"
        f"    p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)\n")
    started = []
    begin = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        pytest_server.run(["-q", "-p", "no:cacheprovider", "test_hangs.py"], str(tmp_path), timeout=4,
                          started=started.append)
    assert time.monotonic() - begin < 40, "the timeout did not end the run"
    (run,) = started
    deadline = time.monotonic() + 10
    for pid in (run.pid, int(pid_file.read_text())):
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"process {pid} of the timed-out run is still there"
            time.sleep(0.05)


def test_a_variable_an_import_reads_makes_it_a_real_subprocess(tmp_path):
    work = _probe_dir(tmp_path)
    out = tmp_path / "flags.json"
    proc = pytest_server.run(["-q", "-p", "no:cacheprovider", "test_probe.py"], str(work), timeout=120,
                             env=_env(tmp_path, out, FLAGS_probe_only="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["parent"] == os.getpid(), "FLAGS_ is read by Paddle's import: not forked"


def test_the_server_ends_with_its_runs_when_its_session_does(tmp_path):
    server = pytest_server._Server(dict(os.environ))
    (tmp_path / "test_sleeps.py").write_text("import time\ndef test_sleeps():\n    time.sleep(60)\n")
    started = []
    waiter = threading.Thread(target=lambda: _run_ignoring_errors(server, tmp_path, started.append), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 60
    while not started:
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.05)
    server.close()
    waiter.join(40)
    assert not waiter.is_alive(), "the client still waits for a run of a closed server"
    for pid in (server.proc.pid, started[0].pid):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert not os.path.exists(server.dir), f"{server.dir} left behind"


def test_a_run_is_its_own_group_when_its_pid_is_reported(tmp_path):
    """A kill of the group at the first moment the client can make one (the server closed, a timeout, the
    session's end) reaches the run: the run is its group's leader before its pid is reported. The forked child
    used to call setsid itself after the report, and a server closed in between missed it (the run slept on,
    the client with it)."""
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    server = pytest_server._Server(dict(os.environ))
    try:
        for attempt in range(12):
            groups = []

            def started(run):
                try:
                    groups.append(os.getpgid(run.pid))
                except ProcessLookupError:
                    groups.append(run.pid)  # ended already: it had its group (it ran pytest)
                groups.append(run.pid)

            proc = pytest_server.run(["-q", "-p", "no:cacheprovider", "test_quick.py"], str(tmp_path), timeout=120,
                                     started=started, server=server)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert groups[0] == groups[1], f"run {attempt}: pid {groups[1]} reported in group {groups[0]}"
    finally:
        server.close()


def _run_ignoring_errors(server, cwd, started):
    try:
        pytest_server.run(["-q", "-p", "no:cacheprovider", "test_sleeps.py"], str(cwd), timeout=120, started=started,
                          server=server)
    except Exception:  # noqa: BLE001 (the run dies with the server: what matters here is that nothing is left)
        pass
