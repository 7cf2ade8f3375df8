"""A CheckpointTransfer-compatible stand-in (the real library is not public).

Importable as ``sim.checkpoint_transfer``, never as ``checkpoint_transfer``: it does not shadow a real
installation. The FastDeploy adapter maps the ``checkpoint_transfer`` names FastDeploy imports onto it
only where no real library imports (conformance/impls/fastdeploy/transfer.py); the reference chooses it
unless told otherwise (``reference.transfer_lib``). Its trainer end is ``sim.stream_trainer``; what both
ends agree on is ``sim.stream_wire``.

Modules, as FastDeploy imports them: ``config`` (Role, Phase1Backend, Phase2Backend, TransferConfig),
``transfer`` (CheckpointTransfer, WeightItem), ``core`` (RDMAWeightsDownloader, the first rsync API).
"""
from .config import Phase1Backend, Phase2Backend, Role, TransferConfig
from .core import RDMAWeightsDownloader
from .transfer import CheckpointTransfer, WeightItem

STANDIN = True

__all__ = ["CheckpointTransfer", "Phase1Backend", "Phase2Backend", "RDMAWeightsDownloader", "Role", "STANDIN",
           "TransferConfig", "WeightItem"]
