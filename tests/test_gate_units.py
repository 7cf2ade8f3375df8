"""In-process tests of the CI-gate functions: the expectations file (parse, match, checkable,
candidate, load), the report (verdict precedence, summary, failing tests by level, root causes, build,
write) and ``--rule`` selection. Kept apart from tests/test_plugin_gate.py's subprocess runs so that
mutation/gate.sh can run them under mutmut (which sees only this process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conformance import expectations as expect
from conformance import report as rep
from conformance.plugin import select_rules
from conformance.spec import area, rules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOWN = {"A-ONE": "", "A-TWO": "", "B-ONE": ""}  # a SPEC of three rules


def test_checkable_entries_are_those_a_run_can_judge():
    entries = expect.parse(
        "[[expect]]\nid = 'a.py::t'\nkind = 'bug'\nreason = 'r'\n"
        "[[expect]]\nglob = 'b*.py::t*'\nkind = 'bug'\nreason = 'r'\n"
        "[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\nreason = 'r'\n", "c.toml", KNOWN)
    assert [e.index for e in expect.checkable(entries, {"a.py"}, False)] == [1]
    assert [e.index for e in expect.checkable(entries, {"bee.py"}, False)] == [2]
    assert [e.index for e in expect.checkable(entries, {"a.py", "b.py"}, True)] == [1, 2, 3]
    assert expect.checkable(entries, {"c.py"}, False) == []
    in_class = expect.parse("[[expect]]\nid = 'a.py::TestK::test_x'\nkind = 'bug'\nreason = 'r'\n", "c.toml", KNOWN)
    assert expect.checkable(in_class, {"a.py"}, False) == in_class, "the file part ends at the first '::'"




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
    assert expect.candidate(tests[::-1], old, "old.toml") == text, "a run that ended its tests in another order"
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


def test_load_reads_utf8_whatever_the_locale(tmp_path):
    """The file is UTF-8, in this process and under an ASCII locale (a machine whose default is not UTF-8)."""
    path = tmp_path / "e.toml"
    path.write_bytes("[[expect]]\nrule = 'A-ONE'\nkind = 'bug'\nreason = 'café – ü'\n".encode("utf-8"))
    assert expect.load(str(path), KNOWN)[0].reason == "café – ü"
    # (a child that imports the module still runs mutmut's active mutant: MUTANT_UNDER_TEST is inherited)
    code = "import sys; from conformance import expectations as e; print(ascii(e.load(sys.argv[1], {'A-ONE'})[0].reason))"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"})
    assert (proc.returncode, proc.stdout) == (0, ascii("café – ü") + "\n"), f"under an ASCII locale: {proc.stderr[-2000:]}"


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
    ended_otherwise = dict(reversed(results.items()))  # a pytest-xdist run's results, in the order its workers end
    assert rep.root_causes(ended_otherwise) == causes, "the example is the first failing test by id, in any order"
    assert rep.root_causes(results, min_rules=3) == []
    long = "E: " + "x" * 700
    assert len(rep.cause_key(long)) == 300
    results = {i: t for i, t in enumerate([_t("B-ONE", long), _t("B-TWO", long), _t("A-ONE", "Z: y"),
                                           _t("A-TWO", "Z: y"), _t("A-THREE", "Z: y")])}
    causes = rep.root_causes(results)
    assert [c["rules"] for c in causes] == [["A-ONE", "A-THREE", "A-TWO"], ["B-ONE", "B-TWO"]], "largest first"
    assert len(causes[1]["example"]) == 500, len(causes[1]["example"])


def test_nothing_raised_is_never_a_root_cause():
    """Five rules failing because an expected exception never came share no cause: neither pytest's bare
    "DID NOT RAISE" nor check.raises' message (which names each case) groups them."""
    bare = {i: _t(f"R-{i}", "Failed: DID NOT RAISE <class 'ValueError'>") for i in range(5)}
    named = {i: _t(f"R-{i}", f"AssertionError: bucket {i} of version 1: expected ValueError with a message matching "
                             "'dtype'; nothing was raised (DID NOT RAISE)") for i in range(5)}
    shared = {i: _t(f"R-{i}", f"AttributeError: 'Engine' object has no attribute 'cfg' (case {i})") for i in range(5)}
    assert rep.root_causes(bare) == [] and rep.root_causes(named) == [], rep.root_causes({**bare, **named})
    assert [c["rules"] for c in rep.root_causes(shared)] == [[f"R-{i}" for i in range(5)]], "a shared cause still groups"


def test_rule_status_precedence():
    assert rep.rule_status(["passed", "expected_failure"]) == "expected_failure"
    assert rep.rule_status(["expected_failure", "unexpected_pass"]) == "unexpected_pass"
    assert rep.rule_status(["unexpected_pass", "failed"]) == "failed"
    assert rep.rule_status(["failed", "error"]) == "error"
    assert rep.rule_status(["not_applicable", "passed"]) == "passed"
    assert rep.rule_status(["skipped", "not_applicable"]) == "not_applicable"
    assert rep.rule_status(["passed", None]) == "error"


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


def test_candidate_writes_race_dependent_tests_as_flaky_never_one_by_one_and_blanks_run_paths():
    tmp = "/tmp/pytest-of-ci/pytest-7/test_x0/model/model_state.tp0.0.pdparams"
    tests = [  # A-ONE: racy only; one case failed, one passed (another run may swap them)
        {"nodeid": "t.py::race[a]", "rule": "A-ONE", "actual": "failed", "message": f"AssertionError: {tmp} killed by SIGBUS", "race": True},
        {"nodeid": "t.py::race[b]", "rule": "A-ONE", "actual": "passed", "message": "", "race": True},
        # A-TWO: a racing function beside a test that does not race
        {"nodeid": "t.py::mix[a]", "rule": "A-TWO", "actual": "failed", "message": "mix at /dev/shm/wsync-seg-3", "race": True},
        {"nodeid": "t.py::mix[b]", "rule": "A-TWO", "actual": "passed", "message": "", "race": True},
        {"nodeid": "t.py::plain", "rule": "A-TWO", "actual": "failed", "message": f"ValueError: {tmp}: empty (0 bytes)"},
        # B-ONE: racy, all passed: nothing to expect
        {"nodeid": "t.py::calm[a]", "rule": "B-ONE", "actual": "passed", "message": "", "race": True},
    ]
    text = expect.candidate(tests, [], None)
    entries = expect.parse(text, "new.toml", KNOWN)
    assert [(e.selector, e.pattern, e.kind) for e in entries] == [
        ("rule", "A-ONE", "flaky"),
        ("glob", "t.py::mix[[]*", "flaky"),
        ("rule", "A-TWO", "bug"),  # after the glob, which covers the racing cases first
    ], text
    assert entries[0].reason == "REVIEW: race-dependent: AssertionError: <tmp> killed by SIGBUS", entries[0].reason
    assert entries[1].reason == "REVIEW: race-dependent: mix at <tmp>" and entries[2].reason == "REVIEW: ValueError: <tmp>: empty (0 bytes)"
    assert "pytest-of" not in text and "/tmp/" not in text and "/dev/shm" not in text, text
    # Both outcomes of every racing case pass the gate; the plain failure stays a bug.
    for nodeid, rule, status, verdict in [("t.py::race[a]", "A-ONE", "passed", "passed"), ("t.py::race[b]", "A-ONE", "failed", "expected_failure"),
                                          ("t.py::mix[b]", "A-TWO", "failed", "expected_failure"), ("t.py::mix[a]", "A-TWO", "passed", "passed"),
                                          ("t.py::plain", "A-TWO", "passed", "unexpected_pass")]:
        assert expect.verdict(status, expect.match(entries, nodeid, rule)) == verdict, (nodeid, status)
