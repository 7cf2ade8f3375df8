"""Rule ids come from SPEC.md: a rule is a level-3 heading ``### `AREA-...` title``."""
from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

SPEC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "SPEC.md")
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
