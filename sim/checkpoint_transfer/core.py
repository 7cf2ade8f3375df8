"""``checkpoint_transfer.core.RDMAWeightsDownloader`` of the stand-in: the first rsync generation's API
(FastDeploy before #6852): one rank's whole state dict for a step, as ``paddle.save`` bytes.

The tensors cross the wire as every stream's do (msgpack items); the ``paddle.save`` bytes that this
generation's FastDeploy ``paddle.load``s are made here, in the receiving process, because that is the
API's return value: no pickle travels on the wire.
"""
from __future__ import annotations

import io

import numpy as np

from .transfer import CheckpointTransfer, config_from_kwargs


class RDMAWeightsDownloader:
    def __init__(self, config: dict):
        self.handle = CheckpointTransfer(config_from_kwargs(dict(config or {})))

    def initialize(self) -> None:
        self.handle.initialize()

    def get_weights(self, step, rank) -> np.ndarray:
        """``paddle.save`` bytes of every item of step ``step`` (a uint8 array)."""
        import paddle

        state = {item.name: item.tensor for item in self.handle._iterate(self.handle._begin("download", step, False, "paddle"))}
        buffer = io.BytesIO()
        paddle.save(state, buffer)
        return np.frombuffer(buffer.getvalue(), np.uint8)

    def cleanup(self) -> None:
        self.handle.cleanup()
