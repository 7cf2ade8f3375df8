"""The draft (MTP) model beside the main one, on every path: both updated, neither left stale, and a fault
in either named. Spec: SPEC.md § DRAFT.

Each test runs one path of ``conformance.paths.PATHS`` (the single snapshot file, ipc metas, buckets, an
rsync or a GDR stream) through a sequence of updates on one session: snapshot, ipc and buckets clear
before each update after the first (their contract), the streamed paths update in place (``Route.clear``).
The cases are generated over each rule's declared modes (SPEC.md: path x staged, every pair): the clear-first
paths also with the session opened staged (a stage that commits only the main model's tensors, or trusts
itself complete, leaves the draft stale).
"""
import numpy as np
import pytest

from conformance import check, modes
from conformance.paths import route  # noqa: F401 - route is a fixture
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S

MAIN = (("embed.weight", "bfloat16", (8, 4)), ("model.layers.0.mlp.weight", "float32", (4, 8)), ("norm.bias", "float16", (4,)))
MTP = (("model.layers.2.eh_proj.weight", "float32", (4, 4)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))
SPEC = M.spec(*MAIN, mtp=[MTP])
MAIN_NAMES = [n for n, _, _ in MAIN]
MTP_NAMES = [n for n, _, _ in MTP]
MTP_LAYER = 2  # the MTP model serves layer 2 (GDR routes model.layers.2.* to it)


def _params(rule):
    """The rule's cases over its declared modes (SPEC.md: path x staged, every pair): each needs ``mtp``."""
    return modes.params(rule, requires=lambda c: [*modes.default_requires(c), "mtp"])


def _run(rt, states, check_each, combo):
    """Open a session (staged when the case is) and run one update per state; ``check_each(i, session,
    outcome)`` judges update i, ``outcome`` the exception it raised or None."""
    session = rt.open(SPEC, options={"staged": True} if combo["staged"] == "staged" else None)
    S.mark_mtp_layers(session.models, MTP_LAYER)
    for i, state in enumerate(states):
        rt.publish(0, state, i + 1)
        if i:
            rt.clear(0)
        try:
            rt.update(0)
            outcome = None
        except Exception as e:  # noqa: BLE001 - judged by check_each
            outcome = e
        check_each(i, session, outcome)
    return session


def _expect_loaded(path, i, session, outcome, state):
    """Update i succeeded and both models hold ``state``."""
    check.that(outcome is None, f"{path}: update {i + 1} failed: {outcome!r}")
    check.params_equal(session.observe(), state, f"{path}: update {i + 1}, main + MTP")


def _expect_error(outcome, names, where):
    """The update failed with an error naming every one of ``names``."""
    check.that(outcome is not None, f"{where}: the update succeeded")
    message = str(outcome)
    missing = [n for n in names if n not in message]
    check.that(not missing, f"{where}: {type(outcome).__name__} {message!r} does not name {missing}")


# -- DRAFT-PAIR-UPDATED ----------------------------------------------------------------------------
@pytest.mark.rule("DRAFT-PAIR-UPDATED")
@pytest.mark.parametrize("combo", _params("DRAFT-PAIR-UPDATED"))
def test_main_and_draft_updated_together(route, combo):
    path = combo["path"]
    states = [M.state(SPEC, version=v) for v in (1, 2, 3)]

    _run(route(path), states, lambda i, session, outcome: _expect_loaded(path, i, session, outcome, states[i]), combo)


# -- DRAFT-NOT-STALE -------------------------------------------------------------------------------
@pytest.mark.rule("DRAFT-NOT-STALE")
@pytest.mark.parametrize("combo", _params("DRAFT-NOT-STALE"))
def test_update_leaving_a_model_stale_fails(route, combo):
    """Version 1, then version 2 without any MTP tensor, then without any main tensor (each must fail naming
    every parameter it would leave behind), then version 3 whole."""
    path = combo["path"]
    v1, v2, v3 = (M.state(SPEC, version=v) for v in (1, 2, 3))
    states = [v1, {n: v2[n] for n in MAIN_NAMES}, {n: v2[n] for n in MTP_NAMES}, v3]
    stale = {1: ("MTP", MTP_NAMES), 2: ("main", MAIN_NAMES)}

    def judge(i, session, outcome):
        if i in stale:
            which, names = stale[i]
            where = f"{path}: update carrying no {which} tensor"
            _expect_error(outcome, names, where)
            check.status_not(session, "NORMAL", where)
        else:
            _expect_loaded(path, i, session, outcome, states[i])

    _run(route(path), states, judge, combo)


# -- DRAFT-FAULT-NAMED -----------------------------------------------------------------------------
@pytest.mark.rule("DRAFT-FAULT-NAMED")
@pytest.mark.parametrize("combo", _params("DRAFT-FAULT-NAMED"))
def test_fault_in_one_model_named(route, combo):
    """Version 1, then version 2 with one MTP tensor of the wrong dtype (the main model's all fine), then
    with one main tensor of the wrong dtype: each fails naming that tensor and, where the path is atomic
    (all but GDR), changes nothing; then version 3 loads both models."""
    path = combo["path"]
    v1, v2, v3 = (M.state(SPEC, version=v) for v in (1, 2, 3))
    bad = {1: "mtp_block.0.norm.weight", 2: "norm.bias"}
    states = [v1, *({**v2, name: v2[name].astype(np.float32)} for name in bad.values()), v3]
    rt = route(path)

    def judge(i, session, outcome):
        if i not in bad:
            _expect_loaded(path, i, session, outcome, states[i])
            return
        where = f"{path}: update with {bad[i]} of the wrong dtype"
        _expect_error(outcome, [bad[i]], where)
        check.status_not(session, "NORMAL", where)
        if rt.path.strategy in ("gdr", "gdr_ipc"):
            return  # GDR applies as items arrive: not atomic
        if not rt.path.in_place:
            check.not_loaded(session.observe(), list(v1), f"{where}: nothing applied after clear()")
        else:
            check.params_equal(session.observe(), v1, f"{where}: version 1 kept")

    _run(rt, states, judge, combo)
