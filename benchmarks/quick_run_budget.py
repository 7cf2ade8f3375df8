"""The quick run's time against an earlier tree's, side by side: the mode-space issue's budget.

    python -m benchmarks.quick_run_budget --against 3d02fa1 --rounds 5

The budget: the quick run (``pytest conformance --impl=reference -n 2``) takes at most twice the wall time of the
tree named by ``--against`` (3d02fa1, the tree the mode-space issue was filed on), and no more per case. Both are
measured in one run, alternating (round 1 the earlier tree first, round 2 this tree first, and so on), so that a
machine whose speed drifts over the hour drifts for both.

* The earlier tree is a clone of this repository at ``--against`` in ``--work-dir``, with a virtual environment of
  its own, installed as the README says (``pip install -e '.[test]'``); both are made once and kept for the next
  run. ``--against-python`` runs it with that interpreter instead (no environment made).
* Each tree has its own pytest temporary root (``PYTEST_DEBUG_TEMPROOT``, in ``--work-dir``). pytest keeps three
  base directories and removes the oldest as a run ends; with one shared root, the earlier tree's runs would
  remove this tree's (larger) directories and flatter it.
* A round's figure is the wall time around the whole command, from start to exit (the controller's start and
  teardown included), and its CPU seconds (user + system of the command and its workers). Per case: wall time
  over the cases pytest reports (passed, failed, skipped, errors). A run that does not exit 0 is reported and
  makes the verdict ``invalid``: a failing run's time says nothing.

The table gives each round, then the median beside the best of each tree, the ratio of the medians (the
verdict's) and of the bests, and the rounds' own ratios. ``--pytest-args`` adds arguments to both trees' runs
(a smoke run selects a rule: ``--pytest-args="--rule PART"``); the verdict then speaks of that selection only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 2.0  # at most twice the earlier tree's wall time
QUICK_RUN = ["-m", "pytest", "conformance", "--impl=reference", "-n", "2", "-q", "-p", "no:cacheprovider"]
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")


def _git(*args: str, cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def earlier_tree(ref: str, work_dir: str, python: str | None) -> tuple[str, str, str]:
    """(checkout, interpreter, commit) of ``ref``: a clone of this repository in ``work_dir``, made once."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}", cwd=REPO)
    tree = os.path.join(work_dir, f"tree-{commit[:12]}")
    if not os.path.isdir(os.path.join(tree, ".git")):
        subprocess.run(["git", "clone", "-q", "--no-checkout", REPO, tree], check=True)
    _git("checkout", "-q", "--detach", commit, cwd=tree)
    if python is None:
        python = os.path.join(tree, ".venv", "bin", "python")
        if not os.path.exists(python):
            subprocess.run([sys.executable, "-m", "venv", os.path.join(tree, ".venv")], check=True)
            subprocess.run([python, "-m", "pip", "install", "-q", "-e", ".[test]"], cwd=tree, check=True)
    return tree, python, commit


def cases(summary: str) -> int:
    """The cases of pytest's last summary line (``2441 passed, 97 skipped in 70.3s``)."""
    lines = [line for line in summary.splitlines() if COUNTS.search(line)]
    return sum(int(n) for n, _ in COUNTS.findall(lines[-1])) if lines else 0


def one_run(tree: str, python: str, temp_root: str, extra: list[str]) -> dict:
    """One quick run of ``tree``: wall and CPU seconds around the command, its cases, its exit status."""
    os.makedirs(temp_root, exist_ok=True)
    env = dict(os.environ, PYTEST_DEBUG_TEMPROOT=temp_root, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([python, *QUICK_RUN, *extra], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    n = cases(proc.stdout)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"wall_s": wall, "cpu_s": cpu, "cases": n, "ms_per_case": 1000 * wall / n if n else None,
            "exit": proc.returncode, "summary": last, "tail": "" if proc.returncode == 0 else proc.stdout[-3000:] + proc.stderr[-2000:]}


def summarise(rounds: list[dict]) -> dict:
    """Medians beside bests, and the verdict: at most BUDGET times the earlier tree's median wall time, and no
    more per case."""
    out = {}
    for side in ("this", "earlier"):
        walls = [r[side]["wall_s"] for r in rounds]
        per_case = [r[side]["ms_per_case"] for r in rounds if r[side]["ms_per_case"] is not None]
        out[side] = {"wall_median_s": statistics.median(walls), "wall_best_s": min(walls),
                     "cpu_median_s": statistics.median(r[side]["cpu_s"] for r in rounds),
                     "cases": rounds[-1][side]["cases"],
                     "ms_per_case_median": statistics.median(per_case) if per_case else None}
    out["ratio_of_medians"] = out["this"]["wall_median_s"] / out["earlier"]["wall_median_s"]
    out["ratio_of_bests"] = out["this"]["wall_best_s"] / out["earlier"]["wall_best_s"]
    out["round_ratios"] = [r["this"]["wall_s"] / r["earlier"]["wall_s"] for r in rounds]
    failed = [f"round {i + 1} {side}: exit {r[side]['exit']}" for i, r in enumerate(rounds)
              for side in ("this", "earlier") if r[side]["exit"] != 0 or not r[side]["cases"]]
    if failed:
        out["verdict"], out["why"] = "invalid", "; ".join(failed)
    else:
        slower_per_case = out["this"]["ms_per_case_median"] > out["earlier"]["ms_per_case_median"]
        met = out["ratio_of_medians"] <= BUDGET and not slower_per_case
        out["verdict"] = "met" if met else "not met"
        out["why"] = (f"x{out['ratio_of_medians']:.2f} of the earlier tree's median wall time (budget x{BUDGET:g}); "
                      f"{out['this']['ms_per_case_median']:.1f} against {out['earlier']['ms_per_case_median']:.1f} ms per case")
    return out


def table(rounds: list[dict], summary: dict, this_label: str, earlier_label: str) -> str:
    rows = [f"{'round':<7}{'this ' + this_label:>22}{'earlier ' + earlier_label:>22}{'ratio':>8}"]
    for i, (r, ratio) in enumerate(zip(rounds, summary["round_ratios"])):
        a, b = r["this"], r["earlier"]
        rows.append(f"{i + 1:<7}{a['wall_s']:>14.1f} s {a['cases']:>5}{b['wall_s']:>14.1f} s {b['cases']:>5}{ratio:>8.2f}")
    t, e = summary["this"], summary["earlier"]
    rows.append(f"{'median':<7}{t['wall_median_s']:>14.1f} s {'':>5}{e['wall_median_s']:>14.1f} s {'':>5}"
                f"{summary['ratio_of_medians']:>8.2f}")
    rows.append(f"{'best':<7}{t['wall_best_s']:>14.1f} s {'':>5}{e['wall_best_s']:>14.1f} s {'':>5}"
                f"{summary['ratio_of_bests']:>8.2f}")
    if t["ms_per_case_median"] is not None and e["ms_per_case_median"] is not None:
        rows.append(f"per case (median): {t['ms_per_case_median']:.1f} against {e['ms_per_case_median']:.1f} ms; "
                    f"CPU (median): {t['cpu_median_s']:.0f} against {e['cpu_median_s']:.0f} s")
    rows.append(f"verdict: {summary['verdict']} ({summary['why']})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="3d02fa1", help="the earlier tree's commit (default: 3d02fa1)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--work-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "weightsync-quick-run-budget"),
                    help="where the earlier tree's clone, its environment and both temporary roots are kept")
    ap.add_argument("--against-python", help="run the earlier tree with this interpreter (no environment made)")
    ap.add_argument("--python", default=sys.executable, help="this tree's interpreter (default: this one)")
    ap.add_argument("--pytest-args", default="", help="more arguments for both trees' runs (a selection)")
    ap.add_argument("--json", help="write the rounds and the summary here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    tree, against_python, commit = earlier_tree(args.against, work, args.against_python)
    this_commit = _git("rev-parse", "--short=7", "HEAD", cwd=REPO)
    extra = shlex.split(args.pytest_args)
    sides = {"this": (REPO, args.python, os.path.join(work, "root-this")),
             "earlier": (tree, against_python, os.path.join(work, f"root-{commit[:12]}"))}
    rounds = []
    for i in range(args.rounds):
        order = ("earlier", "this") if i % 2 == 0 else ("this", "earlier")
        r = {}
        for side in order:
            r[side] = one_run(*sides[side], extra)
            print(f"round {i + 1} {side}: {r[side]['wall_s']:.1f} s, exit {r[side]['exit']}, {r[side]['summary']}",
                  file=sys.stderr, flush=True)
            if r[side]["exit"] != 0:
                print(r[side]["tail"], file=sys.stderr)
        rounds.append(r)
    summary = summarise(rounds)
    print(table(rounds, summary, this_commit + ("+" if _git("status", "--porcelain", cwd=REPO) else ""), commit[:7]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "this": this_commit, "earlier": commit,
                       "quick_run": " ".join(QUICK_RUN + extra), "rounds": rounds, "summary": summary}, f, indent=1)
    return 0 if summary["verdict"] != "invalid" else 1


if __name__ == "__main__":
    sys.exit(main())
