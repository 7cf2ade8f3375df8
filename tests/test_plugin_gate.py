"""What a CI gate needs from the plugin: rule levels and ``--fail-on``, the strict expectations file,
``--update-expectations``, root causes, the JSON schema, ``--junitxml`` properties, the ``repro``
interpreter, ``--list-rules`` and ``--rule`` prefixes, device-dependent rules, and ``pytest-xdist``
giving the report of a serial run.

A sandbox (like tests/test_harness.py's) holds rule-marked tests on one contract rule and two
hardening rules, chosen from SPEC.md's levels, that pass or fail on purpose; each scenario is one
pytest subprocess, all started together once per module.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from conformance import expectations as expect
from conformance import report as rep
from conformance.plugin import select_rules
from conformance.spec import area, devices, levels, rules
from tests.test_harness import FAKE_ADAPTER, PYTEST_INI, _pytest

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE_ERROR = 4

CONTRACT = next(r for r, level in levels().items() if level == "contract")
HARD_A, HARD_B, HARD_C = [r for r, level in levels().items() if level == "hardening"][:3]
PASSING = next(r for r, level in levels().items() if level == "contract" and r != CONTRACT)
DEVICE_RULE = next(iter(devices()))

GATE_TESTS = f'''
import pytest

from conformance import check
from fixtures import models as M

SPEC = M.spec(("w", "float32", (2,)))


@pytest.mark.rule("{PASSING}")
def test_passes(loader):
    check.equal(loader.open(SPEC).status(), "NORMAL", "fake status")


@pytest.mark.rule("{CONTRACT}")
def test_contract_fails(loader):
    check.equal(loader.open(SPEC).status(), "CLEARED", "contract: status after open")


@pytest.mark.rule("{HARD_A}")
def test_hardening_fails(loader):
    loader.open(SPEC)
    raise ValueError("loader refused /m/model_state.tp0.7.pdparams: code 13")


@pytest.mark.rule("{HARD_B}")
def test_hardening_fails_the_same_way(loader):
    loader.open(SPEC)
    raise ValueError("loader refused /m/model_state.tp0.12.pdparams: code 13")


@pytest.mark.rule("{DEVICE_RULE}")
def test_device_dependent(loader):
    check.equal(loader.open(SPEC).status(), "NORMAL", "device-dependent rule ran")
'''

GPU_ADAPTER = '''

class GpuAdapter(FakeAdapter):
    name = "servesgpu"
    serves_on = "gpu"


class BadDeviceAdapter(FakeAdapter):
    serves_on = "tpu"
'''


def _toml(entries: list[dict]) -> str:
    out = []
    for e in entries:
        out.append("[[expect]]")
        out += [f"{k} = {json.dumps(v)}" for k, v in e.items()]
        out.append("")
    return "\n".join(out)


ALL_FAILURES = [
    {"rule": CONTRACT, "kind": "bug", "reason": "status is wrong", "link": "https://example.org/1"},
    {"id": "test_gate.py::test_hardening_fails", "kind": "never", "reason": "message not promised"},
    {"glob": "test_gate.py::test_hardening_fails_the_*", "kind": "never", "reason": "message not promised"},
]
EXPECTATIONS = {
    "all": ALL_FAILURES,
    "contract_only": ALL_FAILURES[:1],
    "unexpected_pass": [*ALL_FAILURES, {"rule": PASSING, "kind": "bug", "reason": "thought broken"}],
    "flaky_pass": [*ALL_FAILURES, {"rule": PASSING, "kind": "flaky", "reason": "sometimes"}],
    "stale": [*ALL_FAILURES, {"id": "test_gate.py::test_gone", "kind": "bug", "reason": "renamed"}],
    # Entries for a module this run does not collect, and a rule entry in a run of part of the suite.
    "other_module": [*ALL_FAILURES, {"id": "test_other.py::test_x", "kind": "bug", "reason": "elsewhere"},
                     {"glob": "test_oth*.py::*", "kind": "bug", "reason": "elsewhere"},
                     {"rule": HARD_C, "kind": "never", "reason": "not in this sandbox"}],
    "no_reason": [{"rule": CONTRACT, "kind": "bug"}],
}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    (root / "pytest.ini").write_text(PYTEST_INI)
    (root / "conftest.py").write_text('pytest_plugins = ["conformance.plugin"]\n')
    (root / "fake_adapter.py").write_text(FAKE_ADAPTER + GPU_ADAPTER)
    (root / "test_gate.py").write_text(GATE_TESTS)
    for name, entries in EXPECTATIONS.items():
        (root / f"{name}.toml").write_text(_toml(entries))
    return root


@pytest.fixture(scope="module")
def runs(sandbox, tmp_path_factory):
    out = tmp_path_factory.mktemp("gate-reports")
    impl = ["test_gate.py", "--impl=fake_adapter:FakeAdapter"]
    jobs = {
        "plain": impl + [f"--junitxml={out / 'junit.xml'}", f"--update-expectations={out / 'candidate.toml'}"],
        "xdist": impl + ["-n", "2"],
        "fail_on_contract": impl + ["--fail-on=contract"],
        "contract_expected_fail_on_contract": impl + ["--fail-on=contract", "--expectations=contract_only.toml"],
        "contract_expected_fail_on_all": impl + ["--expectations=contract_only.toml"],
        "all_expected": impl + ["--expectations=all.toml"],
        "all_expected_xdist": impl + ["--expectations=all.toml", "-n", "2"],
        "unexpected_pass": impl + ["--expectations=unexpected_pass.toml"],
        "flaky_pass": impl + ["--expectations=flaky_pass.toml"],
        "stale": impl + ["--expectations=stale.toml"],
        "stale_deselected": impl + ["--expectations=all.toml", "--rule", PASSING],
        "other_module": impl + ["--expectations=other_module.toml"],
        "no_reason": impl + ["--expectations=no_reason.toml"],
        "missing_file": impl + ["--expectations=nowhere.toml"],
        "gpu": ["test_gate.py", "--impl=fake_adapter:GpuAdapter", "--rule", DEVICE_RULE],
        "bad_device": ["test_gate.py", "--impl=fake_adapter:BadDeviceAdapter"],
    }
    reports = {name: out / f"{name}.json" for name in jobs}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_pytest, args, sandbox, [sandbox], reports[name]) for name, args in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    results["_out"] = out
    return results


def _verdicts(report) -> dict[str, str]:
    return {t["nodeid"].rpartition("::")[2]: t["status"] for t in report["tests"]}


def _rule_status(report) -> dict[str, str]:
    return {r["id"]: r["status"] for r in report["rules"]}


# -- levels and --fail-on --------------------------------------------------------------------------------
def test_levels_are_in_the_report_and_the_table(runs):
    run = runs["plain"]
    assert run.code == 1, run.output[-2000:]
    for rule in run.report["rules"]:
        assert rule["level"] == levels()[rule["id"]] and rule["area"] == area(rule["id"]), rule
    assert run.report["summary"]["rules_failing_by_level"] == {"contract": 1, "hardening": 2}, run.report["summary"]
    assert f"failing contract rules: {CONTRACT}" in run.output, run.output[-2000:]
    assert f"failing hardening rules: {', '.join(sorted([HARD_A, HARD_B]))}" in run.output, run.output[-2000:]
    assert re.search(r"failed contract\s*\S*\s*failed\s*\S*\s*hardening|failed contract.*failed hardening", run.output, re.S), run.output


def test_fail_on_contract_still_fails_for_a_contract_rule(runs):
    run = runs["fail_on_contract"]
    assert run.code == 1 and run.report["summary"]["fail_on"] == "contract", run.output[-2000:]
    assert "--fail-on=contract does not fail the run" in run.output, run.output[-2000:]


def test_fail_on_contract_passes_with_only_hardening_failures(runs):
    run = runs["contract_expected_fail_on_contract"]
    assert run.code == 0, f"hardening failures must not fail --fail-on=contract: {run.output[-2000:]}"
    statuses = _rule_status(run.report)
    assert statuses[HARD_A] == statuses[HARD_B] == "failed", statuses  # still reported as failed
    assert statuses[CONTRACT] == "expected_failure", statuses
    run = runs["contract_expected_fail_on_all"]
    assert run.code == 1, f"--fail-on=all (the default) fails on hardening rules: {run.output[-2000:]}"


# -- expectations -------------------------------------------------------------------------------------
def test_expected_failures_make_the_run_green(runs):
    run = runs["all_expected"]
    assert run.code == 0, run.output[-2000:]
    verdicts = _verdicts(run.report)
    assert verdicts == {"test_passes": "passed", "test_contract_fails": "expected_failure",
                        "test_hardening_fails": "expected_failure", "test_hardening_fails_the_same_way": "expected_failure",
                        "test_device_dependent": "passed"}, verdicts
    rule = next(r for r in run.report["rules"] if r["id"] == CONTRACT)
    assert rule["expectation"] == {"kind": "bug", "reason": "status is wrong", "link": "https://example.org/1",
                                   "selector": {"rule": CONTRACT}}, rule
    assert rule["tests"][0]["actual"] == "failed", rule
    assert "expected failures (bug 1, never 2 tests)" in run.output, run.output[-2000:]


def test_an_expected_failure_that_passes_fails_the_run(runs):
    run = runs["unexpected_pass"]
    assert run.code == 1, run.output[-2000:]
    assert _verdicts(run.report)["test_passes"] == "unexpected_pass"
    assert _rule_status(run.report)[PASSING] == "unexpected_pass"
    assert "UNEXPECTED PASS" in run.output and "test_gate.py::test_passes" in run.output, run.output[-2000:]


def test_a_flaky_entry_accepts_a_pass(runs):
    run = runs["flaky_pass"]
    assert run.code == 0 and _verdicts(run.report)["test_passes"] == "passed", run.output[-2000:]


def test_an_entry_matching_nothing_is_an_error(runs):
    run = runs["stale"]
    assert run.code == USAGE_ERROR, run.output[-2000:]
    assert "entry 4 (id = 'test_gate.py::test_gone') matches no conformance test" in run.output, run.output[-2000:]
    # An entry for a rule this run deselects still matches a collected test: no error.
    run = runs["stale_deselected"]
    assert run.code == 0 and set(_rule_status(run.report)) == {PASSING}, run.output[-2000:]
    # Entries for modules the run did not collect, or a rule entry in a run of part of the suite: unchecked.
    run = runs["other_module"]
    assert run.code == 0, run.output[-2000:]


def test_checkable_entries_are_those_a_run_can_judge():
    entries = expect.parse(
        "[[expect]]\nid = 'a.py::t'\nkind = 'bug'\nreason = 'r'\n"
        "[[expect]]\nglob = 'b*.py::t*'\nkind = 'bug'\nreason = 'r'\n"
        "[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\nreason = 'r'\n", "c.toml", KNOWN)
    assert [e.index for e in expect.checkable(entries, {"a.py"}, False)] == [1]
    assert [e.index for e in expect.checkable(entries, {"bee.py"}, False)] == [2]
    assert [e.index for e in expect.checkable(entries, {"a.py", "b.py"}, True)] == [1, 2, 3]
    assert expect.checkable(entries, {"c.py"}, False) == []


def test_a_malformed_or_missing_file_is_a_usage_error_naming_it(runs):
    run = runs["no_reason"]
    assert run.code == USAGE_ERROR and "no_reason.toml: entry 1" in run.output and "a reason is required" in run.output, \
        run.output[-2000:]
    run = runs["missing_file"]
    assert run.code == USAGE_ERROR and "nowhere.toml: cannot read it" in run.output, run.output[-2000:]


KNOWN = {"A-ONE": "", "A-TWO": "", "B-ONE": ""}


@pytest.mark.parametrize("text,error", [
    ("expect = 1", "array of tables"),
    ("[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\nreason = 'r'\nwhy = 'x'", "unknown key(s) ['why']"),
    ("[[expect]]\nkind = 'bug'\nreason = 'r'", "exactly one of rule, id, glob (has none)"),
    ("[[expect]]\nrule = 'A-ONE'\nid = 'x'\nkind = 'bug'\nreason = 'r'", "exactly one of rule, id, glob (has ['rule', 'id'])"),
    ("[[expect]]\nrule = 'A-ONX'\nkind = 'bug'\nreason = 'r'", "rule 'A-ONX' is not defined"),
    ("[[expect]]\nglob = 't.py::test_a'\nkind = 'bug'\nreason = 'r'", "has no wildcard"),
    ("[[expect]]\nrule = 'A-ONE'\nkind = 'broken'\nreason = 'r'", "kind 'broken' is not one of"),
    ("[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\nreason = '  '", "a reason is required"),
    ("[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\nreason = 'r'\nlink = ''", "link must be a non-empty string"),
    ("[[expect]]\nid = ''\nkind = 'bug'\nreason = 'r'", "id must be a non-empty string"),
    ("[expect\n", "not valid TOML"),
    ("[other]\nx = 1", "unknown top-level key(s) ['other']"),
])
def test_expectations_parser_refuses(text, error):
    with pytest.raises(expect.ExpectationsError) as e:
        expect.parse(text, "gate.toml", KNOWN)
    assert "gate.toml" in str(e.value) and error in str(e.value), str(e.value)


def test_expectations_match_exactly():
    entries = expect.parse(
        "[[expect]]\nid = 't.py::test_a[1]'\nkind = 'bug'\nreason = 'r'\n"
        "[[expect]]\nglob = 't.py::test_b*'\nkind = 'never'\nreason = 'r'\n"
        "[[expect]]\nrule = 'A-TWO'\nkind = 'flaky'\nreason = 'r'\n", "e.toml", KNOWN)
    assert expect.match(entries, "t.py::test_a[1]", "B-ONE") is entries[0]
    assert expect.match(entries, "t.py::test_a[10]", "B-ONE") is None  # an id is not a prefix
    assert expect.match(entries, "t.py::test_bx", "B-ONE") is entries[1]
    assert expect.match(entries, "u.py::test_b", "B-ONE") is None
    assert expect.match(entries, "u.py::anything", "A-TWO") is entries[2]
    assert expect.match(entries, "u.py::anything", "A-ONE") is None
    assert [e.index for e in expect.unmatched(entries, [("t.py::test_a[1]", "A-ONE")])] == [2, 3]
    assert [expect.verdict(s, entries[0]) for s in ("failed", "error", "passed", "not_applicable")] == \
        ["expected_failure", "expected_failure", "unexpected_pass", "not_applicable"]
    assert [expect.verdict(s, entries[2]) for s in ("failed", "passed")] == ["expected_failure", "passed"]
    assert [expect.verdict(s, None) for s in ("failed", "passed")] == ["failed", "passed"]
    assert [e.index for e in expect.unmatched(entries, [("x.py::y", "A-TWO")])] == [1, 2]  # a rule entry matches by rule


def test_an_empty_file_expects_nothing_and_a_glob_needs_a_wildcard():
    assert expect.parse("", "empty.toml", KNOWN) == []
    assert expect.parse("# only a comment\n", "empty.toml", KNOWN) == []
    with pytest.raises(expect.ExpectationsError, match="has no wildcard"):
        expect.parse("[[expect]]\nglob = 't.py::testX'\nkind = 'bug'\nreason = 'r'", "g.toml", KNOWN)


def test_update_expectations_writes_a_file_that_makes_the_run_green(runs, sandbox):
    path = runs["_out"] / "candidate.toml"
    assert path.exists(), runs["plain"].output[-2000:]
    entries = expect.parse(path.read_text(), str(path), rules())
    chosen = {(e.selector, e.pattern) for e in entries}
    assert chosen == {("rule", CONTRACT), ("rule", HARD_A), ("rule", HARD_B)}, chosen
    assert all(e.kind == "bug" and e.reason.startswith("REVIEW: ") for e in entries), entries
    assert any("code 13" in e.reason for e in entries), entries
    run = _pytest(["test_gate.py", "--impl=fake_adapter:FakeAdapter", f"--expectations={path}"], sandbox, [sandbox])
    assert run.code == 0, run.output[-2000:]


def test_candidate_keeps_kind_reason_and_link_and_splits_partial_rules():
    old = expect.parse('[[expect]]\nrule = "A-ONE"\nkind = "never"\nreason = "a \\"quoted\\" reason"\n'
                       'link = "https://x/1"\n'
                       '[[expect]]\nid = "t.py::b4"\nkind = "notimpl"\nreason = "kept by id"\n', "old.toml", KNOWN)
    tests = [
        {"nodeid": "t.py::z1", "rule": "A-AAA", "actual": "passed", "message": ""},  # sorts first; nothing to expect
        {"nodeid": "t.py::a1", "rule": "A-ONE", "actual": "failed", "message": "boom"},
        {"nodeid": "t.py::a2", "rule": "A-ONE", "actual": "error", "message": "boom"},
        {"nodeid": "t.py::b1", "rule": "B-ONE", "actual": "failed", "message": "first line\nsecond"},
        {"nodeid": "t.py::b2", "rule": "B-ONE", "actual": "passed", "message": ""},
        {"nodeid": "t.py::b3", "rule": "B-ONE", "actual": "not_applicable", "message": ""},
        {"nodeid": "t.py::b4", "rule": "B-ONE", "actual": "failed", "message": ""},
        {"nodeid": "t.py::b5", "rule": "B-ONE", "actual": "failed", "message": ""},
        {"nodeid": "t.py::c1", "rule": "A-TWO", "actual": "not_applicable", "message": ""},
        {"nodeid": "t.py::c2", "rule": "A-TWO", "actual": "error", "message": "É: first error"},
        {"nodeid": "t.py::c3", "rule": "A-TWO", "actual": "error", "message": "second error"},
    ]
    text = expect.candidate(tests, old, "old.toml")
    assert text.startswith("# Candidate expectations written by --update-expectations (previous file: old.toml).\n"
                           "# Review every kind and reason"), text
    assert '"REVIEW: É: first error"' in text, "non-ASCII text is written as itself"
    new = expect.parse(text, "new.toml", KNOWN)
    assert [(e.selector, e.pattern, e.kind, e.reason, e.link) for e in new] == [
        ("rule", "A-ONE", "never", 'a "quoted" reason', "https://x/1"),
        ("rule", "A-TWO", "bug", "REVIEW: É: first error", None),  # only errors: still the whole rule
        ("id", "t.py::b1", "bug", "REVIEW: first line", None),
        ("id", "t.py::b4", "notimpl", "kept by id", None),
        ("id", "t.py::b5", "bug", "REVIEW:", None),  # (an empty message)
    ], text
    fresh = expect.candidate([{"nodeid": "t.py::l", "rule": "A-ONE", "actual": "failed", "message": "L" * 300}], [], None)
    assert fresh.startswith("# Candidate expectations written by --update-expectations.\n"), fresh
    (entry,) = expect.parse(fresh, "fresh.toml", KNOWN)
    assert entry.reason == "REVIEW: " + "L" * 200, "the reason quotes the first 200 characters"


def test_load_reads_the_file_and_names_it(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text("[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\nreason = 'r'\nlink = 'https://x/2'\n")
    (entry,) = expect.load(str(path), KNOWN)
    assert entry.as_json() == {"kind": "bug", "reason": "r", "link": "https://x/2", "selector": {"rule": "A-ONE"}}
    with pytest.raises(expect.ExpectationsError,
                       match=f"--expectations {tmp_path / 'none.toml'}: cannot read it: No such file or directory"):
        expect.load(str(tmp_path / "none.toml"), KNOWN)
    path.write_text("[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\n")
    with pytest.raises(expect.ExpectationsError, match=f"^{path}: entry 1 .*a reason is required"):
        expect.load(str(path), KNOWN)


def _rec(nodeid, rule, level, actual, status=None, expectation=None, message=""):
    return {"nodeid": nodeid, "rule": rule, "area": area(rule), "level": level, "device": None, "title": f"t {rule}",
            "requires": [], "status": status or actual, "actual": actual, "message": message,
            "expectation": expectation, "repro": f"{sys.executable} -m pytest {nodeid}"}


def test_summary_failing_tests_and_build_in_process(tmp_path):
    """The report functions on synthetic records (the subprocess tests cover them end to end)."""
    e = {"kind": "never", "reason": "r", "link": None, "selector": {"rule": "B-ONE"}}
    recs = [_rec("t.py::c", "A-TWO", "contract", "failed", message="X: 1"),
            _rec("t.py::a", "A-ONE", "contract", "passed"),
            _rec("t.py::h1", "B-ONE", "hardening", "failed", "expected_failure", e, "Y"),
            _rec("t.py::h2", "B-ONE", "hardening", "passed", "unexpected_pass", e),
            _rec("t.py::h3", "B-TWO", "hardening", "error", message="X: 2"),
            _rec("t.py::n", "A-THREE", "contract", "not_applicable"),
            _rec("t.py::r", "A-FOUR", "contract", None),
            _rec("t.py::o", "C-OLD", "contract", "passed")]  # a rule the SPEC no longer has: listed last
    results = {r["nodeid"]: r for r in recs}
    # (a test that never reported counts as an error)
    assert [r["nodeid"] for r in rep.failing_tests(results)] == ["t.py::c", "t.py::h2", "t.py::h3", "t.py::r"]
    results_without_old = {k: v for k, v in results.items() if k != "t.py::o"}
    assert [r["nodeid"] for r in rep.failing_tests(results, "contract")] == ["t.py::c", "t.py::r"]
    summary = rep.summary(results_without_old, "contract", None)
    assert summary == {
        "tests": {"passed": 1, "failed": 1, "error": 1, "not_applicable": 1, "skipped": 0, "expected_failure": 1,
                  "unexpected_pass": 1, "not_run": 1},
        "rules": {"passed": 1, "failed": 1, "error": 2, "not_applicable": 1, "skipped": 0, "expected_failure": 0,
                  "unexpected_pass": 1},
        "rules_failing_by_level": {"contract": 2, "hardening": 2},
        "fail_on": "contract", "nothing_tested": None}, summary
    spec_order = {"A-ONE": "", "A-TWO": "", "A-THREE": "", "A-FOUR": "", "B-ONE": "", "B-TWO": ""}
    report = rep.build({"implementation": "x"}, results, spec_order, "all", "why")
    assert [r["id"] for r in report["rules"]] == [*spec_order, "C-OLD"], "rules in SPEC order, unknown ones last"
    assert report["run_info"] == {"implementation": "x"} and report["rules"][0]["device"] is None
    b_one = report["rules"][4]
    assert (b_one["status"], b_one["level"], b_one["area"], b_one["expectation"], [t["nodeid"] for t in b_one["tests"]]) \
        == ("unexpected_pass", "hardening", "B", e, ["t.py::h1", "t.py::h2"]), b_one
    assert report["rules"][0]["title"] == "t A-ONE" and report["rules"][0]["expectation"] is None
    assert [t["nodeid"] for t in report["tests"]] == sorted(results)
    assert report["root_causes"] == [{"cause": "X: N", "example": "X: 1", "rules": ["A-TWO", "B-TWO"], "tests": 2}]
    assert report["summary"]["nothing_tested"] == "why" and report["summary"]["fail_on"] == "all"
    path = tmp_path / "sub" / "r.json"
    rep.write(str(path), report)
    rep.write(str(path), report)  # again, into the directory it made
    assert json.loads(path.read_text()) == report
    assert rep.schema()["title"].startswith("Conformance report")


# -- root causes --------------------------------------------------------------------------------------
def test_one_cause_failing_several_rules_is_said_once(runs):
    causes = runs["plain"].report["root_causes"]
    assert len(causes) == 1 and causes[0]["rules"] == sorted([HARD_A, HARD_B]) and causes[0]["tests"] == 2, causes
    assert "code 13" in causes[0]["example"], causes
    assert "root causes (one failure explaining several rules):" in runs["plain"].output
    assert f"rules: {', '.join(sorted([HARD_A, HARD_B]))}" in runs["plain"].output, runs["plain"].output[-2000:]
    assert runs["all_expected"].report["root_causes"] == [], "expected failures are not root causes to chase"


def _t(rule, message, actual="failed", status=None):
    return {"rule": rule, "message": message, "actual": actual, "status": status or actual}


def test_cause_key_blanks_paths_numbers_and_addresses_only():
    a = rep.cause_key("TypeError: __init__() takes 3 positional arguments but 4 were given")
    assert a == "TypeError: __init__() takes N positional arguments but N were given", a
    assert rep.cause_key("x at /tmp/pytest-of-root/pytest-3/test_a0/model/m.pdparams: bad") == "x at <tmp>: bad"
    assert rep.cause_key("object at 0x7f00aa") == "object at 0x…"
    assert rep.cause_key("") == "(no message)"
    results = {i: t for i, t in enumerate([
        _t("A-ONE", "FileNotFoundError: /tmp/pytest-of-root/pytest-1/a/model_state.tp0.0.pdparams"),
        _t("A-TWO", "FileNotFoundError: /tmp/pytest-of-root/pytest-1/b/model_state.tp0.0.pdparams", "error"),
        _t("B-ONE", "FileNotFoundError: /tmp/pytest-of-root/pytest-1/c/x.pdparams", "failed", "expected_failure"),
        _t("B-ONE", "AssertionError: other"),
        _t("B-ONE", "AssertionError: other", "passed"),
    ])}
    causes = rep.root_causes(results)
    assert [(c["rules"], c["tests"]) for c in causes] == [(["A-ONE", "A-TWO"], 2)], causes
    assert causes[0]["example"] == "FileNotFoundError: /tmp/pytest-of-root/pytest-1/a/model_state.tp0.0.pdparams"
    assert rep.root_causes(results, min_rules=3) == []
    long = "E: " + "x" * 700
    assert len(rep.cause_key(long)) == 300
    results = {i: t for i, t in enumerate([_t("B-ONE", long), _t("B-TWO", long), _t("A-ONE", "Z: y"),
                                           _t("A-TWO", "Z: y"), _t("A-THREE", "Z: y")])}
    causes = rep.root_causes(results)
    assert [c["rules"] for c in causes] == [["A-ONE", "A-THREE", "A-TWO"], ["B-ONE", "B-TWO"]], "largest first"
    assert len(causes[1]["example"]) == 500, len(causes[1]["example"])


def test_rule_status_precedence():
    assert rep.rule_status(["passed", "expected_failure"]) == "expected_failure"
    assert rep.rule_status(["expected_failure", "unexpected_pass"]) == "unexpected_pass"
    assert rep.rule_status(["unexpected_pass", "failed"]) == "failed"
    assert rep.rule_status(["failed", "error"]) == "error"
    assert rep.rule_status(["not_applicable", "passed"]) == "passed"
    assert rep.rule_status(["skipped", "not_applicable"]) == "not_applicable"
    assert rep.rule_status(["passed", None]) == "error"


# -- the report's schema, junitxml, repro ---------------------------------------------------------------
def test_reports_follow_the_shipped_schema(runs, reference_report):
    schema = rep.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for name in ("plain", "xdist", "all_expected", "unexpected_pass", "gpu"):
        errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(runs[name].report)]
        assert not errors, f"{name}: {errors[:5]}"
    _, reference, output = reference_report
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(reference)]
    assert not errors, errors[:5]


@pytest.mark.parametrize("damage", [
    lambda r: r["rules"][0].update(level="advisory"),
    lambda r: r["tests"][0].update(status="xfailed"),
    lambda r: r["rules"][0].update(expectation={"kind": "bug"}),
    lambda r: r["summary"].pop("fail_on"),
    lambda r: r.update(extra=1),
    lambda r: r["run_info"].update(serves_on="tpu"),
])
def test_the_schema_refuses_a_damaged_report(runs, damage):
    report = json.loads(json.dumps(runs["plain"].report))
    damage(report)
    assert list(jsonschema.Draft202012Validator(rep.schema()).iter_errors(report)), "damage not detected"


def test_junitxml_carries_rule_and_level(runs):
    root = ET.parse(runs["_out"] / "junit.xml").getroot()
    props = {}
    for case in root.iter("testcase"):
        props[case.get("name")] = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["test_contract_fails"]["rule"] == CONTRACT and props["test_contract_fails"]["level"] == "contract", props
    assert props["test_hardening_fails"]["rule"] == HARD_A and props["test_hardening_fails"]["level"] == "hardening", props
    assert set(props) == {"test_passes", "test_contract_fails", "test_hardening_fails",
                          "test_hardening_fails_the_same_way", "test_device_dependent"}, props


def test_repro_runs_with_the_same_interpreter(runs, sandbox):
    test = next(t for t in runs["plain"].report["tests"] if t["nodeid"].endswith("test_contract_fails"))
    assert test["repro"].startswith(f"{sys.executable} -m pytest test_gate.py::test_contract_fails "), test["repro"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sandbox), REPO]), PATH="/nonexistent")
    proc = subprocess.run(test["repro"], shell=True, cwd=sandbox, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


# -- device-dependent rules --------------------------------------------------------------------------------
def test_a_device_dependent_rule_is_judged_for_the_serving_device(runs):
    on_cpu = runs["plain"].report
    assert _verdicts(on_cpu)["test_device_dependent"] == "passed", "an adapter with no serves_on runs it here"
    run = runs["gpu"]
    assert run.code == 5 and "NOTHING TESTED" in run.output, run.output[-2000:]
    test = run.report["tests"][0]
    assert test["status"] == "not_applicable" and test["device"] == devices()[DEVICE_RULE], test
    assert f"{DEVICE_RULE} depends on the device" in test["message"] and "servesgpu serves on (gpu)" in test["message"] \
        and "this run is on cpu" in test["message"], test["message"]
    assert run.report["run_info"]["serves_on"] == "gpu"
    run = runs["bad_device"]
    assert run.code == USAGE_ERROR and "serves_on must be 'cpu' or 'gpu', got 'tpu'" in run.output, run.output[-2000:]


# -- xdist: the same report as a serial run ----------------------------------------------------------------
def _comparable(report) -> dict:
    tests = {t["nodeid"]: (t["status"], t["actual"], t["rule"], t["level"], t["message"][:200]) for t in report["tests"]}
    rules_ = {r["id"]: (r["status"], r["level"], len(r["tests"])) for r in report["rules"]}
    return {"tests": tests, "rules": rules_, "summary": report["summary"], "root_causes": report["root_causes"]}


def test_xdist_gives_the_serial_report_in_the_sandbox(runs):
    for serial, parallel in (("plain", "xdist"), ("all_expected", "all_expected_xdist")):
        assert runs[parallel].code == runs[serial].code, (parallel, runs[parallel].output[-2000:])
        assert _comparable(runs[parallel].report) == _comparable(runs[serial].report), parallel
        assert "failing contract rules" in runs["xdist"].output


@pytest.fixture(scope="module")
def reference_xdist(tmp_path_factory):
    from tests.conftest import run_conformance

    path = tmp_path_factory.mktemp("xdist") / "report.json"
    return run_conformance(["--impl=reference", "-n", "2"], path)


def test_xdist_gives_the_serial_report_for_the_reference(reference_report, reference_xdist):
    serial_code, serial, _ = reference_report
    code, parallel, output = reference_xdist
    assert parallel is not None and code == serial_code == 0, output[-3000:]
    a, b = _comparable(serial), _comparable(parallel)
    differ = {k: (a["tests"].get(k), b["tests"].get(k)) for k in set(a["tests"]) | set(b["tests"])
              if a["tests"].get(k) != b["tests"].get(k)}
    assert not differ, f"{len(differ)} tests differ under -n 2: {dict(list(differ.items())[:5])}"
    assert a == b


# -- finding rules ------------------------------------------------------------------------------------------
def _run_repo(args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_list_rules_needs_no_impl_and_lists_every_rule():
    code, output = _run_repo(["conformance", "--list-rules"])
    assert code == 0, output[-3000:]
    listed = re.findall(r"^([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+) +(contract|hardening) +(\w+) +([\w.,-]+) ", output, re.M)
    assert {r[0] for r in listed} == set(rules()), sorted(set(rules()) ^ {r[0] for r in listed})
    for rule_id, level, area_, caps in listed:
        assert level == levels()[rule_id] and area_ == area(rule_id), (rule_id, level, area_)
    caps = {r[0]: r[3] for r in listed}
    assert "ipc.buckets" in caps["BKT-LARGE"], caps["BKT-LARGE"]
    assert f"{len(rules())} rules (SPEC.md):" in output, output[-2000:]
    assert not re.search(r"\d+ (passed|failed)", output), "--list-rules must not run tests"


@pytest.mark.parametrize("values,want", [
    (["BKT"], {r for r in rules() if r.startswith("BKT-")}),
    (["SNAP-GPU"], {r for r in rules() if r.startswith("SNAP-GPU-")}),
    (["SNAP-GPU-ID"], {"SNAP-GPU-ID"}),  # an exact id is not also a prefix of SNAP-GPU-ID-INVALID
    (["BKT-LARGE", "LIFE"], {"BKT-LARGE"} | {r for r in rules() if r.startswith("LIFE-")}),
])
def test_rule_takes_an_id_or_a_prefix_at_a_dash(values, want):
    assert want and select_rules(values, rules()) == want


@pytest.mark.parametrize("value,hint", [("SNAP-GPU-IDD", "did you mean SNAP-GPU-ID"), ("bkt", "did you mean BKT"),
                                        ("BK", "matches no rule"), ("ZZZZZZ", "see --list-rules")])
def test_rule_typo_is_a_usage_error_with_a_suggestion(value, hint):
    with pytest.raises(pytest.UsageError) as e:
        select_rules([value], rules())
    assert f"--rule {value!r} matches no rule" in str(e.value) and hint in str(e.value), str(e.value)


def test_rule_prefix_selects_the_area_in_a_real_run(reference_report):
    code, output = _run_repo(["conformance", "--impl=reference", "--rule", "LIFE", "--collect-only", "-q"])
    assert code == 0, output[-2000:]
    ids = {line for line in output.splitlines() if "::" in line}
    want = {t["nodeid"] for t in reference_report[1]["tests"] if t["rule"].startswith("LIFE-")}
    assert want and ids == want, (sorted(ids - want)[:5], sorted(want - ids)[:5])
    code, output = _run_repo(["conformance", "--impl=reference", "--rule", "LIFE-STATU", "--collect-only", "-q"])
    assert code == USAGE_ERROR and "did you mean LIFE-STATUS" in output, output[-2000:]
