"""conformance/modes.py: the ``Modes:`` grammar, the pairwise covering generator, what a collected case's modes
are, and the coverage a rule's cases give (a project test; the plugin's use of it is in test_plugin_gate.py).

The generator is checked against an oracle that enumerates every pair itself, on many random spaces
(hypothesis), with and without exclusions; a generator that drops a pair, emits an excluded pair or a
combination ``valid`` refuses fails here.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import modes as M
from conformance.spec import rule_bodies


def _pairs_of(rows, axes):
    got = set()
    for row in rows:
        for a, b in itertools.combinations(axes, 2):
            got.add(tuple(sorted(((a, row[a]), (b, row[b])))))
    return got


def _every_pair(axes, excluded=()):
    """Every pair of values of two axes that some whole combination free of ``excluded`` pairs holds (by brute
    force over the product, apart from the generator's own search)."""
    excluded, names, want = set(excluded), list(axes), set()
    for values in itertools.product(*(axes[a] for a in names)):
        pairs = {tuple(sorted(((a, va), (b, vb)))) for (a, va), (b, vb) in itertools.combinations(zip(names, values), 2)}
        if not pairs & excluded:
            want |= pairs
    return want


space = st.dictionaries(st.sampled_from("abcdef"), st.lists(st.sampled_from("uvwxyz"), min_size=1, max_size=4, unique=True),
                        min_size=2, max_size=5)


@settings(max_examples=60, deadline=None)
@given(space)
def test_pairwise_covers_every_pair_of_any_space(axes):
    rows = M.pairwise(axes)
    assert _every_pair(axes) <= _pairs_of(rows, axes), axes
    assert all(set(r) == set(axes) and all(r[a] in axes[a] for a in axes) for r in rows)
    biggest = sorted((len(v) for v in axes.values()), reverse=True)
    assert len(rows) >= biggest[0] * biggest[1]
    assert len(rows) <= len(_every_pair(axes)), "no more rows than pairs"


@settings(max_examples=60, deadline=None)
@given(space, st.data())
def test_pairwise_leaves_out_excluded_pairs_and_covers_the_rest(axes, data):
    every = sorted(_every_pair(axes))
    excluded = set(data.draw(st.lists(st.sampled_from(every), max_size=3, unique=True)))
    try:
        rows = M.pairwise(axes, excluded)
    except ValueError as e:  # only when some pair cannot be completed without an excluded one
        assert "no valid combination" in str(e)
        return
    assert not (_pairs_of(rows, axes) & excluded), "an excluded pair was generated"
    assert _every_pair(axes, excluded) <= _pairs_of(rows, axes)


def test_pairwise_honours_valid_and_names_a_pair_it_cannot_place():
    axes = {"path": ("parts", "rsync"), "start": ("cleared", "loaded"), "call": ("first", "second")}
    excluded = {(("path", "parts"), ("start", "loaded"))}
    refused = {"path": "rsync", "start": "cleared", "call": "second"}  # a triple whose pairs other rows hold
    rows = M.pairwise(axes, excluded, valid=lambda c: c != refused)
    assert refused not in rows and all(not (r["path"] == "parts" and r["start"] == "loaded") for r in rows)
    assert _every_pair(axes, excluded) <= _pairs_of(rows, axes)
    with pytest.raises(ValueError, match=r"path.*parts.*start.*loaded|start.*loaded.*path.*parts"):
        M.pairwise({"path": ("parts",), "start": ("loaded",), "call": ("first",)},
                   valid=lambda c: not (c["path"] == "parts" and c["start"] == "loaded"))


def test_pairwise_of_one_axis_lists_its_values():
    assert M.pairwise({"path": ("parts", "ipc")}) == [{"path": "parts"}, {"path": "ipc"}]


@pytest.mark.parametrize("text, axes, excluded", [
    ("path(parts, ipc) × staged.", {"path": ("parts", "ipc"), "staged": ("plain", "staged")}, {}),
    ("call(first, second) × phase(before-first, mid)", {"call": ("first", "second"), "phase": ("before-first", "mid")}, {}),
    ("path(parts, rsync) × op; except path=parts with op=clear (no clear on parts here).",
     {"path": ("parts", "rsync"), "op": ("clear", "update")}, {(("op", "clear"), ("path", "parts")): "no clear on parts here"}),
])
def test_a_declaration_parses(text, axes, excluded):
    decl = M.parse("R-X", text)
    assert decl.axes == axes and decl.excluded == excluded


@pytest.mark.parametrize("text, says", [
    ("", "empty"), ("n/a", "needs a reason"), ("phase", "list its values"), ("path(parts, nowhere)", "no value"),
    ("staged × staged", "twice"), ("path(parts, parts)", "repeated"), ("path × op; except path=parts with op=clear", "no reason"),
    ("path × op; except path=ipc with call=first (x)", "does not declare"), ("path × op; unless x", "except"),
    ("path × op; note x", "except"),
    ("path × op; except path=parts with path=ipc (x)", "does not declare|itself"), ("Path", "not 'name'"),
    ("path × start; admit path=rsync with start=loaded (x)", "nothing to admit"),
    ("path × start; admit path=parts with start=loaded", "no reason"),
    ("path × start; admit path=parts with start=loaded (x); except path=parts with start=loaded (y)", "both"),
    ("path × staged; quick: all", "quick: each"), ("path × staged; quick:", "quick: each"),
    ("path(parts, ipc); quick: each", "two axes"),
])
def test_a_bad_declaration_names_the_rule_and_the_fault(text, says):
    with pytest.raises(ValueError, match=r"R-X") as info:
        M.parse("R-X", text)
    assert any(s in str(info.value) for s in says.split("|")), str(info.value)


def test_global_exclusions_apply_only_to_values_a_rule_declares():
    both = M.parse("R-X", "path(parts, rsync) × start")
    assert (("path", "parts"), ("start", "loaded")) not in both.required()
    assert (("path", "rsync"), ("start", "loaded")) in both.required()
    assert M.parse("R-X", "path(rsync, gdr) × staged").required().count((("path", "gdr"), ("staged", "staged"))) == 0
    assert len(M.parse("R-X", "path(parts) × staged").required()) == 2


def test_an_admitted_pair_is_required_again_for_that_rule_only():
    """``admit`` keeps a globally excluded pair for the rule that says so (with its reason); every other pair the
    global exclusions remove stays removed, for it and for a rule that does not admit."""
    admits = M.parse("R-X", "path(parts, single, rsync) × start; admit path=parts with start=loaded (placeholders)")
    assert admits.admitted == {(("path", "parts"), ("start", "loaded")): "placeholders"}
    assert (("path", "parts"), ("start", "loaded")) in admits.required()
    assert (("path", "single"), ("start", "loaded")) not in admits.required()
    assert (("path", "parts"), ("start", "loaded")) not in M.parse("R-X", "path(parts, single, rsync) × start").required()


def _item(marks=(), params=None, requires=()):
    class Item:
        callspec = SimpleNamespace(params=params or {})

        def iter_markers(self, name):
            found = [m for m in marks if m.name == name]
            if name == "requires" and requires:
                found.append(pytest.mark.requires(*requires).mark)
            return iter(found)
    return Item()


def test_item_modes_from_marks_parameters_and_capabilities():
    item = _item([pytest.mark.modes(call="second").mark, pytest.mark.modes(call="first", model="draft").mark],
                 {"path": "ipc", "fault": "mid"}, requires=("ipc.meta", "staged"))
    assert M.item_modes(item) == {"call": "second", "model": "draft", "path": "ipc", "staged": "staged"}
    assert M.item_modes(_item(requires=("snapshot.parts",))) == {"path": "parts", "staged": "plain"}
    assert M.item_modes(_item(requires=("snapshot.parts", "ipc.meta"))) == {"staged": "plain"}, "two paths: none derived"
    assert M.item_modes(_item(params={"path": "nowhere"})) == {"staged": "plain"}, "a value outside the axis is not a mode"


def test_a_case_that_judges_several_values_covers_each():
    item = _item([pytest.mark.modes(call=("first", "second", "third"), start="loaded").mark])
    modes = M.item_modes(item)
    assert modes["call"] == "first|second|third"
    decl = M.parse("R-X", "call × start")
    assert M.coverage("R-X", [modes], decl).uncovered == ["call=first & start=cleared", "call=second & start=cleared",
                                                          "call=third & start=cleared"]
    assert M.coverage("R-X", [M.decode(M.encode(modes))], decl).covered == 3, "the | form survives the report"


def test_coverage_names_what_is_left_uncovered():
    decl = M.parse("R-X", "path(parts, ipc) × staged × call(first, second)")
    rows = M.pairwise(decl.axes)
    assert M.coverage("R-X", rows, decl).uncovered == [] and M.coverage("R-X", rows, decl).covered == 12
    partial = M.coverage("R-X", rows[:-1], decl)
    assert partial.covered < 12 and len(partial.uncovered) == 12 - partial.covered
    assert all(" & " in u for u in partial.uncovered) and "uncovered: " in partial.summary()
    assert M.coverage("R-X", [{"path": "parts"}], decl).covered == 0, "a case without the other axis covers no pair"
    assert M.coverage("R-X", [], None).declared == "undeclared"
    na = M.parse("R-X", "n/a (one behaviour)")
    assert M.coverage("R-X", [], na).summary() == "n/a (one behaviour)"


def test_params_carry_modes_and_requires_and_cover_the_declaration(monkeypatch):
    decl = M.parse("R-X", "path(parts, gdr) × staged × model")
    monkeypatch.setattr(M, "declarations", lambda path=None: {"R-X": decl})
    params = M.params("R-X")
    combos = [p.values[0] for p in params]
    assert not any(c["path"] == "gdr" and c["staged"] == "staged" for c in combos), "a global exclusion was generated"
    assert M.coverage("R-X", combos, decl).uncovered == []
    for p in params:
        (modes,) = [m for m in p.marks if m.name == "modes"]
        (requires,) = [m for m in p.marks if m.name == "requires"]
        assert modes.kwargs == p.values[0]
        assert M.CAPABILITY_OF_PATH[p.values[0]["path"]] in requires.args
        assert ("staged" in requires.args) == (p.values[0]["staged"] == "staged")
        assert ("mtp" in requires.args) == (p.values[0]["model"] == "draft")
    with pytest.raises(ValueError, match="not declared"):
        M.params("R-X", axes={"call": ("first",)})


def test_quick_each_parses_and_shows_in_the_text():
    decl = M.parse("R-X", "path(parts, ipc) × staged; except path=ipc with staged=staged (x); quick: each.")
    assert decl.quick == "each" and decl.excluded == {(("path", "ipc"), ("staged", "staged")): "x"}
    assert "every pair with -m pairs" in decl.text()
    assert M.parse("R-X", "path(parts, ipc) × staged").quick == "" and "-m pairs" not in M.parse("R-X", "path × staged").text()
    assert decl.values() == [(("path", "parts"),), (("path", "ipc"),), (("staged", "plain"),), (("staged", "staged"),)]
    assert M.parse("R-X", "path(parts, rsync) × start").values().count((("start", "loaded"),)) == 1, \
        "a value a whole combination holds (rsync in place) is a value to meet"


def _split(monkeypatch, text, **kw):
    decl = M.parse("R-X", text)
    monkeypatch.setattr(M, "declarations", lambda path=None: {"R-X": decl})
    return decl, M.params("R-X", **kw)


def _quick(params):
    return [p for p in params if not any(m.name == M.PAIRS_TIER for m in p.marks)]


@pytest.mark.parametrize("text", [
    "path(parts, ipc, bucket) × rank(rank0, follower) × staged",
    "path(parts, ipc, bucket) × fault(partial, bad-dtype, runner) × failing(one, several) × rank(rank0, follower) × call(first, second)",
    "path(parts, single, rsync, gdr) × staged × model; except path=rsync with model=draft (x)",
])
def test_quick_each_keeps_every_value_in_the_quick_run_and_every_pair_with_the_tier(monkeypatch, text):
    """The quick run's cases (no ``pairs`` mark) meet every value of every axis and are fewer than all; every case
    is kept, the others marked ``pairs``, so the two together cover every pair; a case is never marked twice."""
    decl, params = _split(monkeypatch, text + "; quick: each")
    quick = _quick(params)
    held = {((a, v),) for p in quick for a, v in p.values[0].items()}
    assert held >= set(decl.values()), f"values the quick run misses: {set(decl.values()) - held}"
    assert len(quick) < len(params)
    assert M.coverage("R-X", [p.values[0] for p in params], decl).uncovered == []
    assert all(sum(m.name == M.PAIRS_TIER for m in p.marks) <= 1 for p in params)
    _, plain = _split(monkeypatch, text)
    assert [p.values for p in plain] == [p.values for p in params] and _quick(plain) == plain, \
        "without 'quick: each' every case stays in the quick run"


def test_quick_split_meets_the_values_of_each_list_and_prefers_fewer_capabilities(monkeypatch):
    """A list holding some values only (one test's cases of a rule) keeps what meets those; between cases that
    meet as many values still to meet, the one needing fewer capabilities stays (a loader claiming less still
    meets every value it can); modes come from marks, requires and ``staged``."""
    decl = M.parse("R-X", "path(parts, ipc) × staged × call(first, second); quick: each")
    monkeypatch.setattr(M, "declarations", lambda path=None: {"R-X": decl})
    cases = [pytest.param(1, marks=[pytest.mark.requires("snapshot.parts", "staged"), pytest.mark.modes(call="first")]),
             pytest.param(2, marks=[pytest.mark.requires("snapshot.parts"), pytest.mark.modes(call="first")]),
             pytest.param(3, marks=[pytest.mark.requires("snapshot.parts"), pytest.mark.modes(call=("first", "second"))])]
    out = M.quick_split("R-X", cases)
    assert [p.values[0] for p in _quick(out)] == [1, 3], "3 meets three values, then staged, which only 1 holds; not 2"
    assert [p.values[0] for p in out] == [1, 2, 3]
    same = [pytest.param(1, marks=[pytest.mark.requires("snapshot.parts", "mtp"), pytest.mark.modes(call="first")]),
            pytest.param(2, marks=[pytest.mark.requires("snapshot.parts"), pytest.mark.modes(call="first")])]
    assert [p.values[0] for p in _quick(M.quick_split("R-X", same))] == [2], "the one needing fewer capabilities"
    assert M.param_modes(cases[2]) == {"call": "first|second", "path": "parts", "staged": "plain"}


def test_encode_and_decode_are_inverse():
    combo = {"path": "parts", "staged": "plain", "phase": "before-first"}
    assert M.decode(M.encode(combo)) == combo and M.decode("") == {}


def test_every_declaration_in_spec_parses():
    for rule_id, body in rule_bodies().items():
        M.declared_in(rule_id, body)  # raises naming the rule
