"""FastDeploy's own streamed paths, driven against the CheckpointTransfer stand-in: ``update_weights_by_rdma``
(``rsync``) and ``update_weights_by_gdr`` (``gdr``: the rsync mode; ``gdr_ipc``: the IPC mode).

* The library. FastDeploy imports ``checkpoint_transfer`` (and ``.transfer``, ``.config``, ``.core``) inside
  those methods. Where no real library imports, the names are mapped onto ``sim.checkpoint_transfer`` (the
  stand-in whose trainer end the suite drives), replacing the adapter's inert stubs; a real installation
  is never shadowed: with one, the streamed capabilities are not claimed (its peers are not the suite's).
* Which path. The first load is the constructor's own: it picks the method from
  ``envs.FD_USE_GDR_CHECKPOINT_TRANSFER`` and ``load_strategy`` (fd-spec §1.4) and calls it without
  arguments (a bootstrap load: the version comes from ``{model_dir}/version.yaml``, or is step "0" in the
  GDR IPC mode). The adapter only configures the engine, as a deployment does: ``load_strategy``
  (``rsync`` for rsync and GDR, ``ipc`` for GDR's IPC mode), the GDR flag (``engine_config``: on the
  calling thread in the suite's stub envs, in the process environment for a real ``fastdeploy.envs``), and
  for GDR ``rsync_config['transfer_mode'] = 'gdr'`` unless given (the setting of the #7951 era, whose
  ``update_weights_by_rdma`` routes by it); no method of the manager is replaced. Later updates call
  the session's method as the runner does: ``update_weights_by_rdma(version, verify_checksum)``, or
  ``update_weights_by_gdr(version, verify_checksum, restore_cleared_params=<cleared since>)``; a class of
  the GDR era is then finalized (``finalize_update(pid)``, as its runner does after either), an older one
  is not (its rsync is driven only by the control API). The graph recapture (``model.recapture``, session.py)
  follows a GDR update, before the finalize, as the runner's ``update_parameters`` does; rsync's
  ``update_weights`` recaptures nothing (fd-spec §3.5, open #8085). ``update()`` returns the method's result (None
  for the first load: the constructor returns nothing).
* The device. ``Tensor.cuda()`` (the bootstrap rsync load adopts ``new.cuda()``) is the identity on this
  CPU suite, as the device stand-in of the other paths.
* Concurrency. The timing rules run several sessions at once; the world of their calls (identity,
  ``/shared_ipc_meta``, ``cuda()``) is entered by the first and left by the last of them, and sessions of
  different workers never overlap.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading

from .session import FastDeploySession
from .generation import constructor_kwargs
from .stubs import CLEARED, CLEARING, GDR_FLAG, NORMAL, UPDATING, thread_config
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
                        ("stream.gdr_ipc", "update_weights_by_gdr"),
                        # /v1/update_weights: the runner's update_weights calls update_weights_by_rdma (fd-spec §2.8)
                        ("control.update_in_place", "update_weights_by_rdma")):
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
_shared = {"users": 0, "env": None, "stack": None, "owner": None, "cuda": None}  # owner: the thread that entered


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
            _shared.update(env=dict(env), stack=stack, owner=threading.get_ident(), cuda=real)
        _shared["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _shared["users"] -= 1
            if not _shared["users"]:
                stack = _shared["stack"]
                _shared.update(stack=None, env=None, owner=None, cuda=None)
                stack.close()


def _forget_other_threads() -> None:
    """In the child of a fork (world.py's own, for the world itself): a shared world another thread entered is
    gone with that thread (its block was dropped), so the child starts with none, ``Tensor.cuda`` its own again;
    the lock is made anew."""
    global _lock
    _lock = threading.Lock()
    if _shared["users"] and _shared["owner"] != threading.get_ident():
        if _shared["cuda"] is not None:
            import paddle

            paddle.Tensor.cuda = _shared["cuda"]
        _shared.update(users=0, env=None, stack=None, owner=None, cuda=None)


os.register_at_fork(after_in_child=_forget_other_threads)


# -- the engine's configuration of the path ----------------------------------------------------------
_flag = threading.Condition()
_flag_in_force = {"value": None, "owners": []}  # owners: the thread of each construction inside the block


@contextlib.contextmanager
def engine_config(module, gdr: bool):
    """``envs.FD_USE_GDR_CHECKPOINT_TRANSFER`` as ``gdr`` while the block constructs a manager of ``module``
    (nothing where the module reads no ``envs``). The suite's stub envs take it on the calling thread only;
    a real ``fastdeploy.envs`` reads the process environment, so the variable is set there, shared by
    constructions that want the same value, and one that wants the other waits until they are done."""
    envs = getattr(module, "envs", None)
    if envs is None:
        yield
        return
    if getattr(envs, "__conformance_stub__", False):
        with thread_config(**{GDR_FLAG: gdr}):
            yield
        return
    want = "1" if gdr else "0"
    with _flag:
        _flag.wait_for(lambda: not _flag_in_force["owners"] or _flag_in_force["value"] == want)
        if not _flag_in_force["owners"]:
            _flag_in_force["saved"] = os.environ.get(GDR_FLAG)
            os.environ[GDR_FLAG] = want
        _flag_in_force["value"] = want
        _flag_in_force["owners"].append(threading.get_ident())
    try:
        yield
    finally:
        with _flag:
            _flag_in_force["owners"].remove(threading.get_ident())
            if not _flag_in_force["owners"]:
                _restore_flag()
                _flag.notify_all()


def _restore_flag() -> None:
    """The process's own value of the flag again, once no construction is inside the block."""
    saved = _flag_in_force.pop("saved", None)
    if saved is None:
        os.environ.pop(GDR_FLAG, None)
    else:
        os.environ[GDR_FLAG] = saved
    _flag_in_force["value"] = None


def _forget_other_constructions() -> None:
    """In the child of a fork: the constructions other threads had inside the block are gone with those threads
    (a child that constructs a streamed manager would otherwise wait for them for ever, or take their value of
    the flag); with none of its own left, the process's value is back. The condition is made anew (another
    thread may have held its lock at the fork)."""
    global _flag
    _flag = threading.Condition()
    mine = [t for t in _flag_in_force["owners"] if t == threading.get_ident()]
    if mine != _flag_in_force["owners"]:
        _flag_in_force["owners"] = mine
        if not mine:
            _restore_flag()


os.register_at_fork(after_in_child=_forget_other_constructions)


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
        """The runner's call, as for the other paths: the constructor picks the first load itself
        (fd-spec §1.4), from the engine configuration this session was opened with (``_engine_config``)."""
        selected = self.env.get("FLAGS_selected_gpus") or "0"
        local_rank = int(selected) if selected.isdigit() else 0
        options = dict(self.config.options)
        if self.strategy != "rsync":
            # GDR era #7951 (update_weights_by_rdma routes by rsync_config's transfer_mode): the engine's GDR setting.
            options["rsync_config"] = {"transfer_mode": "gdr", **dict(options.get("rsync_config") or {})}
        # (the tensor-parallel rank and size as for the other paths: a follower on the suite's cell writes nothing)
        config = fd_config(STRATEGIES[self.strategy], self.config.model_dir, options, self.pid,
                           tp_rank=self.tp_rank, tp_size=self.tp_size)
        with engine_config(sys.modules.get(self._cls.__module__), self.strategy != "rsync"):
            return self._cls(**constructor_kwargs(self.generation.init_params, config, self.models, local_rank))

    def update(self):
        with self._world():
            self._write(UPDATING)
            self._result = None
            if self.manager is None:
                self.manager = self._construct()
                self.capture_model()  # the runner captures its graphs after the startup load
                self._write(NORMAL)  # first load: finalize writes nothing (fd-spec rule 32)
            else:
                self._result = self._entry(self.manager)()
                if self.strategy != "rsync":
                    # GDR runs in the runner's update_parameters (#7951), whose capture_model() precedes the
                    # finalize; rsync's update_weights recaptures nothing (fd-spec §3.5, open #8085)
                    self.capture_model()
                if hasattr(self.manager, "update_weights_by_gdr") and hasattr(self.manager, "finalize_update"):
                    self.manager.finalize_update(self.pid)
                else:
                    self._write(NORMAL)  # the control API reports success; nothing else writes the cell
            self._cleared = False
        return self._result

    def _v1_world(self):
        return self._world()

    def update_weights(self, version=None, verify_checksum: bool = False):
        """The runner's ``update_weights(version, verify_checksum)`` behind ``/v1/update_weights``: the manager's
        ``update_weights_by_rdma`` (the #7951 era routes it by ``rsync_config['transfer_mode']``), each argument
        where the method takes it; its result returned. Nothing is finalized and nothing written to the cell: the
        V1 path's engine copies the result's version into its config (fd-spec §2.8)."""
        if self.manager is None:
            raise RuntimeError("FastDeploy adapter: update_weights before the worker's first load")
        method = self.manager.update_weights_by_rdma
        with self._world():
            return method(**_kwargs(method, version=None if version is None else str(version),
                                    verify_checksum=bool(verify_checksum)))

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
