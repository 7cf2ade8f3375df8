"""SPEC.md's own shape (a project test, not a conformance test): every rule says how it is proven.

Each rule's body carries exactly one line, its last,
``Proven by: boundaries: ...; paths: ...; faults: ...; aftermath: ....`` with all four axes, in that
order, non-empty (``n/a (reason)`` where an axis does not apply; see docs/testing-guide.md §8), and
cites its origin. Every rule is cited by a conformance test, and every rule a test cites exists.
Every rule's first line is ``Level: contract|hardening. <why>``, optionally followed right away by
``Device: cpu|gpu. <why>`` (see SPEC.md § Levels); ``conformance.spec.levels()`` parses them and fails
loudly on a missing or malformed one.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

from conformance.spec import (AXES, DEVICES, HEADING, LEVELS, RULE_HEADING, SPEC_PATH, devices, level_reasons, levels,
                               proven_by, rule_bodies, rule_levels, rules)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFORMANCE = os.path.join(REPO, "conformance")
BARE_NA = re.compile(r"n/?a\W*", re.IGNORECASE)
GOOD_LINE = ("Proven by: boundaries: 0-d and one past the end; paths: parts, single; "
             "faults: n/a (no other process); aftermath: status not NORMAL, files closed.")


def proven_by_problems(path: str) -> list[str]:
    """One line per rule whose ``Proven by:`` line is missing, repeated or malformed."""
    problems = []
    for rule_id, body in rule_bodies(path).items():
        found = proven_by(body)
        if not found:
            problems.append(f"{rule_id}: no 'Proven by: boundaries: ...; paths: ...; faults: ...; aftermath: ....' line")
            continue
        if len(found) > 1:
            problems.append(f"{rule_id}: {len(found)} 'Proven by:' lines; exactly one is allowed")
        line = found[0]
        if line.order != AXES:
            problems.append(f"{rule_id}: axes written as {list(line.order)}; expected exactly {list(AXES)} in that order")
        empty = [axis for axis in AXES if not line.axes[axis]]
        if empty:
            problems.append(f"{rule_id}: empty axis {empty} (write 'n/a (reason)' where an axis does not apply)")
        bare = [axis for axis in AXES if line.axes[axis] and BARE_NA.fullmatch(line.axes[axis])]
        if bare:
            problems.append(f"{rule_id}: axis {bare} says n/a without a reason; write 'n/a (reason)'")
        if not line.text.rstrip().endswith("."):
            problems.append(f"{rule_id}: the 'Proven by:' line must end with a period")
        if not line.last:
            problems.append(f"{rule_id}: the 'Proven by:' line must be the last line of the rule's body, all on one line")
    return problems


def with_proven_by_lines(src: str, dst: str, line: str = GOOD_LINE) -> None:
    """Copy SPEC.md to ``dst`` with ``line`` as the last line of every rule's body (a ``Proven by:``
    line already there is replaced)."""
    from conformance.spec import PROVEN_BY

    with open(src, encoding="utf-8") as f:
        lines = f.read().splitlines()
    out: list[str] = []
    in_rule = False
    fenced = False

    def close_rule():
        if in_rule:
            end = len(out)
            while end and not out[end - 1].strip():
                end -= 1
            out.insert(end, line)

    for text in lines:
        if text.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and HEADING.match(text):
            close_rule()
            in_rule = RULE_HEADING.match(text.rstrip()) is not None
        elif in_rule and not fenced and PROVEN_BY.match(text.strip()):
            continue
        out.append(text)
    close_rule()
    with open(dst, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def cited_rules() -> dict[str, list[str]]:
    """rule id -> the conformance test functions citing it (read statically from conformance/test_*.py)."""
    cited: dict[str, list[str]] = {}
    for name in sorted(os.listdir(CONFORMANCE)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        with open(os.path.join(CONFORMANCE, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "rule" and isinstance(node.args[0], ast.Constant):
                owner = f"{name}:{getattr(node, 'lineno', '?')}"
                cited.setdefault(str(node.args[0].value), []).append(owner)
    return cited


# -- SPEC.md as it is ------------------------------------------------------------------------------
def test_every_rule_has_one_proven_by_line_with_four_axes():
    problems = proven_by_problems(SPEC_PATH)
    assert not problems, f"{len(problems)} problem(s) in SPEC.md:\n  " + "\n  ".join(problems)


def test_every_rule_has_a_body_citing_its_origin():
    bodies = rule_bodies()
    assert list(bodies) == list(rules()), "rule_bodies() and rules() disagree on the rules of SPEC.md"
    missing = [rule_id for rule_id, body in bodies.items() if "Origin" not in body]
    assert not missing, f"rules citing no origin ('Origin: ...'): {missing}"


def test_every_cited_rule_exists_and_every_rule_is_cited():
    cited = cited_rules()
    unknown = {rule_id: where for rule_id, where in cited.items() if rule_id not in rules()}
    assert not unknown, f"conformance tests cite rules not defined in SPEC.md: {unknown}"
    untested = [rule_id for rule_id in rules() if rule_id not in cited]
    assert not untested, f"rules of SPEC.md no conformance test cites: {untested}"


# -- the checker itself ---------------------------------------------------------------------------
def test_spec_with_a_line_for_every_rule_passes(tmp_path):
    """A copy of SPEC.md in which every rule ends with a well-formed line has no problem: the
    checker above fails only on lines missing or malformed, never on SPEC.md's own layout."""
    copy = tmp_path / "SPEC.md"
    with_proven_by_lines(SPEC_PATH, str(copy))
    assert proven_by_problems(str(copy)) == []
    assert list(rule_bodies(str(copy))) == list(rules())
    assert all(body.endswith(GOOD_LINE) for body in rule_bodies(str(copy)).values())


def _one_rule(tmp_path, body: str) -> list[str]:
    path = tmp_path / "SPEC.md"
    path.write_text("# Rules\n\n## Area (`X`)\n\n### `X-ONE` a rule\nText. Origin: here.\n" + body +
                    "\n\n### `X-TWO` another\nOrigin: there.\n" + GOOD_LINE + "\n\n## Wire\n\n```\n# not a heading\n```\n")
    return proven_by_problems(str(path))


@pytest.mark.parametrize("body,expected", [
    pytest.param(GOOD_LINE, [], id="well-formed"),
    pytest.param(GOOD_LINE.replace("paths: parts, single; ", "paths: parts,\n  single; "), ["one line", "empty axis"],
                 id="wrapped-over-two-lines"),
    pytest.param("", ["no 'Proven by:"], id="missing"),
    pytest.param(GOOD_LINE + "\n" + GOOD_LINE, ["2 'Proven by:' lines"], id="twice"),
    pytest.param(GOOD_LINE.replace("faults: n/a (no other process); ", ""), ["axes written as", "empty axis ['faults']"],
                 id="axis-missing"),
    pytest.param(GOOD_LINE.replace("paths: parts, single;", "paths: ;"), ["empty axis ['paths']"], id="axis-empty"),
    pytest.param(GOOD_LINE.replace("aftermath: status not NORMAL, files closed.", "aftermath: ."), ["empty axis ['aftermath']"],
                 id="last-axis-empty"),
    pytest.param(GOOD_LINE.replace("n/a (no other process)", "n/a"), ["without a reason"], id="bare-n/a"),
    pytest.param("Proven by: paths: p; boundaries: b; faults: f; aftermath: a.", ["axes written as"], id="wrong-order"),
    pytest.param(GOOD_LINE[:-1], ["end with a period"], id="no-period"),
    pytest.param(GOOD_LINE + "\nMore text after it.", ["last line"], id="not-last"),
    pytest.param("proven by: boundaries: b; paths: p; faults: f; aftermath: a.", ["no 'Proven by:"], id="lower-case"),
])
def test_proven_by_checker(tmp_path, body, expected):
    problems = _one_rule(tmp_path, body)
    assert all(p.startswith("X-ONE: ") for p in problems), problems  # X-TWO is well-formed
    for fragment in expected:
        assert any(fragment in p for p in problems), f"{fragment!r} not reported: {problems}"
    if not expected:
        assert problems == []


def test_rule_body_stops_at_any_heading_but_not_inside_code(tmp_path):
    path = tmp_path / "SPEC.md"
    path.write_text("### `A-ONE` first\nline 1\n```\n### `A-FAKE` in a fence\n```\nline 2\n\n### Wire format\nnot A-ONE's\n"
                    "### `A-TWO` second\nbody two\n## Next section\nnot A-TWO's\n")
    bodies = rule_bodies(str(path))
    assert bodies == {"A-ONE": "line 1\n```\n### `A-FAKE` in a fence\n```\nline 2", "A-TWO": "body two"}, bodies


# -- levels ---------------------------------------------------------------------------------------
def test_every_rule_has_exactly_one_level_line_first_with_a_reason():
    """Read from the text, apart from the parser: one ``Level:`` line per rule, its first line, with a
    known level and a reason; a ``Device:`` line only right after it, naming a known device."""
    problems = []
    level_line = re.compile(r"^Level: (" + "|".join(LEVELS) + r")\. \S")
    device_line = re.compile(r"^Device: (" + "|".join(DEVICES) + r")\. \S")
    for rule_id, body in rule_bodies().items():
        lines = [line for line in body.splitlines() if line.strip()]
        found = [line for line in lines if line.startswith("Level:")]
        if len(found) != 1:
            problems.append(f"{rule_id}: {len(found)} 'Level:' lines")
        if not level_line.match(lines[0]):
            problems.append(f"{rule_id}: first line {lines[0]!r} is not 'Level: contract|hardening. <why>'")
        for i, line in enumerate(lines):
            if line.startswith("Device:") and (i != 1 or not device_line.match(line)):
                problems.append(f"{rule_id}: {line!r} is not a 'Device: cpu|gpu. <why>' line right after the level")
    assert not problems, f"{len(problems)} problem(s) in SPEC.md:\n  " + "\n  ".join(problems)


def test_levels_parse_for_every_rule():
    parsed = rule_levels()
    assert list(parsed) == list(rules())
    assert set(levels().values()) == set(LEVELS), levels()  # both levels in use, no other
    assert all(reason for reason in level_reasons().values())
    assert set(devices().values()) <= set(DEVICES)
    assert list(levels()) == list(level_reasons()) == list(rules())


def test_known_device_dependence():
    """FILE-DETACHED is the known device-dependent rule: on CPU paddle.load's safetensors result is a
    view of the file's mmap, on a GPU a copy on the device; a part changed after a one-pass loader read it
    shows the same effect (FILE-CHANGED-BETWEEN-PARTS)."""
    assert devices().get("FILE-DETACHED") == "cpu"
    assert devices().get("FILE-CHANGED-BETWEEN-PARTS") == "cpu"
    assert "FILE-CHANGED-DURING-LOAD" not in devices()  # paddle.load reads through a mapping on every device


def test_spec_documents_the_levels():
    with open(SPEC_PATH, encoding="utf-8") as f:
        text = f.read()
    assert "\n## Levels\n" in text
    for word in ("`Level: contract.`", "`Level: hardening.`", "`Device:`", "--fail-on=contract|all"):
        assert word in text, f"SPEC.md § Levels does not mention {word}"


GOOD_LEVEL = "Level: contract. FastDeploy does it."
GOOD_DEVICE = "Device: cpu. On a GPU the load copies."


def _levels_spec(tmp_path, first_lines: str) -> str:
    """A two-rule SPEC whose first rule starts with ``first_lines``; the second is well-formed."""
    path = tmp_path / "SPEC.md"
    path.write_text("# Rules\n\n## Levels\n\nLevel: prose, not a rule.\n\n## Area (`X`)\n\n"
                    "### `X-ONE` a rule\n" + first_lines + "\nText. Origin: here.\n" + GOOD_LINE + "\n\n"
                    "### `X-TWO` another\nLevel: hardening. A message.\nOrigin: there.\n" + GOOD_LINE + "\n")
    return str(path)


@pytest.mark.parametrize("first_lines,want", [
    pytest.param(GOOD_LEVEL, ("contract", "FastDeploy does it.", None), id="level"),
    pytest.param("\n" + GOOD_LEVEL, ("contract", "FastDeploy does it.", None), id="after-a-blank-line"),
    pytest.param(GOOD_LEVEL + "\n" + GOOD_DEVICE, ("contract", "FastDeploy does it.", "cpu"), id="level-and-device"),
    pytest.param("Level: hardening. Names the file.\nDevice: gpu. Only there.", ("hardening", "Names the file.", "gpu"),
                 id="hardening-gpu"),
])
def test_level_parser_accepts(tmp_path, first_lines, want):
    path = _levels_spec(tmp_path, first_lines)
    assert levels(path) == {"X-ONE": want[0], "X-TWO": "hardening"}
    assert level_reasons(path) == {"X-ONE": want[1], "X-TWO": "A message."}
    assert devices(path) == ({"X-ONE": want[2]} if want[2] else {})
    assert rule_bodies(path)["X-ONE"].endswith(GOOD_LINE)  # the Proven by line stays last


@pytest.mark.parametrize("first_lines,fragment", [
    pytest.param("", "no 'Level:", id="missing"),
    pytest.param("level: contract. Lower case.", "no 'Level:", id="lower-case"),
    pytest.param("Text first.\n" + GOOD_LEVEL, "must be the first line", id="not-first"),
    pytest.param("Level: optional. Whatever.", "unknown level 'optional'", id="unknown-level"),
    pytest.param("Level: Contract. Capitalised.", "unknown level 'Contract'", id="capitalised-level"),
    pytest.param("Level: contract.", "no reason", id="no-reason"),
    pytest.param("Level: contract.   ", "no reason", id="blank-reason"),
    pytest.param("Level: contract", "malformed level line", id="no-period"),
    pytest.param("Level: contract, because.", "malformed level line", id="comma"),
    pytest.param(GOOD_LEVEL + "\nLevel: hardening. Twice.", "2 'Level:' lines", id="duplicate"),
    pytest.param(GOOD_LEVEL + "\n" + GOOD_LEVEL, "2 'Level:' lines", id="duplicate-same"),
    pytest.param(GOOD_DEVICE, "no 'Level:", id="device-without-level"),
    pytest.param(GOOD_DEVICE + "\n" + GOOD_LEVEL, "must be the first line", id="device-before-level"),
    pytest.param(GOOD_LEVEL + "\nMore text.\n" + GOOD_DEVICE, "right after the 'Level:' line", id="device-not-next"),
    pytest.param(GOOD_LEVEL + "\n\n" + GOOD_DEVICE, "right after the 'Level:' line", id="device-after-blank"),
    pytest.param(GOOD_LEVEL + "\nDevice: tpu. Elsewhere.", "unknown device 'tpu'", id="unknown-device"),
    pytest.param(GOOD_LEVEL + "\nDevice: cpu.", "no reason after the device", id="device-no-reason"),
    pytest.param(GOOD_LEVEL + "\nDevice: cpu", "malformed device line", id="device-no-period"),
    pytest.param(GOOD_LEVEL + "\n" + GOOD_DEVICE + "\n" + GOOD_DEVICE, "2 'Device:' lines", id="device-twice"),
])
def test_level_parser_rejects(tmp_path, first_lines, fragment):
    path = _levels_spec(tmp_path, first_lines)
    for parse in (rule_levels, levels, level_reasons, devices):
        with pytest.raises(ValueError) as e:
            parse(path)
        assert "X-ONE" in str(e.value) and fragment in str(e.value), str(e.value)
    assert rules(path) == {"X-ONE": "a rule", "X-TWO": "another"}  # rules() does not read levels


def test_every_rule_declares_its_modes_right_before_its_proven_by_line():
    """Every rule says in which modes its behaviour exists (conformance/modes.py): one ``Modes:`` line, parsed,
    right before its ``Proven by:`` line (``Modes: n/a (why)`` where there is none)."""
    from conformance import modes

    problems = []
    for rule_id, body in rule_bodies().items():
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        at = [i for i, line in enumerate(lines) if line.startswith("Modes:")]
        if len(at) != 1:
            problems.append(f"{rule_id}: {len(at)} 'Modes:' lines; exactly one is expected")
            continue
        if at[0] != len(lines) - 2 or not lines[-1].startswith("Proven by:"):
            problems.append(f"{rule_id}: the 'Modes:' line must come right before the 'Proven by:' line")
        try:
            modes.declared_in(rule_id, body)
        except ValueError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)
