"""A restricted unpickler for the two pickle inputs of the contract.

Paddle's ``paddle.save`` writes a state dict as a protocol-4 pickle whose only globals rebuild
numpy arrays; the ``ipc_metas_{id}`` file holds plain lists, strings and ints. Both are read here
with ``find_class`` limited to that allow-list, so a crafted file raises UnsafePickleError and no
callable it names is ever looked up, let alone called.

The unpickler is Python's own (``pickle._Unpickler``), not its C twin: a 200 KB pickle of a tuple nested
200 000 deep used as a dict key crashes the C unpickler's process (hashing a tuple recurses in C with no
recursion check: a segmentation fault, not an exception). Here a tuple nesting tuples past ``MAX_TUPLE_DEPTH``
is refused as it is built, naming the file (neither format nests tuples more than three deep), so no key or set
member can make a hash recurse, and such a file is refused after a few opcodes, not 200 000. Nothing else in a
pickle recurses while it is loaded (lists and dicts are built from a stack), and a value nested thousands deep
is only ever shown through ``errors.brief``.
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


# Neither format nests tuples deeper than three (numpy's reconstruction arguments); a few more levels are let through.
MAX_TUPLE_DEPTH = 16


def _check_tuple(new: tuple, path: str) -> None:
    """Refuse a tuple whose tuples nest past MAX_TUPLE_DEPTH (hashing one recurses in C), walking no further down
    than that: each tuple the unpickler builds is checked, so a chain is refused at its 17th level."""
    level, stack = 1, [new]
    while stack:
        stack = [item for t in stack for item in t if type(item) is tuple]
        if stack:
            level += 1
            if level > MAX_TUPLE_DEPTH:
                raise pickle.UnpicklingError(f"{path}: a tuple nests tuples deeper than {MAX_TUPLE_DEPTH} levels")


class _Restricted(pickle._Unpickler):
    def __init__(self, file, path: str, allowed: frozenset):
        super().__init__(file)
        self._path = path
        self._allowed = allowed

    # Every opcode that builds a tuple checks it (see the module docstring).
    def _built(self, load):
        load(self)
        _check_tuple(self.stack[-1], self._path)

    dispatch = {**pickle._Unpickler.dispatch,
                **{op[0]: (lambda load: lambda self: _Restricted._built(self, load))(pickle._Unpickler.dispatch[op[0]])
                   for op in (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)}}

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
