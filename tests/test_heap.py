"""conformance.heap: the heap a measuring child inherits must not change what a peak measures.

Each case forks (``harness.in_child``) a child that first leaves freed blocks in its arenas, the way a
worker that has run other tests does, and measures in grandchildren forked from that state, so that no
case depends on what this process ran before.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import paddle

from conformance import harness, heap

MIB = 1 << 20
HOLE_MIB = 20
HOLES = 8


def _leave_holes(pins: list) -> None:
    """Leave ``HOLES`` freed blocks of ``HOLE_MIB`` MiB in this thread's arena, each kept apart from the next
    by a live 64 KiB block (``pins``). Freeing a mapped 24 MiB block first raises glibc's dynamic mmap
    threshold, so the blocks come from the arena, not from mappings of their own."""
    big = np.ones(24 * MIB, dtype=np.uint8)
    del big
    blocks = []
    for _ in range(HOLES):
        blocks.append(paddle.ones([HOLE_MIB * MIB // 4], dtype="float32"))
        pins.append(np.ones(1 << 16, dtype=np.uint8))
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
        a = paddle.ones([4 * MIB], dtype="float32")
        b = paddle.ones([4 * MIB], dtype="float32")
        kept.append(a)
        del b
    del kept


EXPECTED_MIB = 8 * 16  # seven kept and the last dropped one, at the last file


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
    heap._libc().mallopt(heap.M_MMAP_THRESHOLD, MIB)  # what the suite did before: the threshold only
    heap._libc().malloc_trim(0)
    return measure()


def test_every_arena_is_left_without_a_large_free_chunk():
    def child():
        pins = []
        _leave_holes(pins)
        _in_thread(_leave_holes, pins)  # the thread's arena goes to the free list when it ends
        before = heap.largest_free_chunks()
        threads = threading.active_count()
        with heap.isolated() as plug:
            inside = {"arenas": plug.arenas, "plugged_mib": plug.plugged_bytes // MIB, "largest_left": plug.largest_left,
                      "largest": heap.largest_free_chunks(), "threads": threading.active_count()}
        after = {"largest": heap.largest_free_chunks(), "threads": threading.active_count()}
        return {"before": before, "threads": threads, "inside": inside, "after": after}

    r = harness.in_child(child)
    holes = [size for size in r["before"] if size >= HOLE_MIB * MIB]
    assert len(holes) >= 2, f"premise: a hole of {HOLE_MIB} MiB in the main arena and in a thread's, found {r['before']}"
    inside = r["inside"]
    assert inside["arenas"] == len(r["before"]), f"arenas: {inside['arenas']}, malloc_info lists {len(r['before'])}"
    assert inside["plugged_mib"] >= 2 * HOLES * HOLE_MIB * 0.9, f"held {inside['plugged_mib']} MiB of 2 x {HOLES} x {HOLE_MIB}"
    assert max(inside["largest"]) < MIB and inside["largest_left"] < MIB, f"a free chunk of 1 MiB or more is left: {inside}"
    assert inside["threads"] == r["threads"] + len(r["before"]) - 1, f"one helper per other arena: {inside}, {r['threads']}"
    assert max(r["after"]["largest"]) >= HOLE_MIB * MIB, f"the chunks held are not freed on exit: {r['after']}"
    assert r["after"]["threads"] == r["threads"], f"the helper threads outlive the block: {r['after']}, {r['threads']}"


def test_a_new_threads_peak_is_what_it_holds():
    """The measured code's thread takes an inherited arena unless the helpers hold every one."""

    def child():
        pins = []
        _in_thread(_leave_holes, pins)
        return {"raw": harness.in_child(_peak_mib, False, True), "isolated": harness.in_child(_peak_mib, True, True)}

    r = harness.in_child(child)
    assert EXPECTED_MIB - 4 <= r["isolated"] <= EXPECTED_MIB + 8, f"isolated: peak {r['isolated']} MiB, {EXPECTED_MIB} held"
    assert r["raw"] >= r["isolated"] + 16, f"premise: the holes inflate a peak that only pins the threshold: {r}"


def test_the_main_threads_peak_is_what_it_holds():
    def child():
        pins = []
        _leave_holes(pins)
        return harness.in_child(_peak_mib, True, False)

    peak = harness.in_child(child)
    assert EXPECTED_MIB - 4 <= peak <= EXPECTED_MIB + 8, f"isolated: peak {peak} MiB, {EXPECTED_MIB} held"


def test_a_resident_top_chunk_does_not_hide_a_peak():
    """A block freed at the top of the heap, with trimming off, leaves a resident top chunk that malloc splits
    requests from before it maps anything: the update's tensors would cost no growth at all."""
    M_TRIM_THRESHOLD = -1

    def child():
        libc = heap._libc()
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(heap.M_MMAP_THRESHOLD, 1 << 30)
        block = libc.malloc(200 * MIB)
        ctypes.memset(block, 1, 200 * MIB)
        libc.free(block)
        return harness.in_child(_peak_mib, True, False)

    peak = harness.in_child(child)
    assert EXPECTED_MIB - 4 <= peak <= EXPECTED_MIB + 8, f"isolated, under a resident top of 200 MiB: peak {peak} MiB, {EXPECTED_MIB} held"


def test_a_malloc_that_cannot_map_still_ends():
    """With mappings refused (``M_MMAP_MAX`` 0) every request grows an arena: the plugging keeps only what came
    from memory malloc already had, and ends."""
    M_MMAP_MAX = -4

    def child():
        pins = []
        _leave_holes(pins)
        heap._libc().mallopt(M_MMAP_MAX, 0)
        with heap.isolated() as plug:
            return {"plugged_mib": plug.plugged_bytes // MIB, "largest_left": plug.largest_left}

    r = harness.in_child(child, timeout_s=20)
    assert r["plugged_mib"] >= HOLES * HOLE_MIB * 0.9 and r["largest_left"] < MIB, r


def test_freed_buffers_leave_the_resident_set_whatever_came_before():
    """glibc raises its mmap threshold after a mapped block is freed: within ``isolated()`` a freed 16 MiB
    buffer still leaves the resident set after a 20 MiB one raised the threshold."""

    def child():
        np.ones((20 << 20) // 8).sum()  # freed: the unpinned threshold rises to 20 MiB
        with heap.isolated():
            base = harness.rss_kib()
            held = [np.ones((16 << 20) // 8) for _ in range(4)]
            grown = harness.rss_kib() - base
            del held
            left = harness.rss_kib() - base
        return {"grown": grown, "left": left}

    result = harness.in_child(child)
    assert result["grown"] > 60 << 10, f"4 x 16 MiB grew the resident set by only {result['grown']} KiB"
    assert result["left"] < 8 << 10, f"{result['left']} KiB still resident after freeing 4 x 16 MiB"
