"""Mutants of model-level correctness (SPEC.md MODEL): post-load transforms, frozen drafts, fp8 scales,
tied pairs, fused layouts, stale-state hooks and declarations. Each is a bug engines shipped or an outside
implementer plausibly writes; conformance/test_model.py catches it on every path.

Patches replace ``reference.transforms`` / ``reference.hooks`` functions (looked up at call time), or put a
``WeightManager`` subclass where the adapter builds it.
"""
from __future__ import annotations

import paddle

from reference import hooks as _hooks
from reference import manager as _manager
from reference import transforms as _transforms
from .base import Mutant

_real_after_load = _transforms.after_load
_real_transpose = _transforms.transpose
_real_plan = _transforms.plan
_real_before_load = _transforms.before_load
_real_fused = _transforms.fused


def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


# -- transforms ------------------------------------------------------------------------------------------
class TransformEveryReload(Mutant):
    id = "transform_every_reload"
    bug = ("the post-load step keeps a list of weights to transform that every update appends to and none "
           "clears (peers-2026 §2 item 4: post-processing that is not idempotent): update k transposes each "
           "weight k times, so the second update serves the untransposed bytes under the served shape")
    kills = frozenset({"MODEL-TRANSFORM-ONCE", "MODEL-FORWARD"})

    def patches(self):
        pending: dict[int, int] = {}

        def after_load(post):
            pending[id(post)] = pending.get(id(post), 0) + 1
            with paddle.no_grad():
                for t in post.transposes:
                    for _ in range(pending[id(post)]):  # the second pass transposes the transposed weight back
                        _real_transpose(t)
            _real_after_load(_transforms.PostLoad([], post.derived))

        return {"reference.transforms.after_load": after_load}


class TransformSkippedOnReload(Mutant):
    id = "transform_skipped_on_reload"
    bug = ("post-load processing runs on the first load only (a first_load flag, as FastDeploy's transposes "
           "run once at construction): a reload serves the new weights in checkpoint layout, with stale "
           "fused and dequantised buffers")
    kills = frozenset({"MODEL-TRANSFORM-ONCE", "MODEL-FORWARD", "MODEL-QUANT-SCALE", "MODEL-HOOKS"})

    def patches(self):
        done: set[int] = set()

        def after_load(post):
            if id(post) not in done:
                done.add(id(post))
                _real_after_load(post)

        return {"reference.transforms.after_load": after_load}


class TransposeByReshape(Mutant):
    id = "transpose_by_reshape"
    bug = ("the transpose only relabels the shape (the loaded bytes are adopted under the served shape, as "
           "_share_buffer_to into a parameter of the served shape does): every byte the trainer sent lands, "
           "a byte round trip passes, and the layout is wrong")
    kills = frozenset({"MODEL-TRANSFORM-ONCE", "MODEL-FORWARD"})

    def patches(self):
        def transpose(t):
            _transforms._set_shape(t.param, t.served)

        return {"reference.transforms.transpose": transpose}


class ExpertTransposeWrongAxes(Mutant):
    id = "expert_transpose_wrong_axes"
    bug = ("a 3-D expert weight is transposed as a whole (all axes reversed, ``.T``) instead of per expert, "
           "then laid out in the served shape: the shape fits, the experts' rows and columns are mixed")
    kills = frozenset({"MODEL-TRANSFORM-ONCE", "MODEL-FORWARD"})

    def patches(self):
        def transpose(t):
            if len(t.loaded) != 3:
                return _real_transpose(t)
            with paddle.no_grad():
                new = paddle.transpose(t.param, [2, 1, 0]).contiguous()
            _transforms._set_shape(t.param, t.served)
            new._share_buffer_to(t.param)

        return {"reference.transforms.transpose": transpose}


class LoadedLayoutByShapeOnly(Mutant):
    id = "loaded_layout_by_shape_only"
    bug = ("the reference before issue 30's blind batch: before an update every transposed parameter is given its "
           "loaded shape without moving its data, and nothing puts the served layout back when the update fails: "
           "a weight an in-place rsync step leaves out (RSYNC-SUBSET) comes back transposed once more from a "
           "relabelled buffer, and a step refused whole leaves every transposed weight in the loaded shape over served bytes")
    kills = frozenset({"RSYNC-SUBSET", "MODEL-TRANSFORM-FAILED"})

    def patches(self):
        def before_load(post):
            for t in post.transposes:
                _transforms._set_shape(t.param, t.loaded)

        return {"reference.transforms.before_load": before_load, "reference.transforms.restore": lambda post: None}


class FrozenDraftTransformedAgain(Mutant):
    id = "frozen_draft_transformed_again"
    bug = ("post-load processing runs over every model in the list, frozen ones included (radixark/miles#1926), while "
           "the preparation for the load knows the frozen draft receives nothing: the draft, which received nothing, "
           "is transposed again on every update (and a failed update's restore un-transposes it)")
    kills = frozenset({"MODEL-TRANSFORM-FROZEN", "MODEL-TRANSFORM-FAILED"})

    def patches(self):
        class Unfrozen:
            """A frozen model seen without its ``frozen`` flag."""

            def __init__(self, model):
                self._model = model
                self.post_load = {k: v for k, v in model.post_load.items() if k != "frozen"}

            def __getattr__(self, name):
                return getattr(self._model, name)

        frozen: set[int] = set()  # the Transpose entries of frozen models

        def plan(models):
            post = _real_plan([Unfrozen(m) if _transforms.is_frozen(m) else m for m in models])
            params = {id(p) for m in models if _transforms.is_frozen(m) for p in m.state_dict().values()}
            frozen.update(id(t) for t in post.transposes if id(t.param) in params)
            return post

        def before_load(post):  # the weights that will be loaded made ready; the frozen draft left as it is
            _real_before_load(_transforms.PostLoad([t for t in post.transposes if id(t) not in frozen], post.derived))
            post.loaded_layout = True

        return {"reference.transforms.plan": plan, "reference.transforms.before_load": before_load}


class PostLoadBeforeVerification(Mutant):
    id = "post_load_before_verification"
    bug = ("post-load steps run as soon as the sources are applied, before the update is verified complete: "
           "an update that then fails (a parameter missing) has already rewritten the derived buffers")
    kills = frozenset({"MODEL-TRANSFORM-FAILED"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                _real_after_load(self.post_load)
                saved = _transforms.after_load
                _transforms.after_load = lambda post: None
                try:
                    super().finalize()
                finally:
                    _transforms.after_load = saved

        return _manager_patch(Manager)


# -- quantised weights -----------------------------------------------------------------------------------
class StaleScale(Mutant):
    id = "stale_scale"
    bug = ("the scale is treated as a calibration constant read at the first load and kept: later updates "
           "dequantise the new fp8 weight with the first version's scale (sglang#30749: raw scales served)")
    kills = frozenset({"MODEL-QUANT-SCALE", "MODEL-FORWARD", "MODEL-TRANSFORM-ONCE"})

    def patches(self):
        first: dict[int, paddle.Tensor] = {}

        def dequantised(step):
            scale = first.setdefault(id(step.buffer), step.scale.astype(step.buffer.dtype).clone())
            return step.weight.astype(step.buffer.dtype) * scale

        return {"reference.transforms.dequantised": dequantised}


class DoubleScale(Mutant):
    id = "double_scale"
    bug = ("the scale is folded into the weight when both have landed and applied again by the dequantisation "
           "(weight x scale x scale)")
    kills = frozenset({"MODEL-QUANT-SCALE", "MODEL-FORWARD", "MODEL-TRANSFORM-ONCE"})

    def patches(self):
        def dequantised(step):
            scale = step.scale.astype(step.buffer.dtype)
            return step.weight.astype(step.buffer.dtype) * scale * scale

        return {"reference.transforms.dequantised": dequantised}


# -- tied parameters -------------------------------------------------------------------------------------
class UntiedHeads(Mutant):
    id = "untied_heads"
    bug = ("the loader gives every name its own parameter (a tied alias becomes a copy of its owner, made "
           "once, at the first load) and tracks only the owner: later updates leave the head on the first "
           "version's embedding (prime-rl#2823)")
    kills = frozenset({"MODEL-TIED", "MODEL-FORWARD"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def _capture(self):
                self.aliases = []  # (alias param, owner param)
                names = []
                seen: dict[int, str] = {}
                for model in self.model_list:
                    for name, param in model.state_dict().items():
                        if id(param) in seen:
                            *path, leaf = name.split(".")
                            layer = model
                            for part in path:
                                layer = getattr(layer, part)
                            with paddle.LazyGuard():
                                copy = layer.create_parameter(list(param.shape), dtype=param.dtype)
                            setattr(layer, leaf, copy)
                            self.aliases.append((copy, param))
                            names.append(name)
                        seen.setdefault(id(param), name)
                params = super()._capture()
                for name in names:  # the copy is filled from its owner, not cleared or loaded
                    del params[name]
                return params

            def finalize(self):
                super().finalize()
                for alias, owner in self.aliases:
                    if not alias._is_initialized():
                        owner.clone()._share_buffer_to(alias)

        return _manager_patch(Manager)


# -- fused layouts ---------------------------------------------------------------------------------------
class FusedPiecesReversed(Mutant):
    id = "fused_pieces_reversed"
    bug = ("each rank's pieces of a fused weight (its q/k/v or gate/up tensor-parallel shards) are "
           "concatenated in the wrong order: every byte each rank received is correct, the fused layout is not")
    kills = frozenset({"MODEL-FORWARD", "MODEL-TRANSFORM-ONCE"})

    def patches(self):
        def fused(step):
            return paddle.concat(list(step.pieces)[::-1], axis=step.axis)

        return {"reference.transforms.fused": fused}


class FusedAlongWrongAxis(Mutant):
    id = "fused_along_wrong_axis"
    bug = ("the pieces are stacked along the first axis and the result laid out in the buffer's shape: the "
           "fused weight holds every byte, split at the wrong points")
    kills = frozenset({"MODEL-FORWARD", "MODEL-TRANSFORM-ONCE"})

    def patches(self):
        def fused(step):
            return paddle.concat([p.reshape([-1]) for p in step.pieces]).reshape(step.buffer.shape)

        return {"reference.transforms.fused": fused}


# -- stale-state hooks -----------------------------------------------------------------------------------
class HookBeforeCommit(Mutant):
    id = "hook_before_commit"
    bug = ("the caches are reset once the bytes have landed, before the post-load steps and the commit "
           "(status UPDATING): a request served in between recomputes the cache from untransformed weights")
    kills = frozenset({"MODEL-HOOKS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                if not _manager.apply.unloaded(self.params):
                    _hooks.after_commit(self)
                saved = _hooks.after_commit
                _hooks.after_commit = lambda manager: None
                try:
                    super().finalize()
                finally:
                    _hooks.after_commit = saved

        return _manager_patch(Manager)


class HookAfterFailure(Mutant):
    id = "hook_after_failure"
    bug = ("the cache reset sits in a finally: it also runs after a failed update, as if new weights were "
           "being served")
    kills = frozenset({"MODEL-HOOKS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                saved = _hooks.after_commit
                _hooks.after_commit = lambda manager: None
                try:
                    super().update()
                finally:
                    _hooks.after_commit = saved
                    saved(self)

        return _manager_patch(Manager)


class HookErrorSwallowed(Mutant):
    id = "hook_error_swallowed"
    bug = "a hook's exception is logged and dropped: the update reports success while the old cache is served"
    kills = frozenset({"MODEL-HOOK-FAILURE"})

    def patches(self):
        def after_commit(manager):
            for fn in manager.hooks._hooks.values():
                try:
                    fn()
                except Exception:  # noqa: BLE001 (the bug)
                    pass

        return {"reference.hooks.after_commit": after_commit}


class HookErrorStopsTheRest(Mutant):
    id = "hook_error_stops_the_rest"
    bug = "the first hook that raises ends the loop: the hooks after it never run, and the status stays NORMAL"
    kills = frozenset({"MODEL-HOOK-FAILURE"})

    def patches(self):
        def after_commit(manager):
            for fn in manager.hooks._hooks.values():
                fn()

        return {"reference.hooks.after_commit": after_commit}


# -- declarations ----------------------------------------------------------------------------------------
class DeclarationUnchecked(Mutant):
    id = "declaration_unchecked"
    bug = ("the post_load declaration is trusted: names the model lacks are skipped, shapes and dtypes never "
           "compared, so a typo silently disables a transform")
    kills = frozenset({"MODEL-DECLARATION"})

    def patches(self):
        def plan(models):
            out = _transforms.PostLoad([], [])
            for model in models:
                decl = getattr(model, "post_load", None) or {}
                if not isinstance(decl, dict) or decl.get("frozen") is True:
                    continue
                params = model.state_dict()
                for name in decl.get("transpose", ()):
                    if name in params and len(params[name].shape) >= 2:
                        p = params[name]
                        out.transposes.append(_transforms.Transpose(p, tuple(p.shape), _transforms.loaded_shape(p.shape)))
            return out

        return {"reference.transforms.plan": plan, "reference.transforms.is_frozen": lambda m: False}



# -- the served weights sent again (MODEL-SAME-WEIGHTS) -----------------------------------------------------
def _raw(tensor) -> bytes:
    """A tensor's bytes as loaded (b"" for a zero-element one)."""
    return b"" if 0 in tuple(tensor.shape) else tensor.numpy().tobytes()


class SkipUnchangedTensors(Mutant):
    id = "skip_unchanged_tensors"
    bug = ("an update copies only the tensors whose bytes differ from what it applied last time (a shortcut for "
           "RL steps that change few weights), even after a clear emptied the parameters: reloading the served "
           "weights leaves every one of them empty")
    kills = frozenset({"MODEL-SAME-WEIGHTS"})
    zoo_args = ("-k", "reloading_the_served")

    def patches(self):
        from reference import apply as _apply

        real, last = _apply.apply_tensors, {}

        def apply_tensors(targets, tensors, source, land=None):
            def changed():
                for name, tensor in tensors:
                    raw = _raw(tensor)
                    if last.get(name) != raw:
                        last[name] = raw
                        yield name, tensor

            return real(targets, changed(), source, land)

        return {"reference.apply.apply_tensors": apply_tensors}


class TransformSkippedWhenUnchanged(Mutant):
    id = "transform_skipped_when_unchanged"
    bug = ("the post-load transpose runs only for weights whose loaded bytes changed since the last update (they "
           "were transposed then, so why again): reloading the served weights serves them untransposed")
    kills = frozenset({"MODEL-SAME-WEIGHTS"})
    zoo_args = ("-k", "reloading_the_served")

    def patches(self):
        seen: dict[int, bytes] = {}

        def after_load(post):
            todo = []
            for t in post.transposes:
                raw = _raw(t.param)
                if seen.get(id(t.param)) != raw:
                    todo.append(t)
                seen[id(t.param)] = raw
            _real_after_load(_transforms.PostLoad(todo, post.derived))

        return {"reference.transforms.after_load": after_load}
