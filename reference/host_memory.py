"""Host memory of CPU Paddle tensors, for the loaders that copy bytes straight into a parameter.

A loader lands every byte of an update in memory the process has just allocated (``clear()`` gave the
old parameters' memory back). The first touch of a fresh page costs a page fault, and on a 1 GiB model
those faults cost as much as the copy or the disk read itself. Two hints make them cheap or hidden,
neither changes a byte: 2 MiB pages for large allocations (one fault per 2 MiB instead of per 4 KiB),
and populating the next destination's pages in a helper thread while the current one is filled.
"""
from __future__ import annotations

import ctypes
import mmap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import paddle

HUGE_PAGE = 2 << 20
# Linux 5.14: fault the range in, writable, without writing to it (so it is safe on pages that share
# bytes with a range another thread is filling). Older kernels answer EINVAL: no prefaulting there.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_LIBC = ctypes.CDLL(None, use_errno=True)  # (a call through ctypes releases the GIL)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _madvise(start: int, length: int, advice: int) -> bool:
    return _LIBC.madvise(start, length, advice) == 0


def writable_bytes(tensor: paddle.Tensor, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of the first ``nbytes`` of a CPU tensor's own allocation, so that
    one copy (``np.copyto``, ``os.preadv``) lands the bytes in the tensor. ``nbytes`` > 0: a
    zero-element tensor has no allocation to view. The view keeps the tensor alive (a view of freed
    memory would be written into by the loader otherwise)."""
    raw = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
    raw.owner = tensor
    return np.frombuffer(raw, np.uint8)


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask for 2 MiB pages on a fresh allocation before its first touch, as numpy does for large
    arrays: one page fault per 2 MiB instead of 512. Best effort: a no-op where THP is off."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end - start >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        _madvise(start, end - start, mmap.MADV_HUGEPAGE)


def populate(view: np.ndarray) -> bool:
    """Fault in the pages under ``view`` without writing to them; False where the kernel cannot."""
    address = view.ctypes.data
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    return _madvise(start, address + view.nbytes - start, MADV_POPULATE_WRITE)


def fill_in_order(views: list[np.ndarray], fill) -> None:
    """``fill(i)`` for each of ``views`` in order, while a helper thread populates the pages of
    ``views[i + 1]``: the page faults of fresh memory overlap the disk read or copy of the previous
    view instead of adding to it. ``fill`` raising stops the loop once the helper is idle (it must
    never touch memory the caller frees next)."""
    if len(views) < 2:
        for i in range(len(views)):
            fill(i)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="prefault") as helper:
        ahead = helper.submit(populate, views[1])
        for i in range(len(views)):
            fill(i)
            # views[i + 1] is populated (or the kernel cannot): start on views[i + 2], then fill i + 1
            if i + 2 < len(views) and ahead.result():
                ahead = helper.submit(populate, views[i + 2])
