"""Wire format of the ``ipc_bucket`` path: msgpack manifests over ZMQ, and checks both ends share.

The trainer packs tensors into flat uint8 buckets in shared memory (two buffers, used alternately)
and announces each bucket with a manifest; the receiver validates the manifest before it reads a
byte, copies the bytes into memory it owns and acknowledges; the trainer reuses a buffer only after
that acknowledgement. SPEC.md "Async IPC buckets" / "Wire format" is the normative description;
this module is its executable form.

Sockets: the trainer binds a ROUTER (or REP) socket; each receiver connects one REQ socket per
update. Every receiver message is a request and every trainer message its reply, so the trainer
cannot announce bucket k+1 before bucket k is acknowledged (the ack *is* the request for the next
bucket) and nobody has to queue manifests. The trainer packs bucket k+1 into the other buffer while
the receiver copies bucket k: that is the double buffering.

Everything here is pure (no sockets, no shared memory) and is what both ends must agree on: the
message schema and builders, the codec, layout planning and the constants. The receiver's checks
(parsing a manifest, validating it against the update so far, checking the end message) live in
``reference.bucket_checks``, the trainer in ``sim.trainer``; both import this module, which imports
neither. Nothing is ever unpickled: frames are decoded by msgpack with extension types refused, so a
pickled frame is an error, never code.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgpack

from .handles import HANDLE_SIZE  # noqa: F401  (a manifest's handle field has this many bytes)

PROTO = 1
ALIGN = 256  # every entry starts at a multiple of this (checkpoint-engine's _ALIGN_SIZE)
MAX_FRAME = 64 << 20  # a message larger than this is refused before decoding
# msgpack's own decoder (msgpack-python, the C unpacker's fixed stack) refuses a frame whose arrays and maps nest
# deeper than this, the message's map counting as one: the wire format's nesting bound (SPEC BKT-FIELDS).
MAX_DEPTH = 1024

# Canonical dtype name -> itemsize: the only dtypes a manifest may name.
DTYPES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# Receiver -> trainer (requests)
HELLO, ACK, ERROR, DONE = "hello", "ack", "error", "done"
# Trainer -> receiver (replies)
BUCKET, END, ABORT = "bucket", "end", "abort"
TRAINER_TYPES = (BUCKET, END, ABORT)
RECEIVER_TYPES = (HELLO, ACK, ERROR, DONE)


class ManifestError(ValueError):
    """A message that breaks the wire format or the update's invariants. The message names the
    version, the bucket, the tensor and the field at fault."""


class TransferTimeout(TimeoutError):
    """The peer sent nothing within the deadline (a dead or stalled trainer or receiver)."""


def brief(value, limit: int = 80) -> str:
    """A short repr of a decoded value for an error message: cut at a few levels and items (``reprlib``), so a
    value nested a thousand levels deep never reaches the builtin ``repr`` (RecursionError)."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict, short.maxset = 3, 4, 4, 4, 4
    short.maxstring, short.maxother, short.maxlong = limit, limit, limit
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- encoding --------------------------------------------------------------------------------------
def encode(message: Mapping) -> bytes:
    return msgpack.packb(dict(message), use_bin_type=True)


def unpack_map(frame, where: str, *, limit: int, error: type[Exception] = ManifestError, noun: str = "manifest") -> dict:
    """One msgpack map from ``frame``, or ``error`` naming ``where``: a frame over ``limit`` bytes (refused
    before it is decoded), bytes that are not msgpack (a pickle is named as such: never unpickled), an
    extension type, anything but a map. The one safe decoder of every msgpack wire (buckets here, the
    CheckpointTransfer stand-in's ``sim.stream_wire``)."""
    if len(frame) > limit:
        raise error(f"{where}: message of {len(frame)} bytes exceeds the {limit}-byte limit")

    def no_ext(code, data):
        raise error(f"{where}: msgpack extension type {code} is not part of the wire format")

    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=no_ext, use_list=True)
    except error:
        raise
    except msgpack.StackError:
        raise error(f"{where}: the msgpack {noun} nests its arrays and maps deeper than {MAX_DEPTH} levels") from None
    except Exception as e:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ValueError...
        head = bytes(frame[:8])
        hint = " (it looks like a pickle; pickles are never loaded)" if head[:1] == b"\x80" else ""
        raise error(f"{where}: not a msgpack {noun}{hint}: {type(e).__name__}: {e}; first bytes {head!r}") from None
    if not isinstance(message, dict):
        raise error(f"{where}: message is a msgpack {type(message).__name__}, expected a map")
    return message


def decode(frame: bytes, where: str, allowed: Sequence[str] = TRAINER_TYPES, limit: int = MAX_FRAME) -> dict:
    """One frame -> a message dict with a known ``type``; ManifestError otherwise (a frame over
    ``limit`` bytes is refused before it is decoded). Never unpickles."""
    message = unpack_map(frame, where, limit=limit)
    kind = message.get("type")
    if kind not in allowed:
        raise ManifestError(f"{where}: field type is {brief(kind)}, expected one of {list(allowed)}")
    return message


# -- message builders ------------------------------------------------------------------------------
def hello(version: int | None, rank: int = 0) -> dict:
    return {"type": HELLO, "proto": PROTO, "version": version, "rank": rank}


def ack(version: int, bucket: int) -> dict:
    return {"type": ACK, "proto": PROTO, "version": version, "bucket": bucket}


def error(version: int | None, bucket: int, message: str) -> dict:
    return {"type": ERROR, "proto": PROTO, "version": version, "bucket": bucket, "message": message}


def done(version: int, count: int) -> dict:
    return {"type": DONE, "proto": PROTO, "version": version, "count": count}


def abort(version: int, message: str) -> dict:
    return {"type": ABORT, "proto": PROTO, "version": version, "message": message}


def check_name(name: str) -> None:
    """A tensor name the wire can carry: no NUL, which terminates each name in the end digest (a name
    holding one would make ["a\\0b"] and ["a", "b"] digest alike). ValueError naming the tensor."""
    if "\0" in name:
        raise ValueError(f"tensor {name!r}: a name may not hold a NUL character (index {name.index(chr(0))}); NUL ends "
                         "each name in the end message's digest")


def name_digest(names: Iterable[str]) -> str:
    """sha256 hex of the tensor names in announcement order, each UTF-8 encoded and NUL-terminated
    (a name holding a NUL is refused: ValueError)."""
    h = hashlib.sha256()
    for name in names:
        check_name(name)
        h.update(name.encode("utf-8") + b"\0")
    return h.hexdigest()


def end(version: int, buckets: int, names: Sequence[str]) -> dict:
    return {"type": END, "proto": PROTO, "version": version, "buckets": buckets, "count": len(names),
            "digest": name_digest(names)}


# -- layout planning (trainer side) ----------------------------------------------------------------
def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Placement:
    """``nbytes`` bytes of tensor ``name`` starting at ``chunk_offset`` go to ``offset`` of a bucket."""

    name: str
    offset: int
    nbytes: int
    chunk_offset: int
    total_nbytes: int


def plan_layout(sizes: Sequence[tuple[str, int]], bucket_bytes: int, align: int = ALIGN) -> list[list[Placement]]:
    """Assign tensors (name, nbytes), in order, to buckets of ``bucket_bytes``.

    Entries start at ``align``-byte offsets. A tensor that fits a bucket is never split: it moves to
    the next bucket when the current one is too full. Only a tensor larger than a whole bucket is
    split, filling the current bucket's free space and then whole buckets (verl's chunking).
    """
    if bucket_bytes <= 0 or bucket_bytes % align:
        raise ValueError(f"bucket size {bucket_bytes} must be a positive multiple of {align} bytes")
    buckets: list[list[Placement]] = [[]]
    cursor = 0
    seen: set[str] = set()
    for name, total in sizes:
        if name in seen:
            raise ValueError(f"tensor {name!r} listed twice")
        check_name(name)
        seen.add(name)
        if total < 0:
            raise ValueError(f"tensor {name!r} has negative size {total}")
        start = align_up(cursor, align)
        if total <= bucket_bytes - start:
            buckets[-1].append(Placement(name, start, total, 0, total))
            cursor = start + total
            continue
        if total <= bucket_bytes:  # fits a fresh bucket: do not split
            buckets.append([Placement(name, 0, total, 0, total)])
            cursor = total
            continue
        done_bytes = 0
        while done_bytes < total:
            start = align_up(cursor, align)
            if start >= bucket_bytes:
                buckets.append([])
                start = 0
            n = min(total - done_bytes, bucket_bytes - start)
            buckets[-1].append(Placement(name, start, n, done_bytes, total))
            done_bytes += n
            cursor = start + n
    if not buckets[-1]:
        buckets.pop()
    return buckets


# -- manifests -------------------------------------------------------------------------------------
def bucket_manifest(version: int, index: int, handle: bytes, placements: Sequence[Placement],
                    dtypes: Mapping[str, str], shapes: Mapping[str, Sequence[int]]) -> dict:
    entries = []
    for p in placements:
        e = {"name": p.name, "dtype": dtypes[p.name], "shape": list(shapes[p.name]), "offset": p.offset,
             "nbytes": p.nbytes}
        if p.chunk_offset or p.nbytes != p.total_nbytes:
            e["chunk_offset"], e["total_nbytes"] = p.chunk_offset, p.total_nbytes
        entries.append(e)
    return {"type": BUCKET, "proto": PROTO, "version": version, "bucket": index, "handle": bytes(handle),
            "entries": entries}
