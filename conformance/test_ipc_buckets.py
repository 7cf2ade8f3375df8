"""ipc_bucket: flat uint8 buckets announced by msgpack manifests over ZMQ. Spec: SPEC.md § BKT.

The trainer is fixtures.buckets.Publisher, serving from a thread on a private ipc:// endpoint; tests
tamper with its manifests (plain dicts) before serving them. Buckets are tiny (256-2048 bytes) except in
the large cases (>= 8 MiB, so that a loader switching to a threaded or chunked copy for large buffers
runs that copy too), and the frame-limit cases, whose manifest is padded to 64 MiB. Fault tests use timeout_s 0.2 s,
except where the point is that nothing waits it out (BKT-FRAME-REFUSED, BKT-IDLE-WAIT: 5 s).
"""
import functools
import os
import re
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from conformance import check
from conformance import mode_run as R
from conformance import modes
from conformance.harness import Worker, concurrently, in_child
from weightsync.fixtures import buckets as B
from weightsync.fixtures import models as M

pytestmark = pytest.mark.buckets

SPEC = M.spec(("embed.weight", "bfloat16", (8, 16)), ("layers.0.mlp.weight", "float32", (4, 8)), ("norm.bias", "float16", (16,)))
NAMES = [p.name for p in SPEC.all_params]
VERSION = 3


@pytest.fixture
def publisher():
    made = []

    def make(bucket_bytes: int = 1024, wait_s: float = 10.0) -> B.Publisher:
        made.append(B.Publisher(bucket_bytes, wait_s=wait_s))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _serve(loader, publisher, model, states, *, bucket_bytes=1024, version=VERSION, tamper=None, timeout_s=2.0,
           pack_bytes=None, fault=None, wait_s=10.0, combo=None, **serve):
    """Serve ``states`` (one update each) and open a worker expecting ``version``. ``pack_bytes``:
    lay out for buckets of that size but serve buffers of ``bucket_bytes`` (writes clipped), so an
    entry can run past the buffer; ``fault``: what the trainer does wrong in the first update. ``combo``: the
    modes of the session (mode_run): staged; for a later call, healthy updates of other values (same version)
    served, loaded and cleared first, then ``states``."""
    pub = publisher(bucket_bytes, wait_s)
    session = None
    if combo:
        session = loader.open(model, strategy="ipc_bucket", options={**pub.options(version, timeout_s), **R.options(combo)})

        def publish(n):
            pub.serve(B.pack(M.state(model, seed=n, version=version or VERSION), version or VERSION, bucket_bytes))

        R.earlier(combo, session, publish, settle=lambda: pub.wait(10.0))
    updates = [B.pack(st, v, pack_bytes or bucket_bytes) for v, st in states]
    if pack_bytes:
        for update in updates:
            update.writes = [[(o, d[: max(0, bucket_bytes - o)]) for o, d in w] for w in update.writes]
    if tamper:
        tamper(updates[0])
    updates[0].fault = fault
    pub.serve(*updates, **serve)
    if session is None:
        session = loader.open(model, strategy="ipc_bucket", options=pub.options(version, timeout_s))
    return pub, session, updates


def _roundtrip(loader, publisher, model, where, *, bucket_bytes=1024, combo=None, **serve):
    model = R.with_draft(model, combo or {})
    state = M.state(model, version=VERSION)
    pub, session, updates = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=bucket_bytes, combo=combo,
                                   **serve)
    session.update()
    check.params_equal(session.observe(), state, f"{pub.endpoint}: {where}" + (f" ({R.label(combo)})" if combo else ""))
    return updates[0]


def _rejected(loader, publisher, tamper, *, match, names=(), where, exc=ValueError, model=SPEC, bucket_bytes=1024,
              pack_bytes=None, expected=VERSION, combo=None):
    """The update is rejected with ``exc`` matching ``match`` and naming ``names`` and the version (SPEC
    wire format: every violation names the version), and nothing is loaded."""
    if expected is not None:
        names = [*names, f"version {VERSION}"]
    state = M.state(model, version=VERSION)
    pub, session, _ = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=bucket_bytes, tamper=tamper,
                             pack_bytes=pack_bytes, version=expected, combo=combo)
    where = f"{pub.endpoint}: {where}" + (f" ({R.label(combo)})" if combo else "")
    with check.raises(exc, match=match, names=names, where=where):
        session.update()
    check.not_loaded(session.observe(), list(state), where)
    return session


def _free(update, k: int) -> int:
    """First aligned offset after the entries of bucket k."""
    return B.align(max((e["offset"] + e["nbytes"] for e in update.buckets[k]["entries"]), default=0))


def _append(update, k: int, entry: dict, data: bytes) -> dict:
    """Add ``entry`` to bucket k at its first free aligned offset, with ``data`` written there."""
    entry = {**entry, "offset": _free(update, k), "nbytes": len(data)}
    update.buckets[k]["entries"].append(entry)
    update.writes[k].append((entry["offset"], data))
    return entry


@pytest.mark.rule("BKT-ROUNDTRIP-DTYPES")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.modes(model="main", size="small")
def test_every_dtype_roundtrips_bitwise(loader, publisher):
    dtypes = ["bfloat16", "float16", "float32", "int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"]
    model = M.spec(*((f"t.w_{d}", d, (3, 5)) for d in dtypes))
    update = _roundtrip(loader, publisher, model, "8 dtypes in 512-byte buckets", bucket_bytes=512)
    check.that(len(update.buckets) > 1, f"fixture precondition: expected several buckets, got {len(update.buckets)}")


# -- positions: 9 tensors of 128 bytes, three per 768-byte bucket at offsets 0, 256, 512 (gaps of 128) --
POS_SPEC = M.spec(*((f"p.{i}", "float32", (32,)) for i in range(9)))
POS_BUCKET = 768
POSITIONS = {"first-of-first": (0, 0), "middle-of-middle": (1, 1), "last-of-last": (2, 2)}


def _pos_name(position: str) -> str:
    b, j = POSITIONS[position]
    return f"p.{3 * b + j}"


def _params(rule, *more):
    """The rule's cases over its declared modes (SPEC.md Modes:), each needing buckets, ``more``, staged if staged
    and mtp for the draft model."""
    return modes.params(rule, requires=lambda combo: ["ipc.buckets", *more,
                                                      *(["staged"] if combo.get("staged") == "staged" else []),
                                                      *(["mtp"] if combo.get("model") == "draft" else [])])


MODE_POSITION = {"first": "first-of-first", "middle": "middle-of-middle", "last": "last-of-last"}


def _pos_rejected(loader, publisher, position, edit, *, match, names=(), where, exc=ValueError, combo=None):
    """Reject POS_SPEC's update whose entry at ``position`` (bucket, slot) was changed by ``edit``."""
    position = MODE_POSITION.get(position, position)
    name = _pos_name(position)

    def tamper(update):
        e = update.entry(name)
        check.equal(e["offset"], 256 * POSITIONS[position][1], f"fixture precondition: offset of {name}")
        edit(e)

    return _rejected(loader, publisher, tamper, model=POS_SPEC, bucket_bytes=POS_BUCKET, match=match,
                     names=[name, *names], where=f"{where}, bad entry {name} ({position})", exc=exc, combo=combo)


@pytest.mark.rule("BKT-EMPTY-SCALAR")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("position", ["first", "middle", "last", "at-boundary"])
def test_empty_and_scalar_tensors(loader, publisher, position):
    empty, scalar, scalar_i = ("a.w_empty", "float32", (0, 4)), ("a.w_scalar", "bfloat16", ()), ("a.w_scalar_i", "int64", ())
    vec, full = ("a.w_vec", "float32", (3,)), ("a.w_full", "float32", (64,))  # full: 256 bytes, one whole bucket
    order = {"first": [empty, scalar, vec, scalar_i, full], "middle": [vec, empty, scalar, full, scalar_i],
             "last": [vec, full, scalar_i, scalar, empty], "at-boundary": [full, empty, scalar, vec, scalar_i]}[position]
    model = M.spec(*order)
    update = _roundtrip(loader, publisher, model, f"(0, 4) and 0-d tensors {position} in 256-byte buckets",
                        bucket_bytes=256)
    if position == "at-boundary":
        e = update.entry("a.w_empty")
        check.equal((e["offset"], e["nbytes"]), (256, 0), "fixture precondition: empty entry at offset == buffer size")


@pytest.mark.rule("BKT-BOUNDARY")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", ["two-buckets-full", "after-odd-tensor"])
def test_tensor_ending_on_bucket_boundary(loader, publisher, case):
    if case == "two-buckets-full":
        # 256 + 256 bytes fill a 512-byte bucket exactly; then 512 bytes fill the next one alone.
        model = M.spec(("b.first", "float32", (64,)), ("b.edge", "float16", (128,)), ("b.whole", "float32", (128,)),
                       ("b.after", "bfloat16", (4,)))
        bucket, edges = 512, ["b.edge", "b.whole"]
    elif case == "after-odd-tensor":
        # 257 bytes at 0, then a 512-byte uint8 tensor at 512 ending at byte 1024 of 1024.
        model = M.spec(("b.odd", "uint8", (257,)), ("b.last", "uint8", (512,)), ("b.next", "float32", (3,)))
        bucket, edges = 1024, ["b.last"]
    else:
        raise AssertionError(case)
    update = _roundtrip(loader, publisher, model, f"tensors ending at the last byte of a {bucket}-byte bucket ({case})",
                        bucket_bytes=bucket)
    got = [e["name"] for b in update.buckets for e in b["entries"] if e["offset"] + e["nbytes"] == bucket]
    check.equal(got, edges, "fixture precondition: tensors ending on the boundary")


MiB = 1 << 20
LARGE = {
    # many tensors of odd sizes in one 12 MiB bucket, 9+ MiB in all
    "many-in-one": (12 * MiB, [(f"l.t{i}", ("uint8", "bfloat16", "float32")[i % 3], (((i * 7919) % 50000) + 130001,))
                               for i in range(24)]),
    # a tensor of one bucket + 12345 bytes (the first 8 MiB bucket exactly full), then two small ones
    "split-across-large": (8 * MiB, [("l.big", "uint8", (8 * MiB + 12345,)), ("l.before", "float16", (7,)),
                                     ("l.after", "int64", (3,))]),
    # copied bytes one short of 8 MiB, exactly 8 MiB (split between two equal tensors), one past
    "just-under-8MiB": (9 * MiB, [("l.a", "uint8", (4 * MiB,)), ("l.b", "uint8", (4 * MiB - 1,))]),
    "exactly-8MiB": (8 * MiB, [("l.a", "float32", (MiB,)), ("l.b", "float32", (MiB,))]),  # bucket exactly full
    "just-over-8MiB": (9 * MiB, [("l.a", "uint8", (5 * MiB + 1,)), ("l.b", "float32", (3 * MiB // 4,))]),
    # odd sizes: halves fall inside a tensor; three, five or more copy threads split elsewhere
    "odd-sizes": (10 * MiB, [("l.a", "uint8", (MiB + 3,)), ("l.b", "bfloat16", (3 * MiB + 1,)), ("l.c", "uint8", (333,)),
                             ("l.d", "float32", (MiB // 2 + 7,))]),
}


@pytest.mark.rule("BKT-LARGE")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", list(LARGE))
def test_large_buckets_bit_exact(loader, publisher, case):
    bucket, params = LARGE[case]
    model = M.spec(*params)
    update = _roundtrip(loader, publisher, model, f"{case}: {model.nbytes} bytes through {bucket}-byte buckets",
                        bucket_bytes=bucket)
    biggest = max(sum(e["nbytes"] for e in b["entries"]) for b in update.buckets)
    check.that(biggest >= 8 * MiB - 1, f"fixture precondition: {case}: largest bucket carries {biggest} bytes")


@pytest.mark.rule("BKT-SPLIT")
@pytest.mark.requires("ipc.buckets")
def test_tensor_larger_than_a_bucket(loader, publisher):
    model = M.spec(("s.before", "float16", (7,)), ("s.big", "float32", (100, 5)), ("s.after", "uint8", (9,)))
    update = _roundtrip(loader, publisher, model, "a 2000-byte tensor through 512-byte buckets", bucket_bytes=512)
    chunks = [e for b in update.buckets for e in b["entries"] if e["name"] == "s.big"]
    check.that(len(chunks) >= 4, f"fixture precondition: s.big should span >= 4 buckets, got {len(chunks)} chunks")


@pytest.mark.rule("BKT-ALIGN-ODD")
@pytest.mark.requires("ipc.buckets")
def test_odd_sized_tensor_then_wider_dtypes(loader, publisher):
    model = M.spec(("o.mask", "uint8", (3,)), ("o.w", "bfloat16", (5, 3)), ("o.f8", "float8_e4m3fn", (7,)),
                   ("o.x", "float32", (3,)))
    update = _roundtrip(loader, publisher, model, "uint8[3] then bf16, fp8, fp32", bucket_bytes=2048)
    offsets = [e["offset"] for e in update.buckets[0]["entries"]]
    check.equal(offsets, [0, 256, 512, 768], "fixture precondition: aligned offsets")


@pytest.mark.rule("BKT-ACK-AFTER-COPY")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", ["small", "small-no-expected-version", "large-threaded"])
def test_buffer_overwritten_on_ack(loader, publisher, case):
    """The trainer overwrites a buffer from its END backwards (1 MiB steps) the instant it is acked: a
    loader acking while a copy thread still works on the back of the buffer (its share, copied front to
    back) loses the bytes that thread copies last. In the large case the back half of the 16 MiB buffer
    holds zeros the trainer never wrote (holes of the shared-memory file, allocated by the reader's page
    faults), so the copy of the back is the slowest part of the bucket, not a coin toss with the front."""
    tamper = None
    if case.startswith("small"):
        model, bucket = M.spec(*((f"k.{i}", "float32", (32, 4)) for i in range(4))), 512  # one 512-byte tensor per bucket
        state = M.state(model, version=VERSION)
    else:  # two 16 MiB buckets exactly full (the copy a loader parallelizes for large buffers), one in
        # each of the trainer's buffers (the holes below exist only before a buffer's first reuse), then a
        # small one: a loader that does not await its copy thread must win the race twice to pass
        bigs = [f"k.big{i}" for i in range(2)]
        model = M.spec(*((n, "uint8", (16 * MiB,)) for n in bigs), ("k.small", "float32", (3,)))
        bucket = 16 * MiB
        state = {}
        for i, n in enumerate(bigs):
            big = np.zeros(16 * MiB, np.uint8)  # random front half, zero back half
            big[: 8 * MiB] = np.frombuffer(np.random.default_rng(VERSION + i).bytes(8 * MiB), np.uint8)
            state[n] = big
        state.update(M.state(M.spec(("k.small", "float32", (3,))), version=VERSION))

        def tamper(update):  # the zero halves are never written: the reader's faults allocate their pages
            for k in range(len(bigs)):
                update.writes[k] = [(o, d[: 8 * MiB]) for o, d in update.writes[k]]

    expected = None if case.endswith("no-expected-version") else VERSION  # then the acks carry the manifests' version
    pub, session, updates = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=bucket, wait_s=3.0,
                                   overwrite_on_ack=True, version=expected, tamper=tamper)
    where = (f"{pub.endpoint}: trainer fills each {bucket}-byte buffer with 0xA5 from its end when it is acked "
             f"({case}, expected version {expected})")
    session.update()
    check.params_equal(session.observe(), state, where)
    pub.wait(5.0)
    acks = [(m.get("proto"), m.get("version"), m.get("bucket")) for m in pub.replies("ack")]
    want = [(1, VERSION, k) for k in range(len(updates[0].buckets))]
    check.equal(acks, want, f"{where}: (proto, version, bucket) of every ack, in order")


NBYTES = r"(?<!total_)nbytes"  # the field nbytes, not total_nbytes (a whole tensor's entry has no chunk fields)


@pytest.mark.rule("BKT-MANIFEST-MISMATCH")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize(
    "field,exc,match",
    [pytest.param("nbytes-half", ValueError, NBYTES, id="nbytes-half"),
     pytest.param("nbytes-one-item-short", ValueError, NBYTES, id="nbytes-one-item-short"),
     pytest.param("nbytes-one-item-long", ValueError, NBYTES, id="nbytes-one-item-long"),
     pytest.param("nbytes-double", ValueError, NBYTES, id="nbytes-double"),
     *(pytest.param(f"total_nbytes-one-{side}-{chunk}", ValueError, "total_nbytes", id=f"total_nbytes-one-{side}-{chunk}")
       for side in ("short", "long") for chunk in ("first", "middle", "last", "every")),
     pytest.param("dtype", TypeError, "Type mismatch for layers.0.mlp.weight", id="dtype"),
     pytest.param("shape", ValueError, "Shape mismatch for layers.0.mlp.weight", id="shape")],
)
def test_manifest_disagreeing_with_data_or_model(loader, publisher, field, exc, match):
    name = "c.big" if field.startswith("total") else "layers.0.mlp.weight"
    model = M.spec(("c.big", "float32", (300,))) if name == "c.big" else SPEC

    def tamper(update):
        e = update.entry(name)  # layers.0.mlp.weight: float32 (4, 8), 128 bytes at 256; c.big: 1200 bytes, chunk 0
        if field == "nbytes-half":
            e["nbytes"] = 64  # short, so that a worker trusting it writes inside the tensor
        elif field == "nbytes-one-item-short":
            e["nbytes"] -= 4
        elif field == "nbytes-one-item-long":
            e["nbytes"] += 4
        elif field == "nbytes-double":
            e["nbytes"] *= 2
        elif field.startswith("total_nbytes"):  # one chunk alone (the others right), or every chunk alike
            _, side, chunk = field.rsplit("-", 2)
            for k in {"first": [0], "middle": [1], "last": [2], "every": [0, 1, 2]}[chunk]:
                update.entry(name, k)["total_nbytes"] += -1 if side == "short" else 1
        elif field == "dtype":
            e["dtype"], e["shape"], e["nbytes"] = "float16", [4, 16], 128
        else:
            e["shape"] = [8, 4]

    names = [name, f"version {VERSION}"] if field in ("dtype", "shape") else [name]
    _rejected(loader, publisher, tamper, exc=exc, match=match, names=names, model=model,
              bucket_bytes=512 if name == "c.big" else 1024, where=f"manifest {field} disagrees")


@pytest.mark.rule("BKT-OFFSET-RANGE")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", ["past-end", "straddling", "one-byte-past", "starts-at-end", *POSITIONS])
def test_offset_out_of_range(loader, publisher, case):
    if case in POSITIONS:  # a 128-byte entry starting at the 768-byte buffer's end
        def edit(e):
            e["offset"] = POS_BUCKET

        _pos_rejected(loader, publisher, case, edit, match="out of range", where="entry at offset 768 of a 768-byte buffer")
        return
    if case == "one-byte-past":  # 257 bytes at 768 of a 1024-byte buffer: ends at 1025
        model = M.spec(("r.a", "float32", (64,)), ("r.b", "uint8", (511,)), ("r.c", "uint8", (257,)))
        _rejected(loader, publisher, None, model=model, bucket_bytes=1024, pack_bytes=1280, match="out of range",
                  names=["r.c"], where="r.c: offset 768 + nbytes 257 = 1025 of a 1024-byte buffer")
        return
    model = M.spec(("r.a", "float32", (64,)), ("r.b", "float32", (128,)))  # 256 + 512 bytes, one 1024-byte bucket
    offset = {"past-end": 1280, "straddling": 768, "starts-at-end": 1024}[case]

    def tamper(update):
        update.entry("r.b")["offset"] = offset  # 512 bytes at 1280 (past the end) or at 768 (ending at 1280)

    _rejected(loader, publisher, tamper, model=model, match="out of range", names=["r.b"],
              where=f"r.b at offset {offset} of a 1024-byte buffer ({case})")


# o.a [0, 257), o.b [512, 640), o.c [768, 1280), o.d [1280, 1408) in a 2048-byte bucket; o.e is empty.
OVERLAP_SPEC = M.spec(("o.a", "uint8", (257,)), ("o.b", "float32", (32,)), ("o.c", "float32", (128,)),
                      ("o.d", "float32", (32,)), ("o.e", "float32", (0, 4)))
OVERLAPS = {  # case -> (tensor moved, new offset, the tensor it collides with)
    "one-byte": ("o.b", 256, "o.a"),  # [256, 384) shares byte 256 with o.a
    "same-offset-same-size": ("o.d", 512, "o.b"),
    "same-offset-longer": ("o.b", 768, "o.c"),
    "contained": ("o.b", 1024, "o.c"),
    "containing-end": ("o.d", 1024, "o.c"),
}


@pytest.mark.rule("BKT-OVERLAP")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", [*OVERLAPS, "adjacent-loads", "empty-at-same-offset-loads"])
def test_overlapping_entries_rejected(loader, publisher, case):
    if case == "adjacent-loads":  # 256-byte tensors back to back: [0, 256), [256, 512), [512, 768)
        model = M.spec(*((f"o.{i}", "bfloat16", (128,)) for i in range(3)))
        update = _roundtrip(loader, publisher, model, "adjacent entries (one ends where the next starts)")
        check.equal([e["offset"] for e in update.buckets[0]["entries"]], [0, 256, 512], "fixture precondition: offsets")
        return
    if case == "empty-at-same-offset-loads":
        def tamper(update):
            update.entry("o.e")["offset"] = update.entry("o.b")["offset"]  # 0 bytes at 512: shares nothing

        state = M.state(OVERLAP_SPEC, version=VERSION)
        pub, session, _ = _serve(loader, publisher, OVERLAP_SPEC, [(VERSION, state)], bucket_bytes=2048, tamper=tamper)
        session.update()
        check.params_equal(session.observe(), state, f"{pub.endpoint}: an empty entry at the offset of o.b")
        return
    moved, offset, other = OVERLAPS[case]

    def tamper(update):
        update.entry(moved)["offset"] = offset

    _rejected(loader, publisher, tamper, model=OVERLAP_SPEC, bucket_bytes=2048, match="overlap", names=[moved, other],
              where=f"{moved} moved to offset {offset} over {other} ({case})")


@pytest.mark.rule("BKT-MISALIGNED")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("by", [1, 128])
@pytest.mark.parametrize("position", list(POSITIONS))
def test_misaligned_offset_rejected(loader, publisher, position, by):
    want = 256 * POSITIONS[position][1] + by

    def edit(e):
        e["offset"] += by  # the 128-byte entry still fits its 256-byte slot

    _pos_rejected(loader, publisher, position, edit, match="not aligned", names=[str(want)],
                  where=f"entry misaligned by {by} (offset {want})")


@pytest.mark.rule("BKT-DTYPE-UNKNOWN")
@pytest.mark.requires("ipc.buckets")
def test_unknown_dtype_rejected(loader, publisher):
    def tamper(update):
        update.entry("norm.bias")["dtype"] = "float4_e2m1fn"

    _rejected(loader, publisher, tamper, match="unknown dtype", names=["norm.bias", "float4_e2m1fn"],
              where="dtype float4_e2m1fn")


@pytest.mark.rule("BKT-UNKNOWN-NAME")
@pytest.mark.requires("ipc.buckets")
def test_unknown_name_rejected(loader, publisher):
    def tamper(update):
        _append(update, 0, {"name": "lm_head.weight", "dtype": "float32", "shape": [4]}, b"\0" * 16)
        update.names.append("lm_head.weight")
        update.end.update(count=len(update.names), digest=B.digest(update.names))

    _rejected(loader, publisher, tamper, match="not a parameter", names=["lm_head.weight"],
              where="entry for lm_head.weight, which the model lacks")


@pytest.mark.rule("BKT-DUPLICATE")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("where_", ["later-bucket", "same-bucket"])
def test_duplicate_name_rejected(loader, publisher, where_):
    # 512-byte buckets: bucket 0 = embed.weight, layers.0.mlp.weight; bucket 1 = norm.bias.
    name = "layers.0.mlp.weight" if where_ == "later-bucket" else "norm.bias"

    def tamper(update):
        first = update.entry(name)
        _append(update, 1, {k: first[k] for k in ("name", "dtype", "shape")}, b"\x01" * first["nbytes"])

    _rejected(loader, publisher, tamper, bucket_bytes=512, match="duplicate", names=[name],
              where=f"{name} announced twice ({where_})")


@pytest.mark.rule("BKT-CHUNKS")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", ["gap-of-one", "back-by-one", "out-of-order", "last-chunk-missing", "last-chunk-one-item-long",
                                  "total-changes-between-chunks"])
def test_split_chunks_contiguous_in_order(loader, publisher, case):
    model = M.spec(("c.big", "float32", (300,)))  # 1200 bytes in 512-byte buckets: chunks 512, 512, 176

    def tamper(update):
        c0, c1, c2 = (update.entry("c.big", i) for i in range(3))
        if case == "gap-of-one":
            c1["chunk_offset"] += 1
        elif case == "back-by-one":
            c2["chunk_offset"] -= 1
        elif case == "last-chunk-one-item-long":  # 180 bytes at chunk_offset 1024 of a 1200-byte tensor
            c2["nbytes"] += 4
            update.writes[2] = [(o, d + b"\0" * 4) for o, d in update.writes[2]]
        elif case == "total-changes-between-chunks":  # chunk 1 claims a (301,) tensor of 1204 bytes
            c1["shape"], c1["total_nbytes"] = [301], 1204
        elif case == "last-chunk-missing":  # the end counts the two buckets sent
            del update.buckets[2], update.writes[2]
            update.end["buckets"] = 2
        else:  # swap what buckets 1 and 2 carry: chunk 2 arrives before chunk 1
            update.buckets[1], update.buckets[2] = update.buckets[2], update.buckets[1]
            update.writes[1], update.writes[2] = update.writes[2], update.writes[1]
            update.buckets[1]["bucket"], update.buckets[2]["bucket"] = 1, 2

    match = {"last-chunk-missing": "incomplete", "total-changes-between-chunks": "total_nbytes|[Ss]hape"}.get(case, "chunk_offset")
    _rejected(loader, publisher, tamper, model=model, bucket_bytes=512, match=match, names=["c.big"],
              where=f"chunks of c.big: {case}")


@pytest.mark.rule("BKT-CHUNKS")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("chunks", [2, 3], ids=["two-chunks-one-bucket", "three-chunks-one-bucket"])
def test_consecutive_chunks_in_one_bucket_load(loader, publisher, chunks):
    """Contiguity and order are judged by ``chunk_offset``, whatever bucket carries a chunk: a bucket holding
    consecutive chunks of one tensor (c.big, 768 bytes, re-announced as ``chunks`` entries) loads bit-exact."""
    model = M.spec(("a.small", "float16", (8,)), ("c.big", "float32", (192,)))
    cuts = {2: [0, 512, 768], 3: [0, 256, 512, 768]}[chunks]  # each chunk starts at a 256-byte aligned offset

    def tamper(update):
        whole = update.entry("c.big")
        entries = update.buckets[0]["entries"]
        at = entries.index(whole)
        entries[at:at + 1] = [{**whole, "offset": whole["offset"] + a, "nbytes": b - a, "chunk_offset": a,
                               "total_nbytes": 768} for a, b in zip(cuts, cuts[1:])]

    state = M.state(model, version=VERSION)
    pub, session, updates = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=1024, tamper=tamper)
    check.equal([e["chunk_offset"] for e in updates[0].buckets[0]["entries"] if e["name"] == "c.big"],
                cuts[:-1], "fixture precondition: c.big's chunks all in bucket 0")
    session.update()
    check.params_equal(session.observe(), state, f"{pub.endpoint}: {chunks} consecutive chunks of c.big in bucket 0")


def _end_tamper(field: str, case: str):
    def tamper(update):
        end = update.end
        if case == "missing":
            del end[field]
        elif field == "version":
            end["version"] = {"other": VERSION + 1, "str": str(VERSION)}[case]
        elif field in ("buckets", "count"):
            end[field] += {"one-fewer": -1, "one-more": 1}[case]
        elif field == "digest":
            names = {"other-order": list(reversed(update.names)), "one-name-missing": update.names[:-1],
                     "uppercase": None}[case]
            end["digest"] = end["digest"].upper() if names is None else B.digest(names)
        elif field == "proto":
            end["proto"] = 2

    return tamper


END_CASES = [("version", "other"), ("version", "missing"), ("version", "str"), ("buckets", "one-fewer"),
             ("buckets", "one-more"), ("buckets", "missing"), ("count", "one-fewer"), ("count", "one-more"),
             ("count", "missing"), ("digest", "other-order"),
             ("digest", "one-name-missing"), ("digest", "uppercase"), ("digest", "missing"), ("proto", "2"),
             ("proto", "missing"), ("type", "missing")]


@pytest.mark.rule("BKT-END-CHECK")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("field,case", END_CASES, ids=[f"{f}-{c}" for f, c in END_CASES])
def test_end_message_must_match(loader, publisher, field, case):
    names = [field, f"version {VERSION}"]
    if (field, case) == ("version", "other"):
        names.append(str(VERSION + 1))
    _rejected(loader, publisher, _end_tamper(field, case), bucket_bytes=512, match=field, names=names,
              where=f"end message with field {field} {case}")


@pytest.mark.rule("BKT-REPEAT")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.modes(model="main", call=("second", "third"))
@pytest.mark.parametrize("expected", ["none", "configured"])
def test_three_updates_in_a_row(loader, publisher, expected):
    if expected == "none":  # versions 1, 2, 3
        states = [(v, M.state(SPEC, version=v)) for v in (1, 2, 3)]
    else:  # the worker expects version 3 every time: three updates of version 3 with other values
        states = [(VERSION, M.state(SPEC, seed=s, version=VERSION)) for s in (1, 2, 3)]
    pub, _, _ = _serve(loader, publisher, SPEC, states, bucket_bytes=512)
    session = loader.open(SPEC, strategy="ipc_bucket", options=pub.options(None if expected == "none" else VERSION))
    for i, (v, want) in enumerate(states):
        if i:
            session.clear()
        session.update()
        check.params_equal(session.observe(), want, f"{pub.endpoint}: update {i + 1} of 3 (version {v}, expected {expected})")


def _bounded(fn, seconds: float):
    """Run ``fn`` in a thread; (finished, exception, elapsed). A hang is reported, not waited out."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as e:
            out["error"] = e

    start = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out.get("error"), time.monotonic() - start


# SPEC in 256-byte buckets: one tensor per bucket, buckets 0, 1, 2, then the end (step 3).
FAULT_TIMEOUT = 0.2
# The timeout of a session whose update must succeed: a bound only a broken worker waits out. A healthy trainer of
# this process answers in milliseconds, but a loaded machine can hold a thread for more than FAULT_TIMEOUT, and an
# update that must succeed may not depend on that race (BKT-NO-LEAK failed so in a loaded CI run).
HEALTHY_TIMEOUT = 3.0
# A session whose first update must time out and whose next must succeed (BKT-RECOVERY): short enough to keep
# the case cheap, long enough that no scheduling delay of a loaded machine reaches it between two messages.
RECOVERY_TIMEOUT = 0.5
FAULT_PHASES = {  # case -> (fault, bucket awaited)
    "dies-before-first-reply": (("die", 0), 0),
    "silent-after-bucket-0": (("silent", 1), 1),
    "dies-after-middle-bucket": (("die", 2), 2),
    "silent-before-end": (("silent", 3), 3),
}
TIMEOUT_CASES = {
    **{case: dict(fault=fault) for case, (fault, _) in FAULT_PHASES.items()},
    "dies-after-end-succeeds": dict(fault=("die", "after-end")),
    "slow-but-healthy-succeeds": dict(pause_s=0.4),  # 4 replies, each 0.4 s late: 1.6 s in all > timeout_s 1.0
}
# The two updates that must succeed wait HEALTHY_WAIT_S for each message: the slow trainer's 0.6 s of slack per
# reply holds on a loaded machine (0.14 s beside the other cases' trainers did not, as the stream's did not:
# test_stream_timing.py), and the whole slow update (1.6 s) stays over it, so a loader bounding the update, not
# each silence, still fails. A loader waiting for anything after the dead trainer's end waits in vain either way.
HEALTHY_WAIT_S = 1.0
MUST_SUCCEED = ("dies-after-end-succeeds", "slow-but-healthy-succeeds")


def _timeout_of(case: str) -> float:
    """The ``timeout_s`` a BKT-TIMEOUT case's session is served with (a mode case's: RECOVERY_TIMEOUT, below)."""
    if case in TIMEOUT_MODE_CASES:
        return RECOVERY_TIMEOUT
    return HEALTHY_WAIT_S if case in MUST_SUCCEED else FAULT_TIMEOUT


def _status_param(case):
    phase = {"dies-before-first-reply": "before-first", "silent-after-bucket-0": "mid", "dies-after-middle-bucket": "mid",
             "silent-before-end": "after-last"}.get(case)
    marks = [pytest.mark.requires("ipc.buckets", "status")]
    if phase:
        marks.append(pytest.mark.modes(phase=phase, call="first"))
    return pytest.param(case, marks=marks, id=case)


# BKT-TIMEOUT in every pair of its modes (staged, a later call, the phase): case name -> (combo, the plain case it
# repeats), run in the same timed batch. A later call's earlier updates are healthy: their session's timeout is
# RECOVERY_TIMEOUT, which no scheduling delay reaches, and the batch waits out that instead of FAULT_TIMEOUT.
_PHASE_CASE = {"before-first": "dies-before-first-reply", "mid": "silent-after-bucket-0", "after-last": "silent-before-end"}
TIMEOUT_MODE_CASES = {f"{_PHASE_CASE[p.values[0]['phase']]}@{p.id}": (p.values[0], _PHASE_CASE[p.values[0]["phase"]],
                                                                      [m for m in p.marks if m.name == "requires"][0].args)
                      for p in modes.params("BKT-TIMEOUT", requires=lambda c: ["ipc.buckets", "status",
                                                                               *(["staged"] if c["staged"] == "staged" else [])])}


@pytest.fixture(scope="module")
def timed_updates(request, tmp_path_factory):
    """Every BKT-TIMEOUT case at once: one trainer and one worker per case, all updates started together,
    so that the module waits out one timeout instead of one per case. Yields ``{case: (pub, session,
    updates, (finished, error, elapsed))}``; each case's test judges its own."""
    from conformance.harness import Loader
    from conformance.plugin import ADAPTER_KEY

    adapter = request.config.stash[ADAPTER_KEY]
    if not {"ipc.buckets", "status"} <= set(adapter.capabilities):
        yield {}  # every case is not_applicable: its test never asks
        return
    pubs = []
    with pytest.MonkeyPatch.context() as mp:
        loader = Loader(adapter, tmp_path_factory.mktemp("bucket-timeouts"), mp)
        try:
            def publisher(bucket_bytes, wait_s):
                pubs.append(B.Publisher(bucket_bytes, wait_s=wait_s))
                return pubs[-1]

            served = {case: _serve(loader, publisher, SPEC, [(VERSION, M.state(SPEC, version=VERSION))], bucket_bytes=256,
                                   timeout_s=_timeout_of(case), **script) for case, script in TIMEOUT_CASES.items()}
            for case, (combo, plain, needs) in TIMEOUT_MODE_CASES.items():
                if set(needs) <= set(adapter.capabilities):
                    served[case] = _serve(loader, publisher, SPEC, [(VERSION, M.state(SPEC, version=VERSION))],
                                          bucket_bytes=256, timeout_s=_timeout_of(case), combo=combo, **TIMEOUT_CASES[plain])
            outcomes = {}

            def bounded(case):  # _bounded, so that a worker that never gives up is reported, not waited out
                outcomes[case] = _bounded(served[case][1].update, 4.0)

            concurrently({case: functools.partial(bounded, case) for case in served})
            yield {case: (*served[case], outcomes[case]) for case in served}
        finally:
            loader.close_all()
            for pub in pubs:
                pub.close()


@pytest.mark.rule("BKT-TIMEOUT")
@pytest.mark.parametrize("case", [_status_param(c) for c in TIMEOUT_CASES] + [
    pytest.param(name, marks=[pytest.mark.requires(*needs), pytest.mark.modes(**combo)], id=name)
    for name, (combo, _, needs) in TIMEOUT_MODE_CASES.items()])
def test_dead_trainer_is_a_timeout(timed_updates, case):
    pub, session, updates, (finished, error, elapsed) = timed_updates[case]
    state = M.state(SPEC, version=VERSION)
    plain = TIMEOUT_MODE_CASES[case][1] if case in TIMEOUT_MODE_CASES else case
    awaited = FAULT_PHASES[plain][1] if plain in FAULT_PHASES else None
    where = f"{pub.endpoint}: {case} ({len(updates[0].buckets)} buckets, timeout_s {_timeout_of(case):g}, run beside the other cases)"
    check.that(finished, f"{where}: update() still blocked after {elapsed:.1f}s")
    if awaited is None:
        check.that(error is None, f"{where}: the update must succeed, got {type(error).__name__}: {error}")
        check.params_equal(session.observe(), state, where)
        check.status_is(session, "NORMAL", where)
        return
    check.that(isinstance(error, TimeoutError),
               f"{where}: expected TimeoutError, got {type(error).__name__ if error else 'no error'}: {error}")
    check.that(elapsed <= 1.5, f"{where}: raised after {elapsed:.2f}s, expected within 1.5s")
    missing = [s for s in (f"bucket {awaited}", f"version {VERSION}") if s not in str(error)]
    check.that(not missing, f"{where}: error {str(error)!r} does not name {missing}")
    check.not_loaded(session.observe(), NAMES, where)
    check.status_not(session, "NORMAL", where)


@pytest.mark.rule("BKT-ABORT")
@pytest.mark.parametrize("step", [pytest.param(k, marks=[pytest.mark.requires("ipc.buckets", "status"),
                                                         pytest.mark.modes(phase=p)], id=k)
                                  for k, p in (("0", "before-first"), ("1", "mid"), ("3", "after-last"))])
def test_trainer_abort(loader, publisher, step):
    k = int(step)
    state = M.state(SPEC, version=VERSION)
    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=256, timeout_s=2.0,
                             fault=("abort", k))
    where = f"{pub.endpoint}: trainer sends abort instead of {'the end' if k == 3 else f'bucket {k}'}"
    finished, error, elapsed = _bounded(session.update, 4.0)
    check.that(finished and elapsed < 1.5, f"{where}: update() took {elapsed:.2f}s (finished {finished}); an abort "
               "must end the update at once, not after timeout_s")
    check.that(error is not None, f"{where}: update() returned although the trainer aborted")
    missing = [s for s in (f"trainer gave up before step {k}", f"bucket {k}", f"version {VERSION}") if s not in str(error)]
    check.that(not missing, f"{where}: error {type(error).__name__}: {str(error)!r} does not name {missing}")
    check.not_loaded(session.observe(), NAMES, where)
    check.status_not(session, "NORMAL", where)


@pytest.mark.rule("BKT-VERSION")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", ["changes-mid-update", "not-the-expected", "changes-mid-update-none-expected"])
def test_version_must_not_change(loader, publisher, case):
    def tamper(update):
        for k, manifest in enumerate(update.buckets):
            if case == "not-the-expected" or k >= 1:
                manifest["version"] = VERSION + 1
        update.end["version"] = VERSION + 1 if case == "not-the-expected" else VERSION

    expected = None if case.endswith("none-expected") else VERSION  # then bucket 0's version is the update's
    _rejected(loader, publisher, tamper, bucket_bytes=512, match=f"version is {VERSION + 1}.*{VERSION}",
              names=[str(VERSION + 1), "bucket 0" if case == "not-the-expected" else "bucket 1"],
              where=f"version {VERSION} then {VERSION + 1} ({case})", expected=expected)


DONE_APPLIED = {  # case -> (model, bucket bytes, expected version configured): each tensor counted once
    "applied": (SPEC, 256, VERSION),  # 3 tensors, one per bucket
    "applied-no-expected-version": (SPEC, 256, None),  # done (and every ack) carry the manifests' version, never nil
    # 3 tensors, s.big (2000 bytes) split into 5 chunks over 512-byte buckets: 7 entries, count 3
    "applied-split-tensor": (M.spec(("s.before", "float16", (7,)), ("s.big", "float32", (100, 5)),
                                    ("s.after", "uint8", (9,))), 512, VERSION),
    # an empty (0, 4) tensor and two 0-d ones among 4: each counts, bytes or none
    "applied-empty-and-0d": (M.spec(("a.w_empty", "float32", (0, 4)), ("a.w_scalar", "bfloat16", ()),
                                    ("a.w_vec", "float32", (3,)), ("a.w_scalar_i", "int64", ())), 256, VERSION),
}


@pytest.mark.rule("BKT-DONE-AFTER-COMMIT")
@pytest.mark.parametrize("case", [*(pytest.param(c, marks=pytest.mark.requires("ipc.buckets")) for c in DONE_APPLIED),
                                  pytest.param("missing-parameter", marks=pytest.mark.requires("ipc.buckets", "status")),
                                  pytest.param("end-rejected", marks=pytest.mark.requires("ipc.buckets", "status")),
                                  # the commit's own steps fail after every byte landed and was verified
                                  pytest.param("hook-raises",
                                               marks=pytest.mark.requires("ipc.buckets", "model.hooks", "status")),
                                  pytest.param("recapture-raises",
                                               marks=pytest.mark.requires("ipc.buckets", "model.recapture", "status"))])
def test_done_only_after_commit(loader, publisher, case):
    model, bucket, expected = DONE_APPLIED.get(case, (SPEC, 256, VERSION))
    state = M.state(model, version=VERSION)
    sent = {n: a for n, a in state.items() if n != "layers.0.mlp.weight"} if case == "missing-parameter" else state
    tamper = _end_tamper("digest", "other-order") if case == "end-rejected" else None
    pub, _, updates = _serve(loader, publisher, model, [(VERSION, sent)], bucket_bytes=bucket, tamper=tamper, wait_s=3.0)
    moved = []

    def recapture(names):
        moved.append(list(names))
        raise RuntimeError("graph capture ran out of memory")

    options = {**pub.options(expected), **({"recapture": recapture} if case == "recapture-raises" else {})}
    # worker rank 1 on CUDA ordinal 1 = physical GPU 1: the hello carries the global rank
    session = loader.open(model, strategy="ipc_bucket", options=options, worker=Worker(1, "0,1", "1"))
    if case == "hook-raises":
        def hook():
            raise RuntimeError("prefix cache reset failed")

        session.register_hook("reset_prefix_cache", hook)
    failure = {"hook-raises": ("reset_prefix_cache", "prefix cache reset failed"),
               "recapture-raises": ("graph capture ran out of memory",)}.get(case)
    where = f"{pub.endpoint}: what the trainer is told after an update {case} (expected version {expected})"
    if case in DONE_APPLIED:
        entries = sum(len(b["entries"]) for b in updates[0].buckets)
        check.that(case != "applied-split-tensor" or entries == 7,
                   f"fixture precondition: {entries} entries, expected 7 (s.big in 5 chunks)")
        session.update()
        check.params_equal(session.observe(), state, where)
    elif failure:
        with check.raises(RuntimeError, match=failure[-1], names=list(failure), where=where):
            session.update()
        check.that(case != "recapture-raises" or moved, f"{where}: the recapture hook was never called (the first "
                   f"load gives every parameter its memory), so the case proves nothing")
        check.status_not(session, "NORMAL", where)
    else:
        with check.raises((ValueError, RuntimeError), match="digest|layers.0.mlp.weight", where=where):
            session.update()
        check.status_not(session, "NORMAL", where)
    try:
        pub.wait(5.0)
    except TimeoutError:
        pass  # the trainer waited for a done or an error that never came: judged below
    done = [(m.get("proto"), m.get("version"), m.get("count")) for m in pub.replies("done")]
    if case in DONE_APPLIED:
        check.equal(done, [(1, VERSION, len(state))], f"{where}: (proto, version, count) of the done messages "
                    f"({len(state)} tensors in {len(updates[0].buckets)} buckets)")
        kinds = [m.get("type") for m in pub.received]
        check.equal(kinds, ["hello"] + ["ack"] * len(updates[0].buckets) + ["done"], f"{where}: messages in order")
        hello = pub.received[0]
        check.equal((hello.get("version"), hello.get("rank"), hello.get("proto")), (expected, 1, 1),
                    f"{where}: (version, rank, proto) of the hello of worker rank 1 expecting version {expected}")
    else:
        check.equal(done, [], f"{where}: done messages after a failed update")
        kinds = [m.get("type") for m in pub.received]
        check.that(kinds[-1:] == ["error"], f"{where}: messages {kinds}: the last must be an error (the trainer "
                   f"waits for done or error)")
        if failure:
            told = pub.replies("error")[-1].get("message", "")
            check.that(all(n in told for n in failure), f"{where}: the error told the trainer {told!r}, which must "
                       f"name {list(failure)}")


@pytest.mark.rule("BKT-ERROR-REPORTED")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("step", ["0", "1", "2", "end", "commit"])
def test_error_reported_to_trainer(loader, publisher, step):
    """SPEC in 256-byte buckets: buckets 0, 1, 2 carry one tensor each; the end is step 3."""
    state = M.state(SPEC, version=VERSION)
    sent = state
    if step == "commit":
        sent = {n: a for n, a in state.items() if n != "norm.bias"}
    bucket = {"0": 0, "1": 1, "2": 2, "end": 3, "commit": 2}[step]

    def tamper(update):
        if step == "end":
            update.end["count"] += 1
        elif step != "commit":
            update.buckets[bucket]["entries"][0]["dtype"] = "float4_e2m1fn"

    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, sent)], bucket_bytes=256, tamper=tamper, wait_s=3.0)
    where = f"{pub.endpoint}: rejected at {step}"
    with check.raises((ValueError, RuntimeError), match="float4_e2m1fn|count|norm.bias", where=where):
        session.update()
    try:
        pub.wait(5.0)
    except TimeoutError:
        pass  # the trainer waited for an error that never came: judged below
    kinds = [m.get("type") for m in pub.received]
    check.that(kinds and kinds[-1] == "error", f"{where}: the worker's last message must be an error, got {kinds}")
    check.that("done" not in kinds, f"{where}: the worker sent done for a failed update: {kinds}")
    check.equal(kinds.count("ack"), bucket, f"{where}: buckets acknowledged before the rejection ({kinds})")
    err = pub.replies("error")[-1]
    check.equal((err.get("proto"), err.get("version"), err.get("bucket")), (1, VERSION, bucket),
                f"{where}: (proto, version, bucket) of the error")
    text = str(err.get("message"))
    fault = {"end": "count", "commit": "norm.bias"}.get(step, "float4_e2m1fn")
    check.that(fault in text, f"{where}: the error sent to the trainer, {text!r}, does not name {fault!r}")


@pytest.mark.rule("BKT-STATUS-UPDATING")
@pytest.mark.requires("ipc.buckets", "status")
def test_status_updating_while_buckets_arrive(loader, publisher):
    state = M.state(SPEC, version=VERSION)
    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=256, hold_before=1)
    where = f"{pub.endpoint}: status() from another thread while the trainer holds bucket 1"
    runner = threading.Thread(target=lambda: out.update(done=_bounded(session.update, 5.0)), daemon=True)
    out = {}
    runner.start()
    try:
        check.that(pub.holding.wait(5.0), f"{where}: the worker never acknowledged bucket 0")
        check.status_is(session, "UPDATING", where)
        check.not_loaded(session.observe(), NAMES, f"{where}: before the end message")
    finally:
        pub.release.set()
    runner.join(6.0)
    finished, error, _ = out.get("done", (False, None, 0))
    check.that(finished and error is None, f"{where}: after the release the update must succeed, got {error!r}")
    check.status_is(session, "NORMAL", f"{where}: after the update")


@pytest.mark.rule("BKT-RECOVERY")
@pytest.mark.parametrize("failure,expected", [
    pytest.param(f, e, marks=pytest.mark.requires("ipc.buckets", "status"), id=f"{f}-expected-{e}")
    for f, e in (("rejected", "configured"), ("timed-out", "configured"), ("aborted", "none"))])
def test_recovery_after_failed_update(loader, publisher, failure, expected):
    bad, good = M.state(SPEC, seed=1, version=VERSION), M.state(SPEC, seed=2, version=VERSION)
    fault = {"rejected": None, "timed-out": ("silent", 1), "aborted": ("abort", 1)}[failure]

    def tamper(update):
        if failure == "rejected":
            update.buckets[1]["entries"][0]["offset"] = 8

    pub, _, _ = _serve(loader, publisher, SPEC, [(VERSION, bad), (VERSION, good)], bucket_bytes=256, tamper=tamper,
                       fault=fault)
    session = loader.open(SPEC, strategy="ipc_bucket",
                          options=pub.options(VERSION if expected == "configured" else None,
                                              RECOVERY_TIMEOUT if failure == "timed-out" else HEALTHY_TIMEOUT))
    where = f"{pub.endpoint}: update {failure} at bucket 1, then clear() and an update from a healthy trainer"
    with check.raises(Exception, match="bucket 1", where=where):
        session.update()
    check.status_not(session, "NORMAL", where)
    session.clear()
    session.update()
    check.params_equal(session.observe(), good, where)
    check.status_is(session, "NORMAL", where)


@pytest.mark.rule("BKT-ATOMIC")
@pytest.mark.requires("ipc.buckets", "status")
@pytest.mark.parametrize("case", ["second-bucket", "end-message", "missing-parameter", "last-bucket"])
def test_rejected_update_changes_nothing(loader, publisher, case):
    state = M.state(SPEC, version=VERSION)
    if case == "missing-parameter":
        sent = {n: a for n, a in state.items() if n != "norm.bias"}
        pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, sent)], bucket_bytes=512)
    else:
        def tamper(update):
            if case == "second-bucket":
                update.buckets[1]["entries"][0]["offset"] += 8
            elif case == "last-bucket":  # 256-byte buckets: the third and last carries norm.bias
                update.buckets[-1]["entries"][0]["dtype"] = "bfloat16"
            else:
                update.end["count"] -= 1

        pub, session, updates = _serve(loader, publisher, SPEC, [(VERSION, state)],
                                       bucket_bytes=256 if case == "last-bucket" else 512, tamper=tamper)
    where = f"{pub.endpoint}: update rejected ({case})"
    before = session.observe()
    exc, match = {"missing-parameter": (RuntimeError, "norm.bias"), "last-bucket": (TypeError, "norm.bias")}.get(
        case, (ValueError, "bucket|count"))
    with check.raises(exc, match=match, where=where):
        session.update()
    after = session.observe()
    check.unchanged(before, after, where)
    check.not_loaded(after, NAMES, where)
    check.status_not(session, "NORMAL", where)


@pytest.mark.rule("BKT-NO-PICKLE")
@pytest.mark.requires("ipc.buckets")
def test_pickled_manifest_never_unpickled(loader, publisher, tmp_path):
    marker = tmp_path / "pickle-ran"

    def tamper(update):
        update.buckets[0] = B.exec_pickle(marker)

    _rejected(loader, publisher, tamper, match="msgpack", names=["bucket 0", f"version {VERSION}"],
              where="trainer replies to hello with a pickle")
    check.that(not marker.exists(), f"{marker}: created, so the worker unpickled the trainer's message")


@pytest.mark.rule("BKT-NO-PICKLE")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("k", [0, 2], ids=["bucket-0", "last-bucket"])
@pytest.mark.parametrize("frame", ["extension-type", "array"])
def test_frame_that_is_not_a_plain_map_refused(loader, publisher, k, frame):
    """SPEC wire format: one msgpack map per frame, extension types refused. ``extension-type``: an extension
    type (code 5) in a field no message defines, so that a worker which ignores unknown fields never looks at
    it; ``array``: the manifest's values as a msgpack array. Refused while decoded, naming the bucket;
    nothing is loaded."""
    def tamper(update):
        if frame == "array":
            update.buckets[k] = list(update.buckets[k].values())
        else:
            update.buckets[k]["note"] = msgpack.ExtType(5, b"x")

    _rejected(loader, publisher, tamper, match="extension" if frame == "extension-type" else "map",
              names=[f"bucket {k}"], bucket_bytes=256, where=f"bucket {k}'s frame: {frame}")


MAX_FRAME = 64 * MiB  # SPEC wire format: frames over 64 MiB are refused


def _copy_seconds(nbytes: int) -> float:
    """The best of three copies of ``nbytes`` into memory touched beforehand: how fast this machine moves
    bytes right now (the load of other jobs included)."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.rule("BKT-FRAME-LIMIT")
@pytest.mark.parametrize("case", [pytest.param("exactly-64MiB-loads", marks=pytest.mark.requires("ipc.buckets")),
                                  pytest.param("64MiB-plus-1-refused", marks=pytest.mark.requires("ipc.buckets", "status"))])
def test_frame_size_limit(loader, publisher, case):
    """Bucket 0's manifest, otherwise valid, padded by an extra field (bin zeros, ignored as unknown) to a
    frame of exactly 64 MiB (not over the limit: loads) or 64 MiB + 1 byte (refused: the worker raises
    ValueError, or TimeoutError where its transport drops the frame, and loads nothing)."""
    size = MAX_FRAME + (1 if case.endswith("refused") else 0)
    state = M.state(SPEC, version=VERSION)

    def tamper(update):
        update.frame_bytes[0] = size

    # timeout_s: a worker must have time to take the frame in (and load) before it would time out. At exactly
    # the limit the frame must load, so the timeout only bounds a broken worker's silence: 30 s. (With 2 s, the
    # reference timed out on it in CI, beside thirty processes: the frame is copied several times on its way,
    # by threads of a starved process.) Over the limit, a worker without the limit must take the frame in
    # before it would time out, while one with it times out after that silence: 2 s or 120 times what
    # copying 16 MiB takes right now. (With 0.2 s, a worker without the limit timed out under a load average
    # of 5, its TimeoutError read as a refusal; a worker that refuses the frame as it arrives answers at once.)
    timeout_s = 30.0 if size <= MAX_FRAME else max(2.0, 120 * _copy_seconds(MAX_FRAME // 4))
    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=512, tamper=tamper,
                             timeout_s=timeout_s, wait_s=3.0 + timeout_s)
    where = f"{pub.endpoint}: bucket 0 sent as a frame of {size} bytes (limit {MAX_FRAME}, timeout_s {timeout_s:.2f})"
    finished, error, elapsed = _bounded(session.update, 4.0 + timeout_s)
    check.that(finished, f"{where}: update() still blocked after {elapsed:.1f}s")
    if size <= MAX_FRAME:
        check.that(error is None, f"{where}: a frame of exactly the limit must load, got {type(error).__name__}: {error}")
        check.params_equal(session.observe(), state, where)
        return
    check.that(isinstance(error, (ValueError, TimeoutError)),
               f"{where}: expected ValueError or TimeoutError, got {type(error).__name__ if error else 'no error'}: {error}")
    check.that(elapsed <= timeout_s + 1.2, f"{where}: raised after {elapsed:.2f}s, expected within {timeout_s + 1.2:.2f}s")
    missing = [w for w in ("bucket 0", f"version {VERSION}") if w not in str(error)]
    check.that(not missing, f"{where}: error {str(error)!r} does not name {missing}")
    check.not_loaded(session.observe(), NAMES, where)
    check.status_not(session, "NORMAL", where)


_MIB_FIGURE = re.compile(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*MiB")
_BYTE_FIGURE = re.compile(r"(\d+)(?:-byte|\s*bytes?\b)")


@pytest.mark.rule("BKT-FRAME-REFUSED")
@pytest.mark.requires("ipc.buckets", "status")
def test_refused_frame_reported_at_once(loader, publisher):
    """A frame of 64 MiB + 1 byte answering hello, with timeout_s 5: the trainer is alive and waiting, so the
    worker must say the frame was refused (ValueError) well before timeout_s, not time out as if the trainer
    were silent (a transport that drops the frame with the connection, as ZMQ's MAXMSGSIZE does, still shows
    the drop); its message states the limit, and no figure of it in MiB or bytes misstates it."""
    size, timeout_s, bound = MAX_FRAME + 1, 5.0, 2.5
    state = M.state(SPEC, version=VERSION)

    def tamper(update):
        update.frame_bytes[0] = size

    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=512, tamper=tamper,
                             timeout_s=timeout_s, wait_s=3.0 + timeout_s)
    where = f"{pub.endpoint}: bucket 0 sent as a frame of {size} bytes (limit {MAX_FRAME}, timeout_s {timeout_s:g})"
    finished, error, elapsed = _bounded(session.update, 4.0 + timeout_s)
    check.that(finished, f"{where}: update() still blocked after {elapsed:.1f}s")
    check.that(isinstance(error, ValueError),
               f"{where}: expected ValueError (the frame refused), got {type(error).__name__ if error else 'no error'}"
               f" after {elapsed:.2f}s: {error}")
    check.that(elapsed <= bound, f"{where}: refused after {elapsed:.2f}s, expected within {bound}s (timeout_s "
                                 f"{timeout_s:g}): the refusal waited for the trainer's silence")
    text = str(error)
    missing = [w for w in ("bucket 0", f"version {VERSION}") if w not in text]
    check.that(not missing, f"{where}: error {text!r} does not name {missing}")
    check.that("64 MiB" in text or str(MAX_FRAME) in text,
               f"{where}: error {text!r} states the limit neither as 64 MiB nor as {MAX_FRAME} bytes")
    wrong = [f"{m} MiB" for m in _MIB_FIGURE.findall(text) if abs(float(m) - 64) > 0.01]
    wrong += [f"{m} bytes" for m in _BYTE_FIGURE.findall(text) if int(m) not in (MAX_FRAME, size)]
    check.that(not wrong, f"{where}: error {text!r} misstates the 64 MiB ({MAX_FRAME}-byte) limit as {wrong}")
    check.not_loaded(session.observe(), NAMES, where)
    check.status_not(session, "NORMAL", where)


IDLE_HOLD_S = 0.6  # the trainer's pause before bucket 1, at least; and until a process spinning beside had this much CPU
IDLE_HOLD_MAX_S = 4.0  # (the worker's deadline is 5 s)
IDLE_CPU_S = 0.1  # CPU the worker's process may spend in it (a spinning wait takes most of a core)


def _spin_beside(cpu_s: float, max_s: float) -> float:
    """A forked process spinning until it has had ``cpu_s`` of CPU, or ``max_s`` passed; returns its CPU. On an idle
    machine it takes ``cpu_s``; on a loaded one as long as a process of this priority needs to get that much, so a
    worker that spins while it waits has had its share of a core too (a fixed pause, there, starves the spinner
    below the bound and lets it pass)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (only spins and writes: nothing of the parent's threads is touched)
        try:
            os.close(r)
            end = time.monotonic() + max_s
            while time.process_time() < cpu_s and time.monotonic() < end:
                pass
            os.write(w, struct.pack("d", time.process_time()))
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = b""
        while chunk := os.read(r, 8):
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return struct.unpack("d", data)[0] if len(data) == 8 else 0.0


@pytest.mark.rule("BKT-IDLE-WAIT")
@pytest.mark.requires("ipc.buckets")
def test_waiting_for_a_slow_trainer_burns_no_cpu(loader, publisher):
    """A healthy trainer holding bucket 1 for 0.6 s, and on a loaded machine until a process spinning beside the
    worker has had 0.6 s of CPU (at most 4 s; timeout_s 5): the worker's process uses at most 0.1 s of CPU (user +
    system, every thread) over the hold, so it blocks on the transport instead of polling it in a loop; after the
    release the update loads."""
    state = M.state(SPEC, version=VERSION)
    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=256, hold_before=1,
                             timeout_s=5.0)
    where = f"{pub.endpoint}: the trainer holds bucket 1 for {IDLE_HOLD_S:g}s (timeout_s 5)"
    out = {}
    runner = threading.Thread(target=lambda: out.update(done=_bounded(session.update, 8.0)), daemon=True)
    runner.start()
    try:
        check.that(pub.holding.wait(5.0), f"{where}: the worker never acknowledged bucket 0")
        time.sleep(0.05)  # the worker is past its ack, waiting for bucket 1
        cpu, wall = time.process_time(), time.monotonic()
        beside = _spin_beside(IDLE_HOLD_S, IDLE_HOLD_MAX_S)
        time.sleep(max(0.0, IDLE_HOLD_S - (time.monotonic() - wall)))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        pub.release.set()
    runner.join(9.0)
    finished, error, _ = out.get("done", (False, None, 0))
    check.that(finished and error is None, f"{where}: after the release the update must succeed, got {error!r}")
    check.params_equal(session.observe(), state, where)
    check.that(cpu <= IDLE_CPU_S, f"{where}: the worker's process used {cpu:.2f}s of CPU in {wall:.2f}s of waiting "
                                  f"(at most {IDLE_CPU_S:g}s allowed; a process spinning beside it had {beside:.2f}s): "
                                  f"it spins instead of blocking on the transport")


def _mapped(names) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if any(n in line for n in names)]


def _ours() -> set[str]:
    prefix = f"wscf_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _settled(probe, want, seconds: float = 2.0):
    """``probe()`` once it equals ``want``, or its last value after ``seconds`` (sockets close asynchronously)."""
    deadline = time.monotonic() + seconds
    while True:
        got = probe()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def _no_leak(loader, publisher, outcome) -> None:
    """One update ending in ``outcome`` (``-staged``: of a staged session), then: no socket, mapping, /dev/shm
    segment or thread of it left."""
    staged = outcome.endswith("-staged")
    outcome = outcome.removesuffix("-staged")
    existing, threads = _ours(), set(threading.enumerate())
    large = "-large" in outcome
    model = M.spec(("n.big", "uint8", (8 * MiB,)), ("n.small", "float32", (3,))) if large else SPEC
    state = M.state(model, version=VERSION)

    def tamper(update):
        if outcome.startswith("rejected"):
            update.end["digest"] = "0" * 64

    timeout_s = FAULT_TIMEOUT if outcome == "timed-out" else HEALTHY_TIMEOUT  # only a timeout waits it out
    pub, session, _ = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=8 * MiB if large else 512,
                             tamper=tamper, timeout_s=timeout_s, fault=("silent", 1) if outcome == "timed-out" else None,
                             combo={"staged": "staged"} if staged else None)
    where = f"{pub.endpoint}: after an update that was {outcome} (process {os.getpid()})"
    sockets = _sockets()  # the trainer's listening socket is open; the worker has not connected yet
    finished, error, elapsed = _bounded(session.update, 5.0)  # a copy thread that never runs must not hang the suite
    check.that(finished, f"{where}: update() still blocked after {elapsed:.1f}s")
    if outcome.startswith("applied"):
        check.that(error is None, f"{where}: the update must succeed, got {type(error).__name__}: {error}")
    else:
        exc, match = (TimeoutError, "bucket 1") if outcome == "timed-out" else (ValueError, "digest")
        check.that(isinstance(error, exc) and match in str(error),
                   f"{where}: expected {exc.__name__} naming {match!r}, got {type(error).__name__}: {error}")
    # While the trainer is still up, a socket the worker kept open keeps its connection (and the
    # trainer's end of it) alive; once the worker closed it, both descriptors go.
    got = _settled(_sockets, sockets)
    check.that(got <= sockets, f"{where}: {got} socket descriptors open, {sockets} before the update (one left open)")
    names = pub.segment_names
    pub.close()  # the trainer unmaps and unlinks its buffers: any mapping left is the worker's
    left = _mapped(names)
    check.that(not left, f"{where}: the worker still maps the trainer's buffers: {left}")
    leaked = sorted(_ours() - existing)
    check.that(not leaked, f"{where}: /dev/shm still holds {leaked} after the trainer closed")
    extra = _settled(lambda: sorted(t.name for t in set(threading.enumerate()) - threads if t.is_alive()), [])
    check.that(not extra, f"{where}: threads still running after the update: {extra}")


def _no_leak_in_child(loader, outcome) -> None:
    """``_no_leak`` in a forked child, with a trainer of its own: the child's first large update is the
    first of its process, so a copy pool (or any thread) that outlives one update is new there, whatever
    earlier tests did in the parent; a pool inherited across the fork hangs (bounded) or fails."""
    made = []

    def publisher(bucket_bytes: int = 1024, wait_s: float = 10.0) -> B.Publisher:
        made.append(B.Publisher(bucket_bytes, wait_s=wait_s))
        return made[-1]

    try:
        _no_leak(loader, publisher, outcome)
    finally:
        for pub in made:
            pub.close()


@pytest.mark.rule("BKT-NO-LEAK")
@pytest.mark.parametrize("outcome", [pytest.param("applied", marks=[pytest.mark.requires("ipc.buckets"),
                                                                    pytest.mark.modes(outcome="success")]),
                                     pytest.param("applied-large-in-child", marks=[pytest.mark.requires("ipc.buckets"),
                                                                                   pytest.mark.modes(outcome="success")]),
                                     pytest.param("rejected", marks=[pytest.mark.requires("ipc.buckets"),
                                                                     pytest.mark.modes(outcome="rejected")]),
                                     pytest.param("timed-out", marks=[pytest.mark.requires("ipc.buckets"),
                                                                      pytest.mark.modes(outcome="timeout")]),
                                     *(pytest.param(f"{o}-staged", marks=[pytest.mark.requires("ipc.buckets", "staged"),
                                                                          pytest.mark.modes(outcome=m)])
                                       for o, m in (("applied", "success"), ("rejected", "rejected"),
                                                    ("timed-out", "timeout")))])
def test_no_mapping_or_segment_left(loader, publisher, outcome):
    if outcome.endswith("-in-child"):
        in_child(_no_leak_in_child, loader, outcome, timeout_s=20.0)
    else:
        _no_leak(loader, publisher, outcome)


# -- the APPLY rules on the bucket path ---------------------------------------------------------------
APPLY_SPEC = M.spec(("x.bf16", "bfloat16", (4, 8)), ("x.f16", "float16", (4, 8)), ("x.u8", "uint8", (16,)),
                    ("x.f8", "float8_e5m2", (16,)), ("x.f32", "float32", (4, 8)), ("x.scalar", "float32", ()))
# 256-byte buckets: x.bf16 (64 B) and x.f16 (64 B) in bucket 0, ... : first, middle and last positions.


def _apply_rejected(loader, publisher, name, dtype=None, shape=None, *, exc, match):
    def tamper(update):
        e = update.entry(name)
        if dtype is not None:
            e["dtype"] = dtype
        if shape is not None:
            e["shape"] = list(shape)

    _rejected(loader, publisher, tamper, model=APPLY_SPEC, bucket_bytes=256, exc=exc, match=match, names=[name],
              where=f"bucket entry {name} announced as {dtype or 'its dtype'} {list(shape) if shape is not None else ''}")


@pytest.mark.rule("APPLY-DTYPE-MISMATCH")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("name,dtype", [("x.bf16", "float16"), ("x.f16", "bfloat16"), ("x.u8", "float8_e4m3fn"),
                                        ("x.f8", "float8_e4m3fn"), ("x.scalar", "int32")])
def test_bucket_dtype_mismatch(loader, publisher, name, dtype):
    """Same itemsize, so nbytes still agrees: only the comparison with the parameter's dtype can catch it."""
    _apply_rejected(loader, publisher, name, dtype, exc=TypeError, match=f"Type mismatch for {name}")


@pytest.mark.rule("APPLY-SHAPE-MISMATCH")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("name,shape", [("x.bf16", (8, 4)), ("x.f16", (32,)), ("x.u8", (16, 1)), ("x.scalar", (1,))])
def test_bucket_shape_mismatch(loader, publisher, name, shape):
    """Same element count, so nbytes still agrees: only the comparison with the parameter's shape can catch it."""
    _apply_rejected(loader, publisher, name, shape=shape, exc=ValueError, match=f"Shape mismatch for {name}")


@pytest.mark.rule("APPLY-DTYPE-BEFORE-SHAPE")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("name,dtype,shape", [("x.f32", "float16", (4, 16)), ("x.bf16", "float16", (8, 4))])
def test_bucket_dtype_before_shape(loader, publisher, name, dtype, shape):
    _apply_rejected(loader, publisher, name, dtype, shape, exc=TypeError, match=f"Type mismatch for {name}")


@pytest.mark.rule("APPLY-MISSING-FAILS")
@pytest.mark.requires("ipc.buckets", "status")
@pytest.mark.parametrize("missing", [("x.bf16",), ("x.scalar",), ("x.bf16", "x.f8")],
                         ids=["first", "last", "first-and-middle"])
def test_bucket_missing_parameter(loader, publisher, missing):
    state = M.state(APPLY_SPEC, version=VERSION)
    sent = {n: a for n, a in state.items() if n not in missing}
    pub, session, _ = _serve(loader, publisher, APPLY_SPEC, [(VERSION, sent)], bucket_bytes=256)
    where = f"{pub.endpoint}: update without {list(missing)}"
    with check.raises(RuntimeError, match=missing[0], names=list(missing), where=where):
        session.update()
    check.not_loaded(session.observe(), list(sent), where)
    check.status_not(session, "NORMAL", where)


MTP_SPEC = M.spec(("embed.weight", "bfloat16", (8, 4)), ("norm.bias", "float16", (4,)),
                  mtp=[(("mtp.0.proj.weight", "bfloat16", (4, 4)), ("mtp.0.norm.weight", "float32", (4,)))])


@pytest.mark.rule("APPLY-MTP-LOADED")
@pytest.mark.requires("ipc.buckets", "mtp")
def test_bucket_main_and_mtp_two_versions(loader, publisher):
    states = [(v, M.state(MTP_SPEC, version=v)) for v in (1, 2)]
    pub, _, _ = _serve(loader, publisher, MTP_SPEC, states, bucket_bytes=256)
    session = loader.open(MTP_SPEC, strategy="ipc_bucket", options=pub.options(None))
    for i, (v, want) in enumerate(states):
        if i:
            session.clear()
        session.update()
        check.params_equal(session.observe(), want, f"{pub.endpoint}: main + MTP, update of version {v}")


@pytest.mark.rule("APPLY-ROUNDTRIP-DTYPES")
@pytest.mark.requires("ipc.buckets")
def test_bucket_every_dtype_and_scalars(loader, publisher):
    dtypes = ["bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool", "float8_e4m3fn",
              "float8_e5m2"]
    model = M.spec(*((f"d.w_{d}", d, (5, 3)) for d in dtypes), *((f"d.s_{d}", d, ()) for d in dtypes))
    update = _roundtrip(loader, publisher, model, "every wire dtype, as (5, 3) and 0-d tensors, in 512-byte buckets",
                        bucket_bytes=512)
    check.that(len(update.buckets) > 2, f"fixture precondition: expected several buckets, got {len(update.buckets)}")


BAD_OPTIONS = {  # case -> (options changed, option named in the error)
    "endpoint-remote-tcp": ({"endpoint": "tcp://10.1.2.3:5555"}, "endpoint"),
    "endpoint-http": ({"endpoint": "http://127.0.0.1:5555"}, "endpoint"),
    "endpoint-missing": ({"endpoint": None}, "endpoint"),
    "version-str": ({"version": "3"}, "version"),
    "version-bool": ({"version": True}, "version"),
    "timeout-zero": ({"timeout_s": 0}, "timeout_s"),
    "timeout-negative": ({"timeout_s": -1.0}, "timeout_s"),
    "timeout-nan": ({"timeout_s": float("nan")}, "timeout_s"),
    "timeout-bool": ({"timeout_s": True}, "timeout_s"),
    "timeout-str": ({"timeout_s": "5"}, "timeout_s"),
}


@pytest.mark.rule("BKT-OPTIONS")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", [*BAD_OPTIONS, "defaults-load", "localhost-tcp-loads"])
def test_bucket_options(loader, publisher, case):
    state = M.state(SPEC, version=VERSION)
    if case == "localhost-tcp-loads":  # the trainer binds a local TCP port; no version, no timeout_s
        pub = publisher(512)
        pub.sock.unbind(pub.endpoint)
        port = pub.sock.bind_to_random_port("tcp://127.0.0.1")
        pub.endpoint = f"tcp://127.0.0.1:{port}"
        pub.serve(B.pack(state, VERSION, 512))
        options = {"endpoint": pub.endpoint}
    else:
        pub = publisher(512)
        if case not in BAD_OPTIONS:
            pub.serve(B.pack(state, VERSION, 512))
        options = {"endpoint": pub.endpoint}  # defaults: no expected version, timeout_s 5
    if case in BAD_OPTIONS:
        changes, named = BAD_OPTIONS[case]
        options.update(changes)
        options = {k: v for k, v in options.items() if v is not None}
        where = f"ipc_bucket options {options!r} ({case})"
        with check.raises(ValueError, match=named, where=where):
            session = loader.open(SPEC, strategy="ipc_bucket", options=options)
            session.update()
        return
    session = loader.open(SPEC, strategy="ipc_bucket", options=options)
    session.update()
    check.params_equal(session.observe(), state, f"{pub.endpoint}: options {options} ({case})")


FIELD_CASES = {  # case -> (where: "manifest" or "entry", field, new value; DELETE removes it)
    "manifest-proto-2": ("manifest", "proto", 2),
    "manifest-proto-missing": ("manifest", "proto", "DELETE"),
    "manifest-version-str": ("manifest", "version", "3"),
    "manifest-bucket-missing": ("manifest", "bucket", "DELETE"),
    "manifest-bucket-skips-one": ("manifest", "bucket", 1),
    "manifest-bucket-str": ("manifest", "bucket", "0"),
    "manifest-handle-63-bytes": ("manifest", "handle", b"\0" * 63),
    "manifest-handle-str": ("manifest", "handle", "0" * 64),
    "manifest-entries-map": ("manifest", "entries", {}),
    "manifest-entries-missing": ("manifest", "entries", "DELETE"),
    "entry-not-a-map": ("entry", None, ["embed.weight"]),
    "entry-name-missing": ("entry", "name", "DELETE"),
    "entry-name-empty": ("entry", "name", ""),
    "entry-name-int": ("entry", "name", 7),
    "entry-name-nul": ("entry", "name", "embed.weight\0"),  # NUL ends each name in the end digest
    "entry-dtype-int": ("entry", "dtype", 16),
    "entry-shape-str": ("entry", "shape", "8,16"),
    "entry-shape-negative": ("entry", "shape", [-8, -16]),
    "entry-shape-bool": ("entry", "shape", [True, 16]),
    "entry-offset-negative": ("entry", "offset", -256),
    "entry-offset-missing": ("entry", "offset", "DELETE"),
    "entry-nbytes-str": ("entry", "nbytes", "256"),
    "entry-nbytes-negative": ("entry", "nbytes", -256),
    "entry-chunk_offset-negative": ("entry", "chunk_offset", -1),
    "entry-chunk_offset-str": ("entry", "chunk_offset", "0"),
    "entry-total_nbytes-str": ("entry", "total_nbytes", "256"),
}
FIELD_DEFAULTS = {  # optional fields given alone, at their default value: must load
    "entry-chunk_offset-0-alone-loads": ("entry", "chunk_offset", 0),
    "entry-total_nbytes-alone-loads": ("entry", "total_nbytes", 256),
}


@pytest.mark.rule("BKT-FIELDS")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("field", ["total_nbytes", "chunk_offset"])
def test_optional_field_alone_at_zero_on_an_empty_tensor(loader, publisher, field):
    """An empty tensor's defaults are 0 for both optional fields: either given alone at 0 loads (``total_nbytes``
    0 is its default there, nbytes 0, not a missing size)."""
    model = M.spec(("a.w_empty", "float32", (0, 4)), ("embed.weight", "bfloat16", (8, 16)))

    def tamper(update):
        update.entry("a.w_empty")[field] = 0

    state = M.state(model, version=VERSION)
    pub, session, updates = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=512, tamper=tamper)
    e = updates[0].entry("a.w_empty")
    check.equal((e["nbytes"], e.get(field), "total_nbytes" in e and "chunk_offset" in e), (0, 0, False),
                "fixture precondition: the empty entry carries one optional field, at 0")
    session.update()
    check.params_equal(session.observe(), state, f"{pub.endpoint}: empty tensor with {field} 0 alone")


@pytest.mark.rule("BKT-FIELDS")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", [*FIELD_CASES, *FIELD_DEFAULTS])
def test_manifest_fields_present_and_typed(loader, publisher, case):
    """Bucket 0 of SPEC in 512-byte buckets: embed.weight (bf16 (8, 16), 256 bytes at 0) and layers.0.mlp.weight."""
    kind, field, value = FIELD_CASES.get(case) or FIELD_DEFAULTS[case]
    named = {"entry-not-a-map": "entry"}.get(case, field)
    # A NUL name is refused as such, not only as a name the model lacks (which any name check would say).
    match = {"entry-name-nul": r"field name holds a NUL"}.get(case, named)

    def tamper(update):
        manifest = update.buckets[0]
        if kind == "entry" and field is None:
            manifest["entries"][0] = value
            return
        target = manifest if kind == "manifest" else manifest["entries"][0]
        if value == "DELETE":
            del target[field]
        else:
            target[field] = value

    if case in FIELD_DEFAULTS:
        state = M.state(SPEC, version=VERSION)
        pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=512, tamper=tamper)
        session.update()
        check.params_equal(session.observe(), state, f"{pub.endpoint}: bucket 0 with {case}")
        return
    _rejected(loader, publisher, tamper, bucket_bytes=512, match=match, names=[f"version {VERSION}"],
              where=f"bucket 0 with {case}")


# -- BKT-FIELDS: nesting ----------------------------------------------------------------------------------------
# The wire's nesting bound is msgpack's own decoder's (msgpack-python's fixed stack): a frame whose arrays and maps
# nest at most 1024 levels, the message's map counting as one, is decoded, and a field no message defines is ignored
# whatever it holds; one nesting 1025 levels is refused naming the bucket. A known field nested a thousand levels
# deep (within the bound, where an error message that shows the value whole would raise RecursionError) is refused
# naming the field. case -> (manifest or its first entry, field, arrays or maps, levels of the value, bucket, loads?)
NESTED_FIELDS = {
    "unknown-field-1024-levels-arrays": ("manifest", "note", "array", 1023, 2, True),
    "unknown-field-1024-levels-maps": ("manifest", "note", "map", 1023, 0, True),
    "unknown-field-1025-levels-arrays": ("manifest", "note", "array", 1024, 0, False),
    "unknown-field-1025-levels-maps": ("manifest", "note", "map", 1024, 2, False),
    "entry-unknown-field-1025-levels": ("entry", "note", "array", 1022, 1, False),
    "entry-shape-1000-arrays": ("entry", "shape", "array", 1000, 0, False),
    "version-1000-maps": ("manifest", "version", "map", 1000, 2, False),
    "handle-1000-arrays": ("manifest", "handle", "array", 1000, 1, False),
    "type-1000-arrays": ("manifest", "type", "array", 1000, 0, False),
    "entries-5000-arrays": ("manifest", "entries", "array", 5000, 2, False),
}


@pytest.mark.rule("BKT-FIELDS")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", list(NESTED_FIELDS))
def test_manifest_nested_deep(loader, publisher, case):
    """SPEC's 256-byte buckets, three of them: the nesting in bucket 0, 1 or the last; nothing is loaded after a
    refusal, every tensor bit for bit where the nesting is within the bound in an unknown field."""
    spot, field, kind, depth, k, loads = NESTED_FIELDS[case]
    levels = depth + (1 if spot == "manifest" else 3)

    def tamper(update):
        manifest = update.buckets[k]
        target = manifest if spot == "manifest" else manifest["entries"][0]
        target[field] = B.nested(kind, depth)

    where = f"bucket {k}'s {spot} with {field} nesting {depth} {kind}s ({levels} levels in the frame)"
    if loads:
        state = M.state(SPEC, version=VERSION)
        pub, session, updates = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=256, tamper=tamper)
        check.equal(len(updates[0].buckets), 3, "fixture precondition: the number of buckets")
        session.update()
        check.params_equal(session.observe(), state, f"{pub.endpoint}: {where}")
        return
    named = [f"bucket {k}"] + ([field] if field not in ("note", "entries") else [])
    _rejected(loader, publisher, tamper, match=re.escape(f"bucket {k}"), names=named, bucket_bytes=256, where=where)


# -- every rule in every pair of its modes (SPEC.md Modes:) ---------------------------------------------------------
# The cases above hold each rule's boundaries on a plain session's first update of the main model; the cases below
# run a representative of them in every pair of the rule's declared modes (conformance/modes.py): staged, a later
# call of the session (healthy updates of the same version loaded and cleared first), the draft model, the bad
# entry's position, small buckets or 8 MiB ones.
_DTYPES = ["bfloat16", "float16", "float32", "int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"]
BIG_BUCKET = 8 * MiB + 4096


def _sized(small_model, combo):
    """(model, bucket bytes): ``small_model`` in 512-byte buckets, or with an 8 MiB + 1 byte tensor in buckets of
    8 MiB + 4 KiB (every copy strategy a loader switches to for large buffers runs)."""
    if combo.get("size") != "large":
        return small_model, 512
    return M.spec(*((p.name, p.dtype, p.shape) for p in small_model.main), ("z.big", "uint8", (8 * MiB + 1,))), BIG_BUCKET


@pytest.mark.rule("BKT-ROUNDTRIP-DTYPES")
@pytest.mark.parametrize("combo", _params("BKT-ROUNDTRIP-DTYPES"))
def test_every_dtype_roundtrips_bitwise_in_every_mode(loader, publisher, combo):
    model, bucket = _sized(M.spec(*((f"t.w_{d}", d, (3, 5)) for d in _DTYPES)), combo)
    _roundtrip(loader, publisher, model, f"8 dtypes in {bucket}-byte buckets", bucket_bytes=bucket, combo=combo)


@pytest.mark.rule("BKT-EMPTY-SCALAR")
@pytest.mark.parametrize("combo", _params("BKT-EMPTY-SCALAR"))
def test_empty_and_scalar_tensors_in_every_mode(loader, publisher, combo):
    model = M.spec(("a.w_vec", "float32", (3,)), ("a.w_empty", "float32", (0, 4)), ("a.w_scalar", "bfloat16", ()),
                   ("a.w_full", "float32", (64,)), ("a.w_scalar_i", "int64", ()))
    _roundtrip(loader, publisher, model, "(0, 4) and 0-d tensors in 256-byte buckets", bucket_bytes=256, combo=combo)


@pytest.mark.rule("BKT-BOUNDARY")
@pytest.mark.parametrize("combo", _params("BKT-BOUNDARY"))
def test_tensor_ending_on_bucket_boundary_in_every_mode(loader, publisher, combo):
    if combo["size"] == "large":  # two 4 MiB tensors fill an 8 MiB bucket exactly; a small one follows
        model, bucket, edge = M.spec(("b.a", "float32", (MiB,)), ("b.b", "float32", (MiB,)), ("b.c", "int64", (3,))), 8 * MiB, "b.b"
    else:
        model, bucket, edge = M.spec(("b.first", "float32", (64,)), ("b.edge", "float16", (128,)),
                                     ("b.after", "bfloat16", (4,))), 512, "b.edge"
    update = _roundtrip(loader, publisher, model, f"a tensor ending at the last byte of a {bucket}-byte bucket",
                        bucket_bytes=bucket, combo=combo)
    e = update.entry(edge)
    check.equal(e["offset"] + e["nbytes"], bucket, f"fixture precondition: {edge} ends on the boundary")


@pytest.mark.rule("BKT-SPLIT")
@pytest.mark.parametrize("combo", _params("BKT-SPLIT"))
def test_tensor_larger_than_a_bucket_in_every_mode(loader, publisher, combo):
    if combo["size"] == "large":
        model, bucket = M.spec(*LARGE["split-across-large"][1]), LARGE["split-across-large"][0]
    else:
        model, bucket = M.spec(("s.before", "float16", (7,)), ("s.big", "float32", (100, 5)), ("s.after", "uint8", (9,))), 512
    _roundtrip(loader, publisher, model, f"a tensor split over {bucket}-byte buckets", bucket_bytes=bucket, combo=combo)


@pytest.mark.rule("BKT-ALIGN-ODD")
@pytest.mark.parametrize("combo", _params("BKT-ALIGN-ODD"))
def test_odd_sized_tensor_then_wider_dtypes_in_every_mode(loader, publisher, combo):
    model = M.spec(("o.mask", "uint8", (3,)), ("o.w", "bfloat16", (5, 3)), ("o.f8", "float8_e4m3fn", (7,)),
                   ("o.x", "float32", (3,)))
    _roundtrip(loader, publisher, model, "uint8[3] then bf16, fp8, fp32", bucket_bytes=2048, combo=combo)


@pytest.mark.rule("BKT-LARGE")
@pytest.mark.parametrize("combo", _params("BKT-LARGE"))
def test_large_buckets_bit_exact_in_every_mode(loader, publisher, combo):
    bucket, params = LARGE["odd-sizes"]
    _roundtrip(loader, publisher, M.spec(*params), "odd sizes through 10 MiB buckets", bucket_bytes=bucket, combo=combo)


@pytest.mark.rule("BKT-ACK-AFTER-COPY")
@pytest.mark.parametrize("combo", _params("BKT-ACK-AFTER-COPY"))
def test_buffer_overwritten_on_ack_in_every_mode(loader, publisher, combo):
    """The trainer fills a buffer with 0xA5 the instant it is acked: every tensor still ends as it was sent."""
    model, bucket = _sized(M.spec(*((f"k.{i}", "float32", (32, 4)) for i in range(4))), combo)
    state = M.state(model, version=VERSION)
    pub, session, updates = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=bucket, wait_s=3.0,
                                   overwrite_on_ack=True, combo=combo)
    where = f"{pub.endpoint}: trainer fills each {bucket}-byte buffer with 0xA5 when it is acked ({R.label(combo)})"
    acked = len(pub.replies("ack"))  # those of the earlier updates
    session.update()
    check.params_equal(session.observe(), state, where)
    pub.wait(5.0)
    acks = [(m.get("proto"), m.get("version"), m.get("bucket")) for m in pub.replies("ack")[acked:]]
    check.equal(acks, [(1, VERSION, k) for k in range(len(updates[0].buckets))], f"{where}: every ack, in order")


_POSITION_EDITS = {  # rule -> (edit of the entry at the position, match, extra names)
    "BKT-MANIFEST-MISMATCH": (lambda e, pos: e.update(nbytes=e["nbytes"] - 4), NBYTES, ()),
    "BKT-OFFSET-RANGE": (lambda e, pos: e.update(offset=POS_BUCKET), "out of range", ()),
    "BKT-MISALIGNED": (lambda e, pos: e.update(offset=e["offset"] + 1), "not aligned", ()),
    "BKT-DTYPE-UNKNOWN": (lambda e, pos: e.update(dtype="float4_e2m1fn"), "unknown dtype", ("float4_e2m1fn",)),
    # onto its neighbour in the same bucket: p.1 (first), p.3 (middle), p.7 (last)
    "BKT-OVERLAP": (lambda e, pos: e.update(offset={"first-of-first": 256, "middle-of-middle": 0,
                                                    "last-of-last": 256}[pos]), "overlap", ()),
}


@pytest.mark.rule("BKT-MANIFEST-MISMATCH")
@pytest.mark.parametrize("combo", _params("BKT-MANIFEST-MISMATCH"))
def test_manifest_disagreeing_with_data_in_every_mode(loader, publisher, combo):
    _position_case(loader, publisher, "BKT-MANIFEST-MISMATCH", combo)


@pytest.mark.rule("BKT-OFFSET-RANGE")
@pytest.mark.parametrize("combo", _params("BKT-OFFSET-RANGE"))
def test_offset_out_of_range_in_every_mode(loader, publisher, combo):
    _position_case(loader, publisher, "BKT-OFFSET-RANGE", combo)


@pytest.mark.rule("BKT-MISALIGNED")
@pytest.mark.parametrize("combo", _params("BKT-MISALIGNED"))
def test_misaligned_offset_rejected_in_every_mode(loader, publisher, combo):
    _position_case(loader, publisher, "BKT-MISALIGNED", combo)


@pytest.mark.rule("BKT-DTYPE-UNKNOWN")
@pytest.mark.parametrize("combo", _params("BKT-DTYPE-UNKNOWN"))
def test_unknown_dtype_rejected_in_every_mode(loader, publisher, combo):
    _position_case(loader, publisher, "BKT-DTYPE-UNKNOWN", combo)


@pytest.mark.rule("BKT-OVERLAP")
@pytest.mark.parametrize("combo", _params("BKT-OVERLAP"))
def test_overlapping_entries_rejected_in_every_mode(loader, publisher, combo):
    _position_case(loader, publisher, "BKT-OVERLAP", combo)


def _position_case(loader, publisher, rule, combo):
    edit, match, names = _POSITION_EDITS[rule]
    position = MODE_POSITION[combo["position"]]
    _pos_rejected(loader, publisher, position, lambda e: edit(e, position), match=match, names=list(names),
                  where=f"{rule} fault", combo=combo)


@pytest.mark.rule("BKT-UNKNOWN-NAME")
@pytest.mark.parametrize("combo", _params("BKT-UNKNOWN-NAME"))
def test_unknown_name_rejected_in_every_mode(loader, publisher, combo):
    """An entry for a name the model lacks (a draft-looking one when the draft model is there) at the position."""
    model = R.with_draft(POS_SPEC, combo)
    bad = R.judged("p.99", combo)
    k = {"first": 0, "middle": 1, "last": -1}[combo["position"]]

    def tamper(update):
        if combo["position"] == "first":
            update.buckets[0]["entries"].insert(0, {**update.buckets[0]["entries"][0], "name": bad})
            update.buckets[0]["entries"].pop(1)  # p.0's slot now announces the unknown name (p.0 is then missing too)
        else:
            update.buckets[k]["entries"][-1]["name"] = bad
        update.names = [e["name"] for b in update.buckets for e in b["entries"]]
        update.end.update(count=len(update.names), digest=B.digest(update.names))

    _rejected(loader, publisher, tamper, model=model, bucket_bytes=POS_BUCKET, match="not a parameter", names=[bad],
              where=f"entry for {bad}, which the model lacks ({combo['position']})", combo=combo)


@pytest.mark.rule("BKT-DUPLICATE")
@pytest.mark.parametrize("combo", _params("BKT-DUPLICATE"))
def test_duplicate_name_rejected_in_every_mode(loader, publisher, combo):
    """The first, a middle or the last tensor announced again in the last bucket (512-byte buckets)."""
    name = {"first": "embed.weight", "middle": "layers.0.mlp.weight", "last": "norm.bias"}[combo["position"]]

    def tamper(update):
        first = update.entry(name)
        _append(update, len(update.buckets) - 1, {k: first[k] for k in ("name", "dtype", "shape")}, b"\x01" * first["nbytes"])

    _rejected(loader, publisher, tamper, bucket_bytes=512, pack_bytes=None, match="duplicate", names=[name],
              where=f"{name} announced twice", combo=combo)


@pytest.mark.rule("BKT-CHUNKS")
@pytest.mark.parametrize("combo", _params("BKT-CHUNKS"))
def test_split_chunks_in_every_mode(loader, publisher, combo):
    """Small: chunk 1 of c.big one byte off (refused); large: a tensor of 8 MiB + 12345 bytes in two chunks loads."""
    if combo["size"] == "large":
        bucket, params = LARGE["split-across-large"]
        _roundtrip(loader, publisher, M.spec(*params), "chunks of an 8 MiB + 12345-byte tensor", bucket_bytes=bucket,
                   combo=combo)
        return

    def tamper(update):
        update.entry("c.big", 1)["chunk_offset"] += 1

    _rejected(loader, publisher, tamper, model=M.spec(("c.big", "float32", (300,))), bucket_bytes=512,
              match="chunk_offset", names=["c.big"], where="chunk 1 of c.big one byte off", combo=combo)


@pytest.mark.rule("BKT-VERSION")
@pytest.mark.parametrize("combo", _params("BKT-VERSION"))
def test_version_must_not_change_in_every_mode(loader, publisher, combo):
    def tamper(update):
        for manifest in update.buckets[1:]:
            manifest["version"] = VERSION + 1

    _rejected(loader, publisher, tamper, bucket_bytes=512, match=f"version is {VERSION + 1}.*{VERSION}",
              names=[str(VERSION + 1), "bucket 1"], where=f"version {VERSION} then {VERSION + 1}", combo=combo)


@pytest.mark.rule("BKT-END-CHECK")
@pytest.mark.parametrize("combo", _params("BKT-END-CHECK"))
def test_end_message_must_match_in_every_mode(loader, publisher, combo):
    _rejected(loader, publisher, _end_tamper("count", "one-fewer"), bucket_bytes=512, match="count",
              names=["count", f"version {VERSION}"], where="end message with a count one too few", combo=combo)


@pytest.mark.rule("BKT-REPEAT")
@pytest.mark.parametrize("combo", _params("BKT-REPEAT"))
def test_consecutive_updates_in_every_mode(loader, publisher, combo):
    """The update under test (the second or the third of the session, healthy ones of the same version before it)
    leaves exactly its own values, main and draft."""
    _roundtrip(loader, publisher, SPEC, "an update after earlier ones of the same version", bucket_bytes=512,
               combo=combo)


@pytest.mark.rule("BKT-ABORT")
@pytest.mark.parametrize("combo", _params("BKT-ABORT", "status"))
def test_trainer_abort_in_every_mode(loader, publisher, combo):
    k = {"before-first": 0, "mid": 1, "after-last": 3}[combo["phase"]]
    state = M.state(SPEC, version=VERSION)
    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=256, fault=("abort", k), combo=combo)
    where = f"{pub.endpoint}: abort instead of {'the end' if k == 3 else f'bucket {k}'} ({R.label(combo)})"
    finished, error, elapsed = _bounded(session.update, 4.0)
    check.that(finished and elapsed < 1.5, f"{where}: update() took {elapsed:.2f}s (finished {finished})")
    check.that(error is not None and f"bucket {k}" in str(error), f"{where}: error {error!r} must name bucket {k}")
    check.not_loaded(session.observe(), NAMES, where)
    check.status_not(session, "NORMAL", where)


@pytest.mark.rule("BKT-DONE-AFTER-COMMIT")
@pytest.mark.parametrize("combo", _params("BKT-DONE-AFTER-COMMIT"))
def test_done_only_after_commit_in_every_mode(loader, publisher, combo):
    state = M.state(SPEC, version=VERSION)
    pub, session, updates = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=256, wait_s=3.0, combo=combo)
    where = f"{pub.endpoint}: what the trainer is told after an applied update ({R.label(combo)})"
    told = len(pub.received)
    session.update()
    check.params_equal(session.observe(), state, where)
    pub.wait(5.0)
    kinds = [m.get("type") for m in pub.received[told:]]
    check.equal(kinds, ["hello"] + ["ack"] * len(updates[0].buckets) + ["done"], f"{where}: messages in order")
    check.equal([(m.get("version"), m.get("count")) for m in pub.replies("done")][-1:], [(VERSION, len(state))],
                f"{where}: (version, count) of the done")


@pytest.mark.rule("BKT-ERROR-REPORTED")
@pytest.mark.parametrize("combo", _params("BKT-ERROR-REPORTED"))
def test_error_reported_to_trainer_in_every_mode(loader, publisher, combo):
    """A dtype outside the wire's list in bucket 0, 1 or 2 (first, middle, last): the worker's last message is an
    error naming that bucket, after acks of the buckets before it only."""
    bucket = {"first": 0, "middle": 1, "last": 2}[combo["position"]]

    def tamper(update):
        update.buckets[bucket]["entries"][0]["dtype"] = "float4_e2m1fn"

    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, M.state(SPEC, version=VERSION))], bucket_bytes=256,
                             tamper=tamper, wait_s=3.0, combo=combo)
    where = f"{pub.endpoint}: rejected at bucket {bucket} ({R.label(combo)})"
    told = len(pub.received)
    with check.raises(ValueError, match="float4_e2m1fn", where=where):
        session.update()
    try:
        pub.wait(5.0)
    except TimeoutError:
        pass
    kinds = [m.get("type") for m in pub.received[told:]]
    check.that(kinds and kinds[-1] == "error" and "done" not in kinds and kinds.count("ack") == bucket,
               f"{where}: messages {kinds}: acks of the {bucket} buckets before it, then an error")
    err = pub.replies("error")[-1]
    check.equal((err.get("version"), err.get("bucket")), (VERSION, bucket), f"{where}: (version, bucket) of the error")


@pytest.mark.rule("BKT-STATUS-UPDATING")
@pytest.mark.parametrize("combo", _params("BKT-STATUS-UPDATING", "status"))
def test_status_updating_while_buckets_arrive_in_every_mode(loader, publisher, combo):
    state = M.state(SPEC, version=VERSION)
    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=256, hold_before=1, combo=combo)
    where = f"{pub.endpoint}: status() while the trainer holds bucket 1 ({R.label(combo)})"
    out = {}
    runner = threading.Thread(target=lambda: out.update(done=_bounded(session.update, 5.0)), daemon=True)
    runner.start()
    try:
        check.that(pub.holding.wait(5.0), f"{where}: the worker never acknowledged bucket 0")
        check.status_is(session, "UPDATING", where)
    finally:
        pub.release.set()
    runner.join(6.0)
    finished, error, _ = out.get("done", (False, None, 0))
    check.that(finished and error is None, f"{where}: after the release the update must succeed, got {error!r}")
    check.status_is(session, "NORMAL", f"{where}: after the update")


@pytest.mark.rule("BKT-RECOVERY")
@pytest.mark.parametrize("combo", _params("BKT-RECOVERY", "status"))
def test_recovery_after_failed_update_in_every_mode(loader, publisher, combo):
    """A rejected update (a misplaced entry in bucket 1), then clear() and a healthy one, main and draft."""
    model = R.with_draft(SPEC, combo)
    bad, good = M.state(model, seed=1, version=VERSION), M.state(model, seed=2, version=VERSION)

    def tamper(update):
        update.buckets[1]["entries"][0]["offset"] = 8

    pub, session, _ = _serve(loader, publisher, model, [(VERSION, bad), (VERSION, good)], bucket_bytes=256,
                             tamper=tamper, combo=combo)
    where = f"{pub.endpoint}: update rejected at bucket 1, then clear() and a healthy update ({R.label(combo)})"
    with check.raises(Exception, match="bucket 1", where=where):
        session.update()
    check.status_not(session, "NORMAL", where)
    session.clear()
    session.update()
    check.params_equal(session.observe(), good, where)


@pytest.mark.rule("BKT-ATOMIC")
@pytest.mark.parametrize("combo", _params("BKT-ATOMIC", "status"))
def test_rejected_update_changes_nothing_in_every_mode(loader, publisher, combo):
    """The first, a middle or the last bucket refused (its entry of the wrong dtype), main and draft: nothing of the
    buckets before it is adopted."""
    model = R.with_draft(SPEC, combo)
    state = M.state(model, version=VERSION)

    def tamper(update):
        k = {"first": 0, "middle": len(update.buckets) // 2, "last": len(update.buckets) - 1}[combo["position"]]
        e = update.buckets[k]["entries"][0]
        e["dtype"] = {"float32": "int32", "bfloat16": "float16", "float16": "bfloat16"}[e["dtype"]]  # same itemsize
        tamper.name = e["name"]

    pub, session, _ = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=256, tamper=tamper, combo=combo)
    where = f"{pub.endpoint}: update refused at the {combo['position']} bucket ({tamper.name}; {R.label(combo)})"
    before = session.observe()
    with check.raises(TypeError, match=re.escape(tamper.name), where=where):
        session.update()
    check.unchanged(before, session.observe(), where)
    check.not_loaded(session.observe(), list(state), where)
    check.status_not(session, "NORMAL", where)
