"""The mutation report's judgement: survivors must be killed or justified, and justifications go stale."""
import pytest

from mutation.current import change_between, stale_by_context, stale_entries
from mutation.report import Result, judge, load_justified

DIFF = """--- reference/x.py
+++ reference/x.py
@@ -1,3 +1,3 @@
 def check(a, b):
-    if a > b:
+    if a >= b:
         raise ValueError"""


def _r(n, status, diff="", context="c0ffee"):
    return Result(f"reference.x.x_check__mutmut_{n}", status, diff, context)


def _entry(kind="equivalent", change="-if a > b:\n+if a >= b:", context="c0ffee"):
    return {"function": "reference.x.x_check", "change": change, "context": context, "kind": kind, "reason": "r"}


def test_committed_justifications_are_well_formed():
    for e in load_justified():
        assert e["kind"] in ("equivalent", "out-of-scope") and e["reason"].strip() and e["context"].strip(), e


def test_every_justification_was_written_for_todays_code():
    """The stale check on every tree, without a mutmut run: each entry's function hashes today as it did
    when the entry was written (``python -m mutation.current`` also regenerates the mutants, about 30 s)."""
    justified = load_justified()
    stale = stale_by_context(justified)
    assert justified and not stale, (
        f"{len(stale)} justification(s) of mutation/justified.toml were written for a function that has changed "
        f"since: kill the mutant or justify it again (python -m mutation.justify); first: {stale[0]['function']} "
        f"context {stale[0]['context']}: {stale[0]['change']!r}")


def test_the_stale_check_sees_a_changed_function(tmp_path, monkeypatch):
    import mutation.current as current

    (tmp_path / "mod.py").write_text("def check(a, b):\n    if a > b:\n        raise ValueError\n")
    monkeypatch.setattr(current, "REPO", str(tmp_path))
    today = current.function_hashes(["mod"])["mod.x_check"]
    entry = _entry(context=today) | {"function": "mod.x_check"}
    assert stale_by_context([entry]) == []
    (tmp_path / "mod.py").write_text("def check(a, b):\n    if a > b:\n        raise KeyError\n")
    assert stale_by_context([entry]) == [entry]


def test_a_justification_written_for_another_version_of_the_function_is_stale():
    """Same function, same changed line, the function changed elsewhere: the reason no longer holds."""
    v = judge([_r(1, "killed")] * 20 + [_r(2, "survived", DIFF, context="beef00")], [_entry()], 0.9)
    assert not v["ok"] and len(v["stale"]) == 1 and [r.name for r in v["survivors"]] == ["reference.x.x_check__mutmut_2"]
    assert stale_entries([_entry()], []) == [_entry()]


def test_an_entry_outside_an_only_runs_scope_is_not_judged_by_its_survivors():
    v = judge([_r(1, "killed")] * 20, [_entry()], 0.9, in_scope=lambda e: e["function"] != "reference.x.x_check")
    assert v["ok"] and not v["stale"]
    v = judge([_r(1, "killed")] * 20, [_entry()], 0.9)  # in scope and its mutant is killed now: stale
    assert not v["ok"] and len(v["stale"]) == 1


def test_the_change_is_read_as_mutmuts_diff_gives_it():
    r = _r(3, "survived", DIFF)
    assert change_between(["def check(a, b):", "    if a > b:", "        raise ValueError"],
                          ["def check(a, b):", "    if a >= b:", "        raise ValueError"]) == r.change


def test_killed_over_all_is_reported_beside_the_score():
    v = judge([_r(1, "killed")] * 8 + [_r(2, "survived", DIFF)] * 2, [_entry()], 0.9)
    assert v["killed_over_all"] == 0.8 and v["score"] == 1.0


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
