"""Applying: validate a new tensor against its target parameter, adopt it, verify the model.

Validation order is part of the contract: dtype first (TypeError), then shape (ValueError).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import paddle

from .dtypes import dtype_name


def mismatch(name: str, src_dtype: str, src_shape, dst: paddle.Tensor, source: str = "") -> Exception | None:
    """The error of a tensor that does not match its parameter, else None: a TypeError for its dtype, checked
    first (a tensor wrong in both is named for its dtype), then a ValueError for its shape."""
    where = f" (from {source})" if source else ""
    dst_dtype = dtype_name(dst)
    if src_dtype != dst_dtype:
        return TypeError(f"Type mismatch for {name}: {src_dtype} vs {dst_dtype}{where}")
    if tuple(src_shape) != tuple(dst.shape):
        return ValueError(f"Shape mismatch for {name}: {list(src_shape)} vs {list(dst.shape)}{where}")
    return None


def check_match(name: str, src_dtype: str, src_shape, dst: paddle.Tensor, source: str = "") -> None:
    """Raise TypeError on dtype mismatch, then ValueError on shape mismatch."""
    found = mismatch(name, src_dtype, src_shape, dst, source)
    if found is not None:
        raise found


def raise_all(found: list[Exception], what: str = "tensor(s) do not match their parameters") -> None:
    """Raise every problem of an input at once (APPLY-EVERY-PROBLEM): one alone as it is; several as one error
    listing each, of the type dtype-before-shape gives (a TypeError when any is one), else the first's type."""
    if not found:
        return
    if len(found) == 1:
        raise found[0]
    kind = TypeError if any(isinstance(e, TypeError) for e in found) else type(found[0])
    raise kind(f"{len(found)} {what}: " + "; ".join(str(e) for e in found))


def adopt(name: str, new: paddle.Tensor, target: paddle.Tensor) -> None:
    """Make ``target`` hold ``new``'s values. A target that holds memory is written in place (its address and
    strides kept: MODEL-STORAGE-KEPT). A cleared one adopts ``new`` zero-copy (FastDeploy's
    ``_share_buffer_to``) when the layouts agree, else gets a copy in its own layout (APPLY-STRIDED-TARGET, FastDeploy #6601): a
    target whose strides differ from the incoming tensor's (FP8 scales laid out column-major, transposed
    weights) keeps them, and sharing a row-major buffer into it would make it read the bytes in the wrong
    order. A cleared strided target is first given storage of its own layout (APPLY-STRIDED-CLEARED,
    #6722). ``name`` is kept for callers that log per tensor."""
    new = new.contiguous()  # every loader builds contiguous tensors; this makes sure
    if math.prod(target.shape) == 0:
        return  # holds no data, and its layout stays its own
    same_layout = list(new.stride()) == list(target.stride())
    if target._is_initialized():
        # Loaded (or an engine's allocated placeholder): written into its own memory, which keeps its address
        # and strides, so a graph captured on it stays valid (MODEL-STORAGE-KEPT, FastDeploy #8085).
        if same_layout:
            target.set_value(new)
        else:
            target[...] = new
        return
    if same_layout:
        new._share_buffer_to(target)
        return
    allocate_strided(target)
    target[...] = new


def allocate_strided(target: paddle.Tensor) -> None:
    """Give a cleared ``target`` fresh storage laid out by its own strides: a view over new memory that the
    parameter object adopts (``.data``), so the model keeps the same object. (FastDeploy's
    ``target[...] = paddle.empty(...)`` needs a device where setitem allocates: on CPU it raises.)"""
    shape, stride = list(target.shape), list(target.stride())
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    target.data = paddle.as_strided(paddle.empty([span], dtype=target.dtype), shape, stride)


def is_loaded(param: paddle.Tensor) -> bool:
    # Paddle never marks a zero-element tensor initialized, even after it adopts a buffer; such a
    # parameter holds no data, so it cannot be stale.
    # (numel() itself needs an allocated tensor, so count from the shape.)
    return param._is_initialized() or math.prod(param.shape) == 0


def unloaded(params: Mapping[str, paddle.Tensor]) -> list[str]:
    return [name for name, p in params.items() if not is_loaded(p)]


def still_loaded(params: Mapping[str, paddle.Tensor]) -> list[str]:
    return [name for name, p in params.items() if p._is_initialized()]


def apply_tensors(
    targets: Mapping[str, paddle.Tensor], tensors: Iterable[tuple[str, paddle.Tensor]], source: str, land=None
) -> tuple[int, int, list[str]]:
    """Validate every known tensor of one source, then adopt them; return (applied, seen, unknown
    names). Nothing is adopted unless every tensor of the source matches its parameter
    (APPLY-VALIDATE-FIRST): the pickle fallback has no header to check beforehand. The tensors of
    one source are alive together anyway: each adopted one stays referenced by its parameter.
    ``land(name, tensor, target)`` replaces adopting (a staged update keeps them until its commit)."""
    seen = 0
    unknown = []
    matched: list[tuple[str, paddle.Tensor, paddle.Tensor]] = []
    found: list[Exception] = []
    for name, tensor in tensors:
        seen += 1
        target = targets.get(name)
        if target is None:
            unknown.append(name)
            continue
        problem = mismatch(name, dtype_name(tensor), tensor.shape, target, source)
        if problem is not None:
            found.append(problem)
            continue
        matched.append((name, tensor, target))
    raise_all(found)  # every tensor of the source at fault, not only the first
    with paddle.no_grad():
        for name, tensor, target in matched:
            (land or adopt)(name, tensor, target)
    return len(matched), seen, unknown
