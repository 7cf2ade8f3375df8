"""The suite's honesty: the reference passes every rule, every mutant dies, every rule is covered."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.spec import rules
from tests.conftest import run_conformance
from tests.mutants import all_mutants

MUTANTS = all_mutants()


def test_reference_passes_every_rule(reference_report):
    code, report, output = reference_report
    assert report is not None, f"no report written; output:\n{output[-3000:]}"
    bad = {r["id"]: r["status"] for r in report["rules"] if r["status"] not in ("passed", "skipped")}
    assert code == 0 and not bad, f"reference fails rules {bad} (exit {code}):\n{output[-3000:]}"


def test_every_spec_rule_has_a_conformance_test(reference_report):
    _, report, output = reference_report
    tested = {t["rule"] for t in report["tests"]}
    untested = [r for r in rules() if r not in tested]
    assert not untested, f"SPEC.md rules with no conformance test: {untested}"


def test_every_spec_rule_is_killed_by_some_mutant():
    killed = set().union(*(m.kills for m in MUTANTS.values()))
    unproven = [r for r in rules() if r not in killed]
    assert not unproven, f"SPEC.md rules no mutant breaks (a test that cannot be shown to fail): {unproven}"


def test_kill_matrix_names_only_known_rules():
    known = set(rules())
    stray = {m: sorted(set(cls.kills) - known) for m, cls in MUTANTS.items() if set(cls.kills) - known}
    assert not stray, f"kill matrix names rules missing from SPEC.md: {stray}"
    empty = [m for m, cls in MUTANTS.items() if not cls.kills or not cls.bug]
    assert not empty, f"mutants without kills or bug description: {empty}"


def _run_mutant(name, tmp_path):
    cls = MUTANTS[name]
    rule_args = [f"--rule={r}" for r in sorted(cls.kills)]
    report_path = tmp_path / f"{name}.json"
    return run_conformance(["--impl=tests.mutants:mutant", f"--impl-opt=name={name}"], report_path, rule_args)


@pytest.fixture(scope="module")
def mutant_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mutants")
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(_run_mutant, name, tmp) for name in MUTANTS}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name, mutant_runs):
    """Every rule in the mutant's kill list fails when the suite runs against it."""
    code, report, output = mutant_runs[name]
    assert report is not None, f"mutant {name}: no report; output:\n{output[-3000:]}"
    status = {r["id"]: r["status"] for r in report["rules"]}
    survived = {r: status.get(r, "not run") for r in MUTANTS[name].kills if status.get(r) != "failed"}
    assert not survived, (
        f"mutant {name} ({MUTANTS[name].bug}) survives rules {survived}; output:\n{output[-2000:]}"
    )
