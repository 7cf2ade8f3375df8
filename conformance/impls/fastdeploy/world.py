"""The world as a FastDeploy worker sees it, around each call the adapter makes into FastDeploy.

* Identity. Each FastDeploy worker is its own process, so a session keeps the environment it was opened
  with (rank and GPU variables) and reinstates it for the call; Paddle's cached parallel env is dropped
  so that ``paddle.distributed.get_rank()`` reads it.
* ``/shared_ipc_meta``. FastDeploy hard-codes it (the snapshot fallback ``/shared_ipc_meta/{base}.pdparams``
  and ``ipc_path = /shared_ipc_meta/ipc_metas_{id}``). For the call, ``os.path.exists``, ``glob.glob`` and
  ``paddle.load`` map a path under it to the same path under the test's ``LoaderConfig.shared_dir``; no
  other path changes. An exception leaving the call has the same mapping applied to its message, so it
  names the file the suite wrote (FastDeploy's message names the directory it read, which in production
  is that file).
* Barriers. DWM-0 calls ``paddle.distributed.barrier()`` whenever the world size is above 1, later
  generations ``barrier(tp_group)`` / ``barrier(ep_group)`` when those groups have several ranks. Without a
  process group (one worker at a time, the quick run) a barrier returns at once, as if the other ranks had
  arrived. On real ranks (the ``multirank`` tier: ``paddle.distributed`` initialized, world size above 1,
  the tensor-parallel group the whole world; the session says so, ``real_ranks``) it is the default group's
  real barrier, with the process group's timeout the engine configures: ``group_timeout_s`` (the job's
  ``agree_timeout_s``). A barrier
  that times out raises ``TimeoutError`` in FastDeploy's call, as a gloo or NCCL timeout does.
* Loads. ``load_hook(path, configs, real_load)`` sees every ``paddle.load`` (after mapping) and decides
  what it returns; ``watch(how, path)`` is told of every lookup (``exists``, ``glob``, ``load``).
* Communication groups. ``paddle.distributed.shutdown_process_group`` and ``restart_process_group`` (the
  engine's library, which FastDeploy calls on a clear or an update when asked, or always in older
  generations) are stand-ins for the call: nothing is shut down (the suite runs no process group) and
  ``groups(how, name)`` is told of each call (``how`` "shutdown" or "restart"; ``name`` "default" for the
  default group, else the group's ``name``: the ``tp_group`` and ``ep_group`` of ``fd_config``).
"""
from __future__ import annotations

import contextlib
import glob as glob_module
import os
import re
import threading
import types

SHARED_IPC_DIR = "/shared_ipc_meta"
WORKER_ENV = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus")


def map_shared(path, shared_dir: str):
    """``path`` with a leading ``/shared_ipc_meta`` replaced by ``shared_dir``; anything else unchanged."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str):
        return path
    if text == SHARED_IPC_DIR:
        return shared_dir
    if text.startswith(SHARED_IPC_DIR + "/"):
        return os.path.join(shared_dir, text[len(SHARED_IPC_DIR) + 1:])
    return path


# FastDeploy's own mention of the directory: not the tail of a longer path (the suite's shared_dir is
# itself named .../shared_ipc_meta, and a message naming a mapped path must stay as it is).
_MENTION = re.compile(r"(?<![\w.\-/])" + re.escape(SHARED_IPC_DIR) + r"(?=/)")


def _map_message(error: BaseException, shared_dir: str) -> None:
    if not isinstance(error, Exception):
        return
    target = shared_dir.rstrip("/")
    if any(isinstance(a, str) and _MENTION.search(a) for a in error.args):
        error.args = tuple(_MENTION.sub(lambda _m: target, a) if isinstance(a, str) else a for a in error.args)
    if isinstance(error, OSError) and isinstance(error.filename, str):
        error.filename = map_shared(error.filename, shared_dir)


def _apply_env(values: dict) -> None:
    from paddle.distributed import parallel

    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    parallel._global_parallel_env = None  # paddle.distributed.get_rank() re-reads the env


class _World:
    """One ``worker_world`` block's configuration, as the patched functions consult it."""

    def __init__(self, env, shared_dir, load_hook, watch, groups, real_ranks, group_timeout_s):
        self.env, self.shared_dir, self.load_hook, self.watch = env, shared_dir, load_hook, watch
        self.groups, self.real_ranks, self.group_timeout_s = groups, real_ranks, group_timeout_s
        self.loading: list = []  # non-empty while paddle.load runs: its own lookups are not FastDeploy's


# The patches are installed by the first block to enter and removed by the last to leave, whatever the threads:
# two calls into one session at once (LIFE-CONCURRENT, an is_paused() while an update runs) each entered a
# block that saved the functions it found, the second saving the first's patches, and, when the first left
# first, the second restored them: paddle.load stayed patched for the rest of the run and failed every stream's
# paddle.load(BytesIO) after it, in whichever case came next. Each thread's calls follow its own innermost block;
# a thread in none (FastDeploy's own threads, started in a call) follows the block entered last. A forked child
# keeps only the blocks of the thread that forked (_forget_other_threads).
_worlds_lock = threading.Lock()
_worlds: dict = {"active": [], "real": None, "env": None}
_mine = threading.local()


_OUTSIDE = _World({}, None, None, None, None, False, 30.0)  # a patched function called after the last block left


def _world() -> _World:
    stack = getattr(_mine, "stack", None)
    if stack:
        return stack[-1]
    active = _worlds["active"]
    return active[-1] if active else _OUTSIDE


def _real(name: str):
    return _worlds["real"][name]


def _exists(path):
    world = _world()
    path = map_shared(path, world.shared_dir) if world.shared_dir else path
    _note(world, "exists", path)
    return _real("exists")(path)


def _glob(pathname, **kwargs):
    world = _world()
    pathname = map_shared(pathname, world.shared_dir) if world.shared_dir else pathname
    _note(world, "glob", pathname)
    return _real("glob")(pathname, **kwargs)


def _load(path, **configs):
    world = _world()
    path = map_shared(path, world.shared_dir) if world.shared_dir else path
    _note(world, "load", path)
    world.loading.append(path)
    try:
        if world.load_hook is None:
            return _real("load")(path, **configs)
        return world.load_hook(path, configs, _real("load"))
    finally:
        world.loading.pop()


def _note(world: _World, how: str, path) -> None:
    if world.watch is not None and not world.loading:
        world.watch(how, os.fspath(path) if isinstance(path, (str, os.PathLike)) else path)


def _barrier(*args, **kwargs):
    world = _world()
    if world.real_ranks:  # the default group: the tensor-parallel group is the whole world (module docstring)
        bounded(_real("barrier"), world.group_timeout_s, "paddle.distributed.barrier")
    return None


def _group_call(how):
    def call(group=None, *args, **kwargs):
        world = _world()
        if world.groups is not None:
            world.groups(how, group_name(group))

    return call


def _install() -> None:
    import paddle

    dist = paddle.distributed
    _worlds["real"] = {"exists": os.path.exists, "glob": glob_module.glob, "load": paddle.load,
                       "barrier": dist.barrier, "shutdown": getattr(dist, "shutdown_process_group", None),
                       "restart": getattr(dist, "restart_process_group", None)}
    _worlds["env"] = {k: os.environ.get(k) for k in WORKER_ENV}
    os.path.exists, glob_module.glob, paddle.load, dist.barrier = _exists, _glob, _load, _barrier
    dist.shutdown_process_group, dist.restart_process_group = _group_call("shutdown"), _group_call("restart")


def _uninstall() -> None:
    import paddle

    dist, real = paddle.distributed, _worlds["real"]
    os.path.exists, glob_module.glob = real["exists"], real["glob"]
    paddle.load, dist.barrier = real["load"], real["barrier"]
    for name, key in (("shutdown_process_group", "shutdown"), ("restart_process_group", "restart")):
        if real[key] is None:
            dist.__dict__.pop(name, None)
        else:
            setattr(dist, name, real[key])
    _apply_env(_worlds["env"])
    _worlds["env"] = None  # (``real`` stays: a patched function someone kept a reference to calls it)


@contextlib.contextmanager
def worker_world(env: dict, shared_dir: str, load_hook=None, watch=None, groups=None, real_ranks: bool = False,
                 group_timeout_s: float = 30.0):
    """Patch the process for one call into FastDeploy (see the module docstring); undo it after the last block
    (of any thread) has left."""
    world = _World(env, shared_dir, load_hook, watch, groups, real_ranks, group_timeout_s)
    with _worlds_lock:
        if not _worlds["active"]:
            _install()
        _worlds["active"].append(world)
        _apply_env(env)
    stack = _mine.__dict__.setdefault("stack", [])
    stack.append(world)
    try:
        yield
    except BaseException as e:
        _map_message(e, shared_dir)
        raise
    finally:
        stack.pop()
        with _worlds_lock:
            _worlds["active"].remove(world)
            if not _worlds["active"]:
                _uninstall()
            else:
                _apply_env(_worlds["active"][-1].env)


def _forget_other_threads() -> None:
    """In the child of a fork, which has only the thread that forked: the blocks other threads were inside (a
    streamed call still blocked in FastDeploy, a concurrent call) are not the child's, and go with their
    identity. Kept, the next block to end in the child put that identity back into the child's environment (a
    rank forked while a call of an earlier case was still blocked in the test process got that call's
    ``PADDLE_TRAINERS_NUM``, 1, after its own first call, and its next session took itself for a lone worker,
    skipping every barrier its peers waited in). The forking thread's own blocks stay, and end in the child as
    they would have in the parent. The lock is made anew: another thread may have held it."""
    global _worlds_lock
    _worlds_lock = threading.Lock()
    own = getattr(_mine, "stack", [])
    kept = [w for w in _worlds["active"] if any(w is o for o in own)]
    if len(kept) == len(_worlds["active"]):
        return
    _worlds["active"] = kept
    if kept:
        _apply_env(kept[-1].env)
    else:
        _uninstall()


os.register_at_fork(after_in_child=_forget_other_threads)


def real_group() -> bool:
    """True on a real rank of several: ``paddle.distributed`` initialized with a world size above 1."""
    import paddle.distributed as dist

    return bool(dist.is_initialized()) and dist.get_world_size() > 1


def bounded(call, timeout_s: float, what: str):
    """``call()`` on the default group within ``timeout_s`` (the process group's timeout): the collective
    runs on a daemon thread, and a timeout raises ``TimeoutError`` naming it. A collective left pending
    breaks the group, as a real timeout does: the ranks' harness then sees its own collectives fail."""
    import threading

    result: dict = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
            result["error"] = e

    thread = threading.Thread(target=run, name=f"fastdeploy-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what}: the other ranks did not arrive within {timeout_s:g}s (the process group's timeout)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def group_name(group) -> str:
    """"default" for the default group (no argument or None), else the group's name."""
    return "default" if group is None else str(getattr(group, "name", group))


def fd_config(load_strategy: str, model_dir: str, options, pid, tp_rank: int = 0, tp_size: int = 1,
              shutdown_comm_group: bool = False) -> types.SimpleNamespace:
    """The parts of FDConfig that any generation reads: no EP; tensor-parallel rank and size as the engine
    launched this worker (one rank of a one-rank group unless the session shares the suite's status cell);
    ``tp_group`` and ``ep_group`` are named stand-ins (``groups`` of ``worker_world`` tells them apart from
    the default group). The model directory is both ``model_config.model`` and DWM-0's
    ``parallel_config.model_name_or_path``."""
    ns = types.SimpleNamespace
    return ns(
        load_config=ns(load_strategy=load_strategy, dynamic_load_weight=True, rsync_config=dict(options).get("rsync_config")),
        parallel_config=ns(
            tensor_parallel_rank=tp_rank, tensor_parallel_size=tp_size, enable_expert_parallel=False,
            local_data_parallel_id=0, expert_parallel_rank=0, tp_group=ns(name="tp"), ep_group=ns(name="ep"),
            local_engine_worker_queue_port=pid, shutdown_comm_group_if_worker_idle=shutdown_comm_group,
            model_name_or_path=model_dir,
        ),
        model_config=ns(model=model_dir),
    )
