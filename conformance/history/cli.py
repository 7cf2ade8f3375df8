"""The command line: read the versions, run the suite on each distinct content, write the history."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time

from .. import spec
from . import gate, page, verdicts
from .adapter_probe import AdapterError, absolute_impl, probe
from .progress import progress_for
from .runs import SUITE_TREES, TOOL, Cache, Runner, Suite, atomic_write, checkout, default_jobs, run_dir
from .versions import EmptyRange, HistoryError, Version, baseline, from_folder, from_git, range_ends

VERDICTS = ("passed", "failed", "error", "not_applicable", "skipped", "expected_failure", "unexpected_pass",
            verdicts.ABSENT, "usage_error", "crashed", "timed_out")
EXAMPLES = """examples:
  python -m conformance.history --repo ~/FastDeploy --path fastdeploy/rl/dynamic_weight_manager.py \\
      -o fd-history --rule PART -m snapshot
  python -m conformance.history --versions copies/ -o fd-history --rule LEVEL
  python -m conformance.history --repo ~/FastDeploy --path fastdeploy/rl/dynamic_weight_manager.py \\
      -o fd-history --bisect PART-INDEX-BASENAME
  python -m conformance.history --repo . --path fastdeploy/rl/dynamic_weight_manager.py \\
      --rev-range BASE..HEAD --fail-on-regression -o conformance-gate [--expectations expectations.toml]

Arguments the tool does not know (--rule ID, -m EXPR, -k EXPR, --expectations FILE, ...) are passed to
each suite run: pytest conformance --impl=NAME --impl-opt source=FILE --conformance-report R.json ARGS.

exit status: 0 done (with --fail-on-regression: no verdict got worse); 1 a version crashed or timed out
(with --fail-on-regression: a rule's verdict got worse); 2 bad input (arguments, repository, path,
range); 3 with --fail-on-regression: a version of the range has no verdict (usage error, crash,
timeout) and none got worse; 4 the adapter (--impl) cannot be loaded; 130 interrupted.
"""


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m conformance.history", allow_abbrev=False, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the conformance suite on every version of an implementation's file (the commits of a "
                    "git repository that changed it, or a folder of copies), once per distinct content, and "
                    "write one report per version, history.json and history.html (rules by versions, each "
                    "verdict change marked with its commit); or find a rule's first change with --bisect.")
    source = parser.add_argument_group("versions (one of)")
    source.add_argument("--repo", metavar="PATH", help="a git repository holding the file's history")
    source.add_argument("--path", metavar="FILE", help="with --repo: the file's path in the repository")
    source.add_argument("--rev-range", metavar="A..B", help="with --repo: the commits to read (default HEAD), "
                        "first-parent line")
    source.add_argument("--all", action="store_true", help="with --repo: every branch, not the first-parent line")
    source.add_argument("--versions", metavar="DIR", help="a folder of versions of the file, in name order")
    source.add_argument("--manifest", metavar="JSON", help="with --versions: a JSON list of the files in order "
                        '(names, or {"file", "id", "date", "title"} objects)')
    parser.add_argument("-o", "--output", default="conformance-history", metavar="DIR",
                        help="where reports/, history.json and history.html go (default: %(default)s)")
    parser.add_argument("--cache", metavar="DIR", help="the results cache (default: OUTPUT/.history-cache)")
    parser.add_argument("--no-cache", action="store_true",
                        help="read no result from the cache: run every version again (the new results are cached)")
    parser.add_argument("--impl", default="fastdeploy", metavar="NAME",
                        help="the adapter; it is given --impl-opt source=FILE (default: %(default)s)")
    parser.add_argument("-j", "--jobs", type=int, default=default_jobs(), metavar="N",
                        help="suite runs at once (default: %(default)s, half the cores)")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                        help="end a suite run after S seconds, recorded as timed out and not cached (default: "
                             "%(default)g)")
    parser.add_argument("--bisect", metavar="RULE", help="find the first version where RULE's verdict changes, "
                        "running only the versions a binary search needs")
    parser.add_argument("--from", dest="want_from", choices=VERDICTS, metavar="VERDICT",
                        help="with --bisect: the verdict before the change (the first version must have it)")
    parser.add_argument("--to", dest="want_to", choices=VERDICTS, metavar="VERDICT",
                        help="with --bisect: the verdict after the change")
    parser.add_argument("--fail-on-regression", action="store_true",
                        help="the pull-request gate: also run the file as the range starts from (with --rev-range "
                             "A..B, at the merge base of A and B), compare every version with the one before it, "
                             "and exit 1 when a rule's verdict got worse (passed -> failed or error; a failure the "
                             "--expectations file pins is no regression), naming commit, rule, both verdicts and "
                             "the tests' messages")
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    args.extra = [a for a in extra if a != "--"]
    if bool(args.repo) == bool(args.versions):
        parser.error("give the versions: either --repo PATH --path FILE, or --versions DIR")
    if args.repo and not args.path:
        parser.error("--repo needs --path FILE (the file's path in the repository)")
    if args.versions and (args.path or args.rev_range or args.all):
        parser.error("--path, --rev-range and --all go with --repo, not --versions")
    if args.repo and args.manifest:
        parser.error("--manifest goes with --versions, not --repo")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    if (args.want_from or args.want_to) and not args.bisect:
        parser.error("--from and --to go with --bisect RULE")
    if args.fail_on_regression and (args.bisect or args.all):
        parser.error("--fail-on-regression compares each version with its parent: not with --bisect or --all")
    if any(a == "--conformance-report" or a.startswith("--conformance-report=") for a in args.extra):
        parser.error("--conformance-report is the tool's own: each version's report is OUTPUT/reports/NNN-ID.json")
    if any(opt.split("=", 1)[0] == "source" for opt in impl_opts(args.extra)):
        parser.error("--impl-opt source=... is the tool's own (each version's file): give the versions instead")
    return parser, args


def impl_opts(extra: list[str]) -> list[str]:
    """The ``KEY=VALUE`` values of --impl-opt in the pytest arguments."""
    values = []
    for i, arg in enumerate(extra):
        if arg == "--impl-opt" and i + 1 < len(extra):
            values.append(extra[i + 1])
        elif arg.startswith("--impl-opt="):
            values.append(arg.split("=", 1)[1])
    return values


PATH_OPTIONS = ("--expectations",)


def absolute_options(extra: list[str], cwd: str | None = None) -> list[str]:
    """The pytest arguments with the paths they name made absolute (relative to ``cwd``, default the current
    directory): the suite runs from its own root. A path option's value (--expectations FILE, ...), and an
    --impl-opt KEY=VALUE whose value is an existing file or folder."""
    cwd = cwd or os.getcwd()

    def absolute(value: str, must_exist: bool) -> str:
        path = os.path.join(cwd, os.path.expanduser(value))
        return os.path.abspath(path) if value and (not must_exist or os.path.exists(path)) else value

    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        name, eq, value = arg.partition("=")
        if name in PATH_OPTIONS and eq:
            out.append(f"{name}={absolute(value, False)}")
        elif arg in PATH_OPTIONS and i + 1 < len(extra):
            out += [arg, absolute(extra[i + 1], False)]
            i += 1
        elif name == "--impl-opt" and eq:
            key, sep, val = value.partition("=")
            out.append(f"--impl-opt={key}{sep}{absolute(val, True) if sep else val}")
        elif arg == "--impl-opt" and i + 1 < len(extra):
            key, sep, val = extra[i + 1].partition("=")
            out += [arg, f"{key}{sep}{absolute(val, True) if sep else val}"]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def rule_values(extra: list[str]) -> list[str]:
    """The values of --rule in the pytest arguments (``--rule X`` and ``--rule=X``)."""
    values = []
    for i, arg in enumerate(extra):
        if arg == "--rule" and i + 1 < len(extra):
            values.append(extra[i + 1])
        elif arg.startswith("--rule="):
            values.append(arg.split("=", 1)[1])
    return values


def selects(value: str, rule_id: str) -> bool:
    """As the suite reads --rule: an exact id, or an id prefix ending at a dash."""
    return value == rule_id or rule_id.startswith(value + "-")


def check_rules(extra: list[str], bisect: str | None) -> list[str]:
    """The pytest arguments, checked against SPEC.md before any run: every --rule value names a rule or
    an area, and --bisect an exact rule id (added as --rule when no --rule is given)."""
    known = spec.rules()
    values = rule_values(extra)
    for value in values:
        if not any(selects(value, r) for r in known):
            raise HistoryError(f"--rule {value!r} matches no rule in SPEC.md (an id such as PART-ORDER-NUMERIC, "
                               "or an area prefix such as PART)")
    if bisect is None:
        return extra
    if bisect not in known:
        near = [r for r in known if r.startswith(bisect + "-")]
        hint = f" (an area? its rules: {', '.join(near[:6])}{', ...' if len(near) > 6 else ''})" if near else ""
        raise HistoryError(f"--bisect {bisect!r}: no such rule id in SPEC.md{hint}")
    if not values:
        return ["--rule", bisect, *extra]  # first: the same runs (and cache) as a full run with --rule RULE ...
    if not any(selects(v, bisect) for v in values):
        raise HistoryError(f"--bisect {bisect}: the --rule selection ({', '.join(values)}) leaves it out")
    return extra


def load_versions(args):
    """(versions, source, start): the versions in order and, with --fail-on-regression, the index of the
    first one the gate judges (1 when the base, the file as the range starts from, comes first). A range
    that changed nothing gives no versions (EmptyRange's message in source["empty"]) for the gate to pass."""
    if args.repo:
        source = {"kind": "git", "repo": os.path.abspath(args.repo), "path": args.path, "rev_range": args.rev_range,
                  "all": args.all}
        try:
            versions = from_git(args.repo, args.path, args.rev_range, args.all)
        except EmptyRange as e:
            if not args.fail_on_regression:
                raise
            return [], {**source, "empty": str(e)}, 0
        start = 1 if args.fail_on_regression else 0  # without a range, the first version is the base
        if args.fail_on_regression and args.rev_range:
            base = baseline(args.repo, args.path, args.rev_range, versions[0])
            if base is None and range_ends(args.rev_range) is not None:
                start = 0  # the range adds the file: every version is judged
            elif base is not None:
                versions = [base] + [Version(v.index + 1, v.id, v.date, v.title, v.path, v.commit, v.content)
                                     for v in versions]
                source["base"] = base.describe()
        return versions, source, start
    return from_folder(args.versions, args.manifest), {
        "kind": "folder", "folder": os.path.abspath(args.versions),
        "manifest": os.path.abspath(args.manifest) if args.manifest else None}, (1 if args.fail_on_regression else 0)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "version"


def _source_name(versions) -> str:
    return os.path.basename(versions[0].path) if versions[0].commit else "dynamic_weight_manager.py"


def describe_result(result) -> str:
    if result.outcome == "report":
        rules = (result.report.get("summary") or {}).get("rules") or {}
        shown = [f"{n} {s}" for s, n in rules.items() if n]
        return "rules: " + (", ".join(shown) or "none")
    first = (result.message or "").strip().splitlines()
    return f"{result.outcome.replace('_', ' ')}: {first[0] if first else ''}".rstrip(": ")


def abort_on_bad_arguments(result) -> None:
    """A usage error that no content causes (pytest refusing the arguments) ends the whole run."""
    if result.outcome == "usage_error" and "unrecognized arguments" in result.message:
        raise HistoryError(f"pytest refused the arguments passed to it: {result.message}")


def empty_gate(args, source) -> int:
    """--fail-on-regression on a range that changed no version of the file: nothing got worse."""
    os.makedirs(args.output, exist_ok=True)
    summary = {"tool": "conformance.history", "format": 1, "gate": "passed", "source": source, "versions": 0,
               "regressions": [], "unjudged": [], "message": source["empty"]}
    atomic_write(os.path.join(args.output, "gate.json"), json.dumps(summary, indent=2).encode())
    print(f"gate: passed: {source['empty']}")
    return 0


def full_run(args, versions, source, suite, runner, start: int = 0) -> int:
    out = args.output
    name = _source_name(versions)
    distinct: dict[str, list] = {}
    for v in versions:
        distinct.setdefault(v.sha256, []).append(v)
    items = [(sha, name, group[0].content) for sha, group in distinct.items()]
    bar = progress_for(len(items), "suite runs")

    def done(result):
        abort_on_bad_arguments(result)
        group = distinct[result.sha256]
        ids = group[0].id + (f" (+{len(group) - 1} same content)" if len(group) > 1 else "")
        how = "cached" if result.cached else f"{result.duration_s:.1f} s"
        bar.advance(f"{ids}: {describe_result(result)} ({how})")

    started = time.monotonic()
    try:
        by_sha = runner.run_many(items, done)
    finally:
        bar.close()
    results = {v.index: by_sha[v.sha256] for v in versions}
    rows, reports, table, changes = verdicts.table(versions, results)
    gating = getattr(args, "fail_on_regression", False)
    regressions, unjudged = gate.judge(versions, results, start) if gating else ([], [])

    os.makedirs(os.path.join(out, "reports"), exist_ok=True)
    described = []
    for v in versions:
        r = results[v.index]
        entry = {**v.describe(), "outcome": r.outcome, "exit_status": r.exit_status, "message": r.message,
                 "report": None, "rules": None}
        if r.outcome == "report":
            rel = os.path.join("reports", f"{v.index:03d}-{_safe(v.id)}.json")
            atomic_write(os.path.join(out, rel), json.dumps(r.report, indent=2).encode())
            entry["report"] = rel
            entry["rules"] = (r.report.get("summary") or {}).get("rules")
        described.append(entry)
    executed = runner.executed
    adapter = suite.adapter
    history = {
        "tool": "conformance.history", "format": 1, "source": source,
        "suite": {"impl": suite.impl, "extra": list(suite.extra), "hash": runner.cache.suite_hash,
                  "command": suite.command("FILE", "REPORT.json"), "cache_read": runner.cache.read,
                  "adapter": None if adapter is None else {"where": adapter.where, "files": list(adapter.files),
                                                           "distributions": adapter.distributions}},
        "runs": {"versions": len(versions), "distinct": len(distinct), "executed": executed,
                 "cached": len(distinct) - executed},
        "versions": described,
        "rules": [{"id": row.id, "title": row.title, "area": row.area, "level": row.level,
                   "verdicts": table[row.id]} for row in rows],
        "changes": [c.to_json(versions) for c in changes],
    }
    if gating:
        history["gate"] = {"status": "failed" if gate.exit_status(regressions, unjudged) else "passed",
                           "judged_from": start,
                           "regressions": [r.to_json(versions) for r in regressions],
                           "unjudged": [versions[i].describe() | {"outcome": results[versions[i].index].outcome,
                                                                  "message": results[versions[i].index].message}
                                        for i in unjudged]}
        atomic_write(os.path.join(out, "gate.json"), json.dumps(
            {"tool": "conformance.history", "format": 1, "gate": history["gate"]["status"], "source": source,
             "versions": len(versions), **{k: v for k, v in history["gate"].items() if k != "status"}},
            indent=2).encode())
    atomic_write(os.path.join(out, "history.json"), json.dumps(history, indent=2).encode())
    what = source.get("path") or source.get("folder")
    html = page.render(f"Conformance history of {what}", versions, results, rows, reports, table, changes, what,
                       regressions=regressions if gating else None)
    atomic_write(os.path.join(out, "history.html"), html.encode("utf-8"))

    print(f"{len(versions)} version(s), {len(distinct)} distinct content(s) of {what}: {executed} suite run(s), "
          f"{len(distinct) - executed} from the cache ({time.monotonic() - started:.1f} s)")
    for v in versions:
        r = results[v.index]
        if r.outcome != "report":
            print(f"  {v.id}: {describe_result(r)}")
    if changes:
        print(f"{len(changes)} verdict change(s):")
        for c in changes:
            v = versions[c.index]
            print(f"  {c.rule}: {c.old} -> {c.new} at {v.id} ({v.date}) {v.title}")
    else:
        print("no verdict changes")
    print(f"written: {os.path.join(out, 'history.json')}, {os.path.join(out, 'history.html')}, "
          f"{os.path.join(out, 'reports')}/")
    failed = [v.id for v in versions if results[v.index].outcome in ("crashed", "timed_out")]
    if failed:
        print(f"no verdict for {len(failed)} version(s) (crashed or timed out, not cached): {', '.join(failed)}",
              file=sys.stderr)
    if gating:
        for line in gate.report_lines(versions, results, regressions, unjudged, start):
            print(line)
        return gate.exit_status(regressions, unjudged)
    return 1 if failed else 0


def bisect_run(args, versions, source, suite, runner) -> int:
    name = _source_name(versions)
    rule = args.bisect
    results = {}

    fetched = {}

    def prefetch(indices):
        """The first and last version at once (each bisection needs both)."""
        by_sha = runner.run_many([(versions[i].sha256, name, versions[i].content) for i in indices], lambda r: None)
        fetched.update(by_sha)

    def verdict_at(i: int) -> str:
        v = versions[i]
        result = fetched.get(v.sha256) or runner.run_one(v.sha256, name, v.content)
        abort_on_bad_arguments(result)
        if result.outcome in ("crashed", "timed_out"):
            raise HistoryError(f"version {v.id}: the suite run {result.outcome.replace('_', ' ')}: {result.message}")
        results[i] = result
        verdict = verdicts.verdict_of(result, rule)
        how = "cached" if result.cached else f"{result.duration_s:.1f} s"
        print(f"bisect: {v.id} ({v.date}) {rule}: {verdict} ({how})", file=sys.stderr, flush=True)
        return verdict

    found = verdicts.bisect(versions, rule, verdict_at, args.want_from, args.want_to, prefetch)
    executed = runner.executed
    summary = {"tool": "conformance.history", "format": 1, "source": source, "rule": rule,
               "from": args.want_from, "to": args.want_to, "found": found.found, "message": found.message,
               "versions": len(versions), "probed": [{**versions[i].describe(), "verdict": verdict}
                                                     for i, verdict in found.probed],
               "runs": {"executed": executed, "cached": len({versions[i].sha256 for i, _ in found.probed}) - executed}}
    if found.found:
        v, b = versions[found.index], versions[found.before]
        summary["change"] = {**v.describe(), "from": found.old, "to": found.new, "previous": b.describe()}
    os.makedirs(args.output, exist_ok=True)
    atomic_write(os.path.join(args.output, "bisect.json"), json.dumps(summary, indent=2).encode())
    print(f"{len(found.probed)} of {len(versions)} version(s) probed: {executed} suite run(s), "
          f"{summary['runs']['cached']} from the cache")
    if not found.found:
        print(f"no change found: {found.message}")
        return 1
    print(f"first change of {rule}: {found.old} -> {found.new}")
    print(f"  at     {v.id}{f' ({v.commit})' if v.commit else ''}  {v.date}  {v.title}")
    print(f"  before {b.id}  {b.date}  {b.title}")
    if found.message != f"{rule}: {found.old} -> {found.new} at {v.id}":
        print(f"  note: {found.message}")
    return 0


def _terminated(signum, frame):
    raise KeyboardInterrupt  # SIGTERM ends the runs as Ctrl-C does


def main(argv=None) -> int:
    parser, args = parse(argv)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _terminated)
    runner = None
    try:
        extra = absolute_options(check_rules(args.extra, args.bisect))
        versions, source, start = load_versions(args)
        impl = absolute_impl(args.impl)
        options = dict(opt.partition("=")[::2] for opt in impl_opts(extra))
        # Before any run: an adapter that cannot load is the same usage error for every version.
        # Installed, the suite runs from where the tool was started (run_dir) and its trees are site-packages'.
        adapter = probe(impl, {"source": "FILE", **options}, run_dir(), SUITE_TREES if checkout() else (),
                        excluded=[TOOL] if checkout() else [])
        if not versions:
            return empty_gate(args, source)
        suite = Suite(impl, tuple(extra), args.timeout, adapter)
        cache = Cache(args.cache or os.path.join(args.output, ".history-cache"), suite.fingerprint(),
                      base_hash=suite.fingerprint(rules=False), rules=rule_values(extra), read=not args.no_cache)
        runner = Runner(suite, cache, args.jobs, os.path.join(cache.folder, "work"), rule=args.bisect)
        if args.bisect:
            return bisect_run(args, versions, source, suite, runner)
        return full_run(args, versions, source, suite, runner, start)
    except AdapterError as e:
        print(f"conformance.history: error: the adapter cannot be loaded (exit 4, nothing was run): {e}",
              file=sys.stderr)
        return 4
    except HistoryError as e:
        if runner is not None:
            runner.stop()
        print(f"conformance.history: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if runner is not None:
            runner.stop()
        print("\nconformance.history: interrupted: the suite runs were ended; those that finished are cached, "
              "so the same command resumes", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
