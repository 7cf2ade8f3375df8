"""FastDeploy's worker loop against the suite's status cell: ``session.worker_iteration`` runs the class's
own ``check_model_weights_status`` (fd-spec §2.4-2.7), whatever its generation's signature.

Who plays what:

* FastDeploy (the class under test): ``check_model_weights_status``, a staticmethod, and through it the
  manager's ``clear_parameters`` / ``update_parameters`` / ``finalize_update`` and its writes of the cell.
* worker_process.py's event loop (played here, ``iteration``): read the cell, pass the value through
  ``sync`` (the broadcast of rank 0's value), run the model at NORMAL, otherwise call
  ``check_model_weights_status`` and ``continue`` (return). The loop's write-back of the broadcast value
  into the cell (the race #5493 fixed) is not played: FastDeploy's function reads the cell itself.
* The GPU model runner (played here, ``ModelRunner``), outside the manager: what the function asks of it
  is recorded in order and done as FastDeploy's runner does (fd-spec §2.6-2.7): ``clear_requests()``
  stops the in-flight requests (told to the suite's runner, if it passed one); ``clear_parameters(pid)``
  calls the manager's ``clear_parameters(pid, shutdown)`` and ``update_parameters(pid)`` the manager's
  ``update_parameters(pid, restart)`` then ``finalize_update(pid)``, each flag passed only where the
  manager takes it, with the engine's ``shutdown_comm_group_if_worker_idle``: the loop's ``block``.
* The engine's library: ``paddle.distributed.shutdown_process_group`` / ``restart_process_group`` are
  stand-ins while the manager runs (world.py); each call is told to the suite's runner.

The cells are FastDeploy's IPCSignals: an object whose ``.value`` is an int32 numpy array over the
shared-memory segment (``options["status_cell"]``; ``options["kv_cache_cell"]`` for ``kv_cache_status``
where the signature has that parameter, else ``None``, as the engine passes it without a cache manager).
"""
from __future__ import annotations

import contextlib
import inspect
import mmap
import os

import numpy as np

from .stubs import NORMAL

SHM_DIR = "/dev/shm"
LOOP_PARAMS = ("model_weights_status", "kv_cache_status", "model_runner", "pid", "block")
PREFIX = "model_weights_status."


def check_function(cls):
    """(FastDeploy's check_model_weights_status, None) or (None, why the loop cannot be driven)."""
    fn = inspect.getattr_static(cls, "check_model_weights_status", None)
    if fn is None:
        return None, "no check_model_weights_status"
    if not isinstance(fn, staticmethod):
        return None, "check_model_weights_status is not a staticmethod"
    fn = fn.__func__
    params = list(inspect.signature(fn).parameters.values())
    unknown = [p.name for p in params if p.name not in LOOP_PARAMS and p.default is inspect.Parameter.empty]
    if unknown or not {"model_weights_status", "model_runner", "pid"} <= {p.name for p in params}:
        return None, f"check_model_weights_status{inspect.signature(fn)}: parameters the loop cannot supply"
    if not hasattr(cls, "_update_shared_status"):
        return None, "no _update_shared_status: nothing writes the status cell"
    return fn, None


def cell_suffix(name) -> str:
    """The ``pid`` FastDeploy names the cell by (``model_weights_status.{pid}``); ValueError naming the option
    for a name FastDeploy cannot address, a missing cell or one shorter than an int32."""
    if not isinstance(name, str):
        raise ValueError(f"options['status_cell'] must be a shared-memory name, got {name!r}")
    if not name.startswith(PREFIX) or len(name) == len(PREFIX) or "/" in name:
        raise ValueError(f"options['status_cell'] = {name!r}: FastDeploy's status cell is named "
                         f"'{PREFIX}{{pid}}' under {SHM_DIR}")
    check_cell(name, "status_cell")
    return name[len(PREFIX):]


def check_cell(name, option: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"options[{option!r}] = {name!r} is not a shared-memory name")
    path = os.path.join(SHM_DIR, name)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise ValueError(f"options[{option!r}]: the cell {name!r} does not exist ({path}); the engine creates it") from None
    if size < 4:
        raise ValueError(f"options[{option!r}]: the cell {name!r} holds {size} bytes, expected 4 (one int32)")


class Signal:
    """FastDeploy's IPCSignal as the loop sees it: ``value``, an int32 array over the cell."""

    def __init__(self, name: str):
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 4)
        finally:
            os.close(fd)
        self.name = name
        self.value = np.ndarray((1,), dtype=np.int32, buffer=self._map)

    def close(self) -> None:
        del self.value
        try:
            self._map.close()
        except BufferError:  # an array over it is still referenced (a traceback's frame): freed with it
            pass


@contextlib.contextmanager
def signal(name: str | None):
    if name is None:
        yield None
        return
    sig = Signal(name)
    try:
        yield sig
    finally:
        sig.close()


class ModelRunner:
    """FastDeploy's GPU model runner, as ``check_model_weights_status`` uses it (module docstring)."""

    def __init__(self, session, shutdown: bool, suite_runner=None):
        self.session, self.shutdown, self.suite = session, shutdown, suite_runner
        self.calls: list[str] = []

    def clear_requests(self):
        self.calls.append("clear_requests")
        if self.suite is not None:
            self.suite.clear_requests()

    def clear_parameters(self, pid):
        self.calls.append("clear_parameters")
        self.session.runner_clear(pid, self.shutdown, groups=self.groups)

    def update_parameters(self, pid):
        self.calls.append("update_parameters")
        self.session.runner_update(pid, self.shutdown, groups=self.groups)

    def groups(self, how: str, name: str) -> None:
        self.calls.append(f"{how}_process_group({name})")
        if self.suite is not None:
            getattr(self.suite, f"{how}_process_group")(name)

    def result(self) -> str:
        if "update_parameters" in self.calls:
            return "updated"
        return "cleared" if "clear_parameters" in self.calls else "idle"


def iteration(session, fn, run_model, *, block: bool, sync=None, runner=None) -> str:
    """One pass of worker_process.py's loop around FastDeploy's ``fn`` (module docstring)."""
    with signal(session.cell_name) as status:
        value = int(status.value[0])
        value = int(sync(value)) if sync is not None else value  # one rank: its own value is rank 0's
        if value == NORMAL:
            run_model()
            return "ran"
        stand_in = ModelRunner(session, shutdown=bool(block), suite_runner=runner)
        with signal(session.kv_cell_name) as kv:
            values = {"model_weights_status": status, "kv_cache_status": kv, "model_runner": stand_in,
                      "pid": session.pid, "block": bool(block)}
            params = inspect.signature(fn).parameters
            fn(**{name: values[name] for name in params if name in values})
        return stand_in.result()
