"""The draft (MTP) model beside the main one, on every path: both updated, neither left stale, and a fault
in either named. Spec: SPEC.md § DRAFT.

Each test runs one path (a ``Source``: the single snapshot file, ipc metas, buckets, an rsync or a GDR
stream) through a sequence of updates on one session: snapshot, ipc and buckets clear before each update
after the first (their contract), the streamed paths update in place.
"""
import os

import numpy as np
import pytest

from conformance import check
from conformance.stream_support import STRATEGY_CAPS
from fixtures import buckets as B
from fixtures import ipc as I
from fixtures import models as M
from fixtures import snapshot as SN
from fixtures import streams as S

MAIN = (("embed.weight", "bfloat16", (8, 4)), ("model.layers.0.mlp.weight", "float32", (4, 8)), ("norm.bias", "float16", (4,)))
MTP = (("model.layers.2.eh_proj.weight", "float32", (4, 4)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))
SPEC = M.spec(*MAIN, mtp=[MTP])
MAIN_NAMES = [n for n, _, _ in MAIN]
MTP_NAMES = [n for n, _, _ in MTP]


class Source:
    """One path: ``prepare(states)`` before the first update, ``before(i)`` before update i."""

    clear_first = True
    strategy = "ipc_snapshot"

    def __init__(self, loader):
        self.loader = loader
        self.states: list = []

    def prepare(self, states) -> None:
        self.states = list(states)

    def before(self, i: int) -> None:
        pass

    def options(self) -> dict:
        return {}

    def open(self):
        return self.loader.open(SPEC, strategy=self.strategy, options=self.options())

    def close(self) -> None:
        pass


class Snapshot(Source):
    def before(self, i):
        SN.write_safetensors(SN.single_path(self.loader.model_dir, 0, 0), self.states[i])


class Ipc(Source):
    strategy = "ipc"

    def __init__(self, loader):
        super().__init__(loader)
        self.exports = []

    def before(self, i):
        self.exports.append(I.Export(self.states[i]))
        I.write_metas(I.meta_path(self.loader.shared_dir, 0), self.exports[-1].metas)

    def close(self):
        for e in self.exports:
            e.close()


class Buckets(Source):
    strategy = "ipc_bucket"

    def __init__(self, loader):
        super().__init__(loader)
        self.publisher = B.Publisher(512)

    def prepare(self, states):
        super().prepare(states)
        self.publisher.serve(*(B.pack(st, i + 1, 512) for i, st in enumerate(self.states)))

    def options(self):
        return self.publisher.options(None, 2.0)

    def close(self):
        self.publisher.close()


class Stream(Source):
    clear_first = False

    def __init__(self, loader, strategy):
        super().__init__(loader)
        self.strategy = strategy
        self.trainer = S.trainer()

    def prepare(self, states):
        super().prepare(states)
        self.trainer.serve(*(S.stream_of(st) for st in self.states))

    def options(self):
        return {"rsync_config": S.rsync_config(self.trainer), "version": "1"}

    def open(self):
        session = super().open()
        S.attach_loaders(session.models)
        S.mark_mtp_layers(session.models, 2)
        return session

    def close(self):
        self.trainer.close()


PATHS = {"snapshot": (Snapshot, "snapshot.single"), "ipc": (Ipc, "ipc.meta"), "buckets": (Buckets, "ipc.buckets"),
         "rsync": (lambda loader: Stream(loader, "rsync"), STRATEGY_CAPS["rsync"]),
         "gdr": (lambda loader: Stream(loader, "gdr"), STRATEGY_CAPS["gdr"])}
PATH_PARAMS = [pytest.param(p, marks=pytest.mark.requires(cap, "mtp"), id=p) for p, (_, cap) in PATHS.items()]


@pytest.fixture
def path_source(request, loader):
    made = []

    def make(path):
        made.append(PATHS[path][0](loader))
        return made[-1]

    yield make
    for source in made:
        source.close()


def _run(source, states, check_each):
    """Open a session and run one update per state; ``check_each(i, session, outcome)`` judges update i,
    ``outcome`` the exception it raised or None."""
    source.prepare(states)
    session = source.open()
    for i in range(len(states)):
        source.before(i)
        if i and source.clear_first:
            session.clear()
        try:
            session.update()
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
@pytest.mark.parametrize("path", PATH_PARAMS)
def test_main_and_draft_updated_together(path_source, path):
    states = [M.state(SPEC, version=v) for v in (1, 2, 3)]

    _run(path_source(path), states, lambda i, session, outcome: _expect_loaded(path, i, session, outcome, states[i]))


# -- DRAFT-NOT-STALE -------------------------------------------------------------------------------
@pytest.mark.rule("DRAFT-NOT-STALE")
@pytest.mark.parametrize("path", PATH_PARAMS)
def test_update_leaving_a_model_stale_fails(path_source, path):
    """Version 1, then version 2 without any MTP tensor, then without any main tensor (each must fail naming
    every parameter it would leave behind), then version 3 whole."""
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

    _run(path_source(path), states, judge)


# -- DRAFT-FAULT-NAMED -----------------------------------------------------------------------------
@pytest.mark.rule("DRAFT-FAULT-NAMED")
@pytest.mark.parametrize("path", PATH_PARAMS)
def test_fault_in_one_model_named(path_source, path):
    """Version 1, then version 2 with one MTP tensor of the wrong dtype (the main model's all fine), then
    with one main tensor of the wrong dtype: each fails naming that tensor and, where the path is atomic
    (all but GDR), changes nothing; then version 3 loads both models."""
    v1, v2, v3 = (M.state(SPEC, version=v) for v in (1, 2, 3))
    bad = {1: "mtp_block.0.norm.weight", 2: "norm.bias"}
    states = [v1, *({**v2, name: v2[name].astype(np.float32)} for name in bad.values()), v3]
    source = path_source(path)

    def judge(i, session, outcome):
        if i not in bad:
            _expect_loaded(path, i, session, outcome, states[i])
            return
        where = f"{path}: update with {bad[i]} of the wrong dtype"
        _expect_error(outcome, [bad[i]], where)
        check.status_not(session, "NORMAL", where)
        if path == "gdr":
            return  # GDR applies as items arrive: not atomic
        if source.clear_first:
            check.not_loaded(session.observe(), list(v1), f"{where}: nothing applied after clear()")
        else:
            check.params_equal(session.observe(), v1, f"{where}: version 1 kept")

    _run(source, states, judge)
