"""Loading for ``ipc_snapshot``: bytes on disk to Paddle tensors, one file at a time.

``read_header`` looks at names, dtypes and shapes without materialising data, so the manager can
validate every file of a plan before it changes any parameter. ``iter_safetensors`` reads one file's
tensors straight into freshly allocated Paddle tensors and yields them once the whole file has been
read and found unchanged.

The file is never mapped: a mapping would make a trainer that truncates the file while it is read
kill this process with SIGBUS, and parameters adopting views of it would change when the file is
rewritten (FILE-DETACHED). Instead the header is parsed here, validated as strictly as the
safetensors library does (offsets contiguous, in order, starting at 0 and covering the data exactly;
dtype x shape = byte length; arrays and objects nested at most 127 levels, its serde_json bound), and each
tensor's bytes are read with ``os.preadv`` into the tensor's own allocation. A short read (the file shrank) or a file whose identity (device, inode, size,
mtime, ctime) changed between the header check and the end of the read is a SnapshotFormatError
naming the file (FILE-CHANGED-DURING-LOAD).
"""
from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import paddle

from .dtypes import ITEMSIZE, SAFETENSORS_TO_NAME, paddle_dtype
from .errors import SnapshotFormatError, SnapshotPermissionError, brief
from .host_memory import advise_huge_pages, writable_bytes
from .safe_pickle import load_restricted

# paddle.save adds this bookkeeping entry next to the tensors; it is not a parameter.
PADDLE_NAME_TABLE = "StructuredToParameterName@@"

# The safetensors library refuses headers above 100 MB (MAX_HEADER_SIZE); so do we.
MAX_HEADER_BYTES = 100_000_000
_LENGTH_BYTES = 8
# The safetensors library parses the header with serde_json, whose recursion limit (128) refuses a header whose
# arrays and objects nest 128 deep: at most 127 levels, the header object itself counting as one, are read. So
# does this parser, never a RecursionError: a 2 KB header of 1000 "[" is a ValueError naming the file.
MAX_HEADER_DEPTH = 127
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_BY_OFFSETS = operator.itemgetter(3, 4)  # an _Entry's (begin, end)


# Named tuples, not dataclasses: a header of 10**5 tensors makes 10**5 of each (FILE-MANY-TENSORS).
class TensorInfo(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]


class _Entry(NamedTuple):
    name: str
    dtype: str  # canonical name
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data section
    end: int


@dataclass(frozen=True)
class _Header:
    entries: tuple[_Entry, ...]  # in file (offset) order
    data_start: int  # absolute offset of the data section
    identity: tuple


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _open_fd(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)  # (Python sets O_CLOEXEC itself, PEP 446)
    except PermissionError as e:
        raise SnapshotPermissionError(
            f"{path}: permission denied: cannot open the snapshot file for reading ({e.strerror}); the file itself may be intact: fix its mode or owner"
        ) from None


def _read_exact(fd: int, offset: int, n: int, path: str) -> bytes:
    """``n`` bytes at ``offset``: one ``pread`` may return fewer than asked (POSIX; FILE-OVER-2GIB), each
    further one continues where the last ended; none at all (end of file) means the file shrank."""
    data = bytearray(n)
    view = memoryview(data)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise SnapshotFormatError(f"{path}: file changed during load: the read at offset {offset + done} ended early (the file shrank)")
        done += got
    return bytes(data)


def _shape(path: str, name: str, value) -> tuple[int, ...]:
    if type(value) is list:
        for d in value:
            if type(d) is not int or d < 0:
                break
        else:
            return tuple(value)
    raise SnapshotFormatError(f"{path}: tensor {name!r} has shape {brief(value)}, expected a list of integers >= 0")


def _depth(value, limit: int) -> int:
    """How deep ``value``'s lists and dicts nest (a scalar: 0), counted without recursion and no further than
    ``limit`` + 1: the header's own nesting bound, whatever a crafted value holds."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if not isinstance(item, (list, dict)):
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _parse_header(fd: int, path: str) -> _Header:
    st = os.fstat(fd)
    size = st.st_size
    if size == 0:
        raise SnapshotFormatError(f"{path}: file is empty (0 bytes), expected a safetensors snapshot")
    if size < _LENGTH_BYTES:
        raise SnapshotFormatError(
            f"{path}: truncated inside the 8-byte header length: expects at least {_LENGTH_BYTES} bytes, file has {size}"
        )
    n = int.from_bytes(_read_exact(fd, 0, _LENGTH_BYTES, path), "little")
    if n > MAX_HEADER_BYTES:
        raise SnapshotFormatError(
            f"{path}: not a valid safetensors file: header length {n} is over the {MAX_HEADER_BYTES}-byte limit "
            f"(expects {_LENGTH_BYTES + n} bytes, file has {size})"
        )
    if _LENGTH_BYTES + n > size:
        raise SnapshotFormatError(
            f"{path}: truncated inside the JSON header: the header length says {n} bytes, so the file "
            f"expects {_LENGTH_BYTES + n} bytes, file has {size}"
        )
    raw = _read_exact(fd, _LENGTH_BYTES, n, path)

    def no_duplicates(pairs):
        # Linear: a header of 200 000 tensors is one call here (list.count per key was quadratic).
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set = set()
            dup = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
            raise SnapshotFormatError(f"{path}: not a valid safetensors file: header names {dup} more than once")
        return obj

    too_deep = (f"{path}: not a valid safetensors file: the JSON header nests deeper than {MAX_HEADER_DEPTH} levels "
                "(the safetensors library's limit)")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except SnapshotFormatError:
        raise
    except RecursionError:  # thousands of levels: the decoder's own stack ran out, far past the limit
        raise SnapshotFormatError(too_deep) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SnapshotFormatError(f"{path}: not a valid safetensors file: the JSON header does not parse ({e})") from None
    if not isinstance(header, dict):
        raise SnapshotFormatError(f"{path}: not a valid safetensors file: the JSON header is not an object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise SnapshotFormatError(f"{path}: not a valid safetensors file: __metadata__ must map strings to strings")
            continue
        if type(info) is not dict or not _ENTRY_KEYS <= info.keys():
            raise SnapshotFormatError(
                f"{path}: not a valid safetensors file: tensor {name!r} needs dtype, shape and data_offsets: {brief(info)}"
            )
        if len(info) > 3:
            for key in info.keys() - _ENTRY_KEYS:  # ignored, as safetensors ignores them
                if 2 + _depth(info[key], MAX_HEADER_DEPTH) > MAX_HEADER_DEPTH:
                    raise SnapshotFormatError(f"{too_deep}: tensor {name!r}, key {key!r}")
        raw_dtype = info["dtype"]
        if not isinstance(raw_dtype, str) or raw_dtype not in SAFETENSORS_TO_NAME:
            raise SnapshotFormatError(f"{path}: tensor {name!r} has dtype {brief(raw_dtype)}, which Paddle cannot hold")
        dtype = SAFETENSORS_TO_NAME[raw_dtype]
        shape = _shape(path, name, info["shape"])
        offsets = info["data_offsets"]
        if not (type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int
                and offsets[0] >= 0 and offsets[1] >= 0):
            raise SnapshotFormatError(f"{path}: tensor {name!r} has data_offsets {brief(offsets)}, expected [begin, end]")
        begin, end = offsets
        if end < begin:
            raise SnapshotFormatError(f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] that end before they begin")
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if end - begin != nbytes:
            raise SnapshotFormatError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] disagree with dtype "
                f"{raw_dtype} x shape {list(shape)}, which needs {nbytes} bytes"
            )
        entries.append(_Entry(name, dtype, shape, begin, end))
    data_start = _LENGTH_BYTES + n
    entries.sort(key=_BY_OFFSETS)
    _check_layout(path, entries, data_start, size)
    return _Header(tuple(entries), data_start, _identity(st))


def _check_layout(path: str, entries: list[_Entry], data_start: int, size: int) -> None:
    """Sorted by offset, the tensors tile the data section exactly: from 0, no overlap, no gap,
    ending at the end of the file (trailing bytes are rejected, as safetensors does)."""
    position = 0
    for e in entries:
        if e.begin != position:
            raise SnapshotFormatError(
                f"{path}: not a valid safetensors file: tensor {e.name!r} at data_offsets [{e.begin}, {e.end}] "
                f"should start at {position}, where the previous tensor ends (offsets overlap or leave a gap)"
            )
        position = e.end
    expected = data_start + position
    if expected > size:
        raise SnapshotFormatError(
            f"{path}: truncated: the header describes {position} data bytes, so the file expects {expected} bytes, "
            f"file has {size}"
        )
    if expected < size:
        raise SnapshotFormatError(
            f"{path}: not a valid safetensors file: trailing bytes after the data the header describes "
            f"(expects {expected} bytes, file has {size})"
        )


class Header(list):
    """``read_header``'s result: the file's tensors (a list of TensorInfo) and, as ``identity``, the
    file's identity when they were read, so that the load can tell the file was rewritten in between
    (FILE-CHANGED-DURING-LOAD). ``parsed`` keeps the validated layout, so that the load, handed this
    header as ``expect``, reads the file without parsing its header a second time."""

    identity: tuple = ()
    parsed: _Header | None = None


def read_header(path: str) -> Header:
    """Names, dtypes and shapes of a safetensors file; SnapshotFormatError if unreadable."""
    fd = _open_fd(path)
    try:
        header = _parse_header(fd, path)
    finally:
        os.close(fd)
    infos = Header(header.entries)  # each has the name, dtype and shape of a TensorInfo (one object per tensor, not two)
    infos.identity = header.identity
    infos.parsed = header
    return infos


def _read_exactly_into(fd: int, view: np.ndarray, offset: int, path: str, name: str) -> None:
    """Fill ``view`` from file ``offset``. One ``preadv`` returns at most 0x7ffff000 bytes on Linux, and
    any call may return fewer than asked: a larger tensor takes several, each continuing where the last
    one ended (FILE-OVER-2GIB); a call that returns nothing (end of file: the file shrank) is an error
    naming the file, never another turn of the loop."""
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise SnapshotFormatError(f"{path}: file changed during load: the read of tensor {name!r} ended early (the file shrank)")
        done += got


def _validated(fd: int, path: str, expect) -> tuple[_Header, tuple | None]:
    """The layout to read ``fd`` by, and the identity it must have. Handed ``read_header``'s result,
    the header is not parsed again (a 200 000-tensor header costs as much to parse as to read the
    data): the file only has to still be the one whose header was checked."""
    parsed = getattr(expect, "parsed", None)
    if parsed is not None:
        now = _identity(os.fstat(fd))
        return (parsed if now == parsed.identity else _parse_header(fd, path)), parsed.identity
    return _parse_header(fd, path), expect


def iter_safetensors(path: str, expect=None, wanted=None) -> Iterator[tuple[str, paddle.Tensor | None]]:
    """Yield (name, tensor) from a safetensors file, each tensor owning its memory. ``expect`` is
    ``read_header(path)`` (or its ``identity``) from when the header was validated; the file must be
    that file still. Each tensor is read with ``os.preadv`` straight into its own allocation, 2 MiB
    pages asked for first. ``wanted`` (the names the model has): any other entry is yielded as
    ``(name, None)``, never allocated nor read: a name the model lacks is ignored (APPLY-UNKNOWN-IGNORED), and
    100 000 of them (one part of a per-expert checkpoint) cost their names, not a tensor each."""
    fd = _open_fd(path)
    try:
        header, expect = _validated(fd, path, expect)
        if expect is not None and expect != header.identity:
            raise SnapshotFormatError(
                f"{path}: file changed during load: it is not the file whose header was checked before "
                f"loading (device, inode, size, mtime, ctime {expect} then {header.identity})"
            )
        tensors = []
        for e in header.entries:
            if wanted is not None and e.name not in wanted:
                tensors.append((e.name, None))
                continue
            tensor = paddle.empty(list(e.shape), dtype=paddle_dtype(e.dtype))
            nbytes = e.end - e.begin
            if nbytes:
                advise_huge_pages(tensor.data_ptr(), nbytes)
                _read_exactly_into(fd, writable_bytes(tensor, nbytes), header.data_start + e.begin, path, e.name)
            tensors.append((e.name, tensor))
        now = _identity(os.fstat(fd))
        if now != header.identity:
            raise SnapshotFormatError(
                f"{path}: file changed during load: its size, mtime or inode differ after the read "
                f"({header.identity} then {now}); rewrite it completely and update again"
            )
    finally:
        os.close(fd)
    yield from tensors


def load_pickle_state_dict(path: str) -> Iterator[tuple[str, paddle.Tensor]]:
    """Yield (name, tensor) from a ``paddle.save`` state dict, read without executing anything but array
    reconstruction. Every entry is checked before the first is yielded; each array is dropped as its tensor
    is made, so the file's bytes are held about once, not as arrays and tensors both."""
    obj = load_restricted(path, allow_arrays=True)
    if not isinstance(obj, dict):
        raise SnapshotFormatError(f"{path}: expected a dict of arrays, found {brief(obj)}")
    obj.pop(PADDLE_NAME_TABLE, None)
    for name, value in obj.items():
        if not isinstance(name, str):
            raise SnapshotFormatError(f"{path}: entry {brief(name)} is named by a {type(name).__name__}, expected a str")
        if not isinstance(value, np.ndarray):
            raise SnapshotFormatError(f"{path}: entry {name!r} is {brief(value)}, expected an array")
        if value.dtype.hasobject or value.dtype.kind not in "biufc":  # (object arrays hold any Python value)
            raise SnapshotFormatError(f"{path}: entry {name!r} is an array of dtype {value.dtype.name}, "
                                      "expected numbers (object, string and structured arrays are not tensors)")
    return _tensors_from(obj)


def _tensors_from(arrays: dict) -> Iterator[tuple[str, paddle.Tensor]]:
    # paddle.save stores bfloat16 as uint16 bits; paddle.to_tensor maps uint16 back to bfloat16, exactly
    # as paddle.load does.
    for name in list(arrays):
        yield name, paddle.to_tensor(arrays.pop(name))
