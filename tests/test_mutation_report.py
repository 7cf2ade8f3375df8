"""The mutation report's judgement: survivors must be killed or justified, and justifications go stale."""
import pytest

from mutation.report import Result, judge, load_justified

DIFF = """--- reference/x.py
+++ reference/x.py
@@ -1,3 +1,3 @@
 def check(a, b):
-    if a > b:
+    if a >= b:
         raise ValueError"""


def _r(n, status, diff=""):
    return Result(f"reference.x.x_check__mutmut_{n}", status, diff)


def _entry(kind="equivalent", change="-if a > b:\n+if a >= b:"):
    return {"function": "reference.x.x_check", "change": change, "kind": kind, "reason": "r"}


def test_committed_justifications_are_well_formed():
    for e in load_justified():
        assert e["kind"] in ("equivalent", "out-of-scope") and e["reason"].strip(), e


def test_a_justified_equivalent_survivor_leaves_the_denominator():
    results = [_r(1, "killed"), _r(2, "killed"), _r(3, "survived", DIFF)]
    v = judge(results, [_entry()], target=0.9)
    assert v["ok"] and v["score"] == 1.0 and not v["survivors"] and v["equivalent"] == 1


def test_an_out_of_scope_survivor_still_counts_against_the_score():
    results = [_r(1, "killed"), _r(2, "survived", DIFF)]
    v = judge(results, [_entry("out-of-scope")], target=0.9)
    assert v["score"] == 0.5 and not v["ok"] and not v["survivors"]


@pytest.mark.parametrize("status", ["survived", "no tests", "suspicious"])
def test_an_unjustified_survivor_fails(status):
    v = judge([_r(1, "killed")] * 20 + [_r(2, status, DIFF)], [], target=0.9)
    assert not v["ok"] and [r.name for r in v["survivors"]] == ["reference.x.x_check__mutmut_2"]


def test_a_justification_for_another_change_is_stale_and_excuses_nothing():
    v = judge([_r(1, "killed")] * 20 + [_r(2, "survived", DIFF)], [_entry(change="-if a > b:\n+if a < b:")], 0.9)
    assert not v["ok"] and len(v["stale"]) == 1 and len(v["survivors"]) == 1


def test_timeouts_count_as_detected():
    v = judge([_r(1, "killed"), _r(2, "timeout")], [], target=0.9)
    assert v["detected"] == 2 and v["ok"]
