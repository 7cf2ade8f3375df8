"""ipc_snapshot source priority: parts > single file > legacy tp0{id} > shared pickle. Spec: SPEC.md § LEVEL.

The worker is rank 2 on physical GPU 3 (CUDA ordinal 1), so the base name (``model_state.tp2.3``),
the legacy name (``model_state.tp03``), the ordinal's names and rank 0's names all differ.

Each priority comparison is its own case requiring only the two levels it compares. The winner
holds the whole state at a version of its own; the loser is written *after* it, with a newer mtime,
and is poisoned (one tensor of the wrong dtype), so a loader that picks the newest file, applies
the loser before or after the winner, or merely validates it, fails the case with a message saying
which level it read. The all-levels cases additionally compare the trace.
"""
import os
import re
import stat
import time

import numpy as np
import pytest

from conformance import check
from conformance import mode_run as R
from conformance import modes
from conformance.harness import ChildFailed, ChildTimedOut, Worker, in_child, rss_mib
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (4, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 2)), ("norm.bias", "float16", (4,)))
NAMES = [p.name for p in SPEC.all_params]
RANK, GPU = 2, 3
WORKER = Worker(RANK, "5,3,7", "1")
VERSION = {"parts": 1, "single": 2, "legacy": 3, "shared": 4}
CAP = {"parts": "snapshot.parts", "single": "snapshot.single", "legacy": "snapshot.legacy", "shared": "snapshot.shared_fallback"}
TRACE = pytest.mark.requires("trace")
POISONED = "norm.bias"  # float16 in the model, float32 in every losing level


def _state(level, poisoned=False):
    st = M.state(SPEC, version=VERSION[level])
    if poisoned:
        st[POISONED] = st[POISONED].astype(np.float32)
    return st


def _write(loader, level, tensors):
    return S.write_level(level, loader.model_dir, loader.shared_dir, RANK, GPU, tensors)


def _fallback_path(loader):
    return S.fallback_path(loader.shared_dir, RANK, GPU)


def _check_level_wins(loader, winner, losers, observe="values", combo=None):
    """Write ``winner`` clean, then every loser poisoned and newer; update; ``winner`` must be all
    that was read. ``combo``: the modes of the update (mode_run): staged, a later call of the session."""
    combo = combo or {}
    session = loader.open(SPEC, worker=WORKER, options=R.options(combo))
    R.earlier_snapshot(combo, session, SPEC, loader.model_dir, loader.shared_dir, level=winner, rank=RANK, gpu_id=GPU)
    names = {winner: [os.path.basename(p) for p in _write(loader, winner, _state(winner))]}
    future = time.time() + 3600
    for level in losers:
        for path in _write(loader, level, _state(level, poisoned=True)):
            os.utime(path, (future, future))
    where = (f"rank {RANK} gpu {GPU}: {winner} against {', '.join(losers)} (written later, newer mtime, "
             f"{POISONED} of the wrong dtype) in {loader.model_dir} + {loader.shared_dir} ({R.label(combo)})")
    try:
        session.update()
    except Exception as e:  # noqa: BLE001  (any error means a losing level was read)
        check.that(False, f"{where}: update raised {type(e).__name__}: {e}; only {winner} may be read")
    if observe == "values":
        check.params_equal(session.observe(), _state(winner), f"{where}: {winner} must win")
    else:
        check.sources(session.trace(), names[winner], f"{where}: only {winner} may be applied")
        labels = [f"snapshot-part{i}" for i in range(len(names[winner]))] if winner == "parts" else ["snapshot"]
        check.labels(session.trace(), labels, f"{where}: FastDeploy's labels")


def _case(winner, losers, observe="values", extra=()):
    marks = [pytest.mark.requires(*sorted({CAP[winner], *(CAP[lv] for lv in losers)})), pytest.mark.modes(call="first")]
    if observe == "trace":
        marks.append(TRACE)
    label = f"{winner}-vs-{'+'.join(losers)}:{observe}"
    return pytest.param(winner, losers, observe, marks=marks, id=label)


def _mode_cases(rule, winner, losers):
    """The rule's cases over its declared modes: ``winner`` against every lower level at once."""
    caps = sorted({CAP[winner], *(CAP[lv] for lv in losers)})
    return modes.params(rule, requires=lambda combo: [*caps, *modes.default_requires(combo)], extra=(winner, losers))


@pytest.mark.rule("LEVEL-PARTS-FIRST")
@pytest.mark.parametrize("combo,winner,losers", _mode_cases("LEVEL-PARTS-FIRST", "parts", ("single", "legacy", "shared")))
def test_parts_win_over_every_level_in_every_mode(loader, combo, winner, losers):
    _check_level_wins(loader, winner, losers, combo=combo)


@pytest.mark.rule("LEVEL-SINGLE-SECOND")
@pytest.mark.parametrize("combo,winner,losers", _mode_cases("LEVEL-SINGLE-SECOND", "single", ("legacy", "shared")))
def test_single_file_wins_without_parts_in_every_mode(loader, combo, winner, losers):
    _check_level_wins(loader, winner, losers, combo=combo)


@pytest.mark.rule("LEVEL-LEGACY-THIRD")
@pytest.mark.parametrize("combo,winner,losers", _mode_cases("LEVEL-LEGACY-THIRD", "legacy", ("shared",)))
def test_legacy_file_wins_without_parts_or_single_in_every_mode(loader, combo, winner, losers):
    _write_foreign_higher_levels(loader)
    _check_level_wins(loader, winner, losers, combo=combo)


@pytest.mark.rule("LEVEL-SHARED-LAST")
@pytest.mark.parametrize("combo,winner,losers", _mode_cases("LEVEL-SHARED-LAST", "shared", ()))
def test_shared_pickle_used_when_model_dir_has_nothing_in_every_mode(loader, combo, winner, losers):
    _write_foreign_higher_levels(loader)
    _check_level_wins(loader, winner, losers, combo=combo)


@pytest.mark.rule("LEVEL-PARTS-FIRST")
@pytest.mark.parametrize(
    "winner,losers,observe",
    [
        _case("parts", ("single",)),
        _case("parts", ("legacy",)),
        _case("parts", ("shared",)),
        _case("parts", ("single", "legacy", "shared")),
        _case("parts", ("single", "legacy", "shared"), "trace"),
    ],
)
def test_parts_win_over_every_level(loader, winner, losers, observe):
    _check_level_wins(loader, winner, losers, observe)


@pytest.mark.rule("LEVEL-SINGLE-SECOND")
@pytest.mark.parametrize(
    "winner,losers,observe",
    [
        _case("single", ("legacy",)),
        _case("single", ("shared",)),
        _case("single", ("legacy", "shared")),
        _case("single", ("legacy", "shared"), "trace"),
    ],
)
def test_single_file_wins_without_parts(loader, winner, losers, observe):
    _check_level_wins(loader, winner, losers, observe)


def _write_foreign_higher_levels(loader):
    """Other workers' parts and single files (rank 0, the CUDA ordinal, tp{rank}{id} concatenated):
    none is this worker's, so the legacy file must still be the one read."""
    decoy = M.state(SPEC, version=9)
    for rank, gpu in ((0, GPU), (RANK, 1), (RANK, 31), (23, GPU)):
        S.write_safetensors(S.single_path(loader.model_dir, rank, gpu), decoy)
        S.write_parts(loader.model_dir, rank, gpu, {0: decoy})
    S.write_safetensors(os.path.join(loader.model_dir, f"model_state.tp{RANK}{GPU}{S.PDPARAMS}"), decoy)
    S.write_legacy(loader.model_dir, 1, decoy)  # tp01: the ordinal's legacy file


@pytest.mark.rule("LEVEL-LEGACY-THIRD")
@pytest.mark.parametrize(
    "winner,losers,observe",
    [
        pytest.param("legacy", (), "values", marks=[pytest.mark.requires("snapshot.legacy"), pytest.mark.modes(call="first")],
                     id="legacy-beside-other-workers-files"),
        _case("legacy", ("shared",)),
        _case("legacy", ("shared",), "trace"),
    ],
)
def test_legacy_file_wins_without_parts_or_single(loader, winner, losers, observe):
    if not losers:
        _write_foreign_higher_levels(loader)
    _check_level_wins(loader, winner, losers, observe)


@pytest.mark.rule("LEVEL-SHARED-LAST")
@pytest.mark.requires("snapshot.shared_fallback")
@pytest.mark.modes(call="first")
@pytest.mark.parametrize(
    "others,observe",
    [
        pytest.param(False, "values", id="model-dir-empty"),
        # Other workers' files in model_dir are not this worker's: the fallback is still the one to use.
        pytest.param(True, "values", id="model-dir-holds-other-workers-files"),
        pytest.param(True, "trace", marks=TRACE, id="model-dir-holds-other-workers-files:trace"),
    ],
)
def test_shared_pickle_used_when_model_dir_has_nothing(loader, others, observe):
    if others:
        _write_foreign_higher_levels(loader)
    _check_level_wins(loader, "shared", (), observe)


def _claims_shared(loader) -> bool:
    # The shared directory is only written for implementations that read it from LoaderConfig;
    # the others (FastDeploy hard-codes /shared_ipc_meta) still have levels 1-3 checked.
    return "snapshot.shared_fallback" in loader.adapter.capabilities


@pytest.mark.rule("LEVEL-NONE-FOUND")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize(
    "layout,call",
    [
        pytest.param("empty", "first", id="nothing-anywhere"),
        pytest.param("other-ranks", "first", id="only-other-ranks-files"),
        pytest.param("invalid-parts", "first", id="only-invalid-part-names"),
        # After a healthy update and a clear, the trainer's files are gone: the next update finds nothing.
        pytest.param("empty", "second", id="nothing-anywhere:second-update"),
        pytest.param("other-ranks", "second", id="only-other-ranks-files:second-update"),
    ],
)
def test_no_snapshot_is_file_not_found_listing_checks(loader, layout, call):
    session = loader.open(SPEC, worker=WORKER)
    R.earlier_snapshot({"call": call}, session, SPEC, loader.model_dir, loader.shared_dir, rank=RANK, gpu_id=GPU)
    decoy = M.state(SPEC, version=9)
    if layout == "other-ranks":
        S.write_safetensors(S.single_path(loader.model_dir, 0, GPU), decoy)
        S.write_safetensors(S.single_path(loader.model_dir, 23, GPU), decoy)  # tp23.3: not tp2.3
        if _claims_shared(loader):
            S.write_pickle_fallback(S.fallback_path(loader.shared_dir, 0, GPU), decoy)
    elif layout == "invalid-parts":
        S.write_safetensors(os.path.join(loader.model_dir, f"{S.base_name(RANK, GPU)}.partx{S.PDPARAMS}"), decoy)
    base = S.base_name(RANK, GPU)
    with check.raises(
        FileNotFoundError,
        match=re.escape(f"No snapshot found for {base}"),
        names=[loader.model_dir] + ([_fallback_path(loader)] if _claims_shared(loader) else []),
        where=f"rank {RANK} gpu {GPU}, {layout}, {call} update of the session",
    ):
        session.update()


# -- LEVEL-CANDIDATE-NOT-FILE ---------------------------------------------------------------------
# Where the bad candidate sits, the levels it needs, and the lower level a fall-through would read.
_POSITIONS = {
    "single": (("snapshot.single", "snapshot.legacy"), "legacy"),
    "legacy": (("snapshot.legacy", "snapshot.shared_fallback"), "shared"),
    "part1-of-0-1-2": (("snapshot.parts", "snapshot.single"), "single"),
    "only-part": (("snapshot.parts", "snapshot.single"), "single"),
    "shared": (("snapshot.shared_fallback",), None),  # the lowest level: nothing to fall through to
}


def _candidate(loader, position, want):
    """Write the worker's good files for ``position`` except the candidate; return (candidate path,
    tensors the candidate should hold)."""
    if position == "single":
        return S.single_path(loader.model_dir, RANK, GPU), want
    if position == "legacy":
        return S.legacy_path(loader.model_dir, GPU), want
    if position == "only-part":
        return S.part_path(loader.model_dir, RANK, GPU, 0), want
    if position == "shared":
        return S.fallback_path(loader.shared_dir, RANK, GPU), want
    first, middle, last = S.split(want, 3)
    S.write_parts(loader.model_dir, RANK, GPU, {0: first, 2: last})
    return S.part_path(loader.model_dir, RANK, GPU, 1), middle


def _make(kind, path, tmp):
    if kind == "directory":
        os.mkdir(path)
    elif kind == "dangling-symlink":
        os.symlink(os.path.join(tmp, "written-by-a-dead-trainer.pdparams"), path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-to-dev-null":
        os.symlink(os.devnull, path)
    elif kind == "char-device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            os.symlink("/dev/zero", path)  # not root: a device all the same
    else:
        raise ValueError(kind)


def _remove(path):
    (os.rmdir if os.path.isdir(path) and not os.path.islink(path) else os.unlink)(path)


class _Watch:
    """Looks at the child refusing a candidate from the test process (``watch(pid)`` of
    ``harness.in_child``). Opening a FIFO for reading blocks until a writer comes, inside the
    implementation (safetensors opens it in Rust holding the GIL), so only another process can see it:
    a writer's non-blocking open succeeds while a reader has the FIFO open or waits in open(); it is
    recorded and closed at once, so that the reader sees end of file and the case goes on to its
    verdict instead of waiting out the deadline. A device read without end (``/dev/zero``) grows the
    child's memory: past RSS_CAP_MIB the child is killed and the case fails naming the device."""

    def __init__(self, path, kind, where):
        self.path, self.kind, self.where = path, kind, where
        self.opened, self._rss0 = False, None

    def __call__(self, pid):
        rss = rss_mib(pid)
        if self._rss0 is None:
            self._rss0 = rss
        if rss is not None and rss - self._rss0 > RSS_CAP_MIB:
            check.that(False, f"{self.where}: the update read {rss - self._rss0} MiB from {self.path} (a {self.kind}) "
                              f"and was killed; a candidate's kind must be checked without opening it (os.stat)")
        if self.kind != "fifo":
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
        except OSError:
            return
        try:  # (the child replaces the FIFO with a regular file once it has been refused)
            self.opened = self.opened or stat.S_ISFIFO(os.fstat(fd).st_mode)
        finally:
            os.close(fd)


RSS_CAP_MIB = 512  # the models here hold bytes; a loader that grows by this much reads without end
# A case that can block inside the implementation (a FIFO or device opened and read) runs in a forked
# child killed after this long: a hang fails the case naming it, never hangs the run.
BLOCK_DEADLINE_S = 10.0


_BAD_KINDS = {
    "single": ("directory", "dangling-symlink", "fifo", "symlink-to-dev-null", "char-device"),
    "legacy": ("directory", "dangling-symlink", "fifo"),
    "part1-of-0-1-2": ("directory", "dangling-symlink", "fifo"),
    "only-part": ("directory", "symlink-to-dev-null"),
    "shared": ("directory", "fifo"),
}


_PATH_OF = {"single": "single", "legacy": "legacy", "part1-of-0-1-2": "parts", "only-part": "parts", "shared": "shared"}


def _not_file_params():
    """Every bad kind at every position, plain; and a directory at every position, staged."""
    out = []
    for position, (caps, _lower) in _POSITIONS.items():
        for kind in (*_BAD_KINDS[position], "symlink-to-regular-file"):
            out.append(pytest.param(position, kind, False, id=f"{position}:{kind}",
                                    marks=[pytest.mark.requires(*caps), pytest.mark.modes(path=_PATH_OF[position])]))
        out.append(pytest.param(position, "directory", True, id=f"{position}:directory:staged",
                                marks=[pytest.mark.requires(*caps, "staged"), pytest.mark.modes(path=_PATH_OF[position])]))
    return out


@pytest.mark.rule("LEVEL-CANDIDATE-NOT-FILE")
@pytest.mark.parametrize("position,kind,staged", _not_file_params())
def test_candidate_that_is_not_a_regular_file_is_an_error(loader, tmp_path, position, kind, staged):
    """A candidate that exists but is no regular file is an error naming it, never a fall-through
    to the (stale) lower level written beside it; a symlink to a regular file loads. After the
    error, replacing the candidate with a real file, clear() and update() load it."""
    want = M.state(SPEC, version=1)
    path, content = _candidate(loader, position, want)
    lower = _POSITIONS[position][1]
    if lower:
        S.write_level(lower, loader.model_dir, loader.shared_dir, RANK, GPU, M.state(SPEC, version=7))  # stale
    where = f"{path} is a {kind}, stale {lower} level beside it" if lower else f"{path} (the lowest level) is a {kind}"
    if kind == "symlink-to-regular-file":
        write = S.write_pickle_fallback if position == "shared" else S.write_safetensors
        target = write(os.path.join(str(tmp_path), "store", "real.pdparams"), content)
        os.symlink(target, path)
        session = loader.open(SPEC, worker=WORKER, options={"staged": True} if staged else {})
        session.update()
        check.params_equal(session.observe(), want, f"{where}: the link's target must be loaded")
        return
    _make(kind, path, str(tmp_path))
    watch = _Watch(path, kind, where)
    try:  # in a forked child: the update may block inside the implementation (a FIFO, a device)
        in_child(_rejects_candidate_then_loads_it, loader, path, content, want, where, staged,
                 timeout_s=BLOCK_DEADLINE_S, watch=watch)
    except ChildTimedOut as e:
        check.that(False, f"{where}: the update blocked for {e.seconds:.1f}s (in {e.blocked_in or 'an unknown wait'}) "
                          f"opening or reading {path}, and was killed; a candidate's kind must be checked without "
                          "opening it (os.stat)")
    except ChildFailed as e:
        _check_fifo_not_opened(watch, where)  # the cause, when it is the cause
        if not e.child_error:  # (the child died)
            raise
        # The child's failure as this test's own (its first line is the case's verdict in the report).
        raise AssertionError(f"{e.child_error.removeprefix('AssertionError: ')}\n(in the forked child)\n"
                             f"{e.child_traceback}") from None
    _check_fifo_not_opened(watch, where)


def _check_fifo_not_opened(watch, where):
    if watch.kind == "fifo":
        check.that(not watch.opened, f"{where}: the loader opened the FIFO for reading (it blocks until a writer "
                                     "comes; the suite unblocked it from outside); a candidate's kind must be checked "
                                     "without opening it (os.stat)")


def _rejects_candidate_then_loads_it(loader, path, content, want, where, staged=False):
    """In the child: the update raises naming the candidate, loads nothing, is not NORMAL; after the
    candidate is replaced with a regular file, clear() and update() load it."""
    session = loader.open(SPEC, worker=WORKER, options={"staged": True} if staged else {})
    with check.raises((ValueError, OSError), match=re.escape(os.path.basename(path)), names=[path], where=where):
        session.update()
    check.not_loaded(session.observe(), NAMES, f"{where}: after the error")
    if "status" in loader.adapter.capabilities:
        check.status_not(session, "NORMAL", where)
    _remove(path)
    (S.write_pickle_fallback if os.path.dirname(path) == loader.shared_dir else S.write_safetensors)(path, content)
    session.clear()
    session.update()
    check.params_equal(session.observe(), want, f"{where}: after replacing it with a regular file, clear() and update()")
