"""Validation and apply: bit-exact round trip, dtype/shape checks and their order, unknown and
missing names, MTP models. Spec: SPEC.md § APPLY.

Inputs are written with the safetensors library (and ``paddle.save`` for the shared fallback), never
by the implementation. Mismatch tests use one model parameter against a file tensor of the same
name whose dtype and/or shape differ.
"""
import itertools
import os
import re

import pytest

from conformance import check
from fixtures import models as M
from fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (4, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 2)), ("norm.bias", "float16", (4,)))

ALL_DTYPES = M.spec(
    ("w.bf16", "bfloat16", (3, 4)),
    ("w.fp16", "float16", (5,)),
    ("w.fp32", "float32", (2, 3)),
    ("w.int64", "int64", (3,)),
    ("w.uint8", "uint8", (7,)),
    ("w.bool", "bool", (2, 5)),
    ("w.fp8_e4m3fn", "float8_e4m3fn", (4, 2)),
    ("w.fp8_e5m2", "float8_e5m2", (6,)),
    ("scalar.bf16", "bfloat16", ()),
    ("scalar.fp32", "float32", ()),
    ("scalar.int64", "int64", ()),
    ("scalar.fp8_e4m3fn", "float8_e4m3fn", ()),
)
# paddle.save (numpy underneath) cannot hold fp8: the pickle fallback round-trips the rest.
PICKLABLE = M.ModelSpec(tuple(p for p in ALL_DTYPES.main if not p.dtype.startswith("float8")))


def _write(loader, layout, st, rank=0, gpu=0):
    if layout == "single":
        return [S.write_safetensors(S.single_path(loader.model_dir, rank, gpu), st)]
    if layout == "parts":
        return S.write_parts(loader.model_dir, rank, gpu, dict(enumerate(S.split(st, 2))))
    return [S.write_pickle_fallback(os.path.join(loader.shared_dir, S.base_name(rank, gpu) + S.PDPARAMS), st)]


LAYOUTS = [
    pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="single-file"),
    pytest.param("parts", marks=pytest.mark.requires("snapshot.parts"), id="parts"),
    pytest.param("shared", marks=pytest.mark.requires("snapshot.shared_fallback"), id="shared-fallback"),
]


@pytest.mark.rule("APPLY-ROUNDTRIP-DTYPES")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_dtype_round_trips_bit_exact(loader, layout):
    spec = PICKLABLE if layout == "shared" else ALL_DTYPES
    want = M.state(spec, version=3)
    _write(loader, layout, want)
    session = loader.open(spec)
    session.update()
    check.params_equal(session.observe(), want, f"{layout} snapshot in {loader.model_dir}")


MISMATCH_DTYPES = ("bfloat16", "float16", "float32", "int64", "float8_e4m3fn")
DTYPE_PAIRS = [
    *itertools.permutations(MISMATCH_DTYPES, 2),
    ("float8_e4m3fn", "float8_e5m2"),
    ("float8_e5m2", "float8_e4m3fn"),
]


def _mismatch(loader, name, model_dtype, model_shape, file_dtype, file_shape):
    """Model: SPEC with ``name`` as (model_dtype, model_shape); file: the same state but ``name``
    as (file_dtype, file_shape)."""
    others = [(p.name, p.dtype, p.shape) for p in SPEC.main if p.name != name]
    model = M.spec((name, model_dtype, model_shape), *others)
    st = M.state(M.spec((name, file_dtype, file_shape), *others), version=2)
    path = S.write_safetensors(S.single_path(loader.model_dir, 0, 0), st)
    return loader.open(model), path


@pytest.mark.rule("APPLY-DTYPE-MISMATCH")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize("model_dtype,file_dtype", DTYPE_PAIRS, ids=[f"model-{a}:file-{b}" for a, b in DTYPE_PAIRS])
def test_dtype_mismatch_is_type_error_naming_tensor(loader, model_dtype, file_dtype):
    name = "layers.0.attn.qkv"
    session, path = _mismatch(loader, name, model_dtype, (4, 2), file_dtype, (4, 2))
    with check.raises(
        TypeError, match=re.escape(f"Type mismatch for {name}"), where=f"{path}: {name} {file_dtype} into {model_dtype}"
    ):
        session.update()


SHAPES = [((4, 4), (16,)), ((4, 4), (4, 5)), ((2, 3), (3, 2)), ((4,), ()), ((), (1,))]


@pytest.mark.rule("APPLY-SHAPE-MISMATCH")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize(
    "model_shape,file_shape", SHAPES, ids=[f"model-{list(a)}:file-{list(b)}" for a, b in SHAPES]
)
def test_shape_mismatch_is_value_error_naming_tensor(loader, model_shape, file_shape):
    name = "layers.0.attn.qkv"
    session, path = _mismatch(loader, name, "float32", model_shape, "float32", file_shape)
    with check.raises(
        ValueError,
        match=re.escape(f"Shape mismatch for {name}"),
        where=f"{path}: {name} {list(file_shape)} into {list(model_shape)}",
    ):
        session.update()


@pytest.mark.rule("APPLY-DTYPE-BEFORE-SHAPE")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize(
    "model,file",
    [(("float32", (4, 4)), ("bfloat16", (16,))), (("bfloat16", (2, 3)), ("float16", (3, 2))), (("int64", (4,)), ("float32", ()))],
    ids=["fp32[4,4]-vs-bf16[16]", "bf16[2,3]-vs-fp16[3,2]", "int64[4]-vs-fp32-scalar"],
)
def test_dtype_is_checked_before_shape(loader, model, file):
    name = "layers.0.attn.qkv"
    session, path = _mismatch(loader, name, *model, *file)
    with check.raises(
        TypeError, match=re.escape(f"Type mismatch for {name}"), where=f"{path}: {name} {file} into {model}"
    ):
        session.update()


@pytest.mark.rule("APPLY-UNKNOWN-IGNORED")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="extras-in-single-file"),
        pytest.param("own-part", marks=pytest.mark.requires("snapshot.parts"), id="part-with-only-extras"),
        pytest.param("shared", marks=pytest.mark.requires("snapshot.shared_fallback"), id="extras-in-shared-fallback"),
    ],
)
def test_unknown_names_are_ignored(loader, layout):
    want = M.state(SPEC, version=1)
    # Training-side names, and names that would not even fit (other dtype/shape).
    extras = M.state(
        M.spec(
            ("model.embed.weight", "float32", (4, 4)),
            ("lm_head.weight", "bfloat16", (7, 3)),
            ("optimizer.step", "int64", ()),
        ),
        version=5,
    )
    if layout == "single":
        _write(loader, "single", {**want, **extras})
    elif layout == "own-part":
        S.write_parts(loader.model_dir, 0, 0, {0: want, 1: extras})
    else:
        _write(loader, "shared", {**want, **extras})
    session = loader.open(SPEC)
    session.update()
    observed = session.observe()
    where = f"{layout} snapshot with extra tensors {sorted(extras)}"
    check.params_equal(observed, want, where)
    check.equal(sorted(observed), sorted(want), f"{where}: parameter names after the update")


@pytest.mark.rule("APPLY-MISSING-FAILS")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize(
    "when,observe",
    [
        pytest.param("first-load", "error", id="first-load"),
        pytest.param("after-clear", "error", id="after-clear"),
        pytest.param("after-clear", "status", marks=pytest.mark.requires("status"), id="after-clear:status"),
    ],
)
def test_missing_parameter_fails_by_name(loader, when, observe):
    path = S.single_path(loader.model_dir, 0, 0)
    missing = ["layers.0.mlp.weight", "norm.bias"]
    session = loader.open(SPEC)
    if when == "after-clear":
        S.write_safetensors(path, M.state(SPEC, version=1))
        session.update()
        session.clear()
    v2 = M.state(SPEC, version=2)
    S.write_safetensors(path, {k: v for k, v in v2.items() if k not in missing})
    with check.raises(RuntimeError, match="|".join(map(re.escape, missing)), names=missing, where=f"{path} lacks {missing}"):
        session.update()
    if observe == "status":
        check.status_not(session, "NORMAL", f"{path} lacks {missing}")


MTP_SPEC = M.spec(
    ("embed.weight", "float32", (4, 4)),
    ("layers.0.mlp.weight", "bfloat16", (4, 2)),
    mtp=[[("mtp.0.proj.weight", "bfloat16", (4, 4)), ("mtp.0.norm.weight", "float32", (4,))]],
)


@pytest.mark.rule("APPLY-MTP-LOADED")
@pytest.mark.requires("mtp")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="single-file"),
        pytest.param("mtp-own-part", marks=pytest.mark.requires("snapshot.parts"), id="mtp-in-its-own-part"),
        pytest.param("shared", marks=pytest.mark.requires("snapshot.shared_fallback"), id="shared-fallback"),
    ],
)
def test_main_and_mtp_models_both_loaded(loader, layout):
    want = M.state(MTP_SPEC, version=1)
    if layout == "mtp-own-part":
        main = {p.name: want[p.name] for p in MTP_SPEC.main}
        S.write_parts(loader.model_dir, 0, 0, {0: main, 1: {k: v for k, v in want.items() if k not in main}})
    else:
        _write(loader, layout, want)
    session = loader.open(MTP_SPEC)
    session.update()
    check.params_equal(session.observe(), want, f"{layout} snapshot with main + MTP tensors")
