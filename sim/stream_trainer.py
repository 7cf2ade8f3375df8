"""The trainer end of the CheckpointTransfer stand-in: serves scripted weight streams and records
everything the receiving library told it.

A :class:`StreamTrainer` binds a ROUTER socket (a private ``ipc://`` endpoint by default) and answers the
library's requests (``sim.stream_wire``) from a thread of the process that made it, or from a process of
its own (:func:`serve_process`, used by benchmarks/prefetch.py). Each ``hello`` takes the next scripted
:class:`Stream`: its items, in order, one per request, then ``end``; or what its ``fault`` says instead:

============================  ===================================================================
``("fail", k)``               after k items, ``fail``: the library raises ConnectionError
``("stall", k)``              after k items, silence (the socket stays open): the library times out
``("cancel", k)``             after k items, ``cancel``: the library raises asyncio.CancelledError
``("end", k)``                after k items, ``end``: the stream ends early, without an error
``("hang", k)``               after k items, ``hang``: the library blocks with its own timeouts off
``("corrupt", k)``            item k's first byte flipped, its CRC-32 that of the true bytes
``("die-after-end", n)``      ``end`` after the n items, then the trainer is gone (socket closed)
============================  ===================================================================

k = len(items) is the phase "after the last item, before the end". ``pause_s`` sleeps before every
reply (a slow trainer); ``hold_before`` = k holds the stream before item k (a trainer stopped where a test
chooses: :attr:`Stream.holding` is set there, and it goes on once :attr:`Stream.release` is set; the other
receivers' streams are served meanwhile, as a real trainer serves each receiver on its own); ``step``,
when set, is the only step the stream answers (another gets ``fail`` naming both). Everything received is
kept in :attr:`events` (tensor bytes aside).
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import zmq

from . import stream_wire as wire

_WAKE_IDS = itertools.count()

FAULTS = ("fail", "stall", "cancel", "end", "hang", "corrupt", "die-after-end")
HOLD_MAX_S = 60.0  # a hold (``Stream.hold_before``) nobody lets go of ends by itself
HELD_POLL_MS = 5  # while a stream is held, how often its release is looked at


@dataclass
class Stream:
    items: Sequence[tuple[str, np.ndarray]]
    step: str | None = None
    fault: tuple | None = None
    pause_s: float = 0.0
    #: index -> seconds to sleep before that item only (a trainer slow at one point)
    pauses: Mapping[int, float] = field(default_factory=dict)
    #: hold before this item (or the end, at len(items)) until ``release`` is set (at most HOLD_MAX_S),
    #: ``holding`` set meanwhile
    hold_before: int | None = None
    holding: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        if self.fault is not None and (len(self.fault) != 2 or self.fault[0] not in FAULTS):
            raise ValueError(f"fault {self.fault!r}: expected (kind, k) with kind one of {FAULTS}")


def stream_of(state: Mapping[str, np.ndarray], **kwargs) -> Stream:
    return Stream(list(state.items()), **kwargs)


@dataclass
class _Open:
    script: Stream
    sent: int = 0
    silent: bool = False
    taken_at: float = 0.0  # time.monotonic() of the hello that took the script
    hold_until: float | None = None  # while held: when the hold ends by itself (HOLD_MAX_S)


class StreamTrainer:
    def __init__(self, endpoint: str | None = None, *, refuse: str | None = None):
        self.dir = None
        if endpoint is None:
            self.dir = tempfile.mkdtemp(prefix="wscf-ct-")  # short: unix socket paths are limited to ~107 bytes
            endpoint = f"ipc://{self.dir}/trainer.sock"
        self.endpoint = endpoint
        self.refuse = refuse
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        # close() wakes the serving loop at once through this pair (no polling interval to wait out)
        # unique per trainer: an id() is reused once its object is freed, and the freed trainer's pair may still
        # be bound (an unclosed trainer: "Address already in use" failed a zoo mutant's run once)
        self._wake_address = f"inproc://stream-trainer-{os.getpid()}-{next(_WAKE_IDS)}"
        self._wake = ctx.socket(zmq.PAIR)
        self._wake.bind(self._wake_address)
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events: list[dict] = []
        self.failure: BaseException | None = None
        self._scripts: list[Stream] = []
        self._open: dict[tuple[str, int], _Open] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # id(array) -> CRC-32: a stream served again is not checksummed again (scripts, and so their arrays,
        # live as long as the trainer: an id is never reused for another array meanwhile)
        self._crc: dict[int, int] = {}
        # (handle, stream) -> ident of the streams held (``Stream.hold_before``): a held stream waits for its
        # release without holding up the others, each receiver's stream served on its own as by a real trainer
        self._held: dict[tuple, bytes] = {}
        self._thread: threading.Thread | None = None
        self.gone = False

    # -- scripting and observing -------------------------------------------------------------------
    def serve(self, *streams: Stream) -> "StreamTrainer":
        """Queue streams (one per future hello) and start answering, from a thread, if not yet started."""
        with self._lock:
            self._scripts.extend(streams)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stream-trainer", daemon=True)
            self._thread.start()
        return self

    def of(self, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e["type"] == kind]

    def sent(self, stream_index: int = -1) -> int:
        """Items sent in the ``stream_index``-th stream opened (default: the last)."""
        with self._lock:
            opened = list(self._open.values())
        return opened[stream_index].sent if opened else 0

    def taken(self, stream: Stream) -> bool:
        """Whether a receiver's hello has taken ``stream`` (one of the scripts served)."""
        return self.taken_at(stream) is not None

    def taken_at(self, stream: Stream) -> float | None:
        """The ``time.monotonic()`` at which a receiver's hello took ``stream``, or None (not taken)."""
        with self._lock:
            return next((state.taken_at for state in self._open.values() if state.script is stream), None)

    def wait_for(self, predicate, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.002)
        return predicate()

    # -- serving -----------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        try:
            while not self._stop.is_set() and not self.gone:
                ready = dict(poller.poll(HELD_POLL_MS if self._held else 1000))
                self._resume_held()
                if self.sock not in ready or self.gone:
                    continue
                frames = self.sock.recv_multipart()
                if len(frames) != 2:
                    continue  # receivers send one frame per message
                ident, frame = frames
                message = wire.decode(frame, f"trainer at {self.endpoint}", wire.RECEIVER_TYPES)
                message["at"] = time.monotonic()
                self.events.append(message)
                self._handle(ident, message)
        except BaseException as e:  # noqa: BLE001 - reported by close()
            if not self._stop.is_set():
                self.failure = e

    def _resume_held(self) -> None:
        """Answer the held streams whose release has come (or whose hold timed out)."""
        for key, ident in list(self._held.items()):
            del self._held[key]
            self._reply(ident, key)  # held again (put back) until it is let go

    def _send(self, ident: bytes, message: dict, data=None) -> None:
        frames = [ident, wire.encode(message)] + ([data] if data is not None else [])
        self.sock.send_multipart(frames, copy=data is None or len(data) < (64 << 10))

    def _handle(self, ident: bytes, message: dict) -> None:
        kind = message["type"]
        if kind == wire.REGISTER:
            if self.refuse:
                self._send(ident, {"type": wire.REFUSED, "handle": message.get("handle"), "message": self.refuse})
            else:
                self._send(ident, {"type": wire.REGISTERED, "handle": message.get("handle")})
            return
        key = (message.get("handle"), message.get("stream"))
        if kind == wire.HELLO:
            with self._lock:
                script = self._scripts.pop(0) if self._scripts else None
                if script is None:
                    script = Stream([], fault=("fail", 0))
                    self._send(ident, {"type": wire.FAIL, "stream": message["stream"],
                                       "message": f"no stream scripted for step {message.get('step_id')!r}"})
                    self._open[key] = _Open(script, silent=True, taken_at=message["at"])
                    return
                self._open[key] = _Open(script, taken_at=message["at"])
            if script.step is not None and str(message.get("step_id")) != script.step:
                self._open[key].silent = True
                self._send(ident, {"type": wire.FAIL, "stream": message["stream"],
                                   "message": f"no checkpoint for step {message.get('step_id')!r}; the trainer has {script.step!r}"})
                return
            self._reply(ident, key)
        elif kind == wire.NEXT:
            if key in self._open:
                self._reply(ident, key)

    def _reply(self, ident: bytes, key) -> None:
        state = self._open[key]
        if state.silent:
            return
        script, k, stream = state.script, state.sent, key[1]
        pause = script.pauses.get(k, script.pause_s)
        if pause and state.hold_until is None:  # (not again when a held stream is let go)
            self._stop.wait(pause)
        if script.hold_before == k and not script.holding.is_set():
            script.holding.set()
            state.hold_until = time.monotonic() + HOLD_MAX_S
        if state.hold_until is not None:
            if not (script.release.is_set() or self._stop.is_set() or time.monotonic() >= state.hold_until):
                self._held[key] = ident  # answered once let go (_resume_held); the other streams go on meanwhile
                return
            state.hold_until = None
        fault = script.fault
        if fault is not None and fault[0] not in ("corrupt", "die-after-end") and fault[1] == k:
            state.silent = True
            if fault[0] == "fail":
                self._send(ident, {"type": wire.FAIL, "stream": stream, "message": f"trainer broke the stream after {k} item(s)"})
            elif fault[0] == "cancel":
                self._send(ident, {"type": wire.CANCEL, "stream": stream, "message": f"trainer cancelled after {k} item(s)"})
            elif fault[0] == "end":
                self._send(ident, {"type": wire.END, "stream": stream, "count": k})
            elif fault[0] == "hang":
                self._send(ident, {"type": wire.HANG, "stream": stream})
            return  # stall: say nothing, ever
        if k < len(script.items):
            name, arr = script.items[k]
            arr = np.asarray(arr)
            data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))  # C order, no copy
            crc = self._crc.get(id(arr)) if arr is script.items[k][1] else None
            if crc is None:
                crc = self._crc[id(arr)] = wire.checksum(data)
            message = wire.item(stream, k, name, arr.dtype.name, arr.shape, data, crc)
            if fault == ("corrupt", k) and len(data):
                corrupted = bytearray(data)
                corrupted[0] ^= 0xFF
                data = memoryview(corrupted)
            state.sent += 1
            self._send(ident, message, data)
            return
        state.silent = True
        self._send(ident, {"type": wire.END, "stream": stream, "count": k})
        if fault is not None and fault[0] == "die-after-end":
            self.gone = True  # the trainer exits right after its last word
            self.sock.close(linger=1000)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            waker = zmq.Context.instance().socket(zmq.PAIR)
            waker.connect(self._wake_address)
            waker.send(b"")
            self._thread.join(5)
            waker.close(linger=0)
        self._wake.close(linger=0)
        if not self.sock.closed:
            self.sock.close()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- a trainer process (benchmarks, the simulator) ---------------------------------------------------
def patterned_state(spec, seed: int) -> dict:
    """Cheap deterministic weights for large models: every 4-byte word distinct (fixtures.ipc.patterned)."""
    from weightsync.fixtures.ipc import patterned

    return {p.name: patterned(p.shape, p.dtype, seed=seed * 7919 + i) for i, p in enumerate(spec.all_params)}


def _process_main(endpoint: str, spec, streams: int, seed: int, bytes_per_s: float, ready) -> None:
    """Child: serve ``streams`` streams of ``patterned_state(spec, seed)`` (one per hello, any step), pacing
    each item at ``bytes_per_s`` (0: as fast as it can), until the parent ends the process."""
    trainer = StreamTrainer(endpoint)
    try:
        items = list(patterned_state(spec, seed).items())
        pauses = {i: (arr.nbytes / bytes_per_s if bytes_per_s else 0.0) for i, (_, arr) in enumerate(items)}
        trainer.serve(*(Stream(items, pauses=pauses) for _ in range(streams)))
        ready.set()
        while trainer._thread.is_alive() and os.getppid() != 1:
            trainer._thread.join(0.5)
    finally:
        trainer.close()


def serve_process(spec, streams: int, *, seed: int = 0, bytes_per_s: float = 0.0):
    """Start a trainer process (spawn) serving ``streams`` streams of ``patterned_state(spec, seed)``; returns
    (process, endpoint, directory). Terminate the process when done and remove the directory."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    directory = tempfile.mkdtemp(prefix="wscf-ctp-")
    endpoint = f"ipc://{directory}/trainer.sock"
    ready = ctx.Event()
    proc = ctx.Process(target=_process_main, args=(endpoint, spec, streams, seed, bytes_per_s, ready),
                       name="ct-trainer", daemon=True)
    proc.start()
    if not ready.wait(120):
        proc.kill()
        raise RuntimeError("trainer process did not start within 120 s")
    return proc, endpoint, directory
