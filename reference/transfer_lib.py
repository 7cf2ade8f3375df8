"""The transfer library of the streamed paths and the handle a worker keeps across updates.

Which library: ``checkpoint_transfer``, as a production loader imports it. Its ``config`` submodule holds
``TransferConfig``, ``Role`` and ``Phase1Backend``. The real library is not public; where it is absent the
suite installs the simulator's stand-in under that name (``sim.checkpoint_transfer.install_as_library``),
so the reference never names the simulator.

The handle (FastDeploy #8078/#8079): created and initialized once per worker, reused by every update,
destroyed (``cleanup()``, errors swallowed) on any failure so that the next update starts a fresh one,
and at the session's close.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import weakref
from collections.abc import Callable

log = logging.getLogger("reference.transfer_lib")

LIBRARY = "checkpoint_transfer"

_handles: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


def library():
    """(the library module, its ``config`` submodule)."""
    return importlib.import_module(LIBRARY), importlib.import_module(f"{LIBRARY}.config")


async def _await(awaitable):
    return await awaitable


def finish(result):
    """The value of a library call that may return an awaitable (``initialize``/``cleanup`` are coroutines
    in the GDR API and plain calls in the rsync one)."""
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


def ensure(owner, make: Callable[[], object]):
    """``owner``'s handle: the cached one, or a new one from ``make()``, initialized and cached."""
    handle = _handles.get(owner)
    if handle is None:
        handle = make()
        finish(handle.initialize())
        _handles[owner] = handle
        log.info("CheckpointTransfer handle %r initialized and cached for reuse", handle)
    return handle


def destroy(owner) -> None:
    """Forget ``owner``'s handle and clean it up; a failing cleanup is logged, never raised."""
    handle = _handles.pop(owner, None)
    if handle is None:
        return
    try:
        finish(handle.cleanup())
    except Exception as e:  # noqa: BLE001 - the update's own error is the one to report
        log.warning("CheckpointTransfer cleanup of %r failed: %s: %s", handle, type(e).__name__, e)


@contextlib.contextmanager
def receiving(owner, receiver):
    """Run ``receiver`` (a ``reference.prefetch.Prefetcher``) for the block. On any failure: stop it, destroy
    ``owner``'s handle (which also ends a library wait the stop cannot interrupt), wait for the receiver,
    re-raise. Either way no receiving thread outlives the block."""
    receiver.start()
    try:
        yield receiver
    except BaseException:
        receiver.stop()
        destroy(owner)
        receiver.join()
        raise
    receiver.join()
