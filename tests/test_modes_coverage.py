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
