"""Assertion helpers for conformance tests. Each call counts as a check (see the vacuity guard).

Messages name the rule context (``where``), the tensor, and both values.
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
    from fixtures.models import NUMPY_DTYPES

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


@contextlib.contextmanager
def raises(exc_type, *, match: str, names: Iterable[str] = (), where: str = ""):
    """Expect ``exc_type`` whose message matches ``match`` (anchored search, never empty) and
    mentions every string in ``names`` (file, tensor, rank or field at fault)."""
    _count()
    if not match or re.fullmatch(match, "") is not None:
        raise ValueError(f"check.raises: pattern {match!r} matches the empty string; it could never fail")
    with pytest.raises(exc_type) as info:
        yield info
    message = str(info.value)
    assert re.search(match, message), f"{where}: {type(info.value).__name__} message {message!r} does not match {match!r}"
    missing = [n for n in names if str(n) not in message]
    assert not missing, f"{where}: error message {message!r} does not name {missing}"


def that(condition: bool, message: str) -> None:
    """Generic check: ``message`` must name the path, tensor/field and both values."""
    _count()
    assert condition, message


def equal(got, expected, where: str) -> None:
    _count()
    assert got == expected, f"{where}: got {got!r}, expected {expected!r}"
