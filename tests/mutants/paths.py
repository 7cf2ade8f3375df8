"""Mutants of model-level correctness that only a streamed path can have (SPEC.md MODEL on rsync and GDR):
GDR loads through the models' own loaders as items arrive, in place, without a clear, so its completeness
check, its MTP routing and the place where an engine would hook its own post-load work are its own.
conformance/test_model.py catches each on the streamed paths of conformance/paths.py.

Patches follow tests/mutants/base.py: module attributes the reference looks up at call time, or a
``WeightManager`` subclass where the adapter builds it.
"""
from __future__ import annotations

from reference import gdr, rsync
from reference import hooks as _hooks
from reference import manager as _manager
from reference import transforms as _transforms

from .base import Mutant

_problems = rsync.problems
_incomplete = gdr._incomplete
_after_load = _transforms.after_load


class _Unfrozen:
    """A frozen model seen without its ``frozen`` flag."""

    def __init__(self, model):
        self._model = model
        self.post_load = {k: v for k, v in model.post_load.items() if k != "frozen"}

    def __getattr__(self, name):
        return getattr(self._model, name)


class GdrTiedByName(Mutant):
    id = "gdr_tied_by_name"
    zoo_args = ("-k", "gdr")  # the bug is the gdr path's own
    bug = ("GDR's completeness check counts parameters by name: a tied head carried under the embedding's name "
           "(one parameter object under two names) is reported missing, and every update of a tied model fails "
           "(prime-rl#2823's false 'loaded 0 of N', peers-2026 §2 item 15)")
    kills = frozenset({"MODEL-TIED"})

    def patches(self):
        def incomplete(manager, delivery, step, tracked):
            got = set(delivery.names)
            missing = [name for name in tracked if name not in got]
            if missing:
                raise RuntimeError(f"GDR stream of step {step} ended without {missing}: the update is incomplete")

        return {"reference.gdr._incomplete": incomplete}


class GdrFrozenDraftFed(Mutant):
    id = "gdr_frozen_draft_fed"
    zoo_args = ("-k", "gdr")  # the bug is the gdr path's own
    bug = ("GDR routes MTP items to every draft model, frozen ones included: a stream that rightly carries "
           "nothing for the frozen draft fails ('No MTP weights were cached'), so the main model cannot be "
           "updated at all (radixark/miles#1926's frozen draft, on the streamed path)")
    kills = frozenset({"MODEL-TRANSFORM-FROZEN"})

    def patches(self):
        return {"reference.gdr.live_models": lambda models: list(models)}


class RsyncFrozenDraftStale(Mutant):
    id = "rsync_frozen_draft_stale"
    zoo_args = ("-k", "rsync")  # the bug is the rsync path's own
    bug = ("rsync's stale-model check counts a frozen draft that receives nothing as a model left on the "
           "previous version: every update of the main model is refused")
    kills = frozenset({"MODEL-TRANSFORM-FROZEN"})

    def patches(self):
        def problems(received, params, models):
            return _problems(received, params, [_Unfrozen(m) if _transforms.is_frozen(m) else m for m in models])

        return {"reference.rsync.problems": problems}


class GdrPostLoadBeforeComplete(Mutant):
    id = "gdr_post_load_before_complete"
    zoo_args = ("-k", "gdr")  # the bug is the gdr path's own
    bug = ("on GDR the post-load steps run as soon as the models' loaders return (where a model's own "
           "load_weights ends with process_weights_after_loading), before the stream is known complete: a "
           "stream that ended without a parameter has already transposed the half-new weights and rewritten "
           "the derived buffers")
    kills = frozenset({"MODEL-TRANSFORM-FAILED"})

    def patches(self):
        def incomplete(manager, delivery, step, tracked):
            _after_load(manager.post_load)
            manager.post_load_done = True
            return _incomplete(manager, delivery, step, tracked)

        class Manager(_manager.WeightManager):
            def finalize(self):
                if not getattr(self, "post_load_done", False):
                    return super().finalize()
                self.post_load_done = False
                saved, _transforms.after_load = _transforms.after_load, lambda post: None
                try:
                    super().finalize()
                finally:
                    _transforms.after_load = saved

        return {"reference.gdr._incomplete": incomplete, "reference.adapter.WeightManager": Manager}


class GdrHooksPerLoaderCall(Mutant):
    id = "gdr_hooks_per_loader_call"
    zoo_args = ("-k", "gdr")  # the bug is the gdr path's own
    bug = ("on GDR the stale-state hooks also run after every load_weights call (each model, each MTP chunk), "
           "where an engine's loader resets its caches: several resets per update, before it is complete, and "
           "after a failed one")
    kills = frozenset({"MODEL-HOOKS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                if self.load_strategy in ("gdr", "gdr_ipc"):
                    for model in self.model_list:
                        load = getattr(model, "load_weights", None)
                        if callable(load) and not getattr(load, "hooked", False):
                            def hooked(items, load=load):
                                load(items)
                                _hooks.after_commit(self)

                            hooked.hooked = True
                            model.load_weights = hooked
                return super().update()

        return {"reference.adapter.WeightManager": Manager}
