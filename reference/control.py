"""The API side of the status cell: FastDeploy's EngineClient ``clear_load_weight`` and
``update_model_weight`` guards (fd-spec §2.3, rule 31), returning ``(code, message)``.

An update requested while the weights are NORMAL writes nothing and reloads nothing: it answers 200
"model weight is updated". A clear requested while CLEARED answers 200 "model weight is cleared". Only
from NORMAL (clear) or CLEARED (update) does the API write the request and wait for the worker.

An update the worker fails leaves the cell CLEARED (the weights released, ``reference.worker_loop``): the API
waiting for NORMAL then answers ``500 update model weight failed`` at once instead of waiting out its timeout,
and may ask again (SPEC STATUS-FAILED-NOT-NORMAL). Nothing but a failure takes the cell from UPDATING to CLEARED.
"""
from __future__ import annotations

import threading
import time

from .status import Status
from .status_cell import StatusCell

POLL_S = 0.01
# request -> (the status it ends in, the status it starts from, verb, the answer when already done)
GUARDS = {
    Status.CLEARING: (Status.CLEARED, Status.NORMAL, "clear", "model weight is cleared"),
    Status.UPDATING: (Status.NORMAL, Status.CLEARED, "update", "model weight is updated"),
}
# request -> the status that says the worker failed it (the weights released again)
FAILED = {Status.UPDATING: Status.CLEARED}
# request -> {status found: the refusal}
REFUSED = {
    Status.CLEARING: {Status.CLEARING: (400, "worker is clearing model weight already"),
                      Status.UPDATING: (403, "worker is updating model weight, cannot clear now")},
    Status.UPDATING: {Status.UPDATING: (400, "worker is updating model weight already"),
                      Status.CLEARING: (403, "worker is clearing model weight, cannot update now")},
}


def _wait_for(name: str, want: Status, failed: Status | None, timeout_s: float, poll_s: float) -> str:
    """"done" once the cell reads ``want``, "failed" once it reads ``failed``, else "timeout"."""
    deadline = time.monotonic() + timeout_s
    with StatusCell(name) as cell:
        while True:
            now = cell.read()
            if now == want:
                return "done"
            if now == failed:
                return "failed"
            if time.monotonic() >= deadline:
                return "timeout"
            time.sleep(poll_s)


class WeightControl:
    def __init__(self, cell_name: str, poll_s: float = POLL_S):
        self.cell_name = cell_name
        self.poll_s = poll_s
        self._lock = threading.Lock()  # FastDeploy's clear_update_lock

    def _read(self) -> int:
        with StatusCell(self.cell_name) as cell:
            return cell.read()

    def _request(self, value: Status) -> None:
        with StatusCell(self.cell_name) as cell:
            cell.write(value)

    def _guarded(self, request: Status, timeout_s: float) -> tuple[int, str]:
        """FastDeploy's guard table: answer from the status found, or write ``request`` and wait for its end."""
        done, where_from, verb, already = GUARDS[request]
        with self._lock:
            status = self._read()
            if status == done:
                return 200, already
            if status in REFUSED[request]:
                return REFUSED[request][status]
            if status != where_from:
                return 500, f"model weight status is {status}, not a ModelWeightsStatus value"
            self._request(request)
            outcome = _wait_for(self.cell_name, done, FAILED.get(request), timeout_s, self.poll_s)
            if outcome == "done":
                return 200, f"{verb} model weight successfully"
            if outcome == "failed":
                return 500, f"{verb} model weight failed: the worker released the weights (status {Status(FAILED[request]).name})"
            return 404, f"{verb} model weight timeout"

    def clear_load_weight(self, timeout_s: float) -> tuple[int, str]:
        return self._guarded(Status.CLEARING, timeout_s)

    def update_model_weight(self, timeout_s: float) -> tuple[int, str]:
        return self._guarded(Status.UPDATING, timeout_s)  # from NORMAL: nothing requested, nothing reloads
