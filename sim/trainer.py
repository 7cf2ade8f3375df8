"""Fake trainer processes: deterministic weights published to a worker through buckets or a meta file.

One process per rank (``multiprocessing`` spawn context; no Paddle needed on the bucket path). The
weights of (model spec, seed, version) come from ``fixtures.models.state``, so the orchestrator can
recompute exactly what was sent. Status goes to the orchestrator as msgpack over a ZMQ PUSH socket;
nothing is pickled except what ``multiprocessing`` itself needs to start the process.

Bucket path: :class:`BucketTrainer` binds a ROUTER socket and, per update, answers the worker's
hello with bucket manifests (``wire.protocol``), packing bucket k+1 into the other buffer while the
worker copies bucket k. Meta path: :class:`MetaTrainer` writes ``ipc_metas_{gpu}`` (7-field metas,
``sim.ipc_handles.share_array``) and keeps the segment until the orchestrator releases it.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import zmq

from weightsync.reference import digest  # the digest both ends compute (SPEC.md § DIGEST); it needs no Paddle
from weightsync.wire import protocol
from weightsync.wire.handles import SHM_DIR, Segment

from . import interrupt

log = logging.getLogger("sim.trainer")


def sweep_segments(pid: int) -> list[str]:
    """Unlink the segments a (dead) process created; a SIGKILLed trainer cannot unlink its own."""
    prefix = f"wscf_{pid}_"
    gone = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
            except FileNotFoundError:
                pass
    return gone


@dataclass(frozen=True)
class TrainerConfig:
    rank: int
    model: object  # fixtures.models.ModelSpec
    endpoint: str  # where this trainer binds (bucket path) or answers control requests (meta path)
    status: str  # orchestrator's PULL endpoint
    versions: tuple[int, ...]
    bucket_bytes: int = 16 << 20
    seed: int = 0
    path: str = "bucket"  # "bucket" | "meta"
    shared_dir: str = ""  # meta path: where ipc_metas_{gpu_id} is written
    gpu_id: int = 0
    timeout_s: float = 60.0  # how long to wait for the worker
    kill_at: tuple[int, int] | None = None  # (version, bucket): SIGKILL self while packing that bucket
    fast_fill: bool = False  # random bytes instead of fixtures.models values (benchmarks: generation is slow)
    report_digests: bool | tuple[int, ...] = True  # send the model digest of what was sent (True: every version)
    hold_at: tuple | None = None  # (version, "bucket", k) or (version, "end"): pause there (sim.interrupt.hold)


def make_state(cfg: TrainerConfig, version: int) -> dict[str, np.ndarray]:
    if cfg.fast_fill:
        from weightsync.fixtures.models import NUMPY_DTYPES

        rng = np.random.default_rng([cfg.seed, version])
        out = {}
        for p in cfg.model.all_params:
            dt = NUMPY_DTYPES[p.dtype]
            raw = np.frombuffer(rng.bytes(p.nbytes), np.uint8)
            out[p.name] = ((raw % 2).astype(np.bool_) if p.dtype == "bool" else raw.view(dt)).reshape(p.shape)
        return out
    from weightsync.fixtures.models import state

    return state(cfg.model, seed=cfg.seed, version=version)


def array_hashes(name: str, arr, algorithms=digest.DEFAULT_ALGORITHMS) -> dict[str, str]:
    """The trainer's side of ``reference.digest.tensor_hashes``: a numpy array of any layout (a
    transposed view, a big-endian array) digests as its elements in C order, little-endian. Only a
    non-contiguous or big-endian array is copied; a C-contiguous one is hashed in place."""
    arr = np.asarray(arr)
    if arr.dtype.hasobject:
        raise ValueError(f"tensor {name!r} holds Python objects ({arr.dtype}), not numbers: it has no bytes to digest")
    shape = arr.shape
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return digest.tensor_hashes(name, arr.dtype.name, shape, arr.reshape(-1).view(np.uint8), algorithms)


def state_digest(state: Mapping[str, np.ndarray], algorithms=digest.DEFAULT_ALGORITHMS) -> digest.ModelDigest:
    """The model digest of what a trainer sends (name -> numpy array)."""
    algorithms = tuple(algorithms)
    return digest.model_digest({n: array_hashes(n, a, algorithms) for n, a in state.items()}, algorithms)


class BucketTrainer:
    """Two shared-memory buffers and a ROUTER socket; :meth:`publish` serves one update."""

    def __init__(self, endpoint: str, bucket_bytes: int, timeout_s: float = 60.0):
        self.endpoint = endpoint
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.segments: list[Segment] = []
        self.sock = None
        try:
            self.segments = [Segment.create(bucket_bytes), Segment.create(bucket_bytes)]
            self.sock = zmq.Context.instance().socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # receiver messages are tiny
            self.sock.bind(endpoint)
        except BaseException:
            self.close()
            raise

    def _recv(self, ident: bytes | None, where: str) -> tuple[bytes, dict]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not interrupt.sliced(self._poll, left):
                raise protocol.TransferTimeout(f"trainer at {self.endpoint}: no {where} from the worker within {self.timeout_s:g}s")
            frames = self.sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                continue  # not a REQ peer
            peer, frame = frames[0], frames[2]
            message = protocol.decode(frame, f"worker message ({where})", allowed=protocol.RECEIVER_TYPES)
            if ident is None or peer == ident:
                return peer, message
            # Another worker while one update is in flight: refuse it instead of mixing the two.
            self._send(peer, protocol.abort(message.get("version") or 0, "trainer busy with another worker"))

    def _poll(self, seconds: float) -> bool:
        return bool(self.sock.poll(int(seconds * 1000)))

    def _send(self, ident: bytes, message: dict) -> None:
        self.sock.send_multipart([ident, b"", protocol.encode(message)])

    def _pack(self, k: int, layout, flat: Mapping[str, np.ndarray], kill: bool) -> None:
        if kill and k > 0:
            # Die only once manifest k-1 surely arrived (its ack is waiting), so the worker's error
            # names bucket k; a SIGKILL right after send() could lose the queued manifest.
            interrupt.sliced(self._poll, self.timeout_s)
        dst = np.frombuffer(self.segments[k % 2].buf, np.uint8)
        try:
            for i, p in enumerate(layout[k]):
                if kill and i >= max(1, len(layout[k]) // 2):
                    os.kill(os.getpid(), signal.SIGKILL)  # die mid-bucket, as a crashed trainer would
                if p.nbytes:
                    np.copyto(dst[p.offset : p.offset + p.nbytes], flat[p.name][p.chunk_offset : p.chunk_offset + p.nbytes])
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            # A SIGTERM mid-copy unwinds with this frame in its traceback: a view left here would keep
            # the mapping exported and close() would fail.
            del dst

    def publish(self, state: Mapping[str, np.ndarray], version: int, kill_at_bucket: int | None = None,
                on_bucket: Callable[[int], None] | None = None, hold: tuple | None = None) -> int:
        """Serve one update of ``state`` as ``version`` to the next worker that says hello; returns
        the number of buckets. Raises if the worker rejects the update or goes silent. ``hold``:
        ``("bucket", k)`` pauses before manifest k, ``("end",)`` before the end message."""
        layout = protocol.plan_layout([(n, a.nbytes) for n, a in state.items()], self.bucket_bytes)
        flat = {n: np.ascontiguousarray(a).reshape(-1).view(np.uint8) for n, a in state.items()}
        dtypes = {n: a.dtype.name for n, a in state.items()}
        shapes = {n: a.shape for n, a in state.items()}
        ident, hello = self._recv(None, "hello")
        if hello["type"] != protocol.HELLO:
            raise RuntimeError(f"trainer at {self.endpoint}: expected hello, got {hello['type']}")
        if hello.get("version") not in (None, version):
            self._send(ident, protocol.abort(version, f"worker expects version {hello['version']}, trainer has {version}"))
            raise RuntimeError(f"worker expects version {hello['version']}, trainer publishes {version}")
        if layout:
            self._pack(0, layout, flat, kill_at_bucket == 0)
        for k in range(len(layout)):
            if hold == ("bucket", k):
                interrupt.hold(f"bucket:{k}", f"trainer at {self.endpoint}, version {version}")
            seg = self.segments[k % 2]
            self._send(ident, protocol.bucket_manifest(version, k, seg.handle, layout[k], dtypes, shapes))
            if k + 1 < len(layout):
                # Bucket k-1, the last user of the other buffer, was acked before manifest k went out.
                self._pack(k + 1, layout, flat, kill_at_bucket == k + 1)
            _, reply = self._recv(ident, f"ack of bucket {k} of version {version}")
            if reply["type"] != protocol.ACK or reply.get("bucket") != k:
                raise RuntimeError(f"worker rejected bucket {k} of version {version}: {reply.get('message', reply)}")
            if on_bucket:
                on_bucket(k)
        if hold == ("end",):
            interrupt.hold("end", f"trainer at {self.endpoint}, version {version}")
        self._send(ident, protocol.end(version, len(layout), list(state)))
        _, reply = self._recv(ident, f"done of version {version}")
        if reply["type"] != protocol.DONE:
            raise RuntimeError(f"worker rejected version {version} at its end message: {reply.get('message', reply)}")
        return len(layout)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        for seg in self.segments:
            seg.unlink()  # first: the name must leave /dev/shm even if closing the mapping fails
            seg.close()
        self.segments = []


class MetaTrainer:
    """Meta-file path: one segment per version holding every tensor, described by ``ipc_metas_{gpu}``."""

    def __init__(self, shared_dir: str, gpu_id: int):
        self.path = os.path.join(shared_dir, f"ipc_metas_{gpu_id}")
        self.segment: Segment | None = None

    def publish(self, state: Mapping[str, np.ndarray]) -> str:
        from .ipc_handles import share_array

        self.release()
        offsets, cursor = {}, 0
        for name, arr in state.items():
            offsets[name] = cursor
            cursor = protocol.align_up(cursor + arr.nbytes)
        self.segment = Segment.create(max(cursor, protocol.ALIGN))
        metas = {name: share_array(self.segment, offsets[name], arr) for name, arr in state.items()}
        tmp = self.path + ".tmp"
        # The file format is a pickle by contract (paddle.save); the worker reads it with a
        # restricted unpickler that admits no globals. Plain lists, str and int need none.
        with open(tmp, "wb") as f:
            pickle.dump(metas, f, protocol=4)
        os.replace(tmp, self.path)  # the worker never sees a half-written file
        return self.path

    def release(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None

    def close(self) -> None:
        self.release()


def _status(sock, **message) -> None:
    sock.send(protocol.encode(message))


def _on_sigterm(signum, frame):
    # The names first: a worker that attached keeps its mapping, and an unwinding that overruns its deadline
    # (the kernel's SIGALRM, seen on a loaded CI machine) can no longer leave them in /dev/shm.
    sweep_segments(os.getpid())
    raise SystemExit(128 + signum)  # unwind through finally: sockets closed, mappings released


def trainer_main(cfg: TrainerConfig) -> None:
    """Process entry point (spawn). Publishes every version in ``cfg.versions`` in turn."""
    interrupt.trainer_signals(_on_sigterm, multiprocessing.parent_process().pid)
    interrupt.before_forced_exit(lambda: sweep_segments(os.getpid()))
    logging.basicConfig(level=logging.WARNING, format=f"[trainer {cfg.rank}] %(message)s")
    status = zmq.Context.instance().socket(zmq.PUSH)
    status.setsockopt(zmq.LINGER, 2000)  # deliver the last status before exiting
    status.connect(cfg.status)
    trainer = control = None
    try:
        if cfg.path == "bucket":
            trainer = BucketTrainer(cfg.endpoint, cfg.bucket_bytes, cfg.timeout_s)
        else:
            trainer = MetaTrainer(cfg.shared_dir, cfg.gpu_id)
            control = zmq.Context.instance().socket(zmq.REP)
            control.setsockopt(zmq.LINGER, 0)
            control.bind(cfg.endpoint)
        if cfg.path == "meta":
            from weightsync.wire.handles import phi_dtype_codes

            phi_dtype_codes()  # imports Paddle now rather than inside the first timed update
            interrupt.install_sigterm(_on_sigterm)  # Paddle's import set a C handler that dumps a stack and dies
        for version in cfg.versions:
            state = make_state(cfg, version)
            _status(status, type="ready", rank=cfg.rank, version=version, pid=os.getpid())
            if cfg.path == "bucket":
                kill = cfg.kill_at[1] if cfg.kill_at and cfg.kill_at[0] == version else None
                hold = tuple(cfg.hold_at[1:]) if cfg.hold_at and cfg.hold_at[0] == version else None
                buckets = trainer.publish(state, version, kill_at_bucket=kill, hold=hold)
            else:
                for expected in ("publish", "release"):
                    if not interrupt.sliced(lambda seconds: control.poll(int(seconds * 1000)), cfg.timeout_s):
                        raise protocol.TransferTimeout(f"trainer {cfg.rank}: no {expected} request within {cfg.timeout_s:g}s")
                    request = protocol.decode(control.recv(), "control request", allowed=(expected,))
                    if expected == "publish":
                        path = trainer.publish(state)
                        control.send(protocol.encode({"type": "published", "path": path, "version": request.get("version")}))
                    else:
                        trainer.release()
                        control.send(protocol.encode({"type": "released"}))
                buckets = 0
            sent = state_digest(state).as_dict() \
                if cfg.report_digests is True or version in (cfg.report_digests or ()) else None
            _status(status, type="sent", rank=cfg.rank, version=version, buckets=buckets, digest=sent)
            del state
    except BaseException as e:
        _status(status, type="failed", rank=cfg.rank, error=f"{type(e).__name__}: {e}")
        if not isinstance(e, SystemExit):
            print(f"trainer {cfg.rank}: {type(e).__name__}: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if control is not None:
            control.close()
        status.close()
