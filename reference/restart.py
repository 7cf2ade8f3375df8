"""A worker started against a status cell that a dead worker left behind (SPEC STATUS-RESTART-RECOVERS).

A worker killed mid-update leaves the cell at the request it was serving (UPDATING or CLEARING), or at
the last value it wrote (CLEARED, NORMAL). Its replacement loads at startup (the first load, which writes
no status, STATUS-FIRST-LOAD-SILENT) and then runs its loop. The first pass of that loop brings the cell
to the truth before anything else, so that the API's next clear and update work:

* UPDATING written before the startup load began: that load is the update asked for (the trainer
  published before it asked). The worker says so: NORMAL (rank 0; the others wait for it), nothing
  reloaded. UPDATING written while the startup load ran may name a newer version: the worker reloads
  (clear without a write, update, NORMAL).
* CLEARING: the clear is carried out as always (CLEARED).
* CLEARED: the API believes the weights released (a colocated trainer may be using the memory): the
  worker releases what its startup load holds, writing nothing (the cell says so already, and an
  UPDATING the API writes meanwhile must not be overwritten, STATUS-REQUEST-KEPT). The next update then
  loads whatever the trainer publishes next, never answered from weights loaded before it asked.
* NORMAL: nothing to do.

A worker whose startup load failed has nothing to answer from: at UPDATING it releases what that load left
and loads again (the loop's load answers the cell: NORMAL once committed), at CLEARED it releases it. Its
loop's loads are never the startup load, so none is silent (STATUS-FIRST-LOAD-SILENT ends there).
"""
from __future__ import annotations

import time

from .status import Status
from .status_cell import StatusCell


def note_startup(manager) -> None:
    """At the start of the first load: what the cell reads then (None without a cell)."""
    name = manager.commit_options.status_cell
    if name is None:
        return
    with StatusCell(name) as cell:
        manager.cell_at_startup = cell.read()


def recover(manager, cell: StatusCell, value: int, poll_s: float) -> str | None:
    """The first pass of the loop after the startup load, given rank 0's ``value``: what it did ("updated",
    "cleared"), or None when the loop goes on as usual (later passes, nothing to recover)."""
    if manager.loop_started:
        return None
    manager.loop_started = True
    if value not in (Status.UPDATING, Status.CLEARED):
        return None
    loaded = manager.status == Status.NORMAL  # the startup load committed
    if value == Status.CLEARED:
        manager.clear(publish=False)
        return "cleared"
    if loaded and manager.cell_at_startup == Status.UPDATING:  # asked before the startup load: answered by it
        manager.cell.publish(Status.NORMAL, first_load=False)
    else:  # asked while it loaded (perhaps for a newer version), or its startup load failed
        from .worker_loop import update

        if manager.load_strategy not in manager.IN_PLACE or not loaded:
            manager.clear(publish=False)  # (also ends the startup load: the update below writes NORMAL)
        update(manager, cell, poll_s)  # a failure releases what it left (CLEARED), as in the loop
    if not manager.cell.writes:  # rank 0 says NORMAL; do not read the request again
        from .worker_loop import wait_while

        wait_while(cell, Status.UPDATING, manager.agreement.timeout_s, poll_s,
                   f"rank {manager.rank} answered the update left in the cell")
    return "updated"
