"""Every problem of an input, not the first: APPLY-EVERY-PROBLEM. Spec: SPEC.md § APPLY.

An update whose tensors disagree with the model in two places is refused naming both: two dtype mismatches; a
dtype mismatch and a shape mismatch; one tensor wrong in both beside a shape mismatch; a missing parameter beside
the same tensor under a name no parameter takes (a renamed parameter, ``model.{name}``); two missing parameters.
The two tensors at fault are the first two, two in the middle (a good one between them) or the last two of the
main model's tensors, or of the draft (MTP) model's. The cases are the pairwise covering array of the rule's
declared modes (``conformance.modes``): every path that validates what it carries before it applies (the
snapshot levels, ipc metas, buckets, rsync's first load), plain and staged, main and draft, each position and
kind. Then the ipc meta file with several malformed metas, and one bucket manifest with several bad entries.
"""
import logging
import re

import numpy as np
import pytest

from conformance import check, modes
from conformance.paths import route  # noqa: F401 - a fixture
from weightsync.fixtures import buckets as B
from weightsync.fixtures import ipc as I
from weightsync.fixtures import models as M

RULE = "APPLY-EVERY-PROBLEM"
MAIN = (("embed.weight", "float32", (4, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 2)),
        ("layers.1.mlp.weight", "float16", (4,)), ("layers.2.attn.weight", "float32", (2, 3)),
        ("norm.bias", "float16", (4,)))
DRAFT = (("mtp.0.eh.weight", "float32", (4,)), ("mtp.0.norm.weight", "bfloat16", (2, 2)),
         ("mtp.0.proj.weight", "float16", (3,)), ("mtp.0.scale", "float32", (2,)))
SPEC_MAIN = M.spec(*MAIN)
SPEC_DRAFT = M.spec(*MAIN, mtp=[DRAFT])
# position -> the indices of the two tensors at fault, in name order, among the model's (main: 5, draft: 4)
PAIRS = {"main": {"first": (0, 1), "middle": (1, 3), "last": (3, 4)},
         "draft": {"first": (0, 1), "middle": (1, 3), "last": (2, 3)}}
OTHER_DTYPE = {"float32": "int32", "bfloat16": "float16", "float16": "bfloat16"}


def _named(name: str, text: str) -> bool:
    """``name`` as a whole name in ``text`` (``norm.bias`` inside ``model.norm.bias`` does not count)."""
    return re.search(r"(?<![\w.])" + re.escape(name) + r"(?![\w.])", text) is not None


def _tensor(spec, name, dtype=None, shape=None):
    p = spec.param(name)
    return M.weights(M.ParamSpec(name, dtype or p.dtype, tuple(p.shape if shape is None else shape)), version=1)


def _published(spec, combo):
    """(the state to publish, the two names at fault, the unknown name or None) for ``combo``."""
    names = sorted(p.name for p in (spec.main if combo["model"] == "main" else spec.mtp[0]))
    x, y = (names[i] for i in PAIRS[combo["model"]][combo["position"]])
    st = dict(M.state(spec, version=1))
    dtype = lambda n: OTHER_DTYPE[spec.param(n).dtype]  # noqa: E731
    shape = lambda n: (*spec.param(n).shape, 1)  # noqa: E731 - one trailing 1 more: always another shape
    unknown = None
    problem = combo["problem"]
    if problem == "dtypes":
        st[x], st[y] = _tensor(spec, x, dtype(x)), _tensor(spec, y, dtype(y))
    elif problem == "dtype-and-shape":
        st[x], st[y] = _tensor(spec, x, dtype(x)), _tensor(spec, y, shape=shape(y))
    elif problem == "both-and-shape":
        st[x], st[y] = _tensor(spec, x, dtype(x), shape(x)), _tensor(spec, y, shape=shape(y))
    elif problem == "missing-and-unknown":
        unknown = f"model.{x}"
        st[unknown] = st.pop(x)
    else:
        del st[x], st[y]
    return dict(sorted(st.items())), (x, y), unknown


def _expected(path: str, problem: str, x: str, y: str):
    """(exception type, the phrases the message must hold) for a refusal of ``problem`` on ``path``."""
    if problem.startswith("missing"):  # APPLY-MISSING-FAILS' RuntimeError; rsync's first load: either (RSYNC-SUBSET)
        return ((ValueError, RuntimeError) if path == "rsync" else RuntimeError), [x] + ([y] if problem == "missing" else [])
    if path == "rsync":  # RSYNC-VALIDATE-ALL: one ValueError listing every key at fault
        return ValueError, [x, y]
    first = {"dtypes": "Type", "dtype-and-shape": "Type", "both-and-shape": "Type"}[problem]
    second = "Type" if problem == "dtypes" else "Shape"
    return TypeError, [f"{first} mismatch for {x}", f"{second} mismatch for {y}"]


CASES = modes.params(RULE)


@pytest.mark.rule("APPLY-EVERY-PROBLEM")
@pytest.mark.parametrize("combo", CASES)
def test_every_problem_is_named(route, caplog, combo):
    path, problem = combo["path"], combo["problem"]
    spec = SPEC_MAIN if combo["model"] == "main" else SPEC_DRAFT
    rt = route(path)
    if path == "bucket":  # one manifest carries the update: the bucket path names every problem of a manifest
        rt.feed.BUCKET_BYTES = 4096
    session = rt.open(spec, options={"staged": True} if combo["staged"] == "staged" else None)
    st, (x, y), unknown = _published(spec, combo)
    where = rt.publish(0, st, 1) + f": {problem} at {x} and {y} ({combo['position']} of the {combo['model']} model" \
        f"{', staged' if combo['staged'] == 'staged' else ''})"
    exc, phrases = _expected(path, problem, x, y)
    caplog.set_level(logging.WARNING)  # root logger: whatever logger the implementation uses
    with check.raises(exc, match=re.escape(phrases[0]), names=phrases, where=where) as info:
        rt.update(0)
    message = str(info.value)
    check.that(_named(x, message) and (problem == "missing-and-unknown" or _named(y, message)),
               f"{where}: the error {message!r} does not name {x} and {y} as whole names")
    if problem == "missing":
        n = len(spec.all_params)
        check.that(f"{n - 2} of {n}" in message or f"{n - 2}/{n}" in message,
                   f"{where}: the error {message!r} does not carry both counts ({n - 2} of {n} landed)")
    if unknown is not None:
        records = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        check.that(_named(unknown, message) or any(_named(unknown, m) for m in records),
                   f"{where}: the ignored tensor {unknown} is named neither in the error {message!r} nor in a "
                   f"WARNING record of the update ({records[:3]})")
    if not problem.startswith("missing"):  # refused before anything is applied (APPLY-VALIDATE-FIRST, ...)
        check.not_loaded(session.observe(), [p.name for p in spec.all_params], where)
    if "status" in rt.loader.adapter.capabilities:
        check.status_not(session, "NORMAL", where)


# -- several malformed metas in one file -----------------------------------------------------------------------
META_SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)),
                   ("norm.bias", "float16", (4,)), ("norm.weight", "float32", (4,)))
META_NAMES = sorted(p.name for p in META_SPEC.all_params)
META_SPOILS = {  # field -> (its index in the meta, a bad value given the meta)
    "size": (2, lambda meta: meta[2] + 2),
    "dims": (4, lambda meta: [-d for d in meta[4]] if len(meta[4]) == 2 else [-1, *meta[4]]),
    "type_idx": (3, lambda meta: 99),
}
META_CASES = {  # case -> the (position, field) of each bad meta
    "first-size-middle-dims": ((0, "size"), (1, "dims")),
    "middle-type_idx-last-size": ((2, "type_idx"), (3, "size")),
    "first-dims-last-type_idx": ((0, "dims"), (3, "type_idx")),
    "three-sizes": ((0, "size"), (2, "size"), (3, "size")),
}


@pytest.mark.rule("APPLY-EVERY-PROBLEM")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", list(META_CASES))
def test_every_bad_meta_is_named(loader, case):
    """A meta file with two or three malformed metas: one ValueError names each tensor (and the file); nothing loads."""
    export = I.Export(M.state(META_SPEC), per_segment=1)
    try:
        metas = {n: list(export.metas[n]) for n in META_NAMES}
        bad = []
        for position, field in META_CASES[case]:
            name = META_NAMES[position]
            index, value = META_SPOILS[field]
            metas[name][index] = value(metas[name])
            bad.append(name)
        path = I.write_metas_pickle(I.meta_path(loader.shared_dir, 0), metas)
        session = loader.open(META_SPEC, strategy="ipc")
        where = f"{path}: malformed metas {dict(zip(bad, (f for _, f in META_CASES[case])))}"
        with check.raises(ValueError, match=re.escape(bad[0]), names=[path, *bad], where=where):
            session.update()
        check.not_loaded(session.observe(), META_NAMES, where)
    finally:
        export.close()


# -- several bad entries in one bucket manifest ----------------------------------------------------------------
BKT_SPEC = M.spec(*((f"p.{i}", "float32", (32,)) for i in range(4)))  # 128 bytes each, 256 apart: one bucket
BKT_CASES = {  # case -> [(index of the entry, what is wrong with it)], exception
    "unknown-dtype-and-nbytes": ([(0, "dtype-unknown"), (3, "nbytes")], ValueError),
    "two-misaligned": ([(1, "misaligned"), (2, "misaligned")], ValueError),
    "dtype-and-shape-mismatch": ([(0, "dtype"), (2, "shape")], TypeError),
    "three-shapes": ([(1, "shape"), (2, "shape"), (3, "shape")], ValueError),
}


def _spoil_entry(e: dict, what: str) -> None:
    if what == "dtype-unknown":
        e["dtype"] = "complex64"
    elif what == "nbytes":
        e["nbytes"] -= 4
    elif what == "misaligned":
        e["offset"] += 4
    elif what == "dtype":
        e["dtype"] = "int32"  # 4 bytes as float32: the sizes still agree
    else:
        e["shape"] = [2, 16]  # 32 items as [32]: the sizes still agree


@pytest.mark.rule("APPLY-EVERY-PROBLEM")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", list(BKT_CASES))
def test_every_bad_entry_of_a_manifest_is_named(loader, case):
    """One manifest (bucket 0 of 1024 bytes, four entries) with two or three bad entries: the error names each tensor,
    the bucket and the version; nothing loads."""
    spoils, exc = BKT_CASES[case]
    state = M.state(BKT_SPEC, version=3)
    update = B.pack(state, 3, 1024)
    check.equal(len(update.buckets), 1, "fixture precondition: one bucket")
    names = []
    for index, what in spoils:
        e = update.buckets[0]["entries"][index]
        _spoil_entry(e, what)
        names.append(e["name"])
    with B.Publisher(1024, wait_s=10.0) as pub:
        pub.serve(update)
        session = loader.open(BKT_SPEC, strategy="ipc_bucket", options=pub.options(3, 2.0))
        where = f"{pub.endpoint}: bucket 0 with bad entries {spoils}"
        with check.raises(exc, match=re.escape(names[0]), names=[*names, "bucket 0"], where=where) as info:
            session.update()
        message = str(info.value)
        check.that(all(_named(n, message) for n in names), f"{where}: the error {message!r} does not name each of {names}")
        check.not_loaded(session.observe(), list(state), where)
