"""Importing FastDeploy's ``dynamic_weight_manager.py`` without FastDeploy: stubs, only for what is absent.

Every generation of the file imports, at module level, some of: ``paddleformers.utils.log`` (logger),
``fastdeploy.config`` (FDConfig), ``fastdeploy.inter_communicator`` (ModelWeightsStatus, KVCacheStatus;
from DWM-EP on), ``yaml`` (from the #6852 era on, for rsync's version.yaml) and ``fastdeploy.envs``
(``from fastdeploy import envs``, GDR era and a fork of the parts era, which reads the GPU identity
through ``envs.CUDA_VISIBLE_DEVICES`` and ``envs.FLAGS_selected_gpus``); the pre-upstream DWM-0 variant
with ``ipc_no_reshard`` imports ``load_composite_checkpoint`` and ``model_loader.MODEL_CLASSES`` for its
``normal`` strategy. Inside methods the EP, rsync and GDR paths import DeepEP, ``checkpoint_transfer``
(``.core``, ``.transfer``, ``.config``) and ``load_weight_utils``. Each module that does not import here
is replaced by a stub; a module that imports is never touched. Stubs of what the suite does not drive
(EP, rsync, GDR, the ``normal`` strategy) raise when used, saying so.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
import types

from conformance.registry import ImplError

SOURCE_ENV = "CONFORMANCE_FASTDEPLOY_SOURCE"
MODULE = "fastdeploy.rl.dynamic_weight_manager"

# ModelWeightsStatus (fd-spec §2.1)
NORMAL, UPDATING, CLEARING, CLEARED = 0, 1, -1, -2
GDR_FLAG = "FD_USE_GDR_CHECKPOINT_TRANSFER"


def _status_class(name: str) -> type:
    return type(name, (), {"NORMAL": NORMAL, "UPDATING": UPDATING, "CLEARING": CLEARING, "CLEARED": CLEARED})


def _unavailable(what: str) -> type:
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is a conformance stub: the suite drives FastDeploy without it "
                           "(tensor_parallel_size=1, enable_expert_parallel=False, no rsync or GDR)")

    return type(what.rpartition(".")[2], (), {"__init__": fail, "clear_buffer": staticmethod(fail),
                                             "recreate_buffer": staticmethod(fail)})


def _fail_function(what: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is a conformance stub: the suite does not drive the path that needs it")

    return fail


# fastdeploy/envs.py reads each variable from the environment when it is read, with these defaults;
# so does the stub, for the variables a DynamicWeightManager reads. The GDR flag is engine configuration
# the adapter sets per session: a value set on the calling thread (``thread_config``) comes before the
# process environment, so sessions constructing at once on different threads each see their own.
_thread_config = threading.local()


@contextlib.contextmanager
def thread_config(**values):
    """For the block, on this thread only, the stub envs read ``values`` (name -> value) first."""
    saved = dict(getattr(_thread_config, "values", {}))
    _thread_config.values = {**saved, **values}
    try:
        yield
    finally:
        _thread_config.values = saved


def _configured(name: str, default):
    values = getattr(_thread_config, "values", {})
    return values[name] if name in values else default()


_ENVS = {
    GDR_FLAG: lambda: _configured(GDR_FLAG, lambda: bool(int(os.getenv(GDR_FLAG, "0") or "0"))),
    "CUDA_VISIBLE_DEVICES": lambda: os.getenv("CUDA_VISIBLE_DEVICES", None),
    "FLAGS_selected_gpus": lambda: os.getenv("FLAGS_selected_gpus", "0"),
}


def _envs_getattr(name: str):
    if name in _ENVS:
        return _ENVS[name]()
    raise AttributeError(f"module 'fastdeploy.envs' (conformance stub) has no attribute {name!r}")


class _Unavailable(dict):
    """A registry the suite never uses (``MODEL_CLASSES``): reading an entry says so."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def __getitem__(self, key):
        raise RuntimeError(f"{self.what} is a conformance stub: the suite does not drive the path that needs it")


def _stub_contents() -> dict[str, dict]:
    """module name -> attributes of its stub (parents before children)."""
    return {
        "fastdeploy.config": {"FDConfig": type("FDConfig", (), {"__doc__": "conformance stub: a namespace is passed"})},
        "fastdeploy.envs": {"__getattr__": _envs_getattr},
        "fastdeploy.inter_communicator": {
            "ModelWeightsStatus": _status_class("ModelWeightsStatus"),
            "KVCacheStatus": _status_class("KVCacheStatus"),
        },
        "paddleformers.utils.log": {"logger": logging.getLogger("paddleformers")},
        "yaml": {"YAMLError": type("YAMLError", (Exception,), {}), "safe_load": _fail_function("yaml.safe_load")},
        "fastdeploy.model_executor.layers.moe.ep": {
            "DeepEPBufferManager": _unavailable("fastdeploy.model_executor.layers.moe.ep.DeepEPBufferManager")
        },
        "fastdeploy.model_executor.load_weight_utils": {
            name: _fail_function(f"fastdeploy.model_executor.load_weight_utils.{name}")
            for name in ("get_weight_iterator", "load_composite_checkpoint")
        },
        "fastdeploy.model_executor.model_loader": {
            "MODEL_CLASSES": _Unavailable("fastdeploy.model_executor.model_loader.MODEL_CLASSES")
        },
        "checkpoint_transfer": {"CheckpointTransfer": _unavailable("checkpoint_transfer.CheckpointTransfer")},
        "checkpoint_transfer.core": {"RDMAWeightsDownloader": _unavailable("checkpoint_transfer.core.RDMAWeightsDownloader")},
        "checkpoint_transfer.transfer": {"CheckpointTransfer": _unavailable("checkpoint_transfer.transfer.CheckpointTransfer")},
        "checkpoint_transfer.config": {
            name: _unavailable(f"checkpoint_transfer.config.{name}") for name in ("Phase1Backend", "Role", "TransferConfig")
        },
    }


STUBBED_MODULES = tuple(_stub_contents())


def _importable(name: str, importer) -> bool:
    try:
        importer(name)
        return True
    except Exception:  # ImportError, or a module that breaks on import (e.g. needs CUDA ops)
        return False


def _stub_module(name: str, doc: str) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__path__ = []  # a package: a stubbed child can sit under it
    module.__conformance_stub__ = True
    return module


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
                modules[parent] = _stub_module(parent, "conformance stub package")
                installed.append(parent)
        module = _stub_module(name, "conformance stub for FastDeploy's DynamicWeightManager imports")
        module.__dict__.update(attrs)
        modules[name] = module
        installed.append(name)
        parent = modules.get(name.rpartition(".")[0])
        if parent is not None and getattr(parent, "__conformance_stub__", False):
            setattr(parent, parts[-1], module)  # `from fastdeploy import envs` reads the attribute
    return installed


def _fastdeploy_installed() -> bool:
    module = sys.modules.get("fastdeploy")
    if module is not None:
        return not getattr(module, "__conformance_stub__", False)
    return importlib.util.find_spec("fastdeploy") is not None


def load_class(source: str | None) -> tuple[type, types.ModuleType, str]:
    """(DynamicWeightManager, its module, where it came from) for a file or the installed FastDeploy."""
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
            raise ImplError(f"--impl=fastdeploy: cannot import {path}: {e} (a module-level import the adapter "
                            "neither finds nor stubs)") from None
        where = f"source {path} (sha256 {digest})"
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
        where = f"{getattr(fastdeploy, '__version__', 'unknown')} ({module.__file__})"
    cls = getattr(module, "DynamicWeightManager", None)
    if not isinstance(cls, type):
        raise ImplError(f"--impl=fastdeploy: {module.__file__} defines no class DynamicWeightManager")
    envs = getattr(module, "envs", None)
    if envs is not None and getattr(envs, GDR_FLAG, False):
        raise ImplError(f"--impl=fastdeploy: {GDR_FLAG} is set, so DynamicWeightManager streams weights through "
                        "CheckpointTransfer (GDR), a path the suite does not drive; unset it to test ipc_snapshot")
    return cls, module, where
