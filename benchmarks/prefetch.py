"""GDR's prefetch: receiving the next item while the model loads this one, against no read-ahead.

    python -m benchmarks.prefetch --tensors 96 --tensor-mib 2 --repeat 7 --loader device

A trainer process (``sim.stream_trainer.serve_process``, spawn) streams a model of ``--tensors`` float32
tensors of ``--tensor-mib`` MiB through the CheckpointTransfer stand-in to reference ``WeightManager``s on the
``gdr`` strategy in this process. The model's ``load_weights`` copies each item into its parameter and then
reads it back (a CRC-32 of the parameter's bytes: a loader verifying what landed). Loading alone and receiving
alone (an unpaced trainer, a loader that discards) are timed first; loading is made at least as slow as
receiving (``--load-over-receive``), and the trainer then pauses before each item so that receiving takes about
as long as loading. Two loaders: ``cpu`` (CRC passes: loading costs host CPU, as receiving through this
stand-in does, so both compete for the cores) and ``device`` (after the copy the host waits for device work,
as a GPU loader does; on a real deployment the NIC receives without the host CPU either). Each ``update()`` is then timed with ``gdr_prefetch_queue_size`` 1 (no
read-ahead: receive an item, load it, receive the next) and with the prefetch queue (2, FastDeploy's default,
and 4), interleaved in one run after a warm-up of each; the median and the best of ``--repeat`` are reported
with the ratio of the medians to a queue of one. The last update of each is checked bit for bit.
Target: 1.7x or better with the prefetch queue.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import sys
import time
import zlib

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MIB = 1 << 20
TARGET = 1.7


class VerifyingLoader:
    """``load_weights``: copy each item into its parameter, then either CRC-32 the parameter's bytes
    ``rounds`` times (``cpu``: loading costs host CPU) or wait ``device_s_per_byte`` per byte (``device``: the
    host waits for device work, as a GPU loader's copies and transposes are; the host CPU is free)."""

    def __init__(self, model):
        self.params = model.state_dict()
        self.crc = {}
        self.rounds = 1  # CRC passes per item: how heavy loading is
        self.device_s_per_byte = 0.0

    def __call__(self, weights_iterator) -> None:
        import paddle

        with paddle.no_grad():
            for name, tensor in weights_iterator:
                param = self.params[name]
                param.set_value(tensor)
                nbytes = int(np.prod(param.shape)) * param.element_size()
                view = (ctypes.c_uint8 * nbytes).from_address(param.data_ptr())
                if self.device_s_per_byte:
                    time.sleep(self.device_s_per_byte * nbytes)
                    continue
                for _ in range(self.rounds):  # zlib releases the GIL: the receiving thread runs meanwhile
                    self.crc[name] = zlib.crc32(view)


def build(spec):
    from fixtures.models import build_models

    models = build_models(spec)
    for model in models:
        model.load_weights = VerifyingLoader(model)
    return models


def loader_seconds(models, state, repeat: int = 3) -> float:
    """Best time of the loader alone over every tensor (items already in memory, as received)."""
    import paddle

    items = [(n, paddle.to_tensor(a)) for n, a in state.items()]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        models[0].load_weights(iter(items))
        best = min(best, time.perf_counter() - start)
    return best


def manager(models, endpoint: str, window: int, timeout_s: float):
    from reference.manager import WeightManager
    from sim.checkpoint_transfer import install_as_library

    install_as_library()  # the worker's `import checkpoint_transfer` (the stand-in where no real one is)
    cfg = {"endpoint": endpoint, "recv_bucket_timeout_s": timeout_s, "gdr_prefetch_queue_size": window}
    return WeightManager(models, load_strategy="gdr", model_dir=REPO, options={"rsync_config": cfg, "version": "1"})


class Discard:
    """``load_weights`` that takes the items and does nothing: receiving alone."""

    def __call__(self, weights_iterator) -> None:
        for _ in weights_iterator:
            pass


def _serve(spec, args, streams, rate):
    from sim.stream_trainer import serve_process

    return serve_process(spec, streams, seed=args.seed, bytes_per_s=rate)


def _stop(proc, directory) -> None:
    proc.terminate()
    proc.join(10)
    shutil.rmtree(directory, ignore_errors=True)


def receive_seconds(spec, models, args) -> float:
    """Best time of receiving alone (the trainer unpaced, the loader discarding): the CPU the transport itself
    costs here, which on a real deployment the NIC pays."""
    proc, endpoint, directory = _serve(spec, args, 4, 0.0)
    loaders = [m.load_weights for m in models]
    try:
        m = manager(models, endpoint, 1, args.timeout_s)
        m.update()  # loads (parameters must hold data for the discarding runs to pass verification)
        for model in models:
            model.load_weights = Discard()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            m.update()
            best = min(best, time.perf_counter() - start)
        m.close()
    finally:
        for model, fn in zip(models, loaders):
            model.load_weights = fn
        _stop(proc, directory)
    return best


def measure(args) -> dict:
    from fixtures import models as M
    from sim.stream_trainer import patterned_state

    spec = M.spec(*((f"layers.{i}.weight", "float32", (args.tensor_mib * MIB // 4,)) for i in range(args.tensors)))
    state = patterned_state(spec, args.seed)
    nbytes = sum(a.nbytes for a in state.values())
    models = build(spec)
    recv_s = receive_seconds(spec, models, args)
    one_round = loader_seconds(models, state)
    rounds = max(1, round(recv_s * args.load_over_receive / one_round))  # loading at least as slow as receiving
    for model in models:
        if args.loader == "device":
            model.load_weights.device_s_per_byte = recv_s * args.load_over_receive / nbytes
        else:
            model.load_weights.rounds = rounds
    load_s = loader_seconds(models, state)
    pause_s = max(load_s - recv_s, 0.0)  # the trainer's pauses make receiving as slow as loading
    rate = nbytes / pause_s if pause_s > 0 else 0.0  # 0: unpaced
    windows = [1] + [w for w in args.windows if w != 1]
    proc, endpoint, directory = _serve(spec, args, (1 + args.repeat) * len(windows), rate)
    managers = {w: manager(models, endpoint, w, args.timeout_s) for w in windows}
    times: dict[int, list[float]] = {w: [] for w in windows}
    try:
        for r in range(1 + args.repeat):
            for w in windows:
                start = time.perf_counter()
                managers[w].update()
                elapsed = time.perf_counter() - start
                if r:  # the first round warms up
                    times[w].append(elapsed)
                if r == args.repeat and not all(managers[w].params[n].numpy().tobytes() == a.tobytes()
                                                for n, a in state.items()):
                    raise AssertionError(f"window {w}: the last update is not bit-exact")
    finally:
        for m in managers.values():
            m.close()
        _stop(proc, directory)
    base = statistics.median(times[1])
    rows = []
    for w in windows:
        med, best = statistics.median(times[w]), min(times[w])
        rows.append({"window": w, "best_s": best, "median_s": med, "gb_s": nbytes / med / 1e9,
                     "speedup_median": base / med, "speedup_best": min(times[1]) / best, "verified": True})
    return {"tensors": args.tensors, "tensor_mib": args.tensor_mib, "model_mib": nbytes / MIB, "loader_s": load_s,
            "loader": args.loader, "crc_rounds": rounds if args.loader == "cpu" else 0,
            "receive_s": recv_s, "pause_s": pause_s, "rows": rows, "target": TARGET,
            "met": max(r["speedup_median"] for r in rows if r["window"] > 1) >= TARGET,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                        "load_average": os.getloadavg()}}


def show(result: dict) -> None:
    print(f"model: {result['tensors']} x {result['tensor_mib']} MiB float32 = {result['model_mib']:.0f} MiB; "
          f"loader {result['loader']}; loading alone "
          f"{result['loader_s']:.3f} s, receiving alone {result['receive_s']:.3f} s: the trainer pauses "
          f"{result['pause_s']:.3f} s in all so that receiving takes about as long as loading; load average "
          f"{result['machine']['load_average'][0]:.1f} on {result['machine']['cpus']} CPUs")
    print(f"{'queue':>6} {'best s':>8} {'median s':>9} {'GB/s':>6} {'x queue 1 (median)':>19} {'x queue 1 (best)':>17} verified")
    for r in result["rows"]:
        print(f"{r['window']:>6} {r['best_s']:>8.3f} {r['median_s']:>9.3f} {r['gb_s']:>6.2f} "
              f"{r['speedup_median']:>19.2f} {r['speedup_best']:>17.2f} {'yes' if r['verified'] else 'no'}")
    print(f"target {result['target']}x with the prefetch queue: {'met' if result['met'] else 'missed'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=96)
    parser.add_argument("--tensor-mib", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4],
                        help="prefetch queue sizes to compare with 1 (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-over-receive", type=float, default=1.0,
                        help="how much slower than receiving loading is made (calibrated on receiving alone)")
    parser.add_argument("--loader", choices=("cpu", "device"), default="device",
                        help="cpu: loading is CRC passes on the host; device: the host waits for device work")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    result = measure(args)
    show(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
