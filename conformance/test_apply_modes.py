"""Validation and apply on every path, in every pair of each rule's modes. Spec: SPEC.md § APPLY.

test_apply.py (and the path modules) hold each rule's boundaries: every dtype pair, every shape, the tensor at
issue in each part of a snapshot. The cases here run a representative of them on every path of
conformance/paths.py in every pair of the rule's declared modes (conformance/modes.py): staged, the draft model
(the tensor at issue the draft's twin of a main one), the first or a later update of the session, the tensor at
issue first, in the middle or last of what the trainer sends.
"""
import pytest

from conformance import check
from conformance import mode_run as R
from conformance import modes
from conformance.paths import ALL_PATHS, route  # noqa: F401 - route is a fixture
from weightsync.fixtures import models as M

FIRST, MIDDLE, LAST = "embed.weight", "layers.0.mlp.weight", "norm.bias"
SPEC = M.spec((FIRST, "float32", (4, 4)), (MIDDLE, "bfloat16", (4, 2)), (LAST, "float16", (4,)))
POSITION = {"first": FIRST, "middle": MIDDLE, "last": LAST}
OTHER_DTYPE = {"float32": "int32", "bfloat16": "float16", "float16": "bfloat16"}  # the same itemsize
EVERY_DTYPE = ["bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool",
               "float8_e4m3fn", "float8_e5m2"]


def _params(rule, *more):
    return modes.params(rule, requires=lambda combo: [*ALL_PATHS[combo["path"]].capabilities, *more,
                                                      *(["staged"] if combo.get("staged") == "staged" else []),
                                                      *(["mtp"] if combo.get("model") == "draft" else [])])


def _session(route, combo, spec=SPEC):
    """(route, session, spec): ``combo``'s path and modes, the earlier updates of the session done."""
    rt = route(combo["path"])
    spec = R.with_draft(spec, combo)
    session = rt.open(spec, options=R.options(combo))

    def publish(version):
        rt.publish(0, M.state(spec, version=version), version)
        rt.clear(0)

    for version in R.EARLIER_VERSIONS[:R.CALLS[combo.get("call", "first")]]:
        publish(version)
        rt.update(0)
    return rt, session, spec


def _refused_for(path, kind, name, where):
    """What SPEC.md's rules make each path raise for a tensor of the wrong dtype or shape: a TypeError (dtype)
    or ValueError (shape) naming it, and rsync's one ValueError ``Invalid new_state_dict`` naming every key at
    fault (RSYNC-VALIDATE-ALL)."""
    if path == "rsync":
        return check.raises(ValueError, match=r"Invalid new_state_dict", names=[name], where=where)
    return check.raises(TypeError if kind == "dtype" else ValueError, match=name.replace(".", r"\."), names=[name],
                        where=where)


def _mismatch(route, combo, kind):
    rt, session, spec = _session(route, combo)
    name = R.judged(POSITION[combo["position"]], combo)
    st = M.state(spec, version=999)
    p = spec.param(name)
    if kind in ("dtype", "both"):
        st[name] = st[name].astype(M.NUMPY_DTYPES[OTHER_DTYPE[p.dtype]])
    if kind in ("shape", "both"):
        st[name] = st[name].reshape(-1) if len(p.shape) > 1 else st[name].reshape(1, -1)
    where = rt.publish(0, st, 999)
    rt.clear(0)
    where = f"{where}: {name} ({combo['position']}) with the wrong {kind} ({R.label(combo)})"
    with _refused_for(combo["path"], "dtype" if kind == "both" else kind, name, where):
        rt.update(0)
    if "status" in rt.loader.adapter.capabilities:
        check.status_not(session, "NORMAL", where)


@pytest.mark.rule("APPLY-DTYPE-MISMATCH")
@pytest.mark.parametrize("combo", _params("APPLY-DTYPE-MISMATCH"))
def test_dtype_mismatch_in_every_mode(route, combo):
    _mismatch(route, combo, "dtype")


@pytest.mark.rule("APPLY-SHAPE-MISMATCH")
@pytest.mark.parametrize("combo", _params("APPLY-SHAPE-MISMATCH"))
def test_shape_mismatch_in_every_mode(route, combo):
    _mismatch(route, combo, "shape")


@pytest.mark.rule("APPLY-DTYPE-BEFORE-SHAPE")
@pytest.mark.parametrize("combo", _params("APPLY-DTYPE-BEFORE-SHAPE"))
def test_dtype_checked_before_shape_in_every_mode(route, combo):
    """The last tensor wrong in dtype and shape at once: the dtype's error (rsync's names the dtype)."""
    _mismatch(route, {**combo, "position": "last"}, "both")


@pytest.mark.rule("APPLY-VALIDATE-FIRST")
@pytest.mark.parametrize("combo", _params("APPLY-VALIDATE-FIRST"))
def test_rejected_snapshot_changes_no_parameter_in_every_mode(route, combo):
    """The tensor at the position of the wrong dtype: after the clear, no parameter was loaded by the update that
    refused it (every tensor is checked before any is adopted)."""
    rt, session, spec = _session(route, combo)
    name = R.judged(POSITION[combo["position"]], combo)
    st = M.state(spec, version=999)
    st[name] = st[name].astype(M.NUMPY_DTYPES[OTHER_DTYPE[spec.param(name).dtype]])
    where = rt.publish(0, st, 999)
    rt.clear(0)
    where = f"{where}: {name} ({combo['position']}) of the wrong dtype ({R.label(combo)})"
    with check.raises(TypeError, match=name.replace(".", r"\."), names=[name], where=where):
        rt.update(0)
    check.not_loaded(session.observe(), [q.name for q in spec.all_params], where)


@pytest.mark.rule("APPLY-ROUNDTRIP-DTYPES")
@pytest.mark.parametrize("combo", _params("APPLY-ROUNDTRIP-DTYPES"))
def test_every_dtype_round_trips_in_every_mode(route, combo):
    """Every dtype the path carries (fp8 but where the file is a paddle.save pickle), 0-d and zero-element."""
    rt = route(combo["path"])
    dtypes = [d for d in EVERY_DTYPE if rt.fp8 or not d.startswith("float8")]
    spec = M.spec(*((f"d.w_{d}", d, (3, 5)) for d in dtypes), ("e.scalar", "bfloat16", ()), ("e.empty", "float32", (0, 4)))
    rt, session, spec = _session(lambda _: rt, combo, spec)
    want = M.state(spec, version=999)
    where = rt.publish(0, want, 999)
    rt.clear(0)
    rt.update(0)
    check.params_equal(session.observe(), want, f"{where}: every dtype ({R.label(combo)})")


@pytest.mark.rule("APPLY-MTP-LOADED")
@pytest.mark.parametrize("combo", _params("APPLY-MTP-LOADED", "mtp"))
def test_main_and_draft_loaded_in_every_mode(route, combo):
    """The update under test (the first or a later one, staged or not) leaves the main and the draft model both
    on its version."""
    rt, session, spec = _session(route, {**combo, "model": "draft"})
    want = M.state(spec, version=999)
    where = rt.publish(0, want, 999)
    rt.clear(0)
    rt.update(0)
    check.params_equal(session.observe(), want, f"{where}: main and draft ({R.label(combo)})")
