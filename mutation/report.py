"""Run mutmut over ``reference/`` and judge its survivors against ``mutation/justified.toml``.

    python -m mutation.report --run            # mutmut run (about 15 min on 2 cores), then the report
    python -m mutation.report                  # the report from the last run's results in mutants/
    python -m mutation.report --only 'reference.buckets.*'   # run (and report) a subset

A survivor is a mutant that no conformance test fails: ``survived``, ``no tests`` (no test reaches the
code) or ``suspicious``. Each must be killed by a sharper test or justified in ``justified.toml`` as
``equivalent`` (no behaviour changes) or ``out-of-scope`` (a behaviour the suite deliberately does not
judge), with a one-line reason. A justification names the mutated function and the diff's changed lines,
not mutmut's number, so it survives renumbering and goes stale, loudly, when the code it covers changes.

Score = detected / (all - equivalent), where detected = killed, timeout, segfault. The run fails (exit 1)
below ``--target`` (default 0.90) or with any unjustified survivor or stale justification.
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
            out.append(Result(name, status, diff))
    return out


def load_justified(path: str = JUSTIFIED) -> list[dict]:
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    for i, e in enumerate(entries):
        missing = [k for k in ("function", "change", "kind", "reason") if not str(e.get(k, "")).strip()]
        if missing:
            raise ValueError(f"{path}: entry {i} ({e.get('function')}) lacks {missing}")
        if e["kind"] not in KINDS:
            raise ValueError(f"{path}: entry {i} ({e['function']}) has kind {e['kind']!r}, expected one of {KINDS}")
        e["change"] = "\n".join(line.strip()[0] + line.strip()[1:].strip() for line in e["change"].strip().splitlines())
    return entries


def judge(results: list[Result], justified: list[dict], target: float) -> dict:
    by_key = defaultdict(list)
    for e in justified:
        by_key[(e["function"], e["change"])].append(e)
    used: set[int] = set()
    survivors, excused = [], []
    for r in results:
        if r.status not in SURVIVOR:
            continue
        match = by_key.get((r.function, r.change))
        if match:
            used.update(id(e) for e in match)
            excused.append((r, match[0]))
        else:
            survivors.append(r)
    stale = [e for e in justified if id(e) not in used]
    counts = Counter(r.status for r in results)
    equivalent = sum(1 for _, e in excused if e["kind"] == "equivalent")
    detected = sum(counts[s] for s in DETECTED)
    denominator = len(results) - equivalent - counts["skipped"]
    score = detected / denominator if denominator else 0.0
    ok = score >= target and not survivors and not stale
    return {"counts": dict(counts), "total": len(results), "detected": detected, "equivalent": equivalent,
            "out_of_scope": sum(1 for _, e in excused if e["kind"] == "out-of-scope"), "score": score,
            "target": target, "ok": ok, "survivors": survivors, "excused": excused, "stale": stale}


def mutmut_version() -> str:
    import importlib.metadata as md

    return md.version("mutmut")


def write_report(verdict: dict, path: str, command: str, baseline: dict | None) -> None:
    lines = [
        "# Mutation testing of `reference/`",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by `{command}` (mutmut {mutmut_version()}; "
        "tests: `pytest conformance --impl=reference`, configured in pyproject.toml `[tool.mutmut]`).",
        "",
        "| | mutants | detected | equivalent | out of scope | unjustified survivors | score |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    if baseline:
        lines.append(f"| before (issue 6 baseline) | {baseline['total']} | {baseline['detected']} | - | - | "
                     f"{baseline['survivors']} | {baseline['score']:.1%} |")
    lines.append(f"| now | {verdict['total']} | {verdict['detected']} | {verdict['equivalent']} | "
                 f"{verdict['out_of_scope']} | {len(verdict['survivors'])} | **{verdict['score']:.1%}** |")
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
        lines += ["## Stale justifications (no current mutant matches)", ""]
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
    results = load_results()
    if args.only:
        import fnmatch

        results = [r for r in results if any(fnmatch.fnmatch(r.name, g) for g in args.only)]
    verdict = judge(results, load_justified(), args.target)
    if args.only:  # a subset cannot judge justifications of the rest
        verdict["stale"] = []
    baseline = json.load(open(BASELINE)) if os.path.exists(BASELINE) else None
    command = "python -m mutation.report" + (" --run" if args.run else "") + "".join(f" --only {g}" for g in args.only)
    write_report(verdict, args.report, command, baseline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in verdict.items() if k not in ("survivors", "excused", "stale")}
                      | {"survivors": [r.name for r in verdict["survivors"]]}, f, indent=2)
    print(f"mutants {verdict['total']}, detected {verdict['detected']}, equivalent {verdict['equivalent']}, "
          f"out of scope {verdict['out_of_scope']}, unjustified survivors {len(verdict['survivors'])}, "
          f"stale justifications {len(verdict['stale'])}: score {verdict['score']:.1%} (target {args.target:.0%})")
    for r in verdict["survivors"]:
        print(f"  survivor {r.name} ({r.status}): {r.change!r}")
    print(f"report: {os.path.relpath(args.report, REPO)}")
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
