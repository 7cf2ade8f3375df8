"""The multi-rank job shared by the MR and CYCLE tiers (test_multirank.py, test_cycles.py): run once per
session, only when a selected test needs it (its tier named by -m, its capabilities claimed)."""
import pytest

from conformance import multirank_plan
from sim.hosts import Unavailable


@pytest.fixture(scope="session")
def rank_job(request):
    """The result of ``sim.ranks.Job.run()`` for the implementation under test, on every path it claims
    (see ``multirank_plan``). A job that cannot be driven fails every test that uses it, with its error."""
    from conformance.plugin import _adapter

    adapter = _adapter(request.config)
    selected = [item for item in request.session.items if "rank_job" in getattr(item, "fixturenames", ())]
    try:
        return multirank_plan.run(adapter, request.config, selected)
    except Unavailable as e:  # --hosts 2 where network namespaces cannot be made: skipped, never passed
        pytest.skip(f"--hosts 2 needs two network namespaces, which cannot be made here: {e}")
    except Exception as e:  # noqa: BLE001 (each test reports it)
        return {"error": f"{type(e).__name__}: {e}"}
