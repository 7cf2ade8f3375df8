"""``benchmarks.quick_run_budget``: a smoke run on one rule, and its verdict on rounds it did not measure.

The smoke run compares this checkout with a clone of its own HEAD, one round, on one rule's cases: what is judged is
that both trees ran in their own checkouts with their own temporary roots, and that every figure is measured and
reported. No time is judged (a loaded machine would make that flaky); the verdict's arithmetic is judged on rounds
written here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import quick_run_budget as B
from tests.conftest import REPO


def test_quick_run_budget_smoke(tmp_path):
    out = tmp_path / "budget.json"
    cmd = [sys.executable, "-m", "benchmarks.quick_run_budget", "--against", "HEAD", "--rounds", "1",
           "--against-python", sys.executable, "--work-dir", str(tmp_path / "work"),
           "--pytest-args=--rule PART-ORDER-NUMERIC", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for word in ("median", "best", "per case (median)", "verdict: "):
        assert word in proc.stdout, f"{word!r} missing from the table:\n{proc.stdout}"
    report = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert report["earlier"] == head, report["earlier"]
    assert report["quick_run"].endswith("-n 2 -q -p no:cacheprovider --rule PART-ORDER-NUMERIC"), report["quick_run"]
    (r,) = report["rounds"]
    for side in ("this", "earlier"):
        assert r[side]["exit"] == 0 and r[side]["cases"] > 0, f"{side}: {r[side]}"
        assert r[side]["wall_s"] > 0 and r[side]["cpu_s"] > 0, f"{side}: {r[side]}"
    assert r["this"]["cases"] == r["earlier"]["cases"], f"the same rule on the same commit: {r['this']['cases']} against {r['earlier']['cases']} cases"
    assert report["summary"]["verdict"] in ("met", "not met"), report["summary"]
    work = tmp_path / "work"
    clone = work / f"tree-{head[:12]}"
    assert (clone / "conformance").is_dir(), sorted(os.listdir(work))
    for root in ("root-this", f"root-{head[:12]}"):  # each tree's own temporary root, used
        assert any((work / root).iterdir()), f"{root} is empty: the run did not use its own temporary root"
    assert not (clone / ".venv").exists(), "--against-python given: no environment should have been made"


def _round(this_s, this_n, earlier_s, earlier_n, this_exit=0):
    side = lambda s, n, e: {"wall_s": s, "cpu_s": s, "cases": n, "ms_per_case": 1000 * s / n if n else None, "exit": e}
    return {"this": side(this_s, this_n, this_exit), "earlier": side(earlier_s, earlier_n, 0)}


def test_the_verdict_reads_the_medians_and_the_per_case_times():
    met = B.summarise([_round(60, 2560, 32, 1275), _round(70, 2560, 33, 1275), _round(64, 2560, 31, 1275)])
    assert met["verdict"] == "met", met
    assert met["ratio_of_medians"] == pytest.approx(64 / 32) and met["ratio_of_bests"] == pytest.approx(60 / 31)
    assert met["round_ratios"] == pytest.approx([60 / 32, 70 / 33, 64 / 31])
    over = B.summarise([_round(66, 2560, 32, 1275)])  # x2.06
    assert over["verdict"] == "not met" and "x2.06" in over["why"], over
    exact = B.summarise([_round(64, 2560, 32, 1275)])  # exactly twice: met
    assert exact["verdict"] == "met", exact
    slower_per_case = B.summarise([_round(40, 1000, 32, 1275)])  # x1.25 in all, but 40 against 25.1 ms per case
    assert slower_per_case["verdict"] == "not met" and "40.0 against 25.1 ms" in slower_per_case["why"], slower_per_case


def test_a_failed_or_empty_run_makes_the_verdict_invalid():
    failed = B.summarise([_round(30, 2560, 32, 1275), _round(30, 2500, 32, 1275, this_exit=1)])
    assert failed["verdict"] == "invalid" and failed["why"] == "round 2 this: exit 1", failed
    empty = B.summarise([_round(30, 0, 32, 1275)])
    assert empty["verdict"] == "invalid" and "round 1 this" in empty["why"], empty


@pytest.mark.parametrize("summary, want", [
    ("2441 passed, 97 skipped in 70.32s (0:01:10)", 2538),
    ("== 3 failed, 85 passed, 4 skipped, 1 error in 91.9s ==", 93),
    ("1 passed, 2485 deselected in 2.1s", 1),
    ("ERROR: usage", 0),
])
def test_cases_are_read_off_pytests_summary(summary, want):
    assert B.cases("header 1 passed earlier\n" + summary if want else summary) == want
