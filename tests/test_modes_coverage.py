"""Every rule that declares its modes (a ``Modes:`` line in SPEC.md) has collected cases covering every pair of
values of every two of its axes (or each value, for one axis), as ``conformance.modes`` computes it, the excluded
pairs aside; and the generator's own rows cover what they claim. The suite is collected once, against the
reference (``--collect-only``; tests/modes_probe.py writes what was collected)."""
from __future__ import annotations


import pytest

from conformance import modes
from tests.conftest import probe_collection


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    return probe_collection("tests.modes_probe", tmp_path_factory.mktemp("modes") / "cases.json")


DECLARED = sorted(rule for rule, decl in modes.declarations().items() if decl is not None)


@pytest.mark.parametrize("rule", DECLARED)
def test_declared_modes_are_covered_pairwise(collected, rule):
    cases = [c["modes"] for c in collected.get(rule, [])]
    assert cases, f"{rule} declares modes ({modes.declaration(rule).text()}) and no case of it was collected"
    got = modes.coverage(rule, cases)
    assert not got.uncovered, (f"{rule}: {got.covered}/{got.required} pairs of its Modes line covered; "
                               f"uncovered: {got.uncovered}")


def test_generated_rows_cover_every_pair_of_their_axes():
    for rule in DECLARED:
        decl = modes.declaration(rule)
        if not decl.axes:
            continue
        rows = modes.pairwise(decl.axes, decl.all_excluded())
        assert not modes.coverage(rule, rows, decl).uncovered, rule


QUICK_EACH = [rule for rule in DECLARED if modes.declaration(rule).quick == modes.QUICK_EACH]


def test_some_rules_split_their_pairs_with_the_tier():
    assert QUICK_EACH, "no rule declares 'quick: each' (then the pairs tier holds nothing: drop it, or this test)"


@pytest.mark.parametrize("rule", QUICK_EACH)
def test_a_quick_each_rule_meets_every_value_in_the_quick_run(collected, rule):
    """A rule whose pairs the tier ``pairs`` completes: its cases that carry no tier marker (the quick run's)
    meet every value of every declared axis; its ``pairs`` cases exist, and only such a rule has any."""
    decl = modes.declaration(rule)
    cases = collected.get(rule, [])
    quick = [c["modes"] for c in cases if not c["tiers"]]
    held = {((a, v),) for c in quick for a in decl.axes for v in str(c.get(a, "")).split("|")}
    missing = [f"{a}={v}" for ((a, v),) in decl.values() if ((a, v),) not in held]
    assert not missing, f"{rule}: values its quick-run cases never meet: {missing}"
    assert any(modes.PAIRS_TIER in c["tiers"] for c in cases), f"{rule}: 'quick: each' and no case in the pairs tier"


def test_only_quick_each_rules_have_pairs_cases(collected):
    stray = sorted({rule for rule, cases in collected.items() for c in cases
                    if modes.PAIRS_TIER in c["tiers"] and rule not in QUICK_EACH})
    assert not stray, f"rules with cases in the pairs tier that do not declare 'quick: each': {stray}"
