"""Per-part overhead of an ``ipc_snapshot`` update: N one-tensor part files.

    python -m benchmarks.snapshot_parts --parts 2000 --repeat 3

The parent writes N part files ``model_state.tp0.0.part{i}.pdparams`` of one small tensor each
(``fixtures.snapshot``) and runs ``--repeat`` fresh child processes. Each child imports Paddle, builds
the model lazily (as after a clear), creates the reference ``WeightManager`` and measures, side by side:

- ``update()``: plan, validate every header, read each part into its parameter, apply;
- a baseline doing the least any loader must per part: open, read the whole file, close, in the
  same order;
- one ``gc.collect()`` with Paddle loaded (median of 5): FastDeploy collects after every part, which
  is what once made 2000 parts take 135 s.

The files stay in the page cache (they were just written): this measures the software's cost per
part, not the disk (``benchmarks/snapshot_memory.py`` measures against a cold read). Target: N = 2000
parts in under 10 s. Exit status 1 when the median misses it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_MARK = "SNAPSHOT_PARTS_RESULT "
TARGET_S_PER_2000 = 10.0


def model_spec(parts: int, rows: int, cols: int):
    from fixtures.models import spec

    return spec(*[(f"layers.{i}.weight", "float32", (rows, cols)) for i in range(parts)])


def write_parts(model_dir: str, model) -> list[str]:
    from fixtures import snapshot
    from fixtures.models import state

    return snapshot.write_parts(model_dir, 0, 0, {i: {n: a} for i, (n, a) in enumerate(state(model).items())})


def child(args) -> dict:
    import gc
    import logging

    import paddle  # noqa: F401  (imported before anything is timed)

    from fixtures.models import build_models
    from reference import WeightManager

    logging.getLogger("reference").setLevel(logging.WARNING)  # two INFO lines per part otherwise
    model = model_spec(args.parts, args.rows, args.cols)
    paths = sorted(os.listdir(args.child), key=lambda n: int(n.split(".part")[1].split(".")[0]))
    start = time.perf_counter()
    total = 0
    for name in paths:  # the baseline: open, read, close each part in load order
        with open(os.path.join(args.child, name), "rb") as f:
            total += len(f.read())
    read_s = time.perf_counter() - start

    manager = WeightManager(build_models(model), model_dir=args.child, shared_dir=os.path.join(args.child, "none"),
                            env={"CUDA_VISIBLE_DEVICES": "0", "FLAGS_selected_gpus": "0"})
    start = time.perf_counter()
    manager.update()
    update_s = time.perf_counter() - start
    if manager.status.name != "NORMAL" or len(manager.trace) != args.parts:
        raise SystemExit(f"update left status {manager.status.name} after {len(manager.trace)} of {args.parts} parts")

    collects = []
    for _ in range(5):
        start = time.perf_counter()
        gc.collect()
        collects.append(time.perf_counter() - start)
    return {"update_s": update_s, "read_s": read_s, "read_bytes": total, "gc_collect_s": statistics.median(collects)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_parts", description=__doc__.split("\n")[0])
    ap.add_argument("--parts", type=int, default=2000, help="number of one-tensor part files (default 2000)")
    ap.add_argument("--rows", type=int, default=16, help="rows of each float32 tensor (default 16)")
    ap.add_argument("--cols", type=int, default=64, help="columns of each float32 tensor (default 64)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh child processes (default 3)")
    ap.add_argument("--work-dir", default=None, help="where the part files are written (default: system temp)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", metavar="MODEL_DIR", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(RESULT_MARK + json.dumps(child(args)), flush=True)
        return 0

    from rich.console import Console
    from rich.table import Table

    root = tempfile.mkdtemp(prefix="snapshot-parts-", dir=args.work_dir)
    runs = []
    try:
        write_parts(root, model_spec(args.parts, args.rows, args.cols))
        cmd = [sys.executable, "-m", "benchmarks.snapshot_parts", "--child", root, "--parts", str(args.parts),
               "--rows", str(args.rows), "--cols", str(args.cols)]
        for _ in range(args.repeat):
            proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PADDLE_TRAINER_ID="0"), capture_output=True,
                                  text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_MARK)), None)
            if line is None:
                raise RuntimeError(f"child exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            runs.append(json.loads(line[len(RESULT_MARK):]))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    n = args.parts
    target = TARGET_S_PER_2000 * n / 2000

    def col(key, scale=1.0, fmt="{:.3f}"):
        values = [r[key] * scale for r in runs]
        return fmt.format(statistics.median(values)) + " (" + fmt.format(min(values)) + ")"

    update = statistics.median(r["update_s"] for r in runs)
    table = Table(title=f"ipc_snapshot update from {n} one-tensor parts of {args.rows}x{args.cols} float32, "
                        f"{args.repeat} fresh process(es): median (best)")
    for c in ("", "seconds", "ms per part"):
        table.add_column(c, justify="left" if not c else "right")
    table.add_row("update()", col("update_s"), col("update_s", 1000 / n, "{:.2f}"))
    table.add_row("open + read + close (baseline)", col("read_s"), col("read_s", 1000 / n, "{:.2f}"))
    table.add_row("one gc.collect() x parts (FastDeploy's)", col("gc_collect_s", n), col("gc_collect_s", 1000, "{:.2f}"))
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(table)
    verdict = "meets" if update < target else "MISSES"
    console.print(f"update {update:.2f} s for {n} parts ({update / max(statistics.median(r['read_s'] for r in runs), 1e-9):.1f}x "
                  f"the baseline): {verdict} the target of {target:.1f} s", highlight=False)
    console.print("command: python -m benchmarks.snapshot_parts " + " ".join(argv), highlight=False)
    console.print(f"host: {platform.system()} {platform.release()}, {os.cpu_count()} CPUs, Python "
                  f"{platform.python_version()}, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}",
                  highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": argv, "parts": n, "runs": runs, "target_s": target}, f, indent=2)
    return 0 if update < target else 1


if __name__ == "__main__":
    sys.exit(main())
