"""One simulator trainer per inference rank, driven by the orchestrator (``sim.ranks``) over ZMQ.

Each trainer publishes its rank's shard of every version it is asked for, on one path:

* ``snapshot``: the part files ``model_state.tp{rank}.{gpu}.part{N}.pdparams`` (safetensors) and
  ``version.yaml`` in the model directory;
* ``meta``: one shared-memory segment holding every tensor, and ``ipc_metas_{gpu}`` plus
  ``version.yaml`` in the shared directory (``sim.trainer.MetaTrainer``);
* ``bucket``: two bucket buffers and a ROUTER socket (``sim.trainer.BucketTrainer``), serving the next
  worker that says hello from a thread.

Requests (msgpack over a REP socket): ``publish`` {version, fault} answers ``published`` with the
sha256 of every tensor of the shard as sent (bucket: once armed, before the worker connects); ``exit``.
Faults: ``missing`` (snapshot, meta: the shard is not there; bucket: its last tensor is left out),
``partial`` (every path: the shard is published whole but for its last tensor, files and metas well formed),
``bad-dtype`` (its last tensor in float64), ``kill`` (the trainer dies: mid-write of its last part,
after publishing its segment, or while packing bucket 1), ``stall`` (bucket: never answers the
worker) and ``slow`` (bucket, healthy: a pause before every message). ``served`` answers, for the
bucket path, when each update's closing message went out (``t_end``, wall clock). The weights of (rank, version) are ``fixtures.models.state(spec, seed=rank, version)``, so
every rank's shard differs from every other's.
"""
from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time

import numpy as np
import zmq

from weightsync.wire import protocol

from . import interrupt
from .trainer import BucketTrainer, MetaTrainer

FAULTS = ("missing", "partial", "bad-dtype", "kill", "stall", "slow")


def shard(spec, rank: int, version: int, fault: str | None, fast: bool = False) -> dict[str, np.ndarray]:
    """The shard of (rank, version); ``fast``: random bytes instead of ``fixtures.models`` values
    (benchmarks: generating values for hundreds of MiB takes seconds)."""
    if fast:
        from weightsync.fixtures.models import NUMPY_DTYPES

        rng = np.random.default_rng([rank, version])
        st = {p.name: np.frombuffer(rng.bytes(p.nbytes), np.uint8).view(NUMPY_DTYPES[p.dtype]).reshape(p.shape)
              for p in sorted(spec.all_params, key=lambda p: p.name)}
    else:
        from weightsync.fixtures.models import state

        st = dict(sorted(state(spec, seed=rank, version=version).items()))
    last = list(st)[-1]
    if fault == "partial":  # a well-formed shard that lacks its last tensor: nothing fails before the commit's check
        del st[last]
    if fault == "bad-dtype":
        st[last] = st[last].astype(np.float64 if st[last].dtype != np.float64 else np.float32)
    return st


def hashes(st) -> dict[str, str]:
    return {n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in st.items()}


def write_version(directory: str, version: int) -> None:
    path = os.path.join(directory, "version.yaml")
    with open(path + f".{os.getpid()}.tmp", "w", encoding="utf-8") as f:
        f.write(f"step: {version}\n")
    os.replace(path + f".{os.getpid()}.tmp", path)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class SnapshotShard:
    def __init__(self, model_dir: str, rank: int, gpu: int, parts: int = 3):
        self.model_dir, self.rank, self.gpu, self.parts = model_dir, rank, gpu, parts

    def _mine(self) -> list[str]:
        prefix = f"model_state.tp{self.rank}.{self.gpu}."
        return [n for n in os.listdir(self.model_dir) if n.startswith(prefix)]

    def publish(self, st, version: int, fault: str | None) -> None:
        import safetensors.numpy

        for name in self._mine():
            os.remove(os.path.join(self.model_dir, name))
        write_version(self.model_dir, version)
        if fault == "missing":
            return
        names = list(st)
        k = min(self.parts, len(names))
        for i in range(k):
            path = os.path.join(self.model_dir, f"model_state.tp{self.rank}.{self.gpu}.part{i}.pdparams")
            data = safetensors.numpy.save({n: st[n] for n in names[i::k]})
            if fault == "kill" and i == k - 1:
                with open(path, "wb") as f:  # killed mid-write: the worker finds half a file
                    f.write(data[: len(data) // 2])
                    f.flush()
                _die()
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class MetaShard:
    def __init__(self, shared_dir: str, gpu: int):
        self.shared_dir = shared_dir
        self.trainer = MetaTrainer(shared_dir, gpu)

    def publish(self, st, version: int, fault: str | None) -> None:
        self.trainer.release()
        if os.path.exists(self.trainer.path):
            os.remove(self.trainer.path)
        write_version(self.shared_dir, version)
        if fault == "missing":
            return
        self.trainer.publish(st)
        if fault == "kill":
            _die()  # its memory is freed by whoever reaps it (the orchestrator sweeps its segments)

    def close(self) -> None:
        self.trainer.close()

    def abandon(self) -> None:
        self.trainer.release()


class PacedBucketTrainer(BucketTrainer):
    """A bucket trainer that can pause before each message and notes when its end message went out."""

    pause_s = 0.0
    ends: list

    def _send(self, ident: bytes, message: dict) -> None:
        if self.pause_s:
            time.sleep(self.pause_s)
        if message.get("type") == protocol.END:
            self.ends.append({"version": message.get("version"), "t_end": time.time()})
        super()._send(ident, message)


class BucketShard:
    def __init__(self, endpoint: str, bucket_bytes: int, timeout_s: float, pause_s: float):
        self.trainer = PacedBucketTrainer(endpoint, bucket_bytes, timeout_s)
        self.trainer.ends = []
        self.pause_s = pause_s
        self.thread: threading.Thread | None = None
        self.error: str | None = None

    def publish(self, st, version: int, fault: str | None) -> None:
        self.wait()
        if fault == "stall":
            return
        if fault == "missing":
            st = dict(list(st.items())[:-1])
        self.trainer.pause_s = self.pause_s if fault == "slow" else 0.0

        def serve():
            try:
                self.trainer.publish(st, version, kill_at_bucket=1 if fault == "kill" else None)
            except Exception as e:  # noqa: BLE001 (a rejected update is the worker's verdict)
                self.error = f"{type(e).__name__}: {e}"

        self.thread = threading.Thread(target=serve, name=f"bucket-serve-{version}", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join(self.trainer.timeout_s + 5)
            self.thread = None

    def close(self) -> None:
        self.wait()
        self.trainer.close()

    def abandon(self) -> None:
        """Unlink the buffers' names (the process exits next: its mappings go with it)."""
        for seg in self.trainer.segments:
            seg.unlink()


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwind through finally: segments are unlinked


def serve(config: dict) -> None:
    """Process entry point (spawned): ``config`` is plain data (JSON-able)."""
    from weightsync.fixtures.models import spec as make_spec

    # SIGINT ignored (a terminal's Ctrl-C reaches the orchestrator's whole group; it stops the trainers), SIGTERM
    # unwinds (segments unlinked), and SIGTERM comes by itself if the orchestrator dies.
    interrupt.trainer_signals(_on_sigterm, config.get("parent") or os.getppid())
    spec = make_spec(*(tuple(p[:2]) + (tuple(p[2]),) for p in config["params"]))
    rank, path = config["rank"], config["path"]
    if path == "snapshot":
        source = SnapshotShard(config["model_dir"], rank, config["gpu"])
    elif path == "meta":
        from .ipc_handles import phi_dtype_codes

        phi_dtype_codes()  # Paddle imported now, not inside the first update
        interrupt.install_sigterm(_on_sigterm)  # Paddle's import set a C handler that dumps a stack and dies
        source = MetaShard(config["shared_dir"], config["gpu"])
    else:
        source = BucketShard(config["endpoint"], config["bucket_bytes"], config["timeout_s"], config["slow_pause_s"])
    control = zmq.Context.instance().socket(zmq.REP)
    control.setsockopt(zmq.LINGER, 0)
    control.bind(config["control"])
    try:
        while True:
            request = protocol.decode(control.recv(), "orchestrator request", allowed=("publish", "served", "exit"))
            if request["type"] == "exit":
                control.send(protocol.encode({"type": "bye"}))
                return
            if request["type"] == "served":
                source.wait()
                control.send(protocol.encode({"type": "served", "served": list(source.trainer.ends)}))
                continue
            version, fault = request["version"], request.get("fault")
            st = shard(spec, rank, version, fault, config.get("fast_fill", False))
            sent = hashes(st)
            source.publish(st, version, fault)
            control.send(protocol.encode({"type": "published", "version": version, "hashes": sent}))
    except SystemExit:
        # SIGTERM (stopped, or the orchestrator died): a serving thread may wait on ranks that are gone for
        # minutes, so unlink what this trainer created and leave now instead of joining it.
        source.abandon()
        sys.stdout.flush()
        os._exit(143)
    finally:
        source.close()
        control.close()
        sys.stdout.flush()
