"""One FastDeploy worker: the adapter plays the engine and the runner; every weight operation is
FastDeploy's own method (legacy shared-memory control path, fd-spec §2.2 and §2.6-2.7).

* ``update()``, first time: ``DynamicWeightManager(...)`` (arguments by name, see generation.py); its
  constructor captures the parameters, loads them and finalizes.
* ``clear()``: the runner's ``clear_parameters(pid)``: the manager's ``clear_parameters(pid)`` (with
  ``shutdown_process_group=False`` where it takes the flag: the engine's default
  ``shutdown_comm_group_if_worker_idle``).
* ``update()`` afterwards: the runner's ``update_parameters(pid)``: the manager's ``update_parameters(pid)``
  (``restart_process_group=False`` likewise), then ``finalize_update(pid)`` where the class leaves that to
  the runner (DWM-0's ``update_parameters`` finalizes itself).
* ``worker_iteration(run_model, block=, sync=, runner=)``: FastDeploy's own ``check_model_weights_status``
  in worker_process.py's loop (loop.py), where the class has one.
* ``sleep(["weight"])`` / ``wakeup(["weight"])`` (the V1 control path, where the class has #6761's split
  operations): the runner's ``sleep`` / ``wakeup`` of the weight tag, which call the manager's own
  ``clear_model_weight()`` and ``clear_communication_group()``, then ``restart_communication_group()`` and
  ``reload_model_weights()``, and the runner's ``capture_model()`` (fd-spec §2.8). The runner's bookkeeping of
  what sleeps (``is_weight_sleeping``: a call that finds the weights already asleep, or awake, does nothing) is
  the runner's, played here; the tag loop, the KV cache, pausing and resuming are the runner's and the engine's,
  not claimed. The V1 path writes nothing to the status cell (FastDeploy's engine uses no cell there).

Status: FastDeploy writes an int32 into the shared-memory cell ``model_weights_status.{pid}``.

* With ``options["status_cell"]`` (the suite's cell, ``model_weights_status.{suffix}``: ``pid`` is the
  suffix), the suite plays the engine and the API: the adapter writes nothing there, FastDeploy writes
  what it writes (CLEARED after a clear and NORMAL after a non-first finalize, on tensor-parallel rank 0:
  ``global rank % options["tp_size"]``, default the world size, in ``fd_config``), and ``status()`` reads it.
* Without it, the session creates a private 4-byte cell (a unique ``pid``, unlinked at ``close()``) and
  plays the engine and its control API there: CLEARING before a clear and UPDATING before an update (the
  API's requests), and the engine-created cell's NORMAL once the worker's first load has returned (the
  engine's cell reads NORMAL from its creation, fd-spec rule 32; until the worker has started, the private
  cell reads CLEARED: nothing is loaded). CLEARED after a clear and NORMAL after a later update are
  FastDeploy's writes, never the adapter's: a generation that leaves the cell wrong is judged on it. A
  failed update thus leaves UPDATING. The worker of a private cell is tensor-parallel rank 0 of one.

Graphs (capability ``model.recapture``): ``options["recapture"]`` stands for the runner's ``capture_model()``,
called, with every parameter's name (the runner recaptures the whole graph), where FastDeploy's runner
recaptures: after the startup load, and after ``update_parameters(pid)`` before ``finalize_update(pid)``
(fd-spec §2.7 step 3); where ``update_parameters`` finalizes itself (DWM-0), after it returns, as that
runner's capture follows the call. The streamed paths: streams.py.

Trace: observed, never wrapped. Every generation ends a successful ``_update_model_from_state`` with its
own log line ``Updated {n}/{m} parameters from {src_type} source`` (on its module's ``logger``); a handler
on that logger, for the duration of the call and for the calling thread only, reads ``src_type`` from it.
FastDeploy does not log the file, so the session notes the path of each ``paddle.load`` (``worker_world``'s
load hook, result unchanged) and pairs the line with the last file loaded since the previous line (None
when none was). The manager's methods are its own: the constructor is called as the runner calls it.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
import os
import re
import sys
import threading
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from conformance.adapter import LoaderConfig, LoadEvent, Observed, observe_paddle

from . import loop
from .generation import Generation, constructor_kwargs
from .stubs import CLEARED, CLEARING, NORMAL, UPDATING
from .world import WORKER_ENV, bounded, fd_config, real_group, worker_world

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


def _group_timeout(options: dict) -> float:
    """The adapter's own option (FastDeploy's manager has none): the deadline of the world's barriers and
    broadcasts (world.py), 30 s unless given; anything but a positive finite number of seconds is refused."""
    timeout = options.get("agree_timeout_s", 30.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"options['agree_timeout_s'] must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


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
        options = dict(config.options)
        self.tp_rank, self.tp_size = 0, 1
        self.cell_name = self.kv_cell_name = None
        self._cell = None
        tensor_parallel = _tensor_parallel(self.env, options.get("tp_size"))
        # A rank of several under paddle.distributed (the multirank tier): barriers and the loop's broadcast
        # on the real group, bounded by the process group's timeout (world.py).
        self.real_ranks = real_group()
        self.group_timeout_s = _group_timeout(options)
        if options.get("status_cell") is not None:
            self.pid = loop.cell_suffix(options["status_cell"])
            self.cell_name = options["status_cell"]
            self.tp_rank, self.tp_size = tensor_parallel
        else:
            self.pid, self._cell = _status_cell()
            self.cell_name = self._cell.name
            self._write(CLEARED)  # the worker has not started: nothing loaded
        if options.get("kv_cache_cell") is not None:
            loop.check_cell(options["kv_cache_cell"], "kv_cache_cell")
            self.kv_cell_name = options["kv_cache_cell"]
        self._weight_sleeping = False  # the runner's is_weight_sleeping (the V1 path: sleep / wakeup)
        self._recapture = options.get("recapture")
        if self._recapture is not None and not callable(self._recapture):
            raise ValueError(f"options['recapture'] must be a callable, got {self._recapture!r}")

    def capture_model(self) -> None:
        """The runner's CUDA graph capture over the served models (the suite's hook, when it passed one)."""
        if self._recapture is not None:
            self._recapture(sorted(n for model in self.models for n in model.state_dict()))

    # the engine's side of a private status cell (never of the suite's)
    def _write(self, value: int) -> None:
        if self._cell is not None:
            self._cell.buf[:4] = np.array([value], dtype=np.int32).tobytes()

    def _read(self) -> int:
        with loop.signal(self.cell_name) as cell:
            return int(cell.value[0])

    def _config(self, load_strategy: str, shutdown: bool = False):
        return fd_config(load_strategy, self.config.model_dir, self.config.options, self.pid,
                         tp_rank=self.tp_rank, tp_size=self.tp_size, shutdown_comm_group=shutdown)

    def _fastdeploy(self, groups=None):
        def load(path, configs, real_load):
            result = real_load(path, **configs)
            self._loaded_from.append(os.fspath(path))
            return result

        def applied(src_type):
            source = self._loaded_from[-1] if self._loaded_from else None
            self._loaded_from.clear()
            self._events.append(LoadEvent(src_type, source))

        stack = contextlib.ExitStack()
        stack.enter_context(worker_world(self.env, self.config.shared_dir, load_hook=load, groups=groups,
                                         real_ranks=self.real_ranks, group_timeout_s=self.group_timeout_s))
        stack.enter_context(observe_applied(getattr(sys.modules.get(self._cls.__module__), "logger", None), applied))
        return stack

    def _construct(self):
        # The runner's call: the constructor captures the parameters, loads them and finalizes.
        selected = self.env.get("FLAGS_selected_gpus") or "0"
        local_rank = int(selected) if selected.isdigit() else 0
        config = self._config(self.config.load_strategy)
        return self._cls(**constructor_kwargs(self.generation.init_params, config, self.models, local_rank))

    def update(self) -> None:
        self._write(UPDATING)  # the API's request
        if self.manager is None:
            try:
                with self._fastdeploy():
                    self._events = []
                    self.manager = self._construct()
            finally:
                self._loaded_from.clear()
            self.capture_model()  # the runner captures its graphs after the startup load
            self._write(NORMAL)  # the engine's cell reads NORMAL once the worker has started (fd-spec rule 32)
            return
        self.runner_update(self.pid, False)

    def clear(self) -> None:
        if self.manager is None:
            return  # FastDeploy has no manager before its first load, and nothing is loaded to clear
        self._write(CLEARING)  # the API's request
        self.runner_clear(self.pid, False)

    # the runner's calls into the manager (fd-spec §2.6-2.7)
    def runner_update(self, pid, restart: bool, groups=None) -> None:
        """The runner's ``update_parameters(pid)``: the manager's, then ``finalize_update(pid)`` where the
        runner finalizes; ``restart_process_group`` passed where the manager takes it."""
        if self.manager is None:
            raise RuntimeError("FastDeploy adapter: the worker loop runs after the first update() (the worker's startup load)")
        try:
            with self._fastdeploy(groups):
                self._events = []
                flag = _flag(self.manager.update_parameters, "restart_process_group", restart)
                self.manager.update_parameters(pid, **flag)
                self.capture_model()  # the runner's capture_model(), before its finalize_update (fd-spec §2.7)
                if self.generation.runner_finalizes:
                    self.manager.finalize_update(pid)
        finally:
            self._loaded_from.clear()

    def runner_clear(self, pid, shutdown: bool, groups=None) -> None:
        """The runner's ``clear_parameters(pid)``: the manager's, ``shutdown_process_group`` passed where it takes it."""
        with self._fastdeploy(groups):
            self.manager.clear_parameters(pid, **_flag(self.manager.clear_parameters, "shutdown_process_group", shutdown))

    # -- the V1 control path: the runner's sleep / wakeup of the weights (capability control.sleep) ------------
    V1_COMM_GROUPS = True  # shutdown_comm_group_if_worker_idle: FastDeploy's default without EP (its DOC)

    def _v1_world(self):
        return self._fastdeploy()

    @staticmethod
    def _weight_tag(tags) -> bool:
        """Whether the call names the weights; the KV cache is the runner's (not claimed: control.kv_cache)."""
        names = ["weight", "kv_cache"] if tags is None else (tags.split(",") if isinstance(tags, str) else list(tags))
        other = [t for t in names if t != "weight"]
        if other:
            raise NotImplementedError(f"FastDeploy adapter: tag(s) {other}: the KV cache lives in FastDeploy's runner "
                                      "(clear_cache / initialize_kv_cache), not in DynamicWeightManager")
        return "weight" in names

    def sleep(self, tags=None) -> None:
        """The runner's ``sleep("weight")`` (fd-spec §2.8): ``clear_deepep_buffer()`` under EP (never here),
        ``clear_model_weight()``, then ``clear_communication_group()`` with the engine's flag; nothing if the weights
        already sleep (the runner's bookkeeping, ``is_weight_sleeping``)."""
        if not self._weight_tag(tags) or self.manager is None or self._weight_sleeping:
            return
        with self._v1_world():
            self.manager.clear_model_weight()
            if self.V1_COMM_GROUPS:
                self.manager.clear_communication_group()
        self._weight_sleeping = True

    def wakeup(self, tags=None) -> None:
        """The runner's ``wakeup("weight")``: ``restart_communication_group()`` with the engine's flag,
        ``recreate_deepep_buffer()`` under EP (never here), ``reload_model_weights()``, then ``capture_model()``;
        the weights are awake only once all returned; nothing if they do not sleep."""
        if not self._weight_tag(tags) or self.manager is None or not self._weight_sleeping:
            return
        with self._v1_world():
            if self.V1_COMM_GROUPS:
                self.manager.restart_communication_group()
            self.manager.reload_model_weights()
        self.capture_model()
        self._weight_sleeping = False

    def update_weights(self, version=None, verify_checksum: bool = False):
        raise NotImplementedError("FastDeploy adapter: update_weights is the rsync path's (update_weights_by_rdma): "
                                  "open the session with load_strategy 'rsync'")

    def worker_iteration(self, run_model, *, block: bool, sync=None, runner=None) -> str:
        """One pass of the worker's loop around FastDeploy's own ``check_model_weights_status`` (loop.py)."""
        fn, why = loop.check_function(self._cls)
        if fn is None:
            raise NotImplementedError(f"FastDeploy adapter: no worker loop to drive ({why})")
        if self._cell is not None:
            raise ValueError("FastDeploy adapter: the worker loop needs options['status_cell'], the engine's status cell")
        if sync is None and self.real_ranks:
            sync = self._broadcast_rank0  # worker_process.py broadcasts rank 0's value to the others
        return loop.iteration(self, fn, run_model, block=block, sync=sync, runner=runner)

    def _broadcast_rank0(self, value: int) -> int:
        """worker_process.py's ``paddle.distributed.broadcast`` of the status from rank 0, on the real group,
        within the process group's timeout."""
        import paddle
        import paddle.distributed as dist

        box = paddle.to_tensor(np.array([value], np.int32))
        bounded(lambda: dist.broadcast(box, src=0), self.group_timeout_s, "paddle.distributed.broadcast")
        return int(box.numpy()[0])

    def observe(self) -> dict[str, Observed]:
        return observe_paddle({name: p for model in self.models for name, p in model.state_dict().items()})

    def trace(self) -> list[LoadEvent]:
        return list(self._events)

    def status(self) -> str:
        value = self._read()
        return STATUS_NAMES.get(value, f"UNKNOWN({value})")

    def close(self) -> None:
        self.manager = None
        if self._cell is None:
            return  # the suite's cell is the suite's to unlink
        self._cell.close()
        self._cell.unlink()
        self._cell = None


def _flag(method, name: str, value: bool) -> dict:
    """``{name: value}`` where ``method`` takes that parameter (generations before #5493 take none)."""
    return {name: value} if name in inspect.signature(method).parameters else {}


def _tensor_parallel(env: dict, tp_size) -> tuple[int, int]:
    """(tensor-parallel rank, size) of this worker as the engine launches it: ``global rank % tp_size``,
    ``tp_size`` the world size unless the option says otherwise."""
    if tp_size is not None and (not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1):
        raise ValueError(f"options['tp_size'] must be a positive int, got {tp_size!r}")
    rank = int(env.get("PADDLE_TRAINER_ID") or 0)
    world = int(env.get("PADDLE_TRAINERS_NUM") or 1)
    size = tp_size or max(world, 1)
    return rank % size, size
