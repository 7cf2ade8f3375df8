"""ipc_snapshot part files: order, labels, index parsing, invalid names, duplicates. Spec: SPEC.md § PART.

Every part in the ordering tests holds the whole state at a version of its own, so the values the
model ends with name the part applied last; that check needs no trace. Cases marked ``trace``
additionally compare the labels the implementation reports. Part indices are written as text
(``"010"``, a 21-digit index), exactly as they appear in the file name.
"""
import logging
import os

import numpy as np
import pytest

from conformance import check
from conformance import mode_run as R
from conformance import modes
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (4, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 2)), ("norm.bias", "float16", (4,)))
E, W, B = (p.name for p in SPEC.all_params)
TRACE = pytest.mark.requires("trace")
HUGE = "1" + "0" * 20  # 10**20: past every fixed-width integer


def _part_file(model_dir, token):
    return os.path.join(model_dir, f"{S.base_name(0, 0)}.part{token}{S.PDPARAMS}")


def _write_versioned_parts(model_dir, write_order, spec=SPEC):
    """Part ``token`` holds the whole state at version 100 + its rank in numeric order; files are
    created in ``write_order``. Returns the state of the numerically last part."""
    numeric = sorted(write_order, key=int)
    for token in write_order:
        S.write_safetensors(_part_file(model_dir, token), M.state(spec, version=100 + numeric.index(token)))
    return M.state(spec, version=100 + len(numeric) - 1)


def _parts_params(rule: str, *more: str):
    """The rule's cases over its declared modes (SPEC.md Modes:), each needing parts and ``more``."""
    return modes.params(rule, requires=lambda combo: ["snapshot.parts", *more, *modes.default_requires(combo)])


def _open(loader, combo, spec=SPEC, model_dir=None):
    """A session in the combination's modes, its earlier updates done (each from a single file, then removed)."""
    spec = R.with_draft(spec, combo)
    session = loader.open(spec, model_dir=model_dir, options=R.options(combo))
    R.earlier_snapshot(combo, session, spec, model_dir or loader.model_dir, loader.shared_dir)
    return session, spec


def _labels(tokens):
    return [f"snapshot-part{int(t)}" for t in sorted(tokens, key=int)]


# Created in a scrambled order; by name the order would be 0, 1, 10, 11, 2, 9 (part9 last).
_SIX = ("9", "11", "0", "10", "2", "1")


def _order(write_order, observe, case_id):
    marks = [TRACE] if observe == "trace" else []
    return pytest.param(write_order, observe, marks=marks, id=f"{case_id}:{observe}")


@pytest.mark.rule("PART-ORDER-NUMERIC")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.modes(call="first", model="main")
@pytest.mark.parametrize(
    "write_order,observe",
    [
        _order(("10", "2"), "values", "2-before-10:created-10-first"),
        _order(("2", "10"), "values", "2-before-10:created-2-first"),
        _order(("10", "9"), "values", "9-before-10"),
        _order(_SIX, "values", "0-1-2-9-10-11-scrambled"),
        # Leading zeros are digits: part010 is index 10 (by name it sorts before part9).
        _order(("010", "9"), "values", "9-before-010"),
        _order(("100", "99", HUGE), "values", "99-100-10e20"),
        _order(("10", "2"), "trace", "2-before-10"),
        _order(("10", "9"), "trace", "9-before-10"),
        _order(_SIX, "trace", "0-1-2-9-10-11-scrambled"),
        _order(("010", "9"), "trace", "9-before-010"),
        _order(("100", "99", HUGE), "trace", "99-100-10e20"),
    ],
)
def test_parts_load_in_numeric_order(loader, write_order, observe):
    last = _write_versioned_parts(loader.model_dir, write_order)
    session = loader.open(SPEC)
    session.update()
    where = f"{loader.model_dir}: parts {sorted(write_order, key=int)} created in order {list(write_order)}"
    if observe == "values":
        check.params_equal(session.observe(), last, f"{where}: every tensor must hold the highest index's value")
    else:
        check.labels(session.trace(), _labels(write_order), where)


@pytest.mark.rule("PART-ORDER-NUMERIC")
@pytest.mark.parametrize("combo", _parts_params("PART-ORDER-NUMERIC"))
def test_parts_load_in_numeric_order_in_every_mode(loader, combo):
    """Six parts created scrambled, each holding the whole state (main and draft) at a version of its own, in
    every pair of the rule's modes: the highest index's values win."""
    session, spec = _open(loader, combo)
    last = _write_versioned_parts(loader.model_dir, _SIX, spec)
    session.update()
    check.params_equal(session.observe(), last, f"{loader.model_dir}: parts {sorted(_SIX, key=int)} created in order "
                       f"{list(_SIX)} ({R.label(combo)}): every tensor must hold the highest index's value")


@pytest.mark.rule("PART-LABEL-INDEX")
@pytest.mark.requires("snapshot.parts", "trace")
@pytest.mark.modes(call="first")
@pytest.mark.parametrize(
    "tokens,dirname",
    [
        pytest.param(("0", "2", "10"), None, id="0-2-10"),
        pytest.param(("0", "02", "010"), None, id="leading-zeros-0-02-010"),
        pytest.param(("0", "2", "10"), "w.part10", id="0-2-10-under-w.part10"),
        pytest.param(("0", "2", "10"), "ckpt.part7.run", id="0-2-10-under-ckpt.part7.run"),
    ],
)
def test_parts_are_labelled_by_parsed_index(loader, tokens, dirname):
    """Non-contiguous parts each hold a third of the state; each is labelled by its own index."""
    model_dir = os.path.join(os.path.dirname(loader.model_dir), dirname) if dirname else loader.model_dir
    want = M.state(SPEC, version=1)
    for token, part in zip(tokens, S.split(want, 3)):
        S.write_safetensors(_part_file(model_dir, token), part)
    session = loader.open(SPEC, model_dir=model_dir)
    session.update()
    where = f"{model_dir}: parts {list(tokens)}"
    check.params_equal(session.observe(), want, where)
    check.labels(session.trace(), _labels(tokens), where)
    check.sources(session.trace(), [os.path.basename(_part_file("", t)) for t in tokens], where)


@pytest.mark.rule("PART-LABEL-INDEX")
@pytest.mark.parametrize("combo", _parts_params("PART-LABEL-INDEX", "trace"))
def test_parts_are_labelled_by_parsed_index_in_every_mode(loader, combo):
    """Parts 0, 02 and 010 each hold a third of the state, in every pair of the rule's modes: the trace of the
    update under test lists exactly them, by parsed index."""
    session, _ = _open(loader, combo)
    tokens = ("0", "02", "010")
    want = M.state(SPEC, version=1)
    for token, part in zip(tokens, S.split(want, 3)):
        S.write_safetensors(_part_file(loader.model_dir, token), part)
    session.update()
    where = f"{loader.model_dir}: parts {list(tokens)} ({R.label(combo)})"
    check.params_equal(session.observe(), want, where)
    check.labels(session.trace(), _labels(tokens), where)


_DIRS = ("ckpt.part7.run", "w.part10", "model_state.tp0.0.part99.pdparams.d")


@pytest.mark.rule("PART-INDEX-BASENAME")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.modes(call="first")
@pytest.mark.parametrize(
    "dirname,write_order,observe",
    [
        *(pytest.param(d, ("10", "2"), "values", id=f"{d}:created-10-first:values") for d in _DIRS),
        pytest.param(_DIRS[0], ("2", "10"), "values", id=f"{_DIRS[0]}:created-2-first:values"),
        *(pytest.param(d, ("10", "2"), "trace", marks=TRACE, id=f"{d}:trace") for d in _DIRS[:2]),
    ],
)
def test_part_index_ignores_directory_name(loader, dirname, write_order, observe):
    """A full-path search would read the directory's index (7, 10, 99) for every part."""
    model_dir = os.path.join(os.path.dirname(loader.model_dir), dirname)
    last = _write_versioned_parts(model_dir, write_order)
    session = loader.open(SPEC, model_dir=model_dir)
    session.update()
    where = f"{model_dir}: parts 2 and 10 created in order {list(write_order)}"
    if observe == "values":
        check.params_equal(session.observe(), last, f"{where}: every tensor must hold part10's value")
    else:
        check.labels(session.trace(), _labels(("2", "10")), where)


@pytest.mark.rule("PART-INDEX-BASENAME")
@pytest.mark.parametrize("combo", _parts_params("PART-INDEX-BASENAME"))
def test_part_index_ignores_directory_name_in_every_mode(loader, combo):
    """Parts 2 and 10 (created 10 first) under a directory named ``w.part10``, in every pair of the rule's modes."""
    model_dir = os.path.join(os.path.dirname(loader.model_dir), "w.part10")
    os.makedirs(model_dir, exist_ok=True)
    session, _ = _open(loader, combo, model_dir=model_dir)
    last = _write_versioned_parts(model_dir, ("10", "2"))
    session.update()
    check.params_equal(session.observe(), last, f"{model_dir}: parts 2 and 10 ({R.label(combo)}): every tensor must "
                       "hold part10's value")


# Invalid index texts, by where their names sort among part0, part1, part2: int() accepts the
# first of each group but "-1", "+1", " 1", "1_0" and the Arabic-Indic digit are no ASCII digits.
INVALID = {
    "first": ("part-1", "part+1", "part 1", "part"),
    "middle": ("part1.5", "part1_0", "part1x"),
    "last": ("partabc", "part\u0661"),
}
POISON = W  # invalid files hold it as float32: a loader that reads one fails
OTHERS = ("model_state.tp1.0.part0.pdparams", "model_state.tp0.01.part3.pdparams", "model_state.tp0.00.partx.pdparams")


def _poisoned(version):
    st = M.state(SPEC, version=version)
    st[POISON] = np.zeros(st[POISON].shape, np.float32)
    return st


@pytest.mark.rule("PART-INVALID-IGNORED")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.modes(call="first")
@pytest.mark.parametrize(
    "invalid,layout",
    [
        pytest.param(INVALID["first"], "parts", id="invalid-sorting-first"),
        pytest.param(INVALID["middle"], "parts", id="invalid-sorting-middle"),
        pytest.param(INVALID["last"], "parts", id="invalid-sorting-last"),
        pytest.param(sum(INVALID.values(), ()), "parts", id="every-invalid-kind"),
        *(
            pytest.param(("partabc", "part", "part1x"), level, marks=pytest.mark.requires(cap),
                         id=f"all-invalid-falls-through-to-{level}")
            for level, cap in (("single", "snapshot.single"), ("legacy", "snapshot.legacy"),
                               ("shared", "snapshot.shared_fallback"))
        ),
    ],
)
def test_invalid_part_names_are_ignored_with_one_warning(loader, caplog, invalid, layout):
    """Valid parts 0, 1, 2 each hold a third of the state (or, with no valid part, the next level
    holds it); the invalid files are poisoned. Exactly one WARNING names each invalid file once,
    whichever level ends up loaded."""
    _invalid_ignored(loader, caplog, invalid, layout, loader.open(SPEC), {"call": "first"})


@pytest.mark.rule("PART-INVALID-IGNORED")
@pytest.mark.parametrize("combo", _parts_params("PART-INVALID-IGNORED"))
def test_invalid_part_names_are_ignored_with_one_warning_in_every_mode(loader, caplog, combo):
    """Every kind of invalid part name beside valid parts, in every pair of the rule's modes."""
    session, _ = _open(loader, combo)
    _invalid_ignored(loader, caplog, sum(INVALID.values(), ()), "parts", session, combo)


def _invalid_ignored(loader, caplog, invalid, layout, session, combo) -> None:
    want = M.state(SPEC, version=1)
    names = [os.path.basename(S.write_safetensors(_part_file(loader.model_dir, s.removeprefix("part")), _poisoned(9)))
             for s in invalid]
    if layout == "parts":
        valid = S.write_parts(loader.model_dir, 0, 0, dict(enumerate(S.split(want, 3))))
    else:
        valid = S.write_level(layout, loader.model_dir, loader.shared_dir, 0, 0, want)
    # Other workers' part files (one with an invalid index of its own) are not this worker's to report.
    others = [S.write_safetensors(os.path.join(loader.model_dir, n), _poisoned(8)) for n in OTHERS]
    not_invalid = [os.path.basename(p) for p in valid + others]
    caplog.set_level(logging.WARNING)  # root logger: whatever logger the implementation uses
    caplog.clear()  # what the earlier updates logged is not this update's
    where = f"{loader.model_dir} ({layout}; {R.label(combo)}) with {names}"
    try:
        session.update()
    except Exception as e:  # noqa: BLE001
        check.that(False, f"{where}: update raised {type(e).__name__}: {e}; invalid part files must not be read")
    check.params_equal(session.observe(), want, f"{where}: invalid part files must not be loaded")
    records = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    naming = [m for m in records if any(name in m for name in names)]
    check.that(
        len(naming) == 1,
        f"{where}: expected exactly one WARNING record naming the invalid part files, got {len(naming)}: {naming}",
    )
    wrongly_named = [n for n in not_invalid if any(n in m for m in records)]
    check.that(not wrongly_named, f"{where}: a WARNING names files that are not invalid parts of this worker: {wrongly_named}")
    if naming:
        counts = {name: naming[0].count(name) for name in names}
        wrong = {name: c for name, c in counts.items() if c != 1}
        check.that(not wrong, f"{where}: the warning {naming[0]!r} must name each invalid file exactly once: {wrong}")


@pytest.mark.rule("PART-DUPLICATE-LATER-WINS")
@pytest.mark.requires("snapshot.parts")
@pytest.mark.modes(call="first", model="main")
@pytest.mark.parametrize(
    "parts,want",
    [
        # {index: {tensor: version}}; indices 2, 9, 10 so that name order (10, 2, 9) differs.
        pytest.param({2: {E: 1, W: 1}, 9: {E: 2, B: 2}, 10: {E: 3}}, {E: 3, W: 1, B: 2}, id="in-every-part"),
        pytest.param({2: {E: 1, W: 1}, 9: {E: 2}, 10: {B: 3}}, {E: 2, W: 1, B: 3}, id="first-and-middle"),
        pytest.param({2: {W: 1}, 9: {E: 2, B: 2}, 10: {E: 3}}, {E: 3, W: 1, B: 2}, id="middle-and-last"),
        pytest.param({2: {E: 1, B: 1}, 9: {W: 2}, 10: {E: 3}}, {E: 3, W: 2, B: 1}, id="first-and-last"),
        pytest.param({3: {E: 3}, 0: {E: 1, W: 1, B: 1}, 1: {B: 2}}, {E: 3, W: 1, B: 2}, id="two-tensors-0-1-3"),
    ],
)
def test_tensor_repeated_across_parts_takes_later_value(loader, parts, want):
    states = {v: M.state(SPEC, version=v) for v in {1, 2, 3}}
    for index, tensors in parts.items():
        S.write_safetensors(S.part_path(loader.model_dir, 0, 0, index), {n: states[v][n] for n, v in tensors.items()})
    session = loader.open(SPEC)
    session.update()
    check.params_equal(
        session.observe(), {n: states[v][n] for n, v in want.items()},
        f"{loader.model_dir}: parts {parts} (tensor: version); the highest index holding a tensor wins",
    )


@pytest.mark.rule("PART-DUPLICATE-LATER-WINS")
@pytest.mark.parametrize("combo", _parts_params("PART-DUPLICATE-LATER-WINS"))
def test_tensor_repeated_across_parts_takes_later_value_in_every_mode(loader, combo):
    """Parts 2, 9 and 10 repeat the judged model's tensors (the main one's, or the draft's), the other model's
    tensors in part 2 only, in every pair of the rule's modes: the highest index holding a tensor wins."""
    session, spec = _open(loader, combo)
    states = {v: M.state(spec, version=v) for v in (1, 2, 3)}
    e, w, b = (R.judged(n, combo) for n in (E, W, B))
    parts = {2: {e: 1, w: 1}, 9: {e: 2, b: 2}, 10: {e: 3}}
    want = {e: 3, w: 1, b: 2}
    others = {p.name: 1 for p in spec.all_params if p.name not in want}
    parts[2].update(others)
    want.update(others)
    for index, tensors in parts.items():
        S.write_safetensors(S.part_path(loader.model_dir, 0, 0, index), {n: states[v][n] for n, v in tensors.items()})
    session.update()
    check.params_equal(session.observe(), {n: states[v][n] for n, v in want.items()},
                       f"{loader.model_dir}: parts {parts} (tensor: version; {R.label(combo)}); the highest index "
                       "holding a tensor wins")
