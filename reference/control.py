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

    def clear_load_weight(self, timeout_s: float) -> tuple[int, str]:
        with self._lock:
            status = self._read()
            if status == Status.CLEARED:
                return 200, "model weight is cleared"
            if status == Status.CLEARING:
                return 400, "worker is clearing model weight already"
            if status == Status.UPDATING:
                return 403, "worker is updating model weight, cannot clear now"
            if status != Status.NORMAL:
                return 500, f"model weight status is {status}, not a ModelWeightsStatus value"
            self._request(Status.CLEARING)
            if _wait_for(self.cell_name, Status.CLEARED, timeout_s, self.poll_s):
                return 200, "clear model weight successfully"
            return 404, "clear model weight timeout"

    def update_model_weight(self, timeout_s: float) -> tuple[int, str]:
        with self._lock:
            status = self._read()
            if status == Status.NORMAL:
                return 200, "model weight is updated"  # nothing is requested, nothing reloads
            if status == Status.UPDATING:
                return 400, "worker is updating model weight already"
            if status == Status.CLEARING:
                return 403, "worker is clearing model weight, cannot update now"
            if status != Status.CLEARED:
                return 500, f"model weight status is {status}, not a ModelWeightsStatus value"
            self._request(Status.UPDATING)
            if _wait_for(self.cell_name, Status.NORMAL, timeout_s, self.poll_s):
                return 200, "update model weight successfully"
            return 404, "update model weight timeout"
