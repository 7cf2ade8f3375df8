"""Host memory of CPU Paddle tensors, for the loaders that copy bytes straight into a parameter."""
from __future__ import annotations

import ctypes

import numpy as np
import paddle


def writable_bytes(tensor: paddle.Tensor, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of the first ``nbytes`` of a CPU tensor's own allocation, so that
    one copy (``np.copyto``, ``os.preadv``) lands the bytes in the tensor. ``nbytes`` > 0: a
    zero-element tensor has no allocation to view."""
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr()), np.uint8)
