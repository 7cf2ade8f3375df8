"""Staged updates: validate and land the whole update, then commit. Spec: SPEC.md § STAGE.

Each path's trainer (``path_sources``) publishes a version healthy or with one fault placed where a
loader that adopts as it goes has adopted everything else first (the last parameter missing or of the
wrong dtype, the source breaking before its end). With ``options["staged"] = True`` the failed update
must leave every parameter exactly as it was; the next clear() and update() from a fixed source load it
bit for bit. The multi-rank half of the rule (a failure on another rank) is in test_ranks_quick.py (forked ranks,
the quick run) and test_multirank.py (the tier).
"""
import os

import pytest

from conformance import check
from conformance.path_sources import CAPS, FAULTS, KINDS, Sources, broken_state, failure_of
from conformance.paths import PATHS, route  # noqa: F401 (the fixture)
from weightsync.fixtures import ipc as I
from weightsync.fixtures import models as M

# Five tensors in three parts: part 0 holds the first and fourth, so the last parameter (norm.bias) is
# in part 1 and part 2 follows it; a duplicate name in a later part must win.
SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)),
              ("layers.1.mlp.weight", "float16", (4, 4)), ("mtp.0.proj.weight", "bfloat16", (4, 4)),
              ("norm.bias", "float16", (4,)))


@pytest.fixture
def sources(loader, request):
    made = []

    def make(kind, timeout_s=2.0):
        made.append(Sources(loader, kind, timeout_s=timeout_s))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _case(kind, fault):
    return pytest.param(kind, fault, marks=[pytest.mark.requires("staged", *CAPS[kind]), pytest.mark.modes(fault=fault, ranks="one")],
                        id=f"{kind}:{fault}")


@pytest.mark.rule("STAGE-ATOMIC")
@pytest.mark.parametrize("kind,fault", [_case(k, f) for k in KINDS for f in FAULTS])
def test_failed_staged_update_changes_nothing(loader, sources, kind, fault):
    src = sources(kind, timeout_s=0.2 if fault == "gone" else 2.0)  # a dead trainer costs the whole timeout
    src.publish(SPEC, 1)
    session = src.open(SPEC, staged=True)
    session.update()
    src.settle()
    check.params_equal(session.observe(), M.state(SPEC, version=1), f"{kind}: staged first load of {src.where}")
    session.clear()
    before = session.observe()
    src.publish(SPEC, 2, fault)
    where = f"{kind}: staged update of {src.where} ({fault})"
    # A staged update fails as the default mode does, with the type and names its rule gives (APPLY, FILE,
    # IPC-SEGMENT-GONE, BKT-TIMEOUT): never for another reason.
    exc, match, names = src.failure(SPEC, fault)
    if fault == "bad-dtype":
        match, names = r"Type mismatch", names + ([I.meta_path(loader.shared_dir, 0)] if kind == "ipc" else [])
    with check.raises(exc, match=match, names=names, where=where):
        session.update()
    src.settle()
    where = f"{kind}: after the staged update of {src.where} failed ({fault})"
    check.unchanged(before, session.observe(), where)
    if "status" in loader.adapter.capabilities:
        check.status_not(session, "NORMAL", where)
    if kind == "bucket" and fault == "gone":
        return  # the trainer is gone with its endpoint; recovery on buckets: BKT-RECOVERY
    src.publish(SPEC, 3)
    session.clear()
    session.update()
    src.settle()
    check.params_equal(session.observe(), M.state(SPEC, version=3), f"{kind}: clear() and staged update of {src.where} after the failure")


@pytest.mark.rule("STAGE-ATOMIC")
@pytest.mark.requires("staged", "snapshot.parts", "mtp")
def test_staged_update_takes_the_later_duplicate(loader):
    from weightsync.fixtures import snapshot as S

    spec = M.spec(*((p.name, p.dtype, p.shape) for p in SPEC.main if not p.name.startswith("mtp")),
                  mtp=[(("mtp.0.proj.weight", "bfloat16", (4, 4)),)])
    v1, v2 = M.state(spec, version=1), M.state(spec, version=2)
    names = sorted(v1)
    # part 0: every tensor of version 1; part 1: the first and last again, of version 2 (later wins)
    paths = S.write_parts(loader.model_dir, 0, 0, {0: {n: v1[n] for n in names},
                                                   1: {names[0]: v2[names[0]], names[-1]: v2[names[-1]]}})
    session = loader.open(spec, options={"staged": True})
    session.update()
    want = {**v1, names[0]: v2[names[0]], names[-1]: v2[names[-1]]}
    check.params_equal(session.observe(), want, f"staged update of {paths}: main and MTP, the later part's duplicates win")


# -- every path: the trainer's own feed of each path (conformance.paths), each fault at the last place it reaches ------
PATH_FAULTS = ("missing", "bad-dtype", "gone")
# the paths Sources does not feed (test_failed_staged_update_changes_nothing has parts, ipc and bucket); rsync and GDR
# have no staged mode (they validate the whole step first, or hand each item to the models' loaders: SPEC APPLY-EMPTY)
EVERY_PATH = ("single", "legacy", "shared")


def _truncate_last(rt) -> None:
    """The source gone mid-read: the last file the path's trainer wrote, truncated to half."""
    last = rt.feed.written[0][-1]
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) // 2)


def _every_path_case(path_id, fault):
    return pytest.param(path_id, fault, marks=[pytest.mark.requires("staged", *PATHS[path_id].capabilities),
                                               pytest.mark.modes(fault=fault, ranks="one")], id=f"{path_id}:{fault}")


@pytest.mark.rule("STAGE-ATOMIC")
@pytest.mark.parametrize("path_id,fault", [_every_path_case(p, f) for p in EVERY_PATH for f in PATH_FAULTS])
def test_failed_staged_update_changes_nothing_on_every_path(loader, route, path_id, fault):
    """Staged, on the snapshot levels Sources does not write (single file, legacy, the shared pickle fallback: a
    whole-file read is no excuse to adopt early): the update of version 2 fails with its rule's error (type and
    names, as on the parts) and leaves every parameter exactly as before (unloaded after the clear), the status not
    NORMAL; a clear and an update of version 3 then load it bit for
    bit."""
    rt = route(path_id)
    session = rt.open(SPEC, options={"staged": True})
    rt.publish(0, M.state(SPEC, version=1), 1)
    rt.update(0)
    check.params_equal(session.observe(), M.state(SPEC, version=1), f"{path_id}: staged first load")
    rt.clear(0)
    before = session.observe()
    sent = broken_state(SPEC, 2, fault if fault != "gone" else None)
    where = rt.publish(0, sent, 2)
    if fault == "gone":
        _truncate_last(rt)
    where = f"{path_id}: staged update of {where} ({fault}: the last parameter, {sorted(p.name for p in SPEC.all_params)[-1]})"
    # As on the parts (test_failed_staged_update_changes_nothing): the type and names its rule gives (APPLY-MISSING-
    # FAILS, APPLY-DTYPE-MISMATCH's "Type mismatch", FILE-TRUNCATED naming the file), never another reason.
    exc, match, names = failure_of(SPEC, fault, truncated=rt.feed.written[0][-1] if fault == "gone" else None)
    if fault == "bad-dtype":
        match = r"Type mismatch"
    with check.raises(exc, match=match, names=names, where=where) as raised:
        rt.update(0)
    check.unchanged(before, session.observe(), f"{where} (raised {type(raised.value).__name__}: {raised.value})")
    if "status" in loader.adapter.capabilities:
        check.status_not(session, "NORMAL", where)
    session.clear()
    rt.publish(0, M.state(SPEC, version=3), 3)
    rt.update(0)
    check.params_equal(session.observe(), M.state(SPEC, version=3), f"{where}: clear() and a staged update of version 3")
