"""Mutants of storage under captured graphs (SPEC.md MODEL-STORAGE-KEPT): buffers swapped in place without a
recapture, a recapture after NORMAL or only once, strides lost. conformance/test_storage.py catches each.

Patches replace ``reference.storage`` / ``reference.rsync`` / ``reference.hooks`` functions, looked up at call
time.
"""
from __future__ import annotations

import paddle

from reference import apply as _apply
from reference import hooks as _hooks
from reference import manager as _manager
from reference import storage as _storage
from reference import transforms as _transforms

from .base import Mutant

_real_recapture = _storage.recapture
_real_after_commit = _hooks.after_commit
_real_moved = _storage.moved


def _swap_in(key, new, target) -> None:
    """FastDeploy's ``_update_model_from_state`` apply: adopt the received tensor zero-copy where the layouts
    agree (``_share_buffer_to``: the parameter now reads the new buffer), copy into the target's own layout
    where they differ."""
    new = new.contiguous()
    if 0 in tuple(target.shape):
        return
    if list(new.stride()) == list(target.stride()):
        new._share_buffer_to(target)
    else:
        target[...] = new


class RsyncSwapsInPlace(Mutant):
    id = "rsync_swaps_in_place"
    bug = ("rsync's in-place update adopts each received tensor zero-copy (`_share_buffer_to`, as the snapshot "
           "path's apply does: FastDeploy's bootstrap swap applied to loaded parameters too), and the recapture "
           "is tied to the clear (\"only a clear moves memory\"): an update without a clear moves every row-major "
           "parameter under the captured graphs and recaptures nothing (FastDeploy #8085, vLLM #48941)")
    kills = frozenset({"MODEL-STORAGE-KEPT", "RSYNC-IN-PLACE"})
    zoo_args = ("-k", "rsync")

    def patches(self):
        def store(received, params, bootstrap):
            with paddle.no_grad():
                for key, new in received.items():
                    _swap_in(key, new, params[key])

        def recapture(manager):
            before = manager._storage_before or {}
            if before and all(was[1] is None for was in before.values()):  # the update began from cleared weights
                _real_recapture(manager)

        return {"reference.rsync.store": store, "reference.storage.recapture": recapture}


class RecaptureAfterNormal(Mutant):
    id = "recapture_after_normal"
    bug = ("the graph recapture is registered as one more stale-state hook, run after the commit with the "
           "prefix-cache reset: the status is NORMAL (the update is served) before the graphs are captured on "
           "the new memory")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        def after_commit(manager):
            _real_recapture(manager)
            _real_after_commit(manager)

        return {"reference.storage.recapture": lambda manager: None, "reference.hooks.after_commit": after_commit}


class RecaptureOnce(Mutant):
    id = "recapture_once"
    bug = ("a `graphs_captured` flag set by the first recapture and never reset (the engine captures its graphs "
           "once at start-up): the first update after a clear recaptures, every later one serves graphs that "
           "point at the memory the clear released")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        done: set[int] = set()

        def recapture(manager):
            if id(manager) in done:
                return
            before = manager._storage_before
            if before is not None and _real_moved(before, manager.params):
                done.add(id(manager))
            _real_recapture(manager)

        return {"reference.storage.recapture": recapture}


class RecaptureNamesCleared(Mutant):
    id = "recapture_names_cleared"
    bug = ("the recapture names only the parameters that were cleared when the update began (the loader's "
           "own list of what it allocated), not those a buffer swap moved in place: with rsync swapping "
           "buffers in place, the hook is called with no names, and graphs reading the swapped parameters "
           "are not recaptured")
    kills = frozenset({"MODEL-STORAGE-KEPT", "RSYNC-IN-PLACE"})
    zoo_args = ("-k", "rsync")

    def patches(self):
        def store(received, params, bootstrap):
            with paddle.no_grad():
                for key, new in received.items():
                    _swap_in(key, new, params[key])

        def recapture(manager):
            hook, before = manager.commit_options.recapture, manager._storage_before
            if hook is None or before is None:
                return
            hook([n for n in _real_moved(before, manager.params) if before[n][1] is None])

        return {"reference.rsync.store": store, "reference.storage.recapture": recapture}


class StridesLostInPlace(Mutant):
    id = "strides_lost_in_place"
    bug = ("an in-place update replaces each parameter's tensor by a contiguous copy of the received one "
           "(`param.data = new.clone()`, a \"safe\" copy that owns its memory) and recaptures the graphs it "
           "moved: the values and the recapture are right, but a strided (column-major FP8 scale) parameter is "
           "row-major now, and kernels that read its strides read the wrong layout")
    kills = frozenset({"MODEL-STORAGE-KEPT", "APPLY-STRIDED-TARGET", "RSYNC-IN-PLACE"})
    zoo_args = ("-k", "rsync")

    def patches(self):
        def store(received, params, bootstrap):
            with paddle.no_grad():
                for key, new in received.items():
                    target = params[key]
                    if bootstrap and not target._is_initialized():
                        _apply.adopt(key, new, target)
                    elif 0 not in tuple(target.shape):
                        target.data = new.contiguous().clone()

        return {"reference.rsync.store": store}


class RecaptureBeforeLoad(Mutant):
    id = "recapture_before_load"
    bug = ("the graphs are recaptured when the update request arrives, before the weights load (the runner "
           "rebuilds what it cleared first): every parameter is named, but after a clear the memory the graphs "
           "are captured on does not exist yet, and the load then gives every parameter memory no graph reads")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        class EarlyRecapture(_manager.WeightManager):
            def update(self):
                if self.commit_options.recapture is not None:
                    self.commit_options.recapture(sorted(self.params))
                return super().update()

        return {"reference.adapter.WeightManager": EarlyRecapture, "reference.storage.recapture": lambda manager: None}


class SwapsWithoutHook(Mutant):
    id = "swaps_without_hook"
    bug = ("a loader that offers no recapture hook (no model.recapture) and whose rsync update adopts each received "
           "tensor zero-copy into the loaded parameter (FastDeploy's snapshot apply, `_share_buffer_to`, reused for "
           "the in-place path): every row-major parameter moves under the captured graphs, and nothing can recapture")
    kills = frozenset({"MODEL-STORAGE-KEPT", "RSYNC-IN-PLACE"})
    zoo_args = ("-k", "rsync")
    capabilities = Mutant.capabilities - {"model.recapture"}

    def patches(self):
        def store(received, params, bootstrap):
            with paddle.no_grad():
                for key, new in received.items():
                    _swap_in(key, new, params[key])

        return {"reference.rsync.store": store}


class GdrRestoresLoaded(Mutant):
    id = "gdr_restores_loaded"
    bug = ("GDR's restore step gives every parameter fresh memory before the stream loads (FastDeploy's "
           "`paddle.empty(shape)._share_buffer_to(param)` of restore_cleared_params, its `_is_initialized()` check "
           "dropped), and the recapture is tied to the clear: an update in place moves every parameter under the "
           "captured graphs and recaptures nothing")
    kills = frozenset({"MODEL-STORAGE-KEPT"})
    zoo_args = ("-k", "gdr")

    def patches(self):
        from reference import mtp_routing as _routing

        real_load = _routing.load_models

        def load_models(models, items, *args, **kwargs):
            with paddle.no_grad():
                for model in models:
                    for p in model.state_dict().values():
                        if 0 not in tuple(p.shape) and p.is_contiguous():
                            paddle.empty(list(p.shape), dtype=p.dtype)._share_buffer_to(p)
            return real_load(models, items, *args, **kwargs)

        def recapture(manager):
            before = manager._storage_before or {}
            if before and all(was[1] is None for was in before.values()):  # the update began from cleared weights
                _real_recapture(manager)

        return {"reference.mtp_routing.load_models": load_models, "reference.storage.recapture": recapture}


class TransposeSwapsInPlace(Mutant):
    id = "transpose_swaps_in_place"
    bug = ("the post-load transpose swaps the transposed tensor in (`new._share_buffer_to(param)`, FastDeploy's "
           "process_weight_transpose frees the old weight and swaps in the new one, fd-spec §3.8), and the recapture "
           "is tied to the clear: an rsync or GDR update in place moves every transposed weight under the captured "
           "graphs and recaptures nothing")
    kills = frozenset({"MODEL-STORAGE-KEPT"})
    zoo_args = ("-k", "transform")

    def patches(self):
        def transpose(t):
            new = None
            if 0 not in t.served:
                axes = list(range(len(t.loaded)))
                new = paddle.transpose(t.param, axes[:-2] + [axes[-1], axes[-2]]).contiguous()
            _transforms._set_shape(t.param, t.served)
            if new is not None:
                new._share_buffer_to(t.param)

        def recapture(manager):
            before = manager._storage_before or {}
            if before and all(was[1] is None for was in before.values()):  # the update began from cleared weights
                _real_recapture(manager)

        return {"reference.transforms.transpose": transpose, "reference.storage.recapture": recapture}


class RecaptureBeforeInPlaceTranspose(Mutant):
    id = "recapture_before_in_place_transpose"
    bug = ("the commit recaptures the graphs as soon as the last byte landed, before the model's post-load steps, "
           "whose transpose writes into the weight's own memory (its address stays): the graph is captured with the "
           "loaded layout's shape and strides (the trainer's), and then reads the served weight with the wrong ones")
    kills = frozenset({"MODEL-STORAGE-KEPT"})

    def patches(self):
        real_after_load = _transforms.after_load

        def recapture(manager):
            _real_recapture(manager)
            real_after_load(manager.post_load)

        return {"reference.storage.recapture": recapture, "reference.transforms.after_load": lambda post: None}
