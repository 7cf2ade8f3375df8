"""One FastDeploy worker: the adapter plays the engine and the runner; every weight operation is
FastDeploy's own method (legacy shared-memory control path, fd-spec §2.2 and §2.6-2.7).

* ``update()``, first time: ``DynamicWeightManager(...)`` (arguments by name, see generation.py); its
  constructor captures the parameters, loads them and finalizes.
* ``clear()``: ``clear_parameters(pid)``.
* ``update()`` afterwards: ``update_parameters(pid)``, then ``finalize_update(pid)`` where the class leaves
  that to the runner (DWM-0's ``update_parameters`` finalizes itself).

Status: FastDeploy writes an int32 into the shared-memory cell ``model_weights_status.{pid}``; the session
creates that 4-byte cell (a unique ``pid``), reads it for ``status()`` and unlinks it at ``close()``. Like
the engine, it writes CLEARING before a clear and UPDATING before an update; FastDeploy writes CLEARED
after a clear and NORMAL after a *non-first* finalize. The first load writes nothing (fd-spec rule 32: the
engine's cell already reads NORMAL while the worker starts), so the session writes NORMAL itself once
the constructor has returned. A cell not yet used reads CLEARED: nothing is loaded. A failed update
thus leaves UPDATING.

Trace: observed, never wrapped. Every generation ends a successful ``_update_model_from_state`` with its
own log line ``Updated {n}/{m} parameters from {src_type} source`` (on its module's ``logger``); a handler
on that logger, for the duration of the call and for the calling thread only, reads ``src_type`` from it.
FastDeploy does not log the file, so the session notes the path of each ``paddle.load`` (``worker_world``'s
load hook, result unchanged) and pairs the line with the last file loaded since the previous line (None
when none was). The manager's methods are its own: the constructor is called as the runner calls it.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import sys
import threading
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from conformance.adapter import LoaderConfig, LoadEvent, Observed, observe_paddle

from .generation import Generation, constructor_kwargs
from .stubs import CLEARED, CLEARING, NORMAL, UPDATING
from .world import WORKER_ENV, fd_config, worker_world

STATUS_NAMES = {NORMAL: "NORMAL", UPDATING: "UPDATING", CLEARING: "CLEARING", CLEARED: "CLEARED"}
_pids = itertools.count(1)
# FastDeploy's line after each state dict it applied (every generation, fd-spec §3.2), emoji or not.
APPLIED_LINE = re.compile(r"Updated (\d+)/(\d+) parameters from (.+) source\s*$")


class _AppliedLines(logging.Handler):
    """Reads FastDeploy's applied line on the thread that called into it; changes nothing."""

    def __init__(self, on_applied):
        super().__init__(logging.INFO)
        self.thread, self.on_applied = threading.get_ident(), on_applied

    def emit(self, record):
        if record.thread == self.thread:
            match = APPLIED_LINE.search(record.getMessage())
            if match:
                self.on_applied(match.group(3))


_level_lock = threading.Lock()
_level_users: dict[int, list] = {}  # id(logger) -> [users, level before the first]


def _std_logger(logger):
    """The ``logging.Logger`` behind the module's ``logger`` (paddleformers' wraps one as ``.logger``)."""
    if isinstance(logger, logging.Logger):
        return logger
    inner = getattr(logger, "logger", None)
    return inner if isinstance(inner, logging.Logger) else None


@contextlib.contextmanager
def observe_applied(module_logger, on_applied):
    """For the block, ``on_applied(src_type)`` for each of FastDeploy's applied lines on this thread. INFO
    records are enabled on that logger while any session observes it (they are created only then); its
    level is restored after the last."""
    log = _std_logger(module_logger)
    if log is None:
        yield
        return
    handler = _AppliedLines(on_applied)
    with _level_lock:
        users = _level_users.setdefault(id(log), [0, log.level])
        users[0] += 1
        if not log.isEnabledFor(logging.INFO):
            log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        with _level_lock:
            users[0] -= 1
            if not users[0]:
                log.setLevel(users[1])
                del _level_users[id(log)]


def _status_cell() -> tuple[int, SharedMemory]:
    """A fresh 4-byte cell named model_weights_status.{pid}, with a pid unique to this session."""
    while True:
        pid = os.getpid() * 10_000 + next(_pids) % 10_000
        try:
            return pid, SharedMemory(name=f"model_weights_status.{pid}", create=True, size=4)
        except FileExistsError:
            continue


class FastDeploySession:
    def __init__(self, dwm_class: type, generation: Generation, models: list, config: LoaderConfig):
        self._cls = dwm_class
        self.generation = generation
        self.models = list(models)
        self.config = config
        self.env = {k: os.environ.get(k) for k in WORKER_ENV}  # this worker's identity, as at open
        self.manager = None
        self._events: list[LoadEvent] = []
        self._loaded_from: list[str] = []  # files loaded since FastDeploy's last applied line, while an update runs
        self.pid, self._cell = _status_cell()
        self._write(CLEARED)  # nothing loaded yet

    # engine side of the status cell
    def _write(self, value: int) -> None:
        self._cell.buf[:4] = np.array([value], dtype=np.int32).tobytes()

    def _read(self) -> int:
        return int(np.frombuffer(bytes(self._cell.buf[:4]), dtype=np.int32)[0])

    def _fastdeploy(self):
        def load(path, configs, real_load):
            result = real_load(path, **configs)
            self._loaded_from.append(os.fspath(path))
            return result

        def applied(src_type):
            source = self._loaded_from[-1] if self._loaded_from else None
            self._loaded_from.clear()
            self._events.append(LoadEvent(src_type, source))

        stack = contextlib.ExitStack()
        stack.enter_context(worker_world(self.env, self.config.shared_dir, load_hook=load))
        stack.enter_context(observe_applied(getattr(sys.modules.get(self._cls.__module__), "logger", None), applied))
        return stack

    def _construct(self):
        # The runner's call: the constructor captures the parameters, loads them and finalizes.
        selected = self.env.get("FLAGS_selected_gpus") or "0"
        local_rank = int(selected) if selected.isdigit() else 0
        config = fd_config(self.config.load_strategy, self.config.model_dir, self.config.options, self.pid)
        return self._cls(**constructor_kwargs(self.generation.init_params, config, self.models, local_rank))

    def update(self) -> None:
        try:
            with self._fastdeploy():
                self._events = []
                self._write(UPDATING)
                if self.manager is None:
                    self.manager = self._construct()
                    self._write(NORMAL)  # first load: finalize writes nothing (fd-spec rule 32)
                else:
                    self.manager.update_parameters(self.pid)
                    if self.generation.runner_finalizes:
                        self.manager.finalize_update(self.pid)
        finally:
            self._loaded_from.clear()

    def clear(self) -> None:
        with self._fastdeploy():
            if self.manager is None:
                # FastDeploy has no manager before its first load, and nothing is loaded to clear.
                self._write(CLEARED)
                return
            self._write(CLEARING)
            self.manager.clear_parameters(self.pid)

    def observe(self) -> dict[str, Observed]:
        return observe_paddle({name: p for model in self.models for name, p in model.state_dict().items()})

    def trace(self) -> list[LoadEvent]:
        return list(self._events)

    def status(self) -> str:
        value = self._read()
        return STATUS_NAMES.get(value, f"UNKNOWN({value})")

    def close(self) -> None:
        if self._cell is None:
            return
        self._cell.close()
        self._cell.unlink()
        self._cell = None
        self.manager = None
