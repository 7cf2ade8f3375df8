"""Assertion helpers for conformance tests. Each call counts as a check (see the vacuity guard).

Messages name the rule context (``where``), the tensor, and both values. PYTEST_DONT_REWRITE: installed, pytest
would rewrite this module's asserts (it rewrites every module of a distribution with a pytest11 entry point) and
add its own introspection to each message; the report then said something else than a checkout's run.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping

import numpy as np
import pytest

from .adapter import Observed

_counter = {"checks": 0}


def _count() -> None:
    _counter["checks"] += 1


def reset() -> None:
    _counter["checks"] = 0


def count() -> int:
    return _counter["checks"]


def _show(dtype: str, shape, data: bytes | None, limit: int = 6) -> str:
    if data is None:
        return "<not loaded>"
    from weightsync.fixtures.models import NUMPY_DTYPES

    arr = np.frombuffer(data, dtype=NUMPY_DTYPES[dtype]) if dtype in NUMPY_DTYPES else np.frombuffer(data, np.uint8)
    head = ", ".join(str(v) for v in arr[:limit].tolist())
    return f"[{head}{', ...' if arr.size > limit else ''}] ({arr.size} elements)"


def params_equal(observed: Mapping[str, Observed], expected: Mapping[str, np.ndarray], where: str) -> None:
    """Every expected tensor is loaded with the same dtype, shape and bytes."""
    _count()
    problems = []
    for name, want in expected.items():
        got = observed.get(name)
        want_dtype = want.dtype.name
        if got is None:
            problems.append(f"{name}: not a parameter of the model (expected {want_dtype}{list(want.shape)})")
            continue
        if got.dtype != want_dtype or tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: got {got.dtype}{list(got.shape)}, expected {want_dtype}{list(want.shape)}")
            continue
        want_bytes = np.ascontiguousarray(want).tobytes()
        if got.data != want_bytes:
            first = _first_difference(got.data, want_bytes, want.dtype.itemsize)
            problems.append(
                f"{name}: values differ{first}: got {_show(got.dtype, got.shape, got.data)}, "
                f"expected {_show(want_dtype, want.shape, want_bytes)}"
            )
    if problems:
        pytest.fail(f"{where}: {len(problems)} tensor(s) wrong:\n  " + "\n  ".join(problems), pytrace=False)


def _first_difference(got: bytes | None, want: bytes, itemsize: int) -> str:
    if got is None or len(got) != len(want):
        return ""
    for i in range(0, len(want), max(itemsize, 1)):
        if got[i : i + itemsize] != want[i : i + itemsize]:
            return f" (first at element {i // max(itemsize, 1)})"
    return ""


def not_loaded(observed: Mapping[str, Observed], names: Iterable[str], where: str) -> None:
    _count()
    loaded = [n for n in names if observed[n].data is not None and observed[n].data != b""]
    assert not loaded, f"{where}: expected not loaded after the failed update, but loaded: {loaded}"


def unchanged(before: Mapping[str, Observed], after: Mapping[str, Observed], where: str) -> None:
    _count()
    changed = [n for n in before if before[n] != after.get(n)]
    assert not changed, f"{where}: parameters changed although the update was rejected: {changed}"


def labels(trace, expected: list[str], where: str) -> None:
    _count()
    got = [e.label for e in trace]
    assert got == expected, f"{where}: load order by label: got {got}, expected {expected}"


def sources(trace, expected: list[str], where: str) -> None:
    _count()
    import os

    got = [os.path.basename(e.source) if e.source else None for e in trace]
    assert got == expected, f"{where}: sources applied in order: got {got}, expected {expected}"


def status_is(session, expected: str, where: str) -> None:
    _count()
    got = session.status()
    assert got == expected, f"{where}: status got {got}, expected {expected}"


def status_not(session, forbidden: str, where: str) -> None:
    _count()
    got = session.status()
    assert got != forbidden, f"{where}: status is {got} after a failed update; it must not be {forbidden}"


def _type_names(exc_type) -> str:
    types = exc_type if isinstance(exc_type, tuple) else (exc_type,)
    return " or ".join(t.__name__ for t in types)


def _expected(exc_type, match: str | None, names) -> str:
    text = _type_names(exc_type)
    if match is not None:
        text += f" with a message matching {match!r}"
    if names:
        text += f"{' and' if match is not None else ' with a message'} naming {list(map(str, names))}"
    return text


@contextlib.contextmanager
def _expect(exc_type, where: str, expected: str):
    """Yield an ExceptionInfo filled with the ``exc_type`` the block raises. Nothing raised, or an
    exception of another type, fails naming the case (``where``) and what was expected: pytest's
    own "DID NOT RAISE ValueError" names neither."""
    if not where or not str(where).strip():
        raise ValueError("check: where= must name the case (file, tensor, rank or field); a failure would name nothing")
    info = pytest.ExceptionInfo.for_later()
    try:
        yield info
    except exc_type as e:
        info.fill_unfilled((type(e), e, e.__traceback__))
    except Exception as e:
        raise AssertionError(f"{where}: expected {expected}; got {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"{where}: expected {expected}; nothing was raised (DID NOT RAISE)")


@contextlib.contextmanager
def raises(exc_type, *, match: str, names: Iterable[str] = (), where: str):
    """Expect ``exc_type`` whose message matches ``match`` (anchored search, never empty) and
    mentions every string in ``names`` (file, tensor, rank or field at fault). ``where`` names the
    case: a failure (nothing raised, another type, another message) says it and what was expected."""
    _count()
    if not match or re.fullmatch(match, "") is not None:
        raise ValueError(f"check.raises: pattern {match!r} matches the empty string; it could never fail")
    names = list(names)
    with _expect(exc_type, where, _expected(exc_type, match, names)) as info:
        yield info
    message = str(info.value)
    assert re.search(match, message), f"{where}: {type(info.value).__name__} message {message!r} does not match {match!r}"
    missing = [n for n in names if str(n) not in message]
    assert not missing, f"{where}: error message {message!r} does not name {missing}"


@contextlib.contextmanager
def refused(exc_type, *, where: str):
    """Expect any exception of ``exc_type`` (a type or a tuple), message unchecked: for a step whose
    refusal is not itself the rule (the rule checks the aftermath). A failure names the case."""
    _count()
    with _expect(exc_type, where, _expected(exc_type, None, ())) as info:
        yield info


def that(condition: bool, message: str) -> None:
    """Generic check: ``message`` must name the path, tensor/field and both values."""
    _count()
    assert condition, message


def equal(got, expected, where: str) -> None:
    _count()
    assert got == expected, f"{where}: got {got!r}, expected {expected!r}"


# -- resources and status (aftermath checks) -------------------------------------------------------
def _targets(paths_or_dir) -> list[tuple[str, bool]]:
    """(real path, is a directory) for a path or an iterable of paths."""
    import os

    if isinstance(paths_or_dir, (str, bytes, os.PathLike)):
        paths_or_dir = [paths_or_dir]
    out = []
    for p in paths_or_dir:
        p = os.fsdecode(os.fspath(p))
        real = os.path.realpath(p)
        out.append((real.rstrip(os.sep) or os.sep, os.path.isdir(real)))
    return out


def _matches(path: str, targets) -> bool:
    import os

    path = path.removesuffix(" (deleted)")
    for target, is_dir in targets:
        if path == target or (is_dir and path.startswith(target + os.sep)):
            return True
    return False


def open_files_under(paths_or_dir, *, collect_garbage: bool = True) -> list[str]:
    """What this process holds of the given files, or of anything under the given directories:
    ``fd N -> path`` for each open descriptor (``/proc/self/fd``) and ``mapped START-END path``
    for each mapping (``/proc/self/maps``); a deleted file still held counts (``path (deleted)``).
    Not a check by itself (see ``no_open_files``). With ``collect_garbage`` the cyclic garbage
    collector runs first, so a file object only the test's own tracebacks keep alive is not reported."""
    import gc
    import os

    if collect_garbage:
        gc.collect()
    targets = _targets(paths_or_dir)
    held = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if _matches(link, targets):
            held.append(f"fd {fd} -> {link}")
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and _matches(fields[5], targets):
                held.append(f"mapped {fields[0]} {fields[5]}")
    return held


def no_open_files(paths_or_dir, where: str, *, collect_garbage: bool = True) -> None:
    """Nothing under ``paths_or_dir`` (a file, a directory, or an iterable of them) is open in
    ``/proc/self/fd`` or mapped in ``/proc/self/maps``: the loader released every snapshot file."""
    _count()
    held = open_files_under(paths_or_dir, collect_garbage=collect_garbage)
    assert not held, f"{where}: the process still holds {len(held)} descriptor(s)/mapping(s) of the files: {held}"


def live_threads() -> dict[int, str]:
    """ident -> name of every live Python thread (pass the result to ``no_new_threads``)."""
    import threading

    return {t.ident: t.name for t in threading.enumerate() if t.is_alive()}


def no_new_threads(before, where: str, grace_s: float = 1.0) -> None:
    """No Python thread is alive that was not alive in ``before`` (``live_threads()`` taken before
    the session was opened, or any iterable of ``threading.Thread`` objects or idents). Threads that
    end within ``grace_s`` seconds (a worker finishing its last step after ``close()``) are allowed."""
    import threading
    import time

    _count()
    if isinstance(before, Mapping):
        known = set(before)
    else:
        known = {t.ident if isinstance(t, threading.Thread) else int(t) for t in before}
    deadline = time.monotonic() + grace_s
    while True:
        new = [t for t in threading.enumerate() if t.is_alive() and t.ident not in known]
        if not new or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    described = [f"{t.name} (daemon={t.daemon})" for t in new]
    assert not new, f"{where}: {len(new)} thread(s) left running {grace_s}s after the session was done: {described}"


def shm_entries(directory: str = "/dev/shm") -> set[str]:
    """Names in the shared-memory directory (pass the result to ``no_new_shm``)."""
    import os

    try:
        return set(os.listdir(directory))
    except FileNotFoundError:
        return set()


def no_new_shm(before: Iterable[str], where: str, directory: str = "/dev/shm") -> None:
    """No shared-memory segment exists that did not exist in ``before`` (``shm_entries()``)."""
    _count()
    new = sorted(shm_entries(directory) - set(before))
    assert not new, f"{where}: shared-memory segment(s) left in {directory}: {new}"


def is_status(session, allowed, where: str) -> None:
    """``session.status()`` is one of ``allowed`` (a set of status names, e.g. ``{"CLEARED", "UPDATING"}``)."""
    _count()
    allowed = {allowed} if isinstance(allowed, str) else set(allowed)
    got = session.status()
    assert got in allowed, f"{where}: status got {got}, expected one of {sorted(allowed)}"
