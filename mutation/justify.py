"""Append justifications for surviving mutants to ``mutation/justified.toml``.

    python -m mutation.justify LINES_FILE
    python -m mutation.justify --reviewed FUNCTION...   # after reading each entry of FUNCTION against its new code

Each line of LINES_FILE is ``MUTANT_NAME<TAB>KIND<TAB>REASON`` (KIND: equivalent | out-of-scope), for a
mutant of the last ``mutmut run`` in ``mutants/``. The entry records the mutated function and the diff's
changed lines and the function's hash (``context``: what ``mutation.report`` matches on), never mutmut's
number. Names already justified with the same change in the same code are skipped.

KIND ``equivalent`` only with an argument a reader can check against the code; anything observable
through the adapter is a test to write instead.
"""
from __future__ import annotations

import json
import os
import sys

from .report import JUSTIFIED, KINDS, REPO, load_justified, load_results


def _toml_string(text: str) -> str:
    return '"""\n' + text.replace("\\", "\\\\").replace('"""', '\\"""') + '\n"""'


def reviewed(functions: list[str]) -> int:
    """Stamp today's hash on the entries of FUNCTIONS, whose reasons a reader checked against the function
    as it is now (it changed, so they went stale): prints each entry so the commit shows what was vouched for."""
    from .current import function_hashes

    hashes = function_hashes({f.rpartition(".")[0] for f in functions})
    unknown = [f for f in functions if f not in hashes]
    if unknown:
        print(f"no such function today: {unknown}", file=sys.stderr)
        return 2
    with open(JUSTIFIED, encoding="utf-8") as f:
        lines = f.read().split("\n")
    current, stamped = None, 0
    for i, line in enumerate(lines):
        if line.startswith("function = "):
            current = json.loads(line.removeprefix("function = "))
        elif line.startswith("context = ") and current in functions:
            if lines[i] != f"context = {json.dumps(hashes[current])}":
                lines[i] = f"context = {json.dumps(hashes[current])}"
                stamped += 1
                print(f"{current}: reviewed, context {hashes[current]}")
    with open(JUSTIFIED, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print(f"{stamped} entr{'y' if stamped == 1 else 'ies'} stamped with today's context")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--reviewed"]:
        return reviewed(argv[1:])
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        wanted = [line.rstrip("\n").split("\t") for line in f if line.strip() and not line.startswith("#")]
    bad = [w for w in wanted if len(w) != 3 or w[1] not in KINDS or not w[2].strip()]
    if bad:
        print(f"malformed lines (need NAME<TAB>{'|'.join(KINDS)}<TAB>REASON): {bad[:5]}", file=sys.stderr)
        return 2
    os.chdir(REPO)
    results = {r.name: r for r in load_results()}
    have = {(e["function"], e["change"], e["context"]) for e in load_justified()}
    missing = [name for name, _, _ in wanted if name not in results]
    if missing:
        print(f"not mutants of the last run: {missing[:10]}", file=sys.stderr)
        return 2
    added = 0
    with open(JUSTIFIED, "a", encoding="utf-8") as out:
        for name, kind, reason in wanted:
            r = results[name]
            if not r.context:
                print(f"{name}: mutmut recorded no hash of its function; rerun mutmut", file=sys.stderr)
                return 2
            if (r.function, r.change, r.context) in have:
                continue
            have.add((r.function, r.change, r.context))
            out.write(f"\n[[mutant]]  # {name}\nfunction = {json.dumps(r.function)}\n"
                      f"change = {_toml_string(r.change)}\ncontext = {json.dumps(r.context)}\nkind = {json.dumps(kind)}\n"
                      f"reason = {json.dumps(reason.strip(), ensure_ascii=False)}\n")
            added += 1
    print(f"added {added} justification(s) to {os.path.relpath(JUSTIFIED, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
