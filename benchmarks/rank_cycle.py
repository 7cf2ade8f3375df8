"""A full clear/update cycle on 2 ranks, per path, broken into its phases as ratios to the transfer.

    python -m benchmarks.rank_cycle --model-mib 1024 --cycles 5

The model (``--model-mib`` in all, default 1 GiB) is sharded over ``--ranks`` inference ranks launched with
``python -m paddle.distributed.launch`` (gloo), each with its own trainer process (``sim.ranks``: the same
job the MR rules run), the reference on every rank. Each cycle is what RL does between steps: the API
writes CLEARING and waits for CLEARED, the trainers publish the next version, the API writes UPDATING and
waits until every rank has committed. Every rank reports the seconds of each phase of its cycle
(``WeightManager.phases``):

* clear: releasing every parameter; transfer: moving the bytes from the trainer's files, segments or
  buckets into memory the rank owns; apply: validating each tensor against its parameter and adopting
  it (or keeping it, staged); agree: the votes through the process group after the clear and before
  the commit (waiting for the slower rank included); finalize: verifying, committing, stamping the
  version and writing the cell.

Per cycle the figures of the rank with the longest transfer count (the others wait for it at the agreement:
that wait is its transfer, not the agreement's cost); ratios are phase / transfer; the table shows the median over cycles beside the best. Target: everything beyond the transfer
(clear + apply + agree + finalize) at most 25% of it. The first load (version 1) is not a cycle and is not
counted. The last cycle of each path is verified: every rank's sha256 of every parameter equals its
trainer's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PHASES = ("clear", "apply", "agree", "finalize")
TARGET = 0.25
PATHS = ("snapshot", "meta", "bucket")


def params(model_mib: float, ranks: int) -> list:
    """One rank's shard, ``model_mib / ranks`` MiB: eight bfloat16 matrices and a float32 norm."""
    cols = 4096
    rows = max(1, int(model_mib * (1 << 20)) // ranks // (cols * 2) // 8)
    return [[f"layers.{i}.weight", "bfloat16", [rows, cols]] for i in range(8)] + [["norm.weight", "float32", [cols]]]


def nbytes(shard) -> int:
    size = {"bfloat16": 2, "float32": 4}
    total = 0
    for _, dtype, shape in shard:
        n = size[dtype]
        for d in shape:
            n *= d
        total += n
    return total


def cycle_phases(spans: dict) -> dict[str, float]:
    """A rank's spans (``reference.phases``) as the cycle's phases: clear, transfer (the update less what is
    counted apart), apply, agree (the clear's vote and the update's), finalize."""
    inner = spans.get("apply", 0.0) + spans.get("update_agree", 0.0) + spans.get("finalize", 0.0)
    return {"clear": spans.get("clear", 0.0), "transfer": spans.get("update", 0.0) - inner,
            "apply": spans.get("apply", 0.0), "agree": spans.get("clear_agree", 0.0) + spans.get("update_agree", 0.0),
            "finalize": spans.get("finalize", 0.0)}


def cycle_rows(path_result: dict) -> list[dict]:
    """Per cycle: the phases of the rank with the longest transfer (the critical path: the others wait for it
    at the agreement, which is then its own cost, not theirs)."""
    rows = []
    for c in path_result["cycles"]:
        phases = [cycle_phases(e["phases"]) for e in c["update"].values()]
        slow = max(phases, key=lambda p: p["transfer"])
        rows.append(dict(slow, total=sum(slow.values())))
    return rows


def summarize(path: str, rows: list[dict]) -> dict:
    out = {"path": path, "cycles": len(rows)}
    transfers = [r["transfer"] for r in rows]
    out["transfer_s"] = {"median": statistics.median(transfers), "best": min(transfers)}
    for phase in PHASES + ("beyond",):
        if phase == "beyond":
            ratios = [sum(r.get(p, 0.0) for p in PHASES) / r["transfer"] for r in rows]
        else:
            ratios = [r.get(phase, 0.0) / r["transfer"] for r in rows]
        out[phase] = {"median": statistics.median(ratios), "best": min(ratios)}
    out["verdict"] = "pass" if out["beyond"]["median"] <= TARGET else "FAIL"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=float, default=1024.0, help="the whole model, over every rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--path", action="append", choices=PATHS, help="repeatable; default all three")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--staged", action="store_true", help="the reference's staged mode")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from sim.ranks import Job, PathPlan, Step

    shard = params(args.model_mib, args.ranks)
    plans = [PathPlan(path, shard, [Step(1)], cycles=args.cycles, options={"staged": True} if args.staged else {})
             for path in (args.path or PATHS)]
    console = Console(width=170)
    job = Job("reference", plans, ranks=args.ranks, bucket_bytes=args.bucket_mib << 20, fast_fill=True,
              agree_timeout_s=60.0, transfer_timeout_s=60.0, step_timeout_s=600.0,
              progress=lambda text: console.print(f"[dim]{text}[/dim]"))
    result = job.run()
    summaries, verified = [], {}
    for p in result["paths"]:
        last = p["cycles"][-1]
        verified[p["path"]] = all(e["event"] == "updated" and e["digests"] == last["sent"][r] for r, e in last["update"].items())
        summaries.append(summarize(p["path"], cycle_rows(p)))

    total = nbytes(shard) * args.ranks
    table = Table(title=f"clear/update cycle of a {total / (1 << 30):.2f} GiB model on {args.ranks} ranks "
                        f"({args.cycles} cycles per path; ratios to the transfer, median / best)")
    for column in ("path", "transfer s", *PHASES, "beyond transfer", "target", "verdict", "verified"):
        table.add_column(column, justify="right")
    for s in summaries:
        table.add_row(s["path"], f"{s['transfer_s']['median']:.3f} / {s['transfer_s']['best']:.3f}",
                      *(f"{s[p]['median']:.3f} / {s[p]['best']:.3f}" for p in PHASES),
                      f"{s['beyond']['median']:.3f} / {s['beyond']['best']:.3f}", f"<= {TARGET}", s["verdict"],
                      "yes" if verified[s["path"]] else "NO")
    console.print(table)
    console.print(f"job {result['wall_s']:.1f} s, ranks joined after {result['start_s']:.1f} s; python "
                  f"{platform.python_version()}, {os.cpu_count()} cores")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model_bytes": total, "ranks": args.ranks, "rows": summaries,
                       "verified": verified}, f, indent=1)
    ok = all(s["verdict"] == "pass" for s in summaries) and all(verified.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
