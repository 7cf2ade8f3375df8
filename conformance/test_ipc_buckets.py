"""ipc_bucket: flat uint8 buckets announced by msgpack manifests over ZMQ. Spec: SPEC.md § BKT.

The trainer is fixtures.buckets.Publisher, serving from a thread on a private ipc:// endpoint; tests
tamper with its manifests (plain dicts) before serving them. Buckets are tiny (512-1024 bytes).
"""
import os
import threading
import time

import pytest

from conformance import check
from fixtures import buckets as B
from fixtures import models as M

pytestmark = pytest.mark.buckets

SPEC = M.spec(("embed.weight", "bfloat16", (8, 16)), ("layers.0.mlp.weight", "float32", (4, 8)), ("norm.bias", "float16", (16,)))
NAMES = [p.name for p in SPEC.all_params]
VERSION = 3


@pytest.fixture
def publisher():
    made = []

    def make(bucket_bytes: int = 1024) -> B.Publisher:
        made.append(B.Publisher(bucket_bytes))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _serve(loader, publisher, model, states, *, bucket_bytes=1024, version=VERSION, tamper=None, timeout_s=2.0, **serve):
    """Serve ``states`` (one update each) and open a worker expecting ``version``."""
    pub = publisher(bucket_bytes)
    updates = [B.pack(st, v, bucket_bytes) for v, st in states]
    if tamper:
        tamper(updates[0])
    pub.serve(*updates, **serve)
    session = loader.open(model, strategy="ipc_bucket", options=pub.options(version, timeout_s))
    return pub, session, updates


def _roundtrip(loader, publisher, model, where, *, bucket_bytes=1024, **serve):
    state = M.state(model, version=VERSION)
    pub, session, updates = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=bucket_bytes, **serve)
    session.update()
    check.params_equal(session.observe(), state, f"{pub.endpoint}: {where}")
    return updates[0]


def _rejected(loader, publisher, tamper, *, match, names=(), where, exc=ValueError, model=SPEC, bucket_bytes=1024):
    state = M.state(model, version=VERSION)
    pub, session, _ = _serve(loader, publisher, model, [(VERSION, state)], bucket_bytes=bucket_bytes, tamper=tamper)
    where = f"{pub.endpoint}: {where}"
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
def test_every_dtype_roundtrips_bitwise(loader, publisher):
    dtypes = ["bfloat16", "float16", "float32", "int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"]
    model = M.spec(*((f"t.w_{d}", d, (3, 5)) for d in dtypes))
    update = _roundtrip(loader, publisher, model, "8 dtypes in 512-byte buckets", bucket_bytes=512)
    check.that(len(update.buckets) > 1, f"fixture precondition: expected several buckets, got {len(update.buckets)}")


@pytest.mark.rule("BKT-EMPTY-SCALAR")
@pytest.mark.requires("ipc.buckets")
def test_empty_and_scalar_tensors(loader, publisher):
    model = M.spec(("a.w_empty", "float32", (0, 4)), ("a.w_scalar", "bfloat16", ()), ("a.w_vec", "float32", (3,)),
                   ("a.w_scalar_i", "int64", ()))
    _roundtrip(loader, publisher, model, "a (0, 4) tensor and 0-d tensors")


@pytest.mark.rule("BKT-BOUNDARY")
@pytest.mark.requires("ipc.buckets")
def test_tensor_ending_on_bucket_boundary(loader, publisher):
    # 256 + 256 bytes fill a 512-byte bucket exactly; then 512 bytes fill the next one alone.
    model = M.spec(("b.first", "float32", (64,)), ("b.edge", "float16", (128,)), ("b.whole", "float32", (128,)),
                   ("b.after", "bfloat16", (4,)))
    update = _roundtrip(loader, publisher, model, "tensors ending at byte 512 of a 512-byte bucket", bucket_bytes=512)
    edges = [e["name"] for b in update.buckets for e in b["entries"] if e["offset"] + e["nbytes"] == 512]
    check.equal(edges, ["b.edge", "b.whole"], "fixture precondition: tensors ending on the boundary")


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
def test_buffer_overwritten_on_ack(loader, publisher):
    model = M.spec(*((f"k.{i}", "float32", (32, 4)) for i in range(4)))  # 512 bytes each: one per bucket
    update = _roundtrip(loader, publisher, model, "trainer fills each buffer with 0xA5 when it is acked",
                        bucket_bytes=512, overwrite_on_ack=True)
    check.that(len(update.buckets) == 4, f"fixture precondition: 4 buckets, got {len(update.buckets)}")


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


@pytest.mark.rule("BKT-MANIFEST-MISMATCH")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize(
    "field,exc,match",
    [("nbytes", ValueError, "nbytes"), ("dtype", TypeError, "Type mismatch for layers.0.mlp.weight"),
     ("shape", ValueError, "Shape mismatch for layers.0.mlp.weight")],
)
def test_manifest_disagreeing_with_data_or_model(loader, publisher, field, exc, match):
    def tamper(update):
        e = update.entry("layers.0.mlp.weight")  # float32 (4, 8): 128 bytes
        if field == "nbytes":
            e["nbytes"] = 64  # short, so that a worker trusting it writes inside the tensor
        elif field == "dtype":
            e["dtype"], e["shape"], e["nbytes"] = "float16", [4, 16], 128
        else:
            e["shape"] = [8, 4]

    _rejected(loader, publisher, tamper, exc=exc, match=match, names=["layers.0.mlp.weight"],
              where=f"manifest {field} disagrees")


@pytest.mark.rule("BKT-OFFSET-RANGE")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("offset,case", [(1280, "past-end"), (768, "straddling")])
def test_offset_out_of_range(loader, publisher, offset, case):
    model = M.spec(("r.a", "float32", (64,)), ("r.b", "float32", (128,)))  # 256 + 512 bytes, one 1024-byte bucket

    def tamper(update):
        update.entry("r.b")["offset"] = offset  # 512 bytes at 1280 (past the end) or at 768 (ending at 1280)

    _rejected(loader, publisher, tamper, model=model, match="out of range", names=["r.b"],
              where=f"r.b at offset {offset} of a 1024-byte buffer ({case})")


@pytest.mark.rule("BKT-OVERLAP")
@pytest.mark.requires("ipc.buckets")
def test_overlapping_entries_rejected(loader, publisher):
    def tamper(update):
        a, b = update.entry("embed.weight"), update.entry("layers.0.mlp.weight")
        b["offset"] = a["offset"]  # both at 0, same bucket

    _rejected(loader, publisher, tamper, match="overlap", names=["embed.weight", "layers.0.mlp.weight"],
              where="two entries at offset 0")


@pytest.mark.rule("BKT-MISALIGNED")
@pytest.mark.requires("ipc.buckets")
def test_misaligned_offset_rejected(loader, publisher):
    def tamper(update):
        e = update.entry("layers.0.mlp.weight")  # at 256
        e["offset"] += 8

    _rejected(loader, publisher, tamper, match="not aligned", names=["layers.0.mlp.weight", "264"],
              where="entry at offset 264")


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


@pytest.mark.rule("BKT-CHUNKS")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", ["gap", "out-of-order"])
def test_split_chunks_contiguous_in_order(loader, publisher, case):
    model = M.spec(("c.big", "float32", (300,)))  # 1200 bytes in 512-byte buckets: chunks 512, 512, 176

    def tamper(update):
        c0, c1, c2 = (update.entry("c.big", i) for i in range(3))
        if case == "gap":
            c1["chunk_offset"] += 8
        else:  # swap what buckets 1 and 2 carry: chunk 2 arrives before chunk 1
            update.buckets[1], update.buckets[2] = update.buckets[2], update.buckets[1]
            update.writes[1], update.writes[2] = update.writes[2], update.writes[1]
            update.buckets[1]["bucket"], update.buckets[2]["bucket"] = 1, 2

    _rejected(loader, publisher, tamper, model=model, bucket_bytes=512, match="chunk_offset", names=["c.big"],
              where=f"chunks of c.big: {case}")


@pytest.mark.rule("BKT-VERSION")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("case", ["changes-mid-update", "not-the-expected"])
def test_version_must_not_change(loader, publisher, case):
    def tamper(update):
        for k, manifest in enumerate(update.buckets):
            if case == "not-the-expected" or k >= 1:
                manifest["version"] = VERSION + 1
        update.end["version"] = VERSION + 1 if case == "not-the-expected" else VERSION

    _rejected(loader, publisher, tamper, bucket_bytes=512, match=f"version is {VERSION + 1}.*{VERSION}", names=[str(VERSION + 1)],
              where=f"version {VERSION} then {VERSION + 1} ({case})")


@pytest.mark.rule("BKT-END-CHECK")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("field", ["count", "digest"])
def test_end_message_must_match(loader, publisher, field):
    def tamper(update):
        if field == "count":
            update.end["count"] += 1
        else:
            update.end["digest"] = B.digest(list(reversed(update.names)))

    _rejected(loader, publisher, tamper, match=field, names=[field], where=f"end message with a wrong {field}")


@pytest.mark.rule("BKT-REPEAT")
@pytest.mark.requires("ipc.buckets")
def test_three_updates_in_a_row(loader, publisher):
    states = [(v, M.state(SPEC, version=v)) for v in (1, 2, 3)]
    pub, _, _ = _serve(loader, publisher, SPEC, states, bucket_bytes=512)
    session = loader.open(SPEC, strategy="ipc_bucket", options=pub.options(None))
    for v, want in states:
        if v > 1:
            session.clear()
        session.update()
        check.params_equal(session.observe(), want, f"{pub.endpoint}: update {v} of 3 (version {v})")


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


@pytest.mark.rule("BKT-TIMEOUT")
@pytest.mark.requires("ipc.buckets")
def test_dead_trainer_is_a_timeout(loader, publisher):
    state = M.state(SPEC, version=VERSION)
    pub, session, updates = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=512, timeout_s=0.5,
                                   die_before=1)
    where = f"{pub.endpoint}: trainer gone after bucket 0 of {len(updates[0].buckets)}, timeout_s 0.5"
    finished, error, elapsed = _bounded(session.update, 4.0)
    check.that(finished, f"{where}: update() still blocked after {elapsed:.1f}s (expected TimeoutError within 2s)")
    check.that(isinstance(error, TimeoutError),
               f"{where}: expected TimeoutError, got {type(error).__name__ if error else 'no error'}: {error}")
    check.that(elapsed <= 2.0, f"{where}: raised after {elapsed:.2f}s, expected within 2s")
    missing = [s for s in ("bucket 1", f"version {VERSION}") if s not in str(error)]
    check.that(not missing, f"{where}: error {str(error)!r} does not name {missing}")
    check.not_loaded(session.observe(), NAMES, where)


@pytest.mark.rule("BKT-ATOMIC")
@pytest.mark.requires("ipc.buckets", "status")
@pytest.mark.parametrize("case", ["second-bucket", "end-message", "missing-parameter"])
def test_rejected_update_changes_nothing(loader, publisher, case):
    state = M.state(SPEC, version=VERSION)
    if case == "missing-parameter":
        sent = {n: a for n, a in state.items() if n != "norm.bias"}
        pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, sent)], bucket_bytes=512)
    else:
        def tamper(update):
            if case == "second-bucket":
                update.buckets[1]["entries"][0]["offset"] += 8
            else:
                update.end["count"] -= 1

        pub, session, updates = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=512, tamper=tamper)
    where = f"{pub.endpoint}: update rejected ({case})"
    before = session.observe()
    exc, match = (RuntimeError, "norm.bias") if case == "missing-parameter" else (ValueError, "bucket|count")
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

    _rejected(loader, publisher, tamper, match="msgpack", where="trainer replies to hello with a pickle")
    check.that(not marker.exists(), f"{marker}: created, so the worker unpickled the trainer's message")


def _mapped(names) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if any(n in line for n in names)]


def _ours() -> set[str]:
    prefix = f"wscf_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


@pytest.mark.rule("BKT-NO-LEAK")
@pytest.mark.requires("ipc.buckets")
@pytest.mark.parametrize("outcome", ["applied", "rejected"])
def test_no_mapping_or_segment_left(loader, publisher, outcome):
    existing = _ours()
    state = M.state(SPEC, version=VERSION)

    def tamper(update):
        if outcome == "rejected":
            update.end["digest"] = "0" * 64

    pub, session, _ = _serve(loader, publisher, SPEC, [(VERSION, state)], bucket_bytes=512, tamper=tamper)
    where = f"{pub.endpoint}: after an update that was {outcome}"
    if outcome == "applied":
        session.update()
    else:
        with check.raises(ValueError, match="digest", where=where):
            session.update()
    names = pub.segment_names
    pub.close()  # the trainer unmaps and unlinks its buffers: any mapping left is the worker's
    left = _mapped(names)
    check.that(not left, f"{where}: the worker still maps the trainer's buffers: {left}")
    leaked = sorted(_ours() - existing)
    check.that(not leaked, f"{where}: /dev/shm still holds {leaked} after the trainer closed")
