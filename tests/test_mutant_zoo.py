"""The suite's honesty: the reference passes every rule, every mutant dies, every rule is covered."""
import json
import sys

import pytest

from conformance.spec import rules
from tests import early
from tests.conftest import REPO, probe_collection, unstarted_jobs
from tests.mutants import all_mutants

MUTANTS = all_mutants()
# The whole zoo runs once per session in a fork server; its share of the 120 s per-test budget is
# not enough on a loaded 2-core machine (the last CI ran 308 mutants in 659 s; 345 now): it bounds a hang.
ZOO_TIMEOUT_S = 1800


def _needs_two_hosts(name: str) -> bool:
    """A mutant only the two-host job kills (``--hosts 2`` in its ``zoo_args``: tests/mutants/hosts.py)."""
    return "--hosts" in getattr(MUTANTS[name], "zoo_args", ())


_HOSTS: list = []


def _two_hosts_unavailable() -> str | None:
    """Why the two-host job cannot run here (network namespaces), or None; probed once."""
    if not _HOSTS:
        from sim.hosts import unavailable

        _HOSTS.append(unavailable())
    return _HOSTS[0]


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


@pytest.fixture(scope="module")
def mutant_runs(tmp_path_factory):
    """Every mutant through the rules it must fail, via the fork server (tests/zoo_runner.py): name ->
    (report, the child's output). A background job (tests/early.py): it starts with the session."""
    return early.result("mutant_runs", tmp_path_factory)


@early.job("mutant_runs", prepare=_two_hosts_unavailable)
def _zoo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mutants")
    names = sorted(n for n in MUTANTS if not (_needs_two_hosts(n) and _two_hosts_unavailable()))
    proc = early.run([sys.executable, "-m", "tests.zoo_runner", f"--out={out}", "--jobs=2", *names], REPO, ZOO_TIMEOUT_S,
                     cores=2)
    assert proc.returncode == 0, f"zoo runner failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    runs = {}
    for name in MUTANTS:
        report_path, log_path = out / f"{name}.json", out / f"{name}.log"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        runs[name] = (report, log_path.read_text() if log_path.exists() else "")
    return runs


# Nothing proven only in a tier: the multi-rank rules run in the quick run too (conformance/test_ranks_quick.py,
# forked ranks); the tiers' own modules, whose jobs the zoo starts only for a rule the quick run left alive.
QUICK_AREAS = ("MR-",)
TIER_MODULES = ("conformance/test_multirank.py", "conformance/test_cycles.py")


def _quick_kills(name: str) -> set[str]:
    mutant = MUTANTS[name]
    return {r for r in mutant.kills if r.startswith(QUICK_AREAS) and r not in mutant.tier_only}


def test_tier_only_kills_are_kills_with_reasons():
    stray = {n: sorted(set(m.tier_only) - set(m.kills)) for n, m in MUTANTS.items() if set(m.tier_only) - set(m.kills)}
    assert not stray, f"tier_only names rules the mutant does not kill: {stray}"
    bare = [n for n, m in MUTANTS.items() if any(not str(why).strip() for why in m.tier_only.values())]
    assert not bare, f"tier_only entries without a reason: {bare}"


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> set[str]:
    """The node ids of the cases a quick run leaves to a tier by marker (the ``pairs`` tier's cases of a ``quick: each``
    rule among them): the zoo runs them, and a kill there is not the quick run's."""
    collected = probe_collection("tests.modes_probe", tmp_path_factory.mktemp("zoo-modes") / "cases.json")
    return {c["nodeid"] for cases in collected.values() for c in cases if c["tiers"]}


@pytest.mark.timeout(ZOO_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(n for n in MUTANTS if _quick_kills(n)))
def test_multirank_mutant_dies_in_the_quick_run(name, mutant_runs, tiered):
    """Every multi-rank rule the mutant must fail (but its ``tier_only`` ones) fails in a test outside the tiers'
    modules: the quick run that a CI gate runs first catches it, not only the multi-rank job."""
    if _needs_two_hosts(name) and _two_hosts_unavailable():
        pytest.skip(f"mutant {name} runs on two hosts only (--hosts 2), which cannot be made here: {_two_hosts_unavailable()}")
    report, output = mutant_runs[name]
    assert report is not None, f"mutant {name}: no report; output:\n{output[-3000:]}"
    quick = {t["rule"] for t in report["tests"] if t["actual"] == "failed" and not t["nodeid"].startswith(TIER_MODULES)
             and t["nodeid"] not in tiered}
    alive = sorted(_quick_kills(name) - quick)
    assert not alive, (f"mutant {name} ({MUTANTS[name].bug}) fails {alive} only in a tier's job (or not at all): no "
                       f"test of the quick run caught it; output:\n{output[-2000:]}")


@pytest.mark.timeout(ZOO_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name, mutant_runs):
    """Every rule in the mutant's kill list fails when the suite runs against it."""
    if _needs_two_hosts(name) and _two_hosts_unavailable():
        pytest.skip(f"mutant {name} is killed on two hosts only (--hosts 2), which cannot be made here: "
                    f"{_two_hosts_unavailable()}")
    report, output = mutant_runs[name]
    assert report is not None, f"mutant {name}: no report; output:\n{output[-3000:]}"
    unstarted = unstarted_jobs(report)
    assert not unstarted, f"mutant {name}: its multi-rank job never started, which kills nothing: {unstarted[:3]}"
    status = {r["id"]: r["status"] for r in report["rules"]}
    survived = {r: status.get(r, "not run") for r in MUTANTS[name].kills if status.get(r) != "failed"}
    assert not survived, (
        f"mutant {name} ({MUTANTS[name].bug}) survives rules {survived}; output:\n{output[-2000:]}"
    )
