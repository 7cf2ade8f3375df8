"""The reference's own error and warning messages, pinned word for word.

The conformance suite judges an implementation's errors by type and by what they name (the file,
tensor, rank, field at fault), never by their prose: another implementation may word them as it
likes. The reference's messages are part of the product all the same (users read them, and a wrong
type name, a wrong index or "None" where the version belongs misleads), so this project test drives
the reference function that raises each message with inputs built here (plain dicts as the bucket
wire decodes them, directory listings, files written with ``fixtures/`` writers) and compares the
whole text and the exception type. mutmut runs this file too (``[tool.mutmut]``), so a mutant that
only changes a message's wording is killed here instead of being justified as out of scope.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
from types import SimpleNamespace

import pytest

from fixtures import buckets as FB
from wire.protocol import ABORT, ALIGN, HANDLE_SIZE, PROTO, ManifestError
from reference import bucket_checks as C
from reference import snapshot_plan as P
from reference.errors import MetaError, SnapshotNotAFileError

W = "ipc_bucket manifest for bucket 0 of version 3"  # a `where` as validate_bucket builds it


def state(version=None, known=("a", "b", "c"), **fields) -> C.UpdateState:
    return C.UpdateState(known=frozenset(known), version=version, **fields)


def entry(name="a", dtype="float32", shape=(4,), offset=0, nbytes=16, chunk_offset=0, total=None) -> C.Entry:
    return C.Entry(name, dtype, tuple(shape), offset, nbytes, chunk_offset, nbytes if total is None else total)


def raw_entry(**over) -> dict:
    """One manifest entry as msgpack decodes it (lists, not tuples)."""
    raw = {"name": "a", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not MISSING}


def manifest(**over) -> dict:
    message = {"type": "bucket", "proto": PROTO, "version": 3, "bucket": 0, "handle": b"h" * HANDLE_SIZE,
               "entries": [raw_entry()]}
    message.update(over)
    return {k: v for k, v in message.items() if v is not MISSING}


def end(order=(), **over) -> dict:
    message = {"type": "end", "proto": PROTO, "version": 3, "buckets": 0, "count": len(order),
               "digest": FB.digest(order)}
    message.update(over)
    return {k: v for k, v in message.items() if v is not MISSING}


MISSING = object()


def admitted(*buckets_entries, version=3) -> C.UpdateState:
    """The state after the receiver admitted these buckets (each a list of entries), in order."""
    s = state(version)
    for index, entries in enumerate(buckets_entries):
        s.admit(C.Bucket(version, index, b"h" * HANDLE_SIZE, tuple(entries)))
    return s


def raises(exc_type, call, expected: str) -> None:
    with pytest.raises(exc_type) as excinfo:
        call()
    assert type(excinfo.value) is exc_type
    assert str(excinfo.value) == expected


# -- reference.bucket_checks.UpdateState.where ------------------------------------------------------

@pytest.mark.parametrize("s, bucket, expected", [
    (state(None), None, "bucket 0 of version ?"),
    (state(7, next_bucket=2), None, "bucket 2 of version 7"),
    (state(7, next_bucket=2), 5, "bucket 5 of version 7"),
    (state(None, next_bucket=1), 4, "bucket 4 of version ?"),
])
def test_update_state_where(s, bucket, expected):
    assert s.where(bucket) == expected


# -- reference.bucket_checks.check_version ------------------------------------------------------------

@pytest.mark.parametrize("next_bucket, what", [
    (0, "announced"),
    (1, "used by the earlier buckets"),
    (3, "used by the earlier buckets"),
])
def test_check_version(next_bucket, what):
    raises(ManifestError, lambda: C.check_version(9, state(4, next_bucket=next_bucket), W),
           f"{W}: field version is 9, but the update's version is 4 ({what}); a version may not change mid-update")


def test_check_version_accepts_the_same_or_a_first_version():
    C.check_version(4, state(4, next_bucket=2), W)
    C.check_version(9, state(None), W)


# -- reference.bucket_checks.parse_entry --------------------------------------------------------------

AT = f"{W}, tensor 'a'"


@pytest.mark.parametrize("raw, expected", [
    ([1, 2], f"{W}: entry is a list, expected a map"),
    (None, f"{W}: entry is a NoneType, expected a map"),
    ("a", f"{W}: entry is a str, expected a map"),
    (raw_entry(name=MISSING), f"{W}: field name is missing (a non-empty str)"),
    (raw_entry(name=""), f"{W}: field name is '', expected a non-empty str"),
    (raw_entry(name=7), f"{W}: field name is 7, expected a non-empty str"),
    (raw_entry(dtype=MISSING), f"{AT}: field dtype is missing (a dtype name (str))"),
    (raw_entry(dtype=4), f"{AT}: field dtype is 4, expected a dtype name (str)"),
    (raw_entry(shape=MISSING), f"{AT}: field shape is missing (a list of non-negative ints)"),
    (raw_entry(shape=[2, -1]), f"{AT}: field shape is [2, -1], expected a list of non-negative ints"),
    (raw_entry(shape=(4,)), f"{AT}: field shape is (4,), expected a list of non-negative ints"),
    (raw_entry(offset=MISSING), f"{AT}: field offset is missing (a non-negative int)"),
    (raw_entry(offset=-256), f"{AT}: field offset is -256, expected a non-negative int"),
    (raw_entry(nbytes=MISSING), f"{AT}: field nbytes is missing (a non-negative int)"),
    (raw_entry(nbytes=True), f"{AT}: field nbytes is True, expected a non-negative int"),
    (raw_entry(chunk_offset=-1), f"{AT}: field chunk_offset is -1, expected a non-negative int"),
    (raw_entry(chunk_offset=None), f"{AT}: field chunk_offset is None, expected a non-negative int"),
    (raw_entry(total_nbytes=-16), f"{AT}: field total_nbytes is -16, expected a non-negative int"),
    (raw_entry(total_nbytes=1.5), f"{AT}: field total_nbytes is 1.5, expected a non-negative int"),
])
def test_parse_entry(raw, expected):
    raises(ManifestError, lambda: C.parse_entry(raw, W), expected)


# -- reference.bucket_checks.parse_bucket -------------------------------------------------------------

@pytest.mark.parametrize("s, message, expected", [
    (state(None), manifest(proto=MISSING),
     f"ipc_bucket manifest for bucket 0 of version ?: field proto is missing (protocol {PROTO})"),
    (state(3, next_bucket=2), manifest(proto=PROTO + 1),
     f"ipc_bucket manifest for bucket 2 of version 3: field proto is {PROTO + 1}, expected protocol {PROTO}"),
    (state(None), manifest(version=MISSING),
     "ipc_bucket manifest for bucket 0 of version ?: field version is missing (an int)"),
    (state(None), manifest(version="3"),
     "ipc_bucket manifest for bucket 0 of version ?: field version is '3', expected an int"),
    (state(5), manifest(version=3),
     "ipc_bucket manifest for bucket 0 of version 5: field version is 3, but the update's version is 5 "
     "(announced); a version may not change mid-update"),
    (state(None), manifest(bucket=MISSING),
     "ipc_bucket manifest for bucket 0 of version 3: field bucket is missing (an int)"),
    (state(None), manifest(bucket=0.0),
     "ipc_bucket manifest for bucket 0 of version 3: field bucket is 0.0, expected an int"),
    (state(None), manifest(bucket=1),
     "ipc_bucket manifest for bucket 0 of version 3: field bucket is 1, expected 0 (buckets come in order)"),
    (state(None), manifest(handle=MISSING),
     f"ipc_bucket manifest for bucket 0 of version 3: field handle is missing ({HANDLE_SIZE} bytes (an IPC handle))"),
    (state(None), manifest(handle=b"xy"),
     f"ipc_bucket manifest for bucket 0 of version 3: field handle is b'xy', expected {HANDLE_SIZE} bytes "
     "(an IPC handle)"),
    (state(None), manifest(entries=MISSING),
     "ipc_bucket manifest for bucket 0 of version 3: field entries is missing (a list of entries)"),
    (state(None), manifest(entries={"a": 1}),
     "ipc_bucket manifest for bucket 0 of version 3: field entries is {'a': 1}, expected a list of entries"),
    (state(None), manifest(entries=[raw_entry(), 5]),
     "ipc_bucket manifest for bucket 0 of version 3: entry is a int, expected a map"),
])
def test_parse_bucket(s, message, expected):
    raises(ManifestError, lambda: C.parse_bucket(message, s), expected)


def test_parse_bucket_accepts_a_well_formed_manifest():
    bucket = C.parse_bucket(manifest(), state(None))
    assert bucket.entries == (entry(),)


# -- reference.bucket_checks.check_name_text ----------------------------------------------------------

@pytest.mark.parametrize("name, index", [("a\0b\0c", 1), ("\0", 0), ("xyz\0", 3)])
def test_check_name_text(name, index):
    raises(ManifestError, lambda: C.check_name_text(entry(name), W),
           f"{W}, tensor {name!r}: field name holds a NUL character at index {index} "
           "(NUL ends each name in the end message's digest; a name may not contain one)")


# -- reference.bucket_checks.check_dtype --------------------------------------------------------------

def test_check_dtype():
    from wire.protocol import DTYPES
    raises(ManifestError, lambda: C.check_dtype(entry(dtype="complex64"), W),
           f"{W}, tensor 'a': unknown dtype 'complex64' (field dtype); known: {sorted(DTYPES)}")


# -- reference.bucket_checks.check_nbytes -------------------------------------------------------------

@pytest.mark.parametrize("e, expected", [
    (entry(shape=(4,), nbytes=12),
     f"{W}, tensor 'a': field nbytes is 12 but shape [4] of float32 needs 16 bytes (4 x 4)"),
    (entry(dtype="float16", shape=(2, 3), nbytes=8, total=8),
     f"{W}, tensor 'a': field nbytes is 8 but shape [2, 3] of float16 needs 12 bytes (6 x 2)"),
    (entry(shape=(4,), nbytes=8, total=20),
     f"{W}, tensor 'a': field total_nbytes is 20 but shape [4] of float32 needs 16 bytes (4 x 4)"),
    (entry(shape=(4,), nbytes=12, total=12, chunk_offset=4),
     f"{W}, tensor 'a': field total_nbytes is 12 but shape [4] of float32 needs 16 bytes (4 x 4)"),
    (entry(shape=(4,), nbytes=8, chunk_offset=12, total=16),
     f"{W}, tensor 'a': chunk of 8 bytes at chunk_offset 12 runs past the tensor's 16 bytes"),
])
def test_check_nbytes(e, expected):
    raises(ManifestError, lambda: C.check_nbytes(e, W), expected)


# -- reference.bucket_checks.check_ranges / check_alignment / check_overlaps / check_known ------------

def test_check_ranges():
    raises(ManifestError, lambda: C.check_ranges([entry(offset=ALIGN, nbytes=16)], ALIGN + 8, W),
           f"{W}, tensor 'a': offset {ALIGN} + nbytes 16 = {ALIGN + 16} is out of range of the {ALIGN + 8}-byte buffer")


@pytest.mark.parametrize("offset, by", [(ALIGN + 12, 12), (3 * ALIGN - 1, ALIGN - 1), (ALIGN // 2, ALIGN // 2)])
def test_check_alignment(offset, by):
    raises(ManifestError, lambda: C.check_alignment([entry(), entry("b", offset=offset)], W),
           f"{W}, tensor 'b': offset {offset} is not aligned to {ALIGN} bytes (misaligned by {by})")


def test_check_overlaps():
    raises(ManifestError, lambda: C.check_overlaps([entry("b", offset=0, nbytes=512, shape=(128,)),
                                                    entry("a", offset=256, nbytes=16)], W),
           f"{W}: tensors 'b' [0, 512) and 'a' [256, 272) overlap in the buffer")


def test_check_known():
    raises(ManifestError, lambda: C.check_known([entry("a"), entry("zz")], state(3), W),
           f"{W}, tensor 'zz': not a parameter of the model (field name)")


# -- reference.bucket_checks.check_unique -------------------------------------------------------------

def test_check_unique_twice_in_one_bucket():
    raises(ManifestError, lambda: C.check_unique([entry("a"), entry("b", offset=256), entry("a", offset=512)],
                                                 state(3), W),
           f"{W}, tensor 'a': duplicate name (already announced in this bucket)")


@pytest.mark.parametrize("earlier, first", [
    # completed in bucket 1 (the bucket index the receiver recorded)
    ([[entry("b")], [entry("a")]], "bucket 1"),
    # completed in bucket 0 and sent again as a continuation chunk
    ([[entry("a"), entry("b", offset=256)]], "bucket 0"),
    # started in bucket 0 but never completed, then restarted at chunk_offset 0: no completing bucket
    ([[entry("a", nbytes=8, total=16)]], "bucket ?"),
])
def test_check_unique_across_buckets(earlier, first):
    s = admitted(*earlier)
    chunk_offset = 8 if first == "bucket 0" else 0
    e = entry("a", nbytes=8, chunk_offset=chunk_offset, total=16) if chunk_offset else entry("a")
    where = f"ipc_bucket manifest for bucket {s.next_bucket} of version 3"
    raises(ManifestError, lambda: C.check_unique([e], s, where),
           f"{where}, tensor 'a': duplicate name (already announced in {first})")


# -- reference.bucket_checks.check_chunks -------------------------------------------------------------

@pytest.mark.parametrize("earlier, e, expected", [
    ([], entry("a", nbytes=8, chunk_offset=8, total=16),
     "tensor 'a': chunk_offset 8, expected 0 (chunks of a split tensor must be contiguous and in order)"),
    ([[entry("a", nbytes=8, total=16)]], entry("a", nbytes=4, chunk_offset=12, total=16),
     "tensor 'a': chunk_offset 12, expected 8 (chunks of a split tensor must be contiguous and in order)"),
    ([[entry("a", nbytes=8, total=16)]], entry("a", nbytes=4, chunk_offset=8, total=12),
     "tensor 'a': total_nbytes 12 differs from the 16 announced with its first chunk"),
])
def test_check_chunks(earlier, e, expected):
    s = admitted(*earlier)
    raises(ManifestError, lambda: C.check_chunks([e], s, W), f"{W}, {expected}")


# -- reference.bucket_checks.validate_end -------------------------------------------------------------

E3 = "ipc_bucket end message of version 3"


@pytest.mark.parametrize("s, message, expected", [
    (state(None), end(proto=MISSING), f"ipc_bucket end message of version ?: field proto is missing (protocol {PROTO})"),
    (state(None), end(version=MISSING), "ipc_bucket end message of version ?: field version is missing (an int)"),
    (state(3), end(proto="1"), f"{E3}: field proto is '1', expected protocol {PROTO}"),
    (state(3), end(version=MISSING), f"{E3}: field version is missing (an int)"),
    (state(3), end(version=None), f"{E3}: field version is None, expected an int"),
    (state(3, next_bucket=2), end(version=4),
     f"{E3}: field version is 4, but the update's version is 3 (used by the earlier buckets); "
     "a version may not change mid-update"),
    (state(3), end(buckets=MISSING), f"{E3}: field buckets is missing (an int)"),
    (state(3), end(buckets="0"), f"{E3}: field buckets is '0', expected an int"),
    (state(3), end(count=MISSING), f"{E3}: field count is missing (an int)"),
    (state(3), end(count=[0]), f"{E3}: field count is [0], expected an int"),
    (state(3), end(digest=MISSING), f"{E3}: field digest is missing (a sha256 hex str)"),
    (state(3), end(digest=b"00"), f"{E3}: field digest is b'00', expected a sha256 hex str"),
    (state(3), end(buckets=2), f"{E3}: field buckets is 2 but 0 bucket(s) arrived"),
])
def test_validate_end_fields(s, message, expected):
    raises(ManifestError, lambda: C.validate_end(message, s), expected)


def test_validate_end_count_and_digest():
    s = admitted([entry("a"), entry("b", offset=256)])
    raises(ManifestError, lambda: C.validate_end(end(["a", "b"], buckets=1, count=3), s),
           f"{E3}: field count is 3 but 2 tensor(s) arrived (2 of 3 sent)")
    wrong = FB.digest(["b", "a"])
    raises(ManifestError, lambda: C.validate_end(end(["a", "b"], buckets=1, digest=wrong), s),
           f"{E3}: field digest {wrong[:16]}... does not match the sha256 of the 2 names received "
           f"({FB.digest(['a', 'b'])[:16]}...)")
    C.validate_end(end(["a", "b"], buckets=1), s)  # the same message, right: no error


def test_validate_end_incomplete_split_tensors():
    s = admitted([entry("a", nbytes=8, total=16), entry("b", offset=256), entry("c", offset=512, nbytes=4, total=16)])
    raises(ManifestError, lambda: C.validate_end(end(["a", "b", "c"], buckets=1), s),
           f"{E3}: split tensor(s) incomplete: a (8/16 bytes), c (4/16 bytes)")


# -- reference.buckets.check_abort and commit --------------------------------------------------------

ENDPOINT = "ipc:///tmp/trainer.sock"


@pytest.mark.parametrize("message, reason", [
    ({"type": ABORT, "proto": PROTO, "version": 3, "message": "trainer out of memory"}, "trainer out of memory"),
    ({"type": ABORT, "proto": PROTO, "version": 3}, "(no reason given)"),
])
def test_check_abort(message, reason):
    from reference import buckets
    s = admitted([entry("a")])
    raises(RuntimeError, lambda: buckets.check_abort(message, ENDPOINT, s),
           f"ipc_bucket: the trainer at {ENDPOINT} aborted bucket 1 of version 3: {reason}")
    buckets.check_abort({"type": "bucket"}, ENDPOINT, s)  # anything but an abort passes


def _manager(names):
    from fixtures import models as M
    from reference import WeightManager
    spec = M.spec(*[(n, "float32", (2, 2)) for n in names])
    return WeightManager(M.build_models(spec), load_strategy="ipc_bucket", env={"FLAGS_selected_gpus": "0"},
                         options={"endpoint": ENDPOINT})


def test_commit_names_every_missing_parameter():
    from reference import buckets
    manager = _manager(["w1", "w2", "w3"])
    s = state(6, known=manager.params)
    raises(RuntimeError, lambda: buckets.commit(manager, s, buckets.Staging(manager.params), "trainer-x"),
           "ipc_bucket update of version 6 from trainer-x lacks 3 parameter(s): w1, w2, w3; "
           "0 of 3 parameter(s) arrived, nothing was applied")


# -- reference.commit.check_forward -------------------------------------------------------------------

def test_check_forward():
    from reference.commit import check_forward
    from reference.version_file import VersionError
    raises(VersionError, lambda: check_forward(4, 7, "rank 0"),
           "rank 0: version 4 is older than the version 7 this worker reports; nothing was loaded")


# -- reference.snapshot_plan.plan_snapshot, _require_file, entry_kind ---------------------------------

MODEL, SHARED = "/ckpt/model", "/dev/shm/shared"
BASE = "model_state.tp1.3"


def test_plan_snapshot_not_found():
    raises(FileNotFoundError, lambda: P.plan_snapshot(MODEL, ["other.pdparams"], SHARED, [], 1, 3),
           f"No snapshot found for {BASE}: checked {MODEL}/{BASE}.part*.pdparams, {MODEL}/{BASE}.pdparams, "
           f"{MODEL}/model_state.tp03.pdparams and {SHARED}/{BASE}.pdparams")


def _not_a_file(path, what, kind):
    return (f"{path}: the {what} snapshot candidate is a {kind}, not a regular file; refusing to fall through to a "
            "lower-priority snapshot level (its weights may be stale)")


@pytest.mark.parametrize("model_names, shared_names, path, what, kind", [
    ({f"{BASE}.part0.pdparams": P.FILE, f"{BASE}.part2.pdparams": "directory"}, {},
     f"{MODEL}/{BASE}.part2.pdparams", "part 2", "directory"),
    ({f"{BASE}.pdparams": "FIFO"}, {}, f"{MODEL}/{BASE}.pdparams", "single-file", "FIFO"),
    ({"model_state.tp03.pdparams": "dangling symlink"}, {}, f"{MODEL}/model_state.tp03.pdparams", "legacy",
     "dangling symlink"),
    ({}, {f"{BASE}.pdparams": "socket"}, f"{SHARED}/{BASE}.pdparams", "shared fallback", "socket"),
])
def test_plan_snapshot_not_a_file(model_names, shared_names, path, what, kind):
    raises(SnapshotNotAFileError, lambda: P.plan_snapshot(MODEL, model_names, SHARED, shared_names, 1, 3),
           _not_a_file(path, what, kind))


def test_entry_kind_names_what_the_entry_is(tmp_path):
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "f")
    (tmp_path / "r").write_bytes(b"x")
    os.symlink(tmp_path / "nowhere", tmp_path / "l")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        assert P.list_dir(str(tmp_path)) == {"d": "directory", "f": "FIFO", "r": P.FILE, "l": "dangling symlink",
                                             "s": "socket"}
    finally:
        sock.close()


def test_plan_snapshot_names_a_directory_where_the_file_belongs(tmp_path):
    (tmp_path / f"{BASE}.pdparams").mkdir()
    raises(SnapshotNotAFileError, lambda: P.plan_snapshot(str(tmp_path), P.list_dir(str(tmp_path)), SHARED, {}, 1, 3),
           _not_a_file(f"{tmp_path}/{BASE}.pdparams", "single-file", "directory"))


# -- reference.snapshot.update_from_snapshot ----------------------------------------------------------

def _snapshot_manager(model_dir, shared_dir):
    return SimpleNamespace(model_dir=model_dir, shared_dir=shared_dir, rank=1, gpu_id=3, params={},
                           landed_of_sent=lambda landed: f"{landed} of 0 parameter(s) landed")


@pytest.mark.parametrize("model_dir", [None, ""])
def test_update_from_snapshot_needs_model_dir(model_dir):
    from reference.snapshot import update_from_snapshot
    raises(ValueError, lambda: update_from_snapshot(_snapshot_manager(model_dir, "/nonexistent")),
           "ipc_snapshot needs model_dir (the directory holding model_state.tp{rank}.{id}* files)")


def test_update_from_snapshot_warns_of_invalid_part_names(tmp_path, caplog):
    from fixtures import snapshot as S
    from reference.snapshot import update_from_snapshot
    model_dir = str(tmp_path)
    for name in (f"{BASE}.partX.pdparams", f"{BASE}.part.pdparams", f"{BASE}.part1a.pdparams"):
        (tmp_path / name).write_bytes(b"")
    # The single file holds no tensors: the update fails after the warning, before any parameter is touched.
    S.write_zero_bytes(S.single_path(model_dir, 1, 3))
    caplog.set_level(logging.WARNING, logger="reference.snapshot")
    with pytest.raises(ValueError):
        update_from_snapshot(_snapshot_manager(model_dir, str(tmp_path / "none")))
    warnings = [r for r in caplog.records if r.name == "reference.snapshot" and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        f"Found snapshot part files with invalid naming pattern under {model_dir}: {BASE}.part.pdparams, "
        f"{BASE}.part1a.pdparams, {BASE}.partX.pdparams. These files will be ignored when loading IPC snapshot parts."
    ]


# -- reference.ipc_meta.read_metas and normalize_meta -------------------------------------------------

@pytest.mark.parametrize("obj, type_name", [([1, 2], "list"), ("metas", "str"), (None, "NoneType")])
def test_read_metas_not_a_dict(tmp_path, obj, type_name):
    from reference.ipc_meta import read_metas
    path = str(tmp_path / "ipc_metas_0")
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)
    raises(MetaError, lambda: read_metas(path), f"{path}: expected a dict of tensor name -> meta, found {type_name}")


def test_normalize_meta_wrong_types():
    from wire.handles import META_FIELDS
    from reference.ipc_meta import normalize_meta
    raises(MetaError, lambda: normalize_meta({"handle": b""}, name="w", device=0),
           f"IPC meta of tensor 'w' is a dict, expected a list of 7 fields {list(META_FIELDS)}")
    raises(MetaError, lambda: normalize_meta([12345, 0, 16, 10, [4], [], 0], name="w", device=0),
           "IPC meta of tensor 'w': field handle is a int, expected a latin-1 str or bytes")


# -- reference.identity.physical_gpu_id ---------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [
    ({"CUDA_VISIBLE_DEVICES": "0,GPU-5a1b", "FLAGS_selected_gpus": "1"},
     "CUDA_VISIBLE_DEVICES entry 1 is 'GPU-5a1b' (CUDA_VISIBLE_DEVICES='0,GPU-5a1b'); "
     "snapshot and IPC file names need a numeric physical GPU index, not a UUID"),
    ({"CUDA_VISIBLE_DEVICES": "2,3", "FLAGS_selected_gpus": "2"},
     "FLAGS_selected_gpus=2 is out of range for CUDA_VISIBLE_DEVICES='2,3' (2 entries)"),
    ({"FLAGS_selected_gpus": "-1"}, "FLAGS_selected_gpus='-1' is not a non-negative integer index"),
])
def test_physical_gpu_id(env, expected):
    from reference.errors import GpuIdError
    from reference.identity import physical_gpu_id
    raises(GpuIdError, lambda: physical_gpu_id(env), expected)


# -- reference.apply.check_match ----------------------------------------------------------------------

@pytest.mark.parametrize("source, where", [("", ""), ("/ckpt/part0.pdparams", " (from /ckpt/part0.pdparams)")])
def test_check_match(source, where):
    import paddle
    from reference.apply import check_match
    dst = paddle.zeros([2, 3], dtype="float32")
    raises(TypeError, lambda: check_match("w", "float16", [2, 3], dst, source),
           f"Type mismatch for w: float16 vs float32{where}")
    raises(ValueError, lambda: check_match("w", "float32", (3, 2), dst, source),
           f"Shape mismatch for w: [3, 2] vs [2, 3]{where}")


def test_check_match_default_source():
    import paddle
    from reference.apply import check_match
    raises(ValueError, lambda: check_match("w", "float32", (3,), paddle.zeros([2], dtype="float32")),
           "Shape mismatch for w: [3] vs [2]")


# -- reference.hooks.after_commit ---------------------------------------------------------------------

def test_after_commit_names_every_failed_hook():
    from reference.hooks import HookError, after_commit
    manager = _manager(["w1"])
    ran = []

    def fails(exc):
        def hook():
            ran.append(exc)
            raise exc
        return hook

    manager.hooks.register("kv_cache", fails(KeyError("layer 3")))
    manager.hooks.register("ok", lambda: ran.append("ok"))
    manager.hooks.register("graphs", fails(RuntimeError("capture failed")))
    raises(HookError, lambda: after_commit(manager),
           "stale-state hook(s) failed after the commit: kv_cache: KeyError: 'layer 3'; "
           "graphs: RuntimeError: capture failed; clear() and update() again")
    assert len(ran) == 3


# -- reference.manager.WeightManager.failed (several ranks failing one operation) ----------------------

def test_a_failing_rank_names_every_other_failing_rank(monkeypatch):
    from reference import agreement as A
    from reference.agreement import RankFailure
    manager = _manager(["w1"])
    votes = [A.Vote(0, 1, "update", False, "TypeError: mine"), A.Vote(1, 1, "update", True),
             A.Vote(2, 1, "update", False, "RuntimeError: no norm.bias"), A.Vote(3, 1, "update", False, "")]
    monkeypatch.setattr(manager.agreement, "vote", lambda what, ok, error="": votes)
    raised = manager.failed("update", TypeError("mine"))
    assert type(raised) is RankFailure
    assert str(raised) == ("rank 0: update failed on this rank (TypeError: mine) and on 2 other rank(s): "
                           "rank 2: RuntimeError: no norm.bias; rank 3: failed")
    monkeypatch.setattr(manager.agreement, "vote", lambda what, ok, error="": votes[:2])
    alone = TypeError("mine")
    assert manager.failed("update", alone) is alone  # no other rank failed: its own error, as it was


# -- reference.__getattr__ (the package's lazy exports) -----------------------------------------------

def test_package_exports_and_unknown_names():
    import reference
    from reference import manager, status
    assert reference.__getattr__("WeightManager") is manager.WeightManager
    assert reference.__getattr__("Status") is status.Status
    raises(AttributeError, lambda: reference.__getattr__("no_such_name"),
           "module 'reference' has no attribute 'no_such_name'")



# -- reference.snapshot_load: a safetensors header naming a tensor twice ---------------------------------------
def test_duplicate_header_names_are_each_named_once(tmp_path):
    """Names repeated (b and a, twice each) among one that is not (c): the error lists exactly the repeated
    ones, sorted."""
    from fixtures.files import write_raw
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import read_header

    info = '{"dtype": "F32", "shape": [1], "data_offsets": [%d, %d]}'
    header = "{" + ", ".join(f'"{n}": ' + info % (b, b + 4) for n, b in [("b", 0), ("a", 4), ("c", 8), ("b", 0), ("a", 4)]) + "}"
    path = write_raw(tmp_path / "model.safetensors", header.encode(), b"\0" * 12)
    raises(SnapshotFormatError, lambda: read_header(path),
           f"{path}: not a valid safetensors file: header names ['a', 'b'] more than once")


# -- reference.version_file: a version.yaml that is not a small regular file ------------------------------------
@pytest.mark.parametrize("entry, expected", [
    ("fifo", "is a FIFO, not a regular file"),
    ("directory", "is a directory, not a regular file"),
    ("link-to-dev-null", "is a character device, not a regular file"),  # a symlink is followed
    ("socket", "is a socket, not a regular file"),
    ("dangling-link", "is a dangling symlink, not a regular file"),
    ("one-past", "is over the 65536-byte limit (65537 bytes); it holds one small mapping (step: N)"),
    ("link-to-proc-self-mem", "cannot be read (Input/output error)"),  # a regular file whose read fails
])
def test_version_file_refused(tmp_path, entry, expected):
    from fixtures.version_entries import make_entry
    from reference.version_file import VersionError, read_version_bytes

    path = str(tmp_path / "version.yaml")
    make_entry(path, entry, 3)
    raises(VersionError, lambda: read_version_bytes(path), f"{path}: the version file {expected}")


def test_version_file_at_the_limit_absent_and_unexaminable(tmp_path):
    """Exactly 64 KiB is read whole; no entry is None (the update carries no version); a path under a file is
    refused with the OS's reason, naming the file."""
    from fixtures.version_entries import LIMIT, make_entry, padded
    from reference.version_file import VersionError, read_version_bytes

    path = str(tmp_path / "version.yaml")
    assert read_version_bytes(path) is None
    make_entry(path, "at-limit", 3)
    assert read_version_bytes(path) == padded(3, LIMIT)
    under = os.path.join(path, "version.yaml")
    raises(VersionError, lambda: read_version_bytes(under), f"{under}: the version file cannot be examined (Not a directory)")


# -- reference.snapshot_load: a file that shrinks or is replaced while it is read -------------------------------
def _bounded(call, timeout_s: float = 10.0):
    """``call()`` in a daemon thread: its result, or AssertionError if it has not ended within ``timeout_s``
    (a read loop that takes end of file for a short read turns forever)."""
    import threading

    box = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{call} did not end within {timeout_s:g} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_header_read_that_meets_the_end_of_the_file_names_where(tmp_path):
    """50 bytes on disk: 100 asked from offset 8 get 42, then nothing (the file shrank): the error names the
    offset the read had reached; a read of exactly the last byte is a read, not an end."""
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import _read_exact

    path = str(tmp_path / "model.safetensors")
    with open(path, "wb") as f:
        f.write(bytes(range(50)))
    fd = os.open(path, os.O_RDONLY)
    try:
        raises(SnapshotFormatError, lambda: _bounded(lambda: _read_exact(fd, 8, 100, path)),
               f"{path}: file changed during load: the read at offset 50 ended early (the file shrank)")
        assert _bounded(lambda: _read_exact(fd, 49, 1, path)) == bytes([49])
        assert _bounded(lambda: _read_exact(fd, 40, 10, path)) == bytes(range(40, 50))
    finally:
        os.close(fd)


def _two_tensor_file(path, extra: bool = False) -> str:
    import numpy as np

    from fixtures.snapshot import write_safetensors

    tensors = {"a": np.arange(4, dtype=np.float32), "b": np.arange(64, dtype=np.float32)}
    if extra:
        tensors["c"] = np.ones(8, dtype=np.float32)
    return write_safetensors(path, tensors)


def test_a_file_replaced_after_its_header_was_checked_is_named_before_any_read(tmp_path):
    """``read_header``'s result handed to the load, the file rewritten meanwhile (another layout): the load
    parses the file it has, finds it is not the one checked, and says so with both identities."""
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import _identity, iter_safetensors, read_header

    path = _two_tensor_file(str(tmp_path / "model.safetensors"))
    checked = read_header(path)
    assert [n for n, _ in iter_safetensors(path, expect=checked)] == ["a", "b"]  # unchanged: loads
    os.remove(path)
    _two_tensor_file(path, extra=True)
    now = _identity(os.stat(path))
    raises(SnapshotFormatError, lambda: list(iter_safetensors(path, expect=checked)),
           f"{path}: file changed during load: it is not the file whose header was checked before loading "
           f"(device, inode, size, mtime, ctime {checked.identity} then {now})")


def test_a_tensor_read_that_meets_the_end_of_the_file_names_the_tensor(tmp_path, monkeypatch):
    """The file cut inside tensor ``b``'s bytes once its header was read and checked: the error names ``b``."""
    from reference import snapshot_load as SL
    from reference.errors import SnapshotFormatError

    path = _two_tensor_file(str(tmp_path / "model.safetensors"))
    size = os.path.getsize(path)
    validated = SL._validated

    def then_cut(fd, at, expect):
        checked = validated(fd, at, expect)
        os.truncate(at, size - 100)  # inside b's 256 bytes, the last tensor
        return checked

    monkeypatch.setattr(SL, "_validated", then_cut)
    raises(SnapshotFormatError, lambda: _bounded(lambda: list(SL.iter_safetensors(path))),
           f"{path}: file changed during load: the read of tensor 'b' ended early (the file shrank)")


def test_control_answers_an_update_the_worker_failed():
    """The API's answer when the worker's failed update leaves the cell CLEARED (STATUS-FAILED-NOT-NORMAL)."""
    import threading
    import time

    from fixtures import status_cell as SC
    from reference.control import WeightControl

    with SC.Cell(SC.CLEARED) as cell:
        def worker():  # the worker fails the update and releases the weights
            deadline = time.monotonic() + 5.0
            while cell.read() != SC.UPDATING and time.monotonic() < deadline:
                time.sleep(0.001)
            cell.write(SC.CLEARED)

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        answer = WeightControl(cell.name, poll_s=0.001).update_model_weight(5.0)
        thread.join(5.0)
    assert answer == (500, "update model weight failed: the worker released the weights (status CLEARED)")


def test_release_after_a_failed_update_names_the_cell_and_the_rank():
    from fixtures import status_cell as SC
    from reference import worker_loop
    from reference.status_cell import StatusCell

    cleared = []
    manager = SimpleNamespace(commit_options=SimpleNamespace(kv_cache_cell=None), clear=lambda: cleared.append(1),
                              cell=SimpleNamespace(writes=False), agreement=SimpleNamespace(timeout_s=0.01), rank=1)
    with SC.Cell(SC.UPDATING) as cell, StatusCell(cell.name) as mapped:
        with pytest.raises(worker_loop.LoopTimeout) as info:
            worker_loop.release_failed(manager, mapped, 0.001)
    assert cleared == [1]
    assert str(info.value) == (f"status cell {cell.name!r} still reads UPDATING 0.01s after rank 1 released the weights "
                               "of its failed update")
