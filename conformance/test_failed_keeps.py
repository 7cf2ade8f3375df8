"""After a failed update, everything the loader reports still describes the weights it had: the version, the
digest and the status, judged together, on every path and at every phase of the failure, then the recovery.
Spec: SPEC.md § LIFE (LIFE-FAILED-KEEPS-OLD). Origins: slime #2104, ms-swift #10098, TRL PR #5932 (a failed
weight update swallowed while the version moved on).

Each case: version 5 loads and commits; version 6 is published with one fault, at one phase:

* ``plan``: before the first tensor (a corrupt first file, a missing meta file, a bad first manifest, a
  stream broken before its first item);
* ``middle``: after some tensors landed (the middle tensor of the wrong dtype; on a snapshot in parts the
  parts before it have been applied);
* ``trainer-dies``: the trainer ends the stream after its first item or bucket (a break, an abort);
* ``end``: after the last data (the last parameter missing, found at the verification; a stream broken
  after its last item, before its end; a GDR stream that ends one item short).

Snapshot, ipc and buckets clear before each update (their contract); the streamed paths update in place.
The failed update must raise (the type its own rule names), and then: ``status()`` is not ``NORMAL``;
``version()`` is still the version committed last; ``digest()`` is the last committed weights' digest when
every parameter still holds them, else a ``RuntimeError``. Then a fixed version 7 without a version of
its own (no ``version.yaml``: the failed update's 6 must not be stamped on it; the bucket manifests always
carry one, 7) loads after ``clear()`` (where the path has one): every tensor, the digest, ``NORMAL``.
"""
from __future__ import annotations

import os
import pickle
import re

import numpy as np
import pytest
from safetensors import SafetensorError

from conformance import check, modes
from conformance.paths import ALL_PATHS, cases, route  # noqa: F401 (the fixture)
from weightsync.fixtures import digests as D
from weightsync.fixtures import ipc as I
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S
from weightsync.fixtures import status_cell as C
from weightsync.fixtures import streams as ST

# 1 KiB, 512 B and 8 B: in 1 KiB buckets (conformance.paths.BucketFeed) bucket 0 holds embed.weight alone, so
# bucket 1 comes after a tensor landed (and the middle tensor as float64, 1 KiB, has a bucket of its own)
MAIN = (("embed.weight", "float32", (16, 16)), ("model.layers.0.mlp.weight", "bfloat16", (16, 16)),
        ("norm.bias", "float16", (4,)))
MTP = (("model.layers.2.eh_proj.weight", "float32", (4, 4)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))
SPEC, SPEC_MTP = M.spec(*MAIN), M.spec(*MAIN, mtp=[MTP])
MTP_LAYER = 2  # the MTP model serves layer 2 (GDR routes model.layers.2.* to it)
OLD, FAILED, FIXED = 5, 6, 7  # versions: committed, failed, the fix (carried by buckets only)
SNAPSHOTS = ("parts", "single", "legacy", "shared")
STREAMS = ("rsync", "gdr", "gdr_ipc")
ALGS = ("xxh3", "md5")

# path -> the phases its faults reach (see the module's docstring)
PHASES = {
    **{p: ("plan", "middle", "end") for p in SNAPSHOTS},
    "ipc": ("plan", "middle", "end"),
    "bucket": ("plan", "middle", "trainer-dies", "end"),
    "rsync": ("plan", "middle", "trainer-dies", "end"),
    "gdr": ("plan", "middle", "trainer-dies", "end", "short"),
    "gdr_ipc": ("plan", "trainer-dies", "end"),
}
# (path, phase) also run with an MTP model, its tensor the one at fault where the phase has one
WITH_MTP = {("parts", "end"), ("single", "middle"), ("legacy", "end"), ("shared", "middle"), ("ipc", "middle"),
            ("bucket", "end"), ("rsync", "middle"), ("gdr", "trainer-dies"), ("gdr_ipc", "end")}


def _params():
    out = []
    for path, phases in PHASES.items():
        for phase in phases:
            out += _model(cases(phase, SPEC, paths=[path], id_suffix=f":{phase}"), "main")
            if (path, phase) in WITH_MTP:
                out += _model(cases(phase, SPEC_MTP, paths=[path], extra=("mtp",), id_suffix=f":{phase}:main+mtp"), "draft")
    return out


def _model(params, model: str):
    """The params with their ``model`` mode (conformance/modes.py): the tensor at fault is the draft model's
    in the cases with an MTP model (``_target``)."""
    return [pytest.param(*p.values, marks=[*p.marks, pytest.mark.modes(model=model)], id=p.id) for p in params]


def _state(spec, version: int) -> dict[str, np.ndarray]:
    return dict(sorted(M.state(spec, version=version).items()))


def _target(spec, phase: str) -> str:
    """The tensor at fault: the middle one in name order, the last one at the end; with an MTP model, an MTP
    tensor (the middle one's neighbour in name order, or the last MTP one)."""
    names = list(_state(spec, 1))
    mtp = [n for n in names if n in {p.name for m in spec.mtp for p in m}]
    if mtp:
        return mtp[0] if phase == "middle" else mtp[-1]
    return names[len(names) // 2] if phase == "middle" else names[-1]


def _version_dir(loader, path: str) -> str | None:
    """Where the path's trainer leaves ``version.yaml`` (SPEC § VER): beside the snapshot or the meta file."""
    return loader.model_dir if path in SNAPSHOTS else loader.shared_dir if path == "ipc" else None


def _publish(loader, rt, path: str, st: dict, version: int | None, phase: str | None = None, spec=SPEC):
    """Publish ``st`` as version ``version`` (None: no ``version.yaml``) with the fault of ``phase``; returns
    (where, ``check.raises`` context for the failure SPEC.md names for it, or None)."""
    st = dict(st)
    layout, target, n = None, None, len(st)
    if phase in ("middle", "end"):
        target = _target(spec, phase)
    elif phase == "short":
        target = list(st)[-1]  # the item the stream leaves out
    if phase == "middle":
        st[target] = st[target].astype(np.float64)  # the wrong dtype
    elif phase == "end" and path not in STREAMS:
        del st[target]  # missing: found at the verification
    if path == "parts":  # in name order: the first tensor alone in part 0; in the middle phase the last alone too,
        names = list(st)  # the bad tensor in the middle part, after part 0 landed
        layout = [names[:1], names[1:-1], names[-1:]] if phase == "middle" else [names[:1], names[1:]]
    elif path == "bucket":
        fault = {"plan": ("dtype", 0), "trainer-dies": ("abort", 1)}.get(phase)
        if fault == ("dtype", 0):
            layout = lambda update: update.buckets[0]["entries"][0].update(dtype="complex64")  # noqa: E731
        elif fault is not None:
            layout = lambda update: setattr(update, "fault", fault)  # noqa: E731
    elif path in STREAMS:
        layout = {"plan": ("fail", 0), "trainer-dies": ("fail", 1), "end": ("fail", n), "short": ("end", n - 1)}.get(phase)
    where = rt.publish(0, st, version if version is not None else FIXED, layout)
    directory = _version_dir(loader, path)
    if directory is not None:
        if version is not None:
            C.write_version(directory, version)
        elif os.path.exists(os.path.join(directory, "version.yaml")):
            os.remove(os.path.join(directory, "version.yaml"))
    if phase is None:
        return where, None
    if phase == "plan" and path in SNAPSHOTS:
        first = rt.feed.written[0][0]
        if S.writes_pickle(path):
            with open(first, "r+b") as f:
                f.write(b"\x80\x02not a pickle at all")
        else:
            S.corrupt_header(first)
        name = os.path.basename(first)  # FILE-CORRUPT-HEADER, or the format library's own refusal
        return f"{where}, {name} corrupt", check.raises((ValueError, SafetensorError, pickle.UnpicklingError),
                                                        match=rf"{re.escape(name)}|(?i:header|pickle)", where=where)
    if phase == "plan" and path == "ipc":
        meta = I.meta_path(loader.shared_dir, 0)
        os.remove(meta)  # IPC-META-MISSING
        return f"{where}, its meta file removed", check.raises(FileNotFoundError, match=re.escape(meta), where=where)
    if phase == "plan" and path == "bucket":  # BKT-DTYPE-UNKNOWN
        first = next(iter(st))
        return f"{where}, bucket 0 announcing {first} as complex64", check.raises(
            ValueError, match=re.escape(first), where=where)
    if phase == "trainer-dies" and path == "bucket":  # BKT-ABORT: at once, naming the bucket awaited
        return f"{where}, the trainer aborting instead of bucket 1", check.raises(
            Exception, match=r"bucket 1\b", where=where)
    if phase in ("plan", "trainer-dies", "end") and path in STREAMS:  # RSYNC-FAULTS, GDR-RECEIVER-ERROR
        return f"{where}", check.raises(ConnectionError, match=r"\S", where=where)
    if phase == "short":  # GDR-SHORT-STREAM: naming what it lacked (judged here only when it fails: below)
        return where, check.raises(RuntimeError, match=re.escape(target), where=where)
    if phase == "end":  # APPLY-MISSING-FAILS, or FastDeploy's words (fd-spec §2.7)
        return f"{where} without {target}", check.raises(
            RuntimeError, match=rf"verification failed|{re.escape(target)}", where=where)
    where = f"{where}, {target} as float64"
    if path == "rsync":  # RSYNC-VALIDATE-ALL: FastDeploy's words (the keys at fault are logged)
        return where, check.raises(ValueError, match=r"Invalid new_state_dict", where=where)
    return where, check.raises(TypeError, match=re.escape(target), where=where)  # APPLY-DTYPE-MISMATCH


def _holds(observed, st) -> bool:
    """Whether every parameter holds ``st`` bit for bit."""
    return all(
        (got := observed.get(name)) is not None and got.data is not None and got.dtype == want.dtype.name
        and tuple(got.shape) == tuple(want.shape) and got.data == np.ascontiguousarray(want).tobytes()
        for name, want in st.items())


def _digest_is(session, st, where: str) -> None:
    want = D.model(st)
    got = session.digest()
    wrong = [alg for alg in ALGS if not isinstance(got, dict) or got.get("model", {}).get(alg) != want["model"][alg]]
    check.that(not wrong, f"{where}: digest() model {[got.get('model') if isinstance(got, dict) else got]}, expected "
                          f"{want['model']} (the digest of the weights the parameters hold)")


def _judge_digest(session, old, new, where: str) -> None:
    """The last committed weights' digest while every parameter still holds them; else a RuntimeError: never
    the digest of the failed update's weights, of its announcement, or of a mix it left."""
    if _holds(session.observe(), old):
        _digest_is(session, old, f"{where}: every parameter still holds version {OLD}")
        return
    try:
        got = session.digest()
    except RuntimeError:
        return
    except Exception as e:  # noqa: BLE001 (judged)
        pytest.fail(f"{where}: digest() raised {type(e).__name__} {e}; expected a RuntimeError", pytrace=False)
    names = {D.model(new)["model"][ALGS[0]]: f"version {FAILED}'s (the failed update's)",
             D.model(old)["model"][ALGS[0]]: f"version {OLD}'s, which the parameters no longer hold"}
    said = names.get((got.get("model") or {}).get(ALGS[0]) if isinstance(got, dict) else None, "another")
    pytest.fail(f"{where}: the parameters no longer hold version {OLD}, yet digest() returned a model digest "
                f"({said}: {got.get('model') if isinstance(got, dict) else got}); expected a RuntimeError", pytrace=False)


def _outcome(rt) -> Exception | None:
    """The update's error, or None when it returned."""
    try:
        rt.update(0)
    except Exception as e:  # noqa: BLE001 (judged by the caller, re-raised inside its check.raises)
        return e
    return None


@pytest.mark.rule("LIFE-FAILED-KEEPS-OLD")
@pytest.mark.parametrize("path,phase,spec", _params())
def test_failed_update_reports_the_old_weights(route, loader, path, phase, spec):
    caps = loader.adapter.capabilities
    rt = route(path)
    session = rt.open(spec)
    ST.mark_mtp_layers(session.models, MTP_LAYER)
    old, new, fixed = _state(spec, OLD), _state(spec, FAILED), _state(spec, FIXED)
    where, _ = _publish(loader, rt, path, old, OLD, spec=spec)
    rt.update(0)
    check.params_equal(session.observe(), old, f"{path}: the first load ({where})")
    committed = session.version() if "version" in caps else None
    if "version" in caps and path not in STREAMS:  # (a stream's version is the session's option)
        check.equal(committed, OLD, f"{path}: version() after the first load ({where})")

    rt.clear(0)
    bad, refusal = _publish(loader, rt, path, new, FAILED, phase, spec)
    at = f"{path}: after the update to version {FAILED} failed at {phase} ({bad})"
    error = _outcome(rt)
    if error is None and phase == "short":
        return  # accepting a stream that ended early is GDR-SHORT-STREAM's to judge (hardening): no failure here
    with refusal:
        if error is not None:
            raise error
    if "status" in caps:
        check.status_not(session, "NORMAL", at)
    if "version" in caps:
        check.equal(session.version(), committed, f"{at}: version()")
    if "digest.model" in caps:
        _judge_digest(session, old, new, at)

    # The fix carries no version of its own (buckets: 7): the failed update's version is never stamped on it.
    fix, _ = _publish(loader, rt, path, fixed, FIXED if path == "bucket" else None, spec=spec)
    rt.clear(0)
    rt.update(0)
    at = f"{path}: the fixed update ({fix}) after version {FAILED} failed at {phase}"
    check.params_equal(session.observe(), fixed, at)
    if "status" in caps:
        check.status_is(session, "NORMAL", at)
    if "version" in caps:
        check.equal(session.version(), FIXED if path == "bucket" else committed, f"{at}: version()")
    if "digest.model" in caps:
        _digest_is(session, fixed, at)


# -- failures in a row (LIFE-FAILED-TWICE) -------------------------------------------------------------------------
TWICE = "LIFE-FAILED-TWICE"
POINTS = ("before-first", "mid", "after-last")
CALLS = ("first", "second", "third")
IN_ROW = (6, 7, 8)  # the versions of the failed updates, in order
TWICE_FIXED = 9  # the fix's version on buckets (their manifests always carry one)
VERSIONED = SNAPSHOTS + ("ipc",)  # the paths whose updates may carry no version (version.yaml beside the source)


def _twice_requires(combo) -> list[str]:
    return list(ALL_PATHS[combo["path"]].capabilities)


def _in_a_row(call: str, point: str) -> list[str]:
    """The failures of the row, the judged one (at ``point``) last. Second: after a failure at another point (in the
    middle, or before the first item when the judged one is in the middle: the reverse). Third: after one in the
    middle and one before the first item, so that every row of three holds a failure that changed parameters (in
    place on GDR) followed by one that moved nothing."""
    if call == "first":
        return [point]
    if call == "second":
        return ["before-first" if point == "mid" else "mid", point]
    return ["mid", "before-first", point]


@pytest.mark.rule("LIFE-FAILED-TWICE")
@pytest.mark.parametrize("combo", modes.params(TWICE, requires=_twice_requires))
def test_failures_in_a_row_report_the_old_weights(route, loader, combo):
    path, call, point = combo["path"], combo["call"], combo["point"]
    caps = loader.adapter.capabilities
    rt = route(path)
    with C.Cell(C.NORMAL) as cell:
        # The cell is the channel of the paths the API clears and updates through it; the streamed paths update in
        # place at the engine's call (FastDeploy's /v1/update_weights), the cell untouched.
        watched = "status.cell" in caps and not ALL_PATHS[path].in_place
        session = rt.open(SPEC, options={"status_cell": cell.name} if watched else None)
        old = _state(SPEC, OLD)
        where, _ = _publish(loader, rt, path, old, OLD)
        rt.update(0)
        check.params_equal(session.observe(), old, f"{path}: the first load ({where})")
        committed = session.version() if "version" in caps else None
        row = _in_a_row(call, point)
        for i, (at_point, version) in enumerate(zip(row, IN_ROW)):
            rt.clear(0)
            if watched:
                cell.write(C.UPDATING)  # the API's request
            new = _state(SPEC, version)
            phase = {"before-first": "plan", "mid": "middle", "after-last": "end"}[at_point]
            # After an earlier failure, the one before the first item carries no version (no version.yaml): what the
            # worker reports must not come from the earlier failed update's announcement.
            carried = None if at_point == "before-first" and i > 0 and path in VERSIONED else version
            bad, refusal = _publish(loader, rt, path, new, carried, phase)
            if carried is None:
                bad += " (no version.yaml)"
            at = (f"{path}: failure {i + 1} of {len(row)} in a row after version {OLD} committed "
                  f"({', '.join(row[:i + 1])}): {bad}")
            error = _outcome(rt)
            with refusal:
                if error is not None:
                    raise error
            if "status" in caps:
                check.status_not(session, "NORMAL", at)
            if watched:
                check.that(cell.read() != C.NORMAL, f"{at}: the cell reads NORMAL after the failed update")
            if "version" in caps:
                check.equal(session.version(), committed, f"{at}: version()")
            if "digest.model" in caps:
                _judge_digest(session, old, new, at)

        fixed = _state(SPEC, FIXED)
        fix, _ = _publish(loader, rt, path, fixed, TWICE_FIXED if path == "bucket" else None)
        rt.clear(0)
        if watched:
            cell.write(C.UPDATING)
        rt.update(0)
        at = f"{path}: the fixed update ({fix}) after {len(row)} failure(s) in a row ({', '.join(row)})"
        check.params_equal(session.observe(), fixed, at)
        if "status" in caps:
            check.status_is(session, "NORMAL", at)
        if watched:
            check.equal(C.name_of(cell.read()), "NORMAL", f"{at}: the cell (rank 0's NORMAL after the commit)")
        if "version" in caps:
            check.equal(session.version(), TWICE_FIXED if path == "bucket" else committed, f"{at}: version()")
        if "digest.model" in caps:
            _digest_is(session, fixed, at)
