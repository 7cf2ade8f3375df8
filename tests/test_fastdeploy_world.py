"""The FastDeploy adapter's patches around a call (conformance/impls/fastdeploy/world.py) when calls overlap."""
import glob
import os
import threading

import paddle

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
