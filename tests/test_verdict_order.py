"""A rule's verdict never depends on which tests ran before it (the guide: "one behaviour, one verdict").

The GDR stand-in (tests/fd_standins/gdr) is run through the streamed areas in company (every rule of GDR and
STREAM in one process, in the suite's order) and each rule of ORDER_RULES alone (``--rule ID``);
each rule's status must be the same both ways. The rules are those whose tests share the most process
state across tests: the library stand-in's handles, the adapter's stream world, the trainer's record.
A difference names the rule and both outcomes.
"""
from __future__ import annotations

import concurrent.futures
import os

import pytest

from conformance.spec import rules
from tests.conftest import REPO, run_conformance

pytestmark = pytest.mark.timeout(900)

STANDIN = os.path.join("tests", "fd_standins", "gdr", "dynamic_weight_manager.py")
AREAS = ("GDR-", "STREAM-")
ORDER_RULES = ("GDR-HANDLE-REUSE", "GDR-HANDLE-CLEANUP", "GDR-RECEIVER-ERROR", "GDR-CONSUMER-ERROR",
               "STREAM-NO-LEAK")


def _statuses(report) -> dict[str, str]:
    return {r["id"]: r["status"] for r in report["rules"]}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """(company: rule -> status, alone: rule -> status) for the GDR stand-in."""
    root = tmp_path_factory.mktemp("order")
    impl = ["--impl=fastdeploy", f"--impl-opt=source={STANDIN}"]
    company_rules = [r for r in rules() if r.startswith(AREAS)]

    def run(name, selected):
        code, report, output = run_conformance(impl, root / f"{name}.json", [f"--rule={r}" for r in selected])
        assert report is not None, f"{name}: no report (exit {code}):\n{output[-3000:]}"
        return name, report

    jobs = [("company", company_rules)] + [(rule, [rule]) for rule in ORDER_RULES]
    # All at once: the stand-in's stream cases mostly wait (deadlines, a stalled trainer), not compute.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        reports = dict(pool.map(lambda job: run(*job), jobs))
    alone = {rule: _statuses(reports[rule]).get(rule, "not run") for rule in ORDER_RULES}
    return _statuses(reports["company"]), alone


def test_rules_run_alone_and_in_company_get_the_same_verdict(verdicts):
    company, alone = verdicts
    assert set(ORDER_RULES) <= set(company), f"rules missing from the company run: {set(ORDER_RULES) - set(company)}"
    differ = {rule: f"alone {alone[rule]}, in company {company[rule]}" for rule in ORDER_RULES if alone[rule] != company[rule]}
    assert not differ, f"verdicts that depend on the tests run before them ({STANDIN}): {differ}"


def test_the_order_check_sees_both_verdicts(verdicts):
    """Not vacuous: the stand-in passes some of these rules and fails another (its cancelled handle kept)."""
    _, alone = verdicts
    assert alone["GDR-HANDLE-REUSE"] == "passed" and alone["GDR-HANDLE-CLEANUP"] == "failed", alone
