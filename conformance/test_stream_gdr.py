"""GDR: a CheckpointTransfer stream into each model's ``load_weights``, MTP items routed in chunks, received
ahead of the loader. Spec: SPEC.md § GDR (and § RSYNC's introduction for the trainer stand-in).

The models' ``load_weights`` are the suite's (fixtures.streams.ModelLoader): they record what each model
was handed and when, and can break or hold. Cases that share a session run one after the other in one
test, each check naming its case. The silences (stalls, a slow trainer) are judged in test_stream_timing.py.
"""
import asyncio
import threading
import time
import types

import pytest

from conformance import check
from conformance import modes
from conformance.harness import Worker
from conformance.stream_support import STRATEGY_CAPS, both_gdr, case, ct_trainer, open_stream  # noqa: F401 - ct_trainer is a fixture
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S
from weightsync.fixtures.ipc import patterned

pytestmark = pytest.mark.streams

MAIN = (("model.layers.0.q.weight", "bfloat16", (4, 4)), ("model.layers.1.mlp.weight", "float32", (4, 8)),
        ("model.norm.weight", "float16", (4,)))
MTP = (("model.layers.2.eh_proj.weight", "float32", (4, 4)), ("ernie.mtp_block.0.norm.weight", "bfloat16", (4,)))
SPEC = M.spec(*MAIN)
SPEC_MTP = M.spec(*MAIN, mtp=[MTP])
MTP_START = 2  # the MTP model serves layer 2


def _gdr(loader, trainer, spec=SPEC_MTP, strategy="gdr", **kw):
    kw.setdefault("mtp_start", MTP_START if spec.mtp else None)
    return open_stream(loader, trainer, spec, strategy, **kw)


def _loaded(loader, trainer, spec=SPEC_MTP, **kw):
    """(session, record, version 1) after a first update of version 1 (asserted)."""
    v1 = M.state(spec, version=1)
    trainer.serve(S.stream_of(v1))
    session, record = _gdr(loader, trainer, spec, **kw)
    session.update()
    check.params_equal(session.observe(), v1, f"{trainer.endpoint}: first GDR load of version 1")
    return session, record, v1


def _next_loads(session, trainer, spec, where):
    """The trainer serves version 3 whole; the session's next update loads it bit for bit."""
    v3 = M.state(spec, version=3)
    trainer.serve(S.stream_of(v3))
    session.update()
    check.params_equal(session.observe(), v3, where)


# -- GDR-MAIN-EVERY-ITEM ---------------------------------------------------------------------------
EVERY_KIND = M.spec(*((f"d.w_{d}", d, (3, 5)) for d in ("bfloat16", "float16", "float32", "float64", "int8", "int32",
                                                          "int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2")),
                    ("e.scalar", "bfloat16", ()), ("e.empty", "float32", (0, 4)))
LARGE = M.spec(("g.small", "float32", (3,)), ("g.big", "uint8", (8 * (1 << 20) + 1,)))


def _state(spec, version):
    if spec is not LARGE:
        return M.state(spec, version=version)
    return {"g.small": M.weights(spec.main[0], version=version), "g.big": patterned((8 * (1 << 20) + 1,), "uint8", seed=version)}


@pytest.mark.rule("GDR-MAIN-EVERY-ITEM")
@pytest.mark.parametrize("strategy, spec", [
    case("gdr", EVERY_KIND, id="gdr-every-dtype-0d-empty", modes={"start": ("cleared", "loaded")}),
    case("gdr", LARGE, id="gdr-8MiB", modes={"start": "cleared"}),
    case("gdr", SPEC_MTP, extra=("mtp",), id="gdr-main+mtp", modes={"start": ("cleared", "loaded")}),
    case("gdr_ipc", SPEC_MTP, extra=("mtp",), id="gdr_ipc-main+mtp", modes={"start": ("cleared", "loaded")}),
])
def test_gdr_main_model_gets_every_item_in_order(loader, ct_trainer, strategy, spec):
    v1, v2 = _state(spec, 1), _state(spec, 2)
    orders = [list(v1), list(reversed(list(v2)))]
    ct_trainer.serve(S.stream_of(v1), S.stream_of({n: v2[n] for n in orders[1]}))
    session, record = _gdr(loader, ct_trainer, spec, strategy)
    routed = sum(1 for n in v1 if "mtp_" in n or ".layers.2." in n)
    for version, want, order in ((1, v1, orders[0]), (2, v2, orders[1]))[:1 if spec is LARGE else 2]:  # large: once
        result = session.update() or {}
        where = f"{strategy}, update of version {version}"
        check.params_equal(session.observe(), want, where)
        check.equal((result.get("update_count"), result.get("mtp_cache_count")), (len(order), routed),
                    f"{where}: update_count and mtp_cache_count returned")
        check.equal(record.names(0), [orders[0], orders[1]][:version], f"{where}: load_weights calls of the main model")


# -- GDR-MTP-CHUNKS --------------------------------------------------------------------------------
CHUNK_MAIN = (("model.layers.0.a", "float32", (2,)), ("model.layers.1.b", "float32", (2,)), ("model.norm.c", "float16", (2,)))
CHUNK_MTP1 = (("model.layers.2.a", "float32", (2,)), ("mtp_block.c", "bfloat16", (2,)))
CHUNK_MTP2 = (("model.layers.2.b", "float32", (2,)), ("mtp_block.d", "float16", (2,)))
CHUNK_SPEC = M.spec(*CHUNK_MAIN, mtp=[CHUNK_MTP1, CHUNK_MTP2])
# main, routed, main, routed, routed, main, routed: routed items at stream positions 1, 3, 4, 6
CHUNK_ORDER = ["model.layers.0.a", "model.layers.2.a", "model.layers.1.b", "mtp_block.c", "model.layers.2.b",
               "model.norm.c", "mtp_block.d"]
ROUTED = [(1, "model.layers.2.a"), (3, "mtp_block.c"), (4, "model.layers.2.b"), (6, "mtp_block.d")]


def _chunks(size: int, routed=ROUTED, total: int = len(CHUNK_ORDER)) -> tuple[list, list]:
    """The chunks of ``size`` and when each is flushed: once the main loader has taken the item after its
    last one (a full chunk), or when it is done (the rest)."""
    chunks, at = [], []
    for start in range(0, len(routed), size):
        part = routed[start:start + size]
        chunks.append([n for _, n in part])
        at.append(part[-1][0] + 1 if len(part) == size else total)
    return chunks, at


def _default_size_stream(routed: int):
    """(spec, order, routed positions) for the absent size's boundary: ``routed`` items (16: a chunk of exactly the
    default size; 17: one past it) for one MTP model, the last of them after a main item, a main item last."""
    mtp = [(f"mtp_block.w{i:02d}", "float32", (2,)) for i in range(routed)]
    main = [(f"model.layers.0.m{i}", "float32", (2,)) for i in range(3)]
    order = [main[0][0], *(n for n, _, _ in mtp[:-1]), main[1][0], mtp[-1][0], main[2][0]]
    return M.spec(*main, mtp=[mtp]), order, [(order.index(n), n) for n, _, _ in mtp]


def _chunked(loader, ct_trainer, strategy, spec, order, in_place, extra):
    """A session of ``spec`` (with its first load of version 1 when ``in_place``) and the update of the stream
    ``order`` that the case judges: (session, record, state, result, wall, MTP chunks before it, main items before)."""
    state = M.state(spec, version=2 if in_place else 1)
    session, record = _gdr(loader, ct_trainer, spec, strategy, worker=Worker(rank=2, visible="4,6", selected="1"),
                           **extra)
    before, base = {m: 0 for m in range(1, len(spec.mtp) + 1)}, 0
    if in_place:
        ct_trainer.serve(S.stream_of(M.state(spec, version=1)))
        session.update()
        before = {m: len(record.names(m)) for m in before}  # the chunks of the first load, left out below
        base = record.main_taken  # the items the main model took in the first load
    ct_trainer.serve(S.stream_of({n: state[n] for n in order}))
    started = time.perf_counter()
    result = session.update() or {}
    return session, record, state, result, time.perf_counter() - started, before, base


@pytest.mark.rule("GDR-MTP-CHUNKS")
@pytest.mark.parametrize("strategy", [*both_gdr(modes={"start": "cleared"}, suffix="-first-load"),
                                      *both_gdr(modes={"start": "loaded"}, suffix="-in-place")])
def test_gdr_mtp_items_flushed_in_chunks(loader, ct_trainer, strategy, request):
    """One session per gdr_mtp_chunk_size (absent: 16; 0 or less: 1), two MTP models each handed every chunk;
    update() returns the items the main model took (7) and those routed to the MTP models (4). The absent size at
    its boundary: 16 and 17 items routed to one MTP model (a chunk of exactly 16; one past it). On the first load
    into cleared parameters, or on an update in place after it (the chunks of that update alone)."""
    in_place = request.node.callspec.id.endswith("in-place")
    sizes = ((None, 16), (1, 1), (2, 2), (3, 3), (4, 4), (0, 1), (-3, 1)) if not in_place else ((None, 16), (2, 2), (0, 1))
    cases = [(CHUNK_SPEC, CHUNK_ORDER, ROUTED, size, effective) for size, effective in sizes]
    cases += [(*_default_size_stream(n), None, 16) for n in (16, 17)]
    for spec, order, routed, size, effective in cases:
        extra = {} if size is None else {"gdr_mtp_chunk_size": size}
        session, record, state, result, wall, before, base = _chunked(loader, ct_trainer, strategy, spec, order,
                                                                      in_place, extra)
        where = (f"{strategy} gdr_mtp_chunk_size {size!r}, {len(routed)} of {len(order)} items routed "
                 f"({'in place' if in_place else 'first load'})")
        check.params_equal(session.observe(), state, where)
        counts = {k: result.get(k) for k in ("update_count", "mtp_cache_count", "version", "rank")}
        check.equal(counts, {"update_count": len(order), "mtp_cache_count": len(routed), "version": "1", "rank": 1},
                    f"{where}: update()'s result")
        costs = [result.get(k) for k in ("update_cost", "total_cost")]
        check.that(all(isinstance(c, float) and 0 <= c <= wall for c in costs),
                   f"{where}: update_cost and total_cost {costs} are seconds within the call's own {wall:.4f}s")
        want, at = _chunks(effective, routed, len(order))
        for model in before:
            check.equal(record.names(model)[before[model]:], want, f"{where}: chunks handed to MTP model {model}")
            check.equal([a - base for a in record.started_at(model)[before[model]:]], at,
                        f"{where}: items the main model had taken when each chunk was flushed")


# -- GDR-MTP-ROUTE ---------------------------------------------------------------------------------
def _route(loader, trainer, main, mtp, order, setup, where, strategy="gdr"):
    spec = M.spec(*((n, "float32", (2,)) for n in main), mtp=[[(n, "float32", (2,)) for n in mtp]])
    state = M.state(spec, version=1)
    trainer.serve(S.stream_of({n: state[n] for n in order}))
    session, record = open_stream(loader, trainer, spec, strategy)
    setup(session.models[1])
    session.update()
    check.params_equal(session.observe(), state, where)
    return [n for chunk in record.names(1) for n in chunk]


def _attrs(model, start=2, count=2):
    model.mtp_start_layer_idx, model.num_mtp_layers = start, count


def _fd_config(model, start=2, count=2):
    model.fd_config = types.SimpleNamespace(model_config=types.SimpleNamespace(start_layer_index=start,
                                                                               num_nextn_predict_layers=count))


@pytest.mark.rule("GDR-MTP-ROUTE")
@pytest.mark.parametrize("strategy", both_gdr())
def test_gdr_routes_mtp_layers_and_mtp_names(loader, ct_trainer, strategy):
    main = ["model.layers.0.q", "model.layers.1.q", "model.layers.4.q", "model.layers.20.q"]
    mtp = ["model.layers.2.q", "ernie.mtp_linear_proj.0.weight", "model.layers.3.q"]
    order = ["model.layers.0.q", "model.layers.1.q", "model.layers.2.q", "model.layers.20.q",
             "ernie.mtp_linear_proj.0.weight", "model.layers.3.q", "model.layers.4.q"]
    routed = ["model.layers.2.q", "ernie.mtp_linear_proj.0.weight", "model.layers.3.q"]
    for how, setup in (("mtp_start_layer_idx/num_mtp_layers", _attrs), ("fd_config.model_config", _fd_config)):
        where = f"{strategy}: MTP layers 2-3 from {how}"
        check.equal(_route(loader, ct_trainer, main, mtp, order, setup, where, strategy), routed,
                    f"{where}: items routed to the MTP model")
    # a model without a complete pair of attributes (none, or a start without a count) gets the mtp_ items only
    for how, setup in (("no layer attributes", lambda m: None), ("a start without a count",
                                                                 lambda m: setattr(m, "mtp_start_layer_idx", 2))):
        got = _route(loader, ct_trainer, main + ["model.layers.2.q", "model.layers.3.q"], ["ernie.mtp_linear_proj.0.weight"],
                     order, setup, f"{strategy}: an MTP model with {how}", strategy)
        check.equal(got, ["ernie.mtp_linear_proj.0.weight"], f"{strategy}: items routed to an MTP model with {how}")
    # The first layer, 0 (set, though falsy), from either pair; the model's own attribute before fd_config's, also
    # when it is 0 (a start of 0 over fd_config's 2; a count of 0 over fd_config's 2: no layer, the mtp_ items only)
    main0 = ["model.layers.2.q", "model.layers.3.q", "model.layers.10.q"]
    order0 = ["model.layers.0.q", "model.layers.1.q", "model.layers.2.q", "ernie.mtp_linear_proj.0.weight",
              "model.layers.3.q", "model.layers.10.q"]
    for how, setup, routed0 in (
            ("layers 0-1 from mtp_start_layer_idx/num_mtp_layers", lambda m: _attrs(m, 0, 2),
             ["model.layers.0.q", "model.layers.1.q", "ernie.mtp_linear_proj.0.weight"]),
            ("layers 0-1 from fd_config.model_config", lambda m: _fd_config(m, 0, 2),
             ["model.layers.0.q", "model.layers.1.q", "ernie.mtp_linear_proj.0.weight"]),
            ("mtp_start_layer_idx 0 over fd_config's start 2", lambda m: (_fd_config(m, 2, 2), _attrs(m, 0, 2)),
             ["model.layers.0.q", "model.layers.1.q", "ernie.mtp_linear_proj.0.weight"]),
            ("num_mtp_layers 0 over fd_config's count 2", lambda m: (_fd_config(m, 2, 2), _attrs(m, 2, 0)),
             ["ernie.mtp_linear_proj.0.weight"])):
        mtp0 = [n for n in routed0 if n.startswith("model.layers.")] + ["ernie.mtp_linear_proj.0.weight"]
        main_of = main0 + [n for n in ("model.layers.0.q", "model.layers.1.q") if n not in mtp0]
        where = f"{strategy}: an MTP model with {how}"
        check.equal(_route(loader, ct_trainer, main_of, mtp0, order0, setup, where, strategy), routed0,
                    f"{where}: items routed to the MTP model")


@pytest.mark.rule("GDR-MTP-ROUTE-COMPONENTS")
@pytest.mark.parametrize("strategy", both_gdr())
def test_gdr_routes_by_whole_name_components(loader, ct_trainer, strategy):
    main = ["model.sublayers.2.q", "model.xmtp_proj.w", "decoder.pre_mtp_norm.w", "model.layers.12.q", "mtpx_.w", "x.layers"]
    mtp = ["model.layers.2.q", "mtp_block.0.w", "a.layers.2"]
    order = ["x.layers", "model.sublayers.2.q", "model.layers.2.q", "model.xmtp_proj.w", "decoder.pre_mtp_norm.w",
             "model.layers.12.q", "mtp_block.0.w", "mtpx_.w", "a.layers.2"]
    got = _route(loader, ct_trainer, main, mtp, order, lambda m: _attrs(m, 2, 1), f"{strategy}: names sharing text with MTP "
                 "tokens", strategy)
    check.equal(got, ["model.layers.2.q", "mtp_block.0.w", "a.layers.2"],
                f"{strategy}: items routed to MTP layer 2 (whole components only)")


# -- GDR-NO-MTP-WEIGHTS ----------------------------------------------------------------------------
@pytest.mark.rule("GDR-NO-MTP-WEIGHTS")
@pytest.mark.parametrize("strategy", both_gdr(extra=("mtp", "status")))
def test_gdr_without_mtp_items_fails(loader, ct_trainer, strategy):
    """First load and in place: a stream with no MTP item fails; one with exactly one (the MTP model's only
    parameter) loads."""
    spec = M.spec(*MAIN, mtp=[[("ernie.mtp_block.0.norm.weight", "bfloat16", (4,))]])
    session, _ = _gdr(loader, ct_trainer, spec, strategy)
    for phase in ("first load", "in place"):
        state = M.state(spec, version=2 if phase == "in place" else 1)
        ct_trainer.serve(S.stream_of({n: a for n, a in state.items() if "mtp" not in n}), S.stream_of(state))
        with check.raises(ValueError, match="No MTP weights", where=f"{strategy} {phase}, no MTP item"):
            session.update()
        check.status_not(session, "NORMAL", f"{strategy} {phase}, no MTP item")
        session.update()
        check.params_equal(session.observe(), state, f"{strategy} {phase}, exactly one MTP item")


# -- GDR-RECEIVER-ERROR ----------------------------------------------------------------------------
PHASES = {"before-first": 0, "mid": 2, "after-last": 5}


@pytest.mark.rule("GDR-RECEIVER-ERROR")
@pytest.mark.requires("stream.gdr", "mtp", "status")
@pytest.mark.modes(path="gdr", start="loaded", phase=("before-first", "mid", "after-last"))
def test_gdr_broken_or_cancelled_stream_fails(loader, ct_trainer):
    """One session: a broken stream, then a cancelled one, at each phase; each update fails with the
    library's error (a cancellation never counts as complete); then a healthy update loads everything."""
    session, _, _ = _loaded(loader, ct_trainer)
    for kind, error, match in (("fail", ConnectionError, "broke"), ("cancel", (asyncio.CancelledError, RuntimeError), "(?i)cancel")):
        for phase, k in PHASES.items():
            ct_trainer.serve(S.stream_of(M.state(SPEC_MTP, version=2), fault=(kind, k)))
            where = f"GDR, trainer {kind}s {phase} (after {k} of 5 items)"
            with check.raises(error, match=match, where=where):
                session.update()
            check.status_not(session, "NORMAL", where)
    _next_loads(session, ct_trainer, SPEC_MTP, "GDR, the update after six failed ones")


@pytest.mark.rule("GDR-RECEIVER-ERROR")
@pytest.mark.parametrize("combo", modes.params("GDR-RECEIVER-ERROR", requires=lambda combo: [
    STRATEGY_CAPS[combo["path"]], "mtp", "status"]))
def test_gdr_broken_stream_fails_in_every_mode(loader, ct_trainer, combo):
    """A cancelled stream at the combination's phase, on gdr or gdr_ipc, the first load into cleared parameters or
    an update in place: the update fails (a cancellation never counts as complete); the next one loads."""
    strategy, k = combo["path"], PHASES[combo["phase"]]
    if combo["start"] == "loaded":
        session, _, _ = _loaded(loader, ct_trainer, strategy=strategy)
    else:
        session, _ = _gdr(loader, ct_trainer, strategy=strategy)
    ct_trainer.serve(S.stream_of(M.state(SPEC_MTP, version=2), fault=("cancel", k)))
    where = f"{strategy}, trainer cancels {combo['phase']} (after {k} of 5 items), {combo['start']} parameters"
    with check.raises((asyncio.CancelledError, RuntimeError), match="(?i)cancel", where=where):
        session.update()
    check.status_not(session, "NORMAL", where)
    _next_loads(session, ct_trainer, SPEC_MTP, f"{where}: the next update")


# -- GDR-SHORT-STREAM ------------------------------------------------------------------------------
@pytest.mark.rule("GDR-SHORT-STREAM")
@pytest.mark.parametrize("strategy", both_gdr(extra=("status",), modes={"start": ("loaded", "cleared")}))
def test_gdr_stream_ending_early_is_incomplete(loader, ct_trainer, strategy):
    """A stream that ends without an error after 0, 1 or all but the last item: in place, and after clear()."""
    session, _, _ = _loaded(loader, ct_trainer, SPEC, version="17", strategy=strategy)
    names = list(SPEC.all_params)
    for phase in ("in place", "after clear"):
        if phase == "after clear":
            session.clear()
        for k in (0, 1, len(names) - 1):
            ct_trainer.serve(S.stream_of(M.state(SPEC, version=2), fault=("end", k)))
            where = f"{strategy} {phase}, the stream ends after {k} of {len(names)} items"
            with check.raises(Exception, match=".", names=[names[-1].name, "17"], where=where):
                session.update()
            check.status_not(session, "NORMAL", where)
    _next_loads(session, ct_trainer, SPEC, "GDR after the short streams")


# -- GDR-CONSUMER-ERROR ----------------------------------------------------------------------------
@pytest.mark.rule("GDR-CONSUMER-ERROR")
@pytest.mark.parametrize("strategy", both_gdr(extra=("mtp", "status"), modes={"model": ("main", "draft")}))
def test_gdr_loader_error_stops_the_receiver(loader, ct_trainer, strategy):
    """The main model's loader fails at its first, a middle and its last item, then an MTP model's (chunks of 1): the
    update raises the loader's error, the receiver stops asking (at most the window ahead: 2) and tells
    the trainer, and no thread is left; the next update loads."""
    session, _, _ = _loaded(loader, ct_trainer, gdr_mtp_chunk_size=1, strategy=strategy)
    threads = check.live_threads()  # the trainer's among them
    stream = [f"filler.{i}" for i in range(20)]  # items no model has: the stream goes on past the failure
    for model, k, delay in ((0, 0, 0.0), (0, 2, 0.0), (0, 4, 0.0), (1, 0, 0.0), (0, 2, 0.03)):
        v2 = M.state(SPEC_MTP, version=2)
        items = {**v2, **{n: v2["model.norm.weight"] for n in stream}}
        ct_trainer.serve(S.stream_of(items))
        loader_fn = session.models[model].load_weights
        loader_fn.fail_at, loader_fn.fail_delay_s = k, delay  # delayed: the receiver waits with its window full
        where = f"{strategy}, model {model}'s loader fails at its item {k}"
        with check.raises(RuntimeError, match=f"model {model} loader failed at item {k}", where=where):
            session.update()
        loader_fn.fail_at, loader_fn.fail_delay_s = None, 0.0
        check.status_not(session, "NORMAL", where)
        taken = k + 1 if model == 0 else 4  # chunks of 1: the MTP item at position 3 is flushed as main asks for the 5th
        check.that(ct_trainer.wait_for(lambda: ct_trainer.sent() <= taken + 2, 1.0),
                   f"{where}: the trainer sent {ct_trainer.sent()} items, at most {taken + 2} allowed")
        check.that(ct_trainer.wait_for(lambda: any(b["stream"] == ct_trainer.of("hello")[-1]["stream"]
                                                   and b["handle"] == ct_trainer.of("hello")[-1]["handle"]
                                                   for b in ct_trainer.of("bye")), 2.0),
                   f"{where}: the receiver never told the trainer it stopped (bye)")
        check.no_new_threads(threads, where)
    _next_loads(session, ct_trainer, SPEC_MTP, "GDR after the loader errors")


# -- GDR-PREFETCH-BOUND ----------------------------------------------------------------------------
@pytest.mark.rule("GDR-PREFETCH-BOUND")
@pytest.mark.parametrize("strategy", both_gdr(extra=("stream.prefetch",)))
def test_gdr_prefetch_window(loader, ct_trainer, strategy):
    """While the main loader holds item k, the trainer has sent exactly k + gdr_prefetch_queue_size items
    (absent: 2; 0: 1): received ahead, and no more. Held at its first item; and with size 3 held at item 5,
    after a trainer slow for the first 4 items (the window filled up again after the receiver fell behind)."""
    spec = M.spec(*((f"p.{i}", "float32", (4,)) for i in range(10)))
    state = M.state(spec, version=1)
    for size, window, hold in ((None, 2, 0), (3, 3, 5), (0, 1, 0)):
        ct_trainer.serve(S.Stream(list(state.items()), pauses={i: 0.01 for i in range(4)} if hold else {}))
        extra = {} if size is None else {"gdr_prefetch_queue_size": size}
        session, record = _gdr(loader, ct_trainer, spec, strategy, loaders={"hold_at": {0: hold}}, **extra)
        held = session.models[0].load_weights
        done = threading.Thread(target=lambda: session.update(), daemon=True)
        where = f"{strategy} gdr_prefetch_queue_size {size!r}"
        done.start()
        try:
            check.that(held.holding.wait(5), f"{where}: the main loader never got item {hold}")
            ct_trainer.wait_for(lambda: ct_trainer.sent() >= hold + window, 1.0)
            time.sleep(0.02)
            check.equal(ct_trainer.sent(), hold + window, f"{where}: items sent while the loader holds item {hold}")
        finally:
            held.release.set()
            done.join(10)
        check.params_equal(session.observe(), state, f"{where}: after the release")


# -- GDR-REFRESH -----------------------------------------------------------------------------------
@pytest.mark.rule("GDR-REFRESH")
@pytest.mark.parametrize("strategy", both_gdr(modes={"call": ("first", "second")}))
def test_gdr_tracks_parameters_a_loader_replaced(loader, ct_trainer, strategy):
    """Loaders that put new parameter objects in place: each update, clear() and the next update act on them."""
    session, _ = _gdr(loader, ct_trainer, strategy=strategy, loaders={"replace": {0: True, 1: True}})
    for version in (1, 2):
        state = M.state(SPEC_MTP, version=version)
        ct_trainer.serve(S.stream_of(state))
        session.update()
        check.params_equal(session.observe(), state, f"{strategy} with replacing loaders, version {version}")
    session.clear()
    check.not_loaded(session.observe(), list(state), "clear() after updates by replacing loaders")
    state = M.state(SPEC_MTP, version=3)
    ct_trainer.serve(S.stream_of(state))
    session.update()
    check.params_equal(session.observe(), state, "GDR with replacing loaders after clear()")


# -- GDR-CONFIG / GDR-IPC-MODE ---------------------------------------------------------------------
FD_EXTRA = {"backend": "nccl", "output_framework": "paddle", "gpu_direct": True, "gdr_mtp_chunk_size": 2,
            "gdr_prefetch_queue_size": 2, "gdr_release_cache": True, "etcd_server": "127.0.0.1:2379", "transfer_mode": "gdr"}


def _configured(loader, trainer, strategy, settings, worker, version=None, updates=1):
    """Open with ``settings`` (kept by the test) as rsync_config, update ``updates`` times; returns the
    TransferConfig the library was initialized with and the step the last update asked for, after checking
    the load and that ``settings`` did not change."""
    import copy

    state = M.state(SPEC, version=1)
    trainer.serve(*[S.stream_of(state) for _ in range(updates)])
    given = S.rsync_config(trainer, 5.0, **settings)
    kept = copy.deepcopy(given)
    options = {"rsync_config": given, **({} if version is None else {"version": version})}
    session = loader.open(SPEC, strategy=strategy, options=options, worker=worker)
    S.publish_version(loader.model_dir, version)
    S.attach_loaders(session.models)
    for _ in range(updates):
        session.update()
    where = f"{strategy} with rsync_config {settings}"
    check.params_equal(session.observe(), state, where)
    check.equal(given, kept, f"{where}: the caller's rsync_config after the update")
    return trainer.of("register")[-1]["config"], trainer.of("hello")[-1]["step_id"]


@pytest.mark.rule("GDR-CONFIG")
@pytest.mark.requires("stream.gdr")
def test_gdr_transfer_config(loader, ct_trainer, monkeypatch):
    """Worker: global rank 5, ordinal 5 of 8, world size 8; index 1 gives global_rank 1 * 8 + 5 = 13."""
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "8")
    worker = Worker(rank=5, visible="0,1,2,3,4,5,6,7", selected="5")
    cases = [(dict(index=1, device_name="gpu:5", **FD_EXTRA), dict(global_rank=13, group_size=8, device="gpu:5")),
             (dict(index=0, group_size=16, device="gpu:7", device_name="gpu:5"), dict(global_rank=5, group_size=16, device="gpu:7")),
             ({}, dict(global_rank=5, group_size=8, device=None))]
    for settings, want in cases:
        config, step = _configured(loader, ct_trainer, "gdr", settings, worker, version="11")
        got = {k: config[k] for k in ("global_rank", "group_size", "device", "role", "phase1_backend")}
        check.equal(got, {**want, "role": "inference", "phase1_backend": "gpu_direct"}, f"GDR TransferConfig from {settings}")
        check.equal(step, "11", f"GDR step asked with version 11 ({settings})")
    S.write_version_file(loader.model_dir, "step: 23\n")  # no version argument: version.yaml's step, as rsync
    check.equal(_configured(loader, ct_trainer, "gdr", {}, worker)[1], "23", "GDR step asked without a version argument")
    # The argument wins over a version.yaml naming another step (judged on the update after the first load:
    # FastDeploy's first load is its constructor's, which passes no version).
    step = _configured(loader, ct_trainer, "gdr", {}, worker, version="11", updates=2)[1]
    check.equal(step, "11", "GDR step asked with version 11 while version.yaml names step 23")


@pytest.mark.rule("GDR-IPC-MODE")
@pytest.mark.requires("stream.gdr_ipc")
def test_gdr_ipc_mode_config(loader, ct_trainer, monkeypatch):
    """IPC mode on ordinal 2 (physical GPU 6) of global rank 9: global_rank 2, the IPC backend, qsize 2 unless
    given, step "0" unless a version is given, index dropped. The version is checked on the update after the
    first load (FastDeploy's first load is its constructor's, which passes no version)."""
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "16")
    worker = Worker(rank=9, visible="4,5,6,7", selected="2")
    for settings, version, want in (({}, None, dict(qsize=2, step="0")), (dict(qsize=5, index=3), "8", dict(qsize=5, step="8")),
                                    (dict(device_name="gpu:6"), "", dict(qsize=2, step="0"))):
        config, step = _configured(loader, ct_trainer, "gdr_ipc", settings, worker, version=version,
                                   updates=2 if version else 1)
        got = {"global_rank": config["global_rank"], "phase1_backend": config["phase1_backend"], "qsize": config["qsize"],
               "group_size": config["group_size"], "step": step}
        check.equal(got, {"global_rank": 2, "phase1_backend": "ipc", "group_size": 16, **want},
                    f"GDR IPC mode, rsync_config {settings}, version {version!r}")


# -- GDR-HANDLE-REUSE ------------------------------------------------------------------------------
def _handles_of(trainer, first_hello: int = 0) -> list:
    """The handle of each stream the trainer served since hello number ``first_hello``."""
    return [h["handle"] for h in trainer.of("hello")[first_hello:]]


@pytest.mark.rule("GDR-HANDLE-REUSE")
@pytest.mark.parametrize("strategy", both_gdr(modes={"call": ("second", "third")}))
def test_gdr_handle_reused_across_updates(loader, ct_trainer, strategy):
    """Three successful updates stream from the handle the first one initialized, none cleaned up; after a
    broken stream (whose handle GDR-HANDLE-CLEANUP judges) the handle of the next update serves the one
    after it too."""
    v1 = M.state(SPEC_MTP, version=1)
    ct_trainer.serve(S.stream_of(v1))
    session, _ = _gdr(loader, ct_trainer, strategy=strategy)
    session.update()
    for version in (2, 3):
        v = M.state(SPEC_MTP, version=version)
        ct_trainer.serve(S.stream_of(v))
        session.update()
        check.params_equal(session.observe(), v, f"{strategy}: update {version} of three")
    registers, used = ct_trainer.of("register"), _handles_of(ct_trainer)
    where = f"{strategy}, three successful updates"
    check.equal(len(registers), 1, f"{where}: handles initialized")
    check.equal(used, [registers[0]["handle"]] * 3, f"{where}: the handle of each stream")
    check.equal(ct_trainer.of("unregister"), [], f"{where}: handles cleaned up between successful updates")
    # After a failure: the next update's handle is kept for the one after it.
    ct_trainer.serve(S.stream_of(M.state(SPEC_MTP, version=4), fault=("fail", 2)))
    with check.raises(ConnectionError, match=".", where=f"{strategy}: stream broken after 2 items"):
        session.update()
    before = len(ct_trainer.of("hello"))
    for version in (5, 6):
        v = M.state(SPEC_MTP, version=version)
        ct_trainer.serve(S.stream_of(v))
        session.update()
        check.params_equal(session.observe(), v, f"{strategy}: update {version} after a broken stream")
    after = _handles_of(ct_trainer, before)
    check.that(len(after) == 2 and after[0] == after[1],
               f"{strategy}: the two updates after a broken stream streamed from handles {after}, expected one handle")


# -- GDR-HANDLE-CLEANUP ----------------------------------------------------------------------------
def _handle_failures(session):
    """Each way an update can fail, as (name, stream the trainer serves, prepare the session, error type)."""
    v = M.state(SPEC_MTP, version=2)
    no_mtp = {n: a for n, a in v.items() if "mtp" not in n and "layers.2" not in n}
    main = session.models[0].load_weights

    def fail_loader():
        main.fail_at = 1

    return [("stream breaks", S.stream_of(v, fault=("fail", 2)), None, ConnectionError),
            ("stream cancelled", S.stream_of(v, fault=("cancel", 2)), None, (asyncio.CancelledError, RuntimeError)),
            ("loader fails", S.stream_of(v), fail_loader, RuntimeError),
            ("no MTP item", S.stream_of(no_mtp), None, ValueError)]


FAILURE_NAMES = ("stream breaks", "stream cancelled", "loader fails", "no MTP item")


FAILURE_MODE = {"stream breaks": "breaks", "stream cancelled": "cancelled", "loader fails": "loader", "no MTP item": "no-mtp"}


@pytest.mark.rule("GDR-HANDLE-CLEANUP")
@pytest.mark.parametrize("strategy", both_gdr())
@pytest.mark.parametrize("failure", [pytest.param(f, marks=pytest.mark.modes(failure=FAILURE_MODE[f])) for f in FAILURE_NAMES])
def test_gdr_failed_update_cleans_its_handle_up(loader, ct_trainer, failure, strategy):
    """After a successful update, an update failing this way cleans up the handle it streamed from (within
    2 s); the next update initializes a new handle and loads."""
    session, _, _ = _loaded(loader, ct_trainer, strategy=strategy)
    [(name, stream, prepare, error)] = [f for f in _handle_failures(session) if f[0] == failure]
    handle = ct_trainer.of("hello")[-1]["handle"]
    ct_trainer.serve(stream)
    if prepare:
        prepare()
    where = f"{strategy} update failing: {name}"
    with check.raises(error, match=".", where=where):
        session.update()
    session.models[0].load_weights.fail_at = None
    check.that(ct_trainer.wait_for(lambda: any(u["handle"] == handle for u in ct_trainer.of("unregister")), 2.0),
               f"{where}: the handle {handle} it streamed from was not cleaned up")
    v = M.state(SPEC_MTP, version=3)
    ct_trainer.serve(S.stream_of(v))
    session.update()
    check.params_equal(session.observe(), v, f"{where}: the next update")
    fresh = ct_trainer.of("hello")[-1]["handle"]
    check.that(fresh != handle and ct_trainer.of("register")[-1]["handle"] == fresh,
               f"{where}: the next update streamed from handle {fresh}, expected a new one (not {handle})")
