"""End-to-end ``ipc_bucket`` throughput against a plain memcpy of the same bytes.

    python -m benchmarks.bucket_throughput --model-mib 1024 --buckets 16,64,256,1024 --png benchmarks/bucket_throughput.png

For each bucket size a trainer process (``sim.trainer``, spawn) publishes a ~1 GiB model (the mixed-
dtype decoder of ``sim.cli.model_spec``, random bytes) to a reference ``WeightManager`` in this
process: the timed span is ``update()``, from the worker's hello to its last parameter adopted, so it
covers the trainer packing each bucket into shared memory, the worker validating, copying it into
Paddle tensors it owns and acknowledging, and the final commit. The first update of each size is a
warm-up (first touch of the shared buffers); the best of ``--repeat`` following updates is reported
(``clear()`` before each, as in RL). The last update of each size is verified: sha256 of every
parameter as landed equals the trainer's.

Baselines, measured in the same run on the same number of bytes: ``np.copyto`` into an already
touched buffer (best of 5), one memcpy with no page faults; and ``ndarray.copy()`` (best of 3),
which allocates fresh pages as a worker must after ``clear()``. Ratios are throughput / baseline.
Target: 0.6 or better at the best bucket size.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MIB = 1 << 20
TARGET = 0.6


def memcpy_baseline(nbytes: int, repeat: int = 5) -> tuple[float, float]:
    """(seconds of the best prefaulted np.copyto, seconds of the best fresh ndarray.copy())."""
    src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)  # touch every page first: the baseline is the copy alone
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    del dst
    fresh = min(_timed(lambda: src.copy()) for _ in range(max(2, repeat // 2)))
    return best, fresh


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(model, bucket_bytes: int, repeat: int, timeout_s: float) -> dict:
    from sim.cli import Roundtrip

    versions = tuple(range(1, repeat + 2))
    with Roundtrip(ranks=1, model=model, bucket_bytes=bucket_bytes, versions=versions, timeout_s=timeout_s,
                   fast_fill=True, verify=(versions[-1],)) as rt:
        runs = [rt.run_version(v) for v in versions]
        buckets = next((m["buckets"] for m in rt.messages if m.get("type") == "sent"), None)
    failed = {r.version: f"{type(e).__name__}: {e}" for r in runs for e in r.errors.values()}
    if failed:
        raise RuntimeError(f"bucket {bucket_bytes / MIB:g} MiB: updates failed: {failed}")
    bad = [c.name for c in runs[-1].checks if not c.ok]
    timed = [r.seconds for r in runs[1:]]
    return {
        "bucket_mib": bucket_bytes / MIB,
        "buckets": buckets,
        "warmup_s": runs[0].seconds,
        "seconds": timed,
        "best_s": min(timed),
        "median_s": float(np.median(timed)),
        "verified": len(runs[-1].checks),
        "mismatches": bad,
    }


def plot(rows, memcpy_gbps: float, fresh_gbps: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["bucket_mib"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r["gbps"] for r in rows], "o-", label="ipc_bucket end to end (best)")
    ax.plot(x, [r["median_gbps"] for r in rows], "x--", alpha=0.6, label="ipc_bucket end to end (median)")
    ax.axhline(memcpy_gbps, color="gray", label=f"memcpy, prefaulted ({memcpy_gbps:.1f} GB/s)")
    ax.axhline(TARGET * memcpy_gbps, color="gray", linestyle=":", label=f"target {TARGET} x memcpy")
    ax.axhline(fresh_gbps, color="tab:green", linestyle="-.", label=f"np.copy, fresh pages ({fresh_gbps:.1f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel("bucket size (MiB; two buffers per trainer)")
    ax.set_ylabel("GB/s (model bytes / update time)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=float, default=1024)
    parser.add_argument("--buckets", default="16,64,256,1024", help="bucket sizes in MiB, comma separated")
    parser.add_argument("--repeat", type=int, default=5, help="timed updates per bucket size (after one warm-up)")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--png", default=None, help="save the throughput plot here")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)

    import logging

    from rich.console import Console
    from rich.table import Table

    logging.getLogger("reference").setLevel(logging.WARNING)  # one INFO line per bucket otherwise

    from wire import protocol
    from sim.cli import model_spec

    console = Console(width=None if sys.stdout.isatty() else 120)
    model = model_spec(args.model_mib)
    sizes = [protocol.align_up(int(float(b) * MIB)) for b in args.buckets.split(",")]
    memcpy_s, fresh_s = memcpy_baseline(model.nbytes)
    memcpy_gbps = model.nbytes / memcpy_s / 1e9
    console.print(f"model {model.nbytes / MIB:,.1f} MiB ({len(model.all_params)} tensors), {os.cpu_count()} CPUs; "
                  f"memcpy (prefaulted np.copyto) {memcpy_gbps:.2f} GB/s, fresh ndarray.copy() "
                  f"{model.nbytes / fresh_s / 1e9:.2f} GB/s", highlight=False)
    rows = []
    for size in sizes:
        if size == sizes[-1] and len(sizes) > 1:
            # Measure the baselines again late in the run and keep the best: the stricter comparison.
            again = memcpy_baseline(model.nbytes)
            memcpy_s, fresh_s = min(memcpy_s, again[0]), min(fresh_s, again[1])
            memcpy_gbps = model.nbytes / memcpy_s / 1e9
            for r in rows:
                r["ratio"], r["ratio_fresh"] = r["gbps"] / memcpy_gbps, fresh_s / r["best_s"]
        row = measure(model, size, args.repeat, args.timeout_s)
        row["gbps"] = model.nbytes / row["best_s"] / 1e9
        row["median_gbps"] = model.nbytes / row["median_s"] / 1e9
        row["ratio"] = row["gbps"] / memcpy_gbps
        row["ratio_fresh"] = row["best_s"] and fresh_s / row["best_s"]
        rows.append(row)
        console.print(f"  bucket {row['bucket_mib']:g} MiB: best {row['best_s']:.3f}s ({row['gbps']:.2f} GB/s, "
                      f"{row['ratio']:.2f} x memcpy), runs {[round(s, 3) for s in row['seconds']]}", highlight=False)

    table = Table(title=f"ipc_bucket end to end, {model.nbytes / MIB:,.0f} MiB model, best of {args.repeat}")
    for col in ("bucket MiB", "buckets", "best s", "median s", "GB/s", "x memcpy", "x np.copy", "verified"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['bucket_mib']:g}", str(r["buckets"]), f"{r['best_s']:.3f}", f"{r['median_s']:.3f}",
                      f"{r['gbps']:.2f}", f"{r['ratio']:.2f}", f"{r['ratio_fresh']:.2f}",
                      f"{r['verified'] - len(r['mismatches'])}/{r['verified']}")
    table.add_row("memcpy", "", f"{memcpy_s:.3f}", "", f"{memcpy_gbps:.2f}", "1.00", f"{fresh_s / memcpy_s:.2f}", "")
    table.add_row("np.copy", "", f"{fresh_s:.3f}", "", f"{model.nbytes / fresh_s / 1e9:.2f}", f"{memcpy_s / fresh_s:.2f}",
                  "1.00", "")
    console.print(table)
    best = max(rows, key=lambda r: r["ratio"])
    for name, key in (("memcpy (prefaulted np.copyto)", "ratio"), ("np.copy (allocate + copy)", "ratio_fresh")):
        verdict = "meets" if best[key] >= TARGET else "MISSES"
        console.print(f"best: {best['bucket_mib']:g} MiB buckets at {best[key]:.2f} x {name}: {verdict} the {TARGET} "
                      "target", highlight=False)
    if args.png:
        plot(rows, memcpy_gbps, model.nbytes / fresh_s / 1e9, args.png, f"{model.nbytes / MIB:,.0f} MiB model, {os.cpu_count()} CPUs, "
             f"{platform.machine()}, Python {platform.python_version()}")
        console.print(f"plot written to {args.png}", highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"memcpy_s": memcpy_s, "fresh_copy_s": fresh_s, "model_bytes": model.nbytes, "rows": rows}, f, indent=2)
    mismatched = [r["bucket_mib"] for r in rows if r["mismatches"]]
    if mismatched:
        console.print(f"[bold red]landed bytes differ from the trainer's at bucket sizes {mismatched}[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
