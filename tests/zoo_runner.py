"""Run the conformance suite against many mutants quickly: import once, fork per mutant.

A cold ``pytest conformance`` pays for importing Paddle and collecting the suite (about 2-3 s on
the 2-core CI machine) before running the few rules a mutant must fail. Here one interpreter pays
that once; each mutant runs in a forked child (so its process-wide patches die with it, and a
crash such as a SIGBUS takes down only that child), ``--jobs`` at a time.

    python -m tests.zoo_runner --out DIR [--jobs N] MUTANT...

writes DIR/MUTANT.json (the conformance report) and DIR/MUTANT.log (the child's output).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warm_imports() -> None:
    """Import everything a conformance run needs, without starting threads or sockets."""
    import paddle  # noqa: F401
    import pytest  # noqa: F401

    import conformance.plugin  # noqa: F401
    import reference.adapter

    reference.adapter._load()  # (the adapter imports the reference on its first session: here, once for every child)

    import hypothesis  # noqa: F401  (its pytest plugin imports it at terminal summary: ~1 s)

    importlib.import_module("tests.mutants").all_mutants()
    # One in-process collection leaves the assertion-rewritten test modules in sys.modules, so the
    # children do not recompile them (~0.7 s each), and tells which modules hold each rule's tests.
    with silenced():
        pytest.main(["conformance", "--collect-only", "-q", "-p", "no:cacheprovider", "--impl=reference",
                     "-m", TIERS_AND_THE_REST], plugins=[RuleModules()])
    # Everything imported so far lives as long as the server: frozen, each child's collections (pytest runs
    # two full ones as it ends, ~0.2 s each over Paddle's heap) skip it.
    from tests.gc_frozen import freeze_heap

    freeze_heap()


@contextlib.contextmanager
def silenced():
    """File descriptors 1 and 2 on /dev/null for the block (a warm-up's collection prints the whole suite)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (devnull, *saved):
            os.close(fd)


# rule -> the conformance modules holding its tests, from the server's collection (empty: not collected yet)
RULE_MODULES: dict[str, set[str]] = {}


class RuleModules:
    """A pytest plugin for the server's collection: records which modules hold each rule's tests, before any
    plugin deselects one."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        from conformance.plugin import rule_of

        for item in items:
            rule = rule_of(item)
            if rule is not None:
                RULE_MODULES.setdefault(rule, set()).add(os.path.relpath(str(item.path), REPO))


def where_rules_are(rules) -> list[str]:
    """The modules that hold these rules' tests; the whole suite when the server has not collected it (or a
    rule has no test: the run then reports it as not run, and the zoo's test says so)."""
    if not RULE_MODULES or any(r not in RULE_MODULES for r in rules):
        return ["conformance"]
    return sorted(set().union(*(RULE_MODULES[r] for r in rules)))


def conformance_args(name: str, report: str) -> list[str]:
    from tests.mutants import all_mutants

    mutant = all_mutants()[name]
    kills = sorted(mutant.kills)
    # Only the modules of its rules: a child that collected the whole suite (1271 tests) to run a few of them
    # spent about a third of its time collecting.
    return [*where_rules_are(kills), "-q", "-p", "no:cacheprovider", f"--conformance-report={report}",
            "--impl=tests.mutants:mutant", f"--impl-opt=name={name}", *(f"--rule={r}" for r in kills),
            "--tb=native", "-m", TIERS_AND_THE_REST, *getattr(mutant, "zoo_args", ())]


# Every test of the mutant's rules, the tiers' included (a tier runs when -m names it; the multi-rank job
# starts only when a selected test needs it). A mutant's ``zoo_args`` narrow the run (``-k bucket``: one
# path of the multi-rank job, enough to kill it, instead of all three).
TIERS_AND_THE_REST = "multirank or cycles or pairs or not (multirank or cycles)"


class SkipOnceFailed:
    """A pytest plugin for one mutant's run: once a test of a rule the mutant must fail has failed, that
    rule is killed, and its remaining tests are skipped before their fixtures are set up (a skip never
    outranks a failure in the rule's status; tests/test_mutant_zoo.py asks each rule in ``kills`` for
    "failed"). Most mutants fail their rule's first few tests, so the run stops paying for the rest: the
    kill matrix's share of ``pytest tests``."""

    def __init__(self, kills):
        self.kills, self.killed, self.rule_of = frozenset(kills), set(), {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        from conformance.plugin import TIERS, rule_of

        # The tiers' tests last (the two-host ones carry multirank): a rule that fails in-process never
        # starts the ranks (20 s and more).
        items.sort(key=lambda item: any(item.get_closest_marker(t) for t in TIERS))
        self.rule_of = {item.nodeid: rule_of(item) for item in items}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        rule = self.rule_of.get(item.nodeid)
        if rule in self.killed:
            pytest.skip(f"zoo: rule {rule} already failed for this mutant")

    def pytest_runtest_logreport(self, report):
        rule = self.rule_of.get(report.nodeid)
        if report.when == "call" and report.failed and rule in self.kills:
            self.killed.add(rule)


def _child(name: str, out_dir: str) -> None:
    code = 70
    try:
        log = os.open(os.path.join(out_dir, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        from tests.mutants import all_mutants

        plugin = SkipOnceFailed(all_mutants()[name].kills)
        code = int(pytest.main(conformance_args(name, os.path.join(out_dir, f"{name}.json")), plugins=[plugin]))
    except BaseException as e:  # report, never fall back into the parent's loop
        print(f"zoo child {name} crashed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(names: list[str], out_dir: str, jobs: int) -> dict[str, int]:
    """Exit status per mutant (negative: killed by that signal)."""
    os.chdir(REPO)
    os.makedirs(out_dir, exist_ok=True)
    warm_imports()
    pending, running, status = list(names), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(name, out_dir)
            running[pid] = (name, time.monotonic())
        pid, raw = os.wait()
        name, _ = running.pop(pid)
        status[name] = os.waitstatus_to_exitcode(raw)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", type=int, default=max(2, os.cpu_count() or 2))
    parser.add_argument("mutants", nargs="+")
    args = parser.parse_args(argv)
    for name, code in run(args.mutants, args.out, args.jobs).items():
        print(f"{name}\t{code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
