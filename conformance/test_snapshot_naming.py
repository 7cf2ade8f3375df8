"""ipc_snapshot naming and sharding: who loads which file, on every level. Spec: SPEC.md § SNAP.

Every identity case runs on each level where the behaviour exists (parts, single file, legacy
``tp0{id}`` keyed by the GPU only, shared ``paddle.save`` fallback), carrying only that level's
capability. The worker's CUDA ordinal differs from its physical id, and decoy snapshots sit under
every name a plausible mistake would produce (the ordinal, the other CUDA_VISIBLE_DEVICES entries,
rank 0, names sharing a prefix), at the worker's level and at every level above it: a loader that
reads a wrong name finds a file there and ends with that decoy's values, not with a "not found".
"""
import os
import re

import pytest

from conformance import check, harness
from conformance import mode_run as R
from conformance import modes
from conformance.harness import Worker, set_worker_env
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))
NAMES = [p.name for p in SPEC.all_params]
LEVEL_CAP = {
    "parts": "snapshot.parts",
    "single": "snapshot.single",
    "legacy": "snapshot.legacy",
    "shared": "snapshot.shared_fallback",
}
MODEL_DIR_LEVELS = ("parts", "single", "legacy")


def _level_params(levels, cases, ids):
    """pytest.params (level, *case) each requiring only its level's capability."""
    return [
        pytest.param(level, *case, marks=pytest.mark.requires(LEVEL_CAP[level]), id=f"{level}:{case_id}")
        for level in levels
        for case, case_id in zip(cases, ids)
    ]


def _write_decoys(loader, level, identities, own_gpu, shared_identities=(), version0=50):
    """Decoy snapshots of ``identities`` (rank, gpu) at ``level`` and every level above it; legacy
    decoys are keyed by the GPU (never the worker's own); the shared level (``paddle.save``, slow to
    write) gets ``shared_identities`` only. Returns {basename: version}."""
    written = {}
    version = version0
    upto = S.LEVELS.index(level)
    for lvl in S.LEVELS[: upto + 1]:
        seen_legacy = {own_gpu}
        for rank, gpu in identities if lvl != "shared" else shared_identities:
            if lvl == "legacy":
                if gpu in seen_legacy:
                    continue
                seen_legacy.add(gpu)
            version += 1
            for path in S.write_level(lvl, loader.model_dir, loader.shared_dir, rank, gpu, M.state(SPEC, version=version), nparts=1):
                written[os.path.basename(path)] = version
    return written


def _update_and_expect(loader, worker, want, where, combo=None, level="single"):
    """Open ``worker``'s session in ``combo``'s modes (staged, earlier updates at ``level`` first), update, compare."""
    combo = combo or {}
    session = loader.open(SPEC, worker=worker, options=R.options(combo))
    if R.CALLS[combo.get("call", "first")]:  # (a worker whose GPU selection is the case's fault has no gpu_id)
        R.earlier_snapshot(combo, session, SPEC, loader.model_dir, loader.shared_dir, level=level, rank=worker.rank,
                           gpu_id=worker.gpu_id)
    session.update()
    check.params_equal(session.observe(), want, f"{where} ({R.label(combo)})" if combo else where)
    return session


def _level_combos(rule):
    """The rule's cases over its declared modes, each requiring its level (``path``) and ``staged`` if staged."""
    return modes.params(rule, requires=lambda combo: [LEVEL_CAP[combo.get("path", "parts")], *(
        ["staged"] if combo.get("staged") == "staged" else [])])


# -- SNAP-NAME-SINGLE -----------------------------------------------------------------------------
# Two workers whose names differ only by where the dot falls, and names sharing a prefix with them.
_DOT_WORKERS = (Worker(1, "0,234", "1"), Worker(12, "34,5", "0"))  # tp1.234 and tp12.34
_DOT_DECOYS = ((1, 23), (12, 3), (1, 2345), (123, 4), (1, 34), (12, 234))


@pytest.mark.rule("SNAP-NAME-SINGLE")
@pytest.mark.modes(rank="follower")
@pytest.mark.parametrize(
    "level",
    [pytest.param(lvl, marks=pytest.mark.requires(LEVEL_CAP[lvl]), id=lvl) for lvl in ("single", "shared")],
)
def test_single_file_rank_and_id_are_separated(loader, level):
    """tp1.234 and tp12.34 both present (and tp1.23, tp12.3, tp1.2345, tp123.4...; tp1.23 and tp12.3
    in the shared directory): each worker loads its own file, from the single file and from the
    shared fallback alike."""
    wants = {}
    for i, worker in enumerate(_DOT_WORKERS):
        wants[worker.rank] = M.state(SPEC, version=1 + i)
        S.write_level(level, loader.model_dir, loader.shared_dir, worker.rank, worker.gpu_id, wants[worker.rank])
    for i, (rank, gpu) in enumerate(_DOT_DECOYS if level != "shared" else _DOT_DECOYS[:2]):  # paddle.save is slow
        S.write_level(level, loader.model_dir, loader.shared_dir, rank, gpu, M.state(SPEC, version=20 + i))
    for worker in _DOT_WORKERS:
        _update_and_expect(
            loader, worker, wants[worker.rank],
            f"{level}: worker rank={worker.rank} gpu={worker.gpu_id} must load {S.base_name(worker.rank, worker.gpu_id)}",
        )


# Rank 0 on GPU 12 (tp0.12) and rank 12 on GPU 34 (tp12.34), with names sharing a prefix or a dot moved.
_DOT_BY_RANK = {"rank0": (Worker(0, "5,12", "1"), ((0, 1), (0, 123), (1, 2), (0, 5))),
                "follower": (Worker(12, "34,5", "0"), ((1, 234), (12, 3), (123, 4), (12, 345)))}


@pytest.mark.rule("SNAP-NAME-SINGLE")
@pytest.mark.parametrize("combo", _level_combos("SNAP-NAME-SINGLE"))
def test_single_file_rank_and_id_are_separated_in_every_mode(loader, combo):
    """Rank 0 (tp0.12 beside tp0.1, tp0.123, tp01.2) or a follower (tp12.34 beside tp1.234, tp12.3, tp123.4,
    tp12.345), on the single file or the shared fallback, plain or staged."""
    level = combo["path"]
    worker, decoys = _DOT_BY_RANK[combo["rank"]]
    want = M.state(SPEC, version=1)
    S.write_level(level, loader.model_dir, loader.shared_dir, worker.rank, worker.gpu_id, want)
    for i, (rank, gpu) in enumerate(decoys if level != "shared" else decoys[:2]):  # paddle.save is slow
        S.write_level(level, loader.model_dir, loader.shared_dir, rank, gpu, M.state(SPEC, version=20 + i))
    _update_and_expect(loader, worker, want, f"{level}: worker rank={worker.rank} gpu={worker.gpu_id} must load "
                       f"{S.base_name(worker.rank, worker.gpu_id)}", combo)


# -- SNAP-NAME-PARTS ------------------------------------------------------------------------------
@pytest.mark.rule("SNAP-NAME-PARTS")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.modes(rank="follower")
@pytest.mark.parametrize(
    "worker,decoys",
    [
        # tp1.2.part* beside tp1.23.part5 and tp1.20.part5 (a startswith/unanchored glob takes them).
        pytest.param(Worker(1, "7,2", "1"), ("model_state.tp1.23.part5", "model_state.tp1.20.part5"), id="tp1.2-vs-tp1.23"),
        # ids and ranks >= 10; a trainer's temporary file is not a part either.
        pytest.param(
            Worker(12, "13,3", "1"),
            ("model_state.tp12.34.part9", "model_state.tp1.23.part9", "model_state.tp12.3.part7.pdparams.tmp"),
            id="tp12.3-vs-tp12.34-tp1.23-tmp",
        ),
    ],
)
def test_part_glob_does_not_match_longer_id(loader, worker, decoys):
    """Only ``{base}.part{N}.pdparams`` are the worker's parts; every decoy has a higher index, so a
    loader that takes one ends with its values."""
    mine = M.state(SPEC, version=1)
    S.write_parts(loader.model_dir, worker.rank, worker.gpu_id, dict(enumerate(S.split(mine, 2))))
    for i, decoy in enumerate(decoys):
        name = decoy if decoy.endswith(".tmp") else decoy + S.PDPARAMS
        S.write_safetensors(os.path.join(loader.model_dir, name), M.state(SPEC, version=10 + i))
    _update_and_expect(
        loader, worker, mine,
        f"worker rank={worker.rank} gpu={worker.gpu_id} with {', '.join(decoys)} beside its parts",
    )


_PART_DECOYS = {"rank0": (Worker(0, "7,2", "1"), ("model_state.tp0.23.part5", "model_state.tp0.20.part5",
                                                     "model_state.tp02.part7", "model_state.tp0.2.part6.pdparams.tmp")),
                "follower": (Worker(12, "13,3", "1"), ("model_state.tp12.34.part9", "model_state.tp1.23.part9",
                                                        "model_state.tp12.3.part7.pdparams.tmp"))}


@pytest.mark.rule("SNAP-NAME-PARTS")
@pytest.mark.parametrize("combo", modes.params("SNAP-NAME-PARTS", requires=lambda combo: [
    "snapshot.parts", *(["staged"] if combo["staged"] == "staged" else [])]))
def test_part_glob_does_not_match_longer_id_in_every_mode(loader, combo):
    """Rank 0 (tp0.2 beside tp0.23, tp0.20, tp02) or a follower (tp12.3 beside tp12.34, tp1.23), plain or staged;
    every decoy has a higher index than the worker's parts."""
    worker, decoys = _PART_DECOYS[combo["rank"]]
    mine = M.state(SPEC, version=1)
    S.write_parts(loader.model_dir, worker.rank, worker.gpu_id, dict(enumerate(S.split(mine, 2))))
    for i, decoy in enumerate(decoys):
        name = decoy if decoy.endswith(".tmp") else decoy + S.PDPARAMS
        S.write_safetensors(os.path.join(loader.model_dir, name), M.state(SPEC, version=10 + i))
    _update_and_expect(loader, worker, mine, f"worker rank={worker.rank} gpu={worker.gpu_id} with "
                       f"{', '.join(decoys)} beside its parts", combo)


# -- SNAP-RANK-OWN-SHARD --------------------------------------------------------------------------
# Ranks 0, 1, 12, 10 on physical GPUs 5, 23, 3, 7 (ordinals 0..3): rank differs from the ordinal,
# tp1.23 and tp12.3 share a prefix, and the legacy names tp05, tp023, tp03, tp07 are all distinct.
_RANKS = (0, 1, 12, 10)
_VISIBLE = "5,23,3,7"


@pytest.mark.rule("SNAP-RANK-OWN-SHARD")
@pytest.mark.parametrize(
    "level", [pytest.param(lvl, marks=pytest.mark.requires(LEVEL_CAP[lvl]), id=lvl) for lvl in S.LEVELS]
)
def test_each_rank_loads_its_own_shard(loader, level):
    """Every rank's shard present at one level: each rank ends with its own values, never rank 0's
    (legacy files are keyed by the GPU, so there each rank loads its own GPU's file)."""
    workers = [Worker(r, _VISIBLE, str(i)) for i, r in enumerate(_RANKS)]
    states = {}
    for w in workers:
        states[w.rank] = M.state(SPEC, seed=w.rank, version=1)
        S.write_level(level, loader.model_dir, loader.shared_dir, w.rank, w.gpu_id, states[w.rank])
    for w in workers:
        _update_and_expect(loader, w, states[w.rank], f"{level}: rank {w.rank} on physical gpu {w.gpu_id}")


@pytest.mark.rule("SNAP-RANK-OWN-SHARD")
@pytest.mark.parametrize("combo", _level_combos("SNAP-RANK-OWN-SHARD"))
def test_each_rank_loads_its_own_shard_in_every_mode(loader, combo):
    """Every rank's shard present at one level; rank 0 or a follower (rank 12 on GPU 3) loads its own, plain or
    staged."""
    level = combo["path"]
    workers = [Worker(r, _VISIBLE, str(i)) for i, r in enumerate(_RANKS)]
    states = {w.rank: M.state(SPEC, seed=w.rank, version=1) for w in workers}
    for w in workers:
        S.write_level(level, loader.model_dir, loader.shared_dir, w.rank, w.gpu_id, states[w.rank])
    judged = workers[0] if combo["rank"] == "rank0" else workers[2]
    _update_and_expect(loader, judged, states[judged.rank], f"{level}: rank {judged.rank} on physical gpu "
                       f"{judged.gpu_id}, every rank's shard beside its own", combo, level=level)


# -- SNAP-GPU-ID ----------------------------------------------------------------------------------
def _gpu_decoys(worker):
    """Identities a wrong reading of (rank, gpu) produces: the ordinal as id, the other entries,
    rank 0, and ids sharing a prefix with the physical id."""
    entries = [int(v) for v in worker.visible.split(",")]
    gpu = worker.gpu_id
    ids = {int(worker.selected), *entries, int(f"{gpu}1"), gpu // 10} - {gpu}
    out = [(worker.rank, g) for g in sorted(ids)]
    if worker.rank != 0:
        out.append((0, gpu))
    return out


_GPU_CASES = [
    (Worker(1, "5,3,7", "0"),),
    (Worker(1, "5,3,7", "1"),),
    (Worker(1, "5,3,7", "2"),),
    (Worker(11, "14,11,1,12", "1"),),
]
_GPU_IDS = ["first-entry:5", "middle-entry:3", "last-entry:7", "ids-ge-10:11"]


@pytest.mark.rule("SNAP-GPU-ID")
@pytest.mark.parametrize("level,worker", _level_params(S.LEVELS, _GPU_CASES, _GPU_IDS))
def test_file_id_is_physical_gpu(loader, level, worker):
    """The file id is CUDA_VISIBLE_DEVICES[FLAGS_selected_gpus], on every level, with decoys under
    the ordinal, the other entries, rank 0 and prefix-sharing ids at this level and above."""
    want = M.state(SPEC, version=1)
    S.write_level(level, loader.model_dir, loader.shared_dir, worker.rank, worker.gpu_id, want)
    identities = _gpu_decoys(worker)
    ordinal_and_rank0 = [(r, g) for r, g in identities if g == int(worker.selected) or r == 0]
    decoys = _write_decoys(loader, level, identities, worker.gpu_id, ordinal_and_rank0)
    _update_and_expect(
        loader, worker, want,
        f"{level}: rank {worker.rank}, CUDA_VISIBLE_DEVICES={worker.visible} FLAGS_selected_gpus={worker.selected} "
        f"(physical {worker.gpu_id}) with decoys {sorted(decoys)}",
    )


@pytest.mark.rule("SNAP-GPU-ID")
@pytest.mark.parametrize("combo", _level_combos("SNAP-GPU-ID"))
def test_file_id_is_physical_gpu_in_every_mode(loader, combo):
    """The middle entry of CUDA_VISIBLE_DEVICES selected (physical 3, ordinal 1), with decoys, in every pair of the
    rule's modes (a later update reads the same id again)."""
    level, worker = combo["path"], Worker(1, "5,3,7", "1")
    session = loader.open(SPEC, worker=worker, options=R.options(combo))
    R.earlier_snapshot(combo, session, SPEC, loader.model_dir, loader.shared_dir, level=level, rank=worker.rank,
                       gpu_id=worker.gpu_id)
    want = M.state(SPEC, version=1)
    S.write_level(level, loader.model_dir, loader.shared_dir, worker.rank, worker.gpu_id, want)
    identities = _gpu_decoys(worker)
    decoys = _write_decoys(loader, level, identities, worker.gpu_id, [(r, g) for r, g in identities if g == 1 or r == 0])
    session.update()
    check.params_equal(session.observe(), want, f"{level}: rank 1, CUDA_VISIBLE_DEVICES=5,3,7 FLAGS_selected_gpus=1 "
                       f"(physical 3) with decoys {sorted(decoys)} ({R.label(combo)})")


# -- SNAP-GPU-ID-INVALID --------------------------------------------------------------------------
_UUID = "GPU-5f3c2a1e-0000-4b4b-9c9c-123456789abc"
_MIG = "MIG-9b2c7e1d-1111-4c4c-8d8d-abcdefabcdef"
_INVALID = [
    # (visible, selected, culprit or None when the worker must load gpu `loads`, loads)
    ("5,3,7", "2", None, 7),  # last valid index
    ("5,3,7,12", "3", None, 12),  # last valid index, id >= 10
    ("5,3,7", "3", "FLAGS_selected_gpus", None),  # one past the last
    ("5,3,7,12", "4", "FLAGS_selected_gpus", None),
    ("5,3,7", "-1", "FLAGS_selected_gpus", None),  # Python would wrap to the last entry
    ("5,3,7", "1.5", "FLAGS_selected_gpus", None),
    ("5,3,7", "x", "FLAGS_selected_gpus", None),
    ("5,3,7", "", "FLAGS_selected_gpus", None),
    ("5,3,7", "1,2", "FLAGS_selected_gpus", None),  # several GPUs for one worker
    ("5,3,7", "\u0661", "FLAGS_selected_gpus", None),  # ARABIC-INDIC DIGIT ONE: int() takes it
    ("5," + _UUID + ",7", "1", "CUDA_VISIBLE_DEVICES", None),  # UUID at the selected position
    (_MIG, "0", "CUDA_VISIBLE_DEVICES", None),
    (_UUID + ",3," + _MIG, "1", None, 3),  # UUID/MIG entries that are not selected do not matter
    ("", "0", "CUDA_VISIBLE_DEVICES", None),  # no device visible
    ("5,,7", "1", "CUDA_VISIBLE_DEVICES", None),  # an empty entry selected
    ("5,-3,7", "1", "CUDA_VISIBLE_DEVICES", None),
    ("5,\u0663,7", "1", "CUDA_VISIBLE_DEVICES", None),  # ARABIC-INDIC DIGIT THREE
    (" 5, 3 ,7 ", " 1 ", None, 3),  # whitespace around entries is not part of them
    # Unset variables default to "0" (FastDeploy's TestGetGpuId: "with no env, it gives 0").
    (None, None, None, 0),
    ("5,3,7", None, None, 5),
    (None, "0", None, 0),
]
_INVALID_IDS = [
    "last-index-loads", "last-index-ge-10-loads", "one-past-last", "one-past-last-ge-10", "negative", "fraction",
    "non-digit", "empty-selection", "list-selection", "non-ascii-digit-selection", "uuid-selected", "mig-selected", "uuid-mig-not-selected-loads",
    "visible-empty", "empty-entry-selected", "negative-entry", "non-ascii-digit-entry",
    "whitespace-loads", "both-unset-loads-0", "selection-unset-loads-first-entry", "visible-unset-loads-0",
]


_ID_LEVELS = [pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="single"),
              # The legacy tp0{id} file is keyed by the same id (the only level before FastDeploy #6852).
              pytest.param("legacy", marks=pytest.mark.requires("snapshot.legacy"), id="legacy")]


@pytest.mark.rule("SNAP-GPU-ID-INVALID")
@pytest.mark.parametrize("level", _ID_LEVELS)
@pytest.mark.parametrize("visible,selected,culprit,loads", _INVALID, ids=_INVALID_IDS)
def test_invalid_gpu_identity_is_a_clear_error(loader, monkeypatch, visible, selected, culprit, loads, level):
    """Files exist for every id a tolerant reading could produce, so a loader that guesses loads
    something; the rule wants the error, naming the variable, before any parameter is loaded.
    ``None`` is a variable left unset. On the single-file level, and on the legacy level alone."""
    for gpu in (0, 1, 2, 3, 5, 7, 12):
        if level == "single":
            S.write_safetensors(S.single_path(loader.model_dir, 0, gpu), M.state(SPEC, version=100 + gpu))
        else:
            S.write_legacy(loader.model_dir, gpu, M.state(SPEC, version=100 + gpu))
    unset = [var for var, value in (("CUDA_VISIBLE_DEVICES", visible), ("FLAGS_selected_gpus", selected)) if value is None]
    if unset:
        real_set = harness.set_worker_env

        def set_env_then_unset(environ, *args):  # the harness always sets both; drop what the case leaves unset
            real_set(environ, *args)
            for var in unset:
                environ.pop(var, None)

        monkeypatch.setattr(harness, "set_worker_env", set_env_then_unset)
    worker = Worker(0, visible or "", selected or "")
    where = f"CUDA_VISIBLE_DEVICES={visible!r} FLAGS_selected_gpus={selected!r}"
    if culprit is None:
        _update_and_expect(loader, worker, M.state(SPEC, version=100 + loads), f"{where}: physical gpu {loads}")
        return
    opened = []
    with check.raises((ValueError, IndexError), match=re.escape(culprit), where=where):
        opened.append(loader.open(SPEC, worker=worker))
        opened[0].update()
    if opened:  # raised by update(): nothing may have been loaded first
        check.not_loaded(opened[0].observe(), NAMES, f"{where}: after the identity error")


@pytest.mark.rule("SNAP-GPU-ID-INVALID")
@pytest.mark.parametrize("level", [pytest.param(lvl, marks=pytest.mark.requires(LEVEL_CAP[lvl]), id=lvl)
                                   for lvl in ("parts", "shared")])
@pytest.mark.parametrize("visible,selected,culprit", [("5,3,7", "3", "FLAGS_selected_gpus"),
                                                      ("5," + _UUID + ",7", "1", "CUDA_VISIBLE_DEVICES")],
                         ids=["one-past-last", "uuid-selected"])
def test_invalid_gpu_identity_is_a_clear_error_on_parts_and_shared(loader, level, visible, selected, culprit):
    """The same error on the parts level and the shared fallback, files present for every id a tolerant reading
    could produce."""
    for gpu in (0, 1, 2, 3, 5, 7):
        S.write_level(level, loader.model_dir, loader.shared_dir, 0, gpu, M.state(SPEC, version=100 + gpu))
    where = f"{level}: CUDA_VISIBLE_DEVICES={visible!r} FLAGS_selected_gpus={selected!r}"
    opened = []
    with check.raises((ValueError, IndexError), match=re.escape(culprit), where=where):
        opened.append(loader.open(SPEC, worker=Worker(0, visible, selected)))
        opened[0].update()
    if opened:
        check.not_loaded(opened[0].observe(), NAMES, f"{where}: after the identity error")


# -- SNAP-IDENTITY-AT-OPEN ------------------------------------------------------------------------
_A = Worker(1, "5,3,7", "1")  # physical 3
_B = Worker(12, "4,13", "1")  # physical 13
_C = Worker(0, "0,1", "0")  # the process environment at update time


@pytest.mark.rule("SNAP-IDENTITY-AT-OPEN")
@pytest.mark.modes(call="first")
@pytest.mark.parametrize(
    "level,order",
    [
        pytest.param("single", "AB", marks=pytest.mark.requires("snapshot.single"), id="single:A-then-B"),
        pytest.param("single", "BA", marks=pytest.mark.requires("snapshot.single"), id="single:B-then-A"),
        pytest.param("parts", "BA", marks=pytest.mark.requires("snapshot.parts"), id="parts:B-then-A"),
        pytest.param("legacy", "AB", marks=pytest.mark.requires("snapshot.legacy"), id="legacy:A-then-B"),
        pytest.param("shared", "BA", marks=pytest.mark.requires("snapshot.shared_fallback"), id="shared:B-then-A"),
    ],
)
def test_sessions_keep_the_identity_they_were_opened_with(loader, level, order):
    """Workers A (rank 1, gpu 3) and B (rank 12, gpu 13) opened one after the other, then the
    environment switched to C (rank 0, gpu 0), then both updated: each loads its own files."""
    workers = {"A": _A, "B": _B}
    wants = {"A": M.state(SPEC, version=1), "B": M.state(SPEC, version=2)}
    for key, w in workers.items():
        S.write_level(level, loader.model_dir, loader.shared_dir, w.rank, w.gpu_id, wants[key])
    S.write_level(level, loader.model_dir, loader.shared_dir, _C.rank, _C.gpu_id, M.state(SPEC, version=3))
    sessions = {key: loader.open(SPEC, worker=w) for key, w in workers.items()}
    set_worker_env(os.environ, _C.rank, _C.visible, _C.selected)  # the test's monkeypatch restores it
    for key in order:
        w = workers[key]
        sessions[key].update()
        check.params_equal(
            sessions[key].observe(), wants[key],
            f"{level}: session {key} opened as rank {w.rank} gpu {w.gpu_id}, updated (order {order}) while the "
            f"environment says rank {_C.rank} gpu {_C.gpu_id}",
        )


@pytest.mark.rule("SNAP-IDENTITY-AT-OPEN")
@pytest.mark.parametrize("combo", _level_combos("SNAP-IDENTITY-AT-OPEN"))
def test_sessions_keep_the_identity_they_were_opened_with_in_every_mode(loader, combo):
    """Workers A and B opened one after the other, their earlier updates done, then the environment switched to C:
    each update under test (the first, or a later one) still loads the session's own files."""
    level = combo["path"]
    workers = {"A": _A, "B": _B}
    wants = {"A": M.state(SPEC, version=1), "B": M.state(SPEC, version=2)}
    sessions = {key: loader.open(SPEC, worker=w, options=R.options(combo)) for key, w in workers.items()}
    set_worker_env(os.environ, _C.rank, _C.visible, _C.selected)  # the test's monkeypatch restores it
    for key, w in workers.items():
        R.earlier_snapshot(combo, sessions[key], SPEC, loader.model_dir, loader.shared_dir, level=level, rank=w.rank,
                           gpu_id=w.gpu_id)
    for key, w in workers.items():
        S.write_level(level, loader.model_dir, loader.shared_dir, w.rank, w.gpu_id, wants[key])
    S.write_level(level, loader.model_dir, loader.shared_dir, _C.rank, _C.gpu_id, M.state(SPEC, version=3))
    for key in "BA":
        sessions[key].update()
        check.params_equal(sessions[key].observe(), wants[key], f"{level}: session {key} opened as rank "
                           f"{workers[key].rank} gpu {workers[key].gpu_id}, updated while the environment says rank "
                           f"{_C.rank} gpu {_C.gpu_id} ({R.label(combo)})")
