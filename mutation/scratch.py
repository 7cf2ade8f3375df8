"""Mutation testing outside the project's ``[tool.mutmut]`` table (which mutates ``reference/`` against the
conformance suite): copy the tracked tree to a scratch directory, give the copy a table of its own, run
mutmut there and print every mutant that was not killed, then the counts. mutmut 3 reads one table per
tree, hence the copy. Used by ``mutation/gate.sh`` and ``mutation/agreement.sh``; needs mutmut in the
active venv.

    python mutation/scratch.py SCRATCH --source FILE... --tests FILE... [--also PATH...] [--pytest-arg ARG...]
        [--max-children N]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# weightsync/: the suite imports reference, fixtures and wire as weightsync.*, resolved beside weightsync/__init__.py
# (without it, the copy's imports would reach the tree an editable install points at). reference/: the rest of the
# package beside a mutated file of it (tests/test_agreement.py drives reference.manager); mutmut copies these first
# and writes the mutated files over them.
ALSO = ["weightsync/", "reference/", "conformance/", "fixtures/", "sim/", "wire/", "tests/", "conftest.py", "SPEC.md"]


def _toml_list(items) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def copy_tree(scratch: str) -> None:
    """The files git tracks, as they are in the working tree."""
    shutil.rmtree(scratch, ignore_errors=True)
    files = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        dest = os.path.join(scratch, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), dest)


def write_table(scratch: str, sources, tests, also, pytest_args) -> None:
    path = os.path.join(scratch, "pyproject.toml")
    text = open(path, encoding="utf-8").read()
    start = text.index("[tool.mutmut]")
    end = text.find("\n[", start + 1)
    table = (f"[tool.mutmut]\nsource_paths = {_toml_list(sources)}\nalso_copy = {_toml_list(also)}\n"
             f"pytest_add_cli_args = {_toml_list(['-p', 'no:cacheprovider', '-q', *pytest_args])}\n"
             f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + table + (text[end:] if end != -1 else ""))


def run(scratch: str, max_children: int | None) -> None:
    extra = [f"--max-children={max_children}"] if max_children else []
    subprocess.run(["mutmut", "run", *extra], cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = subprocess.run(["mutmut", "results", "--all", "true"], cwd=scratch, capture_output=True,
                           text=True).stdout.splitlines()
    results = [line for line in lines if ": " in line]
    for line in results:
        if not line.endswith(": killed"):
            print(line)
    print(f"killed: {sum(line.endswith(': killed') for line in results)}")
    print(f"total: {len(results)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scratch")
    ap.add_argument("--source", nargs="+", required=True, help="files to mutate")
    ap.add_argument("--tests", nargs="+", required=True, help="the tests that judge each mutant")
    ap.add_argument("--also", nargs="+", default=ALSO, help=f"copied beside the mutants (default {ALSO})")
    ap.add_argument("--pytest-arg", action="append", default=[], help="repeatable")
    ap.add_argument("--max-children", type=int)
    args = ap.parse_args(argv)
    copy_tree(args.scratch)
    write_table(args.scratch, args.source, args.tests, args.also, args.pytest_arg)
    run(args.scratch, args.max_children)
    return 0


if __name__ == "__main__":
    sys.exit(main())
