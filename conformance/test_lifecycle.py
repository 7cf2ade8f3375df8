"""Lifecycle: clear releases every parameter, clear + update leaves exactly the new version over
many cycles, the status tells the truth after every outcome, and a failed update can be recovered
from. Spec: SPEC.md § LIFE.

Every rule runs on every snapshot source (single file, parts, legacy ``tp0{id}`` file, shared
``paddle.save`` fallback), each case requiring only its source's capability (plus ``mtp`` where an
MTP draft model is part of the case, ``status`` where the status is read).
"""
import os
import pickle
import re

import pytest
from safetensors import SafetensorError

from conformance import check
from conformance import mode_run as R
from conformance import modes
from conformance.paths import ALL_PATHS, route  # noqa: F401 - route is a fixture
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

MAIN = (("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))
MTP = (("mtp.0.norm.weight", "float32", (4,)), ("mtp.0.proj.weight", "bfloat16", (4, 4)))
SPEC = M.spec(*MAIN)
SPEC_MTP = M.spec(*MAIN, mtp=[MTP])

CAPS = {
    "single": ("snapshot.single",),
    "parts": ("snapshot.parts",),
    "legacy": ("snapshot.legacy",),
    "shared": ("snapshot.shared_fallback",),
}


def case(source, *values, mtp=False, status=False, extra=(), id=None):
    needs = CAPS[source.split(":")[0]] + (("mtp",) if mtp else ()) + (("status",) if status else ()) + tuple(extra)
    marks = [pytest.mark.requires(*needs)]
    if "first-load" in values or "after-clear" in values:  # the session's first update, or a later one
        marks.append(pytest.mark.modes(call="first" if "first-load" in values else "second",
                                       model="draft" if mtp else "main"))
    return pytest.param(source, *values, marks=marks, id=id)


def _clean(loader):
    """The trainer removes the previous version's files before writing the next."""
    for d in (loader.model_dir, loader.shared_dir):
        for name in os.listdir(d):
            os.remove(os.path.join(d, name))


def _write(loader, source, st):
    """``source``: ``single``, ``legacy``, ``shared``, ``parts`` (2 parts) or ``parts:K``.
    Returns the paths written."""
    kind, _, k = source.partition(":")
    st = dict(sorted(st.items()))
    if kind == "single":
        return [S.write_safetensors(S.single_path(loader.model_dir, 0, 0), st)]
    if kind == "legacy":
        return [S.write_legacy(loader.model_dir, 0, st)]
    if kind == "shared":
        return [S.write_pickle_fallback(os.path.join(loader.shared_dir, S.base_name(0, 0) + S.PDPARAMS), st)]
    return S.write_parts(loader.model_dir, 0, 0, dict(enumerate(S.split(st, min(int(k or 2), len(st))))))


def _failed_update(session):
    """clear() and an update() of a broken source; whether it raises is other rules' business here
    (the tests that use it judge what comes after)."""
    session.clear()
    try:
        session.update()
    except Exception:
        pass


def _first_load(loader, spec, source="single"):
    v1 = M.state(spec, version=1)
    paths = _write(loader, source, v1)
    session = loader.open(spec)
    session.update()
    check.params_equal(session.observe(), v1, f"first load from {paths}")
    return session


# Broken versions of a snapshot: each writes the whole of ``version`` but for one fault.
def _bad_dtype(loader, source, spec, version):
    st = M.state(spec, version=version)
    st["norm.bias"] = st["norm.bias"].astype("float32")
    return _write(loader, source, st)


def _bad_shape(loader, source, spec, version):
    st = M.state(spec, version=version)
    st["embed.weight"] = st["embed.weight"].reshape(4, 8)
    return _write(loader, source, st)


def _missing(loader, source, spec, version):
    st = M.state(spec, version=version)
    del st["layers.0.mlp.weight"]
    if spec.mtp:
        del st["mtp.0.proj.weight"]
    return _write(loader, source, st)


def _corrupt(loader, source, spec, version):
    paths = _write(loader, source, M.state(spec, version=version))
    if S.writes_pickle(source.partition(":")[0]):
        with open(paths[-1], "r+b") as f:
            f.write(b"\x80\x02not a pickle at all")
    else:
        S.corrupt_header(paths[-1])  # the last part where there are several
    return paths


BREAKAGES = {"bad-dtype": _bad_dtype, "bad-shape": _bad_shape, "missing": _missing, "corrupt": _corrupt}


MISSING_STAGE = r"verification failed|layers\.0\.mlp\.weight"


def _refused(breakage, spec, paths, where):
    """``check.raises`` for the failure each breakage must cause, with the type SPEC.md names for it and
    what the message names: a TypeError naming norm.bias (APPLY-DTYPE-MISMATCH), a ValueError naming
    embed.weight (APPLY-SHAPE-MISMATCH), the verification's RuntimeError (fd-spec §2.7: `Model Parameter update
    verification failed`, or naming the missing parameter as APPLY-MISSING-FAILS asks),
    for a corrupt file a ValueError naming it (FILE-CORRUPT-HEADER) or the format library's refusal of its header
    or pickle. A failure for another reason fails."""
    if breakage == "bad-dtype":
        return check.raises(TypeError, match=r"norm\.bias", names=["norm.bias"], where=where)
    if breakage == "bad-shape":
        return check.raises(ValueError, match=r"embed\.weight", names=["embed.weight"], where=where)
    if breakage == "missing":  # the verification's RuntimeError: FastDeploy's words, or the names (a hardening rule's)
        return check.raises(RuntimeError, match=MISSING_STAGE, where=where)
    # A corrupt file: the ValueError naming it (FILE-CORRUPT-HEADER, hardening), or the format library's
    # own refusal of the header or pickle, as FastDeploy raises it (safetensors' SafetensorError, pickle's).
    name = os.path.basename(paths[-1])
    return check.raises((ValueError, SafetensorError, pickle.UnpicklingError),
                        match=rf"{re.escape(name)}|(?i:header|pickle)", where=where)


@pytest.mark.rule("LIFE-CLEAR-RELEASES")
@pytest.mark.parametrize(
    "source,spec,when",
    [
        case("single", SPEC, "after-load", id="single:main"),
        case("single", SPEC_MTP, "after-load", mtp=True, id="single:main+mtp"),
        case("parts:3", SPEC_MTP, "after-load", mtp=True, id="3-parts:main+mtp"),
        case("legacy", SPEC_MTP, "after-load", mtp=True, id="legacy:main+mtp"),
        case("shared", SPEC_MTP, "after-load", mtp=True, id="shared:main+mtp"),
        case("single", SPEC_MTP, "twice", mtp=True, id="single:cleared-twice"),
        case("single", SPEC_MTP, "before-first-load", mtp=True, id="single:before-first-load"),
        case("single", SPEC_MTP, "after-failed-update", mtp=True, id="single:after-failed-update"),
        case("parts:3", SPEC, "after-failed-update", id="3-parts:after-failed-update"),
    ],
)
def test_clear_releases_every_parameter(loader, source, spec, when):
    if when == "before-first-load":
        _write(loader, source, M.state(spec, version=1))
        session = loader.open(spec)
    else:
        session = _first_load(loader, spec, source)
    if when == "after-failed-update":
        # v2 lacks parameters: the others may have been applied before the verification failed.
        _missing(loader, source, spec, 2)
        _failed_update(session)
    session.clear()
    if when == "twice":
        session.clear()
    observed = session.observe()
    names = [p.name for p in spec.all_params]
    absent = [n for n in names if n not in observed]
    check.that(not absent, f"{source} after clear() ({when}): parameters {absent} are not observed at all (expected present, unloaded)")
    still = {n: f"{observed[n].dtype}{list(observed[n].shape)}" for n in names if n in observed and observed[n].data is not None}
    check.that(not still, f"{source} after clear() ({when}): parameters still hold data: {still}; expected none loaded")


@pytest.mark.rule("LIFE-RELOAD-LATEST")
@pytest.mark.parametrize(
    "source,versions,spec,in_place",
    [
        case("single", ["single", "single"], SPEC, True, id="single:main"),
        case("single", ["single", "single", "single"], SPEC_MTP, True, mtp=True, id="single:main+mtp:3-cycles"),
        case("parts", ["parts", "parts"], SPEC, True, id="parts:main"),
        case("parts", ["parts", "parts"], SPEC_MTP, True, mtp=True, id="parts:main+mtp"),
        case("legacy", ["legacy", "legacy", "legacy"], SPEC_MTP, True, mtp=True, id="legacy:main+mtp:3-cycles"),
        case("shared", ["shared", "shared", "shared"], SPEC_MTP, True, mtp=True, id="shared:main+mtp:3-cycles"),
        # The trainer removes the old parts and writes a different number of them each time.
        case("parts", ["parts:3", "parts:2", "parts:4"], SPEC_MTP, False, mtp=True, id="parts:3-then-2-then-4"),
        case("parts", ["parts:3", "single", "parts:2"], SPEC, False, extra=CAPS["single"], id="parts-then-single-then-parts"),
    ],
)
def test_clear_then_update_leaves_new_version(loader, source, versions, spec, in_place):
    session = _first_load(loader, spec, versions[0])
    for version, layout in enumerate(versions[1:], 2):
        want = M.state(spec, version=version)
        if not in_place:
            _clean(loader)
        paths = _write(loader, layout, want)  # in place: the trainer overwrites the same files
        session.clear()
        session.update()
        observed = session.observe()
        where = f"version {version} from {paths} (after {versions[:version - 1]}), clear() then update()"
        check.params_equal(observed, want, where)
        check.equal(sorted(observed), sorted(want), f"{where}: parameter names after reload")
        if "trace" in loader.adapter.capabilities:
            # The trace is the last update's, not every update's so far (nor the first one's).
            check.sources(session.trace(), [os.path.basename(p) for p in paths], f"{where}: sources traced")


@pytest.mark.rule("LIFE-STATUS")
@pytest.mark.parametrize(
    "source,spec",
    [
        case("single", SPEC_MTP, mtp=True, status=True, id="single"),
        case("parts:3", SPEC, status=True, id="3-parts"),
        case("legacy", SPEC, status=True, id="legacy"),
        case("shared", SPEC_MTP, mtp=True, status=True, id="shared"),
    ],
)
def test_status_after_clear_and_success(loader, source, spec):
    session = _first_load(loader, spec, source)
    check.status_is(session, "NORMAL", f"{source}: after the first load")
    session.clear()
    check.status_is(session, "CLEARED", f"{source}: after clear()")
    session.clear()
    check.status_is(session, "CLEARED", f"{source}: after a second clear() in a row")
    paths = _write(loader, source, M.state(spec, version=2))
    session.update()
    check.status_is(session, "NORMAL", f"{source}: after clear() and a successful update from {paths}")
    _missing(loader, source, spec, 3)
    _failed_update(session)
    session.clear()
    check.status_is(session, "CLEARED", f"{source}: after clear() following a failed update")


@pytest.mark.rule("LIFE-FAILED-NOT-NORMAL")
@pytest.mark.parametrize(
    "source,breakage,spec,when",
    [
        case("single", "bad-dtype", SPEC, "after-clear", status=True, id="single:bad-dtype"),
        case("single", "bad-shape", SPEC_MTP, "after-clear", mtp=True, status=True, id="single:bad-shape:main+mtp"),
        case("single", "missing", SPEC_MTP, "after-clear", mtp=True, status=True, id="single:missing:main+mtp"),
        case("single", "corrupt", SPEC, "after-clear", status=True, id="single:corrupt"),
        case("single", "missing", SPEC, "first-load", status=True, id="single:missing:first-load"),
        case("parts:3", "bad-dtype", SPEC, "after-clear", status=True, id="3-parts:bad-dtype"),
        case("parts:3", "missing", SPEC_MTP, "after-clear", mtp=True, status=True, id="3-parts:missing:main+mtp"),
        case("parts:3", "corrupt", SPEC, "first-load", status=True, id="3-parts:corrupt-last-part:first-load"),
        case("legacy", "bad-shape", SPEC, "after-clear", status=True, id="legacy:bad-shape"),
        case("legacy", "missing", SPEC, "first-load", status=True, id="legacy:missing:first-load"),
        case("shared", "bad-dtype", SPEC, "after-clear", status=True, id="shared:bad-dtype"),
        case("shared", "missing", SPEC_MTP, "after-clear", mtp=True, status=True, id="shared:missing:main+mtp"),
        case("shared", "corrupt", SPEC, "first-load", status=True, id="shared:corrupt"),
    ],
)
def test_failed_update_is_never_normal(loader, source, breakage, spec, when):
    if when == "first-load":
        paths = BREAKAGES[breakage](loader, source, spec, 1)
        session = loader.open(spec)
    else:
        session = _first_load(loader, spec, source)
        check.status_is(session, "NORMAL", f"{source}: after the first successful load")
        paths = BREAKAGES[breakage](loader, source, spec, 2)
        session.clear()
    # Raised for the breakage's own reason (its type and names: APPLY-*, FILE-*), and the status must not
    # claim success afterwards.
    with _refused(breakage, spec, paths, f"{breakage} snapshot {paths} ({when})"):
        session.update()
    check.status_not(session, "NORMAL", f"{source}: after an update that raised ({breakage}, {when})")


@pytest.mark.rule("LIFE-RECOVERY")
@pytest.mark.parametrize(
    "source,breakage,spec,retry,with_status",
    [
        case("single", "bad-dtype", SPEC_MTP, "clear", True, mtp=True, status=True, id="single:bad-dtype"),
        case("single", "missing", SPEC, "clear", False, id="single:missing:no-status"),
        case("parts:3", "bad-shape", SPEC, "clear", True, status=True, id="3-parts:bad-shape"),
        case("parts:3", "missing", SPEC_MTP, "clear", True, mtp=True, status=True, id="3-parts:missing:main+mtp"),
        case("legacy", "corrupt", SPEC, "clear", True, status=True, id="legacy:corrupt"),
        case("shared", "missing", SPEC_MTP, "clear", True, mtp=True, status=True, id="shared:missing:main+mtp"),
        case("single", "missing", SPEC, "no-clear", True, status=True, id="single:missing:update-without-clear"),
        case("parts:3", "bad-dtype", SPEC, "no-clear", True, status=True, id="3-parts:bad-dtype:update-without-clear"),
    ],
)
def test_recovery_after_failed_update(loader, source, breakage, spec, retry, with_status):
    session = _first_load(loader, spec, source)
    bad = BREAKAGES[breakage](loader, source, spec, 2)
    session.clear()
    with _refused(breakage, spec, bad, f"{breakage} snapshot {bad}"):
        session.update()
    fixed = M.state(spec, version=3)
    _clean(loader)
    paths = _write(loader, source, fixed)
    where = f"{source}: after a failed update ({breakage}), the fixed version 3 in {paths}"
    if retry == "clear":
        session.clear()
        session.update()
    else:
        try:
            session.update()
        except Exception:
            # Refusing is allowed (the reference requires clear() first); claiming success is not.
            check.status_not(session, "NORMAL", f"{where}: update() without clear() raised")
            return
    check.params_equal(session.observe(), fixed, f"{where}, {'clear() then ' if retry == 'clear' else ''}update()")
    if with_status:
        check.status_is(session, "NORMAL", f"{where}: after the successful retry")


# -- every rule in every pair of its modes (SPEC.md Modes:), on every path ----------------------------------------
# The cases above hold the lifecycle's boundaries on the snapshot levels; the cases below run each rule on every
# path of conformance/paths.py in every pair of its declared modes (conformance/modes.py): staged, the draft model
# beside the main one, what a clear follows, a later call.
def _route_params(rule, *more):
    return modes.params(rule, requires=lambda combo: [*PATHS_CAPS[combo["path"]], *more,
                                                      *(["staged"] if combo.get("staged") == "staged" else []),
                                                      *(["mtp"] if combo.get("model") == "draft" else [])])


PATHS_CAPS = {p: path.capabilities for p, path in ALL_PATHS.items()}


def _routed(route, combo, spec=SPEC):
    """(route, session, spec) of ``combo``'s path, the session in its modes."""
    rt = route(combo["path"])
    spec = R.with_draft(spec, combo)
    return rt, rt.open(spec, options=R.options(combo)), spec


def _load(rt, spec, version):
    """Publish ``version`` whole and update (after the clear, where the path has one); returns where."""
    where = rt.publish(0, M.state(spec, version=version), version)
    rt.clear(0)
    rt.update(0)
    return where


def _broken_source(rt, path, spec, version):
    """Publish a ``version`` the update must refuse, on any path: a parameter of the wrong dtype on rsync (a step may
    leave keys out there: RSYNC-SUBSET), one left out elsewhere (on GDR the stream ends without it)."""
    st = M.state(spec, version=version)
    victim = R.judged("layers.0.mlp.weight", {"model": "draft" if spec.mtp else "main"})
    if path == "rsync":
        st[victim] = st[victim].astype("float32")
    else:
        del st[victim]
    return rt.publish(0, st, version), victim


def _fails(rt, where):
    try:
        rt.update(0)
    except Exception:  # noqa: BLE001 (which error each path raises is its own rules' business)
        return
    check.that(False, f"{where}: the update of a broken source succeeded")


@pytest.mark.rule("LIFE-CLEAR-RELEASES")
@pytest.mark.parametrize("combo", _route_params("LIFE-CLEAR-RELEASES"))
def test_clear_releases_every_parameter_on_every_path(route, combo):
    rt, session, spec = _routed(route, combo)
    after = combo["after"]
    if after != "nothing":
        _load(rt, spec, 1)
    if after == "failure":
        where, _ = _broken_source(rt, combo["path"], spec, 2)
        rt.clear(0)
        _fails(rt, where)
    session.clear()
    if after == "clear":
        session.clear()
    observed = session.observe()
    names = [p.name for p in spec.all_params]
    where = f"{combo['path']}: clear() after {after} ({R.label(combo)})"
    check.that(not [n for n in names if n not in observed], f"{where}: parameters not observed at all")
    still = sorted(n for n in names if n in observed and observed[n].data)
    check.that(not still, f"{where}: parameters still hold data: {still}; expected none loaded")


@pytest.mark.rule("LIFE-STATUS")
@pytest.mark.parametrize("combo", _route_params("LIFE-STATUS", "status"))
def test_status_after_clear_and_success_on_every_path(route, combo):
    rt, session, spec = _routed(route, combo)
    where = f"{combo['path']} ({R.label(combo)})"
    _load(rt, spec, 1)
    check.status_is(session, "NORMAL", f"{where}: after the first load")
    session.clear()
    check.status_is(session, "CLEARED", f"{where}: after clear()")
    session.clear()
    check.status_is(session, "CLEARED", f"{where}: after a second clear() in a row")
    _load(rt, spec, 2)
    check.status_is(session, "NORMAL", f"{where}: after clear() and a successful update")
    bad, _ = _broken_source(rt, combo["path"], spec, 3)
    rt.clear(0)
    _fails(rt, bad)
    session.clear()
    check.status_is(session, "CLEARED", f"{where}: after clear() following a failed update")


@pytest.mark.rule("LIFE-RECOVERY")
@pytest.mark.parametrize("combo", _route_params("LIFE-RECOVERY"))
def test_recovery_after_failed_update_on_every_path(route, combo):
    rt, session, spec = _routed(route, combo)
    _load(rt, spec, 1)
    bad, victim = _broken_source(rt, combo["path"], spec, 2)
    rt.clear(0)
    with check.raises(Exception, match=r"\S", names=[victim], where=f"{bad} ({R.label(combo)})"):
        rt.update(0)
    fixed = M.state(spec, version=3)
    where = rt.publish(0, fixed, 3)
    session.clear()
    rt.update(0)
    where = f"{where}: clear() and update() after the failed update ({R.label(combo)})"
    check.params_equal(session.observe(), fixed, where)
    if "status" in rt.loader.adapter.capabilities:
        check.status_is(session, "NORMAL", where)


@pytest.mark.rule("LIFE-RELOAD-LATEST")
@pytest.mark.parametrize("combo", _route_params("LIFE-RELOAD-LATEST"))
def test_clear_then_update_leaves_new_version_in_every_mode(route, combo):
    """The update under test is the second or third of the session; what the path's trainer publishes for it is
    exactly what the session holds afterwards."""
    rt, session, spec = _routed(route, combo)
    for version in range(1, R.CALLS[combo["call"]] + 1):
        _load(rt, spec, version)
    want = M.state(spec, version=7)
    where = rt.publish(0, want, 7)
    session.clear()
    rt.update(0)
    check.params_equal(session.observe(), want, f"{where}: clear() then the {combo['call']} update ({R.label(combo)})")
