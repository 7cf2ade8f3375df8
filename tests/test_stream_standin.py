"""The CheckpointTransfer stand-in (sim.checkpoint_transfer, sim.stream_trainer, sim.stream_wire) itself:
what the conformance rules take for granted about it."""
from __future__ import annotations

import asyncio
import importlib.util
import pickle
import shutil

import pytest

from fixtures import models as M
from sim import checkpoint_transfer as ct
from sim import stream_wire as wire
from sim.stream_trainer import Stream, StreamTrainer, patterned_state, serve_process, stream_of
from tests.conftest import REPO

SPEC = M.spec(("a.w", "bfloat16", (3, 4)), ("b", "float32", ()), ("c", "int64", (0, 4)), ("d", "float8_e4m3fn", (5,)))


def _bytes(tensor) -> bytes:
    return tensor.numpy().tobytes()


def test_never_shadows_a_real_installation():
    """Nothing this repository puts on sys.path is importable as checkpoint_transfer (only the FastDeploy
    adapter maps the name, in sys.modules, when no real library imports)."""
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("checkpoint_transfer")
    assert spec is None or not str(spec.origin).startswith(REPO), f"checkpoint_transfer found in the repository: {spec}"
    assert importlib.util.find_spec("sim.checkpoint_transfer") is not None
    assert ct.STANDIN is True


def test_install_as_library_maps_the_name_only_where_no_real_library_imports():
    """The worker imports `checkpoint_transfer`: the stand-in is mapped there, submodules included, unless a
    real (non-stand-in) module already holds the name, which is never replaced."""
    import types

    modules = {}
    assert ct.install_as_library(modules) is True
    assert modules["checkpoint_transfer"] is ct
    assert {name: modules[f"checkpoint_transfer.{name}"].__name__ for name in ("config", "transfer", "core")} == {
        name: f"sim.checkpoint_transfer.{name}" for name in ("config", "transfer", "core")}
    real = types.ModuleType("checkpoint_transfer")
    modules = {"checkpoint_transfer": real}
    assert ct.install_as_library(modules) is False
    assert modules == {"checkpoint_transfer": real}, "a real library was replaced by the stand-in"
    stub = types.ModuleType("checkpoint_transfer")
    stub.__conformance_stub__ = True  # the FastDeploy adapter's import stub is not a library
    modules = {"checkpoint_transfer": stub}
    assert ct.install_as_library(modules) is True and modules["checkpoint_transfer"] is ct


def test_initialize_and_cleanup_work_called_plainly_and_through_asyncio_run():
    state = M.state(SPEC, version=2)
    with StreamTrainer() as trainer:
        trainer.serve(stream_of(state), stream_of(state))
        plain = ct.CheckpointTransfer(endpoint=trainer.endpoint, local_rank=3, group_size=4)
        plain.initialize()  # rsync calls it without awaiting: no coroutine is left un-awaited
        got = {name: _bytes(t) for name, t in plain.receive_stream(step_id=7, verify_checksum=True)}
        assert got == {n: a.tobytes() for n, a in state.items()}
        plain.cleanup()
        config = ct.TransferConfig(role=ct.Role.INFERENCE, global_rank=5, endpoint=trainer.endpoint)
        awaited = ct.CheckpointTransfer(config)
        asyncio.run(awaited.initialize())
        assert [i.name for i in awaited.receive_weights_sync("8", output_framework="numpy")] == list(state)
        asyncio.run(awaited.cleanup())
        assert trainer.wait_for(lambda: len(trainer.of("unregister")) == 2)
    registers = trainer.of("register")
    assert [(r["config"]["global_rank"], r["config"]["group_size"]) for r in registers] == [(3, 4), (5, 1)]
    assert [h["step_id"] for h in trainer.of("hello")] == ["7", "8"]


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="etcd_server"):
        ct.CheckpointTransfer(endpoint="ipc:///nowhere", etcd_server="x")


@pytest.mark.parametrize("fault, error", [(("fail", 1), ConnectionError), (("cancel", 1), asyncio.CancelledError),
                                          (("stall", 1), TimeoutError), (("hang", 1), TimeoutError)])
def test_faults_as_scripted(fault, error):
    state = M.state(SPEC, version=1)
    with StreamTrainer() as trainer:
        trainer.serve(Stream(list(state.items()), fault=fault), stream_of(state))
        handle = ct.CheckpointTransfer(endpoint=trainer.endpoint, recv_bucket_timeout_s=1.0, session_total_timeout_s=3.0)
        handle.initialize()
        with pytest.raises(error):
            list(handle.receive_weights_sync("1"))
        assert trainer.wait_for(lambda: [b["received"] for b in trainer.of("bye")] == [1])
        assert [i.name for i in handle.receive_weights_sync("1")] == list(state), "the handle serves the next stream"
        handle.cleanup()


def test_early_end_is_not_an_error():
    state = M.state(SPEC, version=1)
    with StreamTrainer() as trainer:
        trainer.serve(Stream(list(state.items()), fault=("end", 2)))
        handle = ct.CheckpointTransfer(endpoint=trainer.endpoint)
        handle.initialize()
        assert [i.name for i in handle.receive_weights_sync("1")] == list(state)[:2]
        handle.cleanup()


def test_wire_refuses_a_pickle():
    frame = pickle.dumps({"type": "item", "proto": wire.PROTO})
    with pytest.raises(wire.WireError, match="msgpack"):
        wire.decode(frame, "test", wire.TRAINER_TYPES)


def test_trainer_in_its_own_process_streams_bit_exact():
    """The simulator's trainer process (spawn): what the benchmark streams from."""
    spec = M.spec(("x.w", "float32", (1000,)), ("y.w", "uint8", (333,)))
    proc, endpoint, directory = serve_process(spec, 2, seed=3)
    try:
        handle = ct.CheckpointTransfer(endpoint=endpoint, recv_bucket_timeout_s=30.0)
        handle.initialize()
        want = patterned_state(spec, 3)

        async def pump():
            return {item.name: _bytes(item.tensor) async for item in handle.receive_weights("1")}

        assert asyncio.run(pump()) == {n: a.tobytes() for n, a in want.items()}
        handle.cleanup()
    finally:
        proc.terminate()
        proc.join(10)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cleanup_from_another_thread_never_races_the_receiving_one(mode):
    """cleanup() from the loader's thread while the receiving thread waits, sends its next request or says
    bye (the reference's failure path: stop the receiver, clean the handle up, join): libzmq sockets are not
    thread-safe, so an unguarded close there aborts the process now and then (a zero per-item wait makes the
    loader clean up while the receiver sends its hello). 60 rounds, the cleanup at a different moment of the
    stream each time (at once, or after 0-50 busy microseconds, or 1-9 ms); the receiver always ends with an
    error, never a crash."""
    import threading
    import time

    state = M.state(SPEC, version=1)
    with StreamTrainer() as trainer:
        for round_ in range(60):
            trainer.serve(Stream(list(state.items()), pause_s=0.002, fault=("stall", 3)))
            handle = ct.CheckpointTransfer(endpoint=trainer.endpoint, recv_bucket_timeout_s=5.0)
            handle.initialize()
            outcome = {}

            def receive():
                import paddle

                paddle.disable_static()  # dynamic mode is per thread: the stand-in yields Paddle tensors
                try:
                    if mode == "sync":
                        for _ in handle.receive_weights_sync("1"):
                            pass
                    else:
                        async def pump():
                            async for _ in handle.receive_weights("1"):
                                pass
                        asyncio.run(pump())
                except BaseException as e:  # noqa: BLE001 (judged below)
                    outcome["error"] = e

            thread = threading.Thread(target=receive)
            thread.start()
            if round_ % 3 == 1:
                end = time.perf_counter() + 1e-5 * (round_ % 6)
                while time.perf_counter() < end:
                    pass
            elif round_ % 3 == 2:
                time.sleep(0.001 * (round_ % 10))
            handle.cleanup()
            thread.join(5.0)
            assert not thread.is_alive(), f"round {round_}: the receiving thread still waits 5 s after cleanup()"
            assert isinstance(outcome.get("error"), (ConnectionAbortedError, RuntimeError)), \
                f"round {round_} ({mode}): the receiver ended with {outcome!r}, expected the cleanup's error"
