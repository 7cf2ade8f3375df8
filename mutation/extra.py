"""Mutation of what mutmut leaves alone in ``reference/``: module-level constants and decorated functions.

    python -m mutation.extra --list                        # today's mutants, one line each
    python -m mutation.extra --run [--only GLOB] [--workers N | --jobs N]  # judge them, then mutation/EXTRA.md
    python -m mutation.extra --check                       # every justification matches a mutant of today's code
    python -m mutation.extra --justify LINES_FILE          # append entries: NAME<TAB>KIND<TAB>REASON per line

mutmut 3 mutates the bodies of undecorated functions only: a timeout, the version file's size limit, a message
SPEC.md pins or a regular expression at module level, and the body of a ``@property``, ``@classmethod`` or
``@contextmanager`` function, are never changed, so no run says whether a test would notice. This pass makes
those mutants itself (``ast``: one change each) and judges each the way mutmut does: the tree is copied to a
scratch folder (the files git tracks), the mutated module written there, and the conformance suite (with the
``restart`` tier, as ``[tool.mutmut]`` selects) and the project test files of mutmut's selection run in a child
with ``-x``; exit 0 is a survivor, exit 1 a kill, a timeout a kill (``timeout``), anything else an error.
``--workers N`` runs each mutant's tests on N pytest-xdist workers (one mutant at a time: a survivor's whole
selection takes about 50 s with 2, against about 280 s serially); ``--jobs N`` judges N mutants at once instead,
each serially.

The mutants:
- a number constant: ``n + 1``, ``n - 1`` (not below 0 for a positive one), ``n * 2`` and ``n / 2`` for a float;
- a string constant (a message, a name, a pattern compiled at module level): ``"XX" + s + "XX"`` and ``""``;
- a bool: its negation; a tuple, list or set of constants: its first element dropped;
- arithmetic of literals (``64 * 1024``): the value plus one and minus one;
- in a decorated function: a call made for its effect (an expression statement) left out, every comparison
  operator swapped (``==``/``!=``, ``<``/``<=``, ``>``/``>=``,
  ``in``/``not in``, ``is``/``is not``), ``and``/``or``, ``+``/``-``, ``*``/``/``, a ``not`` removed, numbers
  and strings as above, ``True``/``False`` swapped, a ``return`` value replaced by ``None``.

A survivor is killed by a sharper test or justified in ``mutation/extra_justified.toml`` exactly like mutmut's
(``mutation/justified.toml``): the target (``module:name``), the change, ``context`` (a hash of the target's
source: an entry goes stale as soon as its target changes) and ``kind`` ``equivalent`` or ``out-of-scope`` with a
reason. ``--run`` fails (exit 1) on an unjustified survivor, an error or a stale entry; ``--check`` runs in
``pytest tests`` (tests/test_mutation_extra.py).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "reference"
JUSTIFIED = os.path.join(REPO, "mutation", "extra_justified.toml")
REPORT = os.path.join(REPO, "mutation", "EXTRA.md")
KINDS = ("equivalent", "out-of-scope")
TIMEOUT_S = 900
# What judges a mutant: mutmut's selection (pyproject [tool.mutmut], read from there), run whole with -x.
with open(os.path.join(REPO, "pyproject.toml"), "rb") as _f:
    TESTS = tomllib.load(_f)["tool"]["mutmut"]["pytest_add_cli_args_test_selection"]
# The project's unit tests first: they take seconds, and a mutant they kill stops the run (-x) before the suite.
TESTS = sorted(TESTS, key=lambda t: not t.startswith("tests/"))
PYTEST_ARGS = ["--impl=reference", "--project-tests-count", "-p", "no:cacheprovider", "-q", "-x",
               "-m", "restart or pairs or not (multirank or cycles or huge)"]
# Constants that are not behaviour: the package's version string and export list, the logger names.
SKIP_CONSTANTS = {"__version__", "_EXPORTS", "__all__"}


@dataclass(frozen=True)
class Mutant:
    module: str  # reference.buckets
    target: str  # a constant's name or a decorated function's qualified name
    index: int  # the mutant's number within its target
    before: str  # the target's source line(s) that change, unparsed
    after: str
    context: str  # sha256 of the target's unmutated source, first 12 hex digits

    @property
    def name(self) -> str:
        return f"{self.module}:{self.target}:{self.index}"

    @property
    def key(self) -> str:
        return f"{self.module}:{self.target}"

    @property
    def change(self) -> str:
        return f"-{self.before}\n+{self.after}"


# -- making the mutants -------------------------------------------------------------------------------
def _const_variants(value) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1]
    if isinstance(value, float):
        return [v for v in dict.fromkeys([value + 1, value * 2, value / 2]) if v != value]
    if isinstance(value, str):
        return ["XX" + value + "XX"] + ([""] if value else [])
    if isinstance(value, bytes):
        return [b"XX" + value + b"XX"]
    return []


class _Sites(ast.NodeVisitor):
    """Every place in one subtree a mutant can change, in source order: (node path, replacement builder)."""

    SWAP_CMP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE,
                ast.GtE: ast.Gt, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
    SWAP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}

    def __init__(self):
        self.sites: list = []  # (node, kind, detail)

    def visit_FunctionDef(self, node):
        for stmt in node.body:  # decorators, arguments and annotations are not the behaviour
            self.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_JoinedStr(self, node):
        return  # an f-string's pieces: its constants are message text, mutated whole below

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring
        if isinstance(node.value, ast.Call):
            self.sites.append((node, "drop-call", None))  # a call made for its effect, left out
        self.generic_visit(node)

    def visit_Compare(self, node):
        for i, op in enumerate(node.ops):
            if type(op) in self.SWAP_CMP:
                self.sites.append((node, "cmp", i))
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        self.sites.append((node, "bool", None))
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if type(node.op) in self.SWAP_BIN:
            self.sites.append((node, "bin", None))
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            self.sites.append((node, "not", None))
        self.generic_visit(node)

    def visit_Constant(self, node):
        for v in _const_variants(node.value):
            self.sites.append((node, "const", v))

    def visit_Return(self, node):
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self.sites.append((node, "return", None))
        self.generic_visit(node)


def _apply(node, kind, detail):
    """A mutated copy of ``node`` (the site), or None when the change is not possible."""
    new = copy.deepcopy(node)
    if kind == "cmp":
        new.ops[detail] = _Sites.SWAP_CMP[type(new.ops[detail])]()
    elif kind == "bool":
        new.op = ast.Or() if isinstance(new.op, ast.And) else ast.And()
    elif kind == "bin":
        new.op = _Sites.SWAP_BIN[type(new.op)]()
    elif kind == "not":
        return copy.deepcopy(node.operand)
    elif kind == "const":
        new.value = detail
    elif kind == "return":
        new.value = ast.Constant(None)
    elif kind == "drop-call":
        return ast.Pass()
    elif kind == "expr":  # an arithmetic constant expression, moved by detail (+1 or -1)
        return ast.BinOp(new, ast.Add(), ast.Constant(detail))
    return new


def _targets(tree: ast.Module):
    """(name, node, is_function) of every module-level constant assignment and every decorated function."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            names = [ast.unparse(t) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
            if any(n in SKIP_CONSTANTS for n in names):
                continue
            if _is_constant(node.value):
                yield names[0], node, False
    def walk(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from walk(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.decorator_list:
                yield prefix + node.name, node, True
    yield from walk(tree.body, "")


def _is_constant(value) -> bool:
    """A literal, arithmetic of literals (``64 * 1024``), a container of literals, or ``re.compile(literal, ...)``."""
    if isinstance(value, ast.Constant):
        return True
    if isinstance(value, ast.BinOp):
        return all(isinstance(n, (ast.Constant, ast.BinOp, ast.operator)) for n in ast.walk(value))
    if isinstance(value, (ast.Tuple, ast.List, ast.Set)):
        return bool(value.elts) and all(isinstance(e, ast.Constant) for e in value.elts)
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "re.compile":
        return bool(value.args) and isinstance(value.args[0], ast.Constant)
    return False


def _constant_sites(node):
    value = node.value
    if isinstance(value, ast.Constant):
        return [(value, "const", v) for v in _const_variants(value.value)]
    if isinstance(value, ast.BinOp):
        return [(value, "expr", 1), (value, "expr", -1)]
    if isinstance(value, ast.Call):  # re.compile(pattern, ...): the pattern
        pattern = value.args[0]
        return [(pattern, "const", v) for v in _const_variants(pattern.value)]
    if len(value.elts) > 1:
        return [(value, "drop-first", None)]
    return []


def mutants_of(path: str, module: str) -> list[tuple[Mutant, str]]:
    """(mutant, mutated module source) for one file."""
    text = open(path, encoding="utf-8").read()
    tree = ast.parse(text)
    parents = {child: (node, field) for node in ast.walk(tree) for field, value in ast.iter_fields(node)
               for child in (value if isinstance(value, list) else [value]) if isinstance(child, ast.AST)}
    out = []
    for name, node, is_function in _targets(tree):
        source = ast.get_source_segment(text, node) or ast.unparse(node)
        context = hashlib.sha256(source.encode()).hexdigest()[:12]
        if is_function:
            finder = _Sites()
            finder.visit(node)
            sites = finder.sites
        else:
            sites = _constant_sites(node)
        for index, (site, kind, detail) in enumerate(sites, 1):
            if kind == "drop-first":
                replacement = copy.deepcopy(site)
                replacement.elts = replacement.elts[1:]
            else:
                replacement = _apply(site, kind, detail)
            stmt = _statement_of(node, site) if is_function else node
            before = ast.unparse(stmt).splitlines()[0]
            with _swapped(parents, site, replacement):  # the tree itself, put back after
                after = ast.unparse(replacement if stmt is site else stmt).splitlines()[0]
                mutated = ast.unparse(tree)
            out.append((Mutant(module, name, index, before, after, context), mutated))
    return out


@contextlib.contextmanager
def _swapped(parents, node, replacement):
    """``node`` replaced by ``replacement`` in its parent for the block."""
    parent, field = parents[node]
    value = getattr(parent, field)
    if isinstance(value, list):
        i = next(k for k, v in enumerate(value) if v is node)
        value[i] = replacement
        try:
            yield
        finally:
            value[i] = node
    else:
        setattr(parent, field, replacement)
        try:
            yield
        finally:
            setattr(parent, field, node)


def _statement_of(function, site):
    """The innermost statement of ``function`` containing ``site``."""
    best = None
    for node in ast.walk(function):
        if isinstance(node, ast.stmt) and node is not function and any(n is site for n in ast.walk(node)):
            if best is None or (node.lineno, -node.end_lineno) >= (best.lineno, -best.end_lineno):
                best = node
    return best or function


def generate(only: str | None = None) -> list[tuple[Mutant, str, str]]:
    """(mutant, path relative to the repo, mutated source) for every module of ``reference/``."""
    out = []
    folder = os.path.join(REPO, SOURCE)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        module = f"{SOURCE}.{name[:-3]}"
        rel = os.path.join(SOURCE, name)
        for mutant, source in mutants_of(os.path.join(REPO, rel), module):
            if only is None or fnmatch.fnmatch(mutant.name, only) or fnmatch.fnmatch(mutant.key, only):
                out.append((mutant, rel, source))
    return out


# -- justifications -----------------------------------------------------------------------------------
def load_justified(path: str = JUSTIFIED) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    for e in entries:
        missing = {"target", "change", "context", "kind", "reason"} - set(e)
        if missing or e["kind"] not in KINDS or not str(e["reason"]).strip():
            raise ValueError(f"{path}: entry {e.get('target')} lacks {sorted(missing)} or has a bad kind/reason")
    return entries


def _matches(entry: dict, mutant: Mutant) -> bool:
    return (entry["target"] == mutant.key and entry["context"] == mutant.context
            and entry["change"].strip() == mutant.change.strip())


def stale(entries: list[dict], mutants: list[Mutant]) -> list[dict]:
    """Entries no mutant of today's code matches."""
    return [e for e in entries if not any(_matches(e, m) for m in mutants)]


def justification(entries: list[dict], mutant: Mutant) -> dict | None:
    return next((e for e in entries if _matches(e, mutant)), None)


def justify(lines_path: str, path: str = JUSTIFIED) -> int:
    """Append an entry for each line ``NAME<TAB>KIND<TAB>REASON`` of ``lines_path`` (a mutant of today's code, by
    its ``--list`` name); a mutant already justified is skipped. Exit 2 on an unknown name or kind."""
    from .justify import _toml_string  # mutmut's entries are written the same way

    mutants = {m.name: m for m, _, _ in generate()}
    entries = load_justified(path)
    out, bad = [], []
    with open(lines_path, encoding="utf-8") as f:
        for line in filter(str.strip, f):
            name, kind, reason = (line.rstrip("\n").split("\t") + ["", ""])[:3]
            mutant = mutants.get(name)
            if mutant is None or kind not in KINDS or not reason.strip():
                bad.append(line.strip())
                continue
            if justification(entries, mutant) is None:
                out.append(f"\n[[mutant]]  # {name}\ntarget = {json.dumps(mutant.key)}\n"
                           f"change = {_toml_string(mutant.change)}\ncontext = {json.dumps(mutant.context)}\n"
                           f"kind = {json.dumps(kind)}\nreason = {json.dumps(reason.strip())}\n")
    if bad:
        print("not a mutant of today's code, or a bad kind or reason:\n" + "\n".join(bad), file=sys.stderr)
        return 2
    added = len(out)
    if not os.path.exists(path):
        out.insert(0, HEADER)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(out))
    print(f"{added} entries added to {path}")
    return 0


HEADER = """# Surviving mutants of mutation/extra.py (module-level constants and decorated functions of reference/), each with
# its reason. Matched on the target (module:name), the change, and `context`, the hash of the target's unmutated
# source: an entry goes stale, and fails `python -m mutation.extra --check` and tests/test_mutation_extra.py, as
# soon as its target changes at all. Written by `python -m mutation.extra --justify LINES_FILE`.
#
# kind = "equivalent": an argument a reader can check against the code; "out-of-scope": what the suite does not
# judge, and why.
"""


# -- running ------------------------------------------------------------------------------------------
def _scratch(root: str) -> str:
    from .scratch import copy_tree

    copy_tree(root)
    return root


# pytest-xdist's end of a -x run that failed, and the summary line's count of failures (or errors)
_STOPPED = re.compile(r"Interrupted: stopping after \d+ failures")
_FAILED = re.compile(r"^(?:.*\s)?\d+ (failed|errors?)\b.*\bin [\d.]+s", re.M)
_COLLECTION_ERROR = re.compile(r"^ERROR [^\s:]+( - .*)?$", re.M)  # a file that did not import, not a test


def outcome(returncode: int, output: str) -> str:
    """A mutant's status from its pytest run: exit 0 survived, 1 killed, anything else an error. pytest-xdist ends a
    ``-x`` run whose test failed with exit 2 ("stopping after 1 failures"): a kill, unless what failed was a test
    file's import (a serial run says "error during collection" and exits 2: an error in both)."""
    if returncode == 2 and _STOPPED.search(output) and _FAILED.search(output) and not _COLLECTION_ERROR.search(output):
        return "killed"
    return {0: "survived", 1: "killed"}.get(returncode, f"error (exit {returncode})")


def judge(scratch: str, rel: str, source: str, timeout_s: float = TIMEOUT_S, workers: int = 0) -> tuple[str, float]:
    """Run the tests with ``rel`` replaced by ``source`` in ``scratch`` (on ``workers`` pytest-xdist workers, or
    serially); restore it. (status, seconds)."""
    path = os.path.join(scratch, rel)
    original = open(path, encoding="utf-8").read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    env = {**os.environ, "PYTHONPATH": scratch, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        xdist = ["-n", str(workers)] if workers else []
        proc = subprocess.run([sys.executable, "-m", "pytest", *TESTS, *PYTEST_ARGS, *xdist], cwd=scratch, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
        status = outcome(proc.returncode, proc.stdout)
    except subprocess.TimeoutExpired:
        status = "timeout"
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
    return status, time.monotonic() - start


def run(only: str | None, jobs: int, results_path: str, workers: int = 0) -> dict[str, str]:
    todo = generate(only)
    done: dict[str, str] = {}
    if os.path.exists(results_path):
        with open(results_path, encoding="utf-8") as f:
            done = json.load(f)
    todo = [t for t in todo if t[0].name not in done]
    scratches = [_scratch(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mutation-extra-{os.getpid()}-{i}"))
                 for i in range(jobs)]
    free = list(scratches)

    def one(item):
        mutant, rel, source = item
        scratch = free.pop()
        try:
            status, seconds = judge(scratch, rel, source, workers=workers)
        finally:
            free.append(scratch)
        done[mutant.name] = status
        with open(results_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(done, f, indent=1, sort_keys=True)
        os.replace(results_path + ".tmp", results_path)
        print(f"{mutant.name}: {status} ({seconds:.0f} s)  {mutant.change!r}", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, todo))
    return done


def report(results: dict[str, str], only: str | None = None) -> tuple[str, bool]:
    entries = load_justified()
    mutants = [m for m, _, _ in generate(only)]
    lines = ["# Mutation of constants and decorated functions (`python -m mutation.extra`)", "",
             f"{len(mutants)} mutants of module-level constants and decorated functions of `reference/` "
             "(what mutmut does not mutate). Each survivor is justified in `mutation/extra_justified.toml`.", ""]
    counts: dict[str, int] = {}
    unjustified, errors = [], []
    for m in mutants:
        status = results.get(m.name, "not run")
        if status in ("survived",):
            e = justification(entries, m)
            status = f"survived ({e['kind']})" if e else "survived (UNJUSTIFIED)"
            if not e:
                unjustified.append(m)
        elif status.startswith("error") or status == "not run":
            errors.append((m, status))
        counts[status] = counts.get(status, 0) + 1
    gone = stale(entries, mutants)
    detected = sum(n for s, n in counts.items() if s in ("killed", "timeout"))
    lines.append("| outcome | mutants |")
    lines.append("|---|---|")
    lines += [f"| {s} | {n} |" for s, n in sorted(counts.items())]
    lines += ["", f"Detected (killed or timed out): {detected} of {len(mutants)}."]
    if unjustified:
        lines += ["", "## Unjustified survivors", ""] + [f"- `{m.name}`: `{m.change}`" for m in unjustified]
    if errors:
        lines += ["", "## Not judged", ""] + [f"- `{m.name}`: {s}" for m, s in errors]
    if gone:
        lines += ["", "## Stale justifications", ""] + [f"- `{e['target']}`: `{e['change'].strip()}`" for e in gone]
    ok = not unjustified and not errors and not gone
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--only", help="a glob over module:target or module:target:index")
    ap.add_argument("--justify", metavar="LINES_FILE", help="append justifications: NAME<TAB>KIND<TAB>REASON per line")
    ap.add_argument("--jobs", type=int, default=1, help="mutants judged at once (each serially)")
    ap.add_argument("--workers", type=int, default=0, help="pytest-xdist workers for each mutant's tests")
    ap.add_argument("--results", default=os.path.join(REPO, "mutation", ".extra-results.json"))
    args = ap.parse_args(argv)
    if args.list:
        for m, rel, _ in generate(args.only):
            print(f"{m.name}\t{m.change!r}")
        return 0
    if args.justify:
        return justify(args.justify)
    if args.check:
        gone = stale(load_justified(), [m for m, _, _ in generate()])
        for e in gone:
            print(f"stale: {e['target']}: {e['change'].strip()!r}")
        return 1 if gone else 0
    if args.run:
        if args.workers and args.jobs > 1:
            ap.error("--workers and --jobs > 1 together would run workers x jobs pytest processes")
        results = run(args.only, args.jobs, args.results, args.workers)
    else:
        with open(args.results, encoding="utf-8") as f:
            results = json.load(f)
    text, ok = report(results, args.only)
    if args.only is None:
        with open(REPORT, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
