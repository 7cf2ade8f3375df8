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

Trace: the instance's ``_update_model_from_state`` is wrapped to record ``(src_type, source)`` for each
state dict it applies without raising. FastDeploy does not pass the file to it, so the session notes the
file each ``paddle.load`` result came from (``worker_world``'s load hook, result unchanged) and pairs
them; a state dict from no file (ipc) gets ``None``.
"""
from __future__ import annotations

import itertools
import os
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from conformance.adapter import LoaderConfig, LoadEvent, Observed, observe_paddle

from .generation import Generation, constructor_kwargs
from .stubs import CLEARED, CLEARING, NORMAL, UPDATING
from .world import WORKER_ENV, fd_config, worker_world

STATUS_NAMES = {NORMAL: "NORMAL", UPDATING: "UPDATING", CLEARING: "CLEARING", CLEARED: "CLEARED"}
_pids = itertools.count(1)


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
        self._loaded_from: dict[int, str] = {}  # id(state dict) -> file, while an update runs
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
            self._loaded_from[id(result)] = os.fspath(path)
            return result

        return worker_world(self.env, self.config.shared_dir, load_hook=load)

    def _construct(self):
        # Instantiated in two steps so that the instance's _update_model_from_state is traced during
        # the load its constructor performs; this is what DynamicWeightManager(...) does.
        manager = self._cls.__new__(self._cls)
        applied = manager._update_model_from_state

        def traced(state_dict, src_type):
            source = self._loaded_from.pop(id(state_dict), None)
            result = applied(state_dict, src_type)
            self._events.append(LoadEvent(src_type, source))
            return result

        manager._update_model_from_state = traced
        selected = self.env.get("FLAGS_selected_gpus") or "0"
        local_rank = int(selected) if selected.isdigit() else 0
        config = fd_config(self.config.load_strategy, self.config.model_dir, self.config.options, self.pid)
        self._cls.__init__(manager, **constructor_kwargs(self.generation.init_params, config, self.models, local_rank))
        return manager

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
