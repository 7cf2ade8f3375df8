"""A CheckpointTransfer-compatible stand-in (the real library is not public).

Importable as ``sim.checkpoint_transfer``; :func:`install_as_library` also makes it what ``import
checkpoint_transfer`` finds in this process, and only where no real library imports, so it never
shadows a real installation. The suite's stream fixtures (``fixtures.streams``) and the FastDeploy
adapter install it; the reference imports ``checkpoint_transfer`` as a production loader does
(``reference.transfer_lib``) and never names the simulator. Its trainer end is ``sim.stream_trainer``;
what both ends agree on is ``sim.stream_wire``.

Modules, as FastDeploy imports them: ``config`` (Role, Phase1Backend, Phase2Backend, TransferConfig),
``transfer`` (CheckpointTransfer, WeightItem), ``core`` (RDMAWeightsDownloader, the first rsync API).
"""
import importlib
import sys

from .config import Phase1Backend, Phase2Backend, Role, TransferConfig
from .core import RDMAWeightsDownloader
from .transfer import CheckpointTransfer, WeightItem

STANDIN = True
LIBRARY = "checkpoint_transfer"
SUBMODULES = ("config", "transfer", "core")


def _is_real(module) -> bool:
    return not getattr(module, "__conformance_stub__", False) and not getattr(module, "STANDIN", False)


def _real_library(modules) -> bool:
    module = modules.get(LIBRARY)
    if module is not None:
        return _is_real(module)
    try:
        # Through sys.modules: an earlier install in this process answers with the stand-in, not a library.
        module = importlib.import_module(LIBRARY)
    except Exception:  # noqa: BLE001 - absent, or broken here: either way not usable
        return False
    return _is_real(module)


def install_as_library(modules=None) -> bool:
    """Map ``checkpoint_transfer`` and its submodules onto this stand-in, unless a real library imports.
    Returns whether the stand-in is (now) what ``import checkpoint_transfer`` gives."""
    modules = sys.modules if modules is None else modules
    if _real_library(modules):
        return False
    modules[LIBRARY] = sys.modules[__name__]
    for name in SUBMODULES:
        modules[f"{LIBRARY}.{name}"] = importlib.import_module(f"{__name__}.{name}")
    return True

__all__ = ["CheckpointTransfer", "Phase1Backend", "Phase2Backend", "RDMAWeightsDownloader", "Role", "STANDIN",
           "TransferConfig", "WeightItem", "install_as_library"]
