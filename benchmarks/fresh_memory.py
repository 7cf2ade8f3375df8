"""The first touch of freshly allocated memory: with 4 KiB or 2 MiB pages, right after other memory
was freed or a while later.

    python -m benchmarks.fresh_memory --mib 1024 --repeat 5 --gap-s 5

A loader lands every byte of an update in memory it has just allocated (``clear()`` gave the old
parameters' memory back), so it pays the first touch of each page; a memcpy into a buffer touched
before does not. On a virtual machine that hands free memory back to its host (virtio-balloon free
page reporting), that cost depends on how long ago the memory was freed: pages still backed by the
host are cheap, pages the host took back fault on the host too. Each round: a child allocates and
touches ``--mib`` MiB and exits (the memory is freed); after 0 s, or after ``--gap-s`` seconds, a
second child allocates as much (private anonymous memory, ``MADV_HUGEPAGE`` for 2 MiB pages) and
times writing one byte per 4 KiB page. The modes alternate from round to round; the table shows
median and best.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

import numpy as np

RESULT_MARK = "FRESH_MEMORY_RESULT "


def touch(mib: int, huge: bool) -> float:
    """Seconds to write one byte per 4 KiB page of ``mib`` MiB of fresh private memory."""
    size = mib << 20
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    pages = np.frombuffer(area, np.uint8)[:: mmap.PAGESIZE]
    start = time.perf_counter()
    pages[:] = 1
    seconds = time.perf_counter() - start
    del pages
    area.close()
    return seconds


def _child(mib: int, huge: bool) -> float:
    cmd = [sys.executable, "-m", "benchmarks.fresh_memory", "--child", "--mib", str(mib)] + (["--huge"] if huge else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith(RESULT_MARK))[len(RESULT_MARK):])


def page_reporting() -> str:
    try:
        with open("/proc/cmdline") as f:
            words = [w for w in f.read().split() if "page_reporting" in w]
    except OSError:
        words = []
    balloon = os.path.exists("/sys/bus/virtio/drivers/virtio_balloon")
    return f"virtio_balloon driver {'present' if balloon else 'absent'}; " + (" ".join(words) or "no page_reporting option")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fresh_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="memory touched per child (default 1024)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per mode (default 5)")
    ap.add_argument("--gap-s", type=float, default=5.0, help="the wait before the later touch (default 5 s)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--huge", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(RESULT_MARK + json.dumps(touch(args.mib, args.huge)), flush=True)
        return 0

    modes = [(huge, gap) for huge in (False, True) for gap in (0.0, args.gap_s)]
    results: dict[str, list[float]] = {}
    for round_ in range(args.repeat):
        for huge, gap in (modes if round_ % 2 == 0 else modes[::-1]):
            _child(args.mib, huge)  # allocate, touch, exit: the memory is freed now
            time.sleep(gap)
            results.setdefault(f"{'2 MiB' if huge else '4 KiB'} pages, {gap:g} s after a free", []).append(
                _child(args.mib, huge))
    width = max(len(k) for k in results)
    print(f"first touch of {args.mib} MiB of fresh memory, {args.repeat} rounds: median (best) seconds")
    for key, values in results.items():
        print(f"  {key:<{width}}  {statistics.median(values):.3f} ({min(values):.3f})")
    print(f"command: python -m benchmarks.fresh_memory {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; {page_reporting()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
