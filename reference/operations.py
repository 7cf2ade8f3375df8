"""One clear or update at a time per session (SPEC.md LIFE-CONCURRENT).

FastDeploy drives ``clear_parameters`` and ``update_parameters`` from one thread, the worker's event loop
(fd-spec §2.4-2.5), and its API refuses a request that conflicts with the one in flight (the EngineClient's
``clear_update_lock``: a clear while UPDATING is answered 403, an update while UPDATING 400, fd-spec §2.3).
A session driven from several threads gets the same answer here: a clear or an update that arrives while
another runs is refused at once with :class:`OperationInProgressError`, naming both, before it has changed
anything (no status, parameter, gate, vote or version of the one in flight). Refusing, not waiting, means a
call never blocks behind a trainer that is slow, and a hook that calls back into the session (re-entrant,
on the same thread) gets an error instead of a deadlock.

The guard spans the whole operation: taken before the first thing the operation does (the request gate
shut, the status written), let go after the last (the status final, the cell written, the gate open), so
that what ``status()`` says never belongs to a call that was refused. ``status()``, ``version()``,
``observe()`` and ``digest()`` take no guard: they answer at once, describing the operation in flight.
"""
from __future__ import annotations

import threading

from .errors import OperationInProgressError


def refusal(refused: str, running: str) -> str:
    """The message of a call refused because ``running`` is in flight."""
    return (f"{refused}() refused: {running}() is already in progress on this session (called from another "
            f"thread, or from inside it); nothing was changed: call {refused}() again once {running}() has returned")


class OperationGuard:
    """Which operation of a session is in flight, if any (``running``: "clear", "update" or None).

        with self.operations.claim("update"):   # raises OperationInProgressError at once if one runs
            ...                                  # the whole operation
    """

    def __init__(self):
        self._lock = threading.Lock()  # guards ``running``: the check and the claim are one step
        self.running: str | None = None

    def claim(self, operation: str) -> "OperationGuard":
        """Claim the session for ``operation`` (until the ``with`` block ends), or raise at once."""
        with self._lock:
            running = self.running
            if running is not None:
                raise OperationInProgressError(refusal(operation, running))
            self.running = operation
        return self

    def release(self) -> None:
        with self._lock:
            self.running = None

    def __enter__(self) -> "OperationGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
