"""``sim.ranks``'s start-up against Paddle's rendezvous failing, the way it failed in CI: rank 0, the store's
master, waits inside ``init_parallel_env`` for a peer that never comes, holding the GIL (no Python thread of
it runs, so it cannot leave by itself). The job bounds that wait, names every rank's state with the stuck
rank's stack, kills the first start's processes and starts the ranks again; the job then runs as usual."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from sim.ranks import Job, PathPlan, Step, default_params
from tests import early
from tests.conftest import REPO
from tests.processes import ended, wait_ended

# Last, once the background jobs are done (tests/early.py): beside them a rank was still importing Paddle 15 s on.
RUNS_AFTER_THE_JOBS = True
START_S = 30.0  # the start-up's deadline here: rank 0 must reach init_parallel_env (Paddle imported) and the second
# start join within it on a loaded machine (15 s: a rank beside two suite runs was still importing Paddle)


def _gone(pid: int) -> bool:
    try:
        return ended(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return True


HOSTS = (1, 2)


# One stalled-rendezvous job, run in a process of its own: hosts, START_S, the result's path.
_STALLED = """
import json, sys
from sim.ranks import Job, PathPlan, Step, default_params
hosts, start_s, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
plan = PathPlan("bucket", default_params(0.25), [Step(1)], cycles=1)
result = Job("reference", [plan], ranks=2 * hosts, hosts=hosts, stall_join_rank=1, start_timeout_s=start_s,
             step_timeout_s=start_s).run()
with open(out, "w") as f:
    json.dump(result, f)
"""


@early.job("stalled_rendezvous", after_the_others=True)
def _stalled_rendezvous_runs(tmp_path_factory):
    """hosts -> the job's result (or why it cannot run here), one after the other. Each waits out its first
    start's START_S: a job started once the other jobs are done, so that those waits overlap the simulator's tests
    instead of adding to them (its deadlines are kept from the other jobs' load: beside them a rank was still
    importing Paddle 15 s on). Each runs in a process of its own, with the environment of the session's start
    and at the foreground's priority: in a thread of this process it would read os.environ while a test changes
    it (the devices case sets CUDA_VISIBLE_DEVICES: no rank then joined in any start)."""
    from sim.hosts import unavailable

    results = {}
    for hosts in HOSTS:
        if hosts > 1 and unavailable():
            results[hosts] = {"skip": f"two hosts need network namespaces, which cannot be made here: {unavailable()}"}
            continue
        out = tmp_path_factory.mktemp(f"stalled-{hosts}") / "result.json"
        proc = early.run([sys.executable, "-c", _STALLED, str(hosts), str(START_S), str(out)], REPO, timeout=280,
                         nice=0)
        if out.exists():
            results[hosts] = json.loads(out.read_text())
        else:
            results[hosts] = {"error": f"the job's process exited {proc.returncode} with no result:\n"
                                       f"{(proc.stdout + proc.stderr)[-3000:]}"}
    return results


@pytest.fixture(scope="module")
def stalled_rendezvous(tmp_path_factory):
    return early.result("stalled_rendezvous", tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hosts", HOSTS, ids=["one-host", "two-hosts"])
def test_a_rendezvous_that_never_completes_is_named_and_started_once_more(stalled_rendezvous, hosts):
    """On two hosts (2 x 2 ranks, a launcher in each network namespace) the second start's master listens on
    a port of its own."""
    result = stalled_rendezvous[hosts]
    if "skip" in result:
        pytest.skip(result["skip"])
    assert "error" not in result, result.get("error")
    first = result.get("start_failures", [""])[0]
    assert first.startswith(f"not every rank joined within {START_S:g}s"), first[:3000]
    states = dict(re.findall(r"^rank (\d): not joined \(pid \d+\); its events (.*)$", first, re.M))
    assert states == {str(r): "['joining']" for r in range(2 * hosts)}, first[:3000]
    # rank 0's log ends with the stack faulthandler wrote on SIGUSR1: where it waited
    rank0 = first[first.index("rank 0: not joined"):first.index("rank 1: not joined")]
    assert "in init_parallel_env" in rank0, rank0
    # the second start: both ranks joined, the update arrived bit for bit on each
    assert sorted(map(int, result["joined"])) == list(range(2 * hosts)), result["joined"]  # JSON's keys
    (path,) = result["paths"]
    (cycle,) = path["cycles"]
    for r, event in cycle["update"].items():
        assert event["event"] == "updated" and event["digests"] == cycle["sent"][r], (r, event["event"])
    # nothing of the first start is left running
    first_pids = [int(pid) for pid in re.findall(r"^rank \d: not joined \(pid (\d+)\)", first, re.M)]
    assert len(first_pids) == 2 * hosts, first[:3000]
    assert all(_gone(pid) for pid in first_pids), [(pid, psutil.Process(pid).cmdline()) for pid in first_pids
                                                   if not _gone(pid)]
    joined_pids = {e["pid"] for e in result["joined"].values()}
    assert not joined_pids & set(first_pids), (joined_pids, first_pids)



@pytest.mark.timeout(240)  # three starts of 60 s each where the devices made them fail
def test_ranks_join_whatever_devices_the_orchestrator_sees(monkeypatch):
    """CUDA_VISIBLE_DEVICES (and FLAGS_selected_gpus) in the orchestrator's environment, as a GPU machine's
    shell or a test that left a rank's variables behind has them: Paddle's launcher would take the CPU ranks
    for GPU ones and leave the backend unset, and no rank would join in any start. The job runs (a start that
    Paddle's own store fails, now and then, is started again: no start here fails for the devices)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,2")
    monkeypatch.setenv("FLAGS_selected_gpus", "0")
    job = Job("reference", [PathPlan("bucket", default_params(0.25), [Step(1)], cycles=1)], ranks=2,
              start_timeout_s=60.0, agree_timeout_s=60.0, transfer_timeout_s=60.0)  # (a healthy step, loaded)
    result = job.run()
    assert "error" not in result, result["error"]
    device_path = [f for f in result.get("start_failures", []) if "wait_for_master" in f]
    assert not device_path, f"a start failed the way a device environment makes it fail: {device_path[0][:3000]}"
    (cycle,) = result["paths"][0]["cycles"]
    assert all(e["event"] == "updated" for e in cycle["update"].values()), cycle["update"]


@pytest.mark.timeout(180)
def test_ranks_stuck_in_the_rendezvous_die_with_a_killed_orchestrator(tmp_path):
    """The orchestrator SIGKILLed while rank 0 waits in the rendezvous (the GIL held: its orphan watch cannot
    run) and rank 1 is held out of it: the kernel ends the launcher, and with it both ranks, within seconds."""
    script = ("from sim.ranks import Job, PathPlan, Step, default_params\n"
              "Job('reference', [PathPlan('bucket', default_params(0.25), [Step(1)], cycles=1)], ranks=2,"
              " stall_join_rank=1, start_timeout_s=120).run()\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, start_new_session=True)
    try:
        deadline, joining = time.monotonic() + 120, []
        while len(joining) < 2 and time.monotonic() < deadline:
            joining = [json.loads(line) for f in tmp_path.glob("wscf-ranks-*/rank*.jsonl")
                       for line in f.read_text().splitlines() if '"joining"' in line]
            time.sleep(0.1)
        assert len(joining) == 2, f"the ranks never began to join: {joining}"
        time.sleep(1.0)  # rank 0 is inside init_parallel_env by now (its store listens)
        ranks = [psutil.Process(e["pid"]) for e in joining]
        proc.kill()
        proc.wait(10)
        gone, alive = wait_ended(ranks, timeout=15)
        assert not alive, f"ranks still running 15 s after their orchestrator was killed: {[p.pid for p in alive]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for leftover in psutil.process_iter(["cmdline"]):  # a launcher or rank of this run that outlived it
            if str(tmp_path) in " ".join(leftover.info["cmdline"] or []):
                with contextlib.suppress(psutil.NoSuchProcess):
                    leftover.kill()
