"""Validation and apply: bit-exact round trip, dtype/shape checks and their order, validation before
any change, unknown and missing names, MTP models. Spec: SPEC.md § APPLY.

Every rule runs on every snapshot source that carries tensors: the single file, three parts (the
tensor at issue in the first, middle and last part), the legacy ``tp0{id}`` file and the shared
``paddle.save`` fallback (where ``paddle.save`` can hold the dtype: not fp8). Inputs are written with
the safetensors library (and ``paddle.save`` for the fallback), never by the implementation. Tensor
names sort as they are listed (``embed`` < ``layers`` < ``norm``), so "first", "middle" and "last"
hold for a loader reading a file in name order; cases at every position cover other orders.
"""
import logging
import os
import re

import pytest

from conformance import check
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

FIRST, MIDDLE, LAST = "embed.weight", "layers.0.mlp.weight", "norm.bias"
SPEC = M.spec((FIRST, "float32", (4, 4)), (MIDDLE, "bfloat16", (4, 2)), (LAST, "float16", (4,)))
MTP_NAMES = ("mtp.0.norm.weight", "mtp.0.proj.weight", "mtp.0.scale")
SPEC_MTP = M.spec(
    *((p.name, p.dtype, p.shape) for p in SPEC.main),
    mtp=[[(MTP_NAMES[0], "float32", (4,)), (MTP_NAMES[1], "bfloat16", (4, 4)), (MTP_NAMES[2], "float16", ())]],
)

CAPS = {
    "single": ("snapshot.single",),
    "parts": ("snapshot.parts",),
    "part0": ("snapshot.parts",),
    "part1": ("snapshot.parts",),
    "part2": ("snapshot.parts",),
    "legacy": ("snapshot.legacy",),
    "shared": ("snapshot.shared_fallback",),
}


def case(source, *values, extra=(), id=None):
    """A pytest.param for ``source`` requiring exactly its capability (plus ``extra``)."""
    return pytest.param(source, *values, marks=pytest.mark.requires(*CAPS[source], *extra), id=id or source)


def _write(loader, source, st, focus=(), nparts=3):
    """Write ``st`` as ``source``. ``partN``: ``nparts`` parts, part N holding exactly the ``focus``
    names and the others spread over the other parts; ``parts``: round-robin."""
    st = dict(sorted(st.items()))
    if source == "single":
        return [S.write_safetensors(S.single_path(loader.model_dir, 0, 0), st)]
    if source == "legacy":
        return [S.write_legacy(loader.model_dir, 0, st)]
    if source == "shared":
        return [S.write_pickle_fallback(f"{loader.shared_dir}/{S.base_name(0, 0)}{S.PDPARAMS}", st)]
    if source == "parts":
        return S.write_parts(loader.model_dir, 0, 0, dict(enumerate(S.split(st, nparts))))
    where = int(source.removeprefix("part"))
    focus = [focus] if isinstance(focus, str) else list(focus)
    parts = {i: {} for i in range(nparts)}
    for name in focus:
        parts[where][name] = st[name]
    others = [i for i in parts if i != where]
    for k, name in enumerate(n for n in st if n not in focus):
        parts[others[k % len(others)]][name] = st[name]
    return S.write_parts(loader.model_dir, 0, 0, {i: dict(sorted(t.items())) for i, t in parts.items()})


def _replace(st, name, dtype, shape, version=2):
    """``st`` with ``name`` replaced by a tensor of another dtype and/or shape."""
    return {**st, name: M.weights(M.ParamSpec(name, dtype, tuple(shape)), version=version)}


# -- round trip ---------------------------------------------------------------------------------
ALL_DTYPES = M.spec(
    ("w.bf16", "bfloat16", (3, 4)),
    ("w.bool", "bool", (2, 5)),
    ("w.fp16", "float16", (5,)),
    ("w.fp32", "float32", (2, 3)),
    ("w.fp64", "float64", (3,)),
    ("w.fp8_e4m3fn", "float8_e4m3fn", (4, 2)),
    ("w.fp8_e5m2", "float8_e5m2", (6,)),
    ("w.int32", "int32", (2, 2)),
    ("w.int64", "int64", (3,)),
    ("w.int8", "int8", (5,)),
    ("w.uint8", "uint8", (7,)),
    ("scalar.bf16", "bfloat16", ()),
    ("scalar.bool", "bool", ()),
    ("scalar.fp32", "float32", ()),
    ("scalar.fp8_e4m3fn", "float8_e4m3fn", ()),
    ("scalar.int64", "int64", ()),
    ("scalar.uint8", "uint8", ()),
    ("empty.bf16", "bfloat16", (0, 4)),
    ("empty.fp32", "float32", (4, 0)),
    ("empty.int64", "int64", (0,)),
    ("empty.fp8_e5m2", "float8_e5m2", (0, 4)),
    # A few hundred KiB each: a loader that switches copy strategy on size runs both branches.
    ("large.bf16", "bfloat16", (256, 513)),
    ("large.fp32", "float32", (160, 512)),
    ("large.uint8", "uint8", (300_007,)),
)
# paddle.save (numpy underneath) cannot hold fp8: the pickle fallback round-trips the rest.
PICKLABLE = M.ModelSpec(tuple(p for p in ALL_DTYPES.main if not p.dtype.startswith("float8")))


@pytest.mark.rule("APPLY-ROUNDTRIP-DTYPES")
@pytest.mark.parametrize("source", [case("single"), case("parts"), case("legacy"), case("shared")])
def test_every_dtype_round_trips_bit_exact(loader, source):
    spec = PICKLABLE if S.writes_pickle(source) else ALL_DTYPES
    want = M.state(spec, version=3)
    paths = _write(loader, source, want)
    session = loader.open(spec)
    session.update()
    check.params_equal(session.observe(), want, f"{source} snapshot {paths}")


# -- dtype and shape -----------------------------------------------------------------------------
SAME_ITEMSIZE = [
    ("bfloat16", "float16"), ("float16", "bfloat16"),
    ("uint8", "int8"), ("int8", "bool"), ("bool", "uint8"), ("uint8", "float8_e4m3fn"), ("bool", "float8_e5m2"),
    ("float8_e4m3fn", "float8_e5m2"), ("float8_e5m2", "float8_e4m3fn"),
    ("int32", "float32"), ("float32", "int32"),
    ("int64", "float64"), ("float64", "int64"),
]
OTHER_ITEMSIZE = [
    ("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "int64"), ("int64", "float16"),
    ("float32", "float64"), ("uint8", "float16"),
]
# (source, tensor at fault, its file dtype): the tensor first, middle and last in a file and in
# the first, middle and last of three parts; a same-itemsize pair each time.
DTYPE_WHERE = [
    case("single", FIRST, "int32", id="single:first"),
    case("single", LAST, "bfloat16", id="single:last"),
    case("part0", FIRST, "int32", id="part0-of-3"),
    case("part1", MIDDLE, "float16", id="part1-of-3"),
    case("part2", LAST, "bfloat16", id="part2-of-3"),
    case("legacy", LAST, "bfloat16", id="legacy:last"),
    case("shared", FIRST, "int32", id="shared:first"),
    case("shared", LAST, "bfloat16", id="shared:last"),
    case("single", MTP_NAMES[2], "bfloat16", extra=("mtp",), id="single:mtp-tensor"),
    case("part2", MTP_NAMES[1], "float16", extra=("mtp",), id="part2-of-3:mtp-tensor"),
]


def _spec_of(name):
    return SPEC_MTP if name in MTP_NAMES else SPEC


def _open_with_bad_tensor(loader, source, spec, name, file_dtype, file_shape):
    """Write version 2 of ``spec`` to ``source`` with ``name`` as ``file_dtype``/``file_shape`` (the
    file holding it chosen by ``source``) and open a session; returns (session, paths written)."""
    st = _replace(M.state(spec, version=2), name, file_dtype, file_shape)
    paths = _write(loader, source, st, focus=name)
    return loader.open(spec), paths


@pytest.mark.rule("APPLY-DTYPE-MISMATCH")
@pytest.mark.parametrize(
    "source,name,model_dtype,file_dtype",
    [case("single", MIDDLE, a, b, id=f"same-itemsize:model-{a}:file-{b}") for a, b in SAME_ITEMSIZE]
    + [case("single", MIDDLE, a, b, id=f"other-itemsize:model-{a}:file-{b}") for a, b in OTHER_ITEMSIZE]
    + [pytest.param(*p.values[:2], None, p.values[2], marks=p.marks, id=p.id) for p in DTYPE_WHERE],
)
def test_dtype_mismatch_is_type_error_naming_tensor(loader, source, name, model_dtype, file_dtype):
    spec = _spec_of(name)
    if model_dtype is not None:
        spec = M.spec(*((p.name, model_dtype if p.name == name else p.dtype, p.shape) for p in spec.main))
    target = spec.param(name)
    session, paths = _open_with_bad_tensor(loader, source, spec, name, file_dtype, target.shape)
    with check.raises(
        TypeError, match=re.escape(f"Type mismatch for {name}"), names=[name],
        where=f"{source} {paths}: {name} {file_dtype} into a {target.dtype} parameter",
    ):
        session.update()


SHAPES = [
    ((4, 4), (16,), "same-numel-flat"),
    ((16,), (4, 4), "same-numel-unflattened"),
    ((4, 4), (2, 8), "same-numel-regrouped"),
    ((2, 3), (3, 2), "transposed"),
    ((), (1,), "0-d-vs-[1]"),
    ((1,), (), "[1]-vs-0-d"),
    ((0, 4), (4, 0), "[0,4]-vs-[4,0]"),
    ((4, 0), (0,), "[4,0]-vs-[0]"),
    ((4, 4), (4, 4, 1), "extra-trailing-1"),
    ((4, 4), (1, 4, 4), "extra-leading-1"),
    ((4, 1), (4,), "dropped-1"),
    ((4,), (5,), "one-more"),
    ((4,), (3,), "one-less"),
    ((4, 4), (4, 5), "one-more-column"),
]
SHAPE_WHERE = [
    case("single", FIRST, (16,), id="single:first"),
    case("single", LAST, (2, 2), id="single:last"),
    case("part0", FIRST, (2, 8), id="part0-of-3"),
    case("part1", MIDDLE, (2, 4), id="part1-of-3"),
    case("part2", LAST, (4, 1), id="part2-of-3"),
    case("legacy", LAST, (2, 2), id="legacy:last"),
    case("shared", FIRST, (16,), id="shared:first"),
    case("shared", LAST, (1, 4), id="shared:last"),
    case("part2", MTP_NAMES[1], (16,), extra=("mtp",), id="part2-of-3:mtp-tensor"),
]


@pytest.mark.rule("APPLY-SHAPE-MISMATCH")
@pytest.mark.parametrize(
    "source,name,model_shape,file_shape",
    [case("single", MIDDLE, a, b, id=f"{i}:model-{list(a)}:file-{list(b)}") for a, b, i in SHAPES]
    + [pytest.param(*p.values[:2], None, p.values[2], marks=p.marks, id=p.id) for p in SHAPE_WHERE],
)
def test_shape_mismatch_is_value_error_naming_tensor(loader, source, name, model_shape, file_shape):
    spec = _spec_of(name)
    if model_shape is not None:
        spec = M.spec(*((p.name, "float32", model_shape) if p.name == name else (p.name, p.dtype, p.shape) for p in spec.main))
    target = spec.param(name)
    session, paths = _open_with_bad_tensor(loader, source, spec, name, target.dtype, file_shape)
    with check.raises(
        ValueError, match=re.escape(f"Shape mismatch for {name}"), names=[name],
        where=f"{source} {paths}: {name} {list(file_shape)} into a {list(target.shape)} parameter",
    ):
        session.update()


# Wrong in dtype and shape at once (the shape keeping the element count or the byte count).
BOTH = [
    case("single", MIDDLE, "float16", (8,), id="single:bf16[4,2]-vs-fp16[8]"),
    case("single", FIRST, "bfloat16", (32,), id="single:fp32[4,4]-vs-bf16[32]-same-bytes"),
    case("single", LAST, "float32", (), id="single:fp16[4]-vs-fp32-scalar"),
    case("part0", FIRST, "int32", (16,), id="part0-of-3"),
    case("part2", LAST, "bfloat16", (2, 2), id="part2-of-3"),
    case("legacy", MIDDLE, "float16", (2, 4), id="legacy"),
    case("shared", FIRST, "int32", (2, 8), id="shared"),
    case("single", MTP_NAMES[1], "float16", (16,), extra=("mtp",), id="single:mtp-tensor"),
]


@pytest.mark.rule("APPLY-DTYPE-BEFORE-SHAPE")
@pytest.mark.parametrize("source,name,file_dtype,file_shape", BOTH)
def test_dtype_is_checked_before_shape(loader, source, name, file_dtype, file_shape):
    spec = _spec_of(name)
    target = spec.param(name)
    session, paths = _open_with_bad_tensor(loader, source, spec, name, file_dtype, file_shape)
    with check.raises(
        TypeError, match=re.escape(f"Type mismatch for {name}"), names=[name],
        where=f"{source} {paths}: {name} {file_dtype}{list(file_shape)} into {target.dtype}{list(target.shape)}",
    ):
        session.update()


# (source, tensor at fault, file dtype, file shape): the bad tensor anywhere in any file; every
# other tensor of the snapshot is fine and would load.
ATOMIC = [
    case("single", LAST, "bfloat16", (4,), id="single:last:dtype"),
    case("single", MIDDLE, "bfloat16", (2, 4), id="single:middle:shape"),
    case("single", FIRST, "float32", (16,), id="single:first:shape"),
    case("part2", LAST, "float32", (4,), id="part2-of-3:dtype"),
    case("part2", LAST, "float16", (2, 2), id="part2-of-3:shape"),
    case("part1", MIDDLE, "float16", (4, 2), id="part1-of-3:dtype"),
    case("legacy", LAST, "float16", (5,), id="legacy:last:shape"),
    case("shared", LAST, "bfloat16", (4,), id="shared:last:dtype"),
    case("shared", MIDDLE, "bfloat16", (8,), id="shared:middle:shape"),
    case("part2", MTP_NAMES[2], "float32", (), extra=("mtp",), id="part2-of-3:mtp-tensor"),
]


@pytest.mark.rule("APPLY-VALIDATE-FIRST")
@pytest.mark.parametrize("source,name,file_dtype,file_shape", ATOMIC)
def test_rejected_snapshot_changes_no_parameter(loader, source, name, file_dtype, file_shape):
    spec = _spec_of(name)
    target = spec.param(name)
    session, paths = _open_with_bad_tensor(loader, source, spec, name, file_dtype, file_shape)
    bad = os.path.basename(paths[int(source.removeprefix("part"))] if source.startswith("part") else paths[0])
    where = f"{source} {paths}: {name} {file_dtype}{list(file_shape)} into {target.dtype}{list(target.shape)}"
    error = TypeError if file_dtype != target.dtype else ValueError
    with check.raises(error, match=re.escape(name), names=[name, bad], where=where):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in spec.all_params], where)


# -- unknown and missing names --------------------------------------------------------------------
EXTRAS = M.spec(
    ("model.embed.weight", "float32", (4, 4)),  # the training-side name of a parameter; would fit
    ("model.norm.bias", "float32", (4,)),  # would not fit norm.bias (float16)
    ("embed", "int8", (2, 3)),  # a prefix of a parameter's name
    ("embed.weight_scale", "float8_e4m3fn", (4,)),  # shares a prefix, a dtype the model lacks
    ("layers.0.mlp.weight.t", "bfloat16", (2, 4)),
    ("lm_head.weight", "bfloat16", (7, 3)),
    ("optimizer.step", "int64", ()),
)
EXTRAS_PICKLABLE = M.ModelSpec(tuple(p for p in EXTRAS.main if not p.dtype.startswith("float8")))


# Where extras sit: the snapshot levels (ipc metas: test_ipc_meta.py, and APPLY-UNKNOWN-REPORTED below).
UNKNOWN_SNAPSHOT_CASES = [
    case("single", "mixed", id="single"),
    case("legacy", "mixed", id="legacy"),
    case("shared", "mixed", id="shared-fallback"),
    case("part0", "own-part", id="first-of-3-parts-only-extras"),
    case("part2", "own-part", id="last-of-3-parts-only-extras"),
    case("parts", "mixed", id="extras-spread-over-3-parts"),
]


@pytest.mark.rule("APPLY-UNKNOWN-IGNORED")
@pytest.mark.parametrize("source,layout", UNKNOWN_SNAPSHOT_CASES)
def test_unknown_names_are_ignored(loader, source, layout):
    want = M.state(SPEC, version=1)
    extras = M.state(EXTRAS_PICKLABLE if S.writes_pickle(source) else EXTRAS, version=5)
    paths = _write(loader, source, {**want, **extras}, focus=list(extras) if layout == "own-part" else ())
    session = loader.open(SPEC)
    session.update()
    observed = session.observe()
    where = f"{source} {paths} with extra tensors {sorted(extras)}"
    check.params_equal(observed, want, where)
    check.equal(sorted(observed), sorted(want), f"{where}: parameter names after the update")


UNKNOWN_CASES = UNKNOWN_SNAPSHOT_CASES + [pytest.param("ipc", "mixed", marks=pytest.mark.requires("ipc.meta"), id="ipc-metas")]


def _named(name: str, text: str) -> bool:
    """``name`` as a whole name in ``text`` (``embed`` inside ``embed.weight`` does not count)."""
    return re.search(r"(?<![\w.])" + re.escape(name) + r"(?![\w.])", text) is not None


@pytest.mark.rule("APPLY-UNKNOWN-REPORTED")
@pytest.mark.parametrize("source,layout", UNKNOWN_CASES)
def test_unknown_names_are_reported_by_name(loader, caplog, source, layout):
    """The update that ignores them names every ignored tensor, as a whole name, in a record at WARNING or above
    (any logger)."""
    want = M.state(SPEC, version=1)
    extras = M.state(EXTRAS_PICKLABLE if S.writes_pickle(source) or source == "ipc" else EXTRAS, version=5)
    caplog.set_level(logging.WARNING)  # root logger: whatever logger the implementation uses
    if source == "ipc":
        from weightsync.fixtures import ipc as I

        export = I.Export({**want, **extras}, device_id=0)
        try:
            paths = [I.write_metas(I.meta_path(loader.shared_dir, 0), export.metas)]
            session = loader.open(SPEC, strategy="ipc")
            session.update()
        finally:
            export.close()
    else:
        paths = _write(loader, source, {**want, **extras}, focus=list(extras) if layout == "own-part" else ())
        session = loader.open(SPEC)
        session.update()
    where = f"{source} {[os.path.basename(p) for p in paths]} with extra tensors {sorted(extras)}"
    check.params_equal(session.observe(), want, where)
    records = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    silent = [name for name in sorted(extras) if not any(_named(name, m) for m in records)]
    check.that(not silent, f"{where}: ignored tensors no record at WARNING or above names: {silent} "
                           f"(the update's records at that level: {records[:5]})")
    files = [os.path.basename(p) for p in paths]
    naming = [m for m in records if any(_named(name, m) for name in extras)]
    check.that(not naming or any(f in m for m in naming for f in files),
               f"{where}: the records naming the ignored tensors do not name the file they came from ({files}): {naming[:3]}")


# -- unknown names across the mode space ------------------------------------------------------------
# SPEC.md's Modes line of APPLY-UNKNOWN-IGNORED / -REPORTED: path x staged x model x call, every pair covered by
# the generated cases (conformance.modes). ``model=draft``: the session has an MTP model, and the extras are
# names a draft parameter almost has (a loader routing ``mtp.*`` names to the draft model must ignore the ones it
# lacks too). ``call=second``: a first update with extras, clear(), a second one with extras again, each judged
# on its own (a report made once per session, or once per name, misses the second). Parts: the extras spread
# over the parts on the first update, alone in the last part on the second.
from conformance import modes  # noqa: E402
from conformance.paths import PATHS, route  # noqa: E402,F401 - route is a fixture

DRAFT_EXTRAS = M.spec(
    ("mtp.0.proj.weight_scale", "float32", (4,)),  # extends a draft parameter's name
    ("mtp.0.proj", "bfloat16", (4, 4)),  # a prefix of one, of its dtype and shape
    ("model.mtp.0.norm.weight", "float32", (4,)),  # the trainer's prefix on one; would fit
    ("mtp.1.proj.weight", "bfloat16", (4, 4)),  # a second draft model the engine does not have
    ("model.layers.2.eh_proj.bias", "float16", ()),  # an MTP layer's name, 0-d
)


def _extras(path, model, version):
    spec = DRAFT_EXTRAS if model == "draft" else EXTRAS
    if S.writes_pickle(path) or path == "ipc":  # paddle.save and the ipc export carry no fp8
        spec = M.ModelSpec(tuple(p for p in spec.main if not p.dtype.startswith("float8")))
    return M.state(spec, version=version)


def _updates_with_extras(route, loader, caplog, combo):
    """Run the case's updates (1 or 2, ``call``), each from a source holding every parameter and the extras;
    yield (session, state wanted, extras, where, records at WARNING or above during that update)."""
    path = combo["path"]
    spec = SPEC_MTP if combo["model"] == "draft" else SPEC
    rt = route(path)
    session = rt.open(spec, options={"staged": True} if combo["staged"] == "staged" else None)
    caplog.set_level(logging.WARNING)  # root logger: whatever logger the implementation uses
    for k in range(1, 3 if combo["call"] == "second" else 2):
        want, extras = M.state(spec, version=k), _extras(path, combo["model"], 4 + k)
        layout = [sorted(want), sorted(extras)] if path == "parts" and k == 2 else None  # extras alone, last part
        where = rt.publish(0, {**want, **extras}, k, layout)
        where += f" ({combo['staged']}, {combo['model']} model, update {k}) with extra tensors {sorted(extras)}"
        if k > 1:
            rt.clear(0)
        caplog.clear()
        rt.update(0)
        yield session, want, extras, where, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


UNKNOWN_PATHS = ("parts", "single", "legacy", "shared", "ipc")


@pytest.mark.rule("APPLY-UNKNOWN-IGNORED")
@pytest.mark.parametrize("combo", modes.params("APPLY-UNKNOWN-IGNORED"))
def test_unknown_names_are_ignored_in_every_mode(route, loader, caplog, combo):
    for session, want, extras, where, _records in _updates_with_extras(route, loader, caplog, combo):
        observed = session.observe()
        check.params_equal(observed, want, where)
        check.equal(sorted(observed), sorted(want), f"{where}: parameter names after the update")


@pytest.mark.rule("APPLY-UNKNOWN-REPORTED")
@pytest.mark.parametrize("combo", modes.params("APPLY-UNKNOWN-REPORTED"))
def test_unknown_names_are_reported_in_every_mode(route, loader, caplog, combo):
    for session, want, extras, where, records in _updates_with_extras(route, loader, caplog, combo):
        check.params_equal(session.observe(), want, where)
        silent = [name for name in sorted(extras) if not any(_named(name, m) for m in records)]
        check.that(not silent, f"{where}: ignored tensors no record at WARNING or above of this update names: "
                               f"{silent} (the update's records at that level: {records[:5]})")


MISSING = {
    "main": [MIDDLE],
    "mtp": [MTP_NAMES[1]],
    "several": [FIRST, LAST, MTP_NAMES[0]],
}


def _missing_case(source, what, when, status=False, id=None):
    extra = (("mtp",) if what != "main" else ()) + (("status",) if status else ())
    return case(source, what, when, status, extra=extra, id=id or f"{source}:{what}:{when}{':status' if status else ''}")


@pytest.mark.rule("APPLY-MISSING-FAILS")
@pytest.mark.parametrize(
    "source,what,when,status",
    [
        _missing_case("single", "main", "first-load"),
        _missing_case("single", "main", "after-clear", status=True),
        _missing_case("single", "mtp", "after-clear", status=True),
        _missing_case("single", "several", "first-load"),
        _missing_case("parts", "several", "after-clear", status=True),
        _missing_case("parts", "mtp", "first-load"),
        _missing_case("legacy", "main", "after-clear"),
        _missing_case("legacy", "several", "first-load", status=True),
        _missing_case("shared", "several", "after-clear", status=True),
        _missing_case("shared", "mtp", "first-load"),
    ],
)
def test_missing_parameter_fails_by_name(loader, source, what, when, status):
    spec = SPEC if what == "main" else SPEC_MTP
    missing = MISSING[what]
    session = loader.open(spec)
    if when == "after-clear":
        _write(loader, source, M.state(spec, version=1))
        session.update()
        session.clear()
    v2 = M.state(spec, version=2)
    paths = _write(loader, source, {k: v for k, v in v2.items() if k not in missing})
    where = f"{source} {paths} lacks {missing} ({when})"
    with check.raises(RuntimeError, match="|".join(map(re.escape, missing)), names=missing, where=where):
        session.update()
    if status:
        check.status_not(session, "NORMAL", where)


def _position(combo) -> int:
    """0, 1 or 2 (first, middle, last) from the case's path: the generated cases put the fault everywhere."""
    return modes.AXES["path"].index(combo["path"]) % 3


def _missing_in(combo) -> list[str]:
    """main: one main parameter (first, middle or last); draft: the MTP one alone at the first call, with
    the first main parameter at the second (a loader that checks, or names, only the main model fails both)."""
    if combo["model"] == "main":
        return [(FIRST, MIDDLE, LAST)[_position(combo)]]
    return [MTP_NAMES[_position(combo)]] if combo["call"] == "first" else [FIRST, MTP_NAMES[_position(combo)]]


@pytest.mark.rule("APPLY-MISSING-FAILS")
@pytest.mark.parametrize("combo", modes.params("APPLY-MISSING-FAILS"))
def test_missing_parameter_fails_by_name_in_every_mode(route, loader, combo):
    """The update lacking ``_missing_in(combo)`` (the first update, or the second after a whole one and a clear)
    raises RuntimeError naming every missing parameter, the status is not NORMAL; then a whole version loads."""
    path = combo["path"]
    spec = SPEC_MTP if combo["model"] == "draft" else SPEC
    missing = _missing_in(combo)
    rt = route(path)
    session = rt.open(spec, options={"staged": True} if combo["staged"] == "staged" else None)
    if combo["call"] == "second":
        rt.publish(0, M.state(spec, version=1), 1)
        rt.update(0)
        session.clear()
    v2 = M.state(spec, version=2)
    where = rt.publish(0, {k: v for k, v in v2.items() if k not in missing}, 2)
    where += f" ({combo['staged']}, {combo['call']} update) lacks {missing}"
    try:
        with check.raises(RuntimeError, match="|".join(map(re.escape, missing)), names=missing, where=where):
            session.update()
    finally:
        rt.feed.settle(0)
    if "status" in loader.adapter.capabilities:
        check.status_not(session, "NORMAL", where)
    v3 = M.state(spec, version=3)
    rt.publish(0, v3, 3)
    session.clear()
    rt.update(0)
    check.params_equal(session.observe(), v3, f"{path}: version 3, whole, after {where}")


# -- MTP ------------------------------------------------------------------------------------------
SPEC_TWO_MTP = M.spec(
    *((p.name, p.dtype, p.shape) for p in SPEC.main),
    mtp=[[("mtp.0.proj.weight", "bfloat16", (4, 4))], [("mtp.1.proj.weight", "float16", (2, 4))]],
)


@pytest.mark.rule("APPLY-MTP-LOADED")
@pytest.mark.parametrize(
    "source,layout",
    [
        case("single", "mixed", extra=("mtp",), id="single"),
        case("single", "two-mtp-models", extra=("mtp",), id="single:two-mtp-models"),
        case("part1", "mtp-own-part", extra=("mtp",), id="mtp-in-its-own-part"),
        case("parts", "spread", extra=("mtp",), id="mtp-spread-over-3-parts"),
        case("legacy", "mixed", extra=("mtp",), id="legacy"),
        case("shared", "mixed", extra=("mtp",), id="shared-fallback"),
    ],
)
def test_main_and_mtp_models_both_loaded(loader, source, layout):
    """First load, then the trainer writes v2, clear(), update(): main and MTP both hold v2."""
    spec = SPEC_TWO_MTP if layout == "two-mtp-models" else SPEC_MTP
    mtp = [p.name for model in spec.mtp for p in model]
    session = loader.open(spec)
    for version in (1, 2):
        want = M.state(spec, version=version)
        own = layout == "mtp-own-part"
        paths = _write(loader, source, want, focus=mtp if own else (), nparts=2 if own else 3)
        if version == 2:
            session.clear()
        session.update()
        check.params_equal(session.observe(), want, f"{source} {paths} (version {version}) with main + MTP tensors {mtp}")


# -- APPLY-EMPTY-REFUSED -----------------------------------------------------------------------------
# Every path (conformance.paths): a source that carries no tensor, after a clear (the clear-first paths) and
# while the weights are loaded (an update without clear() on the file paths, in place on the streamed ones;
# a bucket update without clear() is refused before the trainer is heard, its update left unconsumed).

EMPTY_SPEC = M.spec(("embed.weight", "float32", (4, 4)), ("norm.bias", "float16", (4,)))
EMPTY_SPEC_MTP = M.spec(("embed.weight", "float32", (4, 4)), ("norm.bias", "float16", (4,)),
                        mtp=[[("model.layers.2.eh_proj.weight", "float32", (2, 4))]])
EMPTY_CASES = [pytest.param(path, mode, marks=pytest.mark.requires(*PATHS[path].capabilities, "status"), id=f"{path}-{mode}")
               for path in PATHS for mode in ("after-clear", "loaded")
               if (mode == "after-clear") != PATHS[path].in_place or (mode == "loaded" and path != "bucket")]


@pytest.mark.rule("APPLY-EMPTY-REFUSED")
@pytest.mark.parametrize("path, mode", EMPTY_CASES)
def test_update_from_a_source_without_tensors_is_refused(route, path, mode):
    """Version 1 loads; a source of version 2 holding no tensor is refused (the update raises; after a clear
    the status is not NORMAL, while loaded no parameter changes); then a whole version 3 loads."""
    rt = route(path)
    session = rt.open(EMPTY_SPEC)
    v1 = M.state(EMPTY_SPEC, version=1)
    rt.publish(0, v1, 1)
    rt.update(0)
    check.params_equal(session.observe(), v1, f"{path}: version 1")
    where = rt.publish(0, {}, 2, [[]] if path == "parts" else None) + f", {mode}"  # parts: one part, empty
    if mode == "after-clear":
        session.clear()
    before = session.observe()
    refused = None
    try:
        rt.update(0)
    except Exception as e:  # noqa: BLE001 - any refusal; what it says is FILE-NO-TENSORS's business
        refused = e
    check.that(refused is not None, f"{where}: an update of nothing was accepted (status {session.status()})")
    if mode == "after-clear":
        check.status_not(session, "NORMAL", f"{where}: refused")
    else:  # still serving version 1: NORMAL may say so (STATUS-UPDATE-WHILE-NORMAL), nothing may have changed
        check.unchanged(before, session.observe(), f"{where}: refused")
    v3 = M.state(EMPTY_SPEC, version=3)
    rt.publish(0, v3, 3)
    if not PATHS[path].in_place:
        session.clear()
    rt.update(0)
    check.params_equal(session.observe(), v3, f"{path}: version 3 after the refused empty source")
    check.status_is(session, "NORMAL", f"{path}: version 3 after the refused empty source")


def _empty_valid(combo) -> bool:
    """A bucket update of loaded weights without clear() is refused before the trainer is heard (its update left
    unconsumed): at a later call, ``start=loaded`` is no empty source there."""
    return not (combo["path"] == "bucket" and combo["start"] == "loaded" and combo["call"] == "second")


def _first_into_allocated() -> list:
    """The first update into weights the engine allocated (``start=loaded`` at the first call) on the paths that
    load cleared weights: a pair conformance.modes leaves out of every declaration (those paths refuse an update of
    loaded weights, LIFE-RECOVERY), yet a first load meets it on every path (FastDeploy's constructor loads into the
    engine's placeholders). Plain and staged, each path."""
    out = []
    for path in ("parts", "single", "legacy", "shared", "ipc", "bucket"):
        for staged in ("plain", "staged"):
            combo = {"path": path, "staged": staged, "start": "loaded", "model": "main", "call": "first"}
            out.append(pytest.param(combo, marks=[pytest.mark.modes(**combo),
                                                  pytest.mark.requires(*modes.default_requires(combo))],
                                    id="-".join(combo.values())))
    return out


@pytest.mark.rule("APPLY-EMPTY-REFUSED")
@pytest.mark.parametrize("combo", modes.params("APPLY-EMPTY-REFUSED", valid=_empty_valid) + _first_into_allocated())
def test_empty_source_is_refused_in_every_mode(route, loader, combo):
    """The source of no tensor is the first update (``start``: the parameters built without memory, or allocated
    by the engine) or the second (after a whole version: ``cleared``, after clear(); ``loaded``, without one, in
    place on the streamed paths): refused; after a clear the status is not NORMAL, while loaded nothing changes;
    then a whole version loads."""
    from weightsync.fixtures import streams as ST
    from weightsync.fixtures import strided as SD

    path, first = combo["path"], combo["call"] == "first"
    model = EMPTY_SPEC_MTP if combo["model"] == "draft" else EMPTY_SPEC
    spec = SD.StridedSpec(model, {}, placeholders=first and combo["start"] == "loaded")
    rt = route(path)
    session = rt.open(spec, options={"staged": True} if combo["staged"] == "staged" else None)
    ST.mark_mtp_layers(session.models, 2)
    if not first:
        v1 = M.state(spec, version=1)
        rt.publish(0, v1, 1)
        rt.update(0)
        check.params_equal(session.observe(), v1, f"{path}: version 1")
        if combo["start"] == "cleared":
            session.clear()
    where = rt.publish(0, {}, 2, [[]] if path == "parts" else None)  # parts: one part, empty
    where += f" ({combo['staged']}, {combo['model']} model, {combo['call']} update, weights {combo['start']})"
    before = session.observe()
    refused = None
    try:
        rt.update(0)
    except Exception as e:  # noqa: BLE001 - any refusal; what it says is FILE-NO-TENSORS's business
        refused = e
    check.that(refused is not None, f"{where}: an update of nothing was accepted (status {session.status()})")
    if combo["start"] == "cleared":
        if "status" in loader.adapter.capabilities:
            check.status_not(session, "NORMAL", f"{where}: refused")
    else:  # still serving what it held: NORMAL may say so (STATUS-UPDATE-WHILE-NORMAL), nothing may have changed
        check.unchanged(before, session.observe(), f"{where}: refused")
    v3 = M.state(spec, version=3)
    rt.publish(0, v3, 3)
    if not PATHS[path].in_place:
        session.clear()
    rt.update(0)
    check.params_equal(session.observe(), v3, f"{where}: version 3 after the refused empty source")
    if "status" in loader.adapter.capabilities:
        check.status_is(session, "NORMAL", f"{where}: version 3 after the refused empty source")
