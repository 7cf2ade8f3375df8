"""``--impl=fastdeploy``: drive FastDeploy's own ``DynamicWeightManager``, whichever generation it is.

Where the class comes from, in order:
  * ``--impl-opt source=PATH`` (or ``CONFORMANCE_FASTDEPLOY_SOURCE=PATH``): a ``dynamic_weight_manager.py``
    file, e.g. from a FastDeploy checkout of any era;
  * an installed ``fastdeploy`` (``fastdeploy.rl.dynamic_weight_manager``).
Modules the file imports that cannot be imported here are replaced by stubs, and only those (stubs.py).

The adapter reads from the class how to call it and what it can be driven on (generation.py): the
constructor's parameters, who finalizes an update, and, by a dry run, which ipc_snapshot levels it reads
and in which format. Its capabilities follow from that, and so does the format in which the suite
writes the legacy ``tp0{id}`` file (``snapshot_formats``: ``paddle.save`` before #6852). What it cannot
drive is an ``ImplError`` (a usage error naming the cause), never a list of failed rules. Every call into
FastDeploy runs in the worker's world (world.py): its identity, ``/shared_ipc_meta`` mapped to the
test's shared directory, barriers for a lone rank. Sessions: session.py.

FastDeploy serves on GPUs (``serves_on = "gpu"``): rules whose outcome depends on the device are judged
for a GPU, and are not applicable to a CPU run (SPEC.md ``Device:`` lines).
"""
from __future__ import annotations

import os

from conformance.adapter import LoaderConfig

from . import streams
from .generation import Generation, derive
from .session import STATUS_NAMES, FastDeploySession
from .stubs import SOURCE_ENV, STUBBED_MODULES, install_stubs, load_class
from .world import SHARED_IPC_DIR, map_shared

__all__ = ["FastDeployAdapter", "FastDeploySession", "Generation", "SOURCE_ENV", "STUBBED_MODULES", "STATUS_NAMES",
           "SHARED_IPC_DIR", "install_stubs", "load_class", "map_shared"]


class FastDeployAdapter:
    name = "fastdeploy"
    serves_on = "gpu"

    def __init__(self, source: str | None = None):
        self.source = source or os.environ.get(SOURCE_ENV) or None
        self.dwm_class, self.module, where = load_class(self.source)
        self.generation = derive(self.dwm_class)
        self.capabilities = self.generation.capabilities
        self.snapshot_formats = {"legacy": self.generation.levels.get("legacy", "safetensors")}
        self.version = f"{where}; {self.generation.describe()}"
        self.notes = [f"not claimed: {c} ({why})" for c, why in self.generation.not_claimed.items()]
        self.notes += list(self.generation.notes)
        # The streamed paths (rsync, GDR) against the CheckpointTransfer stand-in: streams.py.
        stream_caps, stream_why = streams.capabilities(self.dwm_class, streams.install_standin())
        self.capabilities = self.capabilities | stream_caps
        self.notes += [f"not claimed: {c} ({why})" for c, why in stream_why.items()]

    def control(self, cell_name: str):
        """The engine's control API over the status cell (EngineClient's ``clear_load_weight`` and
        ``update_model_weight``, fd-spec §2.3): the engine's code, not the manager's, so the adapter plays
        it, with the suite's reference rendering of those guards; FastDeploy's worker answers in the cell."""
        from weightsync.reference.control import WeightControl

        return WeightControl(cell_name)

    def open(self, models, config: LoaderConfig) -> FastDeploySession:
        if config.load_strategy in streams.STRATEGIES:
            return streams.StreamSession(self.dwm_class, self.generation, models, config)
        return FastDeploySession(self.dwm_class, self.generation, models, config)
