"""ipc_snapshot source priority: parts > single file > legacy tp0{id} > shared pickle. Spec: SPEC.md § LEVEL.

The worker is rank 2 on physical GPU 3, so the base name (``model_state.tp2.3``), the legacy name
(``model_state.tp03``) and rank 0's names all differ. Every level holds the whole state at a
version of its own: the values the model ends with name the level that was applied. Cases marked
``trace`` also check that no other level was applied on top.
"""
import os
import re

import pytest

from conformance import check
from conformance.harness import Worker
from fixtures import models as M
from fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (4, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 2)), ("norm.bias", "float16", (4,)))
RANK, GPU = 2, 3
WORKER = Worker(RANK, "0,1,2,3", "3")
LEVELS = ("parts", "single", "legacy", "shared")
VERSION = {"parts": 1, "single": 2, "legacy": 3, "shared": 4}
TRACE = pytest.mark.requires("trace")


def _write_levels(loader, present):
    """Write each level in ``present``; return the basenames each level's sources have."""
    names = {}
    for level in present:
        st = M.state(SPEC, version=VERSION[level])
        if level == "parts":
            paths = S.write_parts(loader.model_dir, RANK, GPU, dict(enumerate(S.split(st, 2))))
        elif level == "single":
            paths = [S.write_safetensors(S.single_path(loader.model_dir, RANK, GPU), st)]
        elif level == "legacy":
            paths = [S.write_safetensors(S.legacy_path(loader.model_dir, GPU), st)]
        else:
            paths = [S.write_pickle_fallback(_fallback_path(loader), st)]
        names[level] = [os.path.basename(p) for p in paths]
    return names


def _fallback_path(loader):
    return os.path.join(loader.shared_dir, S.base_name(RANK, GPU) + S.PDPARAMS)


def _claims_shared(loader) -> bool:
    # The shared directory is only written for implementations that read it from LoaderConfig;
    # the others (FastDeploy hard-codes /shared_ipc_meta) still have levels 1-3 checked.
    return "snapshot.shared_fallback" in loader.adapter.capabilities


def _check_level_wins(loader, winner, observe):
    present = [lvl for lvl in LEVELS[LEVELS.index(winner) :] if lvl != "shared" or _claims_shared(loader)]
    names = _write_levels(loader, present)
    session = loader.open(SPEC, worker=WORKER)
    session.update()
    where = f"rank {RANK} gpu {GPU}, {loader.model_dir} + {loader.shared_dir} holding {', '.join(present)}"
    if observe == "values":
        check.params_equal(session.observe(), M.state(SPEC, version=VERSION[winner]), f"{where}: {winner} must win")
    else:
        check.sources(session.trace(), names[winner], f"{where}: only {winner} may be applied")


OBSERVE = pytest.mark.parametrize(
    "observe", [pytest.param("values", id="values"), pytest.param("trace", marks=TRACE, id="trace")]
)


@pytest.mark.rule("LEVEL-PARTS-FIRST")
@pytest.mark.requires("snapshot.parts", "snapshot.single", "snapshot.legacy")
@OBSERVE
def test_parts_win_over_every_level(loader, observe):
    _check_level_wins(loader, "parts", observe)


@pytest.mark.rule("LEVEL-SINGLE-SECOND")
@pytest.mark.requires("snapshot.single", "snapshot.legacy")
@OBSERVE
def test_single_file_wins_without_parts(loader, observe):
    _check_level_wins(loader, "single", observe)


@pytest.mark.rule("LEVEL-LEGACY-THIRD")
@pytest.mark.requires("snapshot.legacy")
@OBSERVE
def test_legacy_file_wins_without_parts_or_single(loader, observe):
    _check_level_wins(loader, "legacy", observe)


@pytest.mark.rule("LEVEL-SHARED-LAST")
@pytest.mark.requires("snapshot.shared_fallback")
@pytest.mark.parametrize(
    "others",
    [
        pytest.param(False, id="model-dir-empty"),
        # Rank 0's files in model_dir are not this worker's: the fallback is still the one to use.
        pytest.param(True, id="model-dir-holds-other-ranks-files"),
    ],
)
def test_shared_pickle_used_when_model_dir_has_nothing(loader, others):
    if others:
        decoy = M.state(SPEC, version=9)
        S.write_safetensors(S.single_path(loader.model_dir, 0, GPU), decoy)
        S.write_parts(loader.model_dir, 0, GPU, {0: decoy})
    _check_level_wins(loader, "shared", "values")


@pytest.mark.rule("LEVEL-NONE-FOUND")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("empty", id="nothing-anywhere"),
        pytest.param("other-ranks", id="only-other-ranks-files"),
        pytest.param("invalid-parts", id="only-invalid-part-names"),
    ],
)
def test_no_snapshot_is_file_not_found_listing_checks(loader, layout):
    decoy = M.state(SPEC, version=9)
    if layout == "other-ranks":
        S.write_safetensors(S.single_path(loader.model_dir, 0, GPU), decoy)
        S.write_safetensors(S.single_path(loader.model_dir, 23, GPU), decoy)  # tp23.3: not tp2.3
        if _claims_shared(loader):
            S.write_pickle_fallback(os.path.join(loader.shared_dir, S.base_name(0, GPU) + S.PDPARAMS), decoy)
    elif layout == "invalid-parts":
        S.write_safetensors(os.path.join(loader.model_dir, f"{S.base_name(RANK, GPU)}.partx{S.PDPARAMS}"), decoy)
    base = S.base_name(RANK, GPU)
    with check.raises(
        FileNotFoundError,
        match=re.escape(f"No snapshot found for {base}"),
        names=[loader.model_dir] + ([_fallback_path(loader)] if _claims_shared(loader) else []),
        where=f"rank {RANK} gpu {GPU}, {layout}",
    ):
        session = loader.open(SPEC, worker=WORKER)
        session.update()
