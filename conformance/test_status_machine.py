"""The status state machine: the shared status cell and the worker's loop against it. Spec: SPEC.md § STATUS.

The cell is a real shared-memory int32 created by the suite as the engine does (``fixtures.status_cell``);
the worker's loop runs in a forked child (``loop_driver``) while this process plays the API and the
trainer, writing CLEARING and UPDATING at the moments a seeded schedule picks (``loop_schedule``): at
the worker's hooks (its broadcast of the value it read, the model run, the end of an iteration) or a
seeded number of microseconds after its CLEARED. Every failure names its seed and schedule;
``CONFORMANCE_LOOP_SEED=N`` reruns that seed alone.
"""
import hashlib

import numpy as np
import pytest

from conformance import check
from conformance import loop_schedule as L
from conformance.harness import Worker
from conformance.path_sources import CAPS, Sources
from fixtures import models as M
from fixtures import status_cell as C

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))
LOOP = ("status.cell", "snapshot.single")
VALUES = {"NORMAL": C.NORMAL, "UPDATING": C.UPDATING, "CLEARING": C.CLEARING, "CLEARED": C.CLEARED, "other(7)": 7}


@pytest.fixture
def cell():
    with C.Cell(C.NORMAL) as c:
        yield c


def _loaded(loader, cell, spec=SPEC, **options):
    """A session of (rank 0, GPU 0) on ``cell``, first load of version 1 done."""
    L.publish(loader.model_dir, spec, 1)
    session = loader.open(spec, options={"status_cell": cell.name, **options})
    session.update()
    return session


def _digests(spec, version):
    return {n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in M.state(spec, version=version).items()}


def _run(loader, cell, *, block, count, base):
    session = _loaded(loader, cell)
    seed_list = L.seeds(count, base)
    outcome = L.run(session, cell, loader.model_dir, SPEC, block=block, seed_list=seed_list)
    return outcome, seed_list


def _violations(outcome, invariant, where):
    found = outcome.violations.get(invariant, [])
    check.that(not found, f"{where}: {len(found)} violation(s):\n  " + "\n  ".join(found[:5]))


def _completed(outcome, seed_list, where):
    """Every seed's cycle ran to NORMAL and the worker ends on the last version, bit for bit."""
    stuck = outcome.violations.get(L.PROGRESS, [])
    check.that(not stuck and outcome.cycles == len(seed_list),
               f"{where}: {outcome.cycles}/{len(seed_list)} cycles completed; " + "; ".join(stuck[:3]))
    report = outcome.report or {}
    check.that("error" not in report, f"{where}: the worker loop failed: {report.get('error')}")
    last = outcome.versions[-1] if outcome.versions else 1
    check.equal(report.get("digests"), _digests(SPEC, last), f"{where}: sha256 of every parameter after the last cycle (version {last})")


@pytest.mark.rule("STATUS-REQUEST-KEPT")
@pytest.mark.parametrize("block,count", [pytest.param(False, 24, marks=pytest.mark.requires(*LOOP), id="non-blocking"),
                                         pytest.param(True, 6, marks=pytest.mark.requires(*LOOP), id="blocking")])
def test_request_never_overwritten(loader, cell, block, count):
    outcome, seed_list = _run(loader, cell, block=block, count=count, base=100 if not block else 500)
    where = f"worker loop (block={block}), seeds {seed_list[0]}..{seed_list[-1]}"
    _violations(outcome, L.KEPT, where)
    _completed(outcome, seed_list, where)


@pytest.mark.rule("STATUS-NO-RUN-AFTER-CHANGE")
@pytest.mark.parametrize("block,count", [pytest.param(False, 8, marks=pytest.mark.requires(*LOOP), id="non-blocking"),
                                         pytest.param(True, 3, marks=pytest.mark.requires(*LOOP), id="blocking")])
def test_model_never_runs_in_the_changing_iteration(loader, cell, block, count):
    outcome, seed_list = _run(loader, cell, block=block, count=count, base=200 if not block else 600)
    where = f"worker loop (block={block}), seeds {seed_list[0]}..{seed_list[-1]}"
    _violations(outcome, L.NO_RUN, where)
    runs = sum(1 for kind, _, _ in outcome.events if kind == "run")
    check.that(runs > 0, f"{where}: the loop never ran the model at NORMAL: the rule was not exercised")
    _completed(outcome, seed_list, where)


@pytest.mark.rule("STATUS-NONBLOCK-RETURNS")
@pytest.mark.requires(*LOOP)
def test_nonblocking_loop_returns_at_cleared(loader, cell):
    outcome, seed_list = _run(loader, cell, block=False, count=6, base=300)
    where = f"non-blocking worker loop, seeds {seed_list[0]}..{seed_list[-1]}"
    _violations(outcome, L.NONBLOCK, where)
    _completed(outcome, seed_list, where)


@pytest.mark.rule("STATUS-BLOCK-WAITS")
@pytest.mark.requires(*LOOP)
def test_blocking_loop_stays_until_updated(loader, cell):
    outcome, seed_list = _run(loader, cell, block=True, count=4, base=700)
    where = f"blocking worker loop, seeds {seed_list[0]}..{seed_list[-1]}"
    _violations(outcome, L.BLOCK, where)
    _completed(outcome, seed_list, where)
