"""Conformance adapter for the reference (``--impl=reference``).

The reference itself (and Paddle with it) is imported when the first session or control is opened, not with the
adapter: a pytest-xdist controller resolves the adapter only for the run's header and report, so it starts its
workers without importing Paddle first (about 1.7 s) and ends without tearing it down (docs/suite-run-time.md).
The names of ``_LAZY`` are still this module's own attributes, so that a test can replace them
(``reference.adapter.WeightManager``: tests/mutants); a replacement made before the first session stands.
"""
from __future__ import annotations

import importlib

from conformance.adapter import LoaderConfig, LoadEvent, Observed, observe_paddle

from . import __version__

_LAZY = {  # name -> (module, attribute; None: the module itself)
    "WeightManager": (".manager", "WeightManager"),
    "Control": (".control_v1", "Control"),
    "RoutedControl": (".control_v1", "RoutedControl"),
    "WeightControl": (".control", "WeightControl"),
    "worker_loop": (".worker_loop", None),
    "_digest": (".digest", None),
}


def _resolve(name: str):
    module, attr = _LAZY[name]
    loaded = importlib.import_module(module, __package__)
    return globals().setdefault(name, loaded if attr is None else getattr(loaded, attr))


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _resolve(name)


def _load() -> None:
    """Every name of ``_LAZY`` bound in this module (one replaced already is kept)."""
    for name in _LAZY:
        if name not in globals():
            _resolve(name)


class ReferenceSession:
    def __init__(self, models, config: LoaderConfig):
        self.manager = WeightManager(
            models,
            load_strategy=config.load_strategy,
            model_dir=config.model_dir,
            shared_dir=config.shared_dir,
            options=config.options,
        )
        self.control = Control(self.manager, config.options)  # the V1 control surface (SPEC.md § CTL)

    def update(self):
        return self.manager.update()

    def clear(self) -> None:
        self.manager.clear()

    def observe(self) -> dict[str, Observed]:
        return observe_paddle(self.manager.params)

    def trace(self) -> list[LoadEvent]:
        return [LoadEvent(e.label, e.source) for e in self.manager.trace]

    def status(self) -> str:
        return self.manager.status.name

    def digest(self) -> dict:
        return self.manager.digest().as_dict()

    def debug_digest(self, tensor) -> str:
        return _digest.format_debug_digest(_digest.debug_digest(tensor))

    def register_hook(self, name, fn) -> None:
        """Capability ``model.hooks``: ``fn()`` runs once after each committed update (MODEL-HOOKS)."""
        self.manager.hooks.register(name, fn)

    def version(self):
        return self.manager.version

    def serve(self, fn):
        """Capability ``serve``: ``fn()`` is one forward pass, run under the request gate
        (``reference.request_gate``: drained before a change, held from a change to the commit)."""
        with self.manager.requests.forward():
            return fn()

    def phases(self) -> dict[str, float]:
        """Seconds per span of the last clear/update cycle (``reference.phases``; benchmarks only)."""
        return dict(self.manager.phases)

    # -- the V1 control surface (capabilities control.*; reference.control_v1) ------------------------------
    def pause(self) -> None:
        self.control.pause()

    def resume(self) -> None:
        self.control.resume()

    def is_paused(self) -> bool:
        return self.control.is_paused()

    def generate(self, step, steps: int) -> tuple[str, int]:
        return self.control.generate(step, steps)

    def sleep(self, tags=None) -> None:
        self.control.sleep(tags)

    def wakeup(self, tags=None) -> None:
        self.control.wakeup(tags)

    def update_weights(self, version=None, verify_checksum: bool = False) -> dict:
        return self.control.update_weights(version, verify_checksum)

    def routed_control(self):
        return RoutedControl(self.control)

    def worker_iteration(self, run_model, *, block: bool, sync=None, runner=None) -> str:
        return worker_loop.iteration(self.manager, run_model, block=block, sync=sync, runner=runner)

    def close(self) -> None:
        """Every path frees its files, mappings, sockets and threads before ``update()`` returns
        (FILE-RELEASED, IPC-NO-LEAK, BKT-NO-LEAK); the streamed paths keep one transfer handle across
        updates (GDR-HANDLE-REUSE), released here."""
        self.manager.close()


class ReferenceAdapter:
    name = "reference"
    version = __version__
    capabilities = frozenset(
        {
            "snapshot.parts",
            "snapshot.single",
            "snapshot.legacy",
            "snapshot.shared_fallback",
            "ipc.meta",
            "ipc.buckets",
            "trace",
            "status",
            "mtp",
            "digest.model",
            "digest.debug",
            "model.post_load",
            "model.hooks",
            "model.recapture",
            "stream.rsync",
            "stream.gdr",
            "stream.gdr_ipc",
            "stream.prefetch",
            "status.cell",
            "loop.runner",
            "control",
            "staged",
            "version",
            "multirank",
            "serve",
            "control.pause",
            "control.sleep",
            "control.kv_cache",
            "control.update_in_place",
            "control.routed",
        }
    )
    session_class = ReferenceSession
    control_class = None  # reference.control.WeightControl, unless a subclass names another

    def open(self, models, config: LoaderConfig) -> ReferenceSession:
        _load()
        return self.session_class(models, config)

    def control(self, cell_name: str):
        _load()
        return (self.control_class or WeightControl)(cell_name)
