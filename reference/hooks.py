"""Stale-state hooks (SPEC.md § MODEL, MODEL-HOOKS): what an engine registers to drop state computed
from the old weights (reset the prefix/KV cache, recapture CUDA graphs).

Each hook runs exactly once per committed update, after the commit (status ``NORMAL``, every post-load
step done), in registration order, and never after a failed update. A hook that raises does not keep
the others from running; the update then raises ``HookError`` naming it, and the status leaves
``NORMAL``: state derived from the old weights may still be served, so the update is not a success.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from .status import Status

log = logging.getLogger("reference.hooks")


class HookError(RuntimeError):
    """One or more stale-state hooks raised after the commit."""


class Hooks:
    """The hooks of one manager, by name, in registration order (a name registered again is replaced)."""

    def __init__(self):
        self._hooks: dict[str, Callable[[], object]] = {}

    def register(self, name: str, fn: Callable[[], object]) -> None:
        self._hooks[name] = fn


def after_commit(manager) -> None:
    """Run every hook of ``manager.hooks`` once; on any failure leave ``NORMAL`` and raise naming them."""
    failed = []
    for name, fn in manager.hooks._hooks.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (every hook runs; the failures are raised below)
            failed.append((name, e))
    if failed:
        manager.status = Status.UPDATING
        named = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failed)
        raise HookError(f"stale-state hook(s) failed after the commit: {named}; clear() and update() again") \
            from failed[0][1]
