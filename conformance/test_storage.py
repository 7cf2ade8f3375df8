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

One test, its cases generated over the rule's declared modes (SPEC.md: path x start x model x layout x hook x
swap x call, every pair; ``conformance.modes``): updates into parameters built without memory and after ``clear()``
(every path; rsync and GDR then load as a bootstrap), where the storage necessarily moves and only the hook
makes the graphs right (``model.recapture``); and into loaded weights: the engine's allocated placeholders at a
first update (on every path: the rule admits the pair path x start=loaded that the clear-first paths otherwise
leave out), in place (rsync and GDR, without a clear) at later ones. ``hook=offered``: the engine hands the
loader its recapture hook (``options["recapture"]``, a loader with ``model.recapture``), and a moved storage is
covered by a call naming it; ``hook=none``: the engine offers none (whatever the loader claims), and every
parameter that held memory must keep it, so those cases run only where no storage necessarily moves (no update
after a clear, no engine swap). The case's model may carry strided layouts (an FP8 scale column-major, a per-expert
one), a draft (MTP) model holding what the case is about, a weight it declares ``post_load`` transposed (where
the loader has ``model.post_load``), or, on GDR, models whose own loaders (the suite's, as an engine's) swap
each buffer under the same parameter object: moved is judged by address, never by object.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from conformance import check, modes
from conformance.paths import PATHS, route  # noqa: F401 (the fixture)
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S
from weightsync.fixtures import strided as ST

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


TRANSPOSED = ("g.proj.weight", "float32", (4, 6))  # served shape; the trainer sends it (6, 4), its loaded layout


def _params(models) -> dict:
    return {name: p for model in models for name, p in model.state_dict().items()}


@dataclass
class Held:
    """One parameter's storage as seen at a moment: address (None: holds no memory), strides, shape, and a view
    that keeps the memory alive (so its address cannot be handed out again while the verdict needs it)."""

    address: int | None
    strides: list
    shape: list
    keep: object = None


def hold(models) -> dict[str, Held]:
    import paddle

    out = {}
    with paddle.no_grad():
        for name, p in _params(models).items():
            strides, shape = list(p.strides), list(p.shape)
            if math.prod(shape) == 0 or not p._is_initialized():
                out[name] = Held(None, strides, shape)
            else:
                out[name] = Held(p.data_ptr(), strides, shape, paddle.as_strided(p, shape, strides, p.offset))
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


def _open(rt, loader, spec, options=None, hook=True):
    """Open ``spec``, handing the loader the engine's recapture hook (a :class:`Recorder`) when ``hook`` and the
    loader claims ``model.recapture``."""
    caps = loader.adapter.capabilities
    rec = Recorder(status="status" in caps)
    extra = dict(options or {})
    if hook and RECAPTURE in caps:
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
        final = (now, after[n].shape, after[n].strides)  # what a graph captured then bakes in
        if not any((c.held[n].address, c.held[n].shape, c.held[n].strides) == final for c in named):
            uncovered[n] = (was, now, [(c.held[n].shape, c.held[n].strides) for c in named])
    check.that(not uncovered, f"{where}: parameters moved without a recapture call naming them made once they were in "
               f"their final memory, shape and strides: "
               + ", ".join(f"{n} ({hex(a)} -> {hex(b) if b is not None else None}, ending {after[n].shape} strides "
                           f"{after[n].strides}; (shape, strides) at the calls naming it: {seen})"
                           for n, (a, b, seen) in uncovered.items())
               + f"; recapture calls (names, status): {calls}")


# -- the mode space: path x start x model x layout x hook x swap x call, every pair (SPEC.md's Modes line) -----------------
#: what may move a parameter's storage besides the path: ``none``; ``transform``: the model declares a weight
#: ``post_load`` transposed (the loader's own step: FastDeploy's swaps a new tensor in); ``engine``: GDR hands the
#: items to the models' own loaders, which the suite provides and which here give each parameter new memory under
#: the same parameter object (``_share_buffer_to``, then ``param.data = ...``, by turns), as engines' loaders do
ENGINE_SWAPS = ("share", "data", "share")
DRAFT_PROJ = ("mtp_block.0.proj.weight", "float32", (4, 6))  # the draft's weight a transform may transpose
DRAFT_SCALE = ("mtp_block.0.scale", "bfloat16", (3, 4))  # the draft's parameter a strided layout applies to


def _modal_spec(combo, transposed_name=None):
    """The case's model: the main one (``model=main``) or the main one and a draft (``draft``), the strided layouts
    and the declared transpose (``transform``) in the model the case names; engine placeholders for
    ``start=loaded``."""
    draft = combo["model"] == "draft"
    main = list(MAIN) + ([TRANSPOSED] if combo["swap"] == "transform" and not draft else [])
    mtp = [[*MTP, DRAFT_SCALE, DRAFT_PROJ]] if draft else []
    layouts = ({} if combo["layout"] == "contiguous" else {DRAFT_SCALE[0]: (1, 0)} if draft else LAYOUTS)
    spec = ST.StridedSpec(M.spec(*main, mtp=mtp), layouts, placeholders=combo["start"] == "loaded")
    if combo["swap"] != "transform":
        return spec
    return DeclaringSpec(spec, 1 if draft else 0, DRAFT_PROJ[0] if draft else TRANSPOSED[0])


@dataclass(frozen=True)
class DeclaringSpec:
    """A spec whose model ``index`` declares ``name`` ``post_load`` transposed: built in its served shape (4, 6),
    sent by the trainer in its loaded layout (6, 4) (:func:`_sent`)."""

    model: object
    index: int
    name: str

    def __getattr__(self, attr):
        return getattr(self.model, attr)

    def build_models(self):
        models = self.model.build_models()
        models[self.index].post_load = {"transpose": [self.name]}
        return models


def _sent(spec, served: dict) -> dict:
    """What the trainer sends for the values ``served``: the transposed weight in its loaded layout."""
    name = getattr(spec, "name", None)
    return {n: (a.T.copy() if n == name else a) for n, a in served.items()}


def _storage_valid(combo) -> bool:
    """A clear-first path updates loaded weights only at its first update (into the engine's placeholders); an
    engine offering no hook (``hook=none``) exists only where no storage necessarily moves: not after a clear
    (``start=cleared`` past the first update; an engine's swap is excepted on the Modes line)."""
    if combo["start"] == "loaded" and not PATHS[combo["path"]].in_place and combo["call"] != "first":
        return False
    return not (combo["hook"] == "none" and combo["start"] == "cleared" and combo["call"] != "first")


def _storage_requires(combo) -> list[str]:
    """The path's capabilities, ``model.post_load`` for a declared transform, and ``model.recapture`` where the
    engine offers its hook (it hands it only to a loader that takes it); ``hook=none`` runs on every loader."""
    caps = [*modes.default_requires(combo)]
    if combo["swap"] == "transform":
        caps.append("model.post_load")
    if combo["hook"] == "offered":
        caps.append(RECAPTURE)
    return caps


def _storage_id(combo) -> str:
    """``path-start-model-layout-swap-call``, then ``-nohook`` where the engine offers no hook."""
    return "-".join(combo[a] for a in ("path", "start", "model", "layout", "swap", "call")) + (
        "-nohook" if combo["hook"] == "none" else "")


CALLS = {"first": 1, "second": 2, "third": 3}
ZERO_FIRST = pytest.param({"path": "single", "start": "cleared", "model": "main", "layout": "contiguous",
                           "call": "third", "swap": "none", "hook": "offered"}, True,
                          marks=[pytest.mark.requires("snapshot.single", RECAPTURE),
                                 pytest.mark.modes(path="single", start="cleared", model="main", layout="contiguous",
                                                   call="third", swap="none", hook="offered")],
                          id="single-zero-element-first")


@pytest.mark.rule("MODEL-STORAGE-KEPT")
@pytest.mark.parametrize("combo, zero_first", modes.params("MODEL-STORAGE-KEPT", requires=_storage_requires,
                                                           valid=_storage_valid, extra=(False,), ids=_storage_id)
                         + [ZERO_FIRST])
def test_storage_kept_or_recaptured_in_every_mode(route, loader, combo, zero_first):
    """``call`` consecutive updates, each judged: ``start=cleared``, the first into parameters built without memory
    and each later one after clear() (the streamed paths then load as a bootstrap); ``loaded``, the first into the
    engine's placeholders (every path) and each later one in place (rsync, GDR). ``hook=offered``: every parameter
    keeps its memory of before, or a recapture call made after its last move, before NORMAL, names it;
    ``hook=none``: the loader is opened without ``options["recapture"]`` and every parameter that held memory keeps
    it, whatever the loader claims. Strides never change; values bit for bit.
    ``zero_first``: the model's first parameter holds no memory (zero elements), which needs no recapture; every
    parameter after it still does (a loader that stops looking at it covers none)."""
    path, loaded = combo["path"], combo["start"] == "loaded"
    spec = _modal_spec(combo)
    if zero_first:
        spec = _with_zero_first(spec)
    rt = route(path)
    bootstrap = {"version": None} if PATHS[path].in_place and not loaded else None
    offered = combo["hook"] == "offered"
    session, rec = _open(rt, loader, spec, bootstrap, hook=offered)
    swapping = 1 if combo["model"] == "draft" else 0
    built = {n: h.strides for n, h in hold(session.models).items()}  # as the suite built the layers
    claims = offered and RECAPTURE in loader.adapter.capabilities  # no hook offered: nothing may move
    for k in range(1, CALLS[combo["call"]] + 1):
        if combo["swap"] == "engine":
            session.models[swapping].load_weights.swap = ENGINE_SWAPS[k - 1]
        state = M.state(spec, version=k)  # as served
        where = rt.publish(0, _sent(spec, state), k) + (f": update {k} ({combo['start']} weights, {combo['model']} model, "
                                           f"{combo['layout']}, swap {combo['swap']}, hook {combo['hook']})")
        before = hold(session.models)  # the storage the engine's graphs were captured on
        if k > 1 and not loaded:
            session.clear()
        rec.calls.clear()
        rt.update(0)
        check.params_equal(session.observe(), state, where)
        _judge(where, before, session.models, rec, built, claims)


ZERO = ("a.empty", "float32", (0, 3))  # zero-element, first of all: it holds no memory, the parameters after it do


def _with_zero_first(spec):
    return ST.StridedSpec(M.ModelSpec((M.ParamSpec(*ZERO), *spec.main), spec.mtp), {})
