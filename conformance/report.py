"""What a run found, per test and per rule: statuses, verdicts under an expectations file, root causes.

Pure functions over the per-test records the plugin collects (one dict per conformance test, built
from the test reports alone, so a ``pytest-xdist`` controller builds the same records as a serial
run). ``report.schema.json`` beside this module describes the JSON report ``build`` returns.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter, defaultdict

NOT_APPLICABLE = "not_applicable"
STATUSES = ("passed", "failed", "error", NOT_APPLICABLE, "skipped")  # what a test did
VERDICTS = (*STATUSES, "expected_failure", "unexpected_pass")  # what it means under expectations
# A rule takes the first of these among its tests' verdicts: one failure fails it.
RULE_PRECEDENCE = ("error", "failed", "unexpected_pass", "expected_failure", "passed", NOT_APPLICABLE, "skipped")
FAILING = ("failed", "error", "unexpected_pass")  # verdicts that fail a run
LEVELS = ("contract", "hardening")
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.schema.json")


def rule_status(verdicts) -> str:
    verdicts = [v or "error" for v in verdicts]
    return next(s for s in RULE_PRECEDENCE if s in verdicts)


def by_rule(results: dict) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for r in results.values():
        grouped[r["rule"]].append(r)
    return grouped


def rule_statuses(results: dict) -> dict[str, str]:
    return {rule: rule_status(t["status"] for t in tests) for rule, tests in by_rule(results).items()}


def failing_tests(results: dict, fail_on: str = "all") -> list[dict]:
    """Tests whose verdict fails the run: with ``fail_on="contract"`` only those of contract rules."""
    return [r for r in results.values()
            if (r["status"] or "error") in FAILING and (fail_on == "all" or r["level"] == "contract")]


def summary(results: dict, fail_on: str, nothing_tested: str | None) -> dict:
    tests = Counter(r["status"] or "not_run" for r in results.values())
    statuses = rule_statuses(results)
    rules = Counter(statuses.values())
    levels = {r["rule"]: r["level"] for r in results.values()}
    failed_by_level = Counter(levels[rule] for rule, s in statuses.items() if s in FAILING)
    return {
        "tests": {s: tests[s] for s in (*VERDICTS, "not_run")},
        "rules": {s: rules[s] for s in VERDICTS},
        "rules_failing_by_level": {level: failed_by_level[level] for level in LEVELS},
        "fail_on": fail_on,
        "nothing_tested": nothing_tested,
    }


# -- root causes -------------------------------------------------------------------------------------
_NOISE = [
    (re.compile(r"(?:/[\w.@+-]+)*/pytest-of-[^/\s]+/[^\s'\"),:]*"), "<tmp>"),  # a test's private paths
    (re.compile(r"0x[0-9a-fA-F]+"), "0x…"),
    (re.compile(r"\b\d+\b"), "N"),
]


def cause_key(message: str) -> str:
    """A failure message with what differs between tests (paths, numbers, addresses) blanked, so that
    failures with one cause share a key."""
    first = (message or "").strip().splitlines()[0] if (message or "").strip() else "(no message)"
    for pattern, repl in _NOISE:
        first = pattern.sub(repl, first)
    return first[:300]


# An exception that was expected and never came is each rule's own gap, not a cause shared with others:
# "DID NOT RAISE ValueError" (pytest's words, or check.raises' after the case it names) explains nothing.
_NO_CAUSE = re.compile(r"DID NOT RAISE")


def root_causes(results: dict, min_rules: int = 2) -> list[dict]:
    """Causes shared by failures of at least ``min_rules`` rules, largest first: the cause (its
    normalized message), one real message (the failing test's first by id, so that a pytest-xdist run, whose
    results come in the order its workers end them, gives the serial run's), the rules it explains and how many
    tests it failed. A failure because nothing was raised is never a shared cause."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in (results[key] for key in sorted(results)):
        if _NO_CAUSE.search(r["message"] or ""):
            continue
        if r["actual"] in ("failed", "error") and r["status"] != "expected_failure":
            groups[cause_key(r["message"])].append(r)
    found = []
    for key, tests in groups.items():
        rules = sorted({t["rule"] for t in tests})
        if len(rules) >= min_rules:
            found.append({"cause": key, "example": tests[0]["message"].strip().splitlines()[0][:500],
                          "rules": rules, "tests": len(tests)})
    return sorted(found, key=lambda c: (-len(c["rules"]), c["cause"]))


# -- the JSON report ---------------------------------------------------------------------------------
RAN = ("passed", "failed", "error")  # a test whose case ran: its modes were exercised


def mode_coverage(rule_id: str, tests: list[dict]) -> dict:
    """What the rule's tests that ran (passed, failed or error: not those not applicable, skipped or not run)
    cover of the mode pairs its ``Modes:`` line declares (conformance.modes)."""
    from . import modes

    return modes.coverage(rule_id, [t.get("modes") or {} for t in tests if t["actual"] in RAN]).as_json()


def build(run_info: dict, results: dict, spec_rules: dict, fail_on: str, nothing_tested: str | None) -> dict:
    statuses = rule_statuses(results)
    grouped = by_rule(results)
    order = {rule: i for i, rule in enumerate(spec_rules)}
    rules = []
    for rule_id in sorted(statuses, key=lambda r: order.get(r, len(order))):
        tests = sorted(grouped[rule_id], key=lambda t: t["nodeid"])
        expectation = next((t["expectation"] for t in tests if t["expectation"]), None)
        first = tests[0]
        rules.append({"id": rule_id, "title": first["title"], "area": first["area"], "level": first["level"],
                      "device": first["device"], "status": statuses[rule_id], "expectation": expectation,
                      "modes": mode_coverage(rule_id, tests), "tests": tests})
    return {
        "run_info": run_info,
        "rules": rules,
        "tests": sorted(results.values(), key=lambda t: t["nodeid"]),
        "root_causes": root_causes(results),
        "summary": summary(results, fail_on, nothing_tested),
    }


def write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


def schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return json.load(f)
