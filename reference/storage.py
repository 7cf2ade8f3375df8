"""Storage under captured graphs (SPEC.md MODEL-STORAGE-KEPT): which parameters an update moved, and the
engine's recapture hook, called before the commit says NORMAL.

A CUDA graph captured on the served model reads each parameter's memory by address. An update that writes
into that memory (a copy, ``set_value``) leaves the graph valid; one that gives a parameter other memory (a
buffer swap, ``_share_buffer_to``, a new parameter object, or the allocation a cleared parameter needs) leaves
the graph reading freed memory, unless the engine recaptures it. The reference writes loaded parameters in
place, so an in-place update moves nothing; after a clear every parameter that holds data has new memory.

``options["recapture"]`` (capability ``model.recapture``): a callable the engine hands the loader; it is
called once per update that moved any parameter, with the sorted names of the moved ones, after the last
one moved (the post-load steps included) and before the status is NORMAL. Moved is judged per name against
what the update found: a parameter that held no data (cleared, or the first load), another parameter object
than before (a loader replaced it), or another address. The reference's own writes never free a
parameter's memory before the new memory exists, so an address cannot come back by chance.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import paddle


def check_option(recapture) -> Callable | None:
    """``options["recapture"]``: None, or a callable taking the moved names."""
    if recapture is not None and not callable(recapture):
        raise ValueError(f"options['recapture'] must be a callable taking the moved parameters' names, got {recapture!r}")
    return recapture


def _holds_data(param: paddle.Tensor) -> bool:
    return math.prod(param.shape) > 0 and param._is_initialized()


def snapshot(params: Mapping[str, paddle.Tensor]) -> dict[str, tuple[int, int | None]]:
    """name -> (the parameter object, its address or None when it holds no data), as an update finds them."""
    return {name: (id(p), p.data_ptr() if _holds_data(p) else None) for name, p in params.items()}


def moved(before: Mapping[str, tuple[int, int | None]], params: Mapping[str, paddle.Tensor]) -> list[str]:
    """The names whose parameter holds data now in other memory than the update found (see the module)."""
    out = []
    for name, p in params.items():
        if not _holds_data(p):
            continue  # a zero-element parameter has no memory a graph could read
        was = before.get(name)
        if was is None or was[1] is None or was[0] != id(p) or was[1] != p.data_ptr():
            out.append(name)
    return sorted(out)


def recapture(manager) -> None:
    """Call the engine's recapture hook with the parameters this update moved, if any (before NORMAL)."""
    hook = manager.commit_options.recapture
    if hook is None or manager._storage_before is None:
        return
    names = moved(manager._storage_before, manager.params)
    if names:
        hook(names)
