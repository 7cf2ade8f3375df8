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

Everything here is pure (no sockets, no shared memory): planning the layout, encoding, decoding
and validating. Nothing is ever unpickled: frames are decoded by msgpack with extension types
refused, so a pickled frame is an error, never code.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack

PROTO = 1
ALIGN = 256  # every entry starts at a multiple of this (checkpoint-engine's _ALIGN_SIZE)
HANDLE_SIZE = 64  # bytes of a CUDA IPC handle; sim.ipc_handles uses the same size
MAX_FRAME = 64 << 20  # a manifest larger than this is refused before decoding

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


# -- encoding --------------------------------------------------------------------------------------
def _no_ext(code, data):
    raise ManifestError(f"msgpack extension type {code} is not part of the wire format")


def encode(message: Mapping) -> bytes:
    return msgpack.packb(dict(message), use_bin_type=True)


def decode(frame: bytes, where: str, allowed: Sequence[str] = TRAINER_TYPES) -> dict:
    """One frame -> a message dict with a known ``type``; ManifestError otherwise. Never unpickles."""
    if len(frame) > MAX_FRAME:
        raise ManifestError(f"{where}: message of {len(frame)} bytes exceeds the {MAX_FRAME}-byte limit")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
    except ManifestError:
        raise
    except Exception as e:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ValueError...
        head = bytes(frame[:8])
        hint = " (it looks like a pickle; pickles are never loaded)" if head[:1] == b"\x80" else ""
        raise ManifestError(
            f"{where}: not a msgpack manifest{hint}: {type(e).__name__}: {e}; first bytes {head!r}"
        ) from None
    if not isinstance(message, dict):
        raise ManifestError(f"{where}: message is a msgpack {type(message).__name__}, expected a map")
    kind = message.get("type")
    if kind not in allowed:
        raise ManifestError(f"{where}: field type is {kind!r}, expected one of {list(allowed)}")
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


def name_digest(names: Iterable[str]) -> str:
    """sha256 hex of the tensor names in announcement order, each UTF-8 encoded and NUL-terminated."""
    h = hashlib.sha256()
    for name in names:
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
@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset of this chunk in the bucket buffer
    nbytes: int  # bytes of this chunk
    chunk_offset: int  # byte offset of this chunk within the tensor
    total_nbytes: int  # bytes of the whole tensor

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Bucket:
    version: int
    index: int
    handle: bytes
    entries: tuple[Entry, ...]


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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class UpdateState:
    """The receiver's bookkeeping for one update. Create a fresh one per update."""

    known: Collection[str]
    version: int | None = None  # announced (expected) version; else the first manifest's
    next_bucket: int = 0
    order: list[str] = field(default_factory=list)  # names in order of first appearance
    received: dict[str, int] = field(default_factory=dict)  # bytes received so far
    totals: dict[str, int] = field(default_factory=dict)
    completed_in: dict[str, int] = field(default_factory=dict)  # name -> bucket index that completed it
    nbytes: int = 0

    def where(self, bucket: int | None = None) -> str:
        v = "?" if self.version is None else self.version
        return f"bucket {self.next_bucket if bucket is None else bucket} of version {v}"

    def admit(self, bucket: Bucket) -> None:
        """Record a bucket that passed validation and whose bytes were copied."""
        if self.version is None:
            self.version = bucket.version
        for e in bucket.entries:
            if e.name not in self.received:
                self.order.append(e.name)
                self.received[e.name] = 0
                self.totals[e.name] = e.total_nbytes
            self.received[e.name] += e.nbytes
            if self.received[e.name] == e.total_nbytes:
                self.completed_in[e.name] = bucket.index
            self.nbytes += e.nbytes
        self.next_bucket = bucket.index + 1

    def incomplete(self) -> list[str]:
        return [n for n in self.order if n not in self.completed_in]


def _field(message: Mapping, key: str, where: str, check, expect: str):
    if key not in message:
        raise ManifestError(f"{where}: field {key} is missing ({expect})")
    value = message[key]
    if not check(value):
        raise ManifestError(f"{where}: field {key} is {value!r}, expected {expect}")
    return value


def check_version(got: int, state: UpdateState, where: str) -> None:
    """Every message of an update carries the announced version (or the first manifest's)."""
    if state.version is not None and got != state.version:
        what = "announced" if state.next_bucket == 0 else "used by the earlier buckets"
        raise ManifestError(f"{where}: field version is {got}, but the update's version is {state.version} ({what}); "
                            "a version may not change mid-update")


def parse_entry(raw, where: str) -> Entry:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: entry is a {type(raw).__name__}, expected a map")
    name = _field(raw, "name", where, lambda v: isinstance(v, str) and v != "", "a non-empty str")
    at = f"{where}, tensor {name!r}"
    dtype = _field(raw, "dtype", at, lambda v: isinstance(v, str), "a dtype name (str)")
    shape = _field(raw, "shape", at, lambda v: isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v),
                   "a list of non-negative ints")
    offset = _field(raw, "offset", at, lambda v: _is_int(v) and v >= 0, "a non-negative int")
    nbytes = _field(raw, "nbytes", at, lambda v: _is_int(v) and v >= 0, "a non-negative int")
    chunk_offset, total = 0, nbytes
    if "chunk_offset" in raw or "total_nbytes" in raw:
        chunk_offset = _field(raw, "chunk_offset", at, lambda v: _is_int(v) and v >= 0, "a non-negative int")
        total = _field(raw, "total_nbytes", at, lambda v: _is_int(v) and v >= 0, "a non-negative int")
    return Entry(name, dtype, tuple(shape), offset, nbytes, chunk_offset, total)


def parse_bucket(message: Mapping, state: UpdateState) -> Bucket:
    """Structure of a bucket manifest: fields present and typed, proto, version, index, handle."""
    where = f"ipc_bucket manifest for {state.where()}"
    _field(message, "proto", where, lambda v: v == PROTO, f"protocol {PROTO}")
    version = _field(message, "version", where, _is_int, "an int")
    check_version(version, state, where)
    where = f"ipc_bucket manifest for bucket {state.next_bucket} of version {version}"
    index = _field(message, "bucket", where, _is_int, "an int")
    if index != state.next_bucket:
        raise ManifestError(f"{where}: field bucket is {index}, expected {state.next_bucket} (buckets come in order)")
    handle = _field(message, "handle", where, lambda v: isinstance(v, bytes) and len(v) == HANDLE_SIZE,
                    f"{HANDLE_SIZE} bytes (an IPC handle)")
    raw = _field(message, "entries", where, lambda v: isinstance(v, list), "a list of entries")
    return Bucket(version, index, handle, tuple(parse_entry(e, where) for e in raw))


# The checks below are separate functions so that each can be named in SPEC.md and broken alone.
def check_dtype(e: Entry, where: str) -> None:
    if e.dtype not in DTYPES:
        raise ManifestError(f"{where}, tensor {e.name!r}: unknown dtype {e.dtype!r} (field dtype); "
                            f"known: {sorted(DTYPES)}")


def check_nbytes(e: Entry, where: str) -> None:
    want = math.prod(e.shape) * DTYPES[e.dtype]
    field_name = "total_nbytes" if e.total_nbytes != e.nbytes or e.chunk_offset else "nbytes"
    if e.total_nbytes != want:
        raise ManifestError(f"{where}, tensor {e.name!r}: field {field_name} is {e.total_nbytes} but shape "
                            f"{list(e.shape)} of {e.dtype} needs {want} bytes ({math.prod(e.shape)} x {DTYPES[e.dtype]})")
    if e.chunk_offset + e.nbytes > e.total_nbytes:
        raise ManifestError(f"{where}, tensor {e.name!r}: chunk of {e.nbytes} bytes at chunk_offset {e.chunk_offset} "
                            f"runs past the tensor's {e.total_nbytes} bytes")


def check_ranges(entries: Sequence[Entry], segment_size: int, where: str) -> None:
    for e in entries:
        if e.end > segment_size:
            raise ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} + nbytes {e.nbytes} = {e.end} is out "
                                f"of range of the {segment_size}-byte buffer")


def check_alignment(entries: Sequence[Entry], where: str, align: int = ALIGN) -> None:
    for e in entries:
        if e.offset % align:
            raise ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} is not aligned to {align} bytes "
                                f"(misaligned by {e.offset % align})")


def check_overlaps(entries: Sequence[Entry], where: str) -> None:
    spans = sorted((e.offset, e.end, e.name) for e in entries if e.nbytes)
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ManifestError(f"{where}: tensors {a!r} [{a0}, {a1}) and {b!r} [{b0}, {b1}) overlap in the buffer")


def check_known(entries: Sequence[Entry], state: UpdateState, where: str) -> None:
    for e in entries:
        if e.name not in state.known:
            raise ManifestError(f"{where}, tensor {e.name!r}: not a parameter of the model (field name)")


def check_unique(entries: Sequence[Entry], state: UpdateState, where: str) -> None:
    """A name appears once per update, except the consecutive chunks of one split tensor."""
    here: set[str] = set()
    for e in entries:
        restarted = e.chunk_offset == 0 and (e.name in here or e.name in state.received)
        if restarted or e.name in state.completed_in:
            first = "this bucket" if e.name in here else f"bucket {state.completed_in.get(e.name, '?')}"
            raise ManifestError(f"{where}, tensor {e.name!r}: duplicate name (already announced in {first})")
        here.add(e.name)


def check_chunks(entries: Sequence[Entry], state: UpdateState, where: str) -> None:
    """Chunks of a split tensor arrive in order and contiguous, all with the same total size."""
    progress = dict(state.received)
    totals = dict(state.totals)
    for e in entries:
        have = progress.get(e.name, 0)
        if e.chunk_offset != have:
            raise ManifestError(f"{where}, tensor {e.name!r}: chunk_offset {e.chunk_offset}, expected {have} "
                                "(chunks of a split tensor must be contiguous and in order)")
        if totals.setdefault(e.name, e.total_nbytes) != e.total_nbytes:
            raise ManifestError(f"{where}, tensor {e.name!r}: total_nbytes {e.total_nbytes} differs from the "
                                f"{totals[e.name]} announced with its first chunk")
        progress[e.name] = have + e.nbytes


def validate_bucket(bucket: Bucket, state: UpdateState, segment_size: int) -> None:
    """Every check of one bucket manifest; raises before the receiver reads any byte of it."""
    where = f"ipc_bucket manifest for bucket {bucket.index} of version {bucket.version}"
    for e in bucket.entries:
        check_dtype(e, where)
        check_nbytes(e, where)
    check_ranges(bucket.entries, segment_size, where)
    check_alignment(bucket.entries, where)
    check_overlaps(bucket.entries, where)
    check_known(bucket.entries, state, where)
    check_unique(bucket.entries, state, where)
    check_chunks(bucket.entries, state, where)


def validate_end(message: Mapping, state: UpdateState) -> None:
    """The closing message: same version, every bucket, tensor count and name digest agree."""
    where = f"ipc_bucket end message of version {state.version if state.version is not None else '?'}"
    _field(message, "proto", where, lambda v: v == PROTO, f"protocol {PROTO}")
    version = _field(message, "version", where, _is_int, "an int")
    check_version(version, state, where)
    buckets = _field(message, "buckets", where, _is_int, "an int")
    count = _field(message, "count", where, _is_int, "an int")
    digest = _field(message, "digest", where, lambda v: isinstance(v, str), "a sha256 hex str")
    if buckets != state.next_bucket:
        raise ManifestError(f"{where}: field buckets is {buckets} but {state.next_bucket} bucket(s) arrived")
    if count != len(state.order):
        raise ManifestError(f"{where}: field count is {count} but {len(state.order)} tensor(s) arrived")
    if digest != name_digest(state.order):
        raise ManifestError(f"{where}: field digest {digest[:16]}... does not match the sha256 of the "
                            f"{len(state.order)} names received ({name_digest(state.order)[:16]}...)")
    left = state.incomplete()
    if left:
        raise ManifestError(f"{where}: split tensor(s) incomplete: "
                            + ", ".join(f"{n} ({state.received[n]}/{state.totals[n]} bytes)" for n in left))
