"""Receiving a stream on a thread while the loader consumes it (the prefetch of FastDeploy's GDR path,
fd-spec §4.2, with its gaps closed, §4.4).

``Prefetcher(open_source, window=q, wait_s=t, where=...)``: a receiving thread runs an event loop of its
own that calls ``open_source()`` (an async iterator, or a plain one, stepped inside the loop) and receives
items ahead of the consumer, at most ``q`` of them received and not yet finished by the loader, counting
the one it is loading: the thread asks the source for item i+q only once the loader has asked for item
i+1. ``q = 1`` is no read-ahead at all.

* Every error of the receiver reaches the consumer with its type and message; a cancellation of the
  transfer (``asyncio.CancelledError``, a BaseException) becomes :class:`StreamCancelled`, never a
  normal end: a cancelled stream is never complete.
* No wait is unbounded: the consumer waits at most ``wait_s`` for each item (a library whose own
  timeouts do not fire cannot hang the update).
* ``stop()`` (a consumer error) cancels the receiving task and drops every item the queue holds; the
  caller then ends any library wait the cancellation cannot reach (``transfer_lib.receiving`` cleans the
  handle up) and ``join()``s the thread, bounded.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("reference.prefetch")

_ITEM, _END, _ERROR = "item", "end", "error"
JOIN_S = 5.0


class StreamCancelled(RuntimeError):
    """The transfer was cancelled before its end: the stream is incomplete."""


def wait_bound(recv_timeout_s: float) -> float:
    """How long the consumer waits for one item: beyond the library's own per-item bound, so that the
    library's error (naming what it waited for) normally comes first."""
    return recv_timeout_s * 1.5


async def _stepped(source):
    """A plain iterator as an async one, each step taken in the receiving loop's thread (one left mid-stream
    is the library's to end: the caller cleans its handle up on any failure)."""
    for item in source:
        yield item


class _Window:
    """Slots for items received and not yet finished by the loader: released from the consumer's thread,
    acquired in the receiving loop."""

    def __init__(self, size: int, loop: asyncio.AbstractEventLoop):
        self._free = size
        self._lock = threading.Lock()
        self._loop = loop
        self._wake = asyncio.Event()

    def release(self) -> None:
        with self._lock:
            self._free += 1
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: the receiver is gone
            pass

    async def acquire(self) -> None:
        while True:
            with self._lock:
                if self._free > 0:
                    self._free -= 1
                    return
                self._wake.clear()
            await self._wake.wait()


class Prefetcher:
    def __init__(self, open_source: Callable[[], object], *, window: int, wait_s: float, where: str):
        self._open = open_source
        self._size = window
        self._wait_s = wait_s
        self.where = where
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)  # a hung library must not block exit

    def start(self) -> "Prefetcher":
        """The loop and its task exist before the thread runs, so that ``stop()`` can always cancel."""
        self._loop = asyncio.new_event_loop()
        self._window = _Window(self._size, self._loop)
        self._task = self._loop.create_task(self._pump())
        self._thread.start()
        return self

    # -- the receiving thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
            self._queue.put((_END, None))
        except BaseException as e:  # noqa: BLE001 - every way the receiver ends is the consumer's business
            self._queue.put((_ERROR, e))
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _pump(self) -> None:
        source = self._open()
        if not hasattr(source, "__aiter__"):
            source = _stepped(iter(source))
        try:
            while True:
                await self._window.acquire()
                try:
                    item = await source.__anext__()
                except StopAsyncIteration:
                    return
                self._queue.put((_ITEM, item))
                del item
        finally:
            await source.aclose()

    # -- the consumer ------------------------------------------------------------------------------
    def __iter__(self):
        while True:
            try:
                kind, value = self._queue.get(timeout=self._wait_s)
            except queue.Empty:
                raise TimeoutError(f"{self.where}: no item within {self._wait_s:g}s") from None
            if kind == _END:
                return
            if kind == _ERROR:
                if isinstance(value, asyncio.CancelledError):
                    raise StreamCancelled(f"{self.where}: the transfer was cancelled: {value}") from value
                raise value
            yield value
            del value
            self._window.release()

    def stop(self) -> None:
        """Cancel the receiving task and drop every item the queue holds; does not wait."""
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)
        except RuntimeError:  # the loop is closed: the receiver already ended
            pass
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def join(self, timeout_s: float = JOIN_S) -> None:
        self._thread.join(timeout_s)
        self._drain()
        if self._thread.is_alive():
            log.error("%s: the receiving thread is still alive %gs after the stop", self.where, timeout_s)
