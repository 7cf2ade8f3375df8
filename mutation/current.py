"""The mutants of the tree as it is now, generated in memory (no test run, no ``mutants/``).

    python -m mutation.current            # every justification checked against today's mutants

A justification in ``justified.toml`` is keyed to the mutant's context: the mutated function, the
changed lines, and ``context``, mutmut's own hash of the function's syntax tree (the hash mutmut uses to
decide that a function changed and its mutants must run again). When the function changes in any way,
its justifications no longer match anything and are stale: a reason written for old code never excuses
a mutant of new code. This check needs no mutmut run, so it runs on every tree (tests/test_mutation_report.py).
"""
from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class CurrentMutant:
    name: str  # reference.apply.x_apply_tensors__mutmut_11
    function: str  # reference.apply.x_apply_tensors
    change: str  # the diff's removed and added lines, stripped (as report.Result.change)
    context: str  # mutmut's hash of the unmutated function


def change_between(orig: list[str], mutant: list[str]) -> str:
    """The removed and added lines of a unified diff of two function texts, each stripped."""
    return "\n".join(line[0] + line[1:].strip() for line in difflib.unified_diff(orig, mutant, lineterm="", n=0)
                     if line[:1] in "+-" and not line.startswith(("+++", "---")))


def _function_text(lines: list[str], span, generated: str, original: str) -> list[str]:
    # The generated copies are named x_f__mutmut_orig and x_f__mutmut_N: one name for both, so the
    # def line drops out of the diff as it does in mutmut's own diff.
    return [line.replace(generated, original) for line in lines[span.start - 1:span.end]]


def generate() -> list[CurrentMutant]:
    """Every mutant mutmut would make of the configured source paths today."""
    from mutmut.configuration import config
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.file_utils import walk_mutatable_files
    from mutmut.utils.format_utils import get_mutant_name, mangled_name_from_mutant_name

    cwd = os.getcwd()
    os.chdir(REPO)  # mutmut reads pyproject.toml and walks paths from the working directory
    try:
        out = []
        for path in walk_mutatable_files():
            if not config().should_mutate(path):
                continue
            mutated = mutate_file_contents(str(path), Path(path).read_text(encoding="utf-8"))
            lines = mutated.code.split("\n")
            spans = mutated.line_span_by_function_name
            for short in mutated.mutant_names:
                func = mangled_name_from_mutant_name(short)
                name = get_mutant_name(Path(path), short)
                # mutmut's diff names the function as written (x_f -> f, xǁCǁm -> m): a mutant of the def line
                # (a default argument) reads the same here as in the report's diff.
                plain = func.rpartition("ǁ")[2] if "ǁ" in func else func.removeprefix("x_")
                orig = _function_text(lines, spans[func + "__mutmut_orig"], func + "__mutmut_orig", plain)
                mut = _function_text(lines, spans[short], short, plain)
                out.append(CurrentMutant(name, name.rsplit("__mutmut_", 1)[0], change_between(orig, mut),
                                         mutated.hash_by_function_name[func.rpartition(".")[2]]))
        return out
    finally:
        os.chdir(cwd)


def key(function: str, change: str, context: str) -> tuple[str, str, str]:
    return function, change, context


def stale_entries(justified: list[dict], mutants: list[CurrentMutant]) -> list[dict]:
    """Justifications that match no mutant of today's code (function, change and context)."""
    have = {key(m.function, m.change, m.context) for m in mutants}
    return [e for e in justified if key(e["function"], e["change"], e.get("context", "")) not in have]


def function_hashes(module_names) -> dict[str, str]:
    """function (reference.apply.x_apply_tensors) -> mutmut's hash of it today, for the given modules: the
    cheap half of the stale check (ast only, under a second). An entry whose context equals its function's
    hash was written for the function as it is, so its mutant is still made (same code, same mutmut)."""
    from mutmut.mutation.file_mutation import compute_function_hashes

    out = {}
    for module in module_names:
        path = os.path.join(REPO, *module.split(".")) + ".py"
        if not os.path.exists(path):  # a package's own functions (reference.x___getattr__): its __init__.py
            path = os.path.join(REPO, *module.split("."), "__init__.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for func, digest in compute_function_hashes(f.read()).items():
                out[f"{module}.{func}"] = digest
    return out


def stale_by_context(justified: list[dict]) -> list[dict]:
    hashes = function_hashes({e["function"].rpartition(".")[0] for e in justified})
    return [e for e in justified if hashes.get(e["function"]) != e.get("context")]


def main(argv=None) -> int:
    from .report import JUSTIFIED, load_justified

    mutants = generate()
    justified = load_justified()
    stale = stale_entries(justified, mutants)
    print(f"{len(mutants)} mutants of today's code; {len(justified)} justifications, {len(stale)} stale")
    for e in stale:
        print(f"  stale: {e['function']} context {e.get('context', '(none)')}: {e['change']!r}")
    if stale:
        print(f"each stale entry of {os.path.relpath(JUSTIFIED, REPO)} was written for code that changed: kill the "
              "mutant with a test, or justify it again for the code as it is (python -m mutation.justify)",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
