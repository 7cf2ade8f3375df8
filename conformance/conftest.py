"""The multi-rank job shared by the MR and CYCLE tiers (test_multirank.py, test_cycles.py): run once per
session, only when a selected test needs it (its tier named by -m, its capabilities claimed); each case's own
temporary directory; and the suite's processes' exit."""
import atexit
import gc
import itertools
import re
import shutil

import pytest

from conformance.harness import removes_case_dir
from sim.hosts import Unavailable


@pytest.fixture(scope="session")
def rank_job(request):
    """The result of ``sim.ranks.Job.run()`` for the implementation under test, on every path it claims
    (see ``multirank_plan``). A job that cannot be driven fails every test that uses it, with its error."""
    from conformance import multirank_plan  # (here: a pytest-xdist controller, which loads this file too, never runs it)
    from conformance.plugin import _adapter

    adapter = _adapter(request.config)
    selected = [item for item in request.session.items if "rank_job" in getattr(item, "fixturenames", ())]
    try:
        return multirank_plan.run(adapter, request.config, selected)
    except Unavailable as e:  # --hosts 2 where network namespaces cannot be made: skipped, never passed
        pytest.skip(f"--hosts 2 needs two network namespaces, which cannot be made here: {e}")
    except Exception as e:  # noqa: BLE001 (each test reports it)
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.fixture(scope="session")
def read_cap_built(tmp_path_factory):
    """(path of the read-capping library (conformance.read_cap), None), built once per run with the machine's
    C compiler; or (None, why it cannot be built here)."""
    from conformance import read_cap

    try:
        return read_cap.build(str(tmp_path_factory.mktemp("read_cap"))), None
    except read_cap.Unavailable as e:
        return None, str(e)


@pytest.fixture(scope="session")
def read_cap_library(read_cap_built):
    """The read-capping library's path; the capped-read cases skip, saying why, where it cannot be built."""
    library, why = read_cap_built
    if library is None:
        pytest.skip(f"the capped-read cases (FILE-OVER-2GIB, VER-FILE-SAFE) cannot run on this machine: {why}")
    return library


@pytest.fixture(scope="module")
def read_holder(read_cap_built):
    """A prepared ``read_cap.Capped`` whose ``hold()`` a forked child puts in, or None where the library cannot
    be built or put in (the case then steps the loader with signals instead, a race it may lose)."""
    from conformance import read_cap

    library, _why = read_cap_built
    if library is None:
        return None
    try:
        holder = read_cap.Capped(library)
        holder.prepare()
    except read_cap.Unavailable:
        return None
    return holder


@pytest.fixture(scope="module")
def read_capper(read_cap_library):
    """A ``read_cap.Capped`` for this module's tests: the objects loaded in this process scanned once
    (``prepare()`` writes nothing); a forked child calls ``install()`` to cap its own reads."""
    from conformance import read_cap

    try:
        capper = read_cap.Capped(read_cap_library)
        capper.prepare()
    except read_cap.Unavailable as e:
        pytest.skip(f"the capped-read cases (FILE-OVER-2GIB, VER-FILE-SAFE) cannot run on this machine: {e}")
    return capper


_NEXT_NUMBER: dict = {}
_PASSED = pytest.StashKey[dict]()  # item -> {phase: passed}, for the case's own directory (tmp_path below)


def _leave_the_heap() -> None:
    """At exit, after pytest has finished (its last collections for unraisable exceptions included): no more
    garbage collection. The interpreter's exit otherwise collects what is still alive, and a pytest-xdist worker
    holds the Paddle layers, sessions and modules of every case it ran: 0.7 s before its controller, which waits
    for it, may end (docs/suite-run-time.md). Objects still alive at exit are freed by their reference counts as
    the interpreter clears its modules; Python never promised to finalize the rest (the language reference,
    ``object.__del__``)."""
    gc.disable()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    atexit.register(_leave_the_heap)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    item.stash.setdefault(_PASSED, {})[report.when] = report.passed


@pytest.fixture
def tmp_path(request, tmp_path_factory):
    """A new, empty directory for the case (mode 0700), as pytest's own: under the run's base temporary directory,
    named after the case (its first 30 characters) and a number. Unlike pytest's, it leaves no ``<name>current``
    link beside it: making that link costs an unlink and a symlink per case, about 1 ms on the project's machine,
    against 0.15 ms for the directory (docs/suite-run-time.md). As it ends, the case's directory is removed as
    pytest's ``tmp_path_retention_policy`` says (``harness.removes_case_dir``; the project's own runs: "failed")."""
    name = re.sub(r"[\W]", "_", request.node.name)[:30]
    base = tmp_path_factory.getbasetemp()
    numbers = _NEXT_NUMBER.setdefault((str(base), name), itertools.count())
    while True:
        path = base / f"{name}{next(numbers)}"
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # made by tmp_path_factory.mktemp(name) or an earlier run's case: the next number
            continue
        break
    yield path
    phases = request.node.stash.get(_PASSED, {})
    if removes_case_dir(request.config, bool(phases.get("call")) and all(phases.values())):
        shutil.rmtree(path, ignore_errors=True)
