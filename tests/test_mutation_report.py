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


# conformance.mutmut_hits, driven the way mutmut's stats run drives pytest: MUTANT_UNDER_TEST=stats, a plugin
# filing state()._stats under each test at its teardown (mutmut's StatsCollector), the trampoline's record call.
_HITS_TESTS = '''
import os, select, time
import pytest
from mutmut.mutation import trampoline

def _in_child(names):
    pid = os.fork()
    if pid == 0:
        for name in names:
            trampoline.record_trampoline_hit(name)
        os._exit(0)
    os.waitpid(pid, 0)

@pytest.fixture(scope="module")
def long_lived():
    """A child forked once that reaches ref.f_long whenever told (a fork server, a rank)."""
    r, w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        while os.read(r, 1) == b"g":
            trampoline.record_trampoline_hit("ref.f_long")
            os.write(done_w, b"d")
        os._exit(0)
    yield lambda: (os.write(w, b"g"), os.read(done_r, 1))
    os.write(w, b"q")
    os.waitpid(pid, 0)

def test_child():
    _in_child(["ref.f_child", "ref.f_child"])

def test_parent():
    trampoline.record_trampoline_hit("ref.f_parent")

def test_nothing():
    _in_child([])

def test_long_1(long_lived):
    long_lived()

def test_long_2(long_lived):
    long_lived()
'''

_HITS_DRIVER = '''
import json, sys
from collections import defaultdict
import pytest
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.state import state

set_mutant_under_test("stats")
filed = defaultdict(set)

class StatsCollector:  # mutmut.runners.harness's, reduced to what it files
    def pytest_runtest_teardown(self, item, nextitem):
        for function in state()._stats:
            filed[function].add(item.name)
        state()._stats.clear()

code = pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *sys.argv[3:]],
                   plugins=[StatsCollector()])
json.dump({"code": int(code), "filed": {k: sorted(v) for k, v in filed.items()}}, open(sys.argv[2], "w"))
'''


def _hits_run(tmp_path, *plugin_args):
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    (tmp_path / "test_hits.py").write_text(_HITS_TESTS)
    (tmp_path / "driver.py").write_text(_HITS_DRIVER)
    out = tmp_path / "filed.json"
    # From the repo root: mutmut's config (pyproject.toml's [tool.mutmut]) is read from the working directory.
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "test_hits.py"), str(out),
                           *plugin_args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.exists(), proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["code"] == 0, proc.stdout + proc.stderr
    return result["filed"]


def test_a_function_reached_in_a_forked_child_is_filed_under_the_test_that_forked_it(tmp_path):
    """Without conformance.mutmut_hits mutmut never runs a test whose kill happens in a child (the bounded
    harness, the read-cap and memory measurements, the restart tier's workers); with it, each reach is filed
    under the test during which it was made, a long-lived child's for every test that made it reach."""
    assert _hits_run(tmp_path, "-p", "conformance.mutmut_hits") == {
        "ref.f_child": ["test_child"], "ref.f_parent": ["test_parent"], "ref.f_long": ["test_long_1", "test_long_2"]}


def test_without_the_plugin_a_childs_reach_is_lost(tmp_path):
    """The premise of the test above (it can fail): mutmut alone files only the pytest process's reaches."""
    assert _hits_run(tmp_path) == {"ref.f_parent": ["test_parent"]}
