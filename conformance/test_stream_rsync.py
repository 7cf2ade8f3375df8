"""rsync: a step streamed through a CheckpointTransfer handle, validated whole, then applied. Spec: SPEC.md
§ RSYNC (and its introduction for the options and the trainer stand-in).

The trainer (conformance.stream_support) answers from a thread and records what the library told it.
Cases that share a session run one after the other in one test (a rejected step changes nothing, so the
next case starts from the same state); each check names its case. Tensors are tiny except one of
8 MiB + 1 byte. The silences (stalls, a slow trainer) are judged in test_stream_timing.py.
"""
import asyncio
import logging
import os
import time

import numpy as np
import pytest

from conformance import check, harness
from conformance import mode_run as R
from conformance import modes
from conformance.harness import Worker
from conformance.stream_support import ct_trainer, open_stream  # noqa: F401 - ct_trainer is a fixture
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S
from weightsync.fixtures.ipc import patterned

pytestmark = pytest.mark.streams

MAIN = (("embed.weight", "bfloat16", (8, 4)), ("layers.0.mlp.weight", "float32", (4, 8)), ("norm.bias", "float16", (4,)))
MTP = (("layers.2.eh_proj.weight", "float32", (4, 4)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))
SPEC = M.spec(*MAIN)
SPEC_MTP = M.spec(*MAIN, mtp=[MTP])


def _rsync(loader, trainer, spec=SPEC_MTP, **kw):
    return open_stream(loader, trainer, spec, "rsync", **kw)[0]


def _loaded(loader, trainer, spec=SPEC_MTP, **kw):
    """A session whose first update loaded version 1 of ``spec`` (asserted); returns (session, version 1)."""
    state = M.state(spec, version=1)
    trainer.serve(S.stream_of(state))
    session = _rsync(loader, trainer, spec, **kw)
    session.update()
    check.params_equal(session.observe(), state, f"{trainer.endpoint}: first rsync load of version 1")
    return session, state


# -- RSYNC-ROUNDTRIP -------------------------------------------------------------------------------
DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool",
          "float8_e4m3fn", "float8_e5m2"]
EVERY_KIND = M.spec(*((f"d.w_{d}", d, (3, 5)) for d in DTYPES), ("e.scalar", "bfloat16", ()), ("e.empty", "float32", (0, 4)),
                    ("e.scalar_i", "int64", ()), ("e.empty_t", "float16", (4, 0)))
LARGE = M.spec(("g.small", "float32", (3,)), ("g.big", "uint8", (8 * (1 << 20) + 1,)))
ROUNDTRIP = {"every-dtype-0d-empty": (EVERY_KIND, ()), "main+mtp": (SPEC_MTP, ("mtp",)), "8MiB": (LARGE, ())}


def _params(rule, *more):
    """The rule's cases over its declared modes (SPEC.md Modes:), each needing rsync, ``more`` and staged if staged."""
    return modes.params(rule, requires=lambda combo: ["stream.rsync", *more,
                                                      *(["staged"] if combo.get("staged") == "staged" else []),
                                                      *(["mtp"] if combo.get("model") == "draft" else [])])


def _in_modes(loader, trainer, combo, spec=SPEC_MTP, **kw):
    """An rsync session opened in ``combo``'s modes, its earlier updates done (mode_run.earlier_stream: for
    ``start=cleared`` after a later call, a clear before the update under test). Returns the session."""
    session = open_stream(loader, trainer, spec, "rsync", **kw)[0] if not R.options(combo) else \
        _staged_stream(loader, trainer, spec, **kw)
    R.earlier_stream(combo, session, trainer, spec)
    return session


def _staged_stream(loader, trainer, spec, version="1", **kw):
    options = {"rsync_config": S.rsync_config(trainer, kw.pop("timeout_s", 5.0)), "version": version, "staged": True}
    session = loader.open(spec, strategy="rsync", options=options, **kw)
    S.publish_version(loader.model_dir, version)
    S.attach_loaders(session.models)
    return session


def _roundtrip_state(spec, version: int) -> dict:
    if spec is not LARGE:
        return M.state(spec, version=version)
    return {"g.small": M.weights(spec.main[0], version=version), "g.big": patterned((8 * (1 << 20) + 1,), "uint8", seed=version)}


@pytest.mark.rule("RSYNC-ROUNDTRIP")
@pytest.mark.modes(call="first", start="cleared")  # (its second update, in place, is claimed by no mark: the
# generated cases below cover call x start pair by pair)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.requires("stream.rsync", *extra), id=c)
                                  for c, (_, extra) in ROUNDTRIP.items()])
def test_rsync_roundtrip_two_versions(loader, ct_trainer, case):
    """Two versions, the second in reverse order (the 8 MiB + 1 byte case: one)."""
    spec = ROUNDTRIP[case][0]
    v1, v2 = _roundtrip_state(spec, 1), _roundtrip_state(spec, 2)
    ct_trainer.serve(S.stream_of(v1), S.stream_of(dict(reversed(list(v2.items())))))
    session = _rsync(loader, ct_trainer, spec)
    for version, want in ((1, v1), (2, v2))[:1 if spec is LARGE else 2]:
        session.update()
        check.params_equal(session.observe(), want, f"{ct_trainer.endpoint}: rsync {case}, update of version {version}")


@pytest.mark.rule("RSYNC-ROUNDTRIP")
@pytest.mark.parametrize("combo", _params("RSYNC-ROUNDTRIP"))
def test_rsync_roundtrip_in_every_mode(loader, ct_trainer, combo):
    """Every dtype, 0-d and empty tensors, streamed in reverse order, in every pair of the rule's modes."""
    session = _in_modes(loader, ct_trainer, combo, EVERY_KIND)
    want = M.state(EVERY_KIND, version=2)
    ct_trainer.serve(S.stream_of(dict(reversed(list(want.items())))))
    session.update()
    check.params_equal(session.observe(), want, f"{ct_trainer.endpoint}: rsync of every dtype ({R.label(combo)})")


# -- RSYNC-VERSION ---------------------------------------------------------------------------------
VERSIONS = [("argument-wins-over-yaml", "7", "step: 5\n", "7"), ("argument-no-yaml", "step-9", None, "step-9"),
            ("yaml-int", None, "step: 12345\n", "12345"), ("yaml-str", None, "step: s-9\nother: 1\n", "s-9"),
            ("yaml-zero", "", "step: 0\n", "0")]


@pytest.mark.rule("RSYNC-VERSION")
@pytest.mark.requires("stream.rsync")
@pytest.mark.modes(call=("first", "second"))
def test_rsync_version_from_argument_or_yaml(loader, ct_trainer):
    """One session per case (version argument, version.yaml), each loading twice: the first (bootstrap)
    load and an update in place ask for the same step."""
    state = M.state(SPEC, version=3)
    for case, argument, yaml_text, want in VERSIONS:
        model_dir = os.path.join(loader.model_dir, case)
        os.makedirs(model_dir)
        if yaml_text is not None:
            S.write_version_file(model_dir, yaml_text)
        ct_trainer.serve(S.stream_of(state, step=want), S.stream_of(state, step=want))
        options = {"rsync_config": S.rsync_config(ct_trainer), **({} if argument is None else {"version": argument})}
        session = loader.open(SPEC, strategy="rsync", options=options, model_dir=model_dir)
        for n in (1, 2):
            session.update()
            check.params_equal(session.observe(), state, f"rsync {case}, update {n}")
        check.equal([h["step_id"] for h in ct_trainer.of("hello")[-2:]], [want, want], f"rsync {case}: steps asked")


VERSION_ERRORS = {"no-file": None, "not-a-mapping": "- 1\n- 2\n", "missing-step": "other: 1\n", "step-null": "step:\n",
                  "empty-step": "step: ''\n", "invalid-yaml": "step: [1\n", "empty-file": ""}


@pytest.mark.rule("RSYNC-VERSION")
@pytest.mark.parametrize("combo", _params("RSYNC-VERSION"))
def test_rsync_version_from_argument_or_yaml_in_every_mode(loader, ct_trainer, combo):
    """The argument (7) wins over version.yaml (step 5) at the update under test, staged or not, first or later."""
    S.write_version_file(loader.model_dir, "step: 5\n")
    session = _in_modes(loader, ct_trainer, combo, SPEC, version="7")
    state = M.state(SPEC, version=3)
    ct_trainer.serve(S.stream_of(state, step="7"))
    session.update()
    where = f"rsync, argument 7 beside version.yaml step 5 ({R.label(combo)})"
    check.params_equal(session.observe(), state, where)
    check.equal(ct_trainer.of("hello")[-1]["step_id"], "7", f"{where}: the step asked of the trainer")


@pytest.mark.rule("RSYNC-VERSION")
@pytest.mark.requires("stream.rsync")
@pytest.mark.parametrize("phase", [pytest.param("first-load", marks=pytest.mark.modes(call="first")),
                                   pytest.param("in-place", marks=pytest.mark.modes(call="second"))])
def test_rsync_version_not_set_is_an_error(loader, phase):
    """No usable version: FastDeploy's "rsync model version not set", raised before anything is asked of
    the trainer; nothing changes. In place: a first load from a good version.yaml, then the file breaks
    in each way in turn. One session (and trainer) without a version argument, one with an empty one."""
    for argument in (None, ""):
        with S.trainer() as trainer:
            _version_not_set(loader, trainer, argument, phase)


def _version_not_set(loader, ct_trainer, argument, phase):
    for name in os.listdir(loader.model_dir):
        os.remove(os.path.join(loader.model_dir, name))
    session = _rsync(loader, ct_trainer, SPEC, version=argument)
    path = os.path.join(loader.model_dir, "version.yaml")
    if phase == "in-place":
        S.write_version_file(loader.model_dir, "step: 1\n")
        state = M.state(SPEC, version=1)
        ct_trainer.serve(S.stream_of(state, step="1"))
        session.update()
        check.params_equal(session.observe(), state, "rsync first load from version.yaml step 1")
    ct_trainer.serve(S.stream_of(M.state(SPEC, version=2)))
    for fault, text in VERSION_ERRORS.items():
        if os.path.exists(path):
            os.remove(path)
        if text is not None:
            S.write_version_file(loader.model_dir, text)
        before, hellos = session.observe(), len(ct_trainer.of("hello"))
        where = f"rsync {phase}, version argument {argument!r}, version.yaml {fault}"
        with check.raises(Exception, match="version not set", where=where):
            session.update()
        check.equal(len(ct_trainer.of("hello")), hellos, f"{where}: streams asked of the trainer")
        check.unchanged(before, session.observe(), where)


# -- RSYNC-VALIDATE-ALL ----------------------------------------------------------------------------
def _broken(case: str, st: dict) -> tuple[dict, list[str]]:
    """``st`` broken as ``case`` says, and the keys at fault."""
    return {
        "unknown-first": lambda: ({"embed.weight_scale": np.ones(2, np.float32), **st}, ["embed.weight_scale"]),
        "unknown-last": lambda: ({**st, "layers.1.mlp.weight": np.ones((4, 8), np.float32)}, ["layers.1.mlp.weight"]),
        "shape-middle": lambda: ({**st, "layers.0.mlp.weight": st["layers.0.mlp.weight"].reshape(8, 4)}, ["layers.0.mlp.weight"]),
        "dtype-same-itemsize-first": lambda: ({**st, "embed.weight": st["embed.weight"].astype(np.float16)}, ["embed.weight"]),
        "dtype-last-mtp": lambda: ({**st, "mtp_block.0.norm.weight": st["mtp_block.0.norm.weight"].astype(np.float32)},
                                   ["mtp_block.0.norm.weight"]),
        "shape-mtp": lambda: ({**st, "layers.2.eh_proj.weight": st["layers.2.eh_proj.weight"].reshape(16)},
                              ["layers.2.eh_proj.weight"]),
        "three-at-once": lambda: ({"zzz.extra": np.ones(1, np.int64), **st, "norm.bias": st["norm.bias"].astype(np.float32),
                                   "layers.0.mlp.weight": st["layers.0.mlp.weight"].reshape(2, 16)},
                                  ["zzz.extra", "norm.bias", "layers.0.mlp.weight"]),
    }[case]()


VALIDATION = {"in-place": ["unknown-first", "unknown-last", "shape-middle", "dtype-same-itemsize-first", "dtype-last-mtp",
                           "shape-mtp", "three-at-once"],
              "first-load": ["unknown-last", "dtype-last-mtp", "three-at-once"]}


@pytest.mark.rule("RSYNC-VALIDATE-ALL")
@pytest.mark.requires("stream.rsync", "mtp")
@pytest.mark.parametrize("phase", [pytest.param(p, marks=pytest.mark.modes(start="loaded" if p == "in-place" else "cleared"))
                                   for p in VALIDATION])
def test_rsync_validates_everything_before_applying(loader, ct_trainer, caplog, phase):
    caplog.set_level(logging.ERROR)  # root: whatever logger the implementation uses
    session = _loaded(loader, ct_trainer)[0] if phase == "in-place" else _rsync(loader, ct_trainer)
    for case in VALIDATION[phase]:
        stream, at_fault = _broken(case, M.state(SPEC_MTP, version=2))
        ct_trainer.serve(S.stream_of(stream))
        before = session.observe()
        caplog.clear()
        where = f"rsync {phase}, stream {case}"
        with check.raises(ValueError, match="Invalid new_state_dict", where=where):
            session.update()
        check.unchanged(before, session.observe(), where)
        logged = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
        check.that(all(k in logged for k in at_fault), f"{where}: every key at fault {at_fault} logged at ERROR; logged: {logged!r}")


POSITION_CASE = {"first": "unknown-first", "middle": "shape-middle", "last": "dtype-last-mtp"}


@pytest.mark.rule("RSYNC-VALIDATE-ALL")
@pytest.mark.parametrize("combo", _params("RSYNC-VALIDATE-ALL", "mtp"))
def test_rsync_validates_everything_before_applying_in_every_mode(loader, ct_trainer, caplog, combo):
    """The bad key first, in the middle or last of the step, in place or into cleared parameters, staged or not."""
    caplog.set_level(logging.ERROR)
    combo = {**combo, "call": "second" if combo["start"] == "loaded" else "first"}
    session = _in_modes(loader, ct_trainer, combo)
    case = POSITION_CASE[combo["position"]]
    stream, at_fault = _broken(case, M.state(SPEC_MTP, version=2))
    ct_trainer.serve(S.stream_of(stream))
    before = session.observe()
    caplog.clear()
    where = f"rsync, stream {case} ({R.label(combo)})"
    with check.raises(ValueError, match="Invalid new_state_dict", where=where):
        session.update()
    check.unchanged(before, session.observe(), where)
    logged = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    check.that(all(k in logged for k in at_fault), f"{where}: every key at fault {at_fault} logged at ERROR; logged: {logged!r}")


# -- RSYNC-SUBSET ----------------------------------------------------------------------------------
@pytest.mark.rule("RSYNC-SUBSET")
@pytest.mark.requires("stream.rsync", "mtp")
@pytest.mark.modes(start="loaded", model=("main", "draft"))
def test_rsync_subset_in_place_keeps_the_rest(loader, ct_trainer):
    session, have = _loaded(loader, ct_trainer)
    for version, missing in ((2, ["norm.bias"]), (3, ["embed.weight", "layers.2.eh_proj.weight"])):
        new = M.state(SPEC_MTP, version=version)
        ct_trainer.serve(S.stream_of({n: a for n, a in new.items() if n not in missing}))
        session.update()
        have = {n: (have[n] if n in missing else new[n]) for n in new}
        check.params_equal(session.observe(), have, f"rsync in place, version {version} without {missing}: those keep their values")


@pytest.mark.rule("RSYNC-SUBSET")
@pytest.mark.requires("stream.rsync", "mtp", "status")
@pytest.mark.parametrize("lacking", [pytest.param("layers.0.mlp.weight", marks=pytest.mark.modes(start="cleared", model="main")),
                                     pytest.param("layers.2.eh_proj.weight", marks=pytest.mark.modes(start="cleared", model="draft"))])
def test_rsync_first_load_lacking_a_key_fails(loader, ct_trainer, lacking):
    v1 = M.state(SPEC_MTP, version=1)
    ct_trainer.serve(S.stream_of({n: a for n, a in v1.items() if n != lacking}))
    session = _rsync(loader, ct_trainer)
    where = f"rsync first load lacking {lacking}"
    with check.raises(Exception, match=r"\S", names=[lacking], where=where):
        session.update()
    check.status_not(session, "NORMAL", where)
    check.not_loaded(session.observe(), [lacking], where)


# -- RSYNC-IN-PLACE --------------------------------------------------------------------------------
def _addresses(session) -> dict:
    return {n: p.data_ptr() for m in session.models for n, p in m.state_dict().items()}


@pytest.mark.rule("RSYNC-IN-PLACE")
@pytest.mark.requires("stream.rsync", "mtp")
@pytest.mark.modes(model=("main", "draft"))
@pytest.mark.parametrize("how", [pytest.param("argument", marks=pytest.mark.modes(start="loaded")),
                                 pytest.param("version.yaml", marks=pytest.mark.modes(start=("loaded", "cleared")))])
def test_rsync_in_place_keeps_parameter_memory(loader, ct_trainer, how):
    """Two updates in place keep every parameter's address; with version.yaml, clear() then a bootstrap load."""
    if how == "version.yaml":
        S.write_version_file(loader.model_dir, "step: 4\n")
    session, _ = _loaded(loader, ct_trainer, version="4" if how == "argument" else None)
    before = _addresses(session)
    for version in (2, 3):
        new = M.state(SPEC_MTP, version=version)
        ct_trainer.serve(S.stream_of(new))
        session.update()
        check.params_equal(session.observe(), new, f"rsync in place ({how}), version {version}")
        now = _addresses(session)
        moved = {n: (hex(a), hex(now[n])) for n, a in before.items() if now[n] != a}
        check.that(not moved, f"rsync in place ({how}), version {version}: parameters moved to new memory: {moved}")
    if how == "version.yaml":
        session.clear()
        new = M.state(SPEC_MTP, version=4)
        ct_trainer.serve(S.stream_of(new))
        session.update()
        check.params_equal(session.observe(), new, "rsync bootstrap load into cleared parameters")


# -- RSYNC-RESULT ----------------------------------------------------------------------------------
@pytest.mark.rule("RSYNC-RESULT")
@pytest.mark.requires("stream.rsync")
@pytest.mark.modes(start=("cleared", "loaded"))
def test_rsync_returns_its_costs(loader, ct_trainer):
    state = M.state(SPEC, version=3)
    ct_trainer.serve(S.stream_of(state), S.stream_of(state))
    session = _rsync(loader, ct_trainer, SPEC, version="7", worker=Worker(rank=2, visible="3,5", selected="1"))
    for n in (1, 2):
        started = time.perf_counter()
        result = session.update()
        wall = time.perf_counter() - started
        where = f"rsync update {n} result {result!r}, update() took {wall:.4f}s"
        check.that(isinstance(result, dict) and {"sync_cost", "update_cost", "total_cost", "version", "rank"} <= set(result),
                   f"{where}: a dict with sync_cost, update_cost, total_cost, version, rank")
        check.equal((result["version"], result["rank"]), ("7", 1), f"{where}: version and local rank")
        costs = [result[k] for k in ("sync_cost", "update_cost", "total_cost")]
        check.that(all(isinstance(c, float) and c >= 0 for c in costs) and costs[0] + costs[1] <= costs[2] + 1e-6 <= wall + 2e-6,
                   f"{where}: costs are non-negative seconds and sync + update <= total <= the call's own time")


# -- RSYNC-HANDLE-ONCE -----------------------------------------------------------------------------
RANK3_ORDINAL2 = Worker(rank=3, visible="0,1,2,3", selected="2")  # world size 4 (PADDLE_TRAINERS_NUM)


@pytest.mark.rule("RSYNC-HANDLE-ONCE")
@pytest.mark.requires("stream.rsync")
@pytest.mark.modes(call=("first", "second", "third"))
def test_rsync_one_handle_for_every_update(loader, ct_trainer):
    """Three updates (the first load and two in place) stream from one handle, never cleaned up between them."""
    states = [M.state(SPEC, version=v) for v in (1, 2, 3)]
    ct_trainer.serve(*(S.stream_of(st) for st in states))
    session = _rsync(loader, ct_trainer, SPEC, worker=RANK3_ORDINAL2)
    for n, st in enumerate(states, 1):
        session.update()
        check.params_equal(session.observe(), st, f"rsync update {n} of three")
    where = "rsync, three updates"
    registers, hellos = ct_trainer.of("register"), ct_trainer.of("hello")
    check.equal(len(registers), 1, f"{where}: CheckpointTransfer handles initialized")
    check.equal([h["handle"] for h in hellos], [registers[0]["handle"]] * 3, f"{where}: handle of each stream")
    check.equal(ct_trainer.of("unregister"), [], f"{where}: handles cleaned up between updates")


# -- RSYNC-HANDLE-CONFIG ---------------------------------------------------------------------------
@pytest.mark.rule("RSYNC-HANDLE-CONFIG")
@pytest.mark.requires("stream.rsync")
@pytest.mark.parametrize("world", [pytest.param(4, marks=pytest.mark.modes(rank="follower")),
                                   pytest.param(1, marks=pytest.mark.modes(rank="rank0"))])
def test_rsync_handle_created_with_rank_and_world_size(loader, ct_trainer, monkeypatch, world):
    """The handle is created with local_rank = the worker's ordinal (2 or 0; global rank 3 or 0) and
    group_size = the world size."""
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(world))
    worker = RANK3_ORDINAL2 if world > 1 else Worker(rank=0, visible="5", selected="0")
    _loaded(loader, ct_trainer, SPEC, worker=worker)
    [register] = ct_trainer.of("register")
    want = (2, 4) if world > 1 else (0, 1)
    check.equal((register["config"]["global_rank"], register["config"]["group_size"]), want,
                f"rsync worker {worker}, world size {world}: (local_rank, group_size) the handle was created with")


@pytest.mark.rule("RSYNC-HANDLE-CONFIG")
@pytest.mark.requires("stream.rsync")
@pytest.mark.modes(rank="rank0")
def test_rsync_handle_local_rank_0_when_selection_unset(loader, ct_trainer, monkeypatch):
    """``FLAGS_selected_gpus`` left unset reads as "0" (SNAP-GPU-ID-INVALID): the handle is created with
    local_rank 0, and the update never fails on the missing variable."""
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    real_set = harness.set_worker_env

    def set_env_then_unset(environ, *args):  # the harness always sets it; this case leaves it unset
        real_set(environ, *args)
        environ.pop("FLAGS_selected_gpus", None)

    monkeypatch.setattr(harness, "set_worker_env", set_env_then_unset)
    _loaded(loader, ct_trainer, SPEC, worker=Worker(rank=0, visible="5", selected="0"))
    [register] = ct_trainer.of("register")
    check.equal((register["config"]["global_rank"], register["config"]["group_size"]), (0, 1),
                "rsync worker on physical GPU 5, FLAGS_selected_gpus unset: (local_rank, group_size) of the handle")


# -- RSYNC-CHECKSUM --------------------------------------------------------------------------------
@pytest.mark.rule("RSYNC-CHECKSUM")
@pytest.mark.requires("stream.rsync")
@pytest.mark.modes(start=("cleared", "loaded"))
@pytest.mark.parametrize("verify", [None, True, False], ids=["absent", "true", "false"])
def test_rsync_checksum_flag_reaches_every_stream(loader, ct_trainer, verify):
    """Three updates: each receive_stream gets verify_checksum (False when absent)."""
    states = [M.state(SPEC, version=v) for v in (1, 2, 3)]
    ct_trainer.serve(*(S.stream_of(st) for st in states))
    session = _rsync(loader, ct_trainer, SPEC, verify=verify)
    for st in states:
        session.update()
    where = f"rsync, verify_checksum {verify!r}, three updates"
    check.params_equal(session.observe(), states[-1], where)
    check.equal([h["verify_checksum"] for h in ct_trainer.of("hello")], [bool(verify)] * 3,
                f"{where}: verify_checksum of each receive_stream")


@pytest.mark.rule("RSYNC-CHECKSUM")
@pytest.mark.requires("stream.rsync")
@pytest.mark.parametrize("start", [pytest.param(s, marks=pytest.mark.modes(start=s)) for s in ("loaded", "cleared")])
def test_rsync_checksum_verified_when_asked(loader, ct_trainer, start):
    """In place, or the first load into cleared parameters: a corrupted item fails the update, nothing changes."""
    if start == "loaded":
        session, _ = _loaded(loader, ct_trainer, SPEC, verify=True)
    else:
        session = _rsync(loader, ct_trainer, SPEC, verify=True)
    ct_trainer.serve(S.stream_of(M.state(SPEC, version=2), fault=("corrupt", 1)))
    before = session.observe()
    where = f"rsync with verify_checksum, item 1 corrupted ({'in place' if start == 'loaded' else 'first load'})"
    with check.raises(Exception, match="checksum", where=where):
        session.update()
    check.unchanged(before, session.observe(), where)


# -- RSYNC-FAULTS ----------------------------------------------------------------------------------
PHASES = {"before-first": 0, "mid": 1, "after-last": 3}


def _failed_cleanly(session, kept, where) -> None:
    check.params_equal(session.observe(), kept, f"{where}: version 1 kept whole")
    check.status_not(session, "NORMAL", where)


@pytest.mark.rule("RSYNC-FAULTS")
@pytest.mark.requires("stream.rsync", "status")
@pytest.mark.modes(start="loaded", phase=("before-first", "mid", "after-last"))
def test_rsync_broken_or_cancelled_stream_changes_nothing(loader, ct_trainer):
    """One session: a broken stream, then a cancelled one, at each phase in turn; then a healthy update."""
    session, v1 = _loaded(loader, ct_trainer, SPEC)
    for kind, error, match in (("fail", ConnectionError, "broke"), ("cancel", (asyncio.CancelledError, RuntimeError), "(?i)cancel")):
        for phase, k in PHASES.items():
            ct_trainer.serve(S.stream_of(M.state(SPEC, version=2), fault=(kind, k)))
            where = f"rsync, trainer {kind}s {phase} (after {k} of 3 items)"
            with check.raises(error, match=match, where=where):
                session.update()
            _failed_cleanly(session, v1, where)
    v3 = M.state(SPEC, version=3)
    ct_trainer.serve(S.stream_of(v3))
    session.update()
    check.params_equal(session.observe(), v3, "rsync, the update after six failed ones")


@pytest.mark.rule("RSYNC-FAULTS")
@pytest.mark.parametrize("combo", _params("RSYNC-FAULTS", "status"))
def test_rsync_broken_stream_changes_nothing_in_every_mode(loader, ct_trainer, combo):
    """A stream that breaks at the combination's phase, in place or into cleared parameters (the first load),
    staged or not; then a healthy update loads whole."""
    combo = {**combo, "call": "second" if combo["start"] == "loaded" else "first"}
    session = _in_modes(loader, ct_trainer, combo, SPEC)
    before = session.observe()
    k = PHASES[combo["phase"]]
    ct_trainer.serve(S.stream_of(M.state(SPEC, version=2), fault=("fail", k)))
    where = f"rsync, trainer fails {combo['phase']} (after {k} of 3 items; {R.label(combo)})"
    with check.raises(ConnectionError, match="broke", where=where):
        session.update()
    check.unchanged(before, session.observe(), where)
    check.status_not(session, "NORMAL", where)
    v3 = M.state(SPEC, version=3)
    ct_trainer.serve(S.stream_of(v3))
    session.update()
    check.params_equal(session.observe(), v3, f"{where}: the next, healthy update")
