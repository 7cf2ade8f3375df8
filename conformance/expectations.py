"""Expectations files: the known failures a CI gate accepts, and nothing more.

``--expectations PATH`` names a TOML file of entries::

    [[expect]]
    rule = "PART-INDEX-BASENAME"   # exactly one selector: rule = "ID" | id = "node id" | glob = "pattern"
    kind = "bug"                   # notimpl | bug | never | flaky
    reason = "the part index is parsed from the full path"
    link = "https://github.com/PaddlePaddle/FastDeploy/pull/6852"   # optional

A selector is exact: ``id`` is a pytest node id, ``glob`` an explicit ``fnmatch`` pattern on node ids,
``rule`` every test of one SPEC rule. The file is strict, because a lax one hides regressions:
an unknown key, kind or rule, a missing reason, or an entry that matches no collected conformance test
is an error (checked for the files a run collects: a run of one module is not told about entries for
others). A test an entry covers that fails is an *expected failure*; one that passes is an
*unexpected pass* and fails the run, except for kind ``flaky`` (either outcome is accepted).
"""
from __future__ import annotations

import fnmatch
import json
import re
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from dataclasses import dataclass

KINDS = {
    "notimpl": "the implementation does not implement this (yet)",
    "bug": "a known defect of the implementation",
    "never": "the implementation will not do this (stricter than it promises)",
    "flaky": "fails sometimes; either outcome is accepted",
}
SELECTORS = ("rule", "id", "glob")
KEYS = {*SELECTORS, "kind", "reason", "link"}


class ExpectationsError(Exception):
    """The expectations file is malformed or does not fit this run; names the file and entry."""


@dataclass(frozen=True)
class Expectation:
    index: int  # 1-based position in the file, for messages
    selector: str  # "rule" | "id" | "glob"
    pattern: str
    kind: str
    reason: str
    link: str | None

    def matches(self, nodeid: str, rule: str | None) -> bool:
        if self.selector == "rule":
            return rule == self.pattern
        if self.selector == "id":
            return nodeid == self.pattern
        return fnmatch.fnmatchcase(nodeid, self.pattern)

    def describe(self) -> str:
        return f"entry {self.index} ({self.selector} = {self.pattern!r})"

    def as_json(self) -> dict:
        return {"kind": self.kind, "reason": self.reason, "link": self.link,
                "selector": {self.selector: self.pattern}}


def parse(text: str, source: str, known_rules) -> list[Expectation]:
    """Entries of an expectations file; raises ExpectationsError naming ``source`` and the entry."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ExpectationsError(f"{source}: not valid TOML: {e}") from None
    extra = sorted(set(data) - {"expect"})
    if extra:
        raise ExpectationsError(f"{source}: unknown top-level key(s) {extra}; entries go in [[expect]] tables")
    entries = data.get("expect", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ExpectationsError(f"{source}: 'expect' must be an array of tables ([[expect]])")
    out = []
    for i, entry in enumerate(entries, 1):
        where = f"{source}: entry {i}"
        unknown = sorted(set(entry) - KEYS)
        if unknown:
            raise ExpectationsError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(KEYS)}")
        chosen = [s for s in SELECTORS if s in entry]
        if len(chosen) != 1:
            raise ExpectationsError(f"{where}: needs exactly one of rule, id, glob (has {chosen or 'none'})")
        selector = chosen[0]
        pattern = entry[selector]
        if not isinstance(pattern, str) or not pattern.strip():
            raise ExpectationsError(f"{where}: {selector} must be a non-empty string, got {pattern!r}")
        if selector == "rule" and pattern not in known_rules:
            raise ExpectationsError(f"{where}: rule {pattern!r} is not defined in SPEC.md")
        if selector == "glob" and not any(c in pattern for c in "*?["):
            raise ExpectationsError(f"{where}: glob {pattern!r} has no wildcard; use id = ... for one test")
        kind = entry.get("kind")
        if kind not in KINDS:
            raise ExpectationsError(f"{where} ({selector} = {pattern!r}): kind {kind!r} is not one of {sorted(KINDS)}")
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ExpectationsError(f"{where} ({selector} = {pattern!r}): a reason is required")
        link = entry.get("link")
        if link is not None and (not isinstance(link, str) or not link.strip()):
            raise ExpectationsError(f"{where} ({selector} = {pattern!r}): link must be a non-empty string")
        out.append(Expectation(i, selector, pattern, kind, reason.strip(), link))
    return out


def load(path: str, known_rules) -> list[Expectation]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ExpectationsError(f"--expectations {path}: cannot read it: {e.strerror or e}") from None
    return parse(text, path, known_rules)


def match(entries: list[Expectation], nodeid: str, rule: str | None) -> Expectation | None:
    """The first entry covering the test, or None."""
    return next((e for e in entries if e.matches(nodeid, rule)), None)


def unmatched(entries: list[Expectation], tests: list[tuple[str, str | None]]) -> list[Expectation]:
    """Entries that cover none of ``tests`` ((nodeid, rule) pairs)."""
    return [e for e in entries if not any(e.matches(n, r) for n, r in tests)]


def checkable(entries: list[Expectation], files: set[str], whole_suite: bool) -> list[Expectation]:
    """The entries a run that collected tests of ``files`` can hold to matching something: an ``id``
    or ``glob`` whose file part names a collected file; a ``rule`` entry only when ``whole_suite``."""
    def file_collected(pattern: str) -> bool:
        file_part = pattern.partition("::")[0]
        return any(fnmatch.fnmatchcase(f, file_part) for f in files)

    return [e for e in entries if (whole_suite if e.selector == "rule" else file_collected(e.pattern))]


def verdict(status: str, entry: Expectation | None) -> str:
    """The final status of a test given its actual status and the entry covering it."""
    if entry is None:
        return status
    if status in ("failed", "error"):
        return "expected_failure"
    if status == "passed" and entry.kind != "flaky":
        return "unexpected_pass"
    return status


def _toml_string(value: str) -> str:
    # JSON's string escapes are a subset of TOML basic-string escapes.
    return json.dumps(value, ensure_ascii=False)


# Paths that belong to one run (pytest's temporary directories, /tmp, /dev/shm): a reason quoting them would
# differ in every run and say nothing about the implementation.
_RUN_PATHS = re.compile(r"(?:/[\w.@+-]+)*/pytest-of-[^/\s]+/[^\s'\"),:]*|(?:/tmp|/var/tmp|/dev/shm)/[^\s'\"),:]+")


def blank_run_paths(text: str) -> str:
    """``text`` with the paths that belong to one run replaced by ``<tmp>``."""
    return _RUN_PATHS.sub("<tmp>", text)


def _entry_lines(selector, pattern, kind, reason, link) -> list[str]:
    lines = ["[[expect]]", f"{selector} = {_toml_string(pattern)}", f"kind = {_toml_string(kind)}",
             f"reason = {_toml_string(reason)}"]
    if link:
        lines.append(f"link = {_toml_string(link)}")
    return lines + [""]


def _review(example: dict, prefix: str = "") -> str:
    return "REVIEW: " + prefix + blank_run_paths((example["message"].splitlines() or [""])[0])[:200]


def candidate(tests: list[dict], entries: list[Expectation], source: str | None) -> str:
    """A candidate expectations file for the failures of a run (to review, then pass to --expectations).

    ``tests`` are report test entries (nodeid, rule, actual status, message; ``race``: true for a test
    whose verdict depends on a race with the implementation, e.g. a file changed while it is read). A
    rule whose every applicable test failed gets one ``rule =`` entry, otherwise each failing test gets
    an ``id =`` entry. Kind, reason and link are kept from the entry that covered the failure in
    ``entries``; new failures get kind "bug" and a reason to review, quoting the failure with the run's
    temporary paths blanked. Race-dependent tests are never pinned one by one (another run may fail
    a different subset): when one of them failed, the whole rule (or, beside tests of the rule that
    are not racy, the whole test function, as a ``glob``) is written as ``flaky``, so the file gates
    every run of the same implementation. Entries follow the tests' ids, whatever order the run ended them in
    (a pytest-xdist run's results come as its workers end them), so that a run gives the file a serial run gives."""
    by_rule: dict[str, list[dict]] = {}
    for t in sorted(tests, key=lambda t: t["nodeid"]):
        by_rule.setdefault(t["rule"], []).append(t)
    lines = ["# Candidate expectations written by --update-expectations"
             + (f" (previous file: {source})" if source else "") + ".",
             "# Review every kind and reason before a CI gate uses it.", ""]
    for rule in sorted(by_rule):
        ran = [t for t in by_rule[rule] if t["actual"] in ("passed", "failed", "error")]
        failing = [t for t in ran if t["actual"] in ("failed", "error")]
        if not failing:
            continue
        racy = [t for t in failing if t.get("race")]
        if racy and all(t.get("race") for t in ran):
            old = match(entries, racy[0]["nodeid"], rule)
            lines += _entry_lines("rule", rule, "flaky", old.reason if old else _review(racy[0], "race-dependent: "),
                                  old.link if old else None)
            continue
        globbed = set()
        for t in racy:  # beside tests of the rule that do not race: every case of the racing function, flaky
            function, bracket, _ = t["nodeid"].partition("[")
            if (function if bracket else t["nodeid"]) in globbed:
                continue
            globbed.add(function if bracket else t["nodeid"])
            old = match(entries, t["nodeid"], rule)
            lines += _entry_lines("glob" if bracket else "id", function + "[[]*" if bracket else t["nodeid"], "flaky",
                                  old.reason if old else _review(t, "race-dependent: "), old.link if old else None)
        rest = [t for t in ran if t["nodeid"] not in globbed and t["nodeid"].partition("[")[0] not in globbed]
        failing = [t for t in rest if t["actual"] in ("failed", "error")]
        if not failing:
            continue
        whole = len(failing) == len(rest)
        selections = [("rule", rule, failing[0])] if whole else [("id", t["nodeid"], t) for t in failing]
        for selector, pattern, example in selections:
            old = match(entries, example["nodeid"], rule)
            lines += _entry_lines(selector, pattern, old.kind if old else "bug", old.reason if old else _review(example),
                                  old.link if old else None)
    return "\n".join(lines)
