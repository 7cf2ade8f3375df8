"""Rule ids come from SPEC.md: a rule is a level-3 heading ``### `AREA-...` title``."""
from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def spec_path() -> str:
    """The SPEC.md the suite reads: the installed package's own copy (the wheel's build copies it into
    ``conformance/``, setup.py), else the checkout's, at the repository root (its only copy there)."""
    for candidate in (os.path.join(_PACKAGE, "SPEC.md"), os.path.join(os.path.dirname(_PACKAGE), "SPEC.md")):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"SPEC.md: neither {os.path.join(_PACKAGE, 'SPEC.md')} (an installed suite) nor "
                            f"{os.path.join(os.path.dirname(_PACKAGE), 'SPEC.md')} (a checkout) exists")


SPEC_PATH = spec_path()
RULE_HEADING = re.compile(r"^###\s+`([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+)`\s+(.*)$")


@functools.lru_cache(maxsize=None)
def rules(path: str = SPEC_PATH) -> dict[str, str]:
    """rule id -> title, in document order; duplicate ids are an error."""
    found: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = RULE_HEADING.match(line.rstrip())
            if m:
                if m.group(1) in found:
                    raise ValueError(f"{path}: rule {m.group(1)} is defined twice")
                found[m.group(1)] = m.group(2)
    return found


def area(rule_id: str) -> str:
    return rule_id.split("-", 1)[0]


HEADING = re.compile(r"^#{1,6}\s")
PROVEN_BY = re.compile(r"^Proven by:\s*(.*)$")
AXES = ("boundaries", "paths", "faults", "aftermath")


@functools.lru_cache(maxsize=None)
def rule_bodies(path: str = SPEC_PATH) -> dict[str, str]:
    """rule id -> the text of its body: every line after its heading up to the next heading of any
    level (headings inside fenced code blocks do not count), stripped of surrounding blank lines."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    fenced = False
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and HEADING.match(line):
                m = RULE_HEADING.match(line.rstrip())
                current = bodies.setdefault(m.group(1), []) if m else None
                continue
            if current is not None:
                current.append(line)
    return {rule_id: "\n".join(lines).strip("\n") for rule_id, lines in bodies.items()}


class ProvenBy(NamedTuple):
    text: str  # the line after "Proven by:"
    axes: dict[str, str]  # axis -> its text ("" when absent or empty)
    order: tuple[str, ...]  # the axes in the order they were written (a repeated axis appears twice)
    last: bool  # nothing but blank lines follows the line in the body


def proven_by(body: str) -> list[ProvenBy]:
    """Every ``Proven by:`` line of a rule body, parsed. The form is one line,
    ``Proven by: boundaries: ...; paths: ...; faults: ...; aftermath: ....``. An axis's text runs up
    to the next ``; AXIS:`` (so it may itself contain semicolons); the final period is dropped."""
    lines = body.splitlines()
    found = []
    axis_mark = re.compile(r"(?:^|;\s*)(" + "|".join(AXES) + r"):")
    for i, line in enumerate(lines):
        m = PROVEN_BY.match(line.strip())
        if not m:
            continue
        text = m.group(1).strip()
        axes = {axis: "" for axis in AXES}
        marks = list(axis_mark.finditer(text))
        for k, mark in enumerate(marks):
            end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
            value = text[mark.end():end].strip()
            if k + 1 == len(marks):
                value = value.removesuffix(".").strip()
            axes[mark.group(1)] = (axes[mark.group(1)] + " | " + value) if axes[mark.group(1)] else value
        last = not any(rest.strip() for rest in lines[i + 1:])
        found.append(ProvenBy(text, axes, tuple(mark.group(1) for mark in marks), last))
    return found


# -- levels -----------------------------------------------------------------------------------------
LEVELS = ("contract", "hardening")
DEVICES = ("cpu", "gpu")
LEVEL_LINE = re.compile(r"^Level:\s*(\S+?)\.(?:\s+(.*))?$")
DEVICE_LINE = re.compile(r"^Device:\s*(\S+?)\.(?:\s+(.*))?$")


class RuleLevel(NamedTuple):
    level: str  # "contract" | "hardening"
    reason: str  # the sentence after "Level: LEVEL."
    device: str | None  # the device the effect shows on ("cpu" | "gpu"), None when not device-dependent
    device_reason: str  # the text after "Device: DEVICE." ("" without a Device line)


def _tagged(rule_id: str, line: str, pattern, what: str, allowed) -> tuple[str, str]:
    """(value, reason) of a ``Level:``/``Device:`` line; ValueError naming the rule when the line is
    malformed, its value unknown or its reason missing."""
    m = pattern.match(line)
    if not m:
        raise ValueError(f"SPEC rule {rule_id}: malformed {what} line {line!r}; "
                         f"expected '{what.capitalize()}: {'|'.join(allowed)}. <why>'")
    value, reason = m.group(1), (m.group(2) or "").strip()
    if value not in allowed:
        raise ValueError(f"SPEC rule {rule_id}: unknown {what} {value!r} in {line!r}; expected one of {list(allowed)}")
    if not reason:
        raise ValueError(f"SPEC rule {rule_id}: the {what} line {line!r} gives no reason after the {what}")
    return value, reason


def parse_level(rule_id: str, body: str) -> RuleLevel:
    """A rule body's ``Level:`` line (its first non-blank line: ``Level: contract|hardening. WHY``)
    and the optional ``Device: cpu|gpu. WHY`` line right after it. ValueError naming the rule when
    the Level line is missing, not first, repeated, of an unknown level or without a reason, or a
    Device line is anywhere else, repeated, of an unknown device or without a reason."""
    lines = [line.strip() for line in body.splitlines()]
    nonblank = [(i, line) for i, line in enumerate(lines) if line]
    level_at = [i for i, line in nonblank if line.startswith("Level:")]
    device_at = [i for i, line in nonblank if line.startswith("Device:")]
    if not level_at:
        raise ValueError(f"SPEC rule {rule_id}: no 'Level: contract|hardening. <why>' line "
                         "(it must be the first line of the rule's body)")
    if len(level_at) > 1:
        raise ValueError(f"SPEC rule {rule_id}: {len(level_at)} 'Level:' lines; exactly one is allowed")
    first = nonblank[0][0]
    if level_at[0] != first:
        raise ValueError(f"SPEC rule {rule_id}: the 'Level:' line must be the first line of the rule's body")
    level, reason = _tagged(rule_id, lines[first], LEVEL_LINE, "level", LEVELS)
    device, device_reason = None, ""
    if device_at:
        if len(device_at) > 1:
            raise ValueError(f"SPEC rule {rule_id}: {len(device_at)} 'Device:' lines; at most one is allowed")
        if len(nonblank) < 2 or device_at[0] != nonblank[1][0] or device_at[0] != first + 1:
            raise ValueError(f"SPEC rule {rule_id}: the 'Device:' line must come right after the 'Level:' line")
        device, device_reason = _tagged(rule_id, lines[device_at[0]], DEVICE_LINE, "device", DEVICES)
    return RuleLevel(level, reason, device, device_reason)


@functools.lru_cache(maxsize=None)
def rule_levels(path: str = SPEC_PATH) -> dict[str, RuleLevel]:
    """rule id -> its RuleLevel, for every rule of SPEC.md, in document order; ValueError naming the
    first rule whose Level or Device line is missing or malformed."""
    return {rule_id: parse_level(rule_id, body) for rule_id, body in rule_bodies(path).items()}


@functools.lru_cache(maxsize=None)
def levels(path: str = SPEC_PATH) -> dict[str, str]:
    """rule id -> "contract" | "hardening"."""
    return {rule_id: r.level for rule_id, r in rule_levels(path).items()}


@functools.lru_cache(maxsize=None)
def level_reasons(path: str = SPEC_PATH) -> dict[str, str]:
    """rule id -> the reason given for its level."""
    return {rule_id: r.reason for rule_id, r in rule_levels(path).items()}


@functools.lru_cache(maxsize=None)
def devices(path: str = SPEC_PATH) -> dict[str, str]:
    """rule id -> the device its effect shows on ("cpu" | "gpu"), only for rules with a Device line."""
    return {rule_id: r.device for rule_id, r in rule_levels(path).items() if r.device is not None}
