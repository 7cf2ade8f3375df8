"""Peak host memory (RSS) and load time of an ``ipc_snapshot`` update: one file against k part files.

    python -m benchmarks.snapshot_memory --model-mib 1024 --parts 2,4,8,16 --repeat 3

For each layout (the single file ``model_state.tp0.0.pdparams``, then k = 2, 4, ... part files) the
parent writes the snapshot with ``fixtures.snapshot`` (safetensors) and starts a *fresh* child
process, so that peaks of different layouts never mix. The child imports Paddle, builds the model
lazily with ``fixtures.models.build_models`` and creates the reference ``WeightManager``; then, as
in an RL step, it loads the snapshot once, calls ``clear()`` (the parameters' memory goes back to the
system) and drops the files from the page cache again. It takes its baseline RSS there, runs
``update()`` and reports (``--first-load`` measures the first load of the lazily built model instead)

- the peak RSS increase over the baseline: the larger of the kernel's high-water mark (``VmHWM``,
  reset to the baseline through ``/proc/self/clear_refs``, which needs no root) and a psutil sampler
  thread polling every ~1 ms (a thread can miss a peak while a C call holds the GIL; the kernel
  cannot);
- the RSS increase left once ``update()`` returned, and how much of it is file-backed;
- the wall time of ``update()``.

RSS counts the file pages a process has mapped and touched, not just its own allocations: they are
reported as measured, not subtracted. Target: a peak of at most ``M + 64 MiB`` for every layout (the
conformance rule MEM-SNAPSHOT-PEAK asks less of any loader: ``M * (1 + 1.5/k) + 64 MiB``). After the
measurement the child reads every parameter once: weights that are still views of the file's mmap
then fault in as file-backed RSS ("file-backed weights/M" near 1), which marks the row as failed,
since its near-zero peak only says that nothing was read. Exit status 1 when a layout fails the
memory target.

Load time against the disk, measured side by side: each of ``--repeat`` rounds drops the files from
the page cache (fsync, then ``posix_fadvise(DONTNEED)``, allowed without root) before each of three
fresh children, their order rotating from round to round: one reads the same files front to back
into a reused 1 MiB buffer (a cold sequential read, ``cat`` > /dev/null: the disk alone), one reads
them the same way into memory mapped just before (the disk plus the first touch of M bytes of new
memory, which any loader into cleared parameters pays), and the loader's child. Reported: each
time's median and best, and load/read as the median of the rounds' ratios and as best load over
best read. Target: load within 1.1x the cold read into the reused buffer.
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
COLS = 256
RESULT_MARK = "SNAPSHOT_MEMORY_RESULT "


def model_spec(model_mib: float, tensors: int):
    """``tensors`` 2-D tensors of equal byte size, float32 and bfloat16 alternating, totalling ~M."""
    from fixtures.models import spec

    per = int(model_mib * MIB) // tensors
    params = []
    for i in range(tensors):
        dtype, itemsize = ("float32", 4) if i % 2 == 0 else ("bfloat16", 2)
        rows = per // (COLS * itemsize)
        if rows < 1:
            raise SystemExit(f"--model-mib {model_mib} is too small for {tensors} tensors of {COLS} columns")
        params.append((f"layers.{i}.weight", dtype, (rows, COLS)))
    return spec(*params)


# -- child: one measurement in a fresh process ------------------------------------------------
class Sampler(threading.Thread):
    """Polls RSS (and its file-backed part) every ``interval`` seconds; keeps the peak."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.halt = threading.Event()
        self.peak = self.peak_shared = self.samples = 0

    def sample(self) -> None:
        info = self.proc.memory_info()
        self.samples += 1
        if info.rss > self.peak:
            self.peak, self.peak_shared = info.rss, info.shared

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            time.sleep(self.interval)

    def stop(self) -> None:
        self.halt.set()
        self.join()
        self.sample()


def _status_kib(field: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, own process, no root needed)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(args) -> dict:
    import resource

    import numpy as np
    import paddle  # noqa: F401  (imported before the baseline: its footprint is not the load's)
    import psutil

    from fixtures.models import build_models, weights
    from reference import WeightManager

    model = model_spec(args.model_mib, args.tensors)
    models = build_models(model)
    manager = WeightManager(
        models,
        load_strategy="ipc_snapshot",
        model_dir=args.model_dir,
        shared_dir=os.path.join(args.model_dir, "no-fallback"),
        env={"CUDA_VISIBLE_DEVICES": "0", "FLAGS_selected_gpus": "0"},
    )
    if (manager.rank, manager.gpu_id) != (0, 0):
        raise SystemExit(f"expected rank 0 / GPU 0, got rank {manager.rank} / GPU {manager.gpu_id}")
    proc = psutil.Process()
    # Run the ops of the post-update check once now: their first call faults in Paddle's kernel
    # library pages (shared, file-backed RSS of several MiB) that would read as aliased weights.
    import paddle

    for dtype in {p.dtype for p in model.all_params}:
        probe = paddle.ones([4], dtype=dtype)
        probe.sum()
        probe.numpy()
    cycle = {}
    if args.cycle:
        # RL's step: the weights are loaded, clear() gives their memory back, and the measured update
        # lands in it. The first load reads the files into the page cache: drop them again.
        manager.update()
        cycle["loaded_rss"] = proc.memory_info().rss
        manager.clear()
        cycle["cleared_rss"] = proc.memory_info().rss
        drop_page_cache([os.path.join(args.model_dir, n) for n in sorted(os.listdir(args.model_dir))
                         if n.endswith(".pdparams")])
    gc.collect()
    before = proc.memory_info()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    hwm_ok = _reset_hwm()
    sampler = Sampler(args.interval_ms / 1000)
    sampler.start()
    start = time.perf_counter()
    manager.update()
    seconds = time.perf_counter() - start
    sampler.stop()
    after = proc.memory_info()
    hwm = (_status_kib("VmHWM") or 0) * 1024 if hwm_ok else 0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # Outside the measurement. Read every parameter once: weights that still alias the file's mmap
    # fault their pages in now and show up as file-backed RSS (a peak near 0 then means "not read",
    # not "cheap"); weights the update copied into owned memory add nothing.
    for param in manager.params.values():
        param.sum()
    touched = proc.memory_info()
    # The update must really have loaded the bytes the fixtures wrote.
    for p in (model.main[0], model.main[-1]):
        got = np.ascontiguousarray(manager.params[p.name].numpy()).tobytes()
        if got != weights(p).tobytes():
            raise SystemExit(f"{args.model_dir}: parameter {p.name} does not hold the written bytes")
    return {
        "model_bytes": model.nbytes,
        "status": manager.status.name,
        "sources": len(manager.trace),
        "baseline": before.rss,
        "peak_hwm": max(hwm - before.rss, 0) if hwm_ok else None,
        "peak_sampled": sampler.peak - before.rss,
        "peak_sampled_file": sampler.peak_shared - before.shared,
        "samples": sampler.samples,
        # ru_maxrss cannot be reset: it only says something when nothing before the update was higher.
        "peak_maxrss": maxrss - before.rss if maxrss_before <= before.rss else None,
        "final": after.rss - before.rss,
        "final_file": after.shared - before.shared,
        "weights_file": max(touched.shared - before.shared, 0),
        "seconds": seconds,
        **cycle,
    }


def read_child(paths: list[str], fresh: bool) -> dict:
    """A cold sequential read of ``paths``, in order: into one reused 1 MiB buffer (the disk alone),
    or (``fresh``) each file into memory mapped for it just before, 4 MiB per read (the disk plus the
    first touch of M bytes of new memory, which any loader into cleared parameters pays too)."""
    reused = memoryview(bytearray(1 << 20))
    total = 0
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            area = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if fresh else None
            with memoryview(area if fresh else reused) as dest:
                done = 0
                while done < size:
                    with dest[done : done + (4 << 20)] if fresh else dest[:] as window:
                        got = os.preadv(fd, [window], done)
                    if not got:
                        break
                    done += got
            total += done
            if area is not None:
                area.close()
        finally:
            os.close(fd)
    return {"seconds": time.perf_counter() - start, "bytes": total}


# -- parent: write, drop cache, measure in a child, tabulate ---------------------------------
def write_layout(root: str, state, k: int) -> list[str]:
    from fixtures import snapshot

    model_dir = os.path.join(root, "single" if k == 1 else f"parts{k}")
    if k == 1:
        return [snapshot.write_safetensors(snapshot.single_path(model_dir, 0, 0), state)]
    return snapshot.write_parts(model_dir, 0, 0, dict(enumerate(snapshot.split(state, k))))


def drop_page_cache(paths) -> bool:
    ok = hasattr(os, "posix_fadvise")
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            if ok:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ok


def _run_child(extra: list[str], what: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.snapshot_memory", *extra]
    env = dict(os.environ, PADDLE_TRAINER_ID="0")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise RuntimeError(f"child for {what} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def measure(args, model_dir: str) -> dict:
    return _run_child(["--child", model_dir, "--model-mib", str(args.model_mib), "--tensors", str(args.tensors),
                       "--interval-ms", str(args.interval_ms)] + ([] if args.cycle else ["--first-load"]), model_dir)


def measure_read(paths: list[str], fresh: bool) -> dict:
    return _run_child(["--read-child", *paths] + (["--fresh"] if fresh else []),
                      f"the cold read of {os.path.dirname(paths[0])}")


def target_bytes(model_bytes: int, slack_mib: float) -> float:
    """The reference's target: the model itself and a fixed allowance, whatever the layout."""
    return model_bytes + slack_mib * MIB


def rule_bytes(model_bytes: int, k: int, slack_mib: float) -> float:
    """MEM-SNAPSHOT-PEAK's bound for any loader: one part beyond the model, with margin."""
    return model_bytes * (1 + 1.5 / k) + slack_mib * MIB


def machine_info() -> dict:
    import paddle
    import psutil
    import safetensors

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), platform.processor())
    except OSError:
        cpu = platform.processor()
    return {
        "host": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": f"{cpu} ({os.cpu_count()} logical cores)",
        "memory": f"{psutil.virtual_memory().total / (1 << 30):.1f} GiB",
        "python": platform.python_version(),
        "paddle": paddle.__version__,
        "safetensors": safetensors.__version__,
    }


TIME_TARGET = 1.1  # load time / cold sequential read time


def measure_layout(args, paths: list[str]) -> tuple[list[dict], dict[str, list[float]], bool]:
    """``--repeat`` rounds of (cold read, cold read into fresh memory, load), the order rotating from
    round to round, the page cache dropped before each child. Returns the loads' results, the reads'
    seconds by kind and whether every drop worked."""
    loads, reads, dropped = [], {"reused": [], "fresh": []}, True
    size = sum(os.path.getsize(p) for p in paths)
    order = ["reused", "fresh", "load"]
    for round_ in range(args.repeat):
        for what in order[round_ % 3:] + order[: round_ % 3]:
            if args.drop_cache:
                dropped = drop_page_cache(paths) and dropped
            if what == "load":
                loads.append(measure(args, os.path.dirname(paths[0])))
                continue
            r = measure_read(paths, fresh=what == "fresh")
            if r["bytes"] != size:
                raise RuntimeError(f"the cold read ({what}) got {r['bytes']} of the {size} bytes of {paths}")
            reads[what].append(r["seconds"])
    return loads, reads, dropped


def layout_row(k: int, loads: list[dict], all_reads: dict[str, list[float]], slack_mib: float) -> dict:
    """One table row: memory from the round with the highest peak, times over every round."""
    def peak_of(r):
        return max(v for v in (r["peak_hwm"], r["peak_sampled"]) if v is not None)

    r = max(loads, key=peak_of)
    m = r["model_bytes"]
    peak = peak_of(r)
    target = target_bytes(m, slack_mib)
    # Weights left as views of the file's mmap were never read: their near-zero peak measures
    # nothing, so such a row cannot pass.
    weights_file = max(x["weights_file"] for x in loads)
    aliased = weights_file > m / 2
    load_s = [x["seconds"] for x in loads]
    reads, fresh = all_reads["reused"], all_reads["fresh"]
    ratios = [a / b for a, b in zip(load_s, reads)]
    ratio_median = statistics.median(ratios)
    fresh_ratios = [a / b for a, b in zip(load_s, fresh)]
    return {
        "layout": "single" if k == 1 else "parts",
        "k": k,
        "peak_over_m": peak / m,
        "final_over_m": r["final"] / m,
        "target_over_m": target / m,
        "rule_over_m": rule_bytes(m, k, slack_mib) / m,
        "verdict": "FAIL: weights alias the file" if aliased else ("pass" if peak <= target else "FAIL"),
        "peak_mib": peak / MIB,
        "final_file_over_m": r["final_file"] / m,
        "weights_file_over_m": weights_file / m,
        "sampled_over_m": r["peak_sampled"] / m,
        "hwm_over_m": None if r["peak_hwm"] is None else r["peak_hwm"] / m,
        "maxrss_over_m": None if r["peak_maxrss"] is None else r["peak_maxrss"] / m,
        "load_seconds": load_s,
        "read_seconds": reads,
        "load_over_read": ratios,
        "load_over_read_median": ratio_median,
        "load_over_read_best": min(load_s) / min(reads),
        "fresh_read_seconds": fresh,
        "load_over_fresh_read": fresh_ratios,
        "load_over_fresh_read_median": statistics.median(fresh_ratios),
        "load_over_fresh_read_best": min(load_s) / min(fresh),
        "time_verdict": "pass" if ratio_median <= TIME_TARGET else "miss",
        **r,
        "seconds": statistics.median(load_s),
    }


def run(args) -> tuple[list[dict], dict]:
    from fixtures.models import state

    ks = [1] + [int(k) for k in args.parts.split(",") if k.strip()]
    if max(ks) > args.tensors:
        raise SystemExit(f"--tensors {args.tensors} cannot be split into {max(ks)} parts")
    model = model_spec(args.model_mib, args.tensors)
    values = state(model)
    root = tempfile.mkdtemp(prefix="snapshot-memory-", dir=args.work_dir)
    rows, dropped = [], True
    try:
        for k in ks:
            paths = write_layout(root, values, k)
            loads, reads, ok = measure_layout(args, paths)
            dropped = dropped and ok
            shutil.rmtree(os.path.dirname(paths[0]))
            rows.append(layout_row(k, loads, reads, args.slack_mib))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    info = machine_info()
    info["page cache"] = ("fsync + posix_fadvise(DONTNEED) before each child" if args.drop_cache and dropped
                          else "not dropped: files were just written and are read from the page cache")
    info["load average"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return rows, info


def render(rows, info, argv) -> None:
    from rich.console import Console
    from rich.table import Table

    def ratio(v):
        return "-" if v is None else f"{v:.2f}"

    def spread(values):
        return f"{statistics.median(values):.2f} ({min(values):.2f})"

    m = rows[0]["model_bytes"]
    repeat = len(rows[0]["load_seconds"])
    table = Table(title=f"ipc_snapshot update, peak host RSS over the pre-update baseline (M = {m / MIB:.0f} MiB) "
                        f"and load time against a cold read, {repeat} round(s): median (best)")
    for col in ("layout", "k", "peak/M", "final/M", "target/M", "verdict", "peak MiB", "file-backed weights/M",
                "load s", "cold read s", "load/read", f"<= {TIME_TARGET}", "read, fresh memory s", "load/that"):
        table.add_column(col, justify="left" if col in ("layout", "verdict") else "right")
    for r in rows:
        table.add_row(
            r["layout"], str(r["k"]), ratio(r["peak_over_m"]), ratio(r["final_over_m"]), ratio(r["target_over_m"]),
            r["verdict"] if r["verdict"] == "pass" else f"[bold red]{r['verdict']}[/]", f"{r['peak_mib']:.0f}",
            ratio(r["weights_file_over_m"]), spread(r["load_seconds"]), spread(r["read_seconds"]),
            f"{r['load_over_read_median']:.2f} ({r['load_over_read_best']:.2f})", r["time_verdict"],
            spread(r["fresh_read_seconds"]),
            f"{r['load_over_fresh_read_median']:.2f} ({r['load_over_fresh_read_best']:.2f})",
        )
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    console.print("command: python -m benchmarks.snapshot_memory " + " ".join(argv))
    for key, value in info.items():
        console.print(f"{key}: {value}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--model-mib", type=float, default=1024, help="model size M in MiB (default 1024)")
    ap.add_argument("--parts", default="2,4,8,16", help="comma-separated part counts k (default 2,4,8,16)")
    ap.add_argument("--tensors", type=int, default=32, help="number of tensors, >= the largest k (default 32)")
    ap.add_argument("--slack-mib", type=float, default=64, help="fixed allowance in the target (default 64)")
    ap.add_argument("--interval-ms", type=float, default=1.0, help="sampler period (default 1 ms)")
    ap.add_argument("--work-dir", default=None, help="where snapshot files are written (default: system temp)")
    ap.add_argument("--no-drop-cache", dest="drop_cache", action="store_false",
                    help="leave the written files in the page cache")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of (cold reads, load) per layout (default 3)")
    ap.add_argument("--first-load", dest="cycle", action="store_false",
                    help="measure the first load of a lazily built model instead of RL's load, clear(), update()")
    ap.add_argument("--json", default=None, help="also write the rows and machine info to this file")
    ap.add_argument("--child", metavar="MODEL_DIR", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--read-child", metavar="FILE", nargs="+", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.read_child:
        print(RESULT_MARK + json.dumps(read_child(args.read_child, args.fresh)), flush=True)
        return 0
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    if args.child:
        args.model_dir = args.child
        print(RESULT_MARK + json.dumps(child(args)), flush=True)
        return 0
    rows, info = run(args)
    render(rows, info, argv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": argv, "rows": rows, "machine": info}, f, indent=2)
    return 0 if all(r["verdict"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
