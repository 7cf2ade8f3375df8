"""Strided targets (FP8 layouts): the values land right and the target keeps its layout. Spec: SPEC.md §
APPLY (APPLY-STRIDED-TARGET, APPLY-STRIDED-CLEARED).

The model (``fixtures.strided``) holds, beside row-major parameters, parameters laid out as an engine's FP8
post-processing leaves them: a 2-D scale column-major, a 3-D per-expert scale with its last two dimensions
swapped, in float32, bfloat16 and float16 (fp8: Paddle's CPU build has no strided-copy
kernel for it), named so that they sort first, in the middle and last. The trainer sends row-major tensors
on every path. Values are judged through ``observe()`` (logical order); the layout by the stride of each
parameter of the layers the suite built and handed to ``open``, read before and after (reading, never
acting for the implementation). A zero-size strided target is a zero-element round trip, judged under
APPLY-ROUNDTRIP-DTYPES. The two rules' cases are generated over their declared modes (SPEC.md: path x staged x
model, every pair; ``conformance.modes``): a staged session's commit lands the layout too, and a draft (MTP)
model with strided parameters of its own is loaded like the main one.
"""
import pytest

from conformance import check, modes
from conformance.paths import PATHS, cases, route  # noqa: F401 - route is a fixture
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S
from weightsync.fixtures import strided as ST



FIRST, EXPERTS, EMPTY, HALF, LAST = "a.scale", "c.experts.scale", "e.empty.scale", "f.proj.scale", "z.scale"
MODEL = ST.StridedSpec(
    M.spec(
        (FIRST, "float32", (4, 3)),  # column-major 2-D, first by name
        ("b.weight", "float32", (3, 5)),
        (EXPERTS, "bfloat16", (2, 3, 4)),  # per expert, last two dimensions swapped
        ("d.bias", "float32", (5,)),
        (HALF, "float16", (2, 6)),
        ("y.norm", "bfloat16", (4,)),
        (LAST, "float32", (5, 2)),  # last by name
    ),
    {FIRST: (1, 0), EXPERTS: (0, 2, 1), HALF: (1, 0), LAST: (1, 0)},
)
# ``model=draft`` (SPEC.md's Modes lines): beside the main model, a draft (MTP) model whose own parameters are
# strided (a column-major scale, a per-expert one), named so that GDR routes them to it.
DRAFT_FIRST, DRAFT_EXPERTS = "mtp_block.0.a.scale", "mtp_block.0.experts.scale"
MODEL_DRAFT = ST.StridedSpec(
    M.ModelSpec(MODEL.main, (tuple(M.ParamSpec(*p) for p in (
        (DRAFT_FIRST, "float32", (3, 5)), (DRAFT_EXPERTS, "float16", (2, 4, 3)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))),)),
    {**MODEL.layouts, DRAFT_FIRST: (1, 0), DRAFT_EXPERTS: (0, 2, 1)},
)
# A zero-size strided target holds no data: its case is a zero-element round trip (APPLY-ROUNDTRIP-DTYPES),
# kept apart so that a loader failing zero-element parameters fails that rule, not the stride rules.
ZERO = ST.StridedSpec(M.spec((FIRST, "float32", (4, 3)), (EMPTY, "float32", (0, 3))), {FIRST: (1, 0), EMPTY: (1, 0)})


def _layout_kept(session, before: dict, where: str) -> None:
    """Every parameter's stride is the one it had when the suite built it."""
    after = ST.strides(session.models)
    changed = {n: (before[n], after.get(n)) for n in before if after.get(n) != before[n]}
    check.that(not changed, f"{where}: the layout changed (name: built stride -> now): "
               + ", ".join(f"{n}: {b} -> {a}" for n, (b, a) in changed.items()))


def _opened(rt, model=MODEL):
    session = rt.open(model)
    before = ST.strides(session.models)
    for name in model.layouts:  # the fixture built the layout it means (zero-size: any)
        if 0 not in model.param(name).shape:
            check.equal(before[name], model.stride(name), f"fixture: {name}'s built stride")
    return session, before


def _load(rt, session, before, version: int, where: str, model=MODEL) -> None:
    rt.publish(0, M.state(model, version=version), version)
    rt.update(0)
    check.params_equal(session.observe(), M.state(model, version=version), where)
    _layout_kept(session, before, where)


def _strided_open(rt, combo):
    """A session of the case's model (``model``), staged or not (``staged``)."""
    model = MODEL_DRAFT if combo["model"] == "draft" else MODEL
    session = rt.open(model, options={"staged": True} if combo["staged"] == "staged" else None)
    S.mark_mtp_layers(session.models, 2)
    before = ST.strides(session.models)
    for name in model.layouts:  # the fixture built the layout it means (zero-size: any)
        if 0 not in model.param(name).shape:
            check.equal(before[name], model.stride(name), f"fixture: {name}'s built stride")
    return session, before, model


@pytest.mark.rule("APPLY-STRIDED-TARGET")
@pytest.mark.parametrize("combo", modes.params("APPLY-STRIDED-TARGET"))
def test_strided_target_gets_right_values_and_keeps_its_layout(route, combo):
    """A first load into allocated strided placeholders, then (streamed paths) an in-place update."""
    path = combo["path"]
    rt = route(path)
    session, before, model = _strided_open(rt, combo)
    what = f"({combo['staged']}, {combo['model']} model)"
    _load(rt, session, before, 1, f"{path}: first load into strided targets {what}", model)
    if PATHS[path].in_place:
        _load(rt, session, before, 2, f"{path}: in-place update of strided targets {what}", model)


@pytest.mark.rule("APPLY-STRIDED-CLEARED")
@pytest.mark.parametrize("combo", modes.params("APPLY-STRIDED-CLEARED"))
def test_cleared_strided_target_is_allocated_in_its_layout(route, combo):
    """load, clear, load; twice: a cleared strided target is given memory in its own layout and filled."""
    path = combo["path"]
    rt = route(path)
    session, before, model = _strided_open(rt, combo)
    what = f"({combo['staged']}, {combo['model']} model)"
    _load(rt, session, before, 1, f"{path}: first load {what}", model)
    for version in (2, 3):
        session.clear()
        check.not_loaded(session.observe(), list(model.layouts), f"{path}: after clear() {what}")
        _load(rt, session, before, version, f"{path}: update {version} after clear() {what}", model)


@pytest.mark.rule("APPLY-ROUNDTRIP-DTYPES")
@pytest.mark.parametrize("path", cases(paths=["single", "parts", "rsync"]))
def test_zero_size_strided_target_loads(route, path):
    """A zero-size transposed target beside a strided one: loaded (it holds nothing), its layout its own."""
    rt = route(path)
    session, before = _opened(rt, ZERO)
    _load(rt, session, before, 1, f"{path}: first load, a zero-size strided target", ZERO)
    if PATHS[path].in_place:
        _load(rt, session, before, 2, f"{path}: in-place update, a zero-size strided target", ZERO)
    else:
        session.clear()
        _load(rt, session, before, 2, f"{path}: update after clear(), a zero-size strided target", ZERO)
