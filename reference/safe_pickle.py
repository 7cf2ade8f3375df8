"""A restricted unpickler for the two pickle inputs of the contract.

Paddle's ``paddle.save`` writes a state dict as a protocol-4 pickle whose only globals rebuild
numpy arrays; the ``ipc_metas_{id}`` file holds plain lists, strings and ints. Both are read here
with ``find_class`` limited to that allow-list, so a crafted file raises UnsafePickleError and no
callable it names is ever looked up, let alone called.
"""
from __future__ import annotations

import os
import pickle

from .errors import SnapshotFormatError, SnapshotPermissionError, UnsafePickleError

ARRAY_GLOBALS = frozenset(
    {
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "scalar"),
        ("collections", "OrderedDict"),
    }
)


class _Restricted(pickle.Unpickler):
    def __init__(self, file, path: str, allowed: frozenset):
        super().__init__(file)
        self._path = path
        self._allowed = allowed

    def find_class(self, module, name):
        if (module, name) not in self._allowed:
            raise UnsafePickleError(
                f"{self._path}: refusing to unpickle global {module}.{name}: not on this file's allow-list "
                f"(numpy array reconstruction for a paddle.save state dict, nothing for an ipc meta file)"
            )
        import importlib

        return getattr(importlib.import_module(module), name)


def load_restricted(path: str, *, allow_arrays: bool):
    """Unpickle ``path`` admitting only array-reconstruction globals (or none at all). The pickle is read
    from the file as it is parsed, never whole into memory first: a state dict's bytes are held once (as its
    arrays), not twice (MEM-SNAPSHOT-PEAK on the shared fallback)."""
    allowed = ARRAY_GLOBALS if allow_arrays else frozenset()
    try:
        f = open(path, "rb")
    except PermissionError as e:
        raise SnapshotPermissionError(
            f"{path}: permission denied: cannot open the file for reading ({e.strerror}); the file itself may be intact: fix its mode or owner"
        ) from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            raise SnapshotFormatError(f"{path}: file is empty (0 bytes)")
        try:
            return _Restricted(f, path, allowed).load()
        except UnsafePickleError:
            raise
        except Exception as e:  # truncated or garbage pickles raise many types
            raise SnapshotFormatError(f"{path}: not a readable pickle ({e!r})") from None
