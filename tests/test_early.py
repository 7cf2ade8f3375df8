"""The background jobs of the project's tests (tests/early.py): the order they impose and the processes they
start. Their results are judged where they are read (the kill matrix, the FastDeploy gates)."""
import os
import subprocess
import sys
import time
import types

import psutil
import pytest

from tests import early
from tests.conftest import REPO


def _item(name: str, fixtures=(), before=False, after=False):
    module = types.SimpleNamespace(RUNS_BEFORE_THE_JOBS=before, RUNS_AFTER_THE_JOBS=after)
    return types.SimpleNamespace(name=name, fixturenames=list(fixtures), module=module)


def test_the_readers_of_each_job_run_last_in_job_order_and_the_machine_judges_first():
    import tests.test_fastdeploy_adapter  # noqa: F401  (their modules declare the two other jobs)
    import tests.test_mutant_zoo  # noqa: F401

    jobs = list(early.JOBS)
    assert jobs[:1] == ["reference_report"] and {"reports", "mutant_runs"} <= set(jobs), jobs
    items = [_item("zoo", ["mutant_runs"]), _item("plain"), _item("gate", ["reports", "tmp_path"]),
             _item("both", ["mutant_runs", "reference_report"]), _item("machine", before=True), _item("plain2"),
             _item("after", after=True), _item("after-reader", ["reports"], after=True)]
    early.reorder(items)
    got = [i.name for i in items]
    by_job = {name: jobs.index(name) for name in jobs}
    # the machine's judges first, the rest, the readers; last what needs the machine the jobs no longer load
    assert got[:3] == ["machine", "plain", "plain2"] and got[-2:] == ["after", "after-reader"], got
    # "both" reads the reference run, which starts first: it runs with that job's readers.
    tail = got[3:-2]
    order = [min(by_job[f] for f in next(i for i in items if i.name == n).fixturenames if f in by_job) for n in tail]
    assert order == sorted(order) and tail.index("both") < tail.index("zoo"), (tail, order)


def test_a_job_process_past_its_timeout_dies_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "grandchild"
    script = f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        early.run([sys.executable, "-c", script], REPO, timeout=3, cores=0)
    assert time.monotonic() - start < 30, "the timeout did not end the job"
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the job's own child {grandchild} outlived the job's timeout"
        time.sleep(0.05)


def test_a_job_process_gets_the_environment_of_the_start_not_a_test_s(monkeypatch):
    assert early._env is not None, "the autouse fixture starts the jobs (and takes the environment) before a test"
    monkeypatch.setenv("EARLY_JOB_PROBE", "set by a test for a moment")
    proc = early.run([sys.executable, "-c", "import os; print(os.environ.get('EARLY_JOB_PROBE'))"], REPO, timeout=60,
                     cores=0)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", (proc.returncode, proc.stdout, proc.stderr)


def test_a_job_after_the_others_starts_once_every_other_job_is_done():
    import concurrent.futures
    import threading

    release = [threading.Event(), threading.Event()]
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        others = [pool.submit(e.wait, 30) for e in release]
        last = pool.submit(early._after, others, lambda factory: started.set() or factory, "factory")
        release[0].set()
        assert not started.wait(0.5), "it started while a job still ran"
        release[1].set()
        assert last.result(timeout=30) == "factory" and started.is_set()
    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("a job failed"))
    assert early._after([failed], lambda factory: "ran", None) == "ran", "a failed job's error is its readers' to judge"
    early._stopping.set()  # an interrupted session: the job never starts
    try:
        with pytest.raises(RuntimeError, match="ended before this job started"):
            early._after([failed], lambda factory: pytest.fail("started after the session ended"), None)
    finally:
        early._stopping.clear()


def test_a_job_process_runs_at_the_jobs_priority_unless_told_otherwise():
    probe = [sys.executable, "-c", "import os; print(os.nice(0))"]
    mine = os.nice(0)
    for nice, expected in ((None, min(mine + early.NICE, 19)), (0, mine)):
        proc = (early.run(probe, REPO, timeout=60, cores=0) if nice is None
                else early.run(probe, REPO, timeout=60, nice=nice, cores=0))
        assert proc.returncode == 0 and int(proc.stdout) == expected, (nice, proc.stdout, proc.stderr)


def test_the_jobs_processes_never_hold_more_than_the_pools_cores_and_are_served_in_order():
    """Three callers of a two-core pool: one wanting both, asked first while another holds one, is served before a
    later caller wanting one (never passed over), and the cores held at once never exceed two."""
    import threading

    pool = early.Cores(2)
    held, most, order, lock = [0], [0], [], threading.Lock()

    def use(name, n, hold_s, asked=None):
        with pool.take(n):
            with lock:
                held[0] += n
                most[0] = max(most[0], held[0])
                order.append(name)
            if asked is not None:
                asked.wait(5)
            time.sleep(hold_s)
            with lock:
                held[0] -= n

    asked = threading.Event()
    first = threading.Thread(target=use, args=("one", 1, 0.2, asked))
    first.start()
    while not order:
        time.sleep(0.001)
    both = threading.Thread(target=use, args=("both", 2, 0.05))
    both.start()
    while not pool._queue:
        time.sleep(0.001)
    later = threading.Thread(target=use, args=("later", 1, 0.05))
    later.start()
    while len(pool._queue) < 2:
        time.sleep(0.001)
    asked.set()
    for t in (first, both, later):
        t.join(10)
    assert order == ["one", "both", "later"] and most[0] == 2 and pool.free == 2, (order, most, pool.free)
