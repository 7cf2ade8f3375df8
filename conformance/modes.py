"""The mode space of every rule: declared once, covered pairwise, and shown.

A rule's behaviour exists in *modes*: the load path, staged or not, in place or after a clear, a contiguous
or a strided parameter, the main or the draft model, rank 0 or a follower, the first or a later consecutive
call, the phase a fault hits and the operation it hits, one failing rank or several. Each rule declares its
axes once, in SPEC.md, on a ``Modes:`` line right before its ``Proven by:`` line::

    Modes: path(parts, single, ipc, bucket) × staged × model.
    Modes: path × start; except path=parts with start=loaded (a snapshot update needs a clear first).
    Modes: n/a (a naming rule: one behaviour, no mode).
    Modes: start × model; note: a strided target is judged by APPLY-STRIDED-TARGET.

An axis of :data:`AXES` takes its default values unless the rule lists some; any other axis must list
its values. ``except A=v with B=w (why)`` removes a pair no case can exercise; ``admit A=v with B=w (why)``
keeps, for this rule, a pair :data:`GLOBAL_EXCLUDED` removes everywhere else (a rule whose cases can exercise it:
MODEL-STORAGE-KEPT's first update into an engine's placeholders on a clear-first path); ``note: ...`` is for the
reader; ``quick: each`` splits a rule whose pairs cost too much for the quick run (forked ranks, held windows): the
quick run covers **every value of every axis**, and the tier ``pairs`` (``-m pairs``) holds the rest of its cases,
so the quick run and the tier together cover every pair (:func:`quick_split`). The rule's cases must then
cover **every pair of values of every two axes** (every value, for a rule of one axis): the plugin computes
which pairs the collected cases cover (from each case's ``@pytest.mark.modes(axis=value, ...)`` marks and
what :func:`item_modes` derives), and ``--list-rules``, the JSON report and the matrix page state them,
uncovered pairs by name.

:func:`pairwise` builds a small set of cases covering every pair (a greedy covering array, deterministic),
and :func:`params` turns it into ``pytest.param`` s carrying their ``modes`` and ``requires`` marks, so a
test parametrized with ``params("RULE-ID", requires=...)`` covers its declaration by construction.
"""
from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import pytest

#: Known axes and their values, in the order cases are generated. A rule may restrict an axis to some of
#: its values; an axis not listed here must list its values in the rule's declaration.
AXES: dict[str, tuple[str, ...]] = {
    # the load path (snapshot levels, the ipc metas, the buckets, the streamed paths)
    "path": ("parts", "single", "legacy", "shared", "ipc", "bucket", "rsync", "gdr", "gdr_ipc"),
    # staged: nothing adopted before the whole update is complete and agreed (options["staged"])
    "staged": ("plain", "staged"),
    # cleared: the update follows a clear; loaded: it writes into loaded weights (the streamed paths)
    "start": ("cleared", "loaded"),
    # contiguous or strided (a column-major / transposed view) parameter
    "layout": ("contiguous", "strided"),
    # the behaviour judged on the main model's tensors or on the draft (MTP) model's
    "model": ("main", "draft"),
    # the rank the behaviour is judged on: tensor-parallel rank 0 (writes the cell) or a follower
    "rank": ("rank0", "follower"),
    # the consecutive call of the operation in one session
    "call": ("first", "second", "third"),
    # the operation a fault hits
    "op": ("clear", "update"),
    # how many ranks fail at once
    "failing": ("one", "several"),
    # where the bad item sits in its sequence
    "position": ("first", "middle", "last"),
    # small (KiB) or large (>= 8 MiB: every copy strategy runs)
    "size": ("small", "large"),
}

#: A path capability -> the path it names (``requires`` of a case that needs exactly one path).
PATH_OF_CAPABILITY = {
    "snapshot.parts": "parts", "snapshot.single": "single", "snapshot.legacy": "legacy",
    "snapshot.shared_fallback": "shared", "ipc.meta": "ipc", "ipc.buckets": "bucket",
    "stream.rsync": "rsync", "stream.gdr": "gdr", "stream.gdr_ipc": "gdr_ipc",
}
CAPABILITY_OF_PATH = {path: cap for cap, path in PATH_OF_CAPABILITY.items()}

#: Pairs no case of any rule can exercise, with the reason: left out of every declaration that has both values.
IN_PLACE_PATHS = ("rsync", "gdr", "gdr_ipc")
GLOBAL_EXCLUDED: dict[frozenset, str] = {
    **{frozenset({("path", p), ("start", "loaded")}): "only the streamed paths update loaded weights in place; "
       "the others load cleared weights and refuse an update without a clear (LIFE-RECOVERY)"
       for p in AXES["path"] if p not in IN_PLACE_PATHS},
    **{frozenset({("path", p), ("staged", "staged")}): "GDR hands each item to the model's own load_weights as it "
       "arrives: there is nothing for the loader to stage (STAGE)" for p in ("gdr", "gdr_ipc")},
}

MODES_LINE = re.compile(r"^Modes:\s*(.*)$")
_AXIS = re.compile(r"^([a-z][a-z_]*)\s*(?:\((.*)\))?$")
_VALUE = re.compile(r"^[A-Za-z0-9_.+\-]+$")
_EXCEPT = re.compile(r"^(except|admit)\s+([a-z][a-z_]*)=(\S+)\s+with\s+([a-z][a-z_]*)=(\S+?)\s*(?:\((.+)\))?$")

Pair = tuple[tuple[str, str], ...]  # ((axis, value),) or ((axis_a, a), (axis_b, b)) with axis_a < axis_b


#: The tier that holds the cases a ``quick: each`` rule's quick run leaves out (its marker; ``-m pairs`` runs it).
PAIRS_TIER = "pairs"
QUICK_EACH = "each"


class Declaration(NamedTuple):
    """A rule's mode space: ``axes`` (axis -> values, in declaration order), the excluded pairs (each with its
    reason), ``na``: the reason the rule has no mode axis (then ``axes`` is empty), ``admitted``: the pairs of
    :data:`GLOBAL_EXCLUDED` this rule keeps (each with its reason), and ``quick``: ``"each"`` where the quick run
    covers every value and the tier ``pairs`` the rest of the pairs (``quick: each``), else empty."""

    axes: dict[str, tuple[str, ...]]
    excluded: dict[Pair, str]
    na: str = ""
    admitted: Mapping[Pair, str] = {}
    quick: str = ""

    def required(self) -> list[Pair]:
        """Every pair a rule's cases must cover (every value, for one axis): excluded pairs (the rule's own and
        :data:`GLOBAL_EXCLUDED`) left out, and so is a pair that the exclusions leave in no whole combination (with
        rsync and gdr unstaged and only the streamed paths in place, staged never meets loaded)."""
        names = list(self.axes)
        if len(names) == 1:
            return [((names[0], v),) for v in self.axes[names[0]]]
        out = []
        excluded = self.all_excluded()
        for a, b in itertools.combinations(names, 2):
            for va, vb in itertools.product(self.axes[a], self.axes[b]):
                pair = _pair({a: va, b: vb}, a, b)
                if pair not in excluded and _completes(self.axes, excluded, {a: va, b: vb}):
                    out.append(pair)
        return out

    def all_excluded(self) -> dict[Pair, str]:
        """The rule's exclusions and the global ones that name two of its declared values (but those it admits)."""
        out = dict(self.excluded)
        for pair, why in GLOBAL_EXCLUDED.items():
            (a, va), (b, vb) = sorted(pair)
            if va in self.axes.get(a, ()) and vb in self.axes.get(b, ()) and _pair({a: va, b: vb}, a, b) not in self.admitted:
                out.setdefault(_pair({a: va, b: vb}, a, b), why)
        return out

    def text(self) -> str:
        if not self.axes:
            return f"n/a ({self.na})"
        return " × ".join(f"{a}({', '.join(v)})" for a, v in self.axes.items()) + (
            f" [quick run: every value; every pair with -m {PAIRS_TIER}]" if self.quick else "")

    def values(self) -> list[Pair]:
        """Every value of every axis (as one-axis pairs) that some whole combination holds: what a ``quick: each``
        rule's quick run must cover."""
        excluded = self.all_excluded()
        return [((a, v),) for a, vs in self.axes.items() for v in vs if _completes(self.axes, excluded, {a: v})]


def _completes(axes: Mapping[str, tuple], excluded, partial: Mapping[str, str]) -> bool:
    """Whether ``partial`` extends to a value on every axis with no excluded pair (a depth-first search)."""
    def clash(combo):
        return any(_pair(combo, a, b) in excluded for a, b in itertools.combinations(combo, 2))

    if clash(partial):
        return False
    rest = [a for a in axes if a not in partial]
    if not rest:
        return True
    axis = rest[0]
    return any(_completes(axes, excluded, {**partial, axis: v}) for v in axes[axis])


def _pair(combo: Mapping[str, str], a: str, b: str) -> Pair:
    a, b = sorted((a, b))
    return ((a, combo[a]), (b, combo[b]))


def parse(rule_id: str, text: str) -> Declaration:
    """The text after ``Modes:`` (a final period dropped). ValueError naming the rule for an unknown axis
    without values, an unknown value of a known axis, a repeated axis, an exclusion naming an axis or value
    the declaration does not have, or an ``admit`` of a pair that is not globally excluded (or that the rule
    also excepts)."""
    text = text.strip().removesuffix(".").strip()
    if not text:
        raise ValueError(f"SPEC rule {rule_id}: empty 'Modes:' line; write the axes, or 'n/a (reason)'")
    if re.match(r"^n/?a\b", text, re.IGNORECASE):
        m = re.match(r"^n/?a\s*\((.+)\)$", text, re.IGNORECASE)
        if not m:
            raise ValueError(f"SPEC rule {rule_id}: 'Modes: n/a' needs a reason: 'Modes: n/a (why)'")
        return Declaration({}, {}, m.group(1).strip())
    head, *clauses = [part.strip() for part in _split_top(text, ";")]
    axes: dict[str, tuple[str, ...]] = {}
    for chunk in (c.strip() for c in head.split("×")):
        m = _AXIS.match(chunk)
        if not m:
            raise ValueError(f"SPEC rule {rule_id}: 'Modes:' axis {chunk!r} is not 'name' or 'name(v1, v2)'")
        name, listed = m.group(1), m.group(2)
        if name in axes:
            raise ValueError(f"SPEC rule {rule_id}: 'Modes:' axis {name!r} appears twice")
        if listed is None:
            if name not in AXES:
                raise ValueError(f"SPEC rule {rule_id}: axis {name!r} is not one of {sorted(AXES)}; "
                                 f"list its values: {name}(v1, v2)")
            axes[name] = AXES[name]
            continue
        values = tuple(v.strip() for v in listed.split(","))
        bad = [v for v in values if not _VALUE.match(v)]
        if bad or len(set(values)) != len(values) or not values:
            raise ValueError(f"SPEC rule {rule_id}: axis {name!r} lists bad or repeated values {list(values)}")
        if name in AXES:
            unknown = [v for v in values if v not in AXES[name]]
            if unknown:
                raise ValueError(f"SPEC rule {rule_id}: axis {name!r} has no value(s) {unknown}; "
                                 f"its values are {list(AXES[name])}")
        axes[name] = values
    excluded: dict[Pair, str] = {}
    admitted: dict[Pair, str] = {}
    quick = ""
    for clause in clauses:
        if clause.startswith("note:"):  # a reader's note (where a mode left out is judged instead)
            continue
        if clause.startswith("quick:"):
            quick = clause.removeprefix("quick:").strip()
            if quick != QUICK_EACH:
                raise ValueError(f"SPEC rule {rule_id}: 'Modes:' clause {clause!r}: the only quick split is "
                                 f"'quick: {QUICK_EACH}' (the quick run covers every value, -m {PAIRS_TIER} the pairs)")
            if len(axes) < 2:
                raise ValueError(f"SPEC rule {rule_id}: 'quick: {QUICK_EACH}' needs two axes or more (one axis: "
                                 "the quick run already covers every value)")
            continue
        m = _EXCEPT.match(clause)
        if not m:
            raise ValueError(f"SPEC rule {rule_id}: 'Modes:' clause {clause!r} is not "
                             "'except AXIS=VALUE with AXIS=VALUE (why)' or 'admit AXIS=VALUE with AXIS=VALUE (why)'")
        kind, a, va, b, vb, why = m.groups()
        for axis, value in ((a, va), (b, vb)):
            if axis not in axes or value not in axes[axis]:
                raise ValueError(f"SPEC rule {rule_id}: 'Modes:' exclusion names {axis}={value}, which the rule "
                                 f"does not declare ({', '.join(f'{k}{list(v)}' for k, v in axes.items())})")
        if a == b:
            raise ValueError(f"SPEC rule {rule_id}: 'Modes:' exclusion {clause!r} pairs an axis with itself")
        if not why:
            raise ValueError(f"SPEC rule {rule_id}: 'Modes:' exclusion {clause!r} gives no reason in parentheses")
        pair = _pair({a: va, b: vb}, a, b)
        if kind == "except":
            excluded[pair] = why.strip()
            continue
        if frozenset(pair) not in GLOBAL_EXCLUDED:
            raise ValueError(f"SPEC rule {rule_id}: 'Modes:' clause {clause!r} admits a pair no global exclusion "
                             "removes: nothing to admit")
        admitted[pair] = why.strip()
    both = sorted(set(excluded) & set(admitted))
    if both:
        raise ValueError(f"SPEC rule {rule_id}: 'Modes:' both excepts and admits {both}")
    return Declaration(axes, excluded, admitted=admitted, quick=quick)


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def declared_in(rule_id: str, body: str) -> Declaration | None:
    """The rule's declaration from its SPEC body; None when it has no ``Modes:`` line. Two lines are an error."""
    found = [MODES_LINE.match(line.strip()) for line in body.splitlines()]
    found = [m for m in found if m]
    if len(found) > 1:
        raise ValueError(f"SPEC rule {rule_id}: {len(found)} 'Modes:' lines; exactly one is allowed")
    return parse(rule_id, found[0].group(1)) if found else None


@functools.lru_cache(maxsize=None)
def declarations(path: str | None = None) -> dict[str, Declaration | None]:
    """rule id -> its Declaration (None without a ``Modes:`` line), for every rule of SPEC.md."""
    from . import spec

    bodies = spec.rule_bodies(path) if path else spec.rule_bodies()
    return {rule_id: declared_in(rule_id, body) for rule_id, body in bodies.items()}


def declaration(rule_id: str) -> Declaration:
    found = declarations().get(rule_id)
    if found is None:
        raise KeyError(f"SPEC rule {rule_id} has no 'Modes:' line")
    return found


# -- covering every pair ---------------------------------------------------------------------------------
def pairwise(axes: Mapping[str, Iterable[str]], excluded: Iterable[Pair] = (),
             valid: Callable[[Mapping[str, str]], bool] | None = None) -> list[dict[str, str]]:
    """A small list of combinations (axis -> value) that together cover every pair of values of every two
    axes, leaving out the ``excluded`` pairs and any combination ``valid`` refuses. Greedy and
    deterministic: each row starts from the first uncovered pair and takes, axis by axis, the value that
    covers the most pairs still uncovered (ties to the earlier value), backtracking where an exclusion or
    ``valid`` leaves it no way on. A pair no valid combination holds is an error naming it."""
    axes = {a: tuple(v) for a, v in axes.items()}
    names = list(axes)
    excluded = set(excluded)
    if len(names) == 0:
        return [{}]
    if len(names) == 1:
        combos = [{names[0]: v} for v in axes[names[0]]]
        return [c for c in combos if valid is None or valid(c)]
    todo = {_pair({a: va, b: vb}, a, b) for a, b in itertools.combinations(names, 2)
            for va, vb in itertools.product(axes[a], axes[b])
            if _completes(axes, excluded, {a: va, b: vb})} - excluded

    def ok(combo: Mapping[str, str]) -> bool:
        for a, b in itertools.combinations([n for n in names if n in combo], 2):
            if _pair(combo, a, b) in excluded:
                return False
        return valid is None or len(combo) < len(names) or valid(combo)

    order = {p: i for i, p in enumerate(sorted(todo, key=lambda p: [(names.index(a), axes[a].index(v)) for a, v in p]))}

    def complete(row: dict) -> dict | None:
        """The seed ``row`` completed axis by axis, each value the one covering the most pairs still to do (ties to
        the earlier value), backtracking when an exclusion or ``valid`` leaves a row no way on."""
        rest = [a for a in names if a not in row]
        if not rest:
            return row if ok(row) else None
        axis = rest[0]
        gains = []
        for value in axes[axis]:
            trial = {**row, axis: value}
            if ok(trial):
                gains.append((-sum(_pair(trial, axis, other) in todo for other in trial if other != axis),
                              axes[axis].index(value), value))
        for _, _, value in sorted(gains):
            done = complete({**row, axis: value})
            if done is not None:
                return done
        return None

    rows: list[dict[str, str]] = []
    while todo:
        seed = min(todo, key=order.__getitem__)
        row = complete(dict(seed))
        if row is None:  # the seed pair cannot be completed into a valid combination
            raise ValueError(f"no valid combination holds the pair {dict(seed)} (add an exclusion)")
        rows.append({a: row[a] for a in names})
        todo -= {_pair(row, a, b) for a, b in itertools.combinations(names, 2)}
    return rows


def params(rule_id: str, *, axes: Mapping[str, Iterable[str]] | None = None,
           requires: Callable[[Mapping[str, str]], Iterable[str]] | None = None,
           valid: Callable[[Mapping[str, str]], bool] | None = None, extra: Iterable = (),
           ids: Callable[[Mapping[str, str]], str] | None = None) -> list:
    """``pytest.param(combo, *extra)`` per combination of :func:`pairwise` over the rule's declared axes
    (or ``axes``, a sub-space of them), each marked ``modes(**combo)`` and ``requires(*requires(combo))``
    (default: the capability of its path, and ``staged`` for a staged one); ids ``value-value-...`` (or
    ``ids(combo)``)."""
    decl = declaration(rule_id)
    space = dict(axes) if axes is not None else decl.axes
    unknown = [a for a in space if a not in decl.axes]
    if unknown:
        raise ValueError(f"{rule_id}: axes {unknown} are not declared on its 'Modes:' line ({decl.text()})")
    combos = pairwise(space, decl.all_excluded(), valid)
    requires = requires or default_requires
    return quick_split(rule_id, [
        pytest.param(combo, *extra, marks=[pytest.mark.modes(**combo), pytest.mark.requires(*requires(combo))],
                     id=ids(combo) if ids else "-".join(combo.values()) or "one") for combo in combos])


def param_modes(param) -> dict[str, str]:
    """The modes of a ``pytest.param`` before collection, as :func:`item_modes` derives them from its marks: its
    ``modes`` marks (several values joined by ``|``), the path its ``requires`` name when they name exactly one path
    capability, and ``staged`` from the ``staged`` capability."""
    out: dict[str, str] = {}
    caps: set[str] = set()
    for mark in param.marks:
        if mark.name == "modes":
            for axis, value in mark.kwargs.items():
                out.setdefault(axis, "|".join(values_of(value)))
        elif mark.name == "requires":
            caps.update(mark.args)
    paths = {PATH_OF_CAPABILITY[c] for c in caps if c in PATH_OF_CAPABILITY}
    if "path" not in out and len(paths) == 1:
        out["path"] = paths.pop()
    out.setdefault("staged", "staged" if "staged" in caps else "plain")
    return out


def quick_split(rule_id: str, cases: list, modes_of: Callable[[object], Mapping[str, str]] = param_modes) -> list:
    """``cases`` (``pytest.param`` s of one rule) as they are, unless the rule declares ``quick: each``: then the
    fewest cases that hold every value of a declared axis that any of ``cases`` holds stay in the quick run (greedy:
    each the one holding the most values still uncovered; ties to the one that requires fewer capabilities, so that
    a loader claiming fewer still meets every value it can, then to the earlier), and every other case is marked
    with the tier :data:`PAIRS_TIER`. The suite's own tests check that a rule's quick-run cases, all lists
    together, hold every value of its declaration (tests/test_modes_coverage.py)."""
    decl = declaration(rule_id)
    if decl.quick != QUICK_EACH:
        return list(cases)
    declared = set(decl.values())
    held = [{((a, v),) for a in decl.axes for v in str(modes_of(c).get(a, "")).split("|")} & declared for c in cases]
    needs = [len({r for m in c.marks if m.name == "requires" for r in m.args}) for c in cases]
    todo = set().union(*held) if held else set()
    quick: set[int] = set()
    while todo:
        best = max(range(len(cases)), key=lambda i: (len(held[i] & todo), -needs[i], -i))
        quick.add(best)
        todo -= held[best]
    return [c if i in quick else pytest.param(*c.values, id=c.id, marks=[*c.marks, getattr(pytest.mark, PAIRS_TIER)])
            for i, c in enumerate(cases)]


def default_requires(combo: Mapping[str, str]) -> list[str]:
    caps = []
    if "path" in combo:
        caps.append(CAPABILITY_OF_PATH[combo["path"]])
    if combo.get("staged") == "staged":
        caps.append("staged")
    if combo.get("model") == "draft":
        caps.append("mtp")
    return caps


# -- what the collected cases cover ----------------------------------------------------------------------
def encode(combo: Mapping[str, str]) -> str:
    """``axis=value,...`` in axis order: a test report's ``modes`` property (a string, so that it travels on
    pytest-xdist reports and into ``--junitxml`` properties)."""
    return ",".join(f"{a}={combo[a]}" for a in sorted(combo))


def decode(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def values_of(value) -> tuple[str, ...]:
    """A mark's value for an axis: one value, or a tuple/list of the values one case exercises in turn (a case that
    judges the first, second and third update of its session: ``call=("first", "second", "third")``). A case with
    several values on two axes claims every pair of them (each model judged at each update): where its values go
    together (a first update into cleared weights, then a second in place), mark less, never more."""
    return tuple(str(v) for v in value) if isinstance(value, (tuple, list)) else (str(value),)


def item_modes(item) -> dict[str, str]:
    """The modes of one collected test: its ``modes`` marks (the closest mark wins an axis; several values of
    one axis, joined by ``|``, when the case judges each of them in turn), then a parameter named after an axis
    whose value is one of that axis's values, then the path its ``requires`` name when they name exactly one path
    capability, and ``staged``: staged when it requires ``staged``, else plain (a session is plain unless opened
    staged, which needs the capability)."""
    out: dict[str, str] = {}
    for mark in item.iter_markers("modes"):
        for axis, value in mark.kwargs.items():
            out.setdefault(axis, "|".join(values_of(value)))
    params = getattr(getattr(item, "callspec", None), "params", {}) or {}
    for axis, values in AXES.items():
        value = params.get(axis)
        if axis not in out and isinstance(value, str) and value in values:
            out[axis] = value
    caps = {c for m in item.iter_markers("requires") for c in m.args}
    paths = {PATH_OF_CAPABILITY[c] for c in caps if c in PATH_OF_CAPABILITY}
    if "path" not in out and len(paths) == 1:
        out["path"] = paths.pop()
    out.setdefault("staged", "staged" if "staged" in caps else "plain")
    return out


def covered(decl: Declaration, cases: Iterable[Mapping[str, str]]) -> set[Pair]:
    """The required pairs of ``decl`` that at least one case holds."""
    required = set(decl.required())
    names = list(decl.axes)
    got: set[Pair] = set()
    for case in cases:
        if len(names) == 1:
            got.update(((names[0], v),) for v in str(case.get(names[0])).split("|"))
            continue
        for a, b in itertools.combinations(names, 2):
            if a in case and b in case:
                for va, vb in itertools.product(str(case[a]).split("|"), str(case[b]).split("|")):
                    got.add(_pair({a: va, b: vb}, a, b))
    return got & required


class Coverage(NamedTuple):
    rule: str
    declared: str  # the declaration's text ("n/a (why)", "undeclared" without a Modes line)
    required: int
    covered: int
    uncovered: list[str]  # "a=v & b=w" per uncovered pair, in declaration order
    quick: str = ""  # "each": the quick run covers every value, the tier pairs the rest of the pairs

    def summary(self) -> str:
        if not self.required:
            return self.declared
        what = "values" if " × " not in self.declared else "pairs"
        return f"{self.covered}/{self.required} {what}" + (f"; uncovered: {', '.join(self.uncovered)}" if self.uncovered else "")

    def listing(self) -> str:
        """The declaration and what its cases cover, as ``--list-rules`` prints it."""
        if not self.required:
            return self.declared
        return f"{self.declared}: {self.summary()}"

    def as_json(self) -> dict:
        return {"declared": self.declared, "required": self.required, "covered": self.covered,
                "uncovered": list(self.uncovered), "quick": self.quick}


def coverage(rule_id: str, cases: Iterable[Mapping[str, str]], decl: Declaration | None | bool = False) -> Coverage:
    """What the cases of one rule cover of its declaration (``decl`` default: SPEC.md's)."""
    if decl is False:
        decl = declarations().get(rule_id)
    if decl is None:
        return Coverage(rule_id, "undeclared", 0, 0, [])
    if not decl.axes:
        return Coverage(rule_id, decl.text(), 0, 0, [])
    required = decl.required()
    got = covered(decl, cases)
    missing = [" & ".join(f"{a}={v}" for a, v in pair) for pair in required if pair not in got]
    return Coverage(rule_id, decl.text(), len(required), len(required) - len(missing), missing, decl.quick)
