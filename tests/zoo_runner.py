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
import importlib
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warm_imports() -> None:
    """Import everything a conformance run needs, without starting threads or sockets."""
    import paddle  # noqa: F401
    import pytest  # noqa: F401

    import conformance.plugin  # noqa: F401
    import reference.adapter  # noqa: F401

    import hypothesis  # noqa: F401  (its pytest plugin imports it at terminal summary: ~1 s)

    importlib.import_module("tests.mutants").all_mutants()
    # One in-process collection leaves the assertion-rewritten test modules in sys.modules, so the
    # children do not recompile them (~0.7 s each).
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        pytest.main(["conformance", "--collect-only", "-q", "-p", "no:cacheprovider", "--impl=reference"])
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(devnull)


def conformance_args(name: str, report: str) -> list[str]:
    from tests.mutants import all_mutants

    mutant = all_mutants()[name]
    kills = sorted(mutant.kills)
    return ["conformance", "-q", "-p", "no:cacheprovider", f"--conformance-report={report}",
            "--impl=tests.mutants:mutant", f"--impl-opt=name={name}", *(f"--rule={r}" for r in kills),
            "-m", TIERS_AND_THE_REST, *getattr(mutant, "zoo_args", ())]


# Every test of the mutant's rules, the tiers' included (a tier runs when -m names it; the multi-rank job
# starts only when a selected test needs it). A mutant's ``zoo_args`` narrow the run (``-k bucket``: one
# path of the multi-rank job, enough to kill it, instead of all three).
TIERS_AND_THE_REST = "multirank or cycles or not (multirank or cycles)"


def _child(name: str, out_dir: str) -> None:
    code = 70
    try:
        log = os.open(os.path.join(out_dir, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        import pytest

        code = int(pytest.main(conformance_args(name, os.path.join(out_dir, f"{name}.json"))))
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
