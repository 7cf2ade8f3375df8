"""Memory moves under captured graphs: after an update every parameter keeps its storage (address and
strides), or the loader called the engine's recapture hook, naming it, after it moved and before NORMAL.
Spec: SPEC.md § MODEL (MODEL-STORAGE-KEPT).

The suite holds the layers it passed to ``open`` and reads each parameter's ``data_ptr()`` and ``strides``
from outside (reading, never acting for the implementation). A storage is *kept* when the address after the
update is the address before it. To make that verdict independent of the allocator's luck, the suite keeps
every storage it compares against alive (a strided view of it, ``paddle.as_strided``) until the verdict: while
the old memory is held, no new allocation can get its address, so an equal address is the same memory, also
after ``clear()`` (where a free allocator could otherwise hand the same block back). The hook's calls are
recorded the same way: at each call the storage of every parameter is held, and a moved parameter is covered
only by a call that names it and saw it in the memory it ends the update in (a call before the last move
covers nothing).

Two tests, on every path: updates in place (rsync and GDR, without a clear; a strided FP8-style layout, a 0-d
parameter, main + MTP where the loader has ``mtp``; again with a weight the model declares ``post_load``
transposed, where the loader has ``model.post_load``), where a loader without
``model.recapture`` must keep every storage; and updates after ``clear()`` (every path; rsync and GDR then
load as a bootstrap), where the storage necessarily moves and only the hook makes the graphs right
(``model.recapture``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from conformance import check
from conformance.paths import PATHS, cases, route  # noqa: F401 (the fixture)
from fixtures import models as M
from fixtures import streams as S
from fixtures import strided as ST

RECAPTURE = "model.recapture"
MAIN = (("a.scale", "float32", (4, 3)),  # column-major (strided), first by name
        ("b.weight", "bfloat16", (3, 5)),
        ("c.experts.scale", "float32", (2, 3, 4)),  # per expert, last two dimensions swapped (strided)
        ("d.scalar", "float32", ()),  # 0-d (a zero-element parameter holds no memory a graph could read, and
        # its round trip is APPLY-ROUNDTRIP-DTYPES's: kept out, so a loader failing it fails that rule, not this one)
        ("f.bias", "float16", (5,)),
        ("z.scale", "bfloat16", (5, 2)))  # column-major (strided), last by name
MTP = (("model.layers.2.eh_proj.weight", "float32", (4, 4)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))
MTP_LAYER = 2  # the MTP model serves layer 2 (GDR routes model.layers.2.* to it)
LAYOUTS = {"a.scale": (1, 0), "c.experts.scale": (0, 2, 1), "z.scale": (1, 0)}
IN_PLACE = [p for p in PATHS if PATHS[p].in_place]


def _spec(loader, strided: bool, transposed: bool = False):
    """Main (+ MTP where the loader has ``mtp``); strided layouts only in place: a strided target after a
    clear is APPLY-STRIDED-CLEARED's, judged on the device the loader serves on."""
    model = M.spec(*MAIN, *([TRANSPOSED] if transposed else []), mtp=[MTP] if "mtp" in loader.adapter.capabilities else [])
    spec = ST.StridedSpec(model, LAYOUTS if strided else {})
    return TransposingSpec(spec) if transposed else spec


TRANSPOSED = ("g.proj.weight", "float32", (4, 4))  # square: the source carries it in the served shape too


@dataclass(frozen=True)
class TransposingSpec:
    """The model plus a square weight the main model declares ``post_load`` transposed (FastDeploy's
    ``process_weight_transpose``, which swaps a new tensor in: MODEL, fd-spec §3.8)."""

    model: object

    def __getattr__(self, name):
        return getattr(self.model, name)

    def build_models(self):
        models = self.model.build_models()
        models[0].post_load = {"transpose": [TRANSPOSED[0]]}
        return models


def _served(state: dict) -> dict:
    """What the served model holds for a trainer's ``state``: the declared weight transposed."""
    return {n: (a.T.copy() if n == TRANSPOSED[0] else a) for n, a in state.items()}


def _params(models) -> dict:
    return {name: p for model in models for name, p in model.state_dict().items()}


@dataclass
class Held:
    """One parameter's storage as seen at a moment: address (None: holds no memory), strides, and a view
    that keeps the memory alive (so its address cannot be handed out again while the verdict needs it)."""

    address: int | None
    strides: list
    keep: object = None


def hold(models) -> dict[str, Held]:
    import paddle

    out = {}
    with paddle.no_grad():
        for name, p in _params(models).items():
            strides = list(p.strides)
            if math.prod(p.shape) == 0 or not p._is_initialized():
                out[name] = Held(None, strides)
            else:
                out[name] = Held(p.data_ptr(), strides, paddle.as_strided(p, list(p.shape), strides, p.offset))
    return out


@dataclass
class Call:
    names: object
    status: str | None
    held: dict


@dataclass
class Recorder:
    """The engine's recapture hook (``options["recapture"]``): records each call's names, the status and
    every parameter's storage at that moment."""

    models: list = field(default_factory=list)
    session: object = None
    status: bool = False
    calls: list = field(default_factory=list)

    def __call__(self, names):
        try:
            names = list(names)
        except TypeError:
            pass  # judged: not a list of names
        status = self.session.status() if self.status and self.session is not None else None
        self.calls.append(Call(names, status, hold(self.models)))


def _open(rt, loader, spec, options=None):
    caps = loader.adapter.capabilities
    rec = Recorder(status="status" in caps)
    extra = dict(options or {})
    if RECAPTURE in caps:
        extra["recapture"] = rec
    session = rt.open(spec, options=extra)
    rec.models, rec.session = session.models, session
    S.mark_mtp_layers(session.models, MTP_LAYER)
    return session, rec


def _judge(where: str, before: dict, models, rec: Recorder, built: dict, claims_recapture: bool) -> None:
    """Strides as built; every parameter in its memory of before, or covered by a recapture call (see module)."""
    after = hold(models)
    changed = {n: (built[n], after[n].strides) for n in built if after[n].strides != built[n]}
    check.that(not changed, f"{where}: strides changed (built -> now; a graph reads by them): "
               + ", ".join(f"{n}: {b} -> {a}" for n, (b, a) in changed.items()))
    moved = {n: (h.address, after[n].address) for n, h in before.items()
             if h.address is not None and after[n].address != h.address}
    shown = ", ".join(f"{n}: {hex(a)} -> {hex(b) if b is not None else None}" for n, (a, b) in sorted(moved.items()))
    calls = [(c.names, c.status) for c in rec.calls]
    if not claims_recapture:
        check.that(not moved, f"{where}: parameters moved to other memory ({shown}) and the loader offers no "
                   f"recapture hook ({RECAPTURE}): a captured graph reads freed memory")
        return
    known = set(after)
    for c in rec.calls:
        check.that(isinstance(c.names, list) and all(isinstance(n, str) and n in known for n in c.names),
                   f"{where}: recapture called with {c.names!r}: expected a list of parameter names")
        if c.status is not None:
            check.that(c.status != "NORMAL", f"{where}: recapture called while the status is NORMAL (names "
                       f"{c.names!r}): the update was served before its graphs were recaptured")
    uncovered = {}
    for n, (was, now) in sorted(moved.items()):
        named = [c for c in rec.calls if isinstance(c.names, list) and n in c.names]
        if not any(c.held[n].address == now for c in named):
            uncovered[n] = (was, now, len(named))
    check.that(not uncovered, f"{where}: parameters moved without a recapture call after the move naming them: "
               + ", ".join(f"{n} ({hex(a)} -> {hex(b) if b is not None else None}; named by {k} earlier call(s))"
                           for n, (a, b, k) in uncovered.items())
               + f"; recapture calls (names, status): {calls}")


@pytest.mark.rule("MODEL-STORAGE-KEPT")
@pytest.mark.parametrize("path, transposed", cases(False, paths=IN_PLACE)
                         + cases(True, paths=IN_PLACE, extra=("model.post_load",), id_suffix="-transposed"))
def test_update_in_place_keeps_storage_or_recaptures(route, loader, path, transposed):
    """Two updates without a clear after the first load: storage kept (or moved and recaptured); with a
    declared transpose, the post-load step too."""
    rt = route(path)
    spec = _spec(loader, strided=True, transposed=transposed)
    session, rec = _open(rt, loader, spec)
    claims = RECAPTURE in loader.adapter.capabilities
    built = {n: h.strides for n, h in hold(session.models).items()}  # as the suite built the layers
    rt.publish(0, M.state(spec, version=1), 1)
    rt.update(0)
    for version in (2, 3):
        where = f"{path}: in-place update {version} (no clear{', a declared transpose' if transposed else ''})"
        state = M.state(spec, version=version)
        rt.publish(0, state, version)
        before = hold(session.models)
        rec.calls.clear()
        rt.update(0)
        check.params_equal(session.observe(), _served(state), where)
        _judge(where, before, session.models, rec, built, claims)


ZERO = ("a.empty", "float32", (0, 3))  # zero-element, first of all: it holds no memory, the parameters after it do


def _with_zero_first(spec):
    return ST.StridedSpec(M.ModelSpec((M.ParamSpec(*ZERO), *spec.main), spec.mtp), {})


@pytest.mark.rule("MODEL-STORAGE-KEPT")
@pytest.mark.parametrize("path, zero_first", cases(False, extra=(RECAPTURE,))
                         + cases(True, paths=("single",), extra=(RECAPTURE,), id_suffix="-zero-element-first"))
def test_update_after_clear_recaptures_before_normal(route, loader, path, zero_first):
    """clear() then update, twice: every parameter's memory is new, so the hook must cover it before NORMAL.
    ``-zero-element-first``: the model's first parameter holds no memory (zero elements), which needs no
    recapture; every parameter after it still does (a loader that stops looking at it covers none)."""
    rt = route(path)
    spec = _spec(loader, strided=False)
    if zero_first:
        spec = _with_zero_first(spec)
    # the streamed paths load cleared parameters as a bootstrap: the version from version.yaml
    session, rec = _open(rt, loader, spec, {"version": None} if PATHS[path].in_place else None)
    built = {n: h.strides for n, h in hold(session.models).items()}  # as the suite built the layers
    rt.publish(0, M.state(spec, version=1), 1)
    rt.update(0)
    for version in (2, 3):
        where = f"{path}: update {version} after clear()"
        state = M.state(spec, version=version)
        rt.publish(0, state, version)
        before = hold(session.models)  # the storage the engine's graphs were captured on
        session.clear()
        rec.calls.clear()
        rt.update(0)
        check.params_equal(session.observe(), state, where)
        _judge(where, before, session.models, rec, built, True)
