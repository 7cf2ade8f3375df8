"""conformance.heap: the heap a measuring child inherits must not change what a peak measures.

Each scenario runs in a fresh interpreter (``python -m tests.test_heap NAME``, numpy only: no Paddle, whose
thread pools do not survive a fork), so that nothing this pytest process ran before, or the threads it runs
now, shapes the heap under test. There a child (``harness.in_child``) first leaves freed, resident blocks in
its arenas, the way a worker that has run other tests does, and measures in grandchildren forked from that
state: once pinning the mmap threshold only (what the suite did before), once within ``heap.isolated()``.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading

import numpy as np

from conformance import harness, heap

MIB = 1 << 20
HOLE_MIB = 20
HOLES = 8
EXPECTED_MIB = 8 * 16  # the update's peak: seven blocks kept and the last dropped one, at the last file
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_pins: list = []


def _pin_after(block: np.ndarray) -> None:
    """Keep a live 64 KiB block right after ``block``, so that ``block`` freed is a hole of its own: never merged
    with the next hole, nor with the top chunk, which glibc trims once it passes the trim threshold (then no hole
    is left: a heap of 45 MiB for 165, about one interpreter in 150). malloc serves a request from a free chunk
    below ``block`` first, where the heap has one large enough: each block it places there stays live too, and the
    request is made again until it comes from the top, right after ``block``."""
    end = block.ctypes.data + block.nbytes
    for _ in range(4096):
        pin = np.ones(1 << 16, dtype=np.uint8)
        _pins.append(pin)
        if 0 <= pin.ctypes.data - end < 4096:
            return
    raise AssertionError(f"premise: no 64 KiB block placed right after the {block.nbytes >> 20} MiB one in 4096 tries")


def _leave_holes() -> None:
    """Leave ``HOLES`` freed, resident blocks of ``HOLE_MIB`` MiB in this thread's arena, each kept apart from
    the next by a live 64 KiB block (``_pin_after``). Freeing a mapped 24 MiB block first raises glibc's dynamic
    mmap threshold, so the blocks come from the arena, not from mappings of their own."""
    big = np.ones(24 * MIB, dtype=np.uint8)
    del big
    blocks = []
    for _ in range(HOLES):
        blocks.append(np.ones(HOLE_MIB * MIB, dtype=np.uint8))
        _pin_after(blocks[-1])
    del blocks


def _in_thread(fn, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


def _update_like(files: int = 7) -> None:
    """An update's allocations: per file two 16 MiB tensors read, one kept (the parameter), one dropped."""
    kept = []
    for _ in range(files):
        a = np.ones(16 * MIB, dtype=np.uint8)
        b = np.ones(16 * MIB, dtype=np.uint8)
        kept.append(a)
        del b
    del kept


def _peak_mib(isolate: bool, in_thread: bool) -> int:
    def measure():
        base = harness.rss_kib()
        harness.reset_peak_rss()
        _in_thread(_update_like) if in_thread else _update_like()
        return (harness.peak_rss_kib() - base) // 1024

    if isolate:
        with heap.isolated() as plug:
            assert plug.applied, plug.why
            return measure()
    heap._libc().mallopt(heap.M_MMAP_THRESHOLD, MIB)
    return measure()


def _both_peaks(in_thread: bool) -> dict:
    return {"pinned only": harness.in_child(_peak_mib, False, in_thread), "isolated": harness.in_child(_peak_mib, True, in_thread)}


# -- scenarios, each run in a fresh interpreter --------------------------------------------------------
def _every_arena_in_child() -> dict:
    before = heap.largest_free_chunks()
    threads = threading.active_count()
    with heap.isolated() as plug:
        inside = {"arenas": plug.arenas, "plugged_mib": plug.plugged_bytes // MIB, "largest_left": plug.largest_left,
                  "largest": heap.largest_free_chunks(), "threads": threading.active_count()}
    after = {"largest": heap.largest_free_chunks(), "threads": threading.active_count()}
    return {"before": before, "threads": threads, "inside": inside, "after": after}


def scenario_every_arena() -> dict:
    _leave_holes()
    _in_thread(_leave_holes)
    # Measured in a forked child, as the suite does: there every arena but the forking thread's is on the free
    # list at once (in this process, the ended thread's might still be attached while its exit completes).
    return harness.in_child(_every_arena_in_child)


def scenario_thread_peak() -> dict:
    _in_thread(_leave_holes)
    return _both_peaks(in_thread=True)


def scenario_main_peak() -> dict:
    _leave_holes()
    return _both_peaks(in_thread=False)


def scenario_top_chunk() -> dict:
    libc = heap._libc()
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: a freed top stays
    libc.mallopt(heap.M_MMAP_THRESHOLD, 1 << 30)
    block = libc.malloc(200 * MIB)
    ctypes.memset(block, 1, 200 * MIB)
    libc.free(block)
    return _both_peaks(in_thread=False)


def scenario_no_mappings() -> dict:
    _leave_holes()
    heap._libc().mallopt(-4, 0)  # M_MMAP_MAX: malloc may map nothing, every request it cannot serve grows an arena
    with heap.isolated() as plug:
        return {"plugged_mib": plug.plugged_bytes // MIB, "largest_left": plug.largest_left}


def scenario_freed_buffers() -> dict:
    np.ones((20 << 20) // 8).sum()  # freed: the unpinned threshold rises to 20 MiB
    with heap.isolated():
        base = harness.rss_kib()
        held = [np.ones((16 << 20) // 8) for _ in range(4)]
        grown = harness.rss_kib() - base
        del held
        left = harness.rss_kib() - base
    return {"grown": grown, "left": left}


def _run(name: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.test_heap", name], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, f"scenario {name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- tests --------------------------------------------------------------------------------------------
def test_every_arena_is_left_without_a_large_free_chunk():
    r = _run("every_arena")
    holes = [size for size in r["before"] if size >= HOLE_MIB * MIB]
    assert len(holes) >= 2, f"premise: a hole of {HOLE_MIB} MiB in the main arena and in a thread's, found {r['before']}"
    inside = r["inside"]
    assert inside["arenas"] == len(r["before"]), f"arenas: {inside['arenas']}, malloc_info lists {len(r['before'])}"
    assert inside["plugged_mib"] >= 2 * HOLES * (HOLE_MIB - 1), f"held {inside['plugged_mib']} MiB of 2 x {HOLES} x {HOLE_MIB}"
    assert max(inside["largest"]) < MIB and inside["largest_left"] < MIB, f"a free chunk of 1 MiB or more is left: {inside}"
    assert inside["threads"] == r["threads"] + len(r["before"]) - 1, f"one helper per other arena: {inside}, {r['threads']}"
    assert max(r["after"]["largest"]) >= HOLE_MIB * MIB, f"the chunks held are not freed on exit: {r['after']}"
    assert r["after"]["threads"] == r["threads"], f"the helper threads outlive the block: {r['after']}, {r['threads']}"


def _assert_isolated_peak(r: dict, where: str) -> None:
    assert r["pinned only"] <= 16, f"premise ({where}): resident holes serve the update and hide its peak: {r}"
    assert EXPECTED_MIB - 4 <= r["isolated"] <= EXPECTED_MIB + 8, f"{where}: isolated peak {r['isolated']} MiB, {EXPECTED_MIB} held"


def test_a_new_threads_peak_is_what_it_holds():
    """The measured code's thread takes an inherited arena unless the helpers hold every one."""
    _assert_isolated_peak(_run("thread_peak"), "holes in a thread's arena, the update in a new thread")


def test_the_main_threads_peak_is_what_it_holds():
    _assert_isolated_peak(_run("main_peak"), "holes in the main arena, the update in the main thread")


def test_a_resident_top_chunk_does_not_hide_a_peak():
    """A block freed at the top of the heap, with trimming off, leaves a resident top chunk that malloc splits
    requests from before it maps anything."""
    _assert_isolated_peak(_run("top_chunk"), "a resident top chunk of 200 MiB")


def test_a_malloc_that_cannot_map_still_ends():
    """With mappings refused every request grows an arena: the plugging keeps only what came from memory
    malloc already had, and ends (bounded: the scenario's interpreter has 60 s)."""
    r = _run("no_mappings")
    assert r["plugged_mib"] >= HOLES * (HOLE_MIB - 1) and r["largest_left"] < MIB, r


def test_freed_buffers_leave_the_resident_set_whatever_came_before():
    """glibc raises its mmap threshold after a mapped block is freed: within ``isolated()`` a freed 16 MiB
    buffer still leaves the resident set after a 20 MiB one raised the threshold."""
    r = _run("freed_buffers")
    assert r["grown"] > 60 << 10, f"4 x 16 MiB grew the resident set by only {r['grown']} KiB"
    assert r["left"] < 8 << 10, f"{r['left']} KiB still resident after freeing 4 x 16 MiB"


if __name__ == "__main__":
    print(json.dumps(globals()[f"scenario_{sys.argv[1]}"]()))
