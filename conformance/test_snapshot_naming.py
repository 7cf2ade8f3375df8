"""ipc_snapshot naming and sharding: who loads which file. Spec: SPEC.md § SNAP."""
import os

import pytest

from conformance import check
from conformance.harness import Worker
from fixtures import models as M
from fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))


@pytest.mark.rule("SNAP-NAME-SINGLE")
@pytest.mark.requires("snapshot.single")
def test_single_file_rank_and_id_are_separated(loader):
    """tp1.234 and tp12.34 both present: each worker loads its own file."""
    v_a, v_b = M.state(SPEC, version=1), M.state(SPEC, version=2)
    S.write_safetensors(S.single_path(loader.model_dir, 1, 234), v_a)
    S.write_safetensors(S.single_path(loader.model_dir, 12, 34), v_b)
    for worker, want in ((Worker(1, "234"), v_a), (Worker(12, "34"), v_b)):
        session = loader.open(SPEC, worker=worker)
        session.update()
        check.params_equal(session.observe(), want, f"worker rank={worker.rank} gpu={worker.gpu_id}")


@pytest.mark.rule("SNAP-NAME-PARTS")
@pytest.mark.requires("snapshot.parts")
def test_part_glob_does_not_match_longer_id(loader):
    """tp1.2.part* must not pick up tp1.23.part1 lying beside it."""
    mine, other = M.state(SPEC, version=1), M.state(SPEC, version=2)
    S.write_parts(loader.model_dir, 1, 2, dict(enumerate(S.split(mine, 2))))
    S.write_safetensors(S.part_path(loader.model_dir, 1, 23, 1), other)
    session = loader.open(SPEC, worker=Worker(1, "2"))
    session.update()
    check.params_equal(session.observe(), mine, "worker rank=1 gpu=2 with tp1.23.part1 present")


def _write_every_rank(loader, layout: str, ranks):
    states = {r: M.state(SPEC, seed=r, version=1) for r in ranks}
    for r, st in states.items():
        if layout == "parts":
            S.write_parts(loader.model_dir, r, r, dict(enumerate(S.split(st, 3))))
        elif layout == "single":
            S.write_safetensors(S.single_path(loader.model_dir, r, r), st)
        else:
            S.write_pickle_fallback(os.path.join(loader.shared_dir, S.base_name(r, r) + ".pdparams"), st)
    return states


@pytest.mark.rule("SNAP-RANK-OWN-SHARD")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("parts", marks=pytest.mark.requires("snapshot.parts"), id="parts"),
        pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="single-file"),
        pytest.param("shared", marks=pytest.mark.requires("snapshot.shared_fallback"), id="shared-fallback"),
    ],
)
def test_each_rank_loads_its_own_shard(loader, layout):
    """Ranks 0..3 on GPUs 0..3, every shard present: each rank ends with its own values."""
    ranks = range(4)
    states = _write_every_rank(loader, layout, ranks)
    visible = ",".join(str(r) for r in ranks)
    for r in ranks:
        session = loader.open(SPEC, worker=Worker(r, visible, str(r)))
        session.update()
        check.params_equal(session.observe(), states[r], f"{layout}: rank {r} on gpu {r}")


@pytest.mark.rule("SNAP-GPU-ID")
@pytest.mark.requires("snapshot.single")
def test_file_id_is_physical_gpu(loader):
    """CUDA_VISIBLE_DEVICES=2,3,4 and FLAGS_selected_gpus=1 select files named ...tp0.3..."""
    want, decoy = M.state(SPEC, version=1), M.state(SPEC, version=2)
    S.write_safetensors(S.single_path(loader.model_dir, 0, 3), want)
    S.write_safetensors(S.single_path(loader.model_dir, 0, 1), decoy)
    session = loader.open(SPEC, worker=Worker(0, "2,3,4", "1"))
    session.update()
    check.params_equal(session.observe(), want, "CUDA_VISIBLE_DEVICES=2,3,4 FLAGS_selected_gpus=1")


@pytest.mark.rule("SNAP-GPU-ID-INVALID")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize(
    "visible,selected,culprit",
    [("GPU-5f3c2a1e-0000-4b4b-9c9c-123456789abc", "0", "CUDA_VISIBLE_DEVICES"), ("0,1", "2", "FLAGS_selected_gpus")],
    ids=["uuid-entry", "selection-out-of-range"],
)
def test_invalid_gpu_identity_is_a_clear_error(loader, visible, selected, culprit):
    S.write_safetensors(S.single_path(loader.model_dir, 0, 0), M.state(SPEC))
    with check.raises((ValueError, IndexError), match=culprit, where=f"{culprit} invalid"):
        session = loader.open(SPEC, worker=Worker(0, visible, selected))
        session.update()
