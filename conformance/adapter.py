"""The adapter protocol: how the suite drives an implementation.

An implementation provides a *factory* (a class or function with no required arguments) returning
an object that satisfies ``LoaderAdapter``. See docs/adapters.md for a worked example.

The suite sets the worker's identity in the process environment before ``open`` and resets
Paddle's cached parallel env, so implementations read it as they would in production:
``PADDLE_TRAINER_ID`` (global rank), ``CUDA_VISIBLE_DEVICES`` and ``FLAGS_selected_gpus``.
A session reads its identity at ``open`` and keeps it, whatever the environment says later.

What the rules observe from outside (docs/adapters.md, "What the rules need from a session"):
``status()`` is called from another thread while ``update()``/``clear()`` run; memory rules call
``update()`` in a forked child of the test process (no threads or held locks between calls); after a
call returns, no descriptor, mapping, shared-memory segment or thread of the session is left.

The worker loop (capability ``status.cell``): ``session.worker_iteration(run_model, *, block, sync=None)``;
with capability ``loop.runner`` the suite also passes ``runner=R``, an object that records what the loop
asks of the engine's GPU model runner and communication library: ``R.clear_requests()`` (in-flight
requests stopped, before a clear and before an update), ``R.shutdown_process_group(name)`` and
``R.restart_process_group(name)`` (only with ``block=True``); and ``options["kv_cache_cell"]``, the KV cache's
status cell, which the loop sets CLEARING before a clear and UPDATING before an update. An adapter without
``loop.runner`` is never passed either (docs/adapters.md, SPEC.md STATUS-REQUESTS-CLEARED, -COMM-GROUPS,
-KV-CELL, -ONCE-PER-REQUEST).

Serving (capability ``serve``): ``session.serve(fn)`` runs ``fn()`` as one forward pass of a request, the way
the engine runs one, and returns what it returns. The suite calls it from threads of its own while another
thread calls ``clear()`` and ``update()``; its ``fn`` reads every parameter of the layers handed to ``open``,
one layer at a time, pausing between them. A pass in flight when a clear or an update begins must return
before any byte changes (the change waits for it: drained); a pass that arrives once a change began (by the
time ``status()`` leaves NORMAL), through CLEARED, until the update after it commits, waits and then runs on
the new version (held), or, if that update fails, until one commits; a pass before the first load waits for
it; otherwise a pass runs at once, beside the others. Never refuse a pass, and never run one on cleared or partly loaded parameters (SPEC.md
SERVE-NO-MIXED-VERSIONS).

The V1 control surface (SPEC.md § CTL, docs/adapters.md "The V1 control path"), engine-neutral, each behind its
capability: ``control.pause``: ``session.pause()``, ``session.resume()``, ``session.is_paused() -> bool`` and
``session.generate(step, steps) -> ("finished" | "aborted", steps run)`` (one request whose forward steps the engine
runs as ``step(i)``); ``control.sleep``: ``session.sleep(tags)`` / ``session.wakeup(tags)`` with the tag ``"weight"``
(``tags`` a sequence of tag names, None for every tag): every captured model's weights released, then reloaded from
the configured source, verified and recaptured (``options["recapture"]``); ``control.kv_cache``: the tag
``"kv_cache"``, the engine's KV cache that the suite plays (``options["engine"]``: ``release_kv_cache()``,
``rebuild_kv_cache()``; ``options["cuda_graph"]``: graphs need it rebuilt before the weights' recapture);
``control.update_in_place``: ``session.update_weights(version=, verify_checksum=) -> dict`` on the ``rsync`` path;
``control.routed``: ``session.routed_control()`` with the legacy ``clear_load_weight(timeout_s)`` /
``update_model_weight(timeout_s)`` routed through sleep and wakeup, each ``(code, message)``.

Optional session methods, each behind its capability: ``digest()`` (``digest.model``: the model digest
of the parameters as landed, ``{"model": {alg: hex}, "tensors": {name: {alg: hex}}}`` with ``xxh3`` and
``md5``, SPEC.md § DIGEST) and ``debug_digest(tensor)`` (``digest.debug``: FastDeploy's debug digest
line of a Paddle tensor or numpy array).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class UnsupportedLoadPath(Exception):
    """Raised by an adapter asked for a path it does not implement."""


@dataclass(frozen=True)
class LoaderConfig:
    load_strategy: str  # "ipc_snapshot" | "ipc" | "ipc_bucket" | "rsync" | "gdr" | "gdr_ipc"
    model_dir: str  # snapshot files live here
    shared_dir: str  # the /shared_ipc_meta stand-in: pickle fallback and ipc_metas_{id}
    options: Mapping[str, Any] = field(default_factory=dict)  # path-specific settings


@dataclass(frozen=True)
class Observed:
    """One parameter as the model holds it. ``data`` is None when the parameter is not loaded."""

    dtype: str  # canonical name: "bfloat16", "float32", ...
    shape: tuple[int, ...]
    data: bytes | None


@dataclass(frozen=True)
class LoadEvent:
    label: str  # "snapshot-part{N}", "snapshot", "raw", ...
    source: str | None  # path or endpoint


@runtime_checkable
class LoaderSession(Protocol):
    def update(self) -> None:
        """Load all weights from the configured source and finalize; raise on any failure."""

    def clear(self) -> None:
        """Release every parameter; afterwards none is loaded."""

    def observe(self) -> dict[str, Observed]:
        """Every captured parameter, by name."""

    def trace(self) -> list[LoadEvent]:
        """Sources applied by the last update, in order (capability ``trace``)."""

    def status(self) -> str:
        """"NORMAL", "UPDATING", "CLEARING" or "CLEARED" (capability ``status``). Callable from
        another thread at any time, also while ``update()`` or ``clear()`` runs: it returns at once
        the status the loader is in (``UPDATING`` mid-update), never waiting for the update."""

    def close(self) -> None: ...

    # Optional, with capability ``model.hooks`` (not part of the protocol's required surface):
    #     def register_hook(self, name: str, fn: Callable[[], object]) -> None
    # ``fn()`` runs exactly once after each committed update (after the commit: status NORMAL, every
    # post-load step done), never after a failed one: an engine's stale-state hooks (reset the prefix
    # cache, recapture graphs). The suite registers its own to observe them (SPEC.md MODEL-HOOKS).

    # Optional, with capability ``model.recapture``: ``options["recapture"]`` is a callable the engine hands
    # the loader at ``open``: ``recapture(names: list[str])`` recaptures its CUDA graphs. An update that gives
    # any parameter other memory than it had (a buffer swap such as ``_share_buffer_to`` into a loaded
    # parameter, a new parameter object, a copy that replaces a strided parameter's storage, and always the
    # allocation after ``clear()``) calls it, naming at least the moved parameters (``observe()``'s names),
    # after the last one moved (post-load steps included) and before the status is NORMAL / ``update()``
    # returns. An update that writes every parameter in place (same address, same strides) need not call
    # it. Without the capability, an update must keep every parameter's storage (SPEC.md MODEL-STORAGE-KEPT).


@runtime_checkable
class LoaderAdapter(Protocol):
    """Required: ``name``, ``version``, ``capabilities``, ``open``. Optional attributes the suite reads:
    ``serves_on`` ("cpu" | "gpu": rules with a ``Device:`` line in SPEC.md are judged only on a run on
    that device), ``snapshot_formats`` ({"legacy": "safetensors" | "paddle.save"}: the format of the
    legacy tp0{id} file the suite writes for it) and ``notes`` (strings for the report's header)."""

    name: str
    version: str
    capabilities: frozenset[str]

    def open(self, models: list, config: LoaderConfig) -> LoaderSession:
        """Capture ``models`` (main first, then MTP models; Paddle layers, parameters not yet
        loaded) for a worker configured by ``config``. Must not load anything yet."""


def observe_paddle(params: Mapping[str, Any]) -> dict[str, Observed]:
    """Observation helper for Paddle-based implementations: name -> Observed from live tensors."""
    out = {}
    for name, t in params.items():
        dtype = str(t.dtype).removeprefix("paddle.").lower()
        shape = tuple(int(d) for d in t.shape)
        if 0 in shape:  # (t.numel() fails on a parameter that holds no allocation)
            out[name] = Observed(dtype, shape, b"")
        elif not t._is_initialized():
            out[name] = Observed(dtype, shape, None)
        else:
            out[name] = Observed(dtype, shape, t.numpy().tobytes())
    return out
