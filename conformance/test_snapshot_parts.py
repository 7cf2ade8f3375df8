"""ipc_snapshot part files: order, labels, index parsing, invalid names, duplicates. Spec: SPEC.md § PART.

Every part in the ordering tests holds the whole state at a version of its own, so the values the
model ends with name the part applied last; that check needs no trace. Cases marked ``trace``
additionally compare the labels the implementation reports.
"""
import logging
import os

import pytest

from conformance import check
from fixtures import models as M
from fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (4, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 2)), ("norm.bias", "float16", (4,)))
TRACE = pytest.mark.requires("trace")


def _write_versioned_parts(model_dir, indices, write_order, rank=0, gpu=0):
    """Part i holds the whole state at version 100 + i; files are created in ``write_order``."""
    for i in write_order:
        assert i in indices
        S.write_safetensors(S.part_path(model_dir, rank, gpu, i), M.state(SPEC, version=100 + i))
    return M.state(SPEC, version=100 + max(indices))


def _labels(indices):
    return [f"snapshot-part{i}" for i in sorted(indices)]


# Created in a scrambled order; by name the order would be 0, 1, 10, 11, 2, 9 (part9 last).
_SIX = (9, 11, 0, 10, 2, 1)


@pytest.mark.rule("PART-ORDER-NUMERIC")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.parametrize(
    "write_order,observe",
    [
        pytest.param((10, 2), "values", id="2-before-10:created-10-first:values"),
        pytest.param((2, 10), "values", id="2-before-10:created-2-first:values"),
        pytest.param((10, 9), "values", id="9-before-10:values"),
        pytest.param(_SIX, "values", id="0-1-2-9-10-11-scrambled:values"),
        pytest.param((10, 2), "trace", marks=TRACE, id="2-before-10:trace"),
        pytest.param((10, 9), "trace", marks=TRACE, id="9-before-10:trace"),
        pytest.param(_SIX, "trace", marks=TRACE, id="0-1-2-9-10-11-scrambled:trace"),
    ],
)
def test_parts_load_in_numeric_order(loader, write_order, observe):
    indices = set(write_order)
    last = _write_versioned_parts(loader.model_dir, indices, write_order)
    session = loader.open(SPEC)
    session.update()
    where = f"{loader.model_dir}: parts {sorted(indices)} created in order {list(write_order)}"
    if observe == "values":
        check.params_equal(session.observe(), last, f"{where}: every tensor must hold part{max(indices)}'s value")
    else:
        check.labels(session.trace(), _labels(indices), where)


@pytest.mark.rule("PART-LABEL-INDEX")
@pytest.mark.requires("snapshot.parts", "trace")
def test_parts_are_labelled_by_parsed_index(loader):
    """Parts {0, 2, 10} (non-contiguous) each hold a third of the state."""
    want = M.state(SPEC, version=1)
    indices = (0, 2, 10)
    S.write_parts(loader.model_dir, 0, 0, dict(zip(indices, S.split(want, 3))))
    session = loader.open(SPEC)
    session.update()
    check.params_equal(session.observe(), want, f"{loader.model_dir}: parts {list(indices)}")
    check.labels(session.trace(), _labels(indices), f"{loader.model_dir}: parts {list(indices)}")
    check.sources(
        session.trace(), [os.path.basename(S.part_path("", 0, 0, i)) for i in indices], f"{loader.model_dir}: parts"
    )


@pytest.mark.rule("PART-INDEX-BASENAME")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.parametrize(
    "write_order,observe",
    [
        pytest.param((10, 2), "values", id="created-10-first:values"),
        pytest.param((2, 10), "values", id="created-2-first:values"),
        pytest.param((10, 2), "trace", marks=TRACE, id="trace"),
    ],
)
def test_part_index_ignores_directory_name(loader, write_order, observe):
    """model_dir is .../ckpt.part7.run/: a full-path search would read index 7 for every part."""
    model_dir = os.path.join(os.path.dirname(loader.model_dir), "ckpt.part7.run")
    last = _write_versioned_parts(model_dir, set(write_order), write_order)
    session = loader.open(SPEC, model_dir=model_dir)
    session.update()
    where = f"{model_dir}: parts 2 and 10 created in order {list(write_order)}"
    if observe == "values":
        check.params_equal(session.observe(), last, f"{where}: every tensor must hold part10's value")
    else:
        check.labels(session.trace(), _labels({2, 10}), where)


INVALID = ("partabc", "part", "part1x")


def _invalid_path(model_dir, suffix):
    return os.path.join(model_dir, f"{S.base_name(0, 0)}.{suffix}{S.PDPARAMS}")


@pytest.mark.rule("PART-INVALID-IGNORED")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("beside-valid-parts", id="beside-valid-parts"),
        pytest.param("all-invalid", marks=pytest.mark.requires("snapshot.single"), id="all-invalid-falls-through-to-single"),
    ],
)
def test_invalid_part_names_are_ignored_with_one_warning(loader, caplog, layout):
    want, decoy = M.state(SPEC, version=1), M.state(SPEC, version=9)
    invalid = [os.path.basename(S.write_safetensors(_invalid_path(loader.model_dir, s), decoy)) for s in INVALID]
    if layout == "beside-valid-parts":
        S.write_parts(loader.model_dir, 0, 0, dict(enumerate(S.split(want, 2))))
    else:
        S.write_safetensors(S.single_path(loader.model_dir, 0, 0), want)
    caplog.set_level(logging.WARNING)  # root logger: whatever logger the implementation uses
    session = loader.open(SPEC)
    session.update()
    where = f"{loader.model_dir} ({layout}) with {', '.join(invalid)}"
    check.params_equal(session.observe(), want, f"{where}: invalid part files must not be loaded")
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    naming = [r.getMessage() for r in records if any(name in r.getMessage() for name in invalid)]
    check.that(
        len(naming) == 1,
        f"{where}: expected exactly one WARNING record naming the invalid part files, got {len(naming)}: {naming}",
    )
    if naming:
        unnamed = [name for name in invalid if name not in naming[0]]
        check.that(not unnamed, f"{where}: the warning {naming[0]!r} does not name {unnamed}")


@pytest.mark.rule("PART-DUPLICATE-LATER-WINS")
@pytest.mark.requires("snapshot.parts")
def test_tensor_repeated_across_parts_takes_later_value(loader):
    """part0 holds everything at v1; part1 repeats norm.bias (v2); part3 repeats embed.weight (v3)."""
    v1, v2, v3 = (M.state(SPEC, version=v) for v in (1, 2, 3))
    S.write_parts(
        loader.model_dir,
        0,
        0,
        {3: {"embed.weight": v3["embed.weight"]}, 0: v1, 1: {"norm.bias": v2["norm.bias"]}},
    )
    want = dict(v1, **{"norm.bias": v2["norm.bias"], "embed.weight": v3["embed.weight"]})
    session = loader.open(SPEC)
    session.update()
    check.params_equal(session.observe(), want, f"{loader.model_dir}: duplicates in part0/part1/part3")
