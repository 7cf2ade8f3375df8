"""``checkpoint_transfer.transfer.CheckpointTransfer`` of the stand-in: the receiving end of a weight stream.

The surface FastDeploy uses (fd-spec §3.5, §3.6, §4.2):

* ``CheckpointTransfer(TransferConfig(...))`` (GDR) or ``CheckpointTransfer(**rsync_config, local_rank=,
  group_size=)`` (rsync): keyword arguments are ``TransferConfig`` fields plus ``local_rank`` (the global
  rank when none is given); any other keyword is a TypeError, as a real signature would raise.
* ``initialize()`` / ``cleanup()``: do their work when called and return an awaitable, so that both
  ``handle.initialize()`` (rsync) and ``asyncio.run(handle.initialize())`` (GDR) work. ``initialize``
  connects to the trainer and registers (bounded by ``discover_timeout_s``); ``cleanup`` unregisters and
  closes the socket; a second ``cleanup`` does nothing.
* ``receive_stream(step_id, verify_checksum=False)`` (rsync), ``receive_weights_sync(step_id,
  output_framework="paddle")`` and ``async receive_weights(step_id)``: iterators of ``WeightItem(name,
  tensor)`` (a named tuple: ``item.name`` and ``name, tensor = item`` both work). Tensors are fresh
  (``materialize_tensors``), CPU Paddle tensors on this machine (numpy arrays for ``output_framework="numpy"``).

How the stand-in fails, as the trainer tells it to (``sim.stream_trainer``): ``fail`` raises
``ConnectionError``; ``cancel`` raises ``asyncio.CancelledError`` (a BaseException, as a cancelled task
does); silence raises ``TimeoutError`` after ``recv_bucket_timeout_s`` (each wait) or
``session_total_timeout_s`` (the stream); ``hang`` blocks with those timeouts off (a library whose own
deadlines do not fire) until ``cleanup()``, the task's cancellation, or ``session_total_timeout_s``; an
early ``end`` ends the iteration without error. An iterator closed before its end, or failing, tells the
trainer ``bye``. One stream at a time per handle.
"""
from __future__ import annotations

import asyncio
import collections.abc
import ctypes
import itertools
import logging
import os
import threading
import time
from typing import Any, NamedTuple

import zmq
import zmq.asyncio

from .. import stream_wire as wire
from .config import FIELD_NAMES, Phase1Backend, Role, TransferConfig

log = logging.getLogger("sim.checkpoint_transfer")

POLL_SLICE_S = 0.02  # a blocked wait checks for cleanup() this often
CLOSE_LINGER_MS = 500
_ids = itertools.count(1)


class WeightItem(NamedTuple):
    name: str
    tensor: Any


class _Completed(collections.abc.Coroutine):
    """An awaitable that is already done: ``initialize()``/``cleanup()`` work when called, and the result
    can be awaited, given to ``asyncio.run``, or dropped without a never-awaited warning."""

    def __init__(self, value=None):
        self._value = value

    def send(self, value):
        raise StopIteration(self._value)

    def throw(self, typ, val=None, tb=None):
        raise typ if val is None else val

    def close(self):
        pass

    def __await__(self):
        return self._value
        yield  # noqa: unreachable - makes this a generator


def config_from_kwargs(kwargs: dict) -> TransferConfig:
    kwargs = dict(kwargs)
    unknown = sorted(set(kwargs) - FIELD_NAMES - {"local_rank"})
    if unknown:
        raise TypeError(f"CheckpointTransfer() got unexpected keyword argument(s) {unknown}")
    local_rank = kwargs.pop("local_rank", 0)
    kwargs.setdefault("global_rank", local_rank)
    kwargs.setdefault("role", Role.INFERENCE)
    kwargs.setdefault("phase1_backend", Phase1Backend.GPU_DIRECT)
    return TransferConfig(**kwargs)


def _numpy_dtype(name: str):
    import numpy as np

    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def to_tensor(message: dict, data, framework: str):
    """A fresh tensor holding the item's bytes (``data``, a buffer), copied once."""
    import numpy as np

    shape, dtype = message["shape"], message["dtype"]
    if framework == "numpy":
        return np.frombuffer(data, _numpy_dtype(dtype)).reshape(shape).copy()
    import paddle

    tensor = paddle.empty(shape, dtype=getattr(paddle, dtype))
    if len(data):
        dst = np.frombuffer((ctypes.c_uint8 * len(data)).from_address(tensor.data_ptr()), np.uint8)
        np.copyto(dst, np.frombuffer(data, np.uint8))
    return tensor


class _Stream:
    """One stream's exchange; the sync and async iterators drive it."""

    def __init__(self, handle: "CheckpointTransfer", mode: str, step_id, verify: bool, framework: str):
        self.handle = handle
        self.number = handle._next_stream()
        self.step_id = str(step_id)
        self.verify = verify
        self.framework = framework
        self.mode = mode
        self.received = 0
        self.finished = False
        cfg = handle.config
        self.deadline = time.monotonic() + cfg.session_total_timeout_s
        self.where = f"CheckpointTransfer stream {self.number} (step {self.step_id}) from {cfg.address}"

    def hello(self) -> dict:
        return {"type": wire.HELLO, "handle": self.handle.id, "stream": self.number, "mode": self.mode,
                "step_id": self.step_id, "verify_checksum": self.verify, "rank": self.handle.config.global_rank}

    def next_request(self) -> dict:
        return {"type": wire.NEXT, "handle": self.handle.id, "stream": self.number}

    def wait_budget(self) -> float:
        """Seconds the next reply may take: the per-wait bound, within what is left of the stream's."""
        return max(0.0, min(self.handle.config.recv_bucket_timeout_s, self.deadline - time.monotonic()))

    def timeout_error(self) -> TimeoutError:
        cfg = self.handle.config
        return TimeoutError(f"{self.where}: no message for item {self.received} within "
                            f"{min(cfg.recv_bucket_timeout_s, cfg.session_total_timeout_s):g}s (trainer dead or stalled)")

    def accept(self, frames):
        """The reply as an item to yield, None at the end; raises what the trainer said to raise. Returns
        ``wire.HANG`` when the trainer says hang (the caller blocks)."""
        message = wire.decode(frames[0].bytes, self.where, wire.TRAINER_TYPES)
        data = frames[1].buffer if len(frames) > 1 else None
        if message.get("stream") != self.number:
            return _STALE
        kind = message["type"]
        if kind == wire.ITEM:
            wire.check_item(message, data, f"{self.where}, item {self.received}")
            if self.verify and wire.checksum(data) != message["crc32"]:
                raise ValueError(f"{self.where}: checksum mismatch for item {self.received} ({message['name']!r})")
            self.received += 1
            return WeightItem(message["name"], to_tensor(message, data, self.framework))
        if kind == wire.END:
            self.finished = True
            return None
        if kind == wire.FAIL:
            raise ConnectionError(f"{self.where}: the transfer broke after {self.received} item(s): {message.get('message')}")
        if kind == wire.CANCEL:
            raise asyncio.CancelledError(f"{self.where}: cancelled after {self.received} item(s): {message.get('message')}")
        if kind == wire.HANG:
            return wire.HANG
        raise wire.WireError(f"{self.where}: unexpected {kind!r}")

    def hang_error(self) -> TimeoutError:
        return TimeoutError(f"{self.where}: hung after {self.received} item(s) until the session deadline")

    def bye(self, reason: str) -> None:
        if not self.finished:
            self.handle._send_quietly({"type": wire.BYE, "handle": self.handle.id, "stream": self.number,
                                       "received": self.received, "reason": reason})


_STALE = object()


class CheckpointTransfer:
    def __init__(self, config: TransferConfig | None = None, /, **kwargs):
        if config is None:
            config = config_from_kwargs(kwargs)
        elif kwargs:
            raise TypeError(f"CheckpointTransfer(config) takes no keyword arguments, got {sorted(kwargs)}")
        if not isinstance(config, TransferConfig):
            raise TypeError(f"CheckpointTransfer needs a TransferConfig, got {type(config).__name__}")
        self.config = config
        self.id = f"{os.getpid()}-{next(_ids)}"
        self._sock = None
        self._streams = itertools.count(1)
        self._active = False  # a stream is open (suspended between items, or waiting)
        self._stream: _Stream | None = None
        self._closed = threading.Event()
        # Every zmq call on the socket holds this, one slice of a wait at a time: libzmq sockets are not
        # thread-safe, and cleanup() may come from another thread than the one receiving.
        self._use = threading.RLock()
        self.initialized = False

    def __repr__(self) -> str:
        return f"<CheckpointTransfer stand-in {self.id} -> {self.config.endpoint}>"

    def _next_stream(self) -> int:
        return next(self._streams)

    # -- lifecycle ---------------------------------------------------------------------------------
    def initialize(self) -> _Completed:
        if self.initialized:
            raise RuntimeError(f"{self!r}: initialize() called twice")
        if self._closed.is_set():
            raise RuntimeError(f"{self!r}: initialize() after cleanup()")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        sock.connect(self.config.address)
        try:
            sock.send(wire.encode({"type": wire.REGISTER, "handle": self.id, "config": self.config.as_wire()}))
            if not sock.poll(int(self.config.discover_timeout_s * 1000)):
                raise TimeoutError(f"{self!r}: no trainer answered within discover_timeout_s="
                                   f"{self.config.discover_timeout_s:g}s")
            reply = wire.decode(sock.recv(), f"{self!r} register", (wire.REGISTERED, wire.REFUSED))
            if reply["type"] == wire.REFUSED:
                raise ConnectionRefusedError(f"{self!r}: the trainer refused: {reply.get('message')}")
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = sock
        self.initialized = True
        return _Completed()

    def cleanup(self) -> _Completed:
        if self._closed.is_set():
            return _Completed()
        self._closed.set()  # a blocked wait in another thread gives up at its next slice (POLL_SLICE_S)
        if not self._use.acquire(timeout=2.0):  # never: a wait holds it one slice at a time
            return _Completed()
        try:
            if self._sock is not None:
                stream = self._stream
                if self._active and stream is not None:  # a stream left suspended by its consumer
                    stream.bye("cleanup")
                    stream.finished = True
                self._send_quietly({"type": wire.UNREGISTER, "handle": self.id})
                self._sock.close()
                self._sock = None
        finally:
            self._use.release()
        return _Completed()

    def _live(self, stream: _Stream):
        """The socket, to be used while holding ``self._use``; raises once the handle is cleaned up."""
        if self._sock is None or self._closed.is_set():
            raise ConnectionAbortedError(f"{stream.where}: the handle was cleaned up")
        return self._sock

    def _request(self, message: dict, stream: _Stream) -> None:
        with self._use:
            self._live(stream).send(wire.encode(message))

    def _send_quietly(self, message: dict) -> None:
        with self._use:
            if self._sock is not None:
                try:
                    self._sock.send(wire.encode(message), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def _begin(self, mode, step_id, verify, framework) -> _Stream:
        if not self.initialized or self._closed.is_set():
            raise RuntimeError(f"{self!r}: not initialized (call initialize() first) or already cleaned up")
        if framework not in ("paddle", "numpy"):
            raise ValueError(f"output_framework must be 'paddle' or 'numpy', got {framework!r}")
        return _Stream(self, mode, step_id, verify, framework)

    def _claim(self, stream: _Stream) -> None:
        """At a stream's first step (an iterator never started holds nothing)."""
        if self._active:
            raise RuntimeError(f"{self!r}: another stream of this handle is still open")
        if self._closed.is_set():
            raise RuntimeError(f"{self!r}: cleaned up before the stream started")
        self._active, self._stream = True, stream

    def _release(self, stream: _Stream, reason: str) -> None:
        stream.bye(reason)
        if self._stream is stream:
            self._active, self._stream = False, None

    # -- waiting for the trainer: the same deadlines for the sync and the async iterators --------------
    def _polls(self, stream: _Stream):
        """The timeout (ms) of each poll of one wait, in slices so that cleanup() from another thread ends it;
        raises at the per-wait or session deadline."""
        end = time.monotonic() + stream.wait_budget()
        while True:
            if self._closed.is_set():
                raise ConnectionAbortedError(f"{stream.where}: the handle was cleaned up during the wait")
            left = end - time.monotonic()
            if left <= 0:
                raise stream.timeout_error()
            yield int(min(left, POLL_SLICE_S) * 1000) or 1

    def _hung(self, stream: _Stream) -> bool:
        """While the trainer's hang lasts (until cleanup() or the session deadline)."""
        return not self._closed.is_set() and time.monotonic() < stream.deadline

    def _wait_sync(self, stream: _Stream):
        while True:
            frames = None
            for ms in self._polls(stream):
                with self._use:
                    sock = self._live(stream)
                    if sock.poll(ms):
                        frames = sock.recv_multipart(copy=False)
                if frames is not None:
                    break
            got = stream.accept(frames)
            if got is wire.HANG:
                while self._hung(stream):
                    self._closed.wait(POLL_SLICE_S)
                raise stream.hang_error()
            if got is not _STALE:
                return got

    async def _wait_async(self, stream: _Stream, asock):
        while True:
            frames = None
            for ms in self._polls(stream):
                with self._use:  # held across the await: only this loop's thread receives on the socket
                    sock = self._live(stream)
                    if await asock.poll(ms):
                        frames = sock.recv_multipart(copy=False)
                if frames is not None:
                    break
            got = stream.accept(frames)
            if got is wire.HANG:
                while self._hung(stream):
                    await asyncio.sleep(POLL_SLICE_S)
                raise stream.hang_error()
            if got is not _STALE:
                return got

    def _iterate(self, stream: _Stream):
        self._claim(stream)
        reason = "closed"
        try:
            self._request(stream.hello(), stream)
            while True:
                item = self._wait_sync(stream)
                if item is None:
                    return
                yield item
                self._request(stream.next_request(), stream)
        except BaseException as e:
            reason = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._release(stream, reason)

    def receive_stream(self, step_id, verify_checksum: bool = False):
        """rsync's API: ``(key, tensor)`` pairs of step ``step_id``."""
        return self._iterate(self._begin("stream", step_id, bool(verify_checksum), "paddle"))

    def receive_weights_sync(self, step_id, output_framework: str = "paddle"):
        return self._iterate(self._begin("weights", step_id, False, output_framework))

    # -- async iteration ---------------------------------------------------------------------------
    async def receive_weights(self, step_id):
        stream = self._begin("weights", step_id, False, "paddle")
        self._claim(stream)
        reason = "closed"
        asock = zmq.asyncio.Socket.from_socket(self._sock)
        try:
            self._request(stream.hello(), stream)
            while True:
                item = await self._wait_async(stream, asock)
                if item is None:
                    return
                yield item
                self._request(stream.next_request(), stream)
        except BaseException as e:
            reason = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._release(stream, reason)
