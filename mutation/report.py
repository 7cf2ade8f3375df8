"""Run mutmut over ``reference/`` and judge its survivors against ``mutation/justified.toml``.

    python -m mutation.report --run            # mutmut run (hours on 2 cores: docs/mutation.md), then the report
    python -m mutation.report                  # the report from the last run's results in mutants/
    python -m mutation.report --only 'reference.buckets.*'   # run (and report) a subset

A survivor is a mutant that no conformance test fails: ``survived``, ``no tests`` (no test reaches the
code) or ``suspicious``. Each must be killed by a sharper test or justified in ``justified.toml`` as
``equivalent`` (no behaviour changes) or ``out-of-scope`` (a behaviour the suite deliberately does not
judge), with a one-line reason. A justification names the mutated function, the diff's changed lines and
``context``, mutmut's hash of the whole unmutated function (mutation/current.py), never mutmut's number:
it survives renumbering, and it goes stale, loudly, as soon as the function it was written for changes
in any way, so a reason written for old code never excuses a mutant of new code.

An ``equivalent`` entry claims no behaviour changes: its reason must be an argument a reader can check
against the code. A behaviour observable through the adapter is a test to write, never an entry; one the
adapter cannot observe (a default no caller takes, a message's prose) is ``out-of-scope``.

Score = detected / (all - equivalent), where detected = killed, timeout, segfault; the report also gives
detected / all (killed over all mutants). The run fails (exit 1) below ``--target`` (default 0.90) or
with any unjustified survivor or stale justification. The stale check runs on every report, ``--only``
included: every entry must match a mutant of today's code (generated in memory), and every entry in the
report's scope must match one of its survivors.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JUSTIFIED = os.path.join(REPO, "mutation", "justified.toml")
REPORT = os.path.join(REPO, "mutation", "REPORT.md")
KINDS = ("equivalent", "out-of-scope")
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
SURVIVOR = {"survived", "no tests", "suspicious"}


@dataclass(frozen=True)
class Result:
    name: str  # reference.buckets.x_stage_bucket__mutmut_12
    status: str
    diff: str
    context: str = ""  # mutmut's hash of the unmutated function (current.CurrentMutant.context)

    @property
    def function(self) -> str:
        return self.name.rsplit("__mutmut_", 1)[0]

    @property
    def change(self) -> str:
        """The diff's removed and added lines, stripped: what the mutant changed."""
        return "\n".join(
            line[0] + line[1:].strip()
            for line in self.diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        )


def load_results(with_diffs: bool = True) -> list[Result]:
    """Every mutant of the last ``mutmut run`` with its status (and diff for survivors)."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    out = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for name, code in data.exit_code_by_key.items():
            status = status_by_exit_code[code]
            diff = get_diff_for_mutant(name, path=data.path) if with_diffs and status in SURVIVOR else ""
            function = name.rsplit("__mutmut_", 1)[0].rpartition(".")[2]
            out.append(Result(name, status, diff, data.hash_by_function_name.get(function, "")))
    return out


def load_justified(path: str = JUSTIFIED) -> list[dict]:
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    for i, e in enumerate(entries):
        missing = [k for k in ("function", "change", "context", "kind", "reason") if not str(e.get(k, "")).strip()]
        if missing:
            raise ValueError(f"{path}: entry {i} ({e.get('function')}) lacks {missing}")
        if e["kind"] not in KINDS:
            raise ValueError(f"{path}: entry {i} ({e['function']}) has kind {e['kind']!r}, expected one of {KINDS}")
        e["change"] = "\n".join(line.strip()[0] + line.strip()[1:].strip() for line in e["change"].strip().splitlines())
    return entries


def judge(results: list[Result], justified: list[dict], target: float, in_scope=lambda e: True) -> dict:
    """The verdict of one run. An entry in scope (all, or those of an ``--only`` run's functions) that
    excuses none of the run's survivors is stale: its mutant is killed now, or its code changed."""
    by_key = defaultdict(list)
    for e in justified:
        by_key[(e["function"], e["change"], e["context"])].append(e)
    used: set[int] = set()
    survivors, excused = [], []
    for r in results:
        if r.status not in SURVIVOR:
            continue
        match = by_key.get((r.function, r.change, r.context))
        if match:
            used.update(id(e) for e in match)
            excused.append((r, match[0]))
        else:
            survivors.append(r)
    stale = [e for e in justified if id(e) not in used and in_scope(e)]
    counts = Counter(r.status for r in results)
    equivalent = sum(1 for _, e in excused if e["kind"] == "equivalent")
    detected = sum(counts[s] for s in DETECTED)
    denominator = len(results) - equivalent - counts["skipped"]
    score = detected / denominator if denominator else 0.0
    ok = score >= target and not survivors and not stale
    killed_over_all = detected / len(results) if results else 0.0
    return {"counts": dict(counts), "total": len(results), "detected": detected, "equivalent": equivalent,
            "killed_over_all": killed_over_all,
            "out_of_scope": sum(1 for _, e in excused if e["kind"] == "out-of-scope"), "score": score,
            "target": target, "ok": ok, "survivors": survivors, "excused": excused, "stale": stale}


def tree() -> str:
    """The commit the run's code came from, ``+changes`` when reference/ differed from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "reference") else "")


def mutmut_version() -> str:
    import importlib.metadata as md

    return md.version("mutmut")


def write_report(verdict: dict, path: str, command: str, baseline: dict | None) -> None:
    lines = [
        "# Mutation testing of `reference/`",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on tree {tree()} by `{command}` (mutmut {mutmut_version()}; "
        "tests: `pytest conformance --impl=reference`, configured in pyproject.toml `[tool.mutmut]`).",
        "",
        "| | mutants | detected | equivalent | out of scope | unjustified survivors | detected / all | score |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if baseline:
        lines.append(f"| before (issue 6 baseline) | {baseline['total']} | {baseline['detected']} | - | - | "
                     f"{baseline['survivors']} | {baseline['score']:.1%} | {baseline['score']:.1%} |")
    lines.append(f"| now | {verdict['total']} | {verdict['detected']} | {verdict['equivalent']} | "
                 f"{verdict['out_of_scope']} | {len(verdict['survivors'])} | **{verdict['killed_over_all']:.1%}** | "
                 f"**{verdict['score']:.1%}** |")
    perf = sum(1 for _, e in verdict["excused"] if e["kind"] == "equivalent" and "performance only" in e["reason"])
    if perf:
        strict = verdict["detected"] / max(verdict["total"] - verdict["equivalent"] + perf, 1)
        lines += ["", f"{perf} of the equivalent mutants change only performance (huge-page advice, copy threads and "
                  f"their split): counted against the suite instead, the score is {strict:.1%}."]
    lines += ["", f"Score = detected / (mutants - equivalent); target {verdict['target']:.0%}: "
              f"**{'met' if verdict['score'] >= verdict['target'] else 'missed'}**. Statuses: "
              + ", ".join(f"{k} {v}" for k, v in sorted(verdict["counts"].items())) + ".", ""]
    if verdict["survivors"]:
        lines += ["## Unjustified survivors", ""]
        for r in verdict["survivors"]:
            lines += [f"### `{r.name}` ({r.status})", "", "```diff", r.diff, "```", ""]
    if verdict["stale"]:
        lines += ["## Stale justifications (no survivor of this run, or no mutant of today's code, matches)", ""]
        lines += [f"- `{e['function']}`: {e['change']!r}" for e in verdict["stale"]] + [""]
    if verdict["excused"]:
        lines += ["## Justified survivors", "", "| mutant | kind | change | reason |", "|---|---|---|---|"]
        for r, e in sorted(verdict["excused"], key=lambda x: x[0].name):
            change = r.change.replace("|", "\\|").replace("\n", "<br>")
            lines.append(f"| `{r.name}` | {e['kind']} | `{change}` | {e['reason']} |")
        lines.append("")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


BASELINE = os.path.join(REPO, "mutation", "baseline.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run mutmut first (results go to mutants/)")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB", help="mutant name glob (repeatable)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--report", default=REPORT)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the verdict as JSON")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # mutmut reads pyproject.toml and mutants/ from the working directory
    if args.run:
        with open(os.path.join(REPO, "mutants-run.log"), "w") as log:
            cmd = [os.path.join(os.path.dirname(sys.executable), "mutmut"), "run", f"--max-children={args.jobs}", *args.only]
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        if code != 0:
            print(f"mutmut run failed (exit {code}); see mutants-run.log", file=sys.stderr)
            return 2
    import fnmatch

    from .current import generate, stale_entries

    results = load_results()
    in_scope = lambda e: True  # noqa: E731
    if args.only:
        results = [r for r in results if any(fnmatch.fnmatch(r.name, g) for g in args.only)]
        functions = {r.function for r in results}
        in_scope = lambda e: e["function"] in functions  # noqa: E731
    justified = load_justified()
    verdict = judge(results, justified, args.target, in_scope)
    # Entries outside the run's scope are still judged against today's code: none may outlive its code.
    seen = {id(e) for e in verdict["stale"]}
    verdict["stale"] += [e for e in stale_entries(justified, generate()) if id(e) not in seen]
    verdict["ok"] = verdict["ok"] and not verdict["stale"]
    baseline = json.load(open(BASELINE)) if os.path.exists(BASELINE) else None
    command = "python -m mutation.report" + (" --run" if args.run else "") + "".join(f" --only {g}" for g in args.only)
    write_report(verdict, args.report, command, baseline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in verdict.items() if k not in ("survivors", "excused", "stale")}
                      | {"survivors": [r.name for r in verdict["survivors"]]}, f, indent=2)
    print(f"mutants {verdict['total']}, detected {verdict['detected']}, equivalent {verdict['equivalent']}, "
          f"out of scope {verdict['out_of_scope']}, unjustified survivors {len(verdict['survivors'])}, "
          f"stale justifications {len(verdict['stale'])}: detected over all {verdict['killed_over_all']:.1%}, "
          f"score {verdict['score']:.1%} (target {args.target:.0%})")
    for r in verdict["survivors"]:
        print(f"  survivor {r.name} ({r.status}): {r.change!r}")
    print(f"report: {os.path.relpath(args.report, REPO)}")
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
