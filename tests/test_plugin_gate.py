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
from conformance.spec import area, devices, levels, rules
from tests import early, pytest_server
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
        "stale_xdist": impl + ["--expectations=stale.toml", "-n", "2"],
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
    # Under pytest-xdist the workers find it: the same usage error, named (never an INTERNALERROR), nothing run.
    run = runs["stale_xdist"]
    assert run.code == USAGE_ERROR, run.output[-2000:]
    assert "ERROR: --expectations stale.toml: entry 4 (id = 'test_gate.py::test_gone') matches no conformance test" \
        in run.output and "INTERNALERROR" not in run.output, run.output[-2000:]
    # An entry for a rule this run deselects still matches a collected test: no error.
    run = runs["stale_deselected"]
    assert run.code == 0 and set(_rule_status(run.report)) == {PASSING}, run.output[-2000:]
    # Entries for modules the run did not collect, or a rule entry in a run of part of the suite: unchecked.
    run = runs["other_module"]
    assert run.code == 0, run.output[-2000:]


def test_a_malformed_or_missing_file_is_a_usage_error_naming_it(runs):
    run = runs["no_reason"]
    assert run.code == USAGE_ERROR and "no_reason.toml: entry 1" in run.output and "a reason is required" in run.output, \
        run.output[-2000:]
    run = runs["missing_file"]
    assert run.code == USAGE_ERROR and "nowhere.toml: cannot read it" in run.output, run.output[-2000:]


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


# -- root causes --------------------------------------------------------------------------------------
def test_one_cause_failing_several_rules_is_said_once(runs):
    causes = runs["plain"].report["root_causes"]
    assert len(causes) == 1 and causes[0]["rules"] == sorted([HARD_A, HARD_B]) and causes[0]["tests"] == 2, causes
    assert "code 13" in causes[0]["example"], causes
    assert "root causes (one failure explaining several rules):" in runs["plain"].output
    assert f"rules: {', '.join(sorted([HARD_A, HARD_B]))}" in runs["plain"].output, runs["plain"].output[-2000:]
    assert runs["all_expected"].report["root_causes"] == [], "expected failures are not root causes to chase"


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


@early.job("reference_xdist")
def _reference_xdist_run(tmp_path_factory):
    from tests.conftest import run_conformance

    path = tmp_path_factory.mktemp("xdist") / "report.json"
    return run_conformance(["--impl=reference", "-n", "2"], path, in_job=True)


@pytest.fixture(scope="module")
def reference_xdist(tmp_path_factory):
    """The reference's full conformance run under ``-n 2``: a background job (tests/early.py), as the serial run
    it is compared with is."""
    return early.result("reference_xdist", tmp_path_factory)


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
    proc = pytest_server.run(["-p", "no:cacheprovider", *args], REPO, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_list_rules_needs_no_impl_and_lists_every_rule():
    code, output = _run_repo(["conformance", "--list-rules"])
    assert code == 0, output[-3000:]
    listed = re.findall(r"^([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+) +(contract|hardening) +(\w+) +([\w.,|-]+) ", output, re.M)
    assert {r[0] for r in listed} == set(rules()), sorted(set(rules()) ^ {r[0] for r in listed})
    for rule_id, level, area_, caps in listed:
        assert level == levels()[rule_id] and area_ == area(rule_id), (rule_id, level, area_)
    caps = {r[0]: r[3] for r in listed}
    assert "ipc.buckets" in caps["BKT-LARGE"], caps["BKT-LARGE"]
    assert f"{len(rules())} rules (SPEC.md):" in output, output[-2000:]
    assert not re.search(r"\d+ (passed|failed)", output), "--list-rules must not run tests"


def test_rule_prefix_selects_the_area_in_a_real_run(reference_report):
    code, output = _run_repo(["conformance", "--impl=reference", "--rule", "LIFE", "--collect-only", "-q"])
    assert code == 0, output[-2000:]
    ids = {line for line in output.splitlines() if "::" in line}
    want = {t["nodeid"] for t in reference_report[1]["tests"] if t["rule"].startswith("LIFE-")}
    assert want and ids == want, (sorted(ids - want)[:5], sorted(want - ids)[:5])
    code, output = _run_repo(["conformance", "--impl=reference", "--rule", "LIFE-STATU", "--collect-only", "-q"])
    assert code == USAGE_ERROR and "did you mean LIFE-STATUS" in output, output[-2000:]
