"""The API side of the status cell: FastDeploy's EngineClient ``clear_load_weight`` and
``update_model_weight`` guards (fd-spec §2.3, rule 31), returning ``(code, message)``.

An update requested while the weights are NORMAL writes nothing and reloads nothing: it answers 200
"model weight is updated". A clear requested while CLEARED answers 200 "model weight is cleared". Only
from NORMAL (clear) or CLEARED (update) does the API write the request and wait for the worker.
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
# request -> {status found: the refusal}
REFUSED = {
    Status.CLEARING: {Status.CLEARING: (400, "worker is clearing model weight already"),
                      Status.UPDATING: (403, "worker is updating model weight, cannot clear now")},
    Status.UPDATING: {Status.UPDATING: (400, "worker is updating model weight already"),
                      Status.CLEARING: (403, "worker is clearing model weight, cannot update now")},
}


def _wait_for(name: str, want: Status, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    with StatusCell(name) as cell:
        while cell.read() != want:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
    return True


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
            if _wait_for(self.cell_name, done, timeout_s, self.poll_s):
                return 200, f"{verb} model weight successfully"
            return 404, f"{verb} model weight timeout"

    def clear_load_weight(self, timeout_s: float) -> tuple[int, str]:
        return self._guarded(Status.CLEARING, timeout_s)

    def update_model_weight(self, timeout_s: float) -> tuple[int, str]:
        return self._guarded(Status.UPDATING, timeout_s)  # from NORMAL: nothing requested, nothing reloads
