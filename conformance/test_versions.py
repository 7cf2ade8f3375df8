"""Versions: stamped when the update commits, never backwards, kept by a failed update. Spec: SPEC.md § VER.

Each path carries the version of an update: ``version.yaml`` (``step``) beside the snapshot parts or the
meta file, the bucket manifests. ``session.version()`` is read between calls, and during an update at
every Python function call the update makes (``sys.setprofile``): deterministic, on every path.
"""
import sys

import pytest

from conformance import check
from conformance.harness import rss_mib
from conformance.path_sources import CAPS, FAULTS, KINDS, Sources
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C
from weightsync.fixtures.version_entries import make_entry as _make_entry

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))


@pytest.fixture
def sources(loader):
    made = []

    def make(kind, **kw):
        made.append(Sources(loader, kind, timeout_s=2.0, **kw))  # no test here waits for a dead trainer
        return made[-1]

    yield make
    for s in made:
        s.close()


def _needs(kind, *more):
    return pytest.mark.requires("version", *CAPS[kind], *more)


def _load(src, spec, version, session=None, **options):
    src.publish(spec, version)
    if session is None:
        session = src.open(spec, **options)
    else:
        session.clear()
    session.update()
    src.settle()
    return session


def during(session, call) -> list[tuple[str, object]]:
    """Run ``call()`` and read ``(status(), version())`` at every Python function call it makes in this
    thread (``sys.setprofile``): every step of the update is a point of observation, deterministically.
    Returns the distinct pairs in the order seen."""
    seen: list = []
    busy = [False]

    def probe(frame, event, arg):
        if event != "call" or busy[0]:
            return
        busy[0] = True
        try:
            pair = (session.status(), session.version())
        finally:
            busy[0] = False
        if not seen or seen[-1] != pair:
            seen.append(pair)

    sys.setprofile(probe)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.rule("VER-STAMP-AT-COMMIT")
@pytest.mark.modes(call="second")
@pytest.mark.parametrize("kind,staged", [pytest.param(k, s, marks=_needs(k, "status", *(("staged",) if s else ())),
                                                      id=f"{k}{':staged' if s else ''}")
                                         for k in KINDS for s in (False, True)])
def test_version_stamped_at_commit(loader, sources, kind, staged):
    src = sources(kind)
    session = _load(src, SPEC, 4, **({"staged": True} if staged else {}))
    check.equal(session.version(), 4, f"{kind}: version() after the first load of {src.where}")
    session.clear()
    check.equal(session.version(), 4, f"{kind}: version() after clear()")
    src.publish(SPEC, 7)
    seen = during(session, session.update)
    src.settle()
    early = [pair for pair in seen if pair[0] != "NORMAL" and pair[1] != 4]
    check.that(not early and ("UPDATING", 4) in seen,
               f"{kind}: (status, version) at every step of the update of {src.where} to version 7: {seen}; "
               "the version may change only with NORMAL")
    check.equal((session.status(), session.version()), ("NORMAL", 7), f"{kind}: after the update to version 7")


@pytest.mark.rule("VER-STAMP-AT-COMMIT")
@pytest.mark.parametrize("kind,staged", [pytest.param(k, s, marks=[_needs(k, "status", *(("staged",) if s else ())),
                                                                   pytest.mark.modes(call="first")],
                                                      id=f"{k}:first-load{':staged' if s else ''}")
                                         for k in KINDS for s in (False, True)])
def test_version_stamped_at_commit_of_the_first_load(loader, sources, kind, staged):
    """The first load of a session: version() is None until it commits, then the version it carried."""
    src = sources(kind)
    src.publish(SPEC, 7)
    session = src.open(SPEC, **({"staged": True} if staged else {}))
    check.equal(session.version(), None, f"{kind}: version() before the first load of {src.where}")
    seen = during(session, session.update)
    src.settle()
    early = [pair for pair in seen if pair[0] != "NORMAL" and pair[1] is not None]
    check.that(not early, f"{kind}: (status, version) at every step of the first load of {src.where}: {seen}; the "
               "version may appear only with NORMAL")
    check.equal((session.status(), session.version()), ("NORMAL", 7), f"{kind}: after the first load of version 7")


@pytest.mark.rule("VER-STAMP-AT-COMMIT")
@pytest.mark.parametrize("kind", [pytest.param(k, marks=_needs(k, "status"), id=k) for k in KINDS if k != "bucket"])
def test_no_version_carried_none_reported(loader, sources, kind):
    """A snapshot or meta file without ``version.yaml`` carries no version (a bucket manifest always does):
    the commit stamps nothing, neither an empty nor a made-up version."""
    src = sources(kind)
    src.publish(SPEC, 3, write_version=False)
    session = src.open(SPEC)
    session.update()
    src.settle()
    check.params_equal(session.observe(), M.state(SPEC, version=3), f"{kind}: {src.where} without version.yaml")
    check.equal((session.status(), session.version()), ("NORMAL", None),
                f"{kind}: (status, version) after an update that carried no version ({src.where})")


def _next_without_version(src, session, kept: int, after: str) -> None:
    """clear(), then an update whose source carries no version (no version.yaml): it loads version 7, and version()
    is still ``kept``, the last committed one (``after``: what failed before it)."""
    session.clear()
    src.publish(SPEC, 7, write_version=False)
    session.update()
    src.settle()
    where = f"{src.kind}: the update of {src.where} without version.yaml after {after}"
    check.params_equal(session.observe(), M.state(SPEC, version=7), where)
    check.equal((session.status(), session.version()), ("NORMAL", kept), f"{where}: (status, version)")


@pytest.mark.rule("VER-FAILED-KEEPS")
@pytest.mark.parametrize("kind,fault,staged", [
    pytest.param(k, f, s, marks=_needs(k, *(("staged",) if s else ())), id=f"{k}:{f}{':staged' if s else ''}")
    for k in KINDS for f in FAULTS for s in (False, True)
    if (k, f) != ("bucket", "gone")  # (a 0.2 s timeout; STAGE-ATOMIC has it)
    and (not s or f == FAULTS[0])])  # staged: one fault per path (the version's bookkeeping is the commit's)
def test_failed_update_keeps_version(loader, sources, kind, fault, staged):
    src = sources(kind)
    session = _load(src, SPEC, 5, **({"staged": True} if staged else {}))
    session.clear()
    src.publish(SPEC, 6, fault)
    exc, match, names = src.failure(SPEC, fault)
    with check.raises(exc, match=match, names=names, where=f"{kind}: update of {src.where} ({fault})"):
        session.update()
    src.settle()
    check.equal(session.version(), 5, f"{kind}: version() after the update to version 6 failed ({fault})")
    if kind == "bucket":
        return  # a bucket manifest always carries its version: the next update stamps its own
    # The failed update's version is not this update's: one that carries none stamps none.
    _next_without_version(src, session, 5, f"the update to version 6 failed ({fault})")


class _Recapture:
    """The engine's recapture (``options["recapture"]``): raises while ``failing``, as a graph capture that runs
    out of memory does, after every check of the update passed (on one rank: after its vote)."""

    def __init__(self):
        self.failing = False

    def __call__(self, names):
        if self.failing:
            raise MemoryError("the engine's graph recapture ran out of memory (the suite's recapture failed)")


@pytest.mark.rule("VER-FAILED-KEEPS")
@pytest.mark.parametrize("kind,staged", [
    pytest.param(k, s, marks=_needs(k, "model.recapture", *(("staged",) if s else ())), id=f"{k}:recapture{':staged' if s else ''}")
    for k, s in (("snapshot", False), ("ipc", True))])
def test_version_failed_after_every_check_is_never_stamped(loader, sources, kind, staged):
    """The update to version 6 passes every check of its own and fails in the engine's recapture, the last step
    before its commit (past the ranks' vote, where one rank is all there is): version() stays 5, and the next
    update carrying no version commits with version() still 5, never the failed update's 6."""
    src, recapture = sources(kind), _Recapture()
    session = _load(src, SPEC, 5, recapture=recapture, **({"staged": True} if staged else {}))
    session.clear()
    src.publish(SPEC, 6)
    recapture.failing = True
    with check.raises(MemoryError, match=r"recapture", where=f"{kind}: update of {src.where}, the recapture raising"):
        session.update()
    src.settle()
    check.equal(session.version(), 5, f"{kind}: version() after the update to version 6 failed in the recapture")
    recapture.failing = False
    _next_without_version(src, session, 5, "the update to version 6 failed in the recapture")


@pytest.mark.rule("VER-FAILED-KEEPS")
@pytest.mark.parametrize("kind", [pytest.param(k, marks=_needs(k), id=k) for k in KINDS if k != "bucket"])
def test_refused_version_is_never_stamped_later(loader, sources, kind):
    """An update refused for its version (older than the one reported: VER-MONOTONIC) is a failed update too:
    the version it carried is never stamped later, by an update that carries none (the version would go back)."""
    src = sources(kind)
    session = _load(src, SPEC, 5)
    session.clear()
    src.publish(SPEC, 3)
    with check.raises(ValueError, match=r"older", names=["3", "5"], where=f"{kind}: update of {src.where} to version 3 after 5"):
        session.update()
    src.settle()
    check.equal(session.version(), 5, f"{kind}: version() after the update to version 3 was refused")
    _next_without_version(src, session, 5, "the update to version 3 was refused")


@pytest.mark.rule("VER-MONOTONIC")
@pytest.mark.modes(call=("second", "third"))
@pytest.mark.parametrize("kind,staged", [pytest.param(k, s, marks=_needs(k, *(("staged",) if s else ())),
                                                      id=f"{k}{':staged' if s else ''}")
                                         for k in KINDS for s in (False, True)])
def test_version_never_goes_backwards(loader, sources, kind, staged):
    src = sources(kind)
    options = {"staged": True} if staged else {}
    session = _load(src, SPEC, 9, **options)
    for version, accepted in ((9, True), (8, False), (0, False), (10, True)):
        session.clear()
        src.publish(SPEC, version)
        where = f"{kind}: update to version {version} after version {session.version()} ({src.where})"
        if accepted:
            session.update()
            src.settle()
            check.params_equal(session.observe(), M.state(SPEC, version=version), where)
            check.equal(session.version(), version, f"{where}: version()")
            continue
        reported = session.version()
        with check.raises(ValueError, match=r"older", names=[str(version), str(reported)], where=where):
            session.update()
        src.settle()
        check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], where)
        check.equal(session.version(), reported, f"{where}: version() after the refusal")


BAD_FILES = ["step: -1", "step: two", "step: 1.5", "[1, 2]", "step: [", "other: 3", "step: true"]


def _version_file_reading(loader, src, kind: str, text: str):
    """Version 2 loaded and cleared, version 3 published, its ``version.yaml`` then rewritten to hold
    ``text``: (the session, the file's path), ready for the update that reads it."""
    session = _load(src, SPEC, 2)
    session.clear()
    src.publish(SPEC, 3)
    path = C.write_version(loader.model_dir if kind == "snapshot" else loader.shared_dir, 3)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return session, path


@pytest.mark.rule("VER-MONOTONIC")
@pytest.mark.parametrize("kind", [pytest.param(k, marks=_needs(k), id=k) for k in ("snapshot", "ipc")])
def test_quoted_step_is_a_version(loader, sources, kind):
    """FastDeploy reads ``step`` as a string ("12345"); a quoted number is that version."""
    session, path = _version_file_reading(loader, sources(kind), kind, 'step: "11"')
    session.update()
    check.params_equal(session.observe(), M.state(SPEC, version=3), f"{kind}: update with {path} reading step: \"11\"")
    check.equal(session.version(), 11, f"{kind}: version() after {path} reading step: \"11\"")


@pytest.mark.rule("VER-MONOTONIC")
@pytest.mark.parametrize("kind,text", [pytest.param(k, t, marks=_needs(k), id=f"{k}:{t}") for k in ("snapshot", "ipc")
                                       for t in (BAD_FILES if k == "snapshot" else BAD_FILES[:2])])
def test_unreadable_version_file_is_refused(loader, sources, kind, text):
    session, path = _version_file_reading(loader, sources(kind), kind, text)
    with check.raises(ValueError, match=r"version|step", names=["version.yaml"], where=f"{kind}: {path} reading {text!r}"):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{kind}: after {path} was refused")
    check.equal(session.version(), 2, f"{kind}: version() after {path} reading {text!r} was refused")


# -- VER-FILE-SAFE: what a version.yaml may be ----------------------------------------------------------
FILE_BOUND_S = 20.0  # each path's child: a blocked read (a FIFO) or an unbounded one (/dev/zero) ends here


# kind -> accepted (a regular file of at most the limit); refused ones name the file and load nothing
# (in this order: an implementation that reads without a bound fails at "one-past", before /dev/zero)
VERSION_ENTRIES = {"at-limit": True, "one-past": False, "sparse-1GiB": False, "directory": False,
                   "dangling-link": False, "link-to-dev-null": False, "link-to-proc-self-mem": False,
                   "link-to-dev-zero": False, "fifo": False}
# Version files nested deep (fixtures.version_entries.NESTED), judged once (a cap on the reads changes nothing for a
# file of a few KiB): 64 levels of mappings and sequences load, the file's mapping counting as one; 65, thousands
# (flow sequences, flow mappings, block mappings by indentation), step itself nested 3000 deep, and step an alias of
# 9**9 items once expanded are refused naming the file, within the child's deadline.
NESTED_ENTRIES = {"nested-64-levels": True, "nested-65-levels": False, "nested-3000-sequences": False,
                  "nested-2000-mappings": False, "nested-200-block-mappings": False, "step-nested-3000": False,
                  "step-billion-laughs": False}
# The capped case's cap: it divides the 64 KiB limit, so a reader that counts its pieces lands exactly on the
# limit after 16 of them (where "< limit" and "<= limit" part), and it cuts the at-limit file's step line
# (fixtures.version_entries.STEP_AT) in two.
VERSION_CAP = 4096
FILE_PATHS = [pytest.param(k, marks=_needs(k, "status"), id=k) for k in ("snapshot", "ipc")] + [
    pytest.param(s, marks=pytest.mark.requires(c), id=s) for s, c in (("rsync", "stream.rsync"), ("gdr", "stream.gdr"))]


def _progress(loader) -> str:
    import os

    return os.path.join(os.path.dirname(loader.model_dir.rstrip("/")), "version-file-case")


def _at(loader, where: str) -> None:
    """Leave the case the child is in where the parent finds it if the child has to be killed."""
    with open(_progress(loader), "w", encoding="utf-8") as f:
        f.write(where)


def _capped(capped) -> str:
    """In the child: cap every read of this process (when asked); what the cases' messages add."""
    if capped is None:
        return ""
    capped.install(VERSION_CAP)
    return f", every read of the loading process capped at {VERSION_CAP} bytes"


def _entries(capped) -> dict:
    return VERSION_ENTRIES if capped is not None else {**NESTED_ENTRIES, **VERSION_ENTRIES}


def _entries_on_snapshot_or_ipc(loader, kind, capped=None):
    """In the child: version 2 loaded, version 3 published, its version.yaml replaced by each entry in
    turn (cleared before each update); each refused (at the limit: version 3 loaded), then a fixed file
    loads version 3."""
    import os

    cap = _capped(capped)
    src = Sources(loader, kind, timeout_s=2.0)
    try:
        session = _load(src, SPEC, 2)
        path = os.path.join(loader.model_dir if kind == "snapshot" else loader.shared_dir, "version.yaml")
        src.publish(SPEC, 3)
        for entry, accepted in _entries(capped).items():
            session.clear()
            _make_entry(path, entry, 3)
            where = f"{kind}: update with {path} a {entry}{cap}"
            _at(loader, where)
            if accepted:
                session.update()
                check.params_equal(session.observe(), M.state(SPEC, version=3), where)
                check.equal(session.version(), 3, f"{where}: version()")
                continue
            with check.raises(ValueError, match=r"\S", names=[path], where=where):
                session.update()
            check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{where}: after the refusal")
            check.that(session.status() != "NORMAL" and session.version() == 3,
                       f"{where}: (status, version) ({session.status()}, {session.version()}) after the refusal")
        _make_entry(path, "at-limit", 4)  # the trainer fixes it: the next cycle loads
        session.clear()
        session.update()
        check.params_equal(session.observe(), M.state(SPEC, version=3), f"{kind}: after the refusals, a fixed {path}{cap}")
        check.equal(session.version(), 4, f"{kind}: version() after a fixed {path} (step 4){cap}")
    finally:
        src.close()
    return True


def _entries_on_stream(loader, strategy, capped=None):
    """In the child: a bootstrap load (no version argument) reads version.yaml; each refused entry is
    an error naming the file, raised before the trainer is asked for anything, nothing loaded."""
    import os

    from conformance.stream_support import open_stream
    from weightsync.fixtures import streams as ST

    cap = _capped(capped)
    state = M.state(SPEC, version=3)
    path = os.path.join(loader.model_dir, "version.yaml")
    with ST.trainer() as trainer:
        for entry, accepted in _entries(capped).items():
            session, _ = open_stream(loader, trainer, SPEC, strategy, version=None)
            _make_entry(path, entry, 3)
            where = f"{strategy}: bootstrap load with {path} a {entry}{cap}"
            _at(loader, where)
            hellos = len(trainer.of("hello"))
            if accepted:
                trainer.serve(ST.stream_of(state, step="3"))
                session.update()
                check.params_equal(session.observe(), state, where)
                check.equal([h["step_id"] for h in trainer.of("hello")[hellos:]], ["3"], f"{where}: steps asked")
            else:
                with check.raises(ValueError, match=r"\S", names=[path], where=where):
                    session.update()
                check.equal(len(trainer.of("hello")), hellos, f"{where}: streams asked of the trainer")
                check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{where}: after the refusal")
            session.close()
    return True


def _judge_entries(loader, path_id, capped=None) -> None:
    from conformance.harness import ChildFailed, in_child

    fn = _entries_on_stream if path_id in ("rsync", "gdr") else _entries_on_snapshot_or_ipc
    try:
        done = in_child(fn, loader, path_id, capped, timeout_s=FILE_BOUND_S)
    except ChildFailed as e:
        try:
            with open(_progress(loader), encoding="utf-8") as f:
                case = f.read()
        except OSError:
            case = "before the first case"
        raise AssertionError(f"{path_id}: at {case}: {e}") from None
    check.that(done, f"{path_id}: the version file cases did not complete")


@pytest.mark.rule("VER-FILE-SAFE")
@pytest.mark.parametrize("path_id", FILE_PATHS)
def test_version_file_is_a_small_regular_file(loader, path_id):
    """Every entry at once, in a forked child with a deadline: an implementation that blocks on the FIFO
    or reads /dev/zero without end fails here, naming the path, instead of hanging the run."""
    _judge_entries(loader, path_id)


@pytest.mark.rule("VER-FILE-SAFE")
@pytest.mark.parametrize("path_id", FILE_PATHS)
def test_version_file_read_in_pieces_is_judged_the_same(loader, path_id, read_capper):
    """Every entry again, every read of the child capped at 4096 bytes (``conformance.read_cap``; POSIX
    lets any read return fewer bytes than asked): the file at the limit, its step line cut by the 4096th
    byte, loads that step; the one a byte past the limit is refused though no single read saw more than
    the limit; the rest as before."""
    _judge_entries(loader, path_id, read_capper)


# -- VER-FILE-SAFE: an entry swapped in between the loader's look and its open ---------------------------------------
# version.yaml is a small regular file whenever the loader looks at it (stat, lstat, access) and each of these once it
# has looked and when it opens it (the trainer replaced it in between), so that the loader's open meets what none of
# its looks saw: only the kind judged again on the open descriptor (opened non-blocking) and the bounded read refuse
# it. A loader that trusts its os.stat blocks on the FIFO.
# (in this order: a loader that reads without a bound fails at "one-past", before /dev/zero; the FIFO last, so that a
# loader blocked on it in native code has been judged on the others)
SWAPPED_ENTRIES = ("one-past", "directory", "link-to-dev-zero", "fifo")
SWAP_BOUND_S = 10.0  # the child's deadline: a FIFO open blocking in native code (the GIL held) is killed here


class _SwapAfterEachLook:
    """While entered (in the forked child only), until this process first opens ``path``: the entry there is a
    regular file (``make_entry(.., "at-limit", step)``) during each ``os.stat``, ``os.lstat`` or ``os.access`` of it
    (``os.path.exists``, ``isfile``, ``islink``, ``realpath``, ``pathlib.Path.stat``, ``exists`` and ``is_file`` go
    through these) and ``entry`` right after each; its first ``os.open``, ``open`` or ``io.open``
    (``pathlib.Path.open``) meets ``entry`` (put in place first if the loader opened without a look), which then
    stays. So the swap lands after the loader's last look before its open, however many looks and whatever the call,
    also when the open itself is native code; a loader that opens first and judges the descriptor (``fstat``) meets
    ``entry`` at its open; one that retries sees ``entry`` from then on. A path relative to a ``dir_fd`` counts.
    ``calls`` lists the looks and the open seen (empty: this process never examined the path through these, e.g. a
    native reader; nothing was swapped). The suite interposes on its own process's ``os``, never on the
    implementation's functions; every function is restored on exit."""

    LOOKS = ("stat", "lstat", "access")

    def __init__(self, path: str, entry: str, step: int):
        import os
        import threading

        self.path, self.entry, self.step = path, entry, step
        self.calls: list[str] = []
        self._now = "regular"  # what the entry is now: "regular" or ``entry``
        self._opened = self._busy = False
        self._lock = threading.RLock()
        self._names = {os.path.abspath(path), os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                                                           os.path.basename(path))}
        self._saved: list = []

    def _mine(self, p, dir_fd=None) -> bool:
        import os

        if self._busy or self._opened or isinstance(p, int):
            return False
        try:
            p = os.fsdecode(os.fspath(p))
        except TypeError:
            return False
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        return os.path.abspath(p) in self._names

    def _become(self, what: str) -> None:
        if self._now != what:
            self._busy = True  # (make_entry's own looks pass through)
            try:
                _make_entry(self.path, "at-limit" if what == "regular" else what, self.step)
            finally:
                self._busy = False
            self._now = what

    def _look(self, name, real):
        def look(p, *args, **kwargs):
            if not self._mine(p, kwargs.get("dir_fd")):
                return real(p, *args, **kwargs)
            with self._lock:
                self._become("regular")
                try:
                    return real(p, *args, **kwargs)
                finally:
                    self.calls.append(f"os.{name}")
                    self._become(self.entry)
        return look

    def _open(self, name, real):
        def opener(p, *args, **kwargs):
            if self._mine(p, kwargs.get("dir_fd")):
                with self._lock:
                    if not self._opened:
                        self._become(self.entry)
                        self._opened = True
                        self.calls.append(name)
            return real(p, *args, **kwargs)  # (never under the lock: it may block)
        return opener

    def __enter__(self):
        import builtins
        import io
        import os

        targets = [(os, n, self._look(n, getattr(os, n))) for n in self.LOOKS]
        targets += [(m, "open", self._open(label, m.open))
                    for m, label in ((os, "os.open"), (builtins, "open"), (io, "io.open"))]
        for module, name, wrapper in targets:
            self._saved.append((module, name, getattr(module, name)))
            setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()


def _swapped_update(session, path: str, entry: str):
    """``session.update()`` with ``path`` a regular file at each of the loader's looks and ``entry`` after them and
    at its open: (what it raised or None, the calls seen in words, or None when there were none: nothing swapped)."""
    with _SwapAfterEachLook(path, entry, 3) as swap:
        try:
            session.update()
        except Exception as e:  # noqa: BLE001 (judged by the caller)
            raised = e
        else:
            raised = None
    return raised, (", ".join(swap.calls) or None)


def _judge_swapped(raised, path: str, where: str) -> None:
    with check.raises(ValueError, match=r"\S", names=[path], where=where):
        if raised is not None:
            raise raised


def _swapped_on_snapshot_or_ipc(loader, kind):
    """In the child: version 2 loaded, version 3 published; for each of SWAPPED_ENTRIES in turn (cleared before each
    update), version.yaml a regular file (step 3) at each of the update's looks at it and that entry after them and
    at its open (``_SwapAfterEachLook``): refused naming the file, nothing loaded, not NORMAL, version() still 2.
    Then a fixed file (step 4) loads version 3 bit for bit. Returns entry -> the loader's calls on the file in words
    (None: none seen, nothing swapped)."""
    import os

    src = Sources(loader, kind, timeout_s=2.0)
    swapped: dict = {}
    try:
        session = _load(src, SPEC, 2)
        src.publish(SPEC, 3)
        path = os.path.join(loader.model_dir if kind == "snapshot" else loader.shared_dir, "version.yaml")
        for entry in SWAPPED_ENTRIES:
            session.clear()
            _make_entry(path, "at-limit", 3)  # a regular file, as the trainer published it
            where = (f"{kind}: update with {path} a regular file (step 3) at each of the loader's looks at it, "
                     f"a {entry} after them")
            _at(loader, where)
            raised, swapped[entry] = _swapped_update(session, path, entry)
            if swapped[entry] is None:
                continue
            where += f" (its calls on it: {swapped[entry]})"
            _judge_swapped(raised, path, where)
            check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{where}: after the refusal")
            check.that(session.status() != "NORMAL" and session.version() == 2,
                       f"{where}: (status, version) ({session.status()}, {session.version()}) after the refusal")
        _make_entry(path, "at-limit", 4)  # the trainer fixes it: the next cycle loads
        session.clear()
        session.update()
        check.params_equal(session.observe(), M.state(SPEC, version=3),
                           f"{kind}: after the swapped entries, a fixed {path}")
        check.equal(session.version(), 4, f"{kind}: version() after a fixed {path} (step 4)")
    finally:
        src.close()
    return swapped


def _swapped_on_stream(loader, strategy):
    """In the child: for each of SWAPPED_ENTRIES, a bootstrap load (no version argument) whose regular version.yaml
    (step 3) is that entry after each of the update's looks at it and at its open: refused naming the file before the
    trainer is asked for anything, nothing loaded. Returns entry -> the loader's calls on the file in words (None: none
    seen, nothing swapped)."""
    import os

    from conformance.stream_support import open_stream
    from weightsync.fixtures import streams as ST

    path = os.path.join(loader.model_dir, "version.yaml")
    swapped: dict = {}
    with ST.trainer() as trainer:
        for entry in SWAPPED_ENTRIES:
            session, _ = open_stream(loader, trainer, SPEC, strategy, version=None)
            try:
                _make_entry(path, "at-limit", 3)  # a regular file, as the trainer published it
                where = (f"{strategy}: bootstrap load with {path} a regular file (step 3) at each of the loader's "
                         f"looks at it, a {entry} after them")
                _at(loader, where)
                hellos = len(trainer.of("hello"))
                raised, swapped[entry] = _swapped_update(session, path, entry)
                if swapped[entry] is None:
                    continue
                where += f" (its calls on it: {swapped[entry]})"
                _judge_swapped(raised, path, where)
                check.equal(len(trainer.of("hello")), hellos, f"{where}: streams asked of the trainer")
                check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{where}: after the refusal")
            finally:
                session.close()
    return swapped


SWAP_RSS_CAP_MIB = 512  # a child that grows by this much reads the device swapped in without end: killed


class _SwapWatch:
    """From the test process (``harness.in_child``'s ``watch``). A child blocked opening a FIFO for reading (the
    kernel's ``wait_for_partner``) is recorded and let go: the FIFO at ``path`` is opened for writing (non-blocking: it
    succeeds only while a reader has it open or waits in open()) and closed at once, so the child reads end of file
    and its case goes on to a verdict instead of waiting out the deadline. A child whose memory grows past
    SWAP_RSS_CAP_MIB (a link to /dev/zero read without end) is killed, and the case fails naming the device."""

    def __init__(self, path: str, where):
        self.path, self.where, self.blocked, self._rss0 = path, where, "", None

    def __call__(self, pid) -> None:
        import os
        import stat

        from conformance.harness import blocked_in

        rss = rss_mib(pid)
        self._rss0 = rss if self._rss0 is None else self._rss0
        if rss is not None and rss - self._rss0 > SWAP_RSS_CAP_MIB:
            check.that(False, f"{self.where()}: the update read {rss - self._rss0} MiB from {self.path} and was killed; "
                              "a version file's read must stop one byte past the limit (VER-FILE-SAFE)")
        where = blocked_in(pid)
        if "wait_for_partner" not in where:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                self.blocked = self.blocked or where
        finally:
            os.close(fd)


@pytest.mark.rule("VER-FILE-SAFE")
@pytest.mark.parametrize("path_id", FILE_PATHS)
def test_version_file_swapped_after_the_look_is_refused(loader, path_id):
    """version.yaml is a regular file whenever the loader looks at it (stat, lstat, access) and, after its looks and
    at its open (the trainer replaced it in between), a file a byte over the limit, a directory, a link to /dev/zero,
    a FIFO: the kind is judged again on the descriptor, opened non-blocking, and the read is bounded, so each update
    is refused naming the file, never blocked; a loader that opens first and judges the descriptor passes too. In a
    forked child with a deadline; a FIFO open that blocks is let go from here (the case goes on) and fails the case
    naming it, and a child reading /dev/zero without end is killed at SWAP_RSS_CAP_MIB, naming it."""
    import os

    from conformance.harness import ChildFailed, ChildTimedOut, in_child

    directory = loader.model_dir if path_id in ("snapshot", "rsync", "gdr") else loader.shared_dir
    path = os.path.join(directory, "version.yaml")
    fn = _swapped_on_stream if path_id in ("rsync", "gdr") else _swapped_on_snapshot_or_ipc
    fix = "; the kind must be judged again on the descriptor (fstat), opened non-blocking (VER-FILE-SAFE)"

    def case() -> str:
        """The case the child is in (or was in when it was killed)."""
        try:
            with open(_progress(loader), encoding="utf-8") as f:
                return f.read()
        except OSError:
            return f"{path_id}: before the first case"

    watch = _SwapWatch(path, case)

    def blocked() -> str:
        return (f"{path_id}: the update opened {path}, a FIFO swapped in after the loader's looks at a regular "
                f"file, for reading without O_NONBLOCK and blocked (in {watch.blocked}) until the suite opened it for "
                f"writing{fix}")

    try:
        swapped = in_child(fn, loader, path_id, timeout_s=SWAP_BOUND_S, watch=watch, watch_interval_s=0.02)
    except ChildTimedOut as e:
        raise AssertionError(f"{case()}: ran past {SWAP_BOUND_S:g}s (blocked in {e.blocked_in or 'an unknown wait'}) and "
                             f"was killed{fix}") from None
    except ChildFailed as e:
        if watch.blocked:
            raise AssertionError(blocked()) from None
        if not e.child_error:  # (the child died)
            raise
        raise AssertionError(f"{e.child_error.removeprefix('AssertionError: ')}\n(in the forked child)\n"
                             f"{e.child_traceback}") from None
    check.that(not watch.blocked, blocked())
    if not any(swapped.values()):
        pytest.skip(f"{path_id}: the loader never examined {path} through os.stat, os.lstat, os.access, os.open or "
                    "open in this process (a native reader?): no entry can be swapped in between its look and its open")
