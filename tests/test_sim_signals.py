"""``python -m sim roundtrip`` under real signals at every phase, and its usage errors.

Each run is a real CLI process (its own session, its own TMPDIR) with two spawned trainers, paused at a
phase with ``--hold-at`` (which says so on stderr), then sent SIGINT or SIGTERM. Afterwards: the exit
status is 128 + the signal, within a few seconds (a Ctrl-C used to wait out the worker's timeout and
report a failed update); no traceback, no Paddle stack dump, no failed update reported; every child
process gone (psutil), no /dev/shm segment of the run's processes, and the run's directory removed.
"""
import concurrent.futures
import contextlib
import json
import os
import pathlib
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from sim.cli import model_spec
from sim.ipc_handles import leaked_segments
from wire.protocol import align_up, plan_layout
from tests import early
from tests.conftest import REPO
from tests.processes import ended, wait_ended

# Last, once the background jobs are done (tests/early.py): beside them these tests took 240 s instead of 81, and
# a trainer of a killed CLI was ended by its kernel deadline before it unlinked its segments.
RUNS_AFTER_THE_JOBS = True

HOLD_WAIT_S = 90  # a loaded machine may take long to start; the phase is what matters, not the time
EXIT_WITHIN_S = 10  # after the signal: trainers stopped (they unwind in milliseconds), segments and directory removed
# 2 MiB in 0.25 MiB buckets: version 1 has BUCKETS buckets (11); the mid-transfer hold is before the middle one
BUCKETS = len(plan_layout([(p.name, p.nbytes) for p in model_spec(2).all_params], align_up(1 << 18)))
RUN = ["roundtrip", "--ranks", "2", "--model-mib", "2", "--bucket-mib", "0.25", "--versions", "2", "--timeout-s", "60",
       "--no-progress"]
PHASES = {
    "ready": "ready",  # trainers up and holding their buffers, no update started
    "before-first-bucket": "bucket:0",  # workers said hello, rank 0's trainer has sent nothing
    "mid-transfer": f"bucket:{BUCKETS // 2}",  # the first half landed on rank 0
    "after-last-bucket": "end",  # every bucket landed, the end message not sent
    "verification": "verify",  # both ends' digests being compared
}
WHERE = {"ready": "waiting for the trainers of version 1", "before-first-bucket": "transfer of version 1",
         "mid-transfer": "transfer of version 1", "after-last-bucket": "transfer of version 1",
         "verification": "verification of version 1"}


class Run:
    """The CLI held at a phase: its process, the trainers it spawned, their segments, its TMPDIR."""

    def __init__(self, tmp_path, hold: str, args=RUN):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir(parents=True)
        env = dict(os.environ, TMPDIR=str(self.tmp), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "sim", *args, "--hold-at", hold], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.err = self._until_held()
        me = psutil.Process(self.proc.pid)
        self.children = me.children(recursive=True)
        self.pids = {self.proc.pid} | {c.pid for c in self.children}

    def _until_held(self) -> str:
        text, deadline = "", time.monotonic() + HOLD_WAIT_S
        while "holding at" not in text:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stderr], [], [], max(left, 0))
            line = self.proc.stderr.readline() if ready else ""
            if not line:
                self.proc.kill()
                out, err = self.proc.communicate()
                pytest.fail(f"the run never held (exit {self.proc.returncode}):\n{text}{err}\n{out}"[-4000:])
            text += line
        return text

    def segments(self) -> list[str]:
        return [n for n in leaked_segments() if _pid(n) in self.pids]

    def signal(self, signum: int, group: bool = False) -> tuple[int, str, float]:
        start = time.monotonic()
        if group:
            os.killpg(self.proc.pid, signum)  # a terminal's Ctrl-C: the CLI and every trainer
        else:
            self.proc.send_signal(signum)
        try:
            out, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"still running 60 s after the signal:\n{self.err}{err}"[-4000:])
        return self.proc.returncode, self.err + err + out, time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for child in self.children:  # before reading: a child holding the pipes would keep the read waiting
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        if not self.proc.stdout.closed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.communicate(timeout=30)
        self.proc.wait(timeout=30)


def _cmdline(proc: psutil.Process) -> list[str]:
    """Its command line; none for a process that has exited (a zombie not yet reaped, seen in CI) or gone."""
    try:
        return proc.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return []


def _killed(run: Run, read_output: bool = True) -> str:
    """SIGKILL the CLI and collect its output. Reading to the end waits for every process holding its pipes,
    the trainers included: bounded, and a trainer still there is named, with its stacks (SIGUSR1 makes
    a trainer's faulthandler print them), instead of hanging the test. ``read_output=False``: the CLI's
    death alone, its pipes closed unread (for a test about what the dead CLI left, not its trainers)."""
    run.proc.kill()
    run.proc.wait(timeout=30)
    if not read_output:
        run.proc.stdout.close()
        run.proc.stderr.close()
        return ""
    try:
        out, err = run.proc.communicate(timeout=30)
        return err + out
    except subprocess.TimeoutExpired:
        where = {}
        for c in run.children:
            with contextlib.suppress(psutil.NoSuchProcess):
                if not ended(c):
                    where[c.pid] = (c.status(), " ".join(_cmdline(c))[-120:])
                    c.send_signal(signal.SIGUSR1)
        time.sleep(1)
        for c in run.children:
            with contextlib.suppress(psutil.NoSuchProcess):
                c.kill()
        out, err = run.proc.communicate(timeout=30)
        pytest.fail(f"30 s after the CLI was killed, its output was still held open by {where}:\n{err[-6000:]}")


def _pid(segment: str) -> int | None:
    try:
        return int(segment.split("_")[1])
    except (IndexError, ValueError):
        return None


META = [a for a in RUN if a not in ("--bucket-mib", "0.25")] + ["--path", "meta"]

# Most of a case's time is its run's start (a CLI and two trainers, about a second). So the runs of the next
# AHEAD cases start together, and all of them are held before the first of those cases goes on: no run starts
# while a case judges what its own run left (a starting CLI sweeps what dead processes left in /dev/shm, which
# would hide a leak), and none stays held long (its worker waits 60 s for the next bucket). A case selected alone
# starts its own run the same way; a run whose case does not ask for it as declared here is not used.
AHEAD = 4
HOLDS = {  # a case -> (what its run holds at, its arguments), from the case's parameters
    "test_signal_at_every_phase_exits_clean": lambda p: (PHASES[p["phase"]], RUN),
    "test_signal_on_the_meta_path": lambda p: (PHASES[p["phase"]], META),
    "test_ctrl_c_to_the_process_group_mid_transfer": lambda p: (PHASES["mid-transfer"], RUN),
    "test_a_trainer_that_never_stops_is_killed_in_time": lambda p: (PHASES["verification"], RUN),
    "test_trainers_die_with_a_killed_cli": lambda p: (PHASES["mid-transfer"], RUN),
    "test_a_sigterm_another_thread_takes_still_stops_the_process":
        lambda p: (PHASES["before-first-bucket"] if p["who"] == "cli" else PHASES["verification"], RUN),
    "test_the_next_run_sweeps_what_a_killed_cli_left": lambda p: (PHASES["mid-transfer"], RUN),
}


def _planned(item) -> tuple[str, list[str]] | None:
    plan = HOLDS.get(getattr(item, "originalname", None))
    callspec = getattr(item, "callspec", None)
    return plan(callspec.params if callspec else {}) if plan else None


class Ahead:
    """The runs started ahead of their cases: nodeid -> ((hold, args), Future of the held Run)."""

    def __init__(self):
        # A short TMPDIR of its own, not pytest's tmp_path: the run's ZMQ ipc sockets live there, and under
        # pytest-xdist tmp_path is long enough to pass the 107-byte limit of a socket's path.
        self.base = pathlib.Path(tempfile.mkdtemp(prefix="wsig"))
        self.pool = concurrent.futures.ThreadPoolExecutor(AHEAD, thread_name_prefix="held")
        self.runs: dict[str, tuple] = {}
        self.count = 0

    def new(self, hold, args) -> concurrent.futures.Future:
        self.count += 1
        return self.pool.submit(Run, self.base / str(self.count), hold, args)

    def start_from(self, item) -> None:
        """Start the runs of ``item`` and of the next cases after it that declare one, AHEAD in all; wait until
        every one of them is held (or failed: its own case reports it)."""
        items = item.session.items
        batch = []
        for other in items[items.index(item):]:
            planned = _planned(other)
            if len(batch) == AHEAD or planned is None or other.module is not item.module:
                break
            if other.nodeid not in self.runs:
                self.runs[other.nodeid] = (planned, self.new(*planned))
                batch.append(self.runs[other.nodeid][1])
        concurrent.futures.wait(batch)

    def take(self, item, hold, args) -> "Run":
        if item.nodeid not in self.runs and _planned(item) is not None:
            self.start_from(item)
        planned, future = self.runs.pop(item.nodeid, (None, None))
        if future is not None and planned != (hold, list(args)):
            self.discard(future)  # declared otherwise than the case asks
            future = None
        return (future or self.new(hold, args)).result()

    @staticmethod
    def discard(future) -> None:
        with contextlib.suppress(BaseException):  # a run that never held has already been killed
            future.result().kill()

    def close(self) -> None:
        for _, future in self.runs.values():
            self.discard(future)
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def ahead():
    runs = Ahead()
    yield runs
    runs.close()


@pytest.fixture
def held(request, ahead):
    """``held(hold, args)``: the case's run, held at ``hold`` (started ahead when HOLDS declares it so)."""
    runs = []

    def start(hold, args=RUN):
        runs.append(ahead.take(request.node, hold, args))
        return runs[-1]

    yield start
    for r in runs:
        r.kill()


def _nothing_left(run: Run, code: int, output: str, elapsed: float, signum: int, where: str) -> None:
    name = signal.Signals(signum).name
    assert code == 128 + signum, f"{name} {where}: exit {code}, expected {128 + signum}:\n{output[-3000:]}"
    assert elapsed < EXIT_WITHIN_S, f"{name} {where}: exited {elapsed:.1f}s after the signal"
    for bad in ("Traceback", "FatalError", "C++ Traceback", "update failed", "KeyboardInterrupt"):
        assert bad not in output, f"{name} {where}: {bad!r} in the output:\n{output[-3000:]}"
    assert f"interrupted by {name} during {where}" in output, output[-3000:]
    gone, alive = wait_ended(run.children, timeout=10)
    assert not alive, f"{name} {where}: processes still running: {[(p.pid, _cmdline(p)) for p in alive]}"
    assert not run.segments(), f"{name} {where}: segments left in /dev/shm: {run.segments()}"
    assert not list(run.tmp.iterdir()), f"{name} {where}: left in TMPDIR: {list(run.tmp.iterdir())}"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_signal_at_every_phase_exits_clean(held, phase, signum):
    run = held(PHASES[phase])
    trainers = [c for c in run.children if "spawn_main" in " ".join(_cmdline(c))]
    assert len(trainers) == 2, f"expected 2 trainer processes, found {[_cmdline(c) for c in run.children]}"
    assert list(run.tmp.iterdir()), "the run's directory should exist while it runs"
    assert run.segments(), "the trainers' buffers should exist in /dev/shm while they run"
    _nothing_left(run, *run.signal(signum), signum, WHERE[phase])


@pytest.mark.parametrize("phase", ["ready", "verification"])
def test_signal_on_the_meta_path(held, phase):
    """The meta path (a segment per trainer holding the whole model, control sockets polled by the update
    threads) exits as cleanly."""
    run = held(PHASES[phase], META)
    _nothing_left(run, *run.signal(signal.SIGTERM), signal.SIGTERM, WHERE[phase])


def test_ctrl_c_to_the_process_group_mid_transfer(held):
    """A terminal's Ctrl-C reaches the trainers too: they ignore it (no KeyboardInterrupt traceback) and
    the CLI stops them; same outcome as a SIGINT to the CLI alone."""
    run = held(PHASES["mid-transfer"])
    _nothing_left(run, *run.signal(signal.SIGINT, group=True), signal.SIGINT, WHERE["mid-transfer"])


def test_a_trainer_that_never_stops_is_killed_in_time(held):
    """A trainer that neither unwinds on SIGTERM nor meets its kernel deadline (stopped here: no handler runs,
    no SIGALRM fires) is named and killed by the CLI, whose exit stays within its bound and leaves nothing."""
    from sim.cli import STOP_S

    run = held(PHASES["verification"])
    trainers = sorted((c for c in run.children if "spawn_main" in " ".join(_cmdline(c))), key=lambda c: c.pid)
    assert len(trainers) == 2, f"expected 2 trainer processes, found {[_cmdline(c) for c in run.children]}"
    trainers[1].suspend()
    code, output, elapsed = run.signal(signal.SIGTERM)
    _nothing_left(run, code, output, elapsed, signal.SIGTERM, WHERE["verification"])
    named = re.findall(r"trainer (\d) \(pid (\d+)\) still running ([\d.]+)s after SIGTERM: killed", output)
    assert [int(pid) for _, pid, _ in named] == [trainers[1].pid], f"stopped {trainers[1].pid}, named {named}"
    assert elapsed >= STOP_S, f"the stopped trainer was killed {elapsed:.1f}s after the signal, before its {STOP_S}s"


def test_trainers_die_with_a_killed_cli(held):
    """SIGKILL cannot be handled: the trainers still exit (the kernel sends them SIGTERM when their
    parent dies) and unlink their own buffers, instead of running on until their timeout."""
    run = held(PHASES["mid-transfer"])
    trainers = [c for c in run.children if "spawn_main" in " ".join(_cmdline(c))]
    _killed(run)
    gone, alive = wait_ended(trainers, timeout=10)
    assert not alive, f"trainers still running after the CLI was killed: {[p.pid for p in alive]}"
    assert not run.segments(), f"segments left by the trainers: {run.segments()}"


_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


def _tgkill(pid: int, tid: int, signum: int) -> None:
    """Send ``signum`` to thread ``tid`` of process ``pid`` (tgkill(2)), as the kernel does when it picks that
    thread for a signal sent to the whole process."""
    import ctypes
    import platform

    number = _SYS_TGKILL.get(platform.machine())
    if number is None:
        pytest.skip(f"tgkill's system call number is not known here ({platform.machine()})")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {signum})")


def _settles_in_poll(pid: int, samples: int = 10, within_s: float = 20.0) -> bool:
    """The main thread of ``pid`` is seen waiting in poll ``samples`` times in a row, 20 ms apart: its
    wait for the worker's message, not the making of the next version's state."""
    seen, deadline = 0, time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/wchan") as f:
                seen = seen + 1 if "poll" in f.read() else 0
        except OSError:
            return False
        if seen >= samples:
            return True
        time.sleep(0.02)
    return False


def _takers(pid: int, signum: int) -> list[int]:
    """The threads of ``pid`` other than its main one that do not block ``signum``: where the kernel may
    deliver a signal sent to the process."""
    takers = []
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        if tid == pid:
            continue
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/status") as f:
            blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
            if not blocked & (1 << (signum - 1)):
                takers.append(tid)
    return takers


@pytest.mark.parametrize("who", ["cli", "trainer"])
def test_a_sigterm_another_thread_takes_still_stops_the_process(held, who):
    """The kernel may give a SIGTERM sent to a process to any of its threads that does not block it; its C
    handler only flags the signal, and the Python handler runs when the main thread next runs bytecode. A
    main thread in one long wait (the CLI on its update threads, a trainer in its poll for the worker's
    next message) must still stop within its bound: stop 29's and 31's runs that waited out a 60 s timeout,
    or a trainer still running 10 s after its CLI's stop. Each thread that could take the signal gets it
    (tgkill), the main thread never."""
    run = held(PHASES["before-first-bucket"] if who == "cli" else PHASES["verification"])
    if who == "cli":
        takers = _takers(run.proc.pid, signal.SIGTERM)
        assert takers, "premise: the CLI has threads that do not block SIGTERM (its update threads)"
        start = time.monotonic()
        _tgkill(run.proc.pid, takers[0], signal.SIGTERM)
        try:
            out, err = run.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the CLI still ran 60 s after SIGTERM reached its thread {takers[0]}")
        _nothing_left(run, run.proc.returncode, run.err + err + out, time.monotonic() - start, signal.SIGTERM,
                      WHERE["before-first-bucket"])
        return
    trainers = sorted((c for c in run.children if "spawn_main" in " ".join(_cmdline(c))), key=lambda c: c.pid)
    assert len(trainers) == 2, f"expected 2 trainer processes, found {[_cmdline(c) for c in run.children]}"
    trainer = trainers[0]  # waiting for the worker's hello of version 2 (up to 240 s): the CLI holds at verification
    takers = _takers(trainer.pid, signal.SIGTERM)
    assert takers, "premise: the trainer has threads that do not block SIGTERM (its parent watcher)"
    assert _settles_in_poll(trainer.pid), f"premise: trainer {trainer.pid}'s main thread never settled in its poll"
    _tgkill(trainer.pid, takers[0], signal.SIGTERM)
    deadline = time.monotonic() + EXIT_WITHIN_S
    while not ended(trainer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended(trainer), f"trainer {trainer.pid} still running {EXIT_WITHIN_S} s after SIGTERM reached its thread {takers[0]}"
    assert not [n for n in run.segments() if _pid(n) == trainer.pid], f"segments left by trainer {trainer.pid}: {run.segments()}"


# A stand-in trainer whose unwinding hangs; given a path, its release (the segments a trainer unlinks) appends the
# time to that file.
_STOP_HANGS = """
import contextlib, os, signal, sys, time
from sim import interrupt
signal.pthread_sigmask(signal.SIG_BLOCK, interrupt.SIGNALS)  # as a trainer is spawned
def stuck(signum, frame):
    with contextlib.suppress(OSError):  # a reader that died with the orchestrator
        print("stopping", flush=True)
    while True:
        time.sleep(1)  # an unwinding that never ends
interrupt.trainer_signals(stuck, os.getppid())
if len(sys.argv) > 1:
    interrupt.before_forced_exit(lambda: open(sys.argv[1], "a").write(f"{time.monotonic()}\\n"))
print("ready", flush=True)
time.sleep(600)
"""


def _line(pipe, within_s: float = 60) -> str:
    """The next line of ``pipe``, or "" when none came within ``within_s`` (a stand-in that never started)."""
    ready, _, _ = select.select([pipe], [], [], within_s)
    return pipe.readline() if ready else ""


def _stop_hangs_run() -> dict:
    """The stand-in trainer told to stop: what it printed, its exit status (None: still running UNWIND_S + 30 s
    after its SIGTERM) and when it ended."""
    from sim.interrupt import UNWIND_S

    proc = subprocess.Popen([sys.executable, "-c", _STOP_HANGS], cwd=REPO, env=early.environment(), stdout=subprocess.PIPE,
                            text=True)
    try:
        facts = {"ready": _line(proc.stdout)}
        if facts["ready"] != "ready\n":
            return facts
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        facts["stopping"] = _line(proc.stdout)
        try:
            facts["code"] = proc.wait(timeout=UNWIND_S + 30)
        except subprocess.TimeoutExpired:
            facts["code"] = None
        facts["elapsed"] = time.monotonic() - start
        return facts
    finally:
        proc.kill()
        proc.wait()


_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(600)
"""


def _dead_orchestrator_run(marks: pathlib.Path) -> dict:
    """The stand-in trainer's orchestrator SIGKILLed: whether the trainer still ran UNWIND_S + 30 s on, and the
    times of its releases after the kill."""
    from sim.interrupt import UNWIND_S

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _STOP_HANGS, str(marks)], cwd=REPO, env=early.environment(),
                              stdout=subprocess.PIPE, text=True)
    trainer = None
    try:
        pid = _line(parent.stdout)
        if not pid.strip().isdigit():
            return {"started": pid}
        trainer = psutil.Process(int(pid))
        killed = time.monotonic()
        parent.kill()
        parent.wait(timeout=30)
        gone, alive = wait_ended([trainer], timeout=UNWIND_S + 30)
        times = [float(t) - killed for t in marks.read_text().split()] if marks.exists() else []
        return {"started": pid, "alive": bool(alive), "released": times}
    finally:
        parent.kill()
        parent.wait()
        if trainer is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                trainer.kill()


@early.job("stand_in_trainers", after_the_others=True)
def _stand_in_trainer_runs(tmp_path_factory):
    """The two stand-in trainers' runs, side by side. Each mostly waits (UNWIND_S, the kernel's deadline): a job
    started once the other jobs are done, so that the waits overlap the simulator's cases instead of adding to
    them (its bounds are kept from the other jobs' load, as the cases' are)."""
    marks = tmp_path_factory.mktemp("released") / "released"
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="stand-in") as pool:
        hangs, dead = pool.submit(_stop_hangs_run), pool.submit(_dead_orchestrator_run, marks)
        return {"stop hangs": hangs.result(), "dead orchestrator": dead.result()}


@pytest.fixture(scope="module")
def stand_in_trainers(tmp_path_factory):
    return early.result("stand_in_trainers", tmp_path_factory)


def test_a_trainer_whose_stop_hangs_is_ended_by_the_kernel(stand_in_trainers):
    """A trainer told to stop that never finishes unwinding (the way trainers of a killed CLI once held its
    output open for minutes) is ended by SIGALRM UNWIND_S after the SIGTERM, not left to run."""
    from sim.interrupt import UNWIND_S

    facts = stand_in_trainers["stop hangs"]
    assert facts["ready"] == "ready\n", f"the stand-in trainer did not start: {facts}"
    assert facts["stopping"] == "stopping\n", f"its SIGTERM handler did not run: {facts}"
    code, elapsed = facts["code"], facts["elapsed"]
    assert code is not None, f"a trainer whose stop hangs still runs {UNWIND_S + 30} s after its SIGTERM"
    assert code == -signal.SIGALRM, f"exit {code}, expected death by SIGALRM ({-signal.SIGALRM})"
    assert elapsed >= UNWIND_S - 1, f"ended {elapsed:.1f}s after SIGTERM, before its {UNWIND_S}s to unwind"


def test_a_trainer_of_a_dead_orchestrator_releases_at_once(stand_in_trainers):
    """When its orchestrator dies, a trainer's release (its segments unlinked) runs at once, not after the grace
    its unwinding gets (a loaded machine once let the kernel's deadline end a trainer before that grace was over,
    its segments left behind); the release runs again before the forced exit."""
    from sim.interrupt import UNWIND_S

    facts = stand_in_trainers["dead orchestrator"]
    assert "alive" in facts, f"the stand-in trainer's orchestrator never named it: {facts}"
    assert not facts["alive"], f"the trainer of a dead orchestrator still runs {UNWIND_S + 30} s on"
    times = facts["released"]
    assert times and times[0] < 4.0, f"released {times} s after its orchestrator died: expected within 4 s"


def test_the_next_run_sweeps_what_a_killed_cli_left(held):
    """SIGKILL of the CLI leaves its run directory (named with its pid) in TMPDIR, and whatever its processes
    had in /dev/shm when nobody could unlink it; the next run removes both, since their owner is dead."""
    run = held(PHASES["mid-transfer"])
    cli = run.proc.pid
    _killed(run, read_output=False)
    wait_ended(run.children, timeout=10)
    left = [p.name for p in run.tmp.iterdir()]
    assert left and all(n.startswith(f"wscf-sim-{cli}-") for n in left), f"the killed run's directory: {left}"
    orphan = pathlib.Path("/dev/shm") / f"wscf_{cli}_0123456789ab"  # a segment its process could not unlink
    orphan.write_bytes(b"\0" * 4096)
    try:
        env = dict(os.environ, TMPDIR=str(run.tmp))
        proc = subprocess.run([sys.executable, "-m", "sim", "roundtrip", "--ranks", "1", "--model-mib", "1", "--versions", "1",
                               "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert not list(run.tmp.iterdir()), f"left in TMPDIR after the next run: {list(run.tmp.iterdir())}"
        assert not orphan.exists(), f"{orphan} of the dead run {cli} was not swept"
        assert "leftover(s) of dead runs" in proc.stderr and str(orphan) in proc.stderr, proc.stderr[-2000:]
    finally:
        orphan.unlink(missing_ok=True)


def test_sweep_removes_only_our_leftovers_whose_process_is_dead(tmp_path):
    from sim.leftovers import sweep_dead_runs

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now no process's
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    live, me = os.getpid(), os.getpid()
    swept = [shm / f"wscf_{dead.pid}_00aa11bb22cc", shm / f"model_weights_status.wscf{dead.pid}x3",
             tmp / f"wscf-sim-{dead.pid}-abcd", tmp / f"wscf-ranks-{dead.pid}-efgh"]
    kept = [shm / f"wscf_{live}_00aa11bb22cc", shm / f"model_weights_status.wscf{me}x1", shm / f"other_{dead.pid}_00",
            shm / f"wscf_{dead.pid}_not-hex", tmp / f"wscf-sim-{live}-abcd", tmp / f"wscf-sim-{dead.pid}",
            tmp / f"pytest-{dead.pid}-x", shm / "wscf_1_00aa"]  # pid 1 is alive
    for path in swept + kept:
        if path.parent == tmp and path.name.startswith("wscf-"):
            path.mkdir()
            (path / "status.sock").write_bytes(b"")
        else:
            path.write_bytes(b"x")
    removed = sweep_dead_runs(shm_dir=str(shm), tmp_dir=str(tmp))
    assert sorted(removed) == sorted(map(str, swept)), removed
    assert not [p for p in swept if p.exists()] and all(p.exists() for p in kept), [p for p in kept if not p.exists()]
    assert sweep_dead_runs(shm_dir=str(shm), tmp_dir=str(tmp)) == [], "a second sweep finds nothing"


# -- usage errors ------------------------------------------------------------------------------------
USAGE = {
    "bucket below the alignment": (["--bucket-mib", "0.0001"], "104 bytes, less than the 256-byte alignment"),
    "bucket of zero": (["--bucket-mib", "0"], "--bucket-mib 0.0: must be a positive finite number"),
    "kill point past the last bucket": (["--model-mib", "2", "--bucket-mib", "0.25", "--kill-trainer-at", str(BUCKETS)],
                                        f"--kill-trainer-at {BUCKETS}: version 1 has {BUCKETS} bucket(s)"),
    "kill point negative": (["--kill-trainer-at", "-1"], "--kill-trainer-at -1: version 1 has"),
    "hold past the last bucket": (["--model-mib", "2", "--bucket-mib", "0.25", "--hold-at", f"bucket:{BUCKETS}"],
                                  f"--hold-at bucket:K {BUCKETS}: version 1 has {BUCKETS} bucket(s)"),
    "hold at an unknown phase": (["--hold-at", "bucket"], "not one of ready, bucket:K, end, verify"),
    "kill on the meta path": (["--path", "meta", "--kill-trainer-at", "0"], "--kill-trainer-at applies to the bucket path"),
    "bucket size on the meta path": (["--path", "meta", "--bucket-mib", "4"], "--bucket-mib applies to the bucket path"),
    "kill and hold together": (["--kill-trainer-at", "1", "--hold-at", "ready"], "exclude each other"),
    "NaN model": (["--model-mib", "nan"], "--model-mib nan: must be a positive finite number"),
    "infinite timeout": (["--timeout-s", "inf"], "--timeout-s inf: must be a positive finite number"),
    "zero timeout": (["--timeout-s", "0"], "--timeout-s 0.0: must be a positive finite number"),
    "no ranks": (["--ranks", "0"], "--ranks 0: must be at least 1"),
    "no versions": (["--versions", "0"], "--versions 0: must be at least 1"),
    "model larger than memory": (["--model-mib", "4194304"], "GiB of memory"),
    "buckets larger than /dev/shm": (["--model-mib", "1", "--bucket-mib", "4194304"], "GiB of /dev/shm"),
}


@pytest.mark.parametrize("case", list(USAGE))
def test_nonsensical_arguments_are_usage_errors(case, capsys):
    from sim.cli import main

    args, message = USAGE[case]
    with pytest.raises(SystemExit) as exit_info:
        main(["roundtrip", "--no-progress", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, f"{case}: exit {exit_info.value.code}, expected 2 (usage error):\n{err}"
    assert message in err, f"{case}: {message!r} not in:\n{err}"


def test_edges_that_make_sense_are_accepted():
    """One below each refused value passes the checks: a bucket of exactly the alignment, the last
    bucket as kill or hold point."""
    import argparse

    from sim.cli import _usage_problems
    from wire.protocol import ALIGN

    base = dict(ranks=1, versions=1, model_mib=2.0, timeout_s=1.0, path="bucket", kill_trainer_at=None, hold_at=None)
    model = model_spec(2.0)
    exact = argparse.Namespace(**base, bucket_mib=ALIGN / (1 << 20))
    assert _usage_problems(exact, model, ALIGN) == []
    last = argparse.Namespace(**{**base, "kill_trainer_at": BUCKETS - 1}, bucket_mib=0.25)
    assert _usage_problems(last, model, align_up(1 << 18)) == []
    hold_last = argparse.Namespace(**{**base, "hold_at": ("bucket", BUCKETS - 1)}, bucket_mib=0.25)
    assert _usage_problems(hold_last, model, align_up(1 << 18)) == []


def test_usage_error_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "sim", *RUN, "--kill-trainer-at", "99"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr and "--kill-trainer-at 99" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# -- python -m sim.ranks -------------------------------------------------------------------------------
RANKS_RUN = ["-m", "sim.ranks", "--path", "bucket", "--ranks", "2", "--cycles", "20"]


def _drain(pipe, within_s: float) -> str:
    """The rest of ``pipe`` up to EOF, which comes once every process holding its write end is gone; a process
    still holding it after ``within_s`` fails the test, named."""
    text, deadline = "", time.monotonic() + within_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([pipe], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            break
        chunk = os.read(pipe.fileno(), 65536)
        if not chunk:
            return text
        text += chunk.decode(errors="replace")
    target = os.readlink(f"/proc/self/fd/{pipe.fileno()}")
    holders = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(os.readlink(f"/proc/{p.pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{p.pid}/fd")):
                holders.append((p.pid, p.info["cmdline"]))
        except OSError:
            continue
    pytest.fail(f"still running {within_s:g}s after the job ended, holding its output: {holders}\n{text[-2000:]}")


@pytest.mark.timeout(420)  # two ranks start under paddle.distributed.launch: up to a minute on a loaded machine
@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_sim_ranks_interrupted_leaves_no_process(how):
    """``python -m sim.ranks --path bucket --ranks 2 --cycles 20`` stopped in its first cycle. A terminal's Ctrl-C
    (SIGINT to its process group): exit 130 naming the step, no traceback, the launcher, both ranks (each in a
    session of its own) and the trainers gone, its directory removed. SIGKILL of the orchestrator: nothing can
    clean up for it, yet every process it started leaves within seconds (the ranks see it gone, the trainers get
    SIGTERM from the kernel) instead of polling on, re-parented to init."""
    children = []
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="wrk"))
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, *RANKS_RUN], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # Paddle's rendezvous failing (seen in CI) is the job's to retry, once (tests/test_sim_ranks_start.py).
    text, deadline = "", time.monotonic() + 300
    while "bucket: cycle 1/20" not in text:
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        line = proc.stdout.readline() if ready else ""
        if not line:
            break
        text += line
    if "bucket: cycle 1/20" not in text:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"sim.ranks never reached its first cycle:\n{text[-3000:]}")
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        ranks = [c for c in children if "rank_worker.py" in " ".join(_cmdline(c)) and "paddle.distributed.launch" not in _cmdline(c)]
        assert len(ranks) == 2, f"expected 2 rank workers among {[_cmdline(c) for c in children]}"
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.kill()
        proc.wait(60)
        gone, alive = wait_ended(children, timeout=15)
        output = text + _drain(proc.stdout, 15)  # EOF once no process of the job holds the pipe
        assert not alive, f"{how}: still running: {[(p.pid, _cmdline(p)) for p in alive]}\n{output[-3000:]}"
        pids = {c.pid for c in children}
        segments = [n for n in leaked_segments() if _pid(n) in pids]
        assert not segments, f"{how}: segments left in /dev/shm: {segments}"
        if how == "ctrl-c":
            assert proc.returncode == 130, f"exit {proc.returncode}, expected 130:\n{output[-3000:]}"
            for bad in ("Traceback", "KeyboardInterrupt"):
                assert bad not in output, f"{bad!r} in the output:\n{output[-3000:]}"
            assert "sim.ranks interrupted by SIGINT during bucket: cycle 1/20" in output, output[-3000:]
            assert not list(tmp.iterdir()), f"left in TMPDIR: {list(tmp.iterdir())}"
    finally:
        for child in children:
            if child.is_running():
                child.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_sim_ranks_help_names_the_command_and_says_what_it_does():
    proc = subprocess.run([sys.executable, "-m", "sim.ranks", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    flat = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and flat.startswith("usage: python -m sim.ranks "), proc.stdout
    assert "driven through the shared status cell the way the engine's API drives it." in flat, proc.stdout
    assert "130 SIGINT, 143 SIGTERM" in flat, proc.stdout


# -- python -m sim.ranks --hosts 2 ---------------------------------------------------------------------
def _our_namespaces(pid: int) -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.startswith(f"wscf{pid}h")]


@pytest.fixture(scope="module")
def two_hosts():
    from sim.hosts import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"two hosts need network namespaces, which cannot be made here: {reason}")


@pytest.mark.timeout(420)  # four ranks start under two launchers: up to a minute or two on a loaded machine
def test_sim_ranks_on_two_hosts(two_hosts, tmp_path):
    """``python -m sim.ranks --hosts 2``: two launchers (``--nnodes 2``), each in a network namespace of its own,
    the master on the first one's address; ranks 2 and 3 are the second host's local ranks 0 and 1, every shard
    arrives bit for bit, and the namespaces are gone when it exits."""
    out = tmp_path / "job.json"
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "sim.ranks", "--hosts", "2", "--path", "snapshot", "--cycles", "2",
                             "--json", str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output[-3000:]}"
    assert "snapshot: 2 cycles on 2 hosts x 2 ranks: every shard bit for bit" in output, output[-3000:]
    result = json.loads(out.read_text())
    joined = {int(r): e for r, e in result["joined"].items()}
    addresses = result["addresses"]
    assert sorted(joined) == [0, 1, 2, 3] and all(e["world"] == 4 for e in joined.values()), joined
    assert [(joined[r]["host"], joined[r]["local_rank"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)], joined
    assert all(e["master"].split(":")[0] == addresses[0] for e in joined.values()), (addresses, joined)
    assert [joined[r]["endpoint"].split(":")[0] for r in range(4)] == [addresses[0]] * 2 + [addresses[1]] * 2, joined
    assert not _our_namespaces(proc.pid), f"namespaces left: {_our_namespaces(proc.pid)}"
    assert not list(tmp_path.glob("wscf-ranks-*")), list(tmp_path.iterdir())


def test_hosts_of_a_dead_run_are_swept(two_hosts):
    """A SIGKILLed run cannot remove its namespaces: the next one deletes those whose pid is dead, and no other."""
    from sim import hosts

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f"wscf{dead.pid}h0", f"wscf{os.getpid()}h7"]  # a dead run's, and a live one's (this process)
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
        swept = hosts.sweep_dead()
        assert f"netns {names[0]}" in swept and _our_namespaces(dead.pid) == [], (swept, _our_namespaces(dead.pid))
        assert _our_namespaces(os.getpid()) == [names[1]], f"a live run's namespace was swept: {swept}"
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)


def test_two_hosts_unavailable_names_why(monkeypatch):
    """Not root: two hosts cannot be made, and the reason names the command and the uid (the tier skips with it)."""
    from sim import hosts

    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    reason = hosts.unavailable()
    assert reason and "`ip netns add` needs root" in reason and "uid 1000" in reason, reason
