"""Host memory of CPU Paddle tensors, for the loaders that copy bytes straight into a parameter.

A loader lands every byte of an update in memory the process has just been given back (``clear()``
released the old parameters). The first touch of each fresh page costs a page fault, and with 4 KiB
pages those faults cost as much as the copy or the disk read itself (262,144 faults per GiB). Asking
for 2 MiB pages first makes them 512 times fewer; the hint changes no byte.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import paddle

HUGE_PAGE = 2 << 20

_LIBC = ctypes.CDLL(None, use_errno=True)  # (a call through ctypes releases the GIL)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


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
        _LIBC.madvise(start, end - start, mmap.MADV_HUGEPAGE)
