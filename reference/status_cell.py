"""The shared status cell: one native int32 in shared memory, FastDeploy's IPCSignal
``model_weights_status.{suffix}`` (fd-spec §1.1, §2.1-2.2).

The engine creates the cell; the API side writes CLEARING and UPDATING, the worker writes CLEARED and
NORMAL, and of the workers only tensor-parallel rank 0 writes (fd-spec rule 30). A worker maps the
cell only for the length of a read or a write, so no mapping outlives the call that needed it.

The file is opened straight under ``/dev/shm`` rather than through ``multiprocessing.shared_memory``,
whose resource tracker would unlink a cell it merely attached to when this process exits.
"""
from __future__ import annotations

import mmap
import os
import re

from .status import Status

SHM_DIR = "/dev/shm"
CELL_BYTES = 4
# A cell name is one path component under /dev/shm.
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


class CellError(ValueError):
    """The cell's name is not a shared-memory name, or the cell is missing or of the wrong size."""


def cell_path(name: str) -> str:
    if not NAME.match(name) or name in (".", ".."):
        raise CellError(f"status cell name {name!r} is not a shared-memory name (letters, digits, '_', '.', '-')")
    return os.path.join(SHM_DIR, name)


class StatusCell:
    """A mapped cell; use as a context manager (``with StatusCell(name) as cell``)."""

    def __init__(self, name: str):
        path = cell_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise CellError(f"status cell {name!r} does not exist ({path}); the engine creates it") from None
        try:
            size = os.fstat(fd).st_size
            if size < CELL_BYTES:
                raise CellError(f"status cell {name!r} holds {size} bytes, expected {CELL_BYTES} (one int32)")
            self._map = mmap.mmap(fd, CELL_BYTES)
        finally:
            os.close(fd)
        self.name = name
        self._value = memoryview(self._map).cast("i")

    def read(self) -> int:
        return self._value[0]

    def write(self, value: int) -> None:
        self._value[0] = int(value)

    def close(self) -> None:
        self._value.release()
        self._map.close()

    def __enter__(self) -> "StatusCell":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write(name: str, value: Status) -> None:
    with StatusCell(name) as cell:
        cell.write(value)


class CellWriter:
    """What a worker writes to the cell: CLEARED after a clear and NORMAL after a committed update,
    only as tensor-parallel rank 0, never for the first load (fd-spec rules 30 and 32)."""

    WORKER_VALUES = (Status.CLEARED, Status.NORMAL)

    def __init__(self, name: str | None, tp_rank: int):
        if name is not None:
            StatusCell(name).close()  # a bad name or a missing cell is an error at open, not at the first write
        self.name = name
        self.tp_rank = tp_rank

    @property
    def writes(self) -> bool:
        return self.name is not None and self.tp_rank == 0

    def publish(self, status: Status, first_load: bool) -> None:
        """Write ``status`` if this worker writes it."""
        if self.writes and status in self.WORKER_VALUES and not (first_load and status == Status.NORMAL):
            write(self.name, status)
