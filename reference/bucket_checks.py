"""The receiver's checks of the ``ipc_bucket`` wire format (SPEC.md "Async IPC buckets", BKT rules).

``wire.protocol`` holds what both ends must agree on (message schema, codec, layout planning,
constants); this module holds what only the receiver does with a message: parse it into
:class:`Bucket`/:class:`Entry`, validate it against the update so far (:class:`UpdateState`) before a
byte of the buffer is read, and check the closing message. Each check is a separate function so that
SPEC.md can name it and a mutant can break it alone; each names every entry at fault, and a manifest's
problems are raised together (``raise_all``, APPLY-EVERY-PROBLEM). The dependency runs one way: this module imports
``wire.protocol``, which imports neither ``reference`` nor ``sim``.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.wire.protocol import ALIGN, DTYPES, HANDLE_SIZE, PROTO, ManifestError, brief, name_digest


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


def raise_all(problems: Sequence[Exception], where: str) -> None:
    """Raise the problems found in one manifest: one as it is, several as one ManifestError listing each."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ManifestError(f"{where}: {len(problems)} problems: " + "; ".join(str(p) for p in problems))


def _field(message: Mapping, key: str, where: str, check, expect: str):
    if key not in message:
        raise ManifestError(f"{where}: field {key} is missing ({expect})")
    value = message[key]
    if not check(value):
        raise ManifestError(f"{where}: field {key} is {brief(value)}, expected {expect}")
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
    # Optional, each with its own default (SPEC wire format): chunk_offset 0, total_nbytes = nbytes.
    chunk_offset, total = 0, nbytes
    if "chunk_offset" in raw:
        chunk_offset = _field(raw, "chunk_offset", at, lambda v: _is_int(v) and v >= 0, "a non-negative int")
    if "total_nbytes" in raw:
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
    entries, bad = [], []
    for e in raw:  # every malformed entry is named, not only the first (APPLY-EVERY-PROBLEM)
        try:
            entries.append(parse_entry(e, where))
        except ManifestError as problem:
            bad.append(problem)
    raise_all(bad, where)
    return Bucket(version, index, handle, tuple(entries))


# The checks below are separate functions so that each can be named in SPEC.md and broken alone.
def check_name_text(e: Entry, where: str) -> None:
    """No NUL in a name: the end message's digest ends each name with one, so ["a\\0b"] and ["a", "b"]
    would digest alike (SPEC wire format, BKT-FIELDS)."""
    if "\0" in e.name:
        raise ManifestError(f"{where}, tensor {e.name!r}: field name holds a NUL character at index {e.name.index(chr(0))} "
                            "(NUL ends each name in the end message's digest; a name may not contain one)")


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
    raise_all([ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} + nbytes {e.nbytes} = {e.end} is out "
                             f"of range of the {segment_size}-byte buffer") for e in entries if e.end > segment_size], where)


def check_alignment(entries: Sequence[Entry], where: str, align: int = ALIGN) -> None:
    raise_all([ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} is not aligned to {align} bytes "
                             f"(misaligned by {e.offset % align})") for e in entries if e.offset % align], where)


def check_overlaps(entries: Sequence[Entry], where: str) -> None:
    spans = sorted((e.offset, e.end, e.name) for e in entries if e.nbytes)
    raise_all([ManifestError(f"{where}: tensors {a!r} [{a0}, {a1}) and {b!r} [{b0}, {b1}) overlap in the buffer")
               for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]) if b0 < a1], where)


def check_known(entries: Sequence[Entry], state: UpdateState, where: str) -> None:
    raise_all([ManifestError(f"{where}, tensor {e.name!r}: not a parameter of the model (field name)")
               for e in entries if e.name not in state.known], where)


def check_unique(entries: Sequence[Entry], state: UpdateState, where: str) -> None:
    """A name appears once per update, except the consecutive chunks of one split tensor."""
    here: set[str] = set()
    found = []
    for e in entries:
        restarted = e.chunk_offset == 0 and (e.name in here or e.name in state.received)
        if restarted or e.name in state.completed_in:
            first = "this bucket" if e.name in here else f"bucket {state.completed_in.get(e.name, '?')}"
            found.append(ManifestError(f"{where}, tensor {e.name!r}: duplicate name (already announced in {first})"))
        here.add(e.name)
    raise_all(found, where)


def check_chunks(entries: Sequence[Entry], state: UpdateState, where: str) -> None:
    """Chunks of a split tensor arrive in order and contiguous, all with the same total size."""
    progress = dict(state.received)
    totals = dict(state.totals)
    found = []
    for e in entries:
        have = progress.get(e.name, 0)
        if e.chunk_offset != have:
            found.append(ManifestError(f"{where}, tensor {e.name!r}: chunk_offset {e.chunk_offset}, expected {have} "
                                       "(chunks of a split tensor must be contiguous and in order)"))
        elif totals.setdefault(e.name, e.total_nbytes) != e.total_nbytes:
            found.append(ManifestError(f"{where}, tensor {e.name!r}: total_nbytes {e.total_nbytes} differs from the "
                                       f"{totals[e.name]} announced with its first chunk"))
        progress[e.name] = have + e.nbytes
    raise_all(found, where)


def validate_bucket(bucket: Bucket, state: UpdateState, segment_size: int) -> None:
    """Every check of one bucket manifest; raises before the receiver reads any byte of it."""
    where = f"ipc_bucket manifest for bucket {bucket.index} of version {bucket.version}"
    found: list[ManifestError] = []  # every problem of the manifest is named, not only the first

    def run(check, *args) -> bool:
        try:
            check(*args)
            return True
        except ManifestError as e:
            found.append(e)
            return False

    for e in bucket.entries:
        run(check_name_text, e, where)
        if run(check_dtype, e, where):  # (a size needs a known dtype)
            run(check_nbytes, e, where)
    run(check_ranges, bucket.entries, segment_size, where)
    run(check_alignment, bucket.entries, where)
    run(check_overlaps, bucket.entries, where)
    run(check_known, bucket.entries, state, where)
    run(check_unique, bucket.entries, state, where)
    run(check_chunks, bucket.entries, state, where)
    raise_all(found, where)


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
        raise ManifestError(f"{where}: field count is {count} but {len(state.order)} tensor(s) arrived "
                            f"({len(state.order)} of {count} sent)")
    if digest != name_digest(state.order):
        raise ManifestError(f"{where}: field digest {digest[:16]}... does not match the sha256 of the "
                            f"{len(state.order)} names received ({name_digest(state.order)[:16]}...)")
    left = state.incomplete()
    if left:
        raise ManifestError(f"{where}: split tensor(s) incomplete: "
                            + ", ".join(f"{n} ({state.received[n]}/{state.totals[n]} bytes)" for n in left))
