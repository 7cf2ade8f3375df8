"""The FastDeploy adapter's patches around a call (conformance/impls/fastdeploy/world.py) when calls overlap."""
import glob
import os
import threading

import paddle

from conformance import harness
from conformance.impls.fastdeploy.world import worker_world


def test_overlapping_calls_leave_every_patch_undone_whichever_leaves_first(tmp_path):
    """Two threads' blocks, the first to enter leaving first: while both are in, each thread's paddle.load maps
    /shared_ipc_meta to its own directory; once both have left, paddle.load, the barrier, os.path.exists and
    glob are the real ones again (before, the second restored the first's patches, for the rest of the run)."""
    real = (paddle.load, paddle.distributed.barrier, os.path.exists, glob.glob)
    dirs = [tmp_path / "a", tmp_path / "b"]
    seen: dict[int, list] = {0: [], 1: []}
    entered, first_left = threading.Barrier(2), threading.Event()

    def hook(i):
        return lambda path, configs, real_load: seen[i].append(os.fspath(path))

    def call(i):
        with worker_world({}, str(dirs[i]), load_hook=hook(i)):
            entered.wait(10)
            if i == 1:
                first_left.wait(10)
            paddle.load("/shared_ipc_meta/x.pdparams")
        if i == 0:
            first_left.set()

    threads = [threading.Thread(target=call, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {0: [str(dirs[0] / "x.pdparams")], 1: [str(dirs[1] / "x.pdparams")]}, seen
    now = (paddle.load, paddle.distributed.barrier, os.path.exists, glob.glob)
    assert now == real, f"patches left after both calls: {[n for n, a, b in zip(('load', 'barrier', 'exists', 'glob'), real, now) if a is not b]}"


# -- a fork while calls are in flight ---------------------------------------------------------------------------
IDENTITY = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM")


def _blocked_call(env: dict, shared_dir: str):
    """Another thread inside a call (a block) until the returned event is set; returns (thread, release)."""
    inside, release = threading.Event(), threading.Event()

    def call():
        with worker_world(env, shared_dir):
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    assert inside.wait(10), "the other thread never entered its block"
    return thread, release


def test_a_child_forked_during_another_threads_call_keeps_its_own_identity(tmp_path, monkeypatch):
    """A rank forked while another thread of its parent is inside a call (a streamed call blocked in FastDeploy,
    say) starts with no world: the real functions, and after a call of its own its own identity, never the other
    call's (which, kept, made the rank's next session take itself for a lone worker and skip its barriers)."""
    from conformance.impls.fastdeploy import world

    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    real = (paddle.load, paddle.distributed.barrier, os.path.exists, glob.glob)
    thread, release = _blocked_call({"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1"}, str(tmp_path / "a"))
    try:
        def rank():
            patched = [n for n, a, b in zip(("load", "barrier", "exists", "glob"), real,
                                            (paddle.load, paddle.distributed.barrier, os.path.exists, glob.glob)) if a is not b]
            at_fork = {"active": len(world._worlds["active"]), "patched": patched}
            os.environ.update(PADDLE_TRAINER_ID="1", PADDLE_TRAINERS_NUM="2")  # the rank joins its group
            with worker_world({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2"}, str(tmp_path / "b")):
                pass
            return {**at_fork, "after": {k: os.environ.get(k) for k in IDENTITY},
                    "active_after": len(world._worlds["active"])}

        got = harness.in_child(rank, timeout_s=30)
    finally:
        release.set()
        thread.join(10)
    assert got == {"active": 0, "patched": [], "after": {"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2"},
                   "active_after": 0}, got


def test_a_child_forked_inside_its_own_call_ends_that_call_as_the_parent_would(tmp_path):
    """The forking thread's own block stays in the child, with its identity in force, and ends there as in the
    parent: the patches undone, the environment as before the block; another thread's block is gone."""
    import json

    from conformance.impls.fastdeploy import world

    real = (paddle.load, paddle.distributed.barrier, os.path.exists, glob.glob)
    before = {k: os.environ.get(k) for k in IDENTITY}
    outer = {"PADDLE_TRAINER_ID": "3", "PADDLE_TRAINERS_NUM": "4"}
    thread, release = _blocked_call({"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1"}, str(tmp_path / "a"))
    read, write = os.pipe()
    pid = None
    try:
        try:
            with worker_world(outer, str(tmp_path / "b")):
                pid = os.fork()
                if pid == 0:
                    inside = {"active": len(world._worlds["active"]), "env": {k: os.environ.get(k) for k in IDENTITY}}
        except BaseException:
            if pid == 0:  # the child never goes back into the test run
                os._exit(1)
            raise
        if pid == 0:
            now = (paddle.load, paddle.distributed.barrier, os.path.exists, glob.glob)
            after = {"active": len(world._worlds["active"]), "env": {k: os.environ.get(k) for k in IDENTITY},
                     "patched": [n for n, a, b in zip(("load", "barrier", "exists", "glob"), real, now) if a is not b]}
            os.write(write, json.dumps({"inside": inside, "after": after}).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            got = json.loads(f.read() or "{}")
        os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join(10)
    assert got == {"inside": {"active": 1, "env": outer}, "after": {"active": 0, "env": before, "patched": []}}, got


def test_a_child_forked_during_another_threads_streamed_call_starts_with_no_shared_world(tmp_path):
    """The streamed sessions' shared world (streams.stream_world: the world, and ``Tensor.cuda`` as the identity)
    entered by another thread is not the child's: it starts with no user, and the real ``Tensor.cuda``."""
    from conformance.impls.fastdeploy import streams

    real_cuda = paddle.Tensor.cuda
    inside, release = threading.Event(), threading.Event()

    def call():
        with streams.stream_world({"PADDLE_TRAINER_ID": "0"}, str(tmp_path)):
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    try:
        assert inside.wait(10)
        got = harness.in_child(lambda: {"users": streams._shared["users"], "stack": streams._shared["stack"] is not None,
                                 "cuda_is_real": paddle.Tensor.cuda is real_cuda}, timeout_s=30)
        assert streams._shared["users"] == 1 and paddle.Tensor.cuda is not real_cuda  # the parent's call goes on
    finally:
        release.set()
        thread.join(10)
    assert got == {"users": 0, "stack": False, "cuda_is_real": True}, got
    assert paddle.Tensor.cuda is real_cuda and streams._shared["users"] == 0


def test_a_child_forked_during_another_threads_construction_has_the_flag_of_its_own(tmp_path, monkeypatch):
    """The GDR flag a real ``fastdeploy.envs`` reads (streams.engine_config: set in the process environment for
    the constructions inside the block) while another thread constructs: the child has the process's own value,
    and a construction of its own that wants the other value goes ahead at once instead of waiting for a thread
    that is not there. Forked while the other thread also holds the condition's lock, the child's own
    construction does not wait on that lock."""
    import time
    import types

    from conformance.impls.fastdeploy import streams, stubs

    monkeypatch.setenv(stubs.GDR_FLAG, "process")
    real = types.SimpleNamespace(envs=types.SimpleNamespace())  # not a conformance stub: the process env
    inside, release = threading.Event(), threading.Event()

    def construct():
        with streams.engine_config(real, True):
            with streams._flag:  # the condition's lock held at the fork as well
                inside.set()
                release.wait(30)

    def child():
        before = os.environ.get(stubs.GDR_FLAG)
        start = time.monotonic()
        with streams.engine_config(real, False):
            own = os.environ.get(stubs.GDR_FLAG)
        return {"before": before, "own": own, "after": os.environ.get(stubs.GDR_FLAG),
                "waited": time.monotonic() - start > 5}

    thread = threading.Thread(target=construct, daemon=True)
    thread.start()
    try:
        assert inside.wait(10)
        assert os.environ[stubs.GDR_FLAG] == "1"
        got = harness.in_child(child, timeout_s=30)
    finally:
        release.set()
        thread.join(10)
    assert got == {"before": "process", "own": "0", "after": "process", "waited": False}, got
    assert os.environ[stubs.GDR_FLAG] == "process" and streams._flag_in_force["owners"] == []
