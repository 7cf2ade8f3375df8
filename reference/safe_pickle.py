"""A restricted unpickler for the two pickle inputs of the contract.

Paddle's ``paddle.save`` writes a state dict as a protocol-4 pickle whose only globals rebuild
numpy arrays; the ``ipc_metas_{id}`` file holds plain lists, strings and ints. Both are read here
with ``find_class`` limited to that allow-list, so a crafted file raises UnsafePickleError and no
callable it names is ever looked up, let alone called.

The unpickler is Python's own (``pickle._Unpickler``), not its C twin: a 200 KB pickle of a tuple nested
200 000 deep used as a dict key crashes the C unpickler's process (hashing a tuple recurses in C with no
recursion check: a segmentation fault, not an exception). Here every dict key and set member is checked
for its tuple nesting before it is hashed, and a file nesting them past ``MAX_KEY_DEPTH`` is an error
naming it. Nothing else in a pickle recurses while it is loaded (lists and dicts are built from a stack),
and a value nested thousands deep is only ever shown through ``errors.brief``.
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


# No key of either format is a tuple at all (names are str); a few levels are let through for plain pickles.
MAX_KEY_DEPTH = 16


def _check_hashable(key, path: str) -> None:
    """Refuse a key whose tuples nest past MAX_KEY_DEPTH before anything hashes it (tuple hashing recurses in C)."""
    stack, level = [key], 0
    while stack:
        level += 1
        if level > MAX_KEY_DEPTH:
            raise pickle.UnpicklingError(f"{path}: a dict key or set member nests tuples deeper than "
                                         f"{MAX_KEY_DEPTH} levels")
        stack = [item for t in stack if isinstance(t, tuple) for item in t if isinstance(item, tuple)]


class _Restricted(pickle._Unpickler):
    def __init__(self, file, path: str, allowed: frozenset):
        super().__init__(file)
        self._path = path
        self._allowed = allowed

    # The opcodes that hash values taken from the stream check them first (see the module docstring). After a
    # MARK, ``self.stack`` holds exactly the items pushed since it (the base class keeps the outer stack aside).
    def _load_setitem(self):
        _check_hashable(self.stack[-2], self._path)
        pickle._Unpickler.load_setitem(self)

    def _load_setitems(self):
        for key in self.stack[0::2]:
            _check_hashable(key, self._path)
        pickle._Unpickler.load_setitems(self)

    def _load_dict(self):
        for key in self.stack[0::2]:
            _check_hashable(key, self._path)
        pickle._Unpickler.load_dict(self)

    def _load_set_items(self):  # ADDITEMS and FROZENSET: every member is hashed
        for item in self.stack:
            _check_hashable(item, self._path)

    def _load_additems(self):
        self._load_set_items()
        pickle._Unpickler.load_additems(self)

    def _load_frozenset(self):
        self._load_set_items()
        pickle._Unpickler.load_frozenset(self)

    dispatch = {**pickle._Unpickler.dispatch, pickle.SETITEM[0]: _load_setitem, pickle.SETITEMS[0]: _load_setitems,
                pickle.DICT[0]: _load_dict, pickle.ADDITEMS[0]: _load_additems, pickle.FROZENSET[0]: _load_frozenset}

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
