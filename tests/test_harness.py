"""Self-tests of the conformance harness (conformance/plugin.py, registry.py, harness.py, check.py).

Most tests read the result of one of a few pytest subprocesses, started together once per module:
a *sandbox* directory holds a fake adapter and rule-marked tests that pass, fail, are vacuous or are
not applicable; the plugin treats them as conformance tests because they carry a ``rule`` marker.
Usage-error runs never import Paddle and take about a second each.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from conformance import check
from conformance.adapter import Observed
from conformance.spec import rules
from tests import pytest_server

# Module fixtures run whole pytest subprocesses; their setup counts against the first test's timeout.
pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE_ERROR = 4

FAKE_ADAPTER = '''
"""A fake implementation: loads nothing, claims snapshot.single only."""


class Session:
    def __init__(self, models):
        self.models = models

    def update(self):
        pass

    def clear(self):
        pass

    def observe(self):
        return {}

    def trace(self):
        return []

    def status(self):
        return "NORMAL"

    def close(self):
        pass


class FakeAdapter:
    name = "fake"
    version = "9.9"
    capabilities = frozenset({"snapshot.single"})

    def open(self, models, config):
        return Session(models)


class NoCapsAdapter(FakeAdapter):
    name = "nocaps"
    capabilities = frozenset()


class StrCapsAdapter(FakeAdapter):
    capabilities = "snapshot.single"  # a str, not a set: read letter by letter before


class RaisingAdapter(FakeAdapter):
    def __init__(self, **options):
        raise RuntimeError("no GPU visible to the adapter")  # RAISES-IN-INIT


def raising_factory(**options):
    return {}["engine"]  # RAISES-IN-FACTORY
'''

BROKEN_ADAPTER = '''
"""An adapter file with a syntax error."""

class Broken(:
    pass
'''

SANDBOX_TESTS = '''
import pytest

from conformance import check
from fixtures import models as M

SPEC = M.spec(("w", "float32", (2,)))


@pytest.mark.rule("SNAP-GPU-ID")
@pytest.mark.requires("snapshot.single")
def test_passes(loader):
    session = loader.open(SPEC)
    session.update()
    check.equal(session.status(), "NORMAL", "fake status after update")


@pytest.mark.rule("LEVEL-SHARED-LAST")
@pytest.mark.requires("snapshot.shared_fallback")
def test_not_applicable(loader):
    # Would pass if it ran: only the missing capability keeps it from passing.
    loader.open(SPEC).update()
    check.that(True, "unreachable")


@pytest.mark.rule("SNAP-NAME-SINGLE")
def test_fails(loader):
    session = loader.open(SPEC)
    check.equal(session.status(), "CLEARED", "tensor w in /m/model_state.tp0.0.pdparams")


@pytest.mark.rule("SNAP-NAME-PARTS")
def test_vacuous_no_adapter_call(loader):
    check.that(True, "asserts something but never drives the implementation")


@pytest.mark.rule("SNAP-RANK-OWN-SHARD")
def test_vacuous_no_check(loader):
    loader.open(SPEC).update()


@pytest.mark.rule("PART-ORDER-NUMERIC")
def test_skips_itself(loader):
    loader.open(SPEC).update()
    check.that(True, "reached")
    pytest.skip("no GPU on this machine")


@pytest.mark.rule("PART-LABEL-INDEX")
def test_skips_itself_as_not_applicable(loader):
    loader.open(SPEC)
    pytest.skip("not_applicable: fake cannot label parts")


@pytest.mark.rule("PART-INDEX-BASENAME")
def test_xfails_itself(loader):
    loader.open(SPEC)
    pytest.xfail("known bug")


def test_plain_project_test():
    assert True
'''

BAD_MARKER_TESTS = '''
import pytest


@pytest.mark.rule("NOT-A-RULE")
def test_unknown_rule(loader):
    pass


@pytest.mark.requires("snapshot.single")
def test_missing_rule(loader):
    pass


@pytest.mark.rule("SNAP-GPU-ID")
@pytest.mark.requires("telepathy")
def test_unknown_capability(loader):
    pass


@pytest.mark.rule("SNAP-GPU-ID")
@pytest.mark.xfail(reason="known bug")
def test_marked_xfail(loader):
    pass
'''

PYTEST_INI = '''
[pytest]
addopts = -p no:cacheprovider
markers =
    rule(rule_id): the SPEC.md rule
    requires(*capabilities): adapter capabilities
'''


@dataclass
class Run:
    code: int
    output: str
    report: dict | None


def _pytest(args, cwd, paths=(), report=None, timeout=240) -> Run:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), REPO])
    env.pop("CONFORMANCE_FASTDEPLOY_SOURCE", None)
    # pytest-xdist sets COLUMNS=80 in its workers: the inner run prints as to a log (NATURAL_WIDTH) however the
    # outer run was started, so that its table reads the same under `pytest tests` and `pytest tests -n 2`.
    env.pop("COLUMNS", None)
    args = ["-q", "-p", "no:cacheprovider", *args]
    if report:
        args.append(f"--conformance-report={report}")
    proc = pytest_server.run(args, str(cwd), timeout=timeout, env=env)
    data = None
    if report and os.path.exists(report):
        with open(report) as f:
            data = json.load(f)
    return Run(proc.returncode, proc.stdout + proc.stderr, data)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox")
    (root / "pytest.ini").write_text(PYTEST_INI)
    (root / "conftest.py").write_text('pytest_plugins = ["conformance.plugin"]\n')
    (root / "fake_adapter.py").write_text(FAKE_ADAPTER)
    (root / "broken_adapter.py").write_text(BROKEN_ADAPTER)
    (root / "test_sandbox.py").write_text(SANDBOX_TESTS)
    (root / "test_project_first.py").write_text("def test_project_check_that_fails():\n    assert 1 == 2\n")
    bad = root / "bad"
    bad.mkdir()
    (bad / "test_bad_markers.py").write_text(BAD_MARKER_TESTS)
    # An installed distribution, as far as importlib.metadata can tell: a *.dist-info on the path.
    dist = root / "site" / "sandboxfake-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sandboxfake\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[conformance.impls]\nsandboxfake = fake_adapter:FakeAdapter\n")
    return root


@pytest.fixture(scope="module")
def runs(sandbox, tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    site = sandbox / "site"
    # Only a not-applicable rule: resolving and running the adapter without importing Paddle.
    one = ["--rule", "LEVEL-SHARED-LAST"]
    jobs = {
        "file": (["test_sandbox.py", "--impl=fake_adapter.py:FakeAdapter"], sandbox, [sandbox], out / "file.json"),
        "module": (["test_sandbox.py", "--impl=fake_adapter:FakeAdapter", *one], sandbox, [sandbox], out / "module.json"),
        "entry_point": (["test_sandbox.py", "--impl=sandboxfake", *one], sandbox, [sandbox, site], out / "ep.json"),
        "unknown": (["test_sandbox.py", "--impl=nosuch"], sandbox, [sandbox, site], None),
        "no_impl": (["test_sandbox.py"], sandbox, [sandbox], None),
        "bad_markers": (["bad", "--impl=fake_adapter:FakeAdapter"], sandbox, [sandbox], None),
        "unknown_rule": (["test_sandbox.py", "--impl=fake_adapter:FakeAdapter", "--rule", "NO-SUCH-RULE"], sandbox, [sandbox], None),
        "bad_opt": (["test_sandbox.py", "--impl=fake_adapter:FakeAdapter", "--impl-opt", "novalue"], sandbox, [sandbox], None),
        # Broken adapters: usage errors naming the file and the line, never an INTERNALERROR.
        "syntax_error": (["test_sandbox.py", "--impl=broken_adapter.py:Broken"], sandbox, [sandbox], None),
        "raising_init": (["test_sandbox.py", "--impl=fake_adapter.py:RaisingAdapter"], sandbox, [sandbox], None),
        "raising_factory": (["test_sandbox.py", "--impl=fake_adapter:raising_factory"], sandbox, [sandbox], None),
        "str_caps": (["test_sandbox.py", "--impl=fake_adapter:StrCapsAdapter"], sandbox, [sandbox], None),
        # Runs that test nothing: no capability claimed, -k matching only plain tests, -k matching nothing.
        "no_caps": (["test_sandbox.py", "--impl=fake_adapter:NoCapsAdapter", "--rule", "SNAP-GPU-ID", "--rule",
                     "LEVEL-SHARED-LAST"], sandbox, [sandbox], out / "nocaps.json"),
        "k_plain": (["test_sandbox.py", "--impl=fake_adapter:FakeAdapter", "-k", "plain"], sandbox, [sandbox], out / "kplain.json"),
        "k_none": (["test_sandbox.py", "--impl=fake_adapter:FakeAdapter", "-k", "nosuchtest"], sandbox, [sandbox], out / "knone.json"),
        "k_plain_counted": (["test_sandbox.py", "--impl=fake_adapter:FakeAdapter", "-k", "plain", "--project-tests-count"],
                            sandbox, [sandbox], out / "kplaincounted.json"),
        "k_none_counted": (["test_sandbox.py", "--impl=fake_adapter:FakeAdapter", "-k", "nosuchtest", "--project-tests-count"],
                           sandbox, [sandbox], out / "knonecounted.json"),
        # A project test failing first under -x (as mutmut runs): no conformance test reaches a verdict.
        "plain_fails_first": (["test_project_first.py", "test_sandbox.py", "--impl=fake_adapter:FakeAdapter", "-x",
                               "-k", "fails or test_passes"], sandbox, [sandbox], out / "plainfailsfirst.json"),
        # The real suite against a loader claiming nothing: every test must declare what it needs.
        "nocaps_suite": (["conformance", "--impl=fake_adapter:NoCapsAdapter"], REPO, [sandbox], out / "nocaps_suite.json"),
        # The real suite: by built-in name from conformance/, and (the docs example) from the root.
        "conformance_cwd": (["--impl=reference", "--rule", "SNAP-GPU-ID"], os.path.join(REPO, "conformance"), [], out / "cwd.json"),
        "docs_example": (
            ["conformance", "--impl=docs/example_adapter.py:MineAdapter", "--rule", "SNAP-NAME-SINGLE", "--rule", "SNAP-GPU-ID"],
            REPO, [], out / "docs.json",
        ),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_pytest, args, cwd, paths, report) for name, (args, cwd, paths, report) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _rule(report, rule_id):
    found = [r for r in report["rules"] if r["id"] == rule_id]
    assert found, f"rule {rule_id} missing from report; rules: {[r['id'] for r in report['rules']]}"
    return found[0]


def _statuses(report):
    return {r["id"]: r["status"] for r in report["rules"]}


# -- --impl forms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("form,where", [
    ("file", "fake_adapter.py:FakeAdapter"),
    ("module", "fake_adapter:FakeAdapter"),
    ("entry_point", "entry point conformance.impls:sandboxfake = fake_adapter:FakeAdapter"),
])
def test_every_impl_form_resolves_and_runs(runs, form, where):
    run = runs[form]
    assert run.report is not None, f"{form}: no report (exit {run.code}):\n{run.output[-3000:]}"
    assert run.report["run_info"]["adapter"] == where, run.report["run_info"]
    assert run.report["run_info"]["implementation"] == "fake", run.report["run_info"]
    if form == "file":
        assert _statuses(run.report)["SNAP-GPU-ID"] == "passed", f"{form}:\n{run.output[-3000:]}"
    else:
        assert _statuses(run.report) == {"LEVEL-SHARED-LAST": "not_applicable"}, f"{form}:\n{run.output[-3000:]}"


def test_builtin_name_from_conformance_dir_and_file_from_repo_root(runs):
    """``cd conformance && pytest --impl=reference`` finds --impl (the root conftest registers the plugin)."""
    run = runs["conformance_cwd"]
    assert run.code == 0 and run.report is not None, f"exit {run.code}:\n{run.output[-3000:]}"
    assert run.report["run_info"]["implementation"] == "reference"
    assert run.report["run_info"]["adapter"] == "weightsync.reference.adapter:ReferenceAdapter"
    assert _statuses(run.report) == {"SNAP-GPU-ID": "passed"}, _statuses(run.report)
    # From the repository root: see test_docs_example_adapter_passes_its_rules.


def test_unknown_name_is_usage_error_naming_known_ones(runs):
    run = runs["unknown"]
    assert run.code == USAGE_ERROR, f"exit {run.code}:\n{run.output[-2000:]}"
    assert "unknown implementation 'nosuch'" in run.output, run.output[-2000:]
    for known in ("reference", "fastdeploy", "sandboxfake"):
        assert known in run.output, f"known name {known} not listed:\n{run.output[-2000:]}"


def test_conformance_tests_without_impl_are_usage_error(runs):
    run = runs["no_impl"]
    assert run.code == USAGE_ERROR, f"exit {run.code}:\n{run.output[-2000:]}"
    assert "conformance tests need --impl" in run.output and "reference" in run.output, run.output[-2000:]


def test_impl_opt_without_value_is_usage_error(runs):
    run = runs["bad_opt"]
    assert run.code == USAGE_ERROR and "expected KEY=VALUE" in run.output, run.output[-2000:]


def _line_of(text: str, marker: str) -> int:
    """The line number of ``marker`` in a file written from ``text``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)


BROKEN = {
    "syntax_error": ("broken_adapter.py", r"broken_adapter\.py failed to import: SyntaxError: .* at \S*broken_adapter\.py, "
                                          rf"line {_line_of(BROKEN_ADAPTER, 'class Broken(:')}$"),
    "raising_init": ("fake_adapter.py", r"RaisingAdapter\(\) raised RuntimeError: no GPU visible to the adapter at "
                                        rf"\S*fake_adapter\.py, line {_line_of(FAKE_ADAPTER, 'RAISES-IN-INIT')}$"),
    "raising_factory": ("fake_adapter.py", r"raising_factory\(\) raised KeyError: 'engine' at \S*fake_adapter\.py, "
                                           rf"line {_line_of(FAKE_ADAPTER, 'RAISES-IN-FACTORY')}$"),
    "str_caps": ("fake_adapter", r"capabilities must be a collection of names, such as frozenset\(\{'snapshot\.single'\}\); "
                                 r"got the str 'snapshot\.single'"),
}


@pytest.mark.parametrize("form", list(BROKEN))
def test_a_broken_adapter_is_a_usage_error_naming_the_file_and_line(runs, sandbox, form):
    """A SyntaxError in the adapter file, a constructor or factory that raises, capabilities given as
    one str: exit 4 with one line naming the file and the line (or the value), not an INTERNALERROR."""
    run = runs[form]
    name, pattern = BROKEN[form]
    assert run.code == USAGE_ERROR, f"{form}: exit {run.code}, expected {USAGE_ERROR}:\n{run.output[-3000:]}"
    assert "INTERNALERROR" not in run.output and "Traceback" not in run.output, f"{form}:\n{run.output[-3000:]}"
    error = [line for line in run.output.splitlines() if line.startswith("ERROR:")]
    assert len(error) == 1 and re.search(pattern, error[0]) and name in error[0], \
        f"{form}: expected one ERROR line matching {pattern!r}:\n{run.output[-3000:]}"


def test_capabilities_must_be_a_collection_of_names():
    from conformance.capabilities import validate

    assert validate(["snapshot.single"]) == frozenset({"snapshot.single"}) == validate(("snapshot.single",))
    assert validate(frozenset()) == frozenset()
    for bad, message in (("snapshot.single", "got the str 'snapshot.single'"), (b"ipc.meta", "got the bytes b'ipc.meta'"),
                         (3, "got int 3"), ([None], "must be names (str), got [None]")):
        with pytest.raises(ValueError, match=re.escape(message)):
            validate(bad)


# -- markers and --rule ---------------------------------------------------------------------------
def test_unknown_rule_missing_rule_and_unknown_capability_are_usage_errors(runs):
    run = runs["bad_markers"]
    assert run.code == USAGE_ERROR, f"exit {run.code}:\n{run.output[-2000:]}"
    for expected in (
        "test_unknown_rule: rule 'NOT-A-RULE' is not defined in SPEC.md",
        "test_missing_rule: needs exactly one @pytest.mark.rule('ID')",
        "test_unknown_capability: unknown capabilities ['telepathy']",
        "test_marked_xfail: a conformance test cannot be marked xfail",
    ):
        assert expected in run.output, f"{expected!r} not reported:\n{run.output[-2000:]}"


def test_unknown_rule_selection_is_usage_error(runs):
    run = runs["unknown_rule"]
    assert run.code == USAGE_ERROR and "NO-SUCH-RULE" in run.output, run.output[-2000:]


def test_rule_selection_runs_only_those_rules(runs):
    report = runs["docs_example"].report
    assert {t["rule"] for t in report["tests"]} == {"SNAP-NAME-SINGLE", "SNAP-GPU-ID"}, report["tests"]
    assert "deselected" in runs["docs_example"].output
    assert {t["rule"] for t in runs["module"].report["tests"]} == {"LEVEL-SHARED-LAST"}


# -- statuses, vacuity, not_applicable ------------------------------------------------------------
def test_missing_capability_is_not_applicable_never_passed(runs):
    run = runs["file"]
    rule = _rule(run.report, "LEVEL-SHARED-LAST")
    assert rule["status"] == "not_applicable", rule
    assert "does not claim snapshot.shared_fallback" in rule["tests"][0]["message"], rule
    # The table counts it under "not applicable" for its area.
    row = next(line for line in run.output.splitlines() if re.match(r"\W*LEVEL\W", line))
    counts = [int(c) for c in re.findall(r"\d+", row)]
    assert counts == [0, 0, 0, 0, 0, 0, 1, 0], \
        f"LEVEL row (passed, failed contract, failed hardening, error, expected, unexpected pass, n/a, skipped): {row!r}"


def test_vacuous_tests_fail(runs):
    status = _statuses(runs["file"].report)
    assert status["SNAP-NAME-PARTS"] == "failed" and status["SNAP-RANK-OWN-SHARD"] == "failed", status
    no_call = _rule(runs["file"].report, "SNAP-NAME-PARTS")["tests"][0]["message"]
    no_check = _rule(runs["file"].report, "SNAP-RANK-OWN-SHARD")["tests"][0]["message"]
    assert "vacuous conformance test" in no_call and "adapter calls=0" in no_call, no_call
    assert "vacuous conformance test" in no_check and "checks=0" in no_check, no_check


def test_plain_tests_are_not_conformance_tests(runs):
    report = runs["file"].report
    assert not [t for t in report["tests"] if "plain" in t["nodeid"]]
    # test_passes and the plain test pass; the plain test is neither vacuous nor in the report.
    assert re.search(r"\b2 passed\b", runs["file"].output), runs["file"].output[-1500:]


def test_self_skip_from_the_body_is_an_error(runs):
    """A conformance test that calls pytest.skip()/pytest.xfail() itself hides what it would have
    found: an error, unless its reason says not_applicable (a capability it found missing)."""
    report = runs["file"].report
    skipped = _rule(report, "PART-ORDER-NUMERIC")
    assert skipped["status"] == "error", skipped
    assert "called pytest.skip() from its body" in skipped["tests"][0]["message"], skipped
    assert "no GPU on this machine" in skipped["tests"][0]["message"], skipped
    xfailed = _rule(report, "PART-INDEX-BASENAME")
    assert xfailed["status"] == "error" and "pytest.xfail()" in xfailed["tests"][0]["message"], xfailed
    own_na = _rule(report, "PART-LABEL-INDEX")
    assert own_na["status"] == "not_applicable", own_na
    assert "fake cannot label parts" in own_na["tests"][0]["message"], own_na
    row = next(line for line in runs["file"].output.splitlines() if re.match(r"\W*PART\W", line))
    counts = [int(c) for c in re.findall(r"\d+", row)]
    assert counts == [0, 0, 0, 2, 0, 0, 1, 0], \
        f"PART row (passed, failed contract, failed hardening, error, expected, unexpected pass, n/a, skipped): {row!r}"


# -- a run that tests nothing fails ---------------------------------------------------------------
NOTHING_TESTED = 5


def test_no_capability_claimed_tests_nothing_and_fails(runs):
    run = runs["no_caps"]
    expected = ("no conformance rule was applicable to nocaps: it claims capabilities []; of 2 selected test(s) "
                "of 2 rule(s), 2 not applicable; nothing was tested")
    assert run.code == NOTHING_TESTED, f"exit {run.code}:\n{run.output[-3000:]}"
    assert "NOTHING TESTED: " + expected in run.output, run.output[-3000:]
    assert run.report["summary"]["nothing_tested"] == expected, run.report["summary"]
    assert run.report["summary"]["tests"]["not_applicable"] == 2, run.report["summary"]
    # The plain project test in the same run passed; it does not make the run a conformance pass.
    assert re.search(r"\b1 passed\b", run.output), run.output[-1500:]


def test_rule_selection_with_only_not_applicable_tests_fails(runs):
    run = runs["module"]
    assert run.code == NOTHING_TESTED, f"exit {run.code}:\n{run.output[-3000:]}"
    assert "no conformance rule was applicable to fake: it claims capabilities [snapshot.single]" in run.output
    assert run.report["summary"]["nothing_tested"].endswith("nothing was tested"), run.report["summary"]


def test_every_conformance_test_declares_the_capabilities_it_needs(runs):
    """Against a loader claiming no capability, the whole suite is not applicable: a test that
    requires nothing would run against a loader that implements nothing."""
    run = runs["nocaps_suite"]
    assert run.report is not None, f"exit {run.code}:\n{run.output[-3000:]}"
    ran = [t["nodeid"] for t in run.report["tests"] if t["status"] != "not_applicable"]
    assert not ran, f"conformance tests requiring no capability: {ran[:20]}"
    assert run.code == NOTHING_TESTED and run.report["summary"]["nothing_tested"], run.output[-2000:]


@pytest.mark.parametrize("form", ["k_plain", "k_none"])
def test_no_conformance_test_collected_with_impl_fails(runs, form):
    run = runs[form]
    expected = ("no conformance test was collected for fake (--impl=fake_adapter:FakeAdapter): the paths, -k/-m "
                "expressions or --rule selection matched none; nothing was tested")
    assert run.code == NOTHING_TESTED, f"{form}: exit {run.code}:\n{run.output[-3000:]}"
    assert "NOTHING TESTED: " + expected in run.output, run.output[-3000:]
    assert run.report["summary"]["nothing_tested"] == expected and run.report["tests"] == [], run.report
    if form == "k_plain":  # the plain test ran and passed; still nothing of the implementation was tested
        assert re.search(r"\b1 passed\b", run.output), run.output[-1500:]


def test_project_tests_count_only_when_asked_and_only_when_they_ran(runs):
    """mutmut runs only the tests reaching a mutant: for some mutants that is a project test alone, which
    --project-tests-count lets count; a run where nothing at all ran is still nothing tested."""
    run = runs["k_plain_counted"]
    assert run.code == 0 and "NOTHING TESTED" not in run.output, f"exit {run.code}:\n{run.output[-3000:]}"
    assert re.search(r"\b1 passed\b", run.output), run.output[-1500:]
    run = runs["k_none_counted"]
    assert run.code == NOTHING_TESTED and "NOTHING TESTED: no conformance test was collected" in run.output, \
        f"exit {run.code}:\n{run.output[-3000:]}"


def test_a_failed_project_test_fails_the_run_even_when_nothing_else_was_tested(runs):
    """Under -x a failing project test stops the run before any conformance test: the run failed (1), it
    did not test nothing (5, which mutmut reads as 'no tests' and would record a killed mutant as a survivor)."""
    run = runs["plain_fails_first"]
    assert run.code == 1, f"exit {run.code}:\n{run.output[-3000:]}"
    assert re.search(r"\b1 failed\b", run.output), run.output[-1500:]


def test_a_run_that_tested_something_is_not_flagged(runs):
    for form in ("file", "conformance_cwd", "docs_example"):
        run = runs[form]
        assert "NOTHING TESTED" not in run.output, f"{form}:\n{run.output[-2000:]}"
        assert run.report["summary"]["nothing_tested"] is None, (form, run.report["summary"])
    assert runs["conformance_cwd"].code == 0 and runs["docs_example"].code == 0
    assert runs["file"].code == 1  # failures, not "nothing tested"


# -- the JSON report ------------------------------------------------------------------------------
def test_report_fields(runs):
    report = runs["file"].report
    info = report["run_info"]
    assert info["implementation"] == "fake" and info["implementation_version"] == "9.9", info
    assert info["adapter"] == "fake_adapter.py:FakeAdapter" and info["capabilities"] == ["snapshot.single"], info
    for key in ("suite_version", "suite_protocol", "python", "platform"):
        assert info[key], f"run_info.{key} empty: {info}"
    assert {"paddlepaddle", "safetensors", "numpy"} <= set(info["versions"]), info["versions"]
    assert info["versions"]["numpy"] == np.__version__
    for rule in report["rules"]:
        assert set(rule) == {"id", "title", "area", "level", "device", "status", "expectation", "modes", "tests"}, rule
        assert rule["title"] == rules()[rule["id"]]
        for test in rule["tests"]:
            assert {"nodeid", "rule", "status", "message", "repro"} <= set(test), test
            assert test["rule"] == rule["id"]
    failed = _rule(report, "SNAP-NAME-SINGLE")
    message = failed["tests"][0]["message"]
    assert failed["status"] == "failed", failed
    assert "tensor w in /m/model_state.tp0.0.pdparams" in message and "'NORMAL'" in message and "'CLEARED'" in message, message
    assert _rule(report, "SNAP-GPU-ID")["tests"][0]["message"] == ""


def test_report_summary_counts_tests_and_rules_per_status(runs):
    report = runs["file"].report
    summary = report["summary"]
    assert set(summary) == {"tests", "rules", "rules_failing_by_level", "fail_on", "nothing_tested"}, summary
    tests = {s: 0 for s in ("passed", "failed", "error", "not_applicable", "skipped", "expected_failure",
                            "unexpected_pass", "not_run")}
    for test in report["tests"]:
        tests[test["status"] or "not_run"] += 1
    assert summary["tests"] == tests, summary
    assert summary["tests"] == {"passed": 1, "failed": 3, "error": 2, "not_applicable": 2, "skipped": 0,
                                "expected_failure": 0, "unexpected_pass": 0, "not_run": 0}, summary
    rules_by_status = {s: 0 for s in ("passed", "failed", "error", "not_applicable", "skipped", "expected_failure",
                                      "unexpected_pass")}
    for rule in report["rules"]:
        rules_by_status[rule["status"]] += 1
    assert summary["rules"] == rules_by_status, summary
    assert summary["nothing_tested"] is None


def test_repro_is_a_runnable_command(runs, sandbox):
    test = _rule(runs["file"].report, "SNAP-NAME-SINGLE")["tests"][0]
    assert test["repro"] == f"{sys.executable} -m pytest test_sandbox.py::test_fails --impl=fake_adapter.py:FakeAdapter", \
        test["repro"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sandbox), REPO]))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(test["repro"], shell=True, cwd=sandbox, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and re.search(r"\b1 failed\b", output) and "test_fails" in output, output[-2000:]


def test_repro_carries_impl_options(tmp_path):
    """--impl-opt values are part of the command (a mutant or a FastDeploy source needs them)."""
    from conformance.plugin import repro_command

    class Config:
        options = {"--impl": "tests.mutants:mutant", "--impl-opt": ["name=x y", "source=a.py"]}
        rootpath = tmp_path
        invocation_params = type("Params", (), {"dir": tmp_path / "conformance"})

        def getoption(self, name):
            return self.options[name]

    command = repro_command(Config(), "conformance/test_a.py::test_b[p-1]")
    assert command == (f"{sys.executable} -m pytest 'test_a.py::test_b[p-1]' --impl=tests.mutants:mutant "
                       "'--impl-opt=name=x y' --impl-opt=source=a.py"), command


def test_docs_example_adapter_passes_its_rules(runs):
    run = runs["docs_example"]
    assert run.code == 0 and run.report is not None, f"exit {run.code}:\n{run.output[-3000:]}"
    assert _statuses(run.report) == {"SNAP-NAME-SINGLE": "passed", "SNAP-GPU-ID": "passed"}, _statuses(run.report)
    assert run.report["run_info"]["implementation"] == "mine"


# -- check helpers (in process) -------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["", "a*", "(x)?", ".*", "|foo"])
def test_check_raises_refuses_pattern_matching_empty_string(pattern):
    with pytest.raises(ValueError, match="matches the empty string"):
        with check.raises(RuntimeError, match=pattern, where="x"):
            raise RuntimeError("anything")


def test_check_raises_requires_named_things():
    with pytest.raises(AssertionError, match=r"does not name \['norm.bias'\]"):
        with check.raises(ValueError, match="Shape mismatch", names=["norm.bias"], where="x"):
            raise ValueError("Shape mismatch for embed.weight")


def test_check_raises_failure_names_the_case_and_what_was_expected():
    """Nothing raised, or another type raised: the message names the case (``where``: file, tensor,
    dtypes) and the expected type, pattern and names, not pytest's bare "DID NOT RAISE ValueError"."""
    where = "/m/model_state.tp0.0.pdparams: w float32 into a bfloat16 parameter"
    with pytest.raises(AssertionError) as info:
        with check.raises(TypeError, match="Type mismatch", names=["w"], where=where):
            pass
    assert str(info.value) == (f"{where}: expected TypeError with a message matching 'Type mismatch' and naming ['w']; "
                               "nothing was raised (DID NOT RAISE)"), str(info.value)
    with pytest.raises(AssertionError) as info:
        with check.raises((ValueError, TypeError), match="Shape", where=where):
            raise KeyError("w")
    assert str(info.value) == f"{where}: expected ValueError or TypeError with a message matching 'Shape'; got KeyError: 'w'"
    assert isinstance(info.value.__cause__, KeyError), "the implementation's exception is kept as the cause"
    with check.raises(ValueError, match="Shape", where=where) as got:
        raise ValueError("Shape mismatch for w")
    assert isinstance(got.value, ValueError) and str(got.value) == "Shape mismatch for w", "the exception is handed back"
    with pytest.raises(TypeError):
        with check.raises(ValueError, match="Shape"):  # where= is required
            raise ValueError("Shape")
    with pytest.raises(ValueError, match="where= must name the case"):
        with check.raises(ValueError, match="Shape", where=" "):
            raise ValueError("Shape")


def test_check_refused_names_the_case():
    with pytest.raises(AssertionError, match=r"^rank 1, update from a file with dtype: expected ValueError or "
                                             r"RuntimeError; nothing was raised \(DID NOT RAISE\)$"):
        with check.refused((ValueError, RuntimeError), where="rank 1, update from a file with dtype"):
            pass
    with check.refused(RuntimeError, where="x") as got:
        raise RuntimeError("any message")
    assert str(got.value) == "any message"


def test_params_equal_names_tensor_and_both_values():
    want = {"layers.0.w": np.array([1.0, 2.0, 3.0], dtype=np.float32), "b": np.zeros(2, np.float16)}
    got = {
        "layers.0.w": Observed("float32", (3,), np.array([1.0, 2.5, 3.0], dtype=np.float32).tobytes()),
        "b": Observed("float16", (2,), None),
    }
    with pytest.raises(pytest.fail.Exception) as info:
        check.params_equal(got, want, "worker rank=1 gpu=2")
    message = str(info.value)
    assert "worker rank=1 gpu=2: 2 tensor(s) wrong" in message, message
    assert "layers.0.w: values differ (first at element 1): got [1.0, 2.5, 3.0]" in message, message
    assert "expected [1.0, 2.0, 3.0]" in message, message
    assert "b: values differ: got <not loaded>, expected [0.0, 0.0]" in message, message


def test_params_equal_reports_dtype_shape_and_absent_tensor():
    want = {"a": np.zeros((2, 2), np.float32), "gone": np.zeros(1, np.int64)}
    got = {"a": Observed("bfloat16", (4,), b"\0" * 8)}
    with pytest.raises(pytest.fail.Exception) as info:
        check.params_equal(got, want, "here")
    message = str(info.value)
    assert "a: got bfloat16[4], expected float32[2, 2]" in message, message
    assert "gone: not a parameter of the model (expected int64[1])" in message, message


# -- resource and status checks, harness helpers (in process) -------------------------------------
def test_no_open_files_sees_descriptors_mappings_and_deleted_files(tmp_path):
    import mmap

    path = tmp_path / "model_state.tp0.0.pdparams"
    path.write_bytes(b"x" * 4096)
    before = check.count()
    check.no_open_files(tmp_path, "nothing open")
    f = open(path, "rb")
    view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        held = check.open_files_under(tmp_path)
        assert any(h.startswith("fd ") and h.endswith(str(path)) for h in held), held
        assert any(h.startswith("mapped ") and h.endswith(str(path)) for h in held), held
        f.close()
        for target in (tmp_path, str(path), [str(tmp_path / "other"), path]):
            with pytest.raises(AssertionError, match=r"after update: the process still holds .*mapped .*tp0\.0\.pdparams"):
                check.no_open_files(target, "after update")
        check.no_open_files(tmp_path / "other", "a sibling name is not the file")
    finally:
        view.close()
        f.close()
    check.no_open_files([path], "all released")
    g = open(path, "rb")
    os.unlink(path)
    try:
        with pytest.raises(AssertionError, match=r"tp0\.0\.pdparams \(deleted\)"):
            check.no_open_files(tmp_path, "deleted but held")
    finally:
        g.close()
    assert check.count() == before + 7


def test_no_new_threads_allows_a_grace_and_names_the_stuck_thread():
    import threading
    import time

    before = check.live_threads()
    finishing = threading.Thread(target=time.sleep, args=(0.05,))
    finishing.start()
    check.no_new_threads(before, "a thread ending within the grace period")
    stop = threading.Event()
    stuck = threading.Thread(target=stop.wait, name="loader-receiver", daemon=True)
    stuck.start()
    try:
        with pytest.raises(AssertionError, match=r"after close: 1 thread\(s\) left running .*loader-receiver"):
            check.no_new_threads(before, "after close", grace_s=0.05)
        check.no_new_threads([*threading.enumerate()], "threads given as objects")
    finally:
        stop.set()
        stuck.join()


def test_is_status_and_no_new_shm(tmp_path):
    class Session:
        def status(self):
            return "UPDATING"

    check.is_status(Session(), {"UPDATING", "CLEARED"}, "mid-update")
    check.is_status(Session(), "UPDATING", "a single name")
    with pytest.raises(AssertionError, match=r"after failure: status got UPDATING, expected one of \['CLEARED', 'NORMAL'\]"):
        check.is_status(Session(), {"NORMAL", "CLEARED"}, "after failure")
    before = check.shm_entries(str(tmp_path))
    check.no_new_shm(before, "none yet", directory=str(tmp_path))
    (tmp_path / "wsync-seg-1").write_bytes(b"")
    with pytest.raises(AssertionError, match=r"left in .*\['wsync-seg-1'\]"):
        check.no_new_shm(before, "after the trainer closed", directory=str(tmp_path))


def test_in_child_returns_results_counts_calls_and_fails_with_the_childs_error():
    from conformance import harness

    def child(n):
        check.that(True, "in the child")
        harness._calls["adapter"] += n
        return {"pid": os.getpid(), "peak": harness.peak_rss_kib()}

    harness.reset()
    checks = check.count()
    result = harness.in_child(child, 3)
    assert result["pid"] != os.getpid() and result["peak"] > 0, result
    assert harness.adapter_calls() == 3 and check.count() == checks + 1

    def fails():
        check.that(False, "child check: tensor w got 1, expected 2")

    with pytest.raises(AssertionError, match=r"in the forked child: AssertionError: child check: tensor w got 1, expected 2"):
        harness.in_child(fails)

    def dies():
        os.kill(os.getpid(), 9)

    with pytest.raises(AssertionError, match=r"died without a result .*signal 9"):
        harness.in_child(dies)

    def hangs():
        import time

        time.sleep(30)

    with pytest.raises(AssertionError, match=r"ran past 0\.2s"):
        harness.in_child(hangs, timeout_s=0.2)


def test_status_watcher_sees_the_status_during_an_action():
    import time

    from conformance import harness

    class Session:
        state = "CLEARED"

        def status(self):
            return self.state

    session = Session()
    with harness.StatusWatcher(session) as watch:
        session.state = "UPDATING"
        until = time.monotonic() + 30.0  # (its thread has just started: on a loaded machine it may not have run yet)
        while not ("UPDATING" in watch.seen and watch.polls > 3) and time.monotonic() < until:
            time.sleep(0.005)
        session.state = "NORMAL"
    assert watch.seen == ["CLEARED", "UPDATING", "NORMAL"] and not watch.errors and watch.polls > 3, (watch.seen, watch.polls)


# -- output within the terminal's width -----------------------------------------------------------
class _Reporter:
    """What the plugin's printers use of pytest's terminal reporter, into a string."""

    def __init__(self):
        import io

        from _pytest._io import TerminalWriter

        self.buf = io.StringIO()
        self._tw = TerminalWriter(file=self.buf)

    def write_line(self, line, **markup):
        self._tw.line(line)


@pytest.mark.parametrize("columns", ["80", "120", ""])
def test_list_rules_and_area_table_fit_columns(monkeypatch, columns):
    """``--list-rules`` (230 columns before) and the area table (130 whatever COLUMNS said) fit COLUMNS, or 130
    columns where output goes to no terminal; every rule id starts a line with its level and area, and a line of
    the modes table with its mode coverage."""
    from conformance import plugin

    monkeypatch.setenv("COLUMNS", columns)
    width = int(columns or plugin.NATURAL_WIDTH)
    caps = ",".join(sorted(plugin.CAPABILITIES))[:148]  # as long as MODEL-HOOKS' capabilities
    modes = ("path(parts, single, legacy, shared, ipc, bucket, rsync, gdr) × staged(plain, staged): 10/16 pairs; "
             "uncovered: path=rsync & staged=staged, path=gdr & staged=plain")
    listing = [("MODEL-HOOKS", "contract", "MODEL", caps, rules()["MODEL-HOOKS"], modes),
               ("SNAP-GPU-ID", "contract", "SNAP", "snapshot.single", rules()["SNAP-GPU-ID"], "n/a (a naming rule)")]
    reporter = _Reporter()
    plugin._print_listing(reporter, listing)
    lines = reporter.buf.getvalue().splitlines()
    assert max(map(len, lines)) <= width, f"COLUMNS={columns!r}: widest line {max(map(len, lines))}:\n" + "\n".join(lines)
    for rule_id, level, area_name, *_ in listing:
        assert any(re.match(rf"{rule_id}\s+{level}\s+{area_name}\s", line) for line in lines), "\n".join(lines)
    squeezed = re.sub(r"\s", "", reporter.buf.getvalue())
    assert "SNAP-GPU-IDcontractSNAPsnapshot.single" in squeezed, "a short row stays on one line"
    assert re.sub(r"\s", "", "MODEL-HOOKS" + modes) in squeezed, "the modes table holds the whole coverage, uncovered pairs included"
    assert "SNAP-GPU-IDn/a(anamingrule)" in squeezed

    class Adapter:
        name, version = "fake", "1"

    results = {f"t{i}": {"rule": r, "level": "contract", "status": "passed"} for i, r in enumerate(list(rules())[:20])}
    reporter = _Reporter()
    plugin._print_table(reporter, Adapter, results, {r["rule"]: "passed" for r in results.values()})
    lines = reporter.buf.getvalue().splitlines()
    assert max(map(len, lines)) <= width and any("all" in line for line in lines), reporter.buf.getvalue()


def test_header_explains_the_env_line(monkeypatch):
    from types import SimpleNamespace

    from conformance import plugin

    adapter = SimpleNamespace(name="fake", version="1", capabilities=frozenset(), _conformance_where="here")
    config = SimpleNamespace(stash={plugin.ADAPTER_KEY: adapter}, getoption=lambda name: None)
    for key in [k for k in os.environ if k.startswith("CONFORMANCE_")]:
        monkeypatch.delenv(key)
    line = next(line for line in plugin.pytest_report_header(config) if "env" in line)
    assert line.startswith("conformance: env: none set (CONFORMANCE_LOOP_SEED replays one seed") and "{}" not in line, line
    monkeypatch.setenv("CONFORMANCE_LOOP_SEED", "7")
    line = next(line for line in plugin.pytest_report_header(config) if "env" in line)
    assert line.endswith("set in this run: {'CONFORMANCE_LOOP_SEED': '7'}"), line
