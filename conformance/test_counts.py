"""No success without a transfer: an update in which nothing landed, or fewer tensors landed than it was
sent, fails naming both counts, on every path. Spec: SPEC.md § APPLY (APPLY-COUNT-MATCHES).

Every path of ``conformance.paths`` (the four snapshot levels, ipc metas, buckets, rsync and GDR) and GDR's IPC
mode. Version 1 loads whole; then each update of version 2 is short (nothing at all; one tensor fewer than
the model's, at each position; the MTP model's tensor missing; one tensor fewer beside a stray tensor no
parameter takes, so that the source holds as many tensors as the model; the buckets' ``end`` announcing one
tensor more than arrived; GDR's stream short in place, the weights still loaded) and must fail with a message carrying ``{landed} of {sent}`` (or ``{landed}/{sent}``),
its status not NORMAL and the version it reports unchanged; then version 3, whole, loads (the exact count
succeeds). Every path is cleared before its short updates (rsync's bootstrap load owes every parameter:
RSYNC-SUBSET); GDR is judged in place first (GDR-SHORT-STREAM: nothing, then one tensor fewer). One case per path runs every short update of
the main model on one session, another the MTP model's.
"""
import pytest

from conformance import check
from conformance.paths import MORE_PATHS, PATHS, route  # noqa: F401 - route is a fixture
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C
from weightsync.fixtures import streams as ST

MAIN = (("embed.weight", "float32", (4, 4)), ("model.layers.0.mlp.weight", "bfloat16", (4, 2)), ("norm.bias", "float16", (4,)))
MTP = (("model.layers.2.eh_proj.weight", "float32", (2, 4)),)
SPEC = M.spec(*MAIN)
SPEC_MTP = M.spec(*MAIN, mtp=[MTP])
NAMES = [n for n, _, _ in MAIN]  # first, middle, last in name order (the order every source writes them in)
STRAY = "embed.weight_scale"  # extends a parameter's name: no parameter takes it (APPLY-UNKNOWN-IGNORED)
ALL = {**PATHS, **MORE_PATHS}
SNAPSHOT = ("parts", "single", "legacy", "shared")
# Paths whose sources may carry a name no parameter takes (buckets and rsync refuse one: BKT-UNKNOWN-NAME,
# RSYNC-VALIDATE-ALL).
TAKES_STRAYS = (*SNAPSHOT, "ipc", "gdr", "gdr_ipc")


def _cases():
    """Per path: the main model's short updates, and the MTP model's tensor missing (needs ``mtp``)."""
    return [pytest.param(path, kind, marks=[pytest.mark.requires(*p.capabilities, "status", *(("mtp",) if kind == "mtp" else ())),
                                            pytest.mark.modes(model="draft" if kind == "mtp" else "main", call="second")],
                         id=f"{path}-{kind}")
            for path, p in ALL.items() for kind in ("main", "mtp")]


def _short_updates(path, kind, spec, v2):
    """(kind, in_place, label, tensors, landed, sent, layout) of each short update of version 2; ``sent`` is
    what the update owes. GDR first in place (the weights still loaded), then after clear() as every path."""
    owed = len(spec.all_params)

    def without(name):
        return {n: t for n, t in v2.items() if n != name}

    if kind == "mtp":
        return [("short", False, f"without the MTP tensor {MTP[0][0]}", without(MTP[0][0]), owed - 1, owed, None)]
    fewer = [(f"without the {pos} tensor {name}", without(name)) for pos, name in zip(("first", "middle", "last"), NAMES)]
    out = []
    if path in ("gdr", "gdr_ipc"):  # a GDR stream in place owes every parameter too (GDR-SHORT-STREAM)
        out = [("empty", True, "in place, nothing at all", {}, 0, owed, None)]
        out += [("short", True, f"in place, {label}", st, owed - 1, owed, None) for label, st in fewer]
    if ALL[path].in_place:  # the last tensor never comes: the stream breaks after the others, before its end
        out.append(("cut", True, f"in place, the stream cut after {owed - 1} items, before {NAMES[-1]} and the end",
                    without(NAMES[-1]), owed - 1, owed, ("fail", owed - 1)))
    out.append(("empty", False, "nothing at all", {}, 0, owed, None))
    out += [("short", False, label, st, owed - 1, owed, None) for label, st in fewer]
    if path in TAKES_STRAYS:
        st = dict(sorted({**without(NAMES[1]), STRAY: v2[NAMES[0]]}.items()))
        out.append(("short", False, f"without {NAMES[1]}, with the stray {STRAY}", st, owed - 1, owed, None))
    if path == "bucket":
        def announce_one_more(update):  # every tensor arrives; `end` announces one more
            update.end["count"] += 1

        out.append(("end-count", False, "every tensor, `end` announcing one more", v2, owed, owed + 1, announce_one_more))
    return out


def _error_type(path, kind):
    """The type SPEC.md names: an empty snapshot file FILE-NO-TENSORS's ValueError, a missing parameter on the
    clear-first paths APPLY-MISSING-FAILS's RuntimeError, a disagreeing `end` BKT-END-CHECK's ValueError."""
    if kind == "end-count":
        return ValueError
    if kind == "empty":
        return ValueError if path in SNAPSHOT else Exception
    return RuntimeError if path in (*SNAPSHOT, "ipc", "bucket") else Exception


@pytest.mark.rule("APPLY-COUNT-MATCHES")
@pytest.mark.parametrize("path, kind", _cases())
def test_short_update_fails_naming_both_counts(route, loader, path, kind):
    rt = route(path)
    spec = SPEC_MTP if kind == "mtp" else SPEC
    session = rt.open(spec)
    if kind == "mtp":
        ST.mark_mtp_layers(session.models, 2)
    claims_version = "version" in loader.adapter.capabilities
    version_dir = loader.model_dir if path in SNAPSHOT else loader.shared_dir if path == "ipc" else None

    def publish(tensors, version, layout=None):
        where = rt.publish(0, tensors, version, [[]] if path == "parts" and not tensors else layout)
        if version_dir is not None:
            C.write_version(version_dir, version)
        return where

    v1 = M.state(spec, version=1)
    publish(v1, 1)
    rt.update(0)
    check.params_equal(session.observe(), v1, f"{path}: version 1")
    reported = session.version() if claims_version else None
    v2 = M.state(spec, version=2)
    for short, in_place, label, tensors, landed, sent, layout in _short_updates(path, kind, spec, v2):
        where = f"{publish(tensors, 2, layout)}: version 2 {label} ({landed} of the {sent} tensors it owes land)"
        if not in_place:
            session.clear()
        counts = rf"(?<![\d.]){landed}\s*(?:of|/)\s*{sent}(?![\d.])"
        # A cut transfer fails as its path's fault rule says (RSYNC-FAULTS, GDR-RECEIVER-ERROR), in the words of
        # the transport: how many tensors it would have carried, nobody knows.
        failing = (check.refused(Exception, where=where) if short == "cut"
                   else check.raises(_error_type(path, short), match=counts, where=where))
        try:
            with failing:
                session.update()
        finally:
            rt.feed.settle(0)
        check.status_not(session, "NORMAL", where)
        if claims_version:
            check.equal(session.version(), reported, f"{where}: version() after the update failed")
    v3 = M.state(spec, version=3)
    where = publish(v3, 3)
    session.clear()
    rt.update(0)
    check.params_equal(session.observe(), v3, f"{where}: version 3, whole, after the short updates")
    check.status_is(session, "NORMAL", f"{where}: version 3")
    if claims_version and (version_dir is not None or path == "bucket"):
        check.equal(session.version(), 3, f"{where}: version() after version 3 committed")


# -- across the mode space -------------------------------------------------------------------------------
# SPEC.md's Modes line: path x staged x model x call, every pair covered by the generated cases
# (conformance.modes). One short update per case, one tensor fewer: at the first update of the session, or at
# the second (a whole version 1, clear(), then the short one: rsync's and GDR's bootstrap after a clear owes
# every parameter too); main: a main tensor (first, middle or last by path), draft: the MTP model's tensor;
# staged: the session is opened staged (a loader that trusts what it staged must count it all the same).
from conformance import modes  # noqa: E402


@pytest.mark.rule("APPLY-COUNT-MATCHES")
@pytest.mark.parametrize("combo", modes.params("APPLY-COUNT-MATCHES", requires=lambda c: [*modes.default_requires(c), "status"]))
def test_short_update_fails_naming_both_counts_in_every_mode(route, loader, combo):
    path = combo["path"]
    draft = combo["model"] == "draft"
    spec = SPEC_MTP if draft else SPEC
    rt = route(path)
    session = rt.open(spec, options={"staged": True} if combo["staged"] == "staged" else None)
    if draft:
        ST.mark_mtp_layers(session.models, 2)
    claims_version = "version" in loader.adapter.capabilities
    version_dir = loader.model_dir if path in SNAPSHOT else loader.shared_dir if path == "ipc" else None

    def publish(tensors, version):
        where = rt.publish(0, tensors, version)
        if version_dir is not None:
            C.write_version(version_dir, version)
        return where

    if combo["call"] == "second":
        v1 = M.state(spec, version=1)
        publish(v1, 1)
        rt.update(0)
        check.params_equal(session.observe(), v1, f"{path}: version 1")
        session.clear()
    reported = session.version() if claims_version else None
    owed = len(spec.all_params)
    gone = MTP[0][0] if draft else NAMES[modes.AXES["path"].index(path) % 3]
    v2 = M.state(spec, version=2)
    where = publish({n: t for n, t in v2.items() if n != gone}, 2)
    where += f" ({combo['staged']}, {combo['call']} update): version 2 without {gone} ({owed - 1} of the {owed} it owes)"
    counts = rf"(?<![\d.]){owed - 1}\s*(?:of|/)\s*{owed}(?![\d.])"
    try:
        with check.raises(_error_type(path, "short"), match=counts, where=where):
            session.update()
    finally:
        rt.feed.settle(0)
    check.status_not(session, "NORMAL", where)
    if claims_version:
        check.equal(session.version(), reported, f"{where}: version() after the update failed")
    v3 = M.state(spec, version=3)
    where = publish(v3, 3)
    session.clear()
    rt.update(0)
    check.params_equal(session.observe(), v3, f"{where}: version 3, whole, after the short update")
    check.status_is(session, "NORMAL", f"{where}: version 3")
