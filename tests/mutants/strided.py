"""Mutants of strided targets (SPEC.md APPLY-STRIDED-TARGET, APPLY-STRIDED-CLEARED; FastDeploy #6601, #6722).

Each replaces ``reference.apply.adopt``, which every path that adopts a tensor looks up at call time (the
snapshot levels, ipc metas, buckets, a staged commit, an rsync bootstrap load)."""
from __future__ import annotations

import math

from reference import apply as _apply
from .base import Mutant

_real_adopt = _apply.adopt


def _differs(new, target) -> bool:
    return list(new.contiguous().stride()) != list(target.stride()) and math.prod(target.shape) > 0


class ShareRegardlessOfStrides(Mutant):
    id = "share_regardless_of_strides"
    bug = ("the incoming buffer is shared into every target (`_share_buffer_to`, FastDeploy before #6601): a "
           "column-major FP8 scale keeps its strides over row-major bytes and serves its values transposed")
    kills = frozenset({"APPLY-STRIDED-TARGET", "APPLY-STRIDED-CLEARED"})

    def patches(self):
        def adopt(name, new, target):
            new.contiguous()._share_buffer_to(target)

        return {"reference.apply.adopt": adopt}


class CopyLosesLayout(Mutant):
    id = "copy_loses_layout"
    bug = ("a target whose strides differ gets a row-major copy as its new storage (`target.data = "
           "new.clone()`): the values read right, but the kernels that assume the FP8 layout get another one")
    kills = frozenset({"APPLY-STRIDED-TARGET", "APPLY-STRIDED-CLEARED"})

    def patches(self):
        def adopt(name, new, target):
            if _differs(new, target):
                target.data = new.contiguous().clone()
            else:
                _real_adopt(name, new, target)

        return {"reference.apply.adopt": adopt}


class ClearedStridedNotAllocated(Mutant):
    id = "cleared_strided_not_allocated"
    bug = ("the strided copy `target[...] = new` runs on a cleared target without allocating it first "
           "(FastDeploy between #6601 and #6722): every update after a clear fails on an FP8 scale")
    kills = frozenset({"APPLY-STRIDED-CLEARED"})

    def patches(self):
        def adopt(name, new, target):
            if _differs(new, target):
                target[...] = new.contiguous()
            else:
                _real_adopt(name, new, target)

        return {"reference.apply.adopt": adopt}
