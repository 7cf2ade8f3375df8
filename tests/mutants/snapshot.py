"""Mutants of the ipc_snapshot path (FastDeploy #6815/#6826/#6844/#6852/#6909 history)."""
from __future__ import annotations

from reference import snapshot_plan

from .base import Mutant

_real_plan = snapshot_plan.plan_snapshot


class HardcodedTp0(Mutant):
    id = "hardcoded_tp0"
    bug = "every rank loads rank 0's shard: base name hard-coded as tp0 (before #6852/#6909)"
    kills = frozenset({"SNAP-RANK-OWN-SHARD", "SNAP-NAME-SINGLE", "SNAP-NAME-PARTS"})

    def patches(self):
        def plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
            return _real_plan(model_dir, names, fallback_dir, fallback_names, 0, gpu_id)

        return {"reference.snapshot.plan_snapshot": plan}
