"""Post-load processing a model declares in its ``post_load`` attribute (SPEC.md § MODEL).

FastDeploy transposes weights after loading (``process_weights_after_loading`` /
``process_weight_transpose``: 2-D weights transposed, 3-D ones per expert; fd-spec §3.8); engines fuse
pieces into one buffer and dequantise fp8 weights with their scales. A reload must run every such step on
the new weights exactly once: never on weights it already transformed, never on a model that received
nothing, never after a failed update. The declaration (plain data, so the model needs nothing from us)::

    layer.post_load = {
        "transpose": [param, ...],                     # served [b, a] <- loaded [a, b]; [e, b, a] <- [e, a, b]
        "fuse": {buffer: {"from": [param, ...], "axis": int}},   # concatenated after the transposes
        "dequant": {buffer: {"weight": param, "scale": param}},  # weight (as served) x 0-d or [out] scale
        "frozen": bool,                                # loaded at start-up; no update touches it
    }

Names are the layer's own ``state_dict`` names; a buffer is a dotted attribute path to a tensor the
layer owns (not a parameter), written in place so that whatever captured it (a CUDA graph) sees the
new values. ``plan`` checks a declaration once, when the manager is built; ``before_load`` gives every
transposed parameter its loaded shape (the loaders validate against the parameter's shape);
``after_load`` runs the steps once the update has verified that every parameter is loaded.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import paddle

from .dtypes import dtype_name

KEYS = ("transpose", "fuse", "dequant", "frozen")
FP8 = ("float8_e4m3fn", "float8_e5m2")
WIDE_FLOATS = ("float16", "bfloat16", "float32", "float64")  # what a dequantised buffer may hold


class DeclarationError(ValueError):
    """A model's ``post_load`` declaration names something the model does not have, or cannot hold."""


@dataclass(frozen=True)
class Transpose:
    param: paddle.Tensor
    served: tuple[int, ...]
    loaded: tuple[int, ...]


@dataclass(frozen=True)
class Fuse:
    buffer: paddle.Tensor
    pieces: tuple[paddle.Tensor, ...]
    axis: int


@dataclass(frozen=True)
class Dequant:
    buffer: paddle.Tensor
    weight: paddle.Tensor
    scale: paddle.Tensor


@dataclass
class PostLoad:
    transposes: list[Transpose]
    derived: list  # Fuse and Dequant steps, in declaration order (fuse first)
    loaded_layout: bool = False  # the transposed parameters are in their loaded layout (before_load to after_load)


def loaded_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The checkpoint layout of a transposed parameter: the last two axes swapped back."""
    shape = tuple(shape)
    return shape[:-2] + (shape[-1], shape[-2])


def scale_fits(scale: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    """A scale is per tensor (0-d) or per output channel (``[out]``: the served weight's last axis)."""
    return scale in ((), weight[len(weight) - 1:])


def fused_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...] | None:
    """The shape of pieces concatenated along ``axis``, or None where they cannot be."""
    first = shapes[0]  # (a piece with more or fewer axes differs before or after the axis)
    if not 0 <= axis < len(first) or any(s[:axis] != first[:axis] or s[axis + 1:] != first[axis + 1:] for s in shapes):
        return None
    return first[:axis] + (sum(s[axis] for s in shapes),) + first[axis + 1:]


def is_frozen(model) -> bool:
    """Whether the layer declares itself frozen: loaded at start-up, never cleared, loaded or transformed."""
    decl = getattr(model, "post_load", None)
    frozen = decl.get("frozen", False) if isinstance(decl, Mapping) else False  # (plan() rejects a non-dict)
    if not isinstance(frozen, bool):
        raise DeclarationError(f"post_load['frozen'] must be True or False, got {frozen!r}")
    return frozen


def _declaration(model, index: int) -> Mapping:
    decl = getattr(model, "post_load", None)
    if decl is None:
        return {}
    if not isinstance(decl, Mapping):
        raise DeclarationError(f"model {index}: post_load must be a dict, got {type(decl).__name__}")
    unknown = sorted(set(decl) - set(KEYS))
    if unknown:
        raise DeclarationError(f"model {index}: post_load has unknown key(s) {unknown}; known: {list(KEYS)}")
    return decl


def _buffer(model, path: str, where: str) -> paddle.Tensor:
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise DeclarationError(f"{where}: buffer {path!r} is not an attribute of the model")
    if isinstance(obj, paddle.base.framework.EagerParamBase):
        raise DeclarationError(f"{where}: buffer {path!r} is a parameter; a derived buffer must not be loaded")
    if not isinstance(obj, paddle.Tensor) or not obj._is_initialized():
        raise DeclarationError(f"{where}: buffer {path!r} must be an allocated tensor the model owns")
    return obj


def _param(params: Mapping[str, paddle.Tensor], name, where: str) -> paddle.Tensor:
    if name not in params:
        raise DeclarationError(f"{where}: {name!r} is not a parameter of the model")
    return params[name]


def _check_result(where: str, buffer: paddle.Tensor, dtype: str, shape: tuple[int, ...]) -> None:
    if dtype_name(buffer) != dtype or tuple(buffer.shape) != shape:
        raise DeclarationError(f"{where}: the buffer is {dtype_name(buffer)}{list(buffer.shape)} but the step "
                               f"makes {dtype}{list(shape)}")


def plan(models) -> PostLoad:
    """Check every (non-frozen) model's declaration and resolve its names to tensors."""
    out = PostLoad([], [])
    for index, model in enumerate(models):
        decl = _declaration(model, index)
        if not is_frozen(model):
            _plan_model(model, f"model {index}: post_load", decl, out)
    return out


def _plan_model(model, at: str, decl: Mapping, out: PostLoad) -> None:
    params = model.state_dict()
    for name in decl.get("transpose", ()):
        where = f"{at}['transpose'] {name!r}"
        param = _param(params, name, where)
        if len(param.shape) not in (2, 3):
            raise DeclarationError(f"{where}: only 2-D and 3-D (per expert) weights are transposed, it is "
                                   f"{len(param.shape)}-D {list(param.shape)}")
        out.transposes.append(Transpose(param, tuple(param.shape), loaded_shape(param.shape)))
    for path, step in (decl.get("fuse") or {}).items():
        where = f"{at}['fuse'] {path!r}"
        pieces = [_param(params, n, where) for n in step.get("from") or ()]
        axis = step.get("axis")
        if len(pieces) < 2 or type(axis) is not int:
            raise DeclarationError(f"{where}: needs 'from' (two or more parameters) and an int 'axis'")
        buffer = _buffer(model, path, where)
        shapes = [tuple(p.shape) for p in pieces]
        want = fused_shape(shapes, axis)
        if want is None:
            raise DeclarationError(f"{where}: pieces {shapes} cannot be concatenated along axis {axis}")
        dtypes = sorted({dtype_name(p) for p in pieces})
        if len(dtypes) != 1:
            raise DeclarationError(f"{where}: pieces of different dtypes {dtypes}")
        _check_result(where, buffer, dtypes[0], want)
        out.derived.append(Fuse(buffer, tuple(pieces), axis))
    for path, step in (decl.get("dequant") or {}).items():
        where = f"{at}['dequant'] {path!r}"
        weight = _param(params, step.get("weight"), where)
        scale = _param(params, step.get("scale"), where)
        if dtype_name(weight) not in FP8:
            raise DeclarationError(f"{where}: weight is {dtype_name(weight)}, not fp8 {list(FP8)}")
        if not scale_fits(tuple(scale.shape), tuple(weight.shape)):
            raise DeclarationError(f"{where}: scale {list(scale.shape)} is neither 0-d nor one per output channel "
                                   f"of the weight {list(weight.shape)}")
        buffer = _buffer(model, path, where)
        if dtype_name(buffer) not in WIDE_FLOATS:
            raise DeclarationError(f"{where}: the buffer is {dtype_name(buffer)}, not one of {list(WIDE_FLOATS)}")
        _check_result(where, buffer, dtype_name(buffer), tuple(weight.shape))
        out.derived.append(Dequant(buffer, weight, scale))


def _set_shape(param: paddle.Tensor, shape: tuple[int, ...]) -> None:
    param.value().get_tensor()._set_dims(list(shape))


def _swapped(param: paddle.Tensor) -> paddle.Tensor:
    """The tensor with its last two axes swapped (per expert for 3-D), contiguous."""
    axes = list(range(len(param.shape)))
    return paddle.transpose(param, axes[:-2] + [axes[-1], axes[-2]]).contiguous()


def _relayout(param: paddle.Tensor, shape: tuple[int, ...]) -> None:
    """Give ``param`` the layout ``shape`` (its last two axes swapped): the data moves with it when it holds
    any, written back into the parameter's own memory, so that its address stays (MODEL-STORAGE-KEPT)."""
    new = _swapped(param) if param._is_initialized() and math.prod(shape) else None
    _set_shape(param, shape)
    if new is not None:
        param.set_value(new)


def before_load(post: PostLoad) -> None:
    """Give every transposed parameter its loaded layout, which the loaders check incoming tensors against:
    a cleared one its shape, a loaded one (an update in place) its data too, so that a weight the update
    leaves out (RSYNC-SUBSET) is the same weight when ``after_load`` transposes it again."""
    _to_layout(post, loaded=True)


def restore(post: PostLoad) -> None:
    """After a failed update: if it failed between ``before_load`` and ``after_load``, every transposed parameter
    back in its served layout, with whatever data it holds (an update in place refused whole keeps its weights as
    they were); otherwise nothing."""
    _to_layout(post, loaded=False)


def _to_layout(post: PostLoad, loaded: bool) -> None:
    """Every transposed parameter in its loaded (or served) layout, unless they are in it already."""
    if post.loaded_layout == loaded:
        return
    with paddle.no_grad():
        for t in post.transposes:
            _relayout(t.param, t.loaded if loaded else t.served)
    post.loaded_layout = loaded


def transpose(t: Transpose) -> None:
    """Swap the last two axes of the loaded tensor (per expert for 3-D) and give it its served shape."""
    new = _swapped(t.param) if math.prod(t.served) else None  # a zero-element weight has only a shape
    _set_shape(t.param, t.served)
    if new is not None:  # written back into the parameter's own memory: its address stays (MODEL-STORAGE-KEPT)
        t.param.set_value(new)


def fused(step: Fuse) -> paddle.Tensor:
    return paddle.concat(list(step.pieces), axis=step.axis)


def dequantised(step: Dequant) -> paddle.Tensor:
    """The weight times its scale, each converted to the buffer's dtype and multiplied in it. For a 16-bit float the
    product is taken in float32, where the product of two 16-bit values is exact, and rounded once to the buffer's
    dtype: the value a multiply in that dtype gives, which Paddle's CPU build has no kernel for (float16)."""
    dtype = step.buffer.dtype
    weight, scale = step.weight.astype(dtype), step.scale.astype(dtype)
    if dtype in (paddle.float16, paddle.bfloat16):
        return (weight.astype(paddle.float32) * scale.astype(paddle.float32)).astype(dtype)
    return weight * scale


def after_load(post: PostLoad) -> None:
    """Run every step once on the update's new weights: transposes, then fused and dequantised buffers."""
    post.loaded_layout = False
    with paddle.no_grad():
        for t in post.transposes:
            transpose(t)
        for step in post.derived:
            value = fused(step) if isinstance(step, Fuse) else dequantised(step)
            paddle.assign(value, output=step.buffer)  # in place: a graph that captured the buffer reads it
