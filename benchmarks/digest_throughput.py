"""Digest throughput against a memcpy of the same bytes, measured side by side in one run.

    python -m benchmarks.digest_throughput --model-mib 1024 --repeat 7

One buffer of random bytes (``--model-mib``, at least 1 GiB for the figures in docs/benchmarks.md) is hashed
whole with MD5, SHA-256 and XXH3-128, and the same bytes, carved into the tensors of the mixed-dtype
decoder of ``sim.cli.model_spec`` (views, no copy), are digested as a model by ``reference.digest``:
the trainer's side (numpy arrays) and the receiver's side (Paddle CPU tensors, ``WeightManager``'s
parameters as landed), with XXH3 alone, MD5 alone and both (the default, what the simulator reports).
The baseline is ``np.copyto`` of the same bytes into a buffer whose pages are already touched: one
memcpy, no page faults. Every candidate runs once per round, rounds interleave the candidates so that
load on a shared machine hits them alike; the best and the median of ``--repeat`` rounds are reported.
``x memcpy`` is memcpy's time over the candidate's (the candidate's throughput as a multiple of
memcpy's): best over best and median over median. Target: the whole-model XXH3 digest at 0.5 or better.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MIB = 1 << 20
TARGET = 0.5
TARGET_ROW = "model digest, xxh3 (receiver: Paddle tensors)"


def carve(buf: np.ndarray, model) -> dict[str, np.ndarray]:
    """The model's tensors as views of consecutive bytes of ``buf`` (bool bytes made 0/1 in place)."""
    from fixtures.models import NUMPY_DTYPES

    out, cursor = {}, 0
    for p in model.all_params:
        raw = buf[cursor : cursor + p.nbytes]
        if p.dtype == "bool":
            np.bitwise_and(raw, 1, out=raw)
        out[p.name] = raw.view(NUMPY_DTYPES[p.dtype]).reshape(p.shape)
        cursor += p.nbytes
    return out


def paddle_params(state: dict[str, np.ndarray]) -> dict:
    """Paddle CPU tensors holding the same bytes (a copy: the receiver's own memory)."""
    import paddle

    out = {}
    for name, arr in state.items():
        kind = arr.dtype.name
        if kind == "bfloat16":
            out[name] = paddle.to_tensor(arr.view(np.uint16))
        elif kind.startswith("float8"):
            out[name] = paddle.to_tensor(arr.view(np.uint8)).view(getattr(paddle, kind))
        else:
            out[name] = paddle.to_tensor(arr)
    return out


def candidates(buf: np.ndarray, dst: np.ndarray, state: dict, params: dict) -> dict:
    import xxhash

    from reference.digest import paddle_model_digest
    from sim.trainer import state_digest

    items = list(params.items())

    view = memoryview(buf)
    return {
        "memcpy (np.copyto, prefaulted)": lambda: np.copyto(dst, buf),
        "md5, one buffer": lambda: hashlib.md5(view).hexdigest(),
        "sha256, one buffer": lambda: hashlib.sha256(view).hexdigest(),
        "xxh3-128, one buffer": lambda: xxhash.xxh3_128(view).hexdigest(),
        "model digest, xxh3 (trainer: numpy)": lambda: state_digest(state, ["xxh3"]),
        TARGET_ROW: lambda: paddle_model_digest(items, ["xxh3"]),
        "model digest, md5 (receiver: Paddle tensors)": lambda: paddle_model_digest(items, ["md5"]),
        "model digest, xxh3 + md5 (receiver: Paddle tensors)": lambda: paddle_model_digest(items, ("xxh3", "md5")),
    }


def measure(model_mib: float, repeat: int) -> tuple[int, list[dict]]:
    from sim.cli import model_spec

    model = model_spec(model_mib)
    nbytes = model.nbytes
    buf = np.frombuffer(bytearray(np.random.default_rng(0).bytes(nbytes)), np.uint8)
    dst = np.empty_like(buf)
    dst.fill(0)  # touch every page: the baseline is the copy alone
    state = carve(buf, model)
    params = paddle_params(state)
    from reference.digest import DEFAULT_ALGORITHMS, paddle_model_digest
    from sim.trainer import state_digest

    assert state_digest(state).as_dict() == paddle_model_digest(params.items(), DEFAULT_ALGORITHMS).as_dict(), \
        "trainer and receiver digests differ"
    runs = candidates(buf, dst, state, params)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = times["memcpy (np.copyto, prefaulted)"]
    rows = []
    for name, ts in times.items():
        best, median = min(ts), statistics.median(ts)
        rows.append({"name": name, "best_s": best, "median_s": median, "gbps_best": nbytes / best / 1e9,
                     "x_memcpy_best": min(base) / best, "x_memcpy_median": statistics.median(base) / median})
    return nbytes, rows


def render(nbytes: int, rows: list[dict], repeat: int) -> bool:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Digest throughput over {nbytes / MIB:,.0f} MiB ({nbytes:,} bytes), best and median of {repeat}")
    for col in ("candidate", "best s", "median s", "GB/s (best)", "x memcpy (best)", "x memcpy (median)"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['best_s']:.3f}", f"{r['median_s']:.3f}", f"{r['gbps_best']:.2f}",
                      f"{r['x_memcpy_best']:.2f}", f"{r['x_memcpy_median']:.2f}")
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    target = next(r for r in rows if r["name"] == TARGET_ROW)
    ok = target["x_memcpy_median"] >= TARGET
    console.print(f"target: {TARGET_ROW} at {TARGET}x memcpy or better: median {target['x_memcpy_median']:.2f}x, "
                  f"best {target['x_memcpy_best']:.2f}x: {'met' if ok else 'MISSED'}", highlight=False)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=float, default=1024)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="write the rows and the machine to this file")
    args = parser.parse_args(argv)
    if args.repeat < 1 or not args.model_mib > 0:
        parser.error("--repeat and --model-mib must be positive")
    import logging

    logging.basicConfig(level=logging.WARNING)
    nbytes, rows = measure(args.model_mib, args.repeat)
    ok = render(nbytes, rows, args.repeat)
    if args.json:
        import psutil

        machine = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                   "cpu": platform.processor() or platform.machine(), "memory_gib": psutil.virtual_memory().total / (1 << 30)}
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "repeat": args.repeat, "target": TARGET, "met": ok, "machine": machine,
                       "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
