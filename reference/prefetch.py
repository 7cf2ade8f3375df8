"""Receiving a stream on a thread while the loader consumes it (the prefetch of FastDeploy's GDR path,
fd-spec §4.2, with its gaps closed, §4.4).

``Prefetcher(open_source, window=q, wait_s=t, where=...)``: a receiving thread calls ``open_source()``
(a sync or an async iterator of items) and receives items ahead of the consumer, at most ``q`` of them
received and not yet finished by the loader, counting the one it is loading: the thread asks the source
for item i+q only once the loader has asked for item i+1. ``q = 1`` is no read-ahead at all.

* Every error of the receiver reaches the consumer with its type and message; a cancellation of the
  transfer (``asyncio.CancelledError``, a BaseException) becomes :class:`StreamCancelled`, never a
  normal end: a cancelled stream is never complete.
* No wait is unbounded: the consumer waits at most ``wait_s`` for each item (a library whose own
  timeouts do not fire cannot hang the update), and the thread waits for a free slot in short slices
  so that ``stop()`` ends it.
* ``stop()`` (a consumer error, the end of the update) cancels the receiving task, drops every item
  held and lets the thread end; ``join()`` waits for it, bounded.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("reference.prefetch")

_ITEM, _END, _ERROR = "item", "end", "error"
SLOT_POLL_S = 0.05
JOIN_S = 5.0


class StreamCancelled(RuntimeError):
    """The transfer was cancelled before its end: the stream is incomplete."""


def wait_bound(recv_timeout_s: float) -> float:
    """How long the consumer waits for one item: beyond the library's own per-item bound, so that the
    library's error (naming what it waited for) normally comes first."""
    return recv_timeout_s * 1.5


class _Window:
    """Slots for items received and not yet finished by the loader; released from the consumer's thread,
    acquired by the receiver from plain code or from its event loop."""

    def __init__(self, size: int):
        self._free = size
        self._cond = threading.Condition()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None

    def release(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify()
        loop, wake = self.loop, self.wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop is closed: the receiver is gone
                pass

    def acquire(self, stop: threading.Event) -> bool:
        with self._cond:
            while self._free <= 0:
                if stop.is_set():
                    return False
                self._cond.wait(SLOT_POLL_S)
            self._free -= 1
            return True

    async def acquire_async(self) -> None:
        while True:
            with self._cond:
                if self._free > 0:
                    self._free -= 1
                    return
                self.wake.clear()
            await self.wake.wait()


class Prefetcher:
    def __init__(self, open_source: Callable[[], object], *, window: int, wait_s: float, where: str,
                 name: str = "stream-receive"):
        if window < 1:
            raise ValueError(f"prefetch window must be at least 1, got {window}")
        self._open = open_source
        self._window = _Window(window)
        self._wait_s = wait_s
        self.where = where
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.received = 0  # items handed to the consumer

    def start(self) -> "Prefetcher":
        self._thread.start()
        return self

    # -- the receiving thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            source = self._open()
            if hasattr(source, "__aiter__"):
                self._run_async(source)
            else:
                self._pump(source)
            self._queue.put((_END, None))
        except BaseException as e:  # noqa: BLE001 - every way the receiver ends is the consumer's business
            self._queue.put((_ERROR, e))

    def _pump(self, source) -> None:
        try:
            while self._window.acquire(self._stop):
                try:
                    item = next(source)
                except StopIteration:
                    return
                self._queue.put((_ITEM, item))
                del item
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()  # a generator left mid-stream tells its library now, not at garbage collection

    def _run_async(self, source) -> None:
        loop = asyncio.new_event_loop()
        try:
            self._window.loop, self._window.wake = loop, asyncio.Event()
            self._task = loop.create_task(self._pump_async(source))
            if self._stop.is_set():
                self._task.cancel()
            loop.run_until_complete(self._task)
        finally:
            self._window.loop = None
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _pump_async(self, source) -> None:
        try:
            while not self._stop.is_set():
                await self._window.acquire_async()
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
                raise TimeoutError(f"{self.where}: no item within {self._wait_s:g}s after {self.received} item(s) "
                                   "(the transfer is stalled)") from None
            if kind == _END:
                return
            if kind == _ERROR:
                if isinstance(value, asyncio.CancelledError):
                    raise StreamCancelled(f"{self.where}: the transfer was cancelled after {self.received} item(s): "
                                          f"{value}") from value
                raise value
            self.received += 1
            yield value
            del value
            self._window.release()

    def stop(self) -> None:
        """End the receiver (cancel its task) and drop every item it holds; does not wait."""
        self._stop.set()
        loop, task = self._window.loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # loop already closed
                pass
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def join(self, timeout_s: float = JOIN_S) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        self._drain()
        if self._thread.is_alive():
            log.error("%s: the receiving thread is still alive %gs after the stop", self.where, timeout_s)

    def close(self) -> None:
        self.stop()
        self.join()
