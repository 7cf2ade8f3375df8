"""FastDeploy's own streamed paths, driven against the CheckpointTransfer stand-in: ``update_weights_by_rdma``
(``rsync``) and ``update_weights_by_gdr`` (``gdr``: the rsync mode; ``gdr_ipc``: the IPC mode).

* The library. FastDeploy imports ``checkpoint_transfer`` (and ``.transfer``, ``.config``, ``.core``) inside
  those methods. Where no real library imports, the names are mapped onto ``sim.checkpoint_transfer`` (the
  stand-in whose trainer end the suite drives), replacing the adapter's inert stubs; a real installation
  is never shadowed: with one, the streamed capabilities are not claimed (its peers are not the suite's).
* Which path. FastDeploy picks it in the constructor from ``envs.FD_USE_GDR_CHECKPOINT_TRANSFER`` and
  ``load_strategy`` (fd-spec §1.4). Rather than flip a process-wide flag (the suite runs sessions at
  once), the session binds, on the instance and for the constructor only, each entry point the
  constructor may call to the one the flag would pick, with the runner's arguments: the version
  (``options['version']``) and ``verify_checksum``. Later updates call that method as the runner does:
  ``update_weights_by_rdma(version, verify_checksum)``, or ``update_weights_by_gdr(version, verify_checksum,
  restore_cleared_params=<cleared since>)``; a class of the GDR era is then finalized
  (``finalize_update(pid)``, as its runner does after either), an older one is not (its rsync is driven
  only by the control API). ``update()`` returns the method's result.
* The device. ``Tensor.cuda()`` (the bootstrap rsync load adopts ``new.cuda()``) is the identity on this
  CPU suite, as the device stand-in of the other paths.
* Concurrency. The timing rules run several sessions at once; the world of their calls (identity,
  ``/shared_ipc_meta``, ``cuda()``) is entered by the first and left by the last of them, and sessions of
  different workers never overlap.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

from .session import FastDeploySession
from .generation import constructor_kwargs
from .stubs import CLEARED, CLEARING, NORMAL, UPDATING
from .world import fd_config, worker_world

STRATEGIES = {"rsync": "rsync", "gdr": "rsync", "gdr_ipc": "ipc"}  # suite strategy -> FastDeploy load_strategy
LIBRARY = "checkpoint_transfer"


def install_standin(modules=None) -> bool:
    """Map ``checkpoint_transfer`` onto the simulator's stand-in, unless a real library imports
    (``sim.checkpoint_transfer.install_as_library``). Returns whether the stand-in is what FastDeploy imports."""
    from sim.checkpoint_transfer import install_as_library

    return install_as_library(modules)


def capabilities(cls, standin: bool) -> tuple[set, dict]:
    """(streamed capabilities the class can be driven on, {capability: why not} for the others)."""
    caps, why = set(), {}
    reason = None if standin else "a real checkpoint_transfer is installed; the suite's trainer speaks the stand-in's protocol"
    for cap, method in (("stream.rsync", "update_weights_by_rdma"), ("stream.gdr", "update_weights_by_gdr"),
                        ("stream.gdr_ipc", "update_weights_by_gdr")):
        if not hasattr(cls, method):
            why[cap] = f"no {method}"
        elif reason:
            why[cap] = reason
        else:
            caps.add(cap)
    why["stream.prefetch"] = "no prefetch queue: the stream is consumed as it is received (DWM-A)"
    if hasattr(cls, "_receive_gdr_weights_as_sync_iterator") and "stream.gdr" in caps:
        caps.add("stream.prefetch")
        del why["stream.prefetch"]
    return caps, why


def _kwargs(method, **candidates) -> dict:
    """The candidates ``method`` takes (generations differ: rsync_tp0 has no verify_checksum)."""
    params = inspect.signature(method).parameters
    return {k: v for k, v in candidates.items() if k in params}


# -- the shared world of concurrent sessions ---------------------------------------------------------
_lock = threading.Lock()
_shared = {"users": 0, "env": None, "stack": None}


def _identity_cuda(self, *args, **kwargs):
    return self


@contextlib.contextmanager
def stream_world(env: dict, shared_dir: str):
    """``worker_world`` plus ``Tensor.cuda()`` as the identity, shared by sessions of one worker at once."""
    import paddle

    with _lock:
        if _shared["users"] and _shared["env"] != env:
            raise RuntimeError("FastDeploy adapter: streamed sessions of different workers cannot run at once "
                               f"({_shared['env']} vs {env})")
        if not _shared["users"]:
            stack = contextlib.ExitStack()
            stack.enter_context(worker_world(env, shared_dir))
            real = paddle.Tensor.cuda
            paddle.Tensor.cuda = _identity_cuda
            stack.callback(setattr, paddle.Tensor, "cuda", real)
            _shared.update(env=dict(env), stack=stack)
        _shared["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _shared["users"] -= 1
            if not _shared["users"]:
                stack, _shared["stack"], _shared["env"] = _shared["stack"], None, None
                stack.close()


class StreamSession(FastDeploySession):
    """A FastDeploy worker updated by rsync or GDR (module docstring)."""

    def __init__(self, dwm_class, generation, models, config):
        super().__init__(dwm_class, generation, models, config)
        self.strategy = config.load_strategy
        self.options = dict(config.options)
        self._cleared = False
        self._result = None

    def _world(self):
        return stream_world(self.env, self.config.shared_dir)

    def _call_kwargs(self, method) -> dict:
        return _kwargs(method, version=self.options.get("version"),
                       verify_checksum=bool(self.options.get("verify_checksum", False)),
                       restore_cleared_params=self._cleared)

    def _entry(self, manager):
        """The bound method of this session's path, with the runner's arguments."""
        name = "update_weights_by_rdma" if self.strategy == "rsync" else "update_weights_by_gdr"
        method = getattr(manager, name)
        return lambda: method(**self._call_kwargs(method))

    def _construct(self):
        manager = self._cls.__new__(self._cls)
        entry = self._entry(manager)

        def first_load(*args, **kwargs):
            self._result = entry()
            return self._result

        # Whatever the flag and load_strategy make the constructor call, it is this session's path.
        for name in ("update_weights_by_rdma", "update_weights_by_gdr", "update_parameters"):
            setattr(manager, name, first_load)
        selected = self.env.get("FLAGS_selected_gpus") or "0"
        local_rank = int(selected) if selected.isdigit() else 0
        config = fd_config(STRATEGIES[self.strategy], self.config.model_dir, self.config.options, self.pid)
        try:
            self._cls.__init__(manager, **constructor_kwargs(self.generation.init_params, config, self.models, local_rank))
        finally:
            for name in ("update_weights_by_rdma", "update_weights_by_gdr", "update_parameters"):
                manager.__dict__.pop(name, None)
        return manager

    def update(self):
        with self._world():
            self._write(UPDATING)
            self._result = None
            if self.manager is None:
                self.manager = self._construct()
                self._write(NORMAL)  # first load: finalize writes nothing (fd-spec rule 32)
            else:
                self._result = self._entry(self.manager)()
                if hasattr(self.manager, "update_weights_by_gdr") and hasattr(self.manager, "finalize_update"):
                    self.manager.finalize_update(self.pid)
                else:
                    self._write(NORMAL)  # the control API reports success; nothing else writes the cell
            self._cleared = False
        return self._result

    def clear(self) -> None:
        with self._world():
            if self.manager is None:
                self._write(CLEARED)  # FastDeploy has no manager before its first load, and nothing is loaded
                return
            self._write(CLEARING)
            self.manager.clear_parameters(self.pid)
            self._cleared = True  # the runner's next GDR update restores cleared parameters first

    def close(self) -> None:
        manager = self.manager
        destroy = getattr(manager, "_destroy_gdr_handle", None)
        if destroy is not None:
            with self._world():
                destroy()  # FastDeploy's own teardown of its cached GDR handle
        super().close()
