import json
import os
import signal

from tests import early, pytest_server

import paddle  # noqa: F401  (its first import sets OMP_NUM_THREADS and CUSTOM_DEVICE_ROOT: here, before any test)
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sigint_at_default() -> None:
    """``preexec_fn`` for a child a test sends SIGINT: the signal at its default disposition, as a terminal's
    child has it. A run started in the background by a non-interactive shell inherits SIGINT ignored, and
    Python leaves an ignored SIGINT ignored (no KeyboardInterrupt), so the test would measure the shell."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def probe_collection(probe: str, out) -> object:
    """The suite collected against the reference (``--collect-only``, through the fork server) with the probe
    plugin ``probe`` (a module of tests/), which writes JSON to the path in ``PROBE_OUT``: what it wrote."""
    env = {**os.environ, "PROBE_OUT": str(out)}
    proc = pytest_server.run(["conformance", "--impl=reference", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-p", probe], REPO, timeout=300, env=env)
    assert proc.returncode == 0 and os.path.exists(out), (proc.stdout + proc.stderr)[-3000:]
    with open(out) as f:
        return json.load(f)


def run_conformance(impl_args: list[str], report_path, extra: list[str] = (), timeout: int = 1500, in_job=False):
    """Run the conformance suite as a subprocess would (forked from tests/pytest_server.py); return (exit code,
    report dict, output). ``in_job``: from a background job (tests/early.py: the jobs' environment and priority,
    killed with the session). ``timeout`` guards against a hang only: a whole run of the suite alone takes about
    2 minutes on 2 idle cores; in a job it starts once the cores it uses are free (tests/early.py)."""
    # Native tracebacks: pytest's own style parses a test module's whole source per traceback entry, and the
    # FastDeploy stand-ins fail hundreds of tests on purpose (the parts gate: 23.3 CPU-s, 14.7 native; the same
    # verdicts, root causes and messages).
    args = ["conformance", "-q", "-p", "no:cacheprovider", "--tb=native", f"--conformance-report={report_path}",
            *impl_args, *extra]
    if in_job:
        workers = args[args.index("-n") + 1] if "-n" in args else "1"
        proc = early.run_pytest(args, REPO, timeout, cores=int(workers) if workers.isdigit() else early.CORES)
    else:
        proc = pytest_server.run(args, REPO, timeout)
    report = None
    if os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)
    return proc.returncode, report, proc.stdout + proc.stderr


@pytest.fixture(autouse=True)
def environment_left_as_found(request):
    """Every test leaves ``os.environ`` as it found it: a variable left behind reaches every later test and
    every process they start. (A rank's CUDA_VISIBLE_DEVICES, left by test_agreement's in-process run, made
    paddle.distributed.launch take the CPU ranks of every later multi-rank job for GPU ones: none joined.)"""
    before = dict(os.environ)
    yield
    changed = {k: (before.get(k), os.environ.get(k)) for k in sorted(before.keys() | os.environ.keys())
               if before.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST"}  # pytest's own, per phase
    if changed:
        os.environ.clear()
        os.environ.update(before)
        pytest.fail(f"{request.node.nodeid} left os.environ changed, name: (before, after): {changed}")


def pytest_collection_modifyitems(items):
    early.reorder(items)
    for item in items:
        if any(early._uses(item, name) for name in early.JOBS):
            # Its setup waits for the job, queued behind the others for the jobs' cores (tests/early.py): bounded by
            # the job's own processes (each has its timeout), not by a test's; closest, so it is the one in force.
            item.add_marker(pytest.mark.timeout(early.READER_TIMEOUT_S), append=False)


@pytest.fixture(autouse=True)
def early_jobs(request, tmp_path_factory):
    """The long setups (tests/early.py) start with the session's first test, or its first after the modules
    that judge every process and segment of the machine (``RUNS_BEFORE_THE_JOBS``)."""
    if not getattr(request.module, "RUNS_BEFORE_THE_JOBS", False):
        early.start(request.session.items, tmp_path_factory)


def pytest_sessionfinish(session):
    early.stop()  # what still runs (an interrupted session) is killed
    pytest_server.stop()


@early.job("reference_report")
def _reference_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "report.json"
    return run_conformance(["--impl=reference"], path, in_job=True)


@pytest.fixture(scope="session")
def reference_report(tmp_path_factory):
    """The full conformance run against the reference, once per session: (exit code, report, output)."""
    return early.result("reference_report", tmp_path_factory)


# The worked example of docs/adapters.md (tests/test_example_adapter.py), and the run an installed suite must
# repeat verdict for verdict (tests/test_install.py).
EXAMPLE_ADAPTER = "docs/example_adapter.py:MineAdapter"


@early.job("example_report")
def _example_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("example") / "report.json"
    return run_conformance([f"--impl={EXAMPLE_ADAPTER}"], path, in_job=True)


@pytest.fixture(scope="session")
def example_report(tmp_path_factory):
    """The full conformance run against docs/example_adapter.py, from the checkout's root, once per session:
    (exit code, report, output)."""
    return early.result("example_report", tmp_path_factory)


def unstarted_jobs(report: dict) -> list[str]:
    """The tests of a conformance report that failed because their multi-rank job's ranks never joined
    (``sim.ranks``: the start-up, before any rank loads the implementation). Such a failure says nothing
    of the implementation: counted as a kill, or as a pinned failure, it would hide a broken harness."""
    from sim.ranks import NEVER_JOINED

    return [t["nodeid"] for t in report["tests"] if NEVER_JOINED in (t.get("message") or "")]
