"""``--impl=fastdeploy``: drive FastDeploy's own ``DynamicWeightManager``.

Where the class comes from, in order:
  * ``--impl-opt source=PATH`` (or ``CONFORMANCE_FASTDEPLOY_SOURCE=PATH``): a
    ``dynamic_weight_manager.py`` file, e.g. from a FastDeploy checkout;
  * an installed ``fastdeploy`` (``fastdeploy.rl.dynamic_weight_manager``).
Modules that file imports but that cannot be imported here (FastDeploy's config and signal classes,
paddleformers' logger, DeepEP, checkpoint_transfer) are replaced by small stubs, and only those.

Session mapping (FastDeploy's legacy shared-memory control path, fd-spec §2.2 and §2.6-2.7). The
adapter plays the engine and the runner; every weight operation is FastDeploy's own method:
  * ``update()``, first time: ``DynamicWeightManager(fd_config, models, local_rank)``; its
    constructor captures the parameters, loads them and calls ``finalize_update()``.
  * ``clear()``: ``clear_parameters(pid)``.
  * ``update()`` afterwards: ``update_parameters(pid)`` then ``finalize_update(pid)``.
Status: FastDeploy writes an int32 into the shared-memory cell ``model_weights_status.{pid}``; the
adapter creates that 4-byte cell per session (a unique ``pid``), reads it for ``status()`` and
unlinks it at ``close()``. Like the engine, the adapter writes CLEARING before a clear and UPDATING
before an update; FastDeploy writes CLEARED after a clear and NORMAL after a *non-first*
``finalize_update``. The first load writes nothing (fd-spec rule 32: in FastDeploy the engine's cell
already reads NORMAL while the worker starts), so the adapter writes NORMAL itself once the
constructor has returned. A cell not yet used reads CLEARED: nothing is loaded. A failed update thus
leaves UPDATING.
Trace: the instance's ``_update_model_from_state`` is wrapped to record ``(src_type, source)`` for each
state dict it applies without raising. FastDeploy does not pass the file path to it, so during an
update the adapter watches ``paddle.load`` (without changing what it returns) and pairs each state
dict with the file it was loaded from; a state dict that came from no file (ipc) gets ``None``.
Worker identity: each FastDeploy worker is its own process, so the session keeps the environment it
was opened with (rank and GPU variables) and reinstates it around every call into FastDeploy.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import itertools
import logging
import os
import sys
import types
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from conformance.adapter import LoaderConfig, LoadEvent, Observed, observe_paddle
from conformance.registry import ImplError

SOURCE_ENV = "CONFORMANCE_FASTDEPLOY_SOURCE"
MODULE = "fastdeploy.rl.dynamic_weight_manager"
WORKER_ENV = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus")

# ModelWeightsStatus (fd-spec §2.1)
NORMAL, UPDATING, CLEARING, CLEARED = 0, 1, -1, -2
STATUS_NAMES = {NORMAL: "NORMAL", UPDATING: "UPDATING", CLEARING: "CLEARING", CLEARED: "CLEARED"}


# -- stubs for FastDeploy's imports ----------------------------------------------------------------
def _status_class(name: str) -> type:
    return type(name, (), {"NORMAL": NORMAL, "UPDATING": UPDATING, "CLEARING": CLEARING, "CLEARED": CLEARED})


def _unavailable(what: str) -> type:
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is a conformance stub: the suite drives FastDeploy without it "
                           "(tensor_parallel_size=1, enable_expert_parallel=False)")

    return type(what.rpartition(".")[2], (), {"__init__": fail, "clear_buffer": staticmethod(fail),
                                             "recreate_buffer": staticmethod(fail)})


def _stub_contents() -> dict[str, dict]:
    """module name -> attributes of its stub."""
    return {
        "fastdeploy.config": {"FDConfig": type("FDConfig", (), {"__doc__": "conformance stub: a namespace is passed"})},
        "fastdeploy.inter_communicator": {
            "ModelWeightsStatus": _status_class("ModelWeightsStatus"),
            "KVCacheStatus": _status_class("KVCacheStatus"),
        },
        "paddleformers.utils.log": {"logger": logging.getLogger("paddleformers")},
        "fastdeploy.model_executor.layers.moe.ep": {
            "DeepEPBufferManager": _unavailable("fastdeploy.model_executor.layers.moe.ep.DeepEPBufferManager")
        },
        "checkpoint_transfer": {"CheckpointTransfer": _unavailable("checkpoint_transfer.CheckpointTransfer")},
    }


STUBBED_MODULES = tuple(_stub_contents())


def _importable(name: str, importer) -> bool:
    try:
        importer(name)
        return True
    except Exception:  # ImportError, or a module that breaks on import (e.g. needs CUDA ops)
        return False


def install_stubs(modules: dict | None = None, importer=importlib.import_module) -> list[str]:
    """Put a stub into ``modules`` (default ``sys.modules``) for each module FastDeploy's DWM imports
    that does not import here, plus stub parent packages that do not import either. Returns the
    names stubbed; a module that imports is never touched."""
    modules = sys.modules if modules is None else modules
    installed = []
    for name, attrs in _stub_contents().items():
        if name in modules or _importable(name, importer):
            continue
        parts = name.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            if parent not in modules and not _importable(parent, importer):
                package = types.ModuleType(parent, "conformance stub package")
                package.__path__ = []
                package.__conformance_stub__ = True
                modules[parent] = package
                installed.append(parent)
        module = types.ModuleType(name, "conformance stub for FastDeploy's DynamicWeightManager imports")
        module.__conformance_stub__ = True
        module.__dict__.update(attrs)
        modules[name] = module
        installed.append(name)
        parent = modules.get(name.rpartition(".")[0])
        if parent is not None and getattr(parent, "__conformance_stub__", False):
            setattr(parent, parts[-1], module)
    return installed


def _fastdeploy_installed() -> bool:
    module = sys.modules.get("fastdeploy")
    if module is not None:
        return not getattr(module, "__conformance_stub__", False)
    return importlib.util.find_spec("fastdeploy") is not None


def _load_class(source: str | None) -> tuple[type, str]:
    """(DynamicWeightManager, version string)."""
    if source:
        path = os.path.abspath(source)
        if not os.path.isfile(path):
            raise ImplError(f"--impl=fastdeploy: source file {path} does not exist (from --impl-opt source= or {SOURCE_ENV})")
        install_stubs()
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        name = f"_conformance_fastdeploy_dwm_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except ImportError as e:
            del sys.modules[name]
            raise ImplError(f"--impl=fastdeploy: cannot import {path}: {e}") from None
        version = f"source {path} (sha256 {digest})"
    else:
        if not _fastdeploy_installed():
            raise ImplError(
                "--impl=fastdeploy: FastDeploy is not installed (no module 'fastdeploy'); install it, or point "
                f"the adapter at a dynamic_weight_manager.py with --impl-opt source=PATH (or {SOURCE_ENV}=PATH)"
            )
        install_stubs()
        try:
            module = importlib.import_module(MODULE)
        except ImportError as e:
            raise ImplError(f"--impl=fastdeploy: cannot import {MODULE}: {e}") from None
        fastdeploy = sys.modules["fastdeploy"]
        version = f"{getattr(fastdeploy, '__version__', 'unknown')} ({module.__file__})"
    cls = getattr(module, "DynamicWeightManager", None)
    if not isinstance(cls, type):
        raise ImplError(f"--impl=fastdeploy: {module.__file__} defines no class DynamicWeightManager")
    return cls, version


# -- the session ------------------------------------------------------------------------------------
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
    def __init__(self, dwm_class: type, models: list, config: LoaderConfig):
        self._cls = dwm_class
        self.models = list(models)
        self.config = config
        self.env = {k: os.environ.get(k) for k in WORKER_ENV}
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

    @contextlib.contextmanager
    def _as_worker(self):
        """Reinstate this worker's identity (its process environment) for a call into FastDeploy."""
        from paddle.distributed import parallel

        saved = {k: os.environ.get(k) for k in WORKER_ENV}

        def apply(values):
            for key, value in values.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            parallel._global_parallel_env = None  # paddle.distributed.get_rank() re-reads the env

        apply(self.env)
        try:
            yield
        finally:
            apply(saved)

    @contextlib.contextmanager
    def _watching_loads(self):
        """Note the file each ``paddle.load`` result came from, for the trace's sources."""
        import paddle

        real_load = paddle.load

        def load(path, **configs):
            result = real_load(path, **configs)
            if isinstance(path, (str, os.PathLike)):
                self._loaded_from[id(result)] = os.fspath(path)
            return result

        paddle.load = load
        try:
            yield
        finally:
            paddle.load = real_load
            self._loaded_from.clear()

    def _fd_config(self) -> types.SimpleNamespace:
        ns = types.SimpleNamespace
        return ns(
            load_config=ns(load_strategy=self.config.load_strategy, dynamic_load_weight=True,
                           rsync_config=self.config.options.get("rsync_config")),
            parallel_config=ns(
                tensor_parallel_rank=0, tensor_parallel_size=1, enable_expert_parallel=False,
                local_data_parallel_id=0, expert_parallel_rank=0, tp_group=None, ep_group=None,
                local_engine_worker_queue_port=self.pid, shutdown_comm_group_if_worker_idle=False,
            ),
            model_config=ns(model=self.config.model_dir),
        )

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
        # The runner passes the model alone, or [model, mtp model] (fd-spec §1.3).
        models = self.models[0] if len(self.models) == 1 else self.models
        self._cls.__init__(manager, self._fd_config(), models, local_rank)
        return manager

    def update(self) -> None:
        with self._as_worker(), self._watching_loads():
            self._events = []
            self._write(UPDATING)
            if self.manager is None:
                self.manager = self._construct()
                self._write(NORMAL)  # first load: finalize_update writes nothing (fd-spec rule 32)
            else:
                self.manager.update_parameters(self.pid)
                self.manager.finalize_update(self.pid)

    def clear(self) -> None:
        with self._as_worker():
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


class FastDeployAdapter:
    name = "fastdeploy"
    # Not snapshot.shared_fallback: FastDeploy hard-codes /shared_ipc_meta, which the suite cannot
    # redirect. Not ipc.meta: its ipc path needs paddle-gpu's _new_shared_cuda. No ipc_bucket path.
    capabilities = frozenset({"snapshot.parts", "snapshot.single", "snapshot.legacy", "trace", "status", "mtp"})

    def __init__(self, source: str | None = None):
        self.source = source or os.environ.get(SOURCE_ENV) or None
        self.dwm_class, self.version = _load_class(self.source)

    def open(self, models, config: LoaderConfig) -> FastDeploySession:
        return FastDeploySession(self.dwm_class, models, config)
