"""Mutants that only two hosts can kill: the local rank taken for the global one (issue 18).

On one host a launch makes every rank's local rank its global rank, so these pass the one-host
``multirank`` tier and the quick run; on 2 hosts x 2 ranks (``--hosts 2``) ranks 2 and 3 are local ranks
0 and 1, on the same physical GPUs as ranks 0 and 1.
"""
from __future__ import annotations

import os

from .base import Mutant

# Only the two-host job kills them: the zoo runs them with --hosts 2 (tests/test_mutant_zoo.py skips
# them, saying why, where network namespaces cannot be made).
TWO_HOSTS = ("--hosts", "2")


class LocalRankForGlobal(Mutant):
    id = "local_rank_for_global"
    bug = ("the worker's rank read from PADDLE_LOCAL_RANK (the rank within its node, set by "
           "paddle.distributed.launch; the classic sharding bug of a job that outgrew one machine) instead of "
           "paddle.distributed.get_rank(): on the second host rank 2 names its snapshot tp0.{id} and loads "
           "rank 0's shard, which sits on the same physical GPU id of the other host")
    # Rank 3 finds rank 1's files where its own are missing or broken: the failures of the snapshot path
    # never reach it, and the cell reads NORMAL after them.
    kills = frozenset({"MR-OWN-SHARD", "SNAP-RANK-OWN-SHARD", "MR-FAILURE-EVERY-RANK", "MR-AGREE-BEFORE-NORMAL",
                       "STAGE-ATOMIC"})
    zoo_args = (*TWO_HOSTS, "-k", "quick or snapshot or every_host")  # the quick run, the snapshot path, the levels
    # The quick run has one rank per host for MR-OWN-SHARD only (each the local rank 0 of its host); the failures
    # that reach rank 3 through rank 1's files need the second host's two ranks.
    tier_only = {r: "rank 3 finding rank 1's files needs two ranks on the second host (--hosts 2)"
                 for r in ("MR-AGREE-BEFORE-NORMAL", "MR-FAILURE-EVERY-RANK")}

    def patches(self):
        from reference import identity

        real = identity.global_rank

        def global_rank() -> int:
            local = os.environ.get("PADDLE_LOCAL_RANK")
            return int(local) if local is not None else real()

        return {"reference.identity.global_rank": global_rank}
