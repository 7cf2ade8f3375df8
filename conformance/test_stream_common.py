"""What both streamed paths (rsync, GDR) owe whatever the library does: options checked first, nothing left
behind, the identity of open handed to the library. Spec: SPEC.md § STREAM (STREAM-HANG-BOUNDED:
test_stream_timing.py).
"""
import asyncio
import time

import pytest

from conformance import check
from conformance import modes
from conformance.harness import Worker
from conformance.stream_support import case, ct_trainer, open_stream, socket_fds  # noqa: F401
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S

pytestmark = pytest.mark.streams

SPEC = M.spec(("model.layers.0.q.weight", "bfloat16", (4, 4)), ("model.layers.1.mlp.weight", "float32", (4, 8)),
              ("model.norm.weight", "float16", (4,)))
SPEC_MTP = M.spec(*((p.name, p.dtype, p.shape) for p in SPEC.main), mtp=[(("mtp_block.0.w", "float32", (4,)),)])


def _failures(strategy, session, state):
    """(name, stream, prepare, (exception type, pattern, names)) of the failing updates each path goes
    through, each with what it must raise: the library's ConnectionError and cancellation (RSYNC/GDR
    stream rules), rsync's one ValueError `Invalid new_state_dict` for a shape mismatch (RSYNC-VALIDATE-ALL), the model
    loader's own RuntimeError."""
    def loader_breaks():
        session.models[0].load_weights.fail_at = 1

    broken = [("stream breaks mid-way", S.stream_of(state, fault=("fail", 1)), None, (ConnectionError, "broke", [])),
              ("stream cancelled", S.stream_of(state, fault=("cancel", 2)), None,
               ((asyncio.CancelledError, RuntimeError), "(?i)cancel", []))]
    if strategy == "rsync":
        return broken + [("shape mismatch", S.stream_of({**state, "model.norm.weight": state["model.norm.weight"].reshape(2, 2)}),
                          None, (ValueError, r"Invalid new_state_dict", []))]
    return broken + [("loader fails", S.stream_of(state), loader_breaks, (RuntimeError, r"loader failed", []))]


@pytest.mark.rule("STREAM-NO-LEAK")
@pytest.mark.modes(outcome=("success", "rejected"))
@pytest.mark.parametrize("strategy", [case("rsync"), case("gdr"), case("gdr_ipc")])
def test_nothing_left_after_close(loader, ct_trainer, strategy):
    """A success, each kind of failure, a success, then close(): no thread or socket of the session is
    left, and every library handle it initialized was cleaned up."""
    state = M.state(SPEC, version=2)
    # The default per-item wait: none of these failures is a stall, and the updates that must succeed may not race
    # a short wait on a loaded machine.
    session, _ = open_stream(loader, ct_trainer, SPEC, strategy)
    failures = _failures(strategy, session, state)
    ct_trainer.serve(S.stream_of(state), *(stream for _, stream, _, _ in failures), S.stream_of(state))
    threads, sockets = check.live_threads(), socket_fds()  # the trainer's own already among them
    session.update()
    for name, _, prepare, (error, match, names) in failures:
        if prepare:
            prepare()
        with check.raises(error, match=match, names=names, where=f"{strategy}: {name}"):
            session.update()
        session.models[0].load_weights.fail_at = None
    session.update()
    check.params_equal(session.observe(), state, f"{strategy}: after the failures")
    session.close()
    where = f"{strategy}: after close()"
    check.no_new_threads(threads, where)
    deadline = time.monotonic() + 2.0
    while socket_fds() > sockets and time.monotonic() < deadline:
        time.sleep(0.02)
    check.that(socket_fds() <= sockets, f"{where}: {socket_fds()} socket descriptors, {sockets} before the first update")
    registered = {r["handle"] for r in ct_trainer.of("register")}
    check.that(ct_trainer.wait_for(lambda: registered <= {u["handle"] for u in ct_trainer.of("unregister")}, 2.0),
               f"{where}: handles never cleaned up: {sorted(registered - {u['handle'] for u in ct_trainer.of('unregister')})}")


# -- STREAM-IDENTITY-AT-OPEN -----------------------------------------------------------------------
OPENED = Worker(rank=3, visible="0,1,2,3", selected="2")  # ordinal 2 (physical GPU 2), global rank 3, of a world of 4
OPENED_WORLD = 4
LIVE = {  # the environment the update runs in: another device only, another world size only, both
    "device": {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "FLAGS_selected_gpus": "1"},
    "world": {"PADDLE_TRAINERS_NUM": "8"},
    "both": {"CUDA_VISIBLE_DEVICES": "6,7", "FLAGS_selected_gpus": "0", "PADDLE_TRAINERS_NUM": "2"},
}
GDR_INDEX = 1  # GDR's global_rank is index x world size + ordinal: the world size shows in it too


def _identity_of_open(strategy) -> tuple[dict, tuple[int, int]]:
    """(rsync_config keys beyond the trainer's, the (global_rank, group_size) of OPENED the library must be given):
    rsync's local_rank and GDR's IPC mode take the ordinal, GDR index x world + ordinal; group_size is the world."""
    ordinal = int(OPENED.selected)
    if strategy == "gdr":
        return {"index": GDR_INDEX}, (GDR_INDEX * OPENED_WORLD + ordinal, OPENED_WORLD)
    return {}, (ordinal, OPENED_WORLD)


def _judge_identity(session, trainer, result, want_state, want, where) -> None:
    """Every handle registered with ``want`` (global_rank, group_size), every stream asked for as its rank, the rank
    update() returned (where it returns one) the ordinal of open, and every tensor bit for bit."""
    check.params_equal(session.observe(), want_state, where)
    registered = [(r["config"]["global_rank"], r["config"]["group_size"]) for r in trainer.of("register")]
    check.that(registered, f"{where}: no handle was registered with the trainer")
    check.equal(registered, [want] * len(registered),
                f"{where}: (global_rank, group_size) of each handle the library was created with, opened as {want}")
    asked = [h["rank"] for h in trainer.of("hello")]
    check.equal(asked, [want[0]] * len(asked), f"{where}: the rank each stream was asked for as")
    if isinstance(result, dict) and "rank" in result:
        check.equal(result["rank"], int(OPENED.selected), f"{where}: the rank update() returned (the ordinal of open)")


@pytest.mark.rule("STREAM-IDENTITY-AT-OPEN")
@pytest.mark.parametrize("live", list(LIVE))
@pytest.mark.parametrize("combo", modes.params("STREAM-IDENTITY-AT-OPEN"))
def test_session_hands_the_library_the_identity_of_open(loader, ct_trainer, monkeypatch, combo, live):
    """Opened as ordinal 2 of CUDA_VISIBLE_DEVICES=0,1,2,3 (global rank 3) of a world of 4, then the environment
    names another device, another world size or both (the test's monkeypatch restores it): the update at the first
    load, or in place after a first load made before the change (and, after a broken stream, the next one), hands
    the library the identity of open and loads what it streamed."""
    strategy = combo["path"]
    extra, want = _identity_of_open(strategy)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(OPENED_WORLD))
    session, _ = open_stream(loader, ct_trainer, SPEC, strategy, worker=OPENED, **extra)
    where = (f"{strategy}, opened as FLAGS_selected_gpus=2 of CUDA_VISIBLE_DEVICES=0,1,2,3, world size 4, then the "
             f"environment changed to {LIVE[live]}")

    def change_environment():
        for key, value in LIVE[live].items():
            monkeypatch.setenv(key, value)

    v1, v2, v3 = (M.state(SPEC, version=v) for v in (1, 2, 3))
    if combo["call"] == "first":
        ct_trainer.serve(S.stream_of(v1))
        change_environment()
        _judge_identity(session, ct_trainer, session.update(), v1, want, f"{where}: the first load")
        return
    ct_trainer.serve(S.stream_of(v1), S.stream_of(v2), S.stream_of(v3, fault=("fail", 0)), S.stream_of(v3))
    session.update()
    check.params_equal(session.observe(), v1, f"{where}: the first load, before the change")
    change_environment()
    _judge_identity(session, ct_trainer, session.update(), v2, want, f"{where}: the second update, in place")
    with check.raises(ConnectionError, match=".", where=f"{where}: a stream broken before its first item"):
        session.update()
    _judge_identity(session, ct_trainer, session.update(), v3, want,
                    f"{where}: the update after the broken stream, in place (its handle, if new)")


# -- STREAM-OPTIONS --------------------------------------------------------------------------------
def _bad_options(strategy):
    """(what, rsync_config edit (None: no rsync_config at all), other options, the name the error must carry)."""
    common = [("no rsync_config", None, {}, "rsync_config"), ("rsync_config a str", "x", {}, "rsync_config")]
    common += [(f"recv_bucket_timeout_s {v!r}", {"recv_bucket_timeout_s": v}, {}, "recv_bucket_timeout_s")
               for v in (0, -1.0, float("nan"), True, "1")]
    if strategy == "rsync":
        return common + [("verify_checksum a str", {}, {"verify_checksum": "yes"}, "verify_checksum")]
    gdr = [(f"{k} {v!r}", {k: v}, {}, k) for k, v in (("gdr_mtp_chunk_size", "x"), ("gdr_prefetch_queue_size", "2.5"),
                                                       ("index", "one"), ("group_size", "eight"))]
    return common + gdr + ([("qsize 'x'", {"qsize": "x"}, {}, "qsize")] if strategy == "gdr_ipc" else [])


@pytest.mark.rule("STREAM-OPTIONS")
@pytest.mark.parametrize("strategy", [case("rsync"), case("gdr"), case("gdr_ipc")])
def test_options_checked_before_the_trainer_hears_of_them(loader, ct_trainer, strategy):
    state = M.state(SPEC, version=1)
    S.publish_version(loader.model_dir, "1")  # every session below is opened with version 1
    ct_trainer.serve()  # answering: a loader that connects anyway is seen at once
    for what, edit, other, name in _bad_options(strategy):
        options = dict(other, version="1")
        if edit is not None:
            options["rsync_config"] = edit if isinstance(edit, str) else {**S.rsync_config(ct_trainer), **edit}
        session = loader.open(SPEC, strategy=strategy, options=options)
        S.attach_loaders(session.models)
        where = f"{strategy}, {what}"
        with check.raises(ValueError, match=".", names=[name], where=where):
            session.update()
        check.equal(ct_trainer.of("register"), [], f"{where}: what the trainer heard")
        check.not_loaded(session.observe(), list(state), where)
    if strategy != "rsync":  # a model GDR cannot load into
        session = loader.open(SPEC_MTP, strategy=strategy, options={"rsync_config": S.rsync_config(ct_trainer), "version": "1"})
        S.attach_loaders(session.models[:1])
        with check.raises(TypeError, match=".", names=["load_weights"], where=f"{strategy}, an MTP model without load_weights"):
            session.update()
        check.equal(ct_trainer.of("register"), [], f"{strategy}, an MTP model without load_weights: what the trainer heard")
    # only the trainer's address: the library's default wait, and the update loads
    ct_trainer.serve(S.stream_of(state))
    session = loader.open(SPEC, strategy=strategy, options={"rsync_config": {"endpoint": ct_trainer.endpoint}, "version": "1"})
    S.attach_loaders(session.models)
    session.update()
    check.params_equal(session.observe(), state, f"{strategy} with rsync_config {{'endpoint': ...}} only")
