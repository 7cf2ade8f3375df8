"""The worker's event loop against the status cell (fd-spec §2.4-2.5; FastDeploy #5249, #5493, #5527).

One call of :func:`iteration` is one pass of the worker's loop:

1. read the cell, and take rank 0's value on every rank (``sync``: the loop's broadcast);
2. NORMAL: run the model, and nothing else;
3. otherwise act on it (:func:`check_status`) and return *without* running the model (#5527: the
   weights or caches may be gone): CLEARING clears, UPDATING updates, CLEARED waits.

The worker writes only what it did (CLEARED after its clear, NORMAL after its commit, both from the
manager, rank 0 only): never the value it read back, so an UPDATING the API writes while the worker
holds a stale CLEARED is never overwritten (#5493). ``block=False`` returns as soon as the cell reads
CLEARED (#5249); ``block=True`` stays until the update that follows has committed.

Before it clears or updates, the loop tells the KV cache's status cell (``options["kv_cache_cell"]``, if
any) CLEARING or UPDATING (#5930), then has the runner stop its in-flight requests (``runner.clear_requests()``,
#4286/#4402), and only then changes the weights. A failure there is the operation's failure on this rank: it is
voted as one (``manager.failed``), so that its peers, already at the agreement, fail at once (MR-FAILED-CLEAR). The reference shuts no communication group down (its
agreement needs the default group between iterations: #5433), so it never calls the runner's
``shutdown_process_group`` / ``restart_process_group``. After its own clear or update a rank waits for rank
0's write, so it acts once per request (#5710).

An update that fails inside the loop (its source, a stale-state hook, the engine's recapture) never leaves the
cell NORMAL, and never leaves it UPDATING, where the API could neither clear (403) nor update (400) again
(issue 19's stuck cell): the worker releases what the failed update left (``clear()``: rank 0 writes CLEARED,
the KV cache's cell is told CLEARING) and raises the update's error. The API's waiting update sees CLEARED and
answers a failure; its next update loads afresh (SPEC STATUS-FAILED-NOT-NORMAL).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from . import restart
from .status import Status
from .status_cell import StatusCell

POLL_S = 0.01  # FastDeploy's 10 ms spin


class LoopError(RuntimeError):
    """The loop cannot run: no status cell configured."""


class LoopTimeout(LoopError, TimeoutError):
    """A rank waited past its deadline for rank 0's write to the cell."""


def wait_while(cell: StatusCell, value: int, timeout_s: float, poll_s: float, why: str) -> int:
    """Poll the cell until it no longer reads ``value``; return what it reads then."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = cell.read()
        if now != value:
            return now
        if time.monotonic() >= deadline:
            raise LoopTimeout(f"status cell {cell.name!r} still reads {Status(value).name} {timeout_s:g}s after {why}")
        time.sleep(poll_s)


def _stop_requests(manager, runner, kv_value: Status) -> None:
    """What precedes every change of the weights: the KV cache's cell told, the in-flight requests stopped."""
    name = manager.commit_options.kv_cache_cell
    if name is not None:
        with StatusCell(name) as kv:
            kv.write(kv_value)
    if runner is not None:
        runner.clear_requests()


def update(manager, cell: StatusCell, poll_s: float, before=None) -> None:
    """``before()`` (what precedes the update: ``_before``) then ``manager.update()``; after a failure of either,
    release what it left and raise its error (see the module)."""
    try:
        if before is not None:
            before()
        manager.update()
    except Exception:
        release_failed(manager, cell, poll_s)
        raise


def release_failed(manager, cell: StatusCell, poll_s: float) -> None:
    """After a failed update: the weights it left released (CLEARED in the cell, from rank 0); a rank that does
    not write the cell waits for rank 0's CLEARED, so that it never reads the request again. No runner call:
    the requests were stopped before the update and nothing has run since."""
    name = manager.commit_options.kv_cache_cell
    if name is not None:
        with StatusCell(name) as kv:
            kv.write(Status.CLEARING)
    manager.clear()
    if not manager.cell.writes:
        wait_while(cell, Status.UPDATING, manager.agreement.timeout_s, poll_s,
                   f"rank {manager.rank} released the weights of its failed update")


def _before(manager, runner, kv_value: Status, what: str) -> None:
    """``_stop_requests`` as the first step of the clear or update ``what``: a failure there is that
    operation's failure on this rank, voted like any other (``manager.failed``), so that the ranks already in
    the operation learn of it at once instead of waiting for this rank at the agreement's deadline."""
    try:
        _stop_requests(manager, runner, kv_value)
    except Exception as e:
        raised = manager.failed(what, e)
        if raised is e:
            raise
        raise raised from e


def check_status(manager, cell: StatusCell, value: int, *, block: bool, poll_s: float = POLL_S, runner=None) -> str:
    """FastDeploy's ``check_model_weights_status`` from the synced ``value``; returns what was done:
    "updated", "cleared" or "idle". After its own clear or update, a rank waits for rank 0's write
    (bounded by the agreement's timeout), so that no rank reads the request again and repeats it."""
    done = "idle"
    timeout = manager.agreement.timeout_s
    while value != Status.NORMAL and (block or value != Status.CLEARED):
        if value == Status.UPDATING:
            update(manager, cell, poll_s, before=lambda: _before(manager, runner, Status.UPDATING, "update"))
            value = wait_while(cell, Status.UPDATING, timeout, poll_s, f"rank {manager.rank} committed its update")
            done = "updated"
        elif value == Status.CLEARING:
            _before(manager, runner, Status.CLEARING, "clear")
            manager.clear()
            value = wait_while(cell, Status.CLEARING, timeout, poll_s, f"rank {manager.rank} cleared")
            done = "cleared"
        else:  # CLEARED while blocking, or a value the API never writes: wait
            time.sleep(poll_s)
            value = cell.read()
    return done


def iteration(manager, run_model: Callable[[], None], *, block: bool, sync: Callable[[int], int] | None = None,
              poll_s: float = POLL_S, runner=None) -> str:
    """One pass of the worker's loop; returns "ran", "updated", "cleared" or "idle"."""
    name = manager.commit_options.status_cell
    if name is None:
        raise LoopError("the worker loop needs options['status_cell'], the name of the shared status cell")
    with StatusCell(name) as cell:
        value = cell.read()
        value = sync(value) if sync is not None else manager.agreement.broadcast(value)
        recovered = restart.recover(manager, cell, value, poll_s)  # a cell a dead worker left (STATUS-RESTART-RECOVERS)
        if recovered is not None:
            return recovered
        if value == Status.NORMAL:
            run_model()
            return "ran"
        return check_status(manager, cell, value, block=block, poll_s=poll_s, runner=runner)
