"""Model-level correctness: what a byte-for-byte check cannot see. Spec: SPEC.md § MODEL.

The model is ``fixtures.tiny_transformer`` (embedding tied to the output head, fused qkv and up_gate,
an fp8 o_proj with its scale, norms, an MTP draft with 3-D expert weights), tensor-parallel over two
ranks. Its layers declare their post-load steps (``post_load``); the oracles compute the served layout
and the logits from the trainer's tensors with numpy and their own slicing, never with the code under
test. Every rule runs on every path of ``conformance.paths.PATHS`` (snapshot levels, ipc metas, ipc
buckets), each case requiring exactly its path's capability; a new path joins with one line there.
"""
import re

import numpy as np
import pytest

from conformance import check
from conformance.adapter import observe_paddle
from conformance.paths import PATHS, cases, route, staged_options  # noqa: F401 - route is a fixture
from conformance.plugin import NOT_APPLICABLE, run_device
from weightsync.fixtures import tiny_transformer as TT

POST = ("model.post_load", "mtp")
HOOKS = ("model.hooks",)
BROKEN = "norm.weight"  # a plain parameter: fused groups stay complete when it is missing or wrong


def _model(rt, **kw) -> TT.TinyTransformer:
    """The model for a path: o_proj fp8 where the path can carry fp8, float32 where it cannot."""
    kw.setdefault("fp8", "float8_e4m3fn" if rt.fp8 else None)
    return TT.TinyTransformer(**kw)


def _buffers(session, model) -> dict:
    return observe_paddle({path: TT.buffer(session.models, path) for path in model.buffer_specs()})


def _cycle(rt, model, version, rank=0, *, tensors=None, layout=None, clear=True) -> str:
    """Publish ``version`` (or ``tensors``) to ``rank``, clear its session, update; returns where."""
    st = TT.sent(model, version, rank) if tensors is None else tensors
    where = rt.publish(rank, st, version, layout)
    if clear:
        rt.clear(rank)
    rt.update(rank)
    return where


def _served_once(session, model, st, where) -> None:
    """Every parameter and derived buffer is the post-load transform of ``st``, applied exactly once."""
    check.params_equal(session.observe(), TT.served_params(model, st), f"{where}: parameters")
    check.params_equal(_buffers(session, model), TT.served_buffers(model, st), f"{where}: derived buffers")


def _broken(model, version, breakage, rank=0):
    st = TT.sent(model, version, rank)
    if breakage == "missing":
        del st[BROKEN]
    elif breakage == "dtype":
        st[BROKEN] = st[BROKEN].astype(np.float16)
    return st


def _tamper_end(update):
    update.end["count"] += 1  # after every bucket arrived: the last check before the commit


def _bad_update(rt, model, version, breakage) -> str:
    """Publish a broken ``version`` to rank 0 and make ready for its update (the clear, where the path has
    one); returns where. ``missing``/``dtype``: a tensor left out or of the wrong dtype; ``end``: the bucket
    stream's closing message disagrees; ``stream-broken``: the trainer breaks the stream in the middle."""
    st, layout = TT.sent(model, version), None
    if breakage in ("missing", "dtype"):
        st = _broken(model, version, breakage)
    elif breakage == "end":
        layout = _tamper_end
    elif breakage == "stream-broken":
        layout = ("fail", len(st) // 2)
    where = rt.publish(0, st, version, layout)
    rt.clear(0)
    return where


def _refused(path, breakage, where):
    """``check.raises`` for the failure each breakage must cause, as SPEC.md names it: the missing parameter
    the verification's RuntimeError, its words or the name (APPLY-MISSING-FAILS; on GDR the stream's end, an error naming it:
    GDR-SHORT-STREAM), the wrong dtype a TypeError naming it (APPLY-DTYPE-MISMATCH; rsync: one ValueError
    `Invalid new_state_dict` naming it), the tampered end a
    ValueError naming its field `count` (BKT-END-CHECK), the broken stream the library's ConnectionError."""
    if breakage == "missing" and path == "gdr":
        return check.raises(Exception, match=re.escape(BROKEN), names=[BROKEN], where=where)
    if breakage == "missing":  # FastDeploy's verification names no parameter (fd-spec §2.7)
        return check.raises(RuntimeError, match=rf"verification failed|{re.escape(BROKEN)}", where=where)
    if breakage == "dtype" and path == "rsync":  # rsync refuses the whole dict at once (RSYNC-VALIDATE-ALL)
        return check.raises(ValueError, match=r"Invalid new_state_dict", names=[BROKEN], where=where)
    if breakage == "dtype":
        return check.raises(TypeError, match=re.escape(BROKEN), names=[BROKEN], where=where)
    if breakage == "end":
        return check.raises(ValueError, match=r"\bcount\b", where=where)
    return check.raises(ConnectionError, match=r"broke", where=where)


# -- transforms ------------------------------------------------------------------------------------------
@pytest.mark.rule("MODEL-TRANSFORM-ONCE")
@pytest.mark.modes(call=("first", "second"))
@pytest.mark.parametrize("path,updates,staged", cases(2, extra=POST, staged=True) + cases(
    20, False, paths=["single"], extra=POST, id_suffix=":20-updates"))
def test_transform_applied_once_per_update(route, path, updates, staged):
    rt = route(path)
    model = _model(rt)
    session = rt.open(model, options=staged_options(staged))
    for version in range(1, updates + 1):
        st = TT.sent(model, version)
        where = _cycle(rt, model, version, tensors=st, clear=version > 1)
        if version in (1, 2, updates):
            _served_once(session, model, st, f"{where}, update {version} of {updates}")


@pytest.mark.rule("MODEL-SAME-WEIGHTS")
@pytest.mark.parametrize("path,staged", cases(extra=POST, staged=True))
def test_reloading_the_served_weights_changes_nothing(route, path, staged):
    rt = route(path)
    model = _model(rt)
    session = rt.open(model, options=staged_options(staged))
    st = TT.sent(model, 1)
    where = _cycle(rt, model, 1, tensors=st, clear=False)
    _served_once(session, model, st, f"{where}: the first load")
    for update in (1, 2):  # the served weights sent again (a trainer's retry, an RL step that changed nothing), twice
        again = {name: array.copy() for name, array in st.items()}
        where = _cycle(rt, model, 1 + update, tensors=again)
        _served_once(session, model, st, f"{where}: update {update} of 2 carries exactly the served weights")


@pytest.mark.rule("MODEL-TRANSFORM-FROZEN")
@pytest.mark.parametrize("path,updates,staged", cases(2, extra=POST, staged=True))
def test_frozen_draft_is_not_transformed_again(route, path, updates, staged):
    rt = route(path)
    model = _model(rt, frozen_draft=True)
    session = rt.open(model, options=staged_options(staged))
    draft = session.models[1]
    startup = TT.served_params(model, model.draft_startup_shard())
    startup_buffers = TT.served_buffers(model, model.draft_startup_shard())  # the draft's fused eh_proj
    pointers = {n: p.data_ptr() for n, p in draft.state_dict().items()}
    check.params_equal(observe_paddle(draft.state_dict()), startup, f"{path}: fixture precondition: the draft as loaded at start-up")
    for version in range(1, updates + 1):
        st = TT.sent(model, version)
        where = _cycle(rt, model, version, tensors=st, clear=version > 1)
        if version in (1, 2, updates):
            check.params_equal(session.observe(), TT.served_params(model, st), f"{where}, update {version}: main model")
            check.params_equal(observe_paddle(draft.state_dict()), startup,
                               f"{where}, update {version}: the frozen draft received nothing and must be as at start-up")
            check.params_equal(_buffers(session, model), {**TT.served_buffers(model, st), **startup_buffers},
                               f"{where}, update {version}: derived buffers (the draft's as at start-up)")
            moved = {n: (pointers[n], p.data_ptr()) for n, p in draft.state_dict().items() if p.data_ptr() != pointers[n]}
            check.that(not moved, f"{where}, update {version}: the frozen draft's storage was replaced: {moved}")


# rsync updates in place and a step may leave keys out (RSYNC-SUBSET, FastDeploy #7675): a missing tensor is
# no failure there, so rsync fails by a dtype (its whole-step validation) and by a broken stream instead.
# On GDR a missing tensor is the stream ending without it (GDR-SHORT-STREAM).
CAN_MISS = [p for p in PATHS if p != "rsync"]
FAILED = (cases("missing", paths=CAN_MISS, extra=POST, staged=True)
          + cases("dtype", paths=["parts", "rsync"], extra=POST, id_suffix=":dtype", staged=True)
          + cases("end", paths=["bucket"], extra=POST, id_suffix=":end-tampered", staged=True)
          + cases("stream-broken", paths=["gdr"], extra=POST, id_suffix=":stream-broken", staged=True))


@pytest.mark.rule("MODEL-TRANSFORM-FAILED")
@pytest.mark.parametrize("path,breakage,staged", FAILED)
def test_failed_update_runs_no_post_load_step(route, path, breakage, staged):
    rt = route(path)
    model = _model(rt, frozen_draft=True)
    session = rt.open(model, options=staged_options(staged))
    draft = session.models[1]
    startup = observe_paddle(draft.state_dict())
    v1 = TT.sent(model, 1)
    _cycle(rt, model, 1, tensors=v1, clear=False)
    kept = _buffers(session, model)
    where = _bad_update(rt, model, 2, breakage)
    with _refused(path, breakage, f"{where} ({breakage})"):
        rt.update(0)
    after = _buffers(session, model)
    changed = sorted(k for k in kept if kept[k] != after[k])
    check.that(not changed, f"{where}: after the failed update ({breakage}), the derived buffers must still hold "
                            f"version 1's values (no post-load step ran); changed: {changed}")
    check.unchanged(startup, observe_paddle(draft.state_dict()), f"{where}: the frozen draft after the failed update")
    if rt.path.in_place and (staged or path == "rsync"):  # refused before any parameter changed: as served before
        check.params_equal(session.observe(), TT.served_params(model, v1),
                           f"{where}: after the failed update ({breakage}) in place, every parameter as version 1 served it")
    v3 = TT.sent(model, 3)
    where = _cycle(rt, model, 3, tensors=v3)
    check.params_equal(session.observe(), TT.served_params(model, v3),
                       f"{where}: clear() and update() after the failed one: each transform once")
    check.params_equal(_buffers(session, model), TT.served_buffers(model, v3), f"{where}: derived buffers after recovery")


# An rsync step in place may leave keys out (RSYNC-SUBSET): a transposed weight left out must come back as it was
# served, transposed once, not undone or done twice by the steps run around the update; its fused and dequantised
# buffers follow the weights the model now holds. First, middle and last transposed weights; a non-square, a square
# and a 3-D per-expert one, an fp8 weight whose scale the step carries; one and two left out.
LEFT_OUT = (["layers.0.attn.q_proj.weight"], ["layers.0.mlp.gate_proj.weight"],
            ["layers.0.attn.o_proj.weight", "layers.0.mlp.down_proj.weight"], ["mtp_block.0.experts.down_proj.weight"])


@pytest.mark.rule("RSYNC-SUBSET")
@pytest.mark.modes(start="loaded", model=("main", "draft"))
@pytest.mark.parametrize("path,staged", cases(paths=["rsync"], extra=POST, staged=True))
def test_rsync_subset_leaves_transposed_weights_as_served(route, path, staged):
    rt = route(path)
    model = _model(rt)
    session = rt.open(model, options=staged_options(staged))
    have = TT.sent(model, 1)
    _cycle(rt, model, 1, tensors=have, clear=False)
    for version, left_out in enumerate(LEFT_OUT, start=2):
        new = TT.sent(model, version)
        where = _cycle(rt, model, version, tensors={n: a for n, a in new.items() if n not in left_out})
        have = {n: (have[n] if n in left_out else a) for n, a in new.items()}
        _served_once(session, model, have, f"{where}, update {version} in place without {left_out}: those as served before")


# -- quantised weights -----------------------------------------------------------------------------------
QUANT_WEIGHT, QUANT_SCALE = "layers.0.attn.o_proj.weight", "layers.0.attn.o_proj.weight_scale"
QUANT = (cases("float8_e4m3fn", "channel", "scale-first", "float32", paths=["parts"], extra=POST, id_suffix=":scale-in-part0")
         + cases("float8_e4m3fn", "channel", "weight-first", "float32", paths=["parts"], extra=POST,
                 id_suffix=":weight-in-part0")
         + cases("float8_e5m2", "scalar", "weight-first", "float32", paths=["single"], extra=POST, id_suffix=":e5m2:0-d-scale")
         + cases("float8_e4m3fn", "channel", "scale-first", "float32", paths=["legacy", "ipc"], extra=POST)
         + cases("float8_e4m3fn", "channel", "scale-first", "float32", paths=["bucket"], extra=POST,
                 id_suffix=":scale-in-bucket0")
         + cases("float8_e5m2", "scalar", "weight-first", "float32", paths=["bucket"], extra=POST,
                 id_suffix=":e5m2:0-d-scale:weight-in-bucket0")
         + cases("float8_e4m3fn", "channel", "scale-first", "float32", paths=["rsync"], extra=POST, id_suffix=":scale-first")
         # GDR applies items as they arrive: the scale last in the stream, after its weight
         + cases("float8_e5m2", "scalar", "weight-first", "float32", paths=["gdr"], extra=POST,
                 id_suffix=":e5m2:0-d-scale:scale-last")
         # every wider float a dequantised buffer may be (float32 above): the weight times its scale in that dtype
         + cases("float8_e5m2", "scalar", "weight-first", "float16", paths=["parts"], extra=POST,
                 id_suffix=":e5m2:0-d-scale:float16-buffer")
         + cases("float8_e4m3fn", "channel", "scale-first", "bfloat16", paths=["ipc"], extra=POST, id_suffix=":bfloat16-buffer")
         + cases("float8_e4m3fn", "channel", "weight-first", "float64", paths=["bucket"], extra=POST,
                 id_suffix=":float64-buffer"))


def _quant_order(st, order):
    """``st`` with the scale first and the weight last, or the other way round."""
    first, last = (QUANT_SCALE, QUANT_WEIGHT) if order == "scale-first" else (QUANT_WEIGHT, QUANT_SCALE)
    rest = {n: a for n, a in st.items() if n not in (first, last)}
    return {first: st[first], **rest, last: st[last]}


# staged: each path a loader can stage, once
QUANT_STAGED = [pytest.param(*p.values, True, marks=[*p.marks, pytest.mark.requires("staged")], id=f"{p.id}:staged")
                for p in {p.values[0]: p for p in reversed(QUANT)}.values() if p.values[0] not in ("gdr",)]


@pytest.mark.rule("MODEL-QUANT-SCALE")
@pytest.mark.parametrize("path,fp8,scale,order,buffer_dtype,staged", [pytest.param(*p.values, False, marks=p.marks,
                                                                                    id=p.id) for p in QUANT] + QUANT_STAGED)
def test_fp8_weight_and_scale_dequantised_once(route, path, fp8, scale, order, buffer_dtype, staged):
    rt = route(path)
    if not rt.fp8:
        pytest.skip(f"{NOT_APPLICABLE}: the {path} file is written with paddle.save for this adapter, which cannot hold fp8")
    model = _model(rt, fp8=fp8, scalar_scale=scale == "scalar", dequant_dtype=buffer_dtype)
    session = rt.open(model, options=staged_options(staged))
    buffer = TT.buffer(session.models, "layers.0.attn.o_dq")
    pointer = buffer.data_ptr()
    for version in (1, 2):
        st = _quant_order(TT.sent(model, version), order)
        layout = None
        if path == "parts":
            names = list(st)
            layout = [names[: len(names) // 2], names[len(names) // 2:]]
        where = _cycle(rt, model, version, tensors=st, layout=layout, clear=version > 1)
        want = TT.served_buffers(model, st)["layers.0.attn.o_dq"]
        check.params_equal(_buffers(session, model), {"layers.0.attn.o_dq": want},
                           f"{where} ({order}, a {buffer_dtype} buffer): o_proj x its scale, both of version {version}, "
                           "applied once")
        check.params_equal(session.observe(), TT.served_params(model, st), f"{where}: the fp8 weight and its scale as sent")
        check.equal(buffer.data_ptr(), pointer, f"{where}: the dequantised buffer is written in place (its storage)")


# -- tied parameters -------------------------------------------------------------------------------------
# A model without post_load steps: the tie is a rule for every loader of a path, declarations or not.
TIED = (cases("embed", extra=("mtp",), id_suffix=":embed-only", staged=True)
        + cases("head", paths=["parts", "bucket"], extra=("mtp",), id_suffix=":head-only", staged=True)
        + cases("both", paths=["single"], extra=("mtp",), id_suffix=":both", staged=True))


@pytest.mark.rule("MODEL-TIED")
@pytest.mark.modes(call=("first", "second"))
@pytest.mark.parametrize("path,carried,staged", TIED)
def test_tied_pair_serves_the_new_value_by_both_names(route, path, carried, staged):
    rt = route(path)
    model = _model(rt, plain=True)
    session = rt.open(model, options=staged_options(staged))
    main = session.models[0]
    for version in (1, 2):
        st = TT.sent(model, version, tied=carried)
        where = _cycle(rt, model, version, tensors=st, clear=version > 1)
        observed = session.observe()
        want = TT.served_params(model, st)
        check.params_equal({n: observed.get(n) for n in ("embed.weight", "lm_head.weight")},
                           {n: want[n] for n in ("embed.weight", "lm_head.weight")},
                           f"{where}: the tied pair carried as {carried!r}, update {version}")
        check.equal(main.lm_head.weight.data_ptr(), main.embed.weight.data_ptr(),
                    f"{where}: lm_head.weight and embed.weight must still share one storage after update {version}")


# -- the forward pass ------------------------------------------------------------------------------------
def _logits_equal(got, want, where) -> None:
    """Bitwise on the CPU; on a GPU within 1e-3 of the largest logit (kernels may reorder sums)."""
    for kind, g, w in zip(("main", "mtp"), got, want):
        if run_device() == "cpu":
            same = g.shape == w.shape and g.tobytes() == w.tobytes()
        else:
            same = g.shape == w.shape and bool(np.all(np.abs(g - w) <= 1e-3 * np.abs(w).max()))
        diff = float(np.abs(g - w).max()) if g.shape == w.shape else f"shape {g.shape} vs {w.shape}"
        check.that(same, f"{where}: {kind} logits of the served model differ from the trainer model's "
                         f"(max |diff| {diff}): got {g.ravel()[:4]}, expected {w.ravel()[:4]}")


@pytest.mark.rule("MODEL-FORWARD")
@pytest.mark.parametrize("path,staged", cases(extra=POST, staged=True))
def test_served_logits_equal_the_trainer_models(route, path, staged):
    rt = route(path)
    model = _model(rt)
    sessions = [rt.open(model, rank, options=staged_options(staged)) for rank in range(model.tp)]
    for version in (1, 2):
        where = [_cycle(rt, model, version, rank, clear=version > 1) for rank in range(model.tp)]
        _logits_equal(TT.served_logits(model, [s.models for s in sessions]), TT.trainer_logits(model, version),
                      f"{where}: tensor-parallel forward over {model.tp} ranks after update {version}")


# -- stale-state hooks -----------------------------------------------------------------------------------
class Recorder:
    """Hooks an engine would register; each call records what the session served at that moment."""

    def __init__(self, session, model, names=("reset_prefix_cache", "recapture_graphs"), status=False):
        self.session, self.model, self.calls = session, model, []
        self.status = status
        for name in names:
            session.register_hook(name, lambda name=name: self._called(name))

    def _called(self, name):
        self.calls.append({"hook": name, "status": self.session.status() if self.status else None,
                           "observed": self.session.observe(), "buffers": _buffers(self.session, self.model)})


HOOK_CASES = (cases("missing", 3, paths=CAN_MISS, extra=POST + HOOKS)
              + cases("dtype", 3, paths=["parts", "rsync"], extra=POST + HOOKS, id_suffix=":dtype")
              + cases("end", 3, paths=["bucket"], extra=POST + HOOKS, id_suffix=":end-tampered")

              + cases("missing", 6, paths=["single"], extra=POST + HOOKS, id_suffix=":6-updates"))


@pytest.mark.rule("MODEL-HOOKS")
@pytest.mark.parametrize("path,breakage,updates", HOOK_CASES)
def test_hooks_run_once_after_each_commit(route, loader, path, breakage, updates):
    rt = route(path)
    model = _model(rt)
    session = rt.open(model)
    rec = Recorder(session, model, status="status" in loader.adapter.capabilities)
    committed = 0
    for version in range(1, updates + 1):
        if version == 2:  # a failed update: no hook may run
            where = _bad_update(rt, model, 2, breakage)
            with _refused(path, breakage, f"{where} ({breakage})"):
                rt.update(0)
            check.equal([c["hook"] for c in rec.calls], ["reset_prefix_cache", "recapture_graphs"] * committed,
                        f"{where}: hooks called after the failed update ({breakage})")
            continue
        st = TT.sent(model, version)
        where = _cycle(rt, model, version, tensors=st, clear=version > 1)
        committed += 1
        check.equal([c["hook"] for c in rec.calls], ["reset_prefix_cache", "recapture_graphs"] * committed,
                    f"{where}: hooks after {committed} committed update(s) (one failed in between)")
        if version in (1, 3, updates):
            for call in rec.calls[-2:]:
                at = f"{where}: inside hook {call['hook']} of update {version}"
                if rec.status:
                    check.equal(call["status"], "NORMAL", f"{at}: status (a hook runs after the commit)")
                check.params_equal(call["observed"], TT.served_params(model, st), f"{at}: parameters served")
                check.params_equal(call["buffers"], TT.served_buffers(model, st), f"{at}: derived buffers")


@pytest.mark.rule("MODEL-HOOK-FAILURE")
# The hooks run at the commit, after any path's load, plain or staged (on buckets the trainer was already told
# done; on the streamed paths the recovery is in place, without a clear).
@pytest.mark.parametrize("path,staged", cases(extra=POST + HOOKS + ("status",), staged=True))
def test_a_failing_hook_fails_the_update(route, path, staged):
    rt = route(path)
    model = _model(rt)
    session = rt.open(model, options=staged_options(staged))
    calls, broken = [], [True]

    def hook(name):
        calls.append(name)
        if name == "recapture_graphs" and broken[0]:
            raise RuntimeError("graph capture ran out of memory")

    for name in ("reset_prefix_cache", "recapture_graphs", "reset_mtp_cache"):
        session.register_hook(name, lambda name=name: hook(name))
    where = rt.publish(0, TT.sent(model, 1), 1)
    with check.raises(RuntimeError, match="recapture_graphs",
                      names=["recapture_graphs", "RuntimeError", "graph capture ran out of memory"], where=where):
        rt.update(0)
    check.equal(calls, ["reset_prefix_cache", "recapture_graphs", "reset_mtp_cache"],
                f"{where}: every hook runs once although one raised")
    check.status_not(session, "NORMAL", f"{where}: after a hook raised (stale state may be served)")
    broken[0] = False
    st = TT.sent(model, 2)
    where = _cycle(rt, model, 2, tensors=st)
    check.equal(calls[3:], ["reset_prefix_cache", "recapture_graphs", "reset_mtp_cache"], f"{where}: after recovery")
    check.status_is(session, "NORMAL", f"{where}: after recovery")
    _served_once(session, model, st, f"{where}: after recovery")


# -- declarations ----------------------------------------------------------------------------------------
class Declared:
    """The model with its declaration edited by ``edit(main_decl, mtp_decl)`` after it is built."""

    def __init__(self, edit):
        self.model = TT.TinyTransformer()
        self.edit = edit

    def build_models(self):
        models = self.model.build_models()
        models[0].post_load = dict(models[0].post_load)
        models[1].post_load = dict(models[1].post_load)
        self.edit(*models)
        return models


def _set(model_index, key, value):
    def edit(main, mtp):
        decl = (main, mtp)[model_index].post_load
        if value is None:
            (main, mtp)[model_index].post_load = key
        else:
            decl[key] = value
    return edit


def _int_buffer(main, mtp):
    import paddle

    getattr(main.layers, "0").attn.register_buffer("o_int", paddle.zeros([4, 8], dtype="int32"), persistable=False)
    main.post_load["dequant"] = {"layers.0.attn.o_int": {"weight": "layers.0.attn.o_proj.weight",
                                                         "scale": "layers.0.attn.o_proj.weight_scale"}}


DECLARATIONS = {
    "transpose-unknown-name": (_set(0, "transpose", ["layers.0.attn.q_proj.wieght"]), ["layers.0.attn.q_proj.wieght"]),
    "transpose-1-D": (_set(0, "transpose", ["norm.weight"]), ["norm.weight", "1-D"]),
    "fuse-piece-unknown": (_set(0, "fuse", {"layers.0.attn.qkv": {"from": ["layers.0.attn.q_proj.weight", "nope"],
                                                                    "axis": 1}}), ["nope"]),
    "fuse-buffer-missing": (_set(0, "fuse", {"layers.0.attn.kvq": {"from": ["layers.0.attn.k_proj.weight",
                                                                             "layers.0.attn.v_proj.weight"], "axis": 1}}),
                            ["layers.0.attn.kvq"]),
    "fuse-wrong-axis": (_set(0, "fuse", {"layers.0.attn.qkv": {"from": ["layers.0.attn.q_proj.weight",
                                                                         "layers.0.attn.k_proj.weight",
                                                                         "layers.0.attn.v_proj.weight"], "axis": 0}}),
                        ["layers.0.attn.qkv", "cannot be concatenated"]),
    "fuse-buffer-too-small": (_set(0, "fuse", {"layers.0.attn.qkv": {"from": ["layers.0.attn.q_proj.weight",
                                                                               "layers.0.attn.k_proj.weight"], "axis": 1}}),
                              ["layers.0.attn.qkv"]),
    "dequant-weight-not-fp8": (_set(0, "dequant", {"layers.0.attn.o_dq": {"weight": "layers.0.attn.q_proj.weight",
                                                                           "scale": "layers.0.attn.o_proj.weight_scale"}}),
                               ["layers.0.attn.o_dq", "float32"]),
    "dequant-scale-not-per-channel": (_set(0, "dequant", {"layers.0.attn.o_dq": {
        "weight": "layers.0.attn.o_proj.weight", "scale": "layers.0.mlp.gate_proj.weight"}}), ["layers.0.attn.o_dq", "scale"]),
    "dequant-into-int-buffer": (_int_buffer, ["layers.0.attn.o_int", "int32"]),
    "dequant-weight-unknown": (_set(0, "dequant", {"layers.0.attn.o_dq": {"weight": "layers.0.attn.o.weight",
                                                                           "scale": "layers.0.attn.o_proj.weight_scale"}}),
                               ["layers.0.attn.o_dq", "layers.0.attn.o.weight"]),
    "dequant-scale-unknown": (_set(0, "dequant", {"layers.0.attn.o_dq": {"weight": "layers.0.attn.o_proj.weight",
                                                                          "scale": "layers.0.attn.o_proj.scale"}}),
                              ["layers.0.attn.o_dq", "layers.0.attn.o_proj.scale"]),
    "dequant-buffer-wrong-shape": (_set(0, "dequant", {"layers.0.attn.qkv": {"weight": "layers.0.attn.o_proj.weight",
                                                                              "scale": "layers.0.attn.o_proj.weight_scale"}}),
                                   ["layers.0.attn.qkv", "[8, 8]", "[4, 8]"]),
    "fuse-without-from": (_set(1, "fuse", {"mtp_block.0.eh_proj": {"axis": 0}}), ["model 1", "mtp_block.0.eh_proj", "from"]),
    "fuse-into-a-layer": (_set(0, "fuse", {"layers.0.attn": {"from": ["layers.0.attn.k_proj.weight",
                                                                      "layers.0.attn.v_proj.weight"], "axis": 1}}),
                          ["layers.0.attn"]),
    "fuse-axis-not-int": (_set(0, "fuse", {"layers.0.attn.qkv": {"from": ["layers.0.attn.q_proj.weight",
                                                                           "layers.0.attn.k_proj.weight"], "axis": "1"}}),
                          ["layers.0.attn.qkv", "axis"]),
    "fuse-axis-out-of-range": (_set(0, "fuse", {"layers.0.mlp.up_gate": {"from": ["layers.0.mlp.gate_proj.weight",
                                                                               "layers.0.mlp.up_proj.weight"], "axis": 2}}),
                               ["layers.0.mlp.up_gate", "axis 2", "cannot be concatenated"]),
    "fuse-pieces-of-two-dtypes": (_set(0, "fuse", {"layers.0.attn.qkv": {"from": ["layers.0.attn.o_proj.weight",
                                                                                   "embed.weight"], "axis": 0}}),
                                  ["layers.0.attn.qkv", "float8_e4m3fn", "float32"]),
    "dequant-buffer-is-a-parameter": (_set(0, "dequant", {"norm.weight": {"weight": "layers.0.attn.o_proj.weight",
                                                                           "scale": "layers.0.attn.o_proj.weight_scale"}}),
                                      ["norm.weight"]),
    "frozen-not-bool": (_set(1, "frozen", "yes"), ["frozen", "yes"]),
    "unknown-key": (_set(1, "transpose_all", True), ["model 1", "transpose_all"]),
    "not-a-dict": (_set(1, ["mtp_block.0.eh_proj.weight"], None), ["model 1", "list"]),
}


# A declaration error is the model's, whatever the path (checked before any source is read): every case on
# the single file, and one on gdr (where the models load themselves, through their own load_weights).
STREAMED_DECLARATIONS = ("fuse-piece-unknown",)


@pytest.mark.rule("MODEL-DECLARATION")
@pytest.mark.parametrize("path,case", [p for c in DECLARATIONS for p in cases(c, paths=["single"], extra=POST,
                                                                            id_suffix=f":{c}")]
                         + [p for c in STREAMED_DECLARATIONS for p in cases(c, paths=["gdr"], extra=POST,
                                                                           id_suffix=f":{c}")])
def test_bad_declaration_is_a_clear_error(route, path, case):
    edit, names = DECLARATIONS[case]
    rt = route(path)
    spec = Declared(edit)
    with check.raises(ValueError, match="post_load", names=names, where=f"{case}: declaration"):
        rt.open(spec)  # (the reference refuses here; a loader that waits for update() gets one)
        rt.publish(0, TT.sent(spec.model, 1), 1)
        rt.update(0)
