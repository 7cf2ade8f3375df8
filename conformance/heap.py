"""A forked child's glibc heap made neutral for a peak-memory measurement (elsewhere a no-op that says so).

A child forked from a test process inherits that process's malloc arenas and their free chunks: 130 MiB
of them in an xdist worker that had run the ipc and lifecycle modules first (measured with
``mallinfo2``). Pinning the mmap threshold is not enough, because malloc serves a request from a free
chunk (or splits it off the top chunk) before it maps anything, whatever the threshold: in that worker
an update's 16 MiB tensors came from the holes (no tensor was mapped), touching fresh pages of them
while the blocks freed before stayed resident there, and the same update of the same files peaked at
70, 102 or 144 MiB by what the worker had run before (MEM-SNAPSHOT-PEAK's bound there is 144 MiB; 70
in a fresh process). A top chunk left resident by a freed block errs the other way: requests split off
it cost no growth at all.

``isolated()`` pins the threshold, then takes every free chunk of ``min_bytes`` or more in every arena,
the top chunks too, held and never touched (only their headers are written), before the caller's
baseline. The measured code's large blocks are then mapped afresh and unmapped when freed, so the
peak is what that code holds. Arenas other than the calling thread's are reached the way the measured
code's own threads would reach them: after a fork every other arena is on the free list, and a new
thread takes one from it; a helper thread per arena takes each in turn, plugs it, and keeps it until
the end, so the measured code's threads get fresh arenas (or, past glibc's arena limit, plugged ones).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MIB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc's functions used here, or None where the C library lacks one of them (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        for name in ("mallopt", "mallinfo2", "malloc_info", "open_memstream"):
            getattr(libc, name)
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _Mallinfo2
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_usable_size.restype = ctypes.c_size_t
    libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
    return libc


def largest_free_chunks() -> list[int]:
    """The largest free chunk of each arena, in bytes (``malloc_info``'s bins; the top chunk is not one);
    [] where the C library is not glibc."""
    libc = _libc()
    if libc is None:
        return []
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    try:
        text = ctypes.string_at(buf.value, size.value).decode()
    finally:
        libc.free(buf.value)
    largest = []
    for heap in ET.fromstring(text).iter("heap"):
        tops = [int(e.get("to", 0)) for e in heap.iter() if e.tag in ("size", "unsorted")]
        largest.append(max(tops, default=0))
    return largest


def _footprint(libc) -> tuple[int, int]:
    """(blocks mapped on their own, bytes the arenas took from the system): both unchanged by a request
    that malloc served from memory it already had."""
    info = libc.mallinfo2()
    return info.hblks, info.arena


def _plug_own_arena(libc, start: int, min_bytes: int) -> list[int]:
    """Allocate, from this thread's arena, every free chunk of ``min_bytes`` or more: sizes from ``start``
    down, halving, each kept while malloc serves it from memory it already had, and retried; a request
    malloc had to map, or to grow an arena for, is freed at once (never touched) and the size halved."""
    held, size = [], start
    while size >= min_bytes:
        before = _footprint(libc)
        address = libc.malloc(size)
        if address and _footprint(libc) == before:
            held.append(address)
            continue
        if address:
            libc.free(address)
        size = min_bytes if min_bytes < size < 2 * min_bytes else size // 2
    return held


@dataclass
class Plug:
    """What ``isolated()`` did: ``applied`` False (and ``why``) where the C library is not glibc."""
    applied: bool
    why: str = ""
    arenas: int = 0
    plugged_bytes: int = 0
    largest_left: int = 0  # the largest free chunk of any arena after plugging
    _held: list = field(default_factory=list, repr=False)
    _release: threading.Event = field(default_factory=threading.Event, repr=False)
    _threads: list = field(default_factory=list, repr=False)


def _plug_other_arena(libc, start: int, min_bytes: int, plug: Plug, done: threading.Event) -> None:
    plug._held.extend(_plug_own_arena(libc, start, min_bytes))
    done.set()
    plug._release.wait()


@contextlib.contextmanager
def isolated(min_bytes: int = MIB):
    """Within the block, blocks of ``min_bytes`` or more are mapped afresh and unmapped when freed: the
    mmap threshold pinned at ``min_bytes`` and every inherited free chunk that large held (see the module's
    docstring). Take the baseline inside the block. Yields a ``Plug``; everything held is freed on exit."""
    libc = _libc()
    if libc is None:
        yield Plug(applied=False, why="the C library is not glibc (no mallopt/mallinfo2/malloc_info)")
        return
    libc.mallopt(M_MMAP_THRESHOLD, min_bytes)
    plug = Plug(applied=True)
    try:
        plug.arenas = len(largest_free_chunks())
        start = libc.mallinfo2().fordblks  # every arena's free bytes, top chunks included: no chunk is larger
        plug._held.extend(_plug_own_arena(libc, start, min_bytes))
        for _ in range(plug.arenas - 1):  # one helper per other arena, one at a time: each takes the next free one
            done = threading.Event()
            thread = threading.Thread(target=_plug_other_arena, args=(libc, start, min_bytes, plug, done),
                                      name="heap-plug", daemon=True)
            thread.start()
            done.wait()
            plug._threads.append(thread)
        plug.plugged_bytes = sum(libc.malloc_usable_size(a) for a in plug._held)
        plug.largest_left = max(largest_free_chunks(), default=0)
        yield plug
    finally:
        plug._release.set()
        for thread in plug._threads:
            thread.join()
        for address in plug._held:
            libc.free(address)

