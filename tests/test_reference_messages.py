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


# -- reference.operations: one clear or update at a time (LIFE-CONCURRENT) ------------------------------------

def _refusal(refused, running):
    return (f"{refused}() refused: {running}() is already in progress on this session (called from another "
            f"thread, or from inside it); nothing was changed: call {refused}() again once {running}() has returned")


@pytest.mark.parametrize("running, refused", [("update", "clear"), ("update", "update"), ("clear", "update"),
                                              ("clear", "clear")])
def test_a_call_arriving_while_another_runs_is_refused_naming_both(running, refused):
    """Called on the same thread, inside the running operation (a hook calling back into its session): refused
    at once, never deadlocked, and nothing changed."""
    from reference.errors import OperationInProgressError
    manager = _manager(["w1"])
    before = manager.status
    with manager.operations.claim(running):
        raises(OperationInProgressError, getattr(manager, refused), _refusal(refused, running))
        assert manager.operations.running == running and manager.status == before
    assert manager.operations.running is None
    assert issubclass(OperationInProgressError, RuntimeError)


def _single_file_manager(tmp_path):
    from fixtures import models as M
    from fixtures import snapshot as S
    from reference import WeightManager
    spec = M.spec(("w1", "float32", (2, 2)))
    S.write_level("single", tmp_path, tmp_path, 0, 0, M.state(spec, version=1))
    return WeightManager(M.build_models(spec), model_dir=str(tmp_path), shared_dir=str(tmp_path),
                         env={"CUDA_VISIBLE_DEVICES": "0", "FLAGS_selected_gpus": "0"})


def test_clear_called_back_from_inside_an_update_is_refused(tmp_path):
    from reference.errors import OperationInProgressError
    from reference.status import Status
    manager = _single_file_manager(tmp_path)
    said = []

    def calls_back():
        with pytest.raises(OperationInProgressError) as excinfo:
            manager.clear()
        said.append(str(excinfo.value))

    manager.hooks.register("calls back", calls_back)
    manager.update()
    assert said == [_refusal("clear", "update")]
    assert manager.status == Status.NORMAL and manager.operations.running is None


def test_update_from_another_thread_during_a_clear_is_refused(tmp_path):
    """The clear is held draining a forward pass in flight; the update arrives from this thread."""
    import threading
    import time
    from reference.errors import OperationInProgressError
    from reference.status import Status
    manager = _single_file_manager(tmp_path)
    manager.update()
    inside, go = threading.Event(), threading.Event()

    def forward():
        with manager.requests.forward():
            inside.set()
            go.wait(10)

    threads = [threading.Thread(target=forward, daemon=True), threading.Thread(target=manager.clear, daemon=True)]
    threads[0].start()
    assert inside.wait(10)
    threads[1].start()
    deadline = time.monotonic() + 10
    while manager.operations.running != "clear" and time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        raises(OperationInProgressError, manager.update, _refusal("update", "clear"))
    finally:
        go.set()
        for t in threads:
            t.join(10)
    assert manager.status == Status.CLEARED and manager.operations.running is None
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


# -- issue 30: input nested far deeper than it needs -----------------------------------------------------------
DEEP = "[[[[...]]]]"  # errors.brief of a list nested deeper than 3 levels


def _safetensors(tmp_path):
    from fixtures import snapshot as S
    import numpy as np
    return S.write_safetensors(tmp_path / "model.safetensors", {"a": np.zeros(2, np.float32), "b": np.ones(3, np.int64)})


@pytest.mark.parametrize("where, kind, depth, tail", [
    ("unknown-key", "array", 126, ": tensor 'a', key 'nested'"),
    ("unknown-key", "object", 200, ": tensor 'a', key 'nested'"),
    ("header", "array", 1100, ""),
    ("header-unclosed", "array", 5000, ""),
])
def test_header_nested_past_the_limit(tmp_path, where, kind, depth, tail):
    from fixtures.files import write_nested_header
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import read_header
    path = _safetensors(tmp_path)
    write_nested_header(path, where, kind, depth)
    raises(SnapshotFormatError, lambda: read_header(path),
           f"{path}: not a valid safetensors file: the JSON header nests deeper than 127 levels (the safetensors "
           f"library's limit){tail}")


def test_header_nested_within_the_limit_reads(tmp_path):
    from fixtures.files import write_nested_header
    from reference.snapshot_load import read_header
    path = _safetensors(tmp_path)
    assert write_nested_header(path, "unknown-key", "array", 125)["levels"] == 127
    assert [(e.name, e.dtype, e.shape) for e in read_header(path)] == [("b", "int64", (3,)), ("a", "float32", (2,))]


@pytest.mark.parametrize("where, field, shown", [
    ("shape", "shape", f"has shape {DEEP}, expected a list of integers >= 0"),
    ("dtype", "dtype", f"has dtype {DEEP}, which Paddle cannot hold"),
    ("data_offsets", "data_offsets", f"has data_offsets {DEEP}, expected [begin, end]"),
])
def test_header_known_key_nested_is_shown_briefly(tmp_path, where, field, shown):
    from fixtures.files import write_nested_header
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import read_header
    path = _safetensors(tmp_path)
    write_nested_header(path, where, "array", 100)
    raises(SnapshotFormatError, lambda: read_header(path), f"{path}: tensor 'a' {shown}")


@pytest.mark.parametrize("where, kind, depth, expected", [
    ("file", "list", 20_000, "expected a dict of arrays, found " + DEEP),
    ("entry", "list", 10_000, "entry 'nested' is " + DEEP + ", expected an array"),
    ("entry", "dict", 5000, "entry 'nested' is {'a': {'a': {'a': {...}}}}, expected an array"),
    ("object-array", "list", 10_000, "entry 'nested' is an array of dtype object, expected numbers (object, string "
                                      "and structured arrays are not tensors)"),
])
def test_pickle_fallback_nested(tmp_path, where, kind, depth, expected):
    import numpy as np
    from fixtures.files import write_nested_pickle
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import load_pickle_state_dict
    path = write_nested_pickle(tmp_path / "state.pdparams", [("w", np.zeros(2, np.float32))], where, kind, depth)
    raises(SnapshotFormatError, lambda: list(load_pickle_state_dict(path)), f"{path}: {expected}")


def test_pickle_tuple_key_nested_past_the_limit_is_never_hashed(tmp_path):
    """300 000 levels: hashing the key would recurse in C (a SIGSEGV of the process); 18 levels are refused already,
    as the tuple is built; 16 load (a tuple key nothing else refuses)."""
    import numpy as np
    from fixtures.files import write_nested_pickle
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import load_pickle_state_dict
    ok = write_nested_pickle(tmp_path / "state15.pdparams", [("w", np.zeros(2, np.float32))], "key", "tuple", 15)
    raises(SnapshotFormatError, lambda: list(load_pickle_state_dict(ok)), f"{ok}: entry ((((...),),),) is named by a "
           "tuple, expected a str")
    for depth in (300_000, 17):
        path = write_nested_pickle(tmp_path / f"state{depth}.pdparams", [("w", np.zeros(2, np.float32))], "key", "tuple", depth)
        raises(SnapshotFormatError, lambda: list(load_pickle_state_dict(path)),
               f"{path}: not a readable pickle (UnpicklingError('{path}: a tuple nests tuples deeper than 16 levels'))")


def test_pickle_names_that_are_not_strings(tmp_path):
    import numpy as np
    from fixtures.files import write_state_pickle
    from reference.errors import SnapshotFormatError
    from reference.snapshot_load import load_pickle_state_dict
    path = write_state_pickle(tmp_path / "state.pdparams", [("w", np.zeros(2, np.float32)), (7, np.ones(2, np.float32))])
    raises(SnapshotFormatError, lambda: list(load_pickle_state_dict(path)), f"{path}: entry 7 is named by a int, expected a str")


def test_meta_fields_nested_are_shown_briefly():
    from reference.ipc_meta import normalize_meta
    deep = 0
    for _ in range(5000):
        deep = [deep]
    raises(MetaError, lambda: normalize_meta(["h" * 64, 0, 16, 10, deep, [], 0], name="w", device=0),
           f"IPC meta of tensor 'w': field dims is {DEEP}, expected a list of non-negative ints")
    raises(MetaError, lambda: normalize_meta(["h" * 64, deep, 16, 10, [4], [], 0], name="w", device=0),
           f"IPC meta of tensor 'w': field offset_bytes is {DEEP}, expected a non-negative int")


def test_msgpack_nested_past_its_bound():
    from fixtures.buckets import nested, packb
    from wire import protocol
    frame = packb({"type": "bucket", "note": nested("array", 1024)})
    raises(ManifestError, lambda: protocol.decode(frame, "message for bucket 0 of version 3"),
           "message for bucket 0 of version 3: the msgpack manifest nests its arrays and maps deeper than 1024 levels")
    frame = packb({"type": nested("array", 1000)})
    raises(ManifestError, lambda: protocol.decode(frame, "message for bucket 0 of version 3"),
           f"message for bucket 0 of version 3: field type is {DEEP}, expected one of ['bucket', 'end', 'abort']")
    assert protocol.decode(packb({"type": "end", "note": nested("map", 1023)}), "w")["type"] == "end"


def test_manifest_field_nested_is_shown_briefly():
    deep = 0
    for _ in range(1000):
        deep = [deep]
    raises(ManifestError, lambda: C.parse_entry(raw_entry(shape=deep), W),
           f"{AT}: field shape is {DEEP}, expected a list of non-negative ints")


@pytest.mark.parametrize("text, expected", [
    ("step: 3\nnote: " + "[" * 64 + "]" * 64, "the version file nests its mappings and sequences deeper than 64 levels; "
                                               "it holds one small mapping (step: N)"),
    ("step: " + "{a: " * 3000 + "1" + "}" * 3000, "the version file nests its mappings and sequences deeper than 64 "
                                                  "levels; it holds one small mapping (step: N)"),
    ("step: [[1, 2], [3]]", "field step is [[1, 2], [3]], expected a non-negative integer version"),
])
def test_version_file_nested(tmp_path, text, expected):
    from reference.commit import read_version_file
    from reference.version_file import VersionError
    path = tmp_path / "version.yaml"
    path.write_text(text)
    raises(VersionError, lambda: read_version_file(str(tmp_path)), f"{path}: {expected}")


def test_version_file_billion_laughs_is_never_expanded(tmp_path):
    from fixtures.version_entries import make_entry
    from reference import stream_config
    from reference.commit import read_version_file
    from reference.version_file import VersionError
    path = str(tmp_path / "version.yaml")
    make_entry(path, "step-billion-laughs", 3)
    with pytest.raises(VersionError) as info:
        read_version_file(str(tmp_path))
    assert str(info.value).startswith(f"{path}: field step is [[[[...], [...], [...], [...], ...], ")
    assert str(info.value).endswith(", expected a non-negative integer version") and len(str(info.value)) < 200 + len(path)
    assert stream_config.read_version_file(str(tmp_path)) == (
        None, f"Failed to read model step from '{path}': 'step' is a list, expected a number or a string")


# -- issue 30: every problem of an input -------------------------------------------------------------------------
def test_raise_all_names_each_problem():
    from reference.apply import raise_all
    raise_all([])  # nothing to raise
    one = ValueError("Shape mismatch for b: [3] vs [2]")
    with pytest.raises(ValueError) as info:
        raise_all([one])
    assert info.value is one
    raises(TypeError, lambda: raise_all([ValueError("Shape mismatch for a: [1] vs [2]"), TypeError("Type mismatch for b: x vs y")]),
           "2 tensor(s) do not match their parameters: Shape mismatch for a: [1] vs [2]; Type mismatch for b: x vs y")
    raises(ValueError, lambda: raise_all([ValueError("Shape mismatch for a"), ValueError("Shape mismatch for b")]),
           "2 tensor(s) do not match their parameters: Shape mismatch for a; Shape mismatch for b")


def test_plan_metas_names_every_bad_meta():
    from reference.ipc_meta import plan_metas
    good = ["h" * 64, 0, 16, 10, [4], [], 0]
    metas = {"a": good[:6], "b": list(good), "c": [*good[:2], 12, *good[3:]]}
    raises(MetaError, lambda: plan_metas("/shm/ipc_metas_0", metas, 0, {"a": None, "b": None, "c": None}),
           "/shm/ipc_metas_0: 2 bad metas: IPC meta of tensor 'a' has 6 fields, expected 7 fields ['handle', "
           "'offset_bytes', 'size', 'type_idx', 'dims', 'lod', 'device_id'] (Paddle's _share_cuda() tuple); IPC meta "
           "of tensor 'c': field size is 12 bytes but dims [4] of float32 need 16 (4 x 4)")


def test_validate_bucket_names_every_bad_entry():
    bucket = C.Bucket(3, 0, b"h" * HANDLE_SIZE, (entry("a", offset=4), entry("b", dtype="complex64", offset=256),
                                                 entry("c", offset=516)))
    raises(ManifestError, lambda: C.validate_bucket(bucket, state(3), 1024),
           f"{W}: 2 problems: {W}, tensor 'b': unknown dtype 'complex64' (field dtype); known: "
           "['bfloat16', 'bool', 'float16', 'float32', 'float64', 'float8_e4m3fn', 'float8_e5m2', 'int16', 'int32', "
           f"'int64', 'int8', 'uint8']; {W}: 2 problems: {W}, tensor 'a': offset 4 is not aligned to 256 bytes "
           f"(misaligned by 4); {W}, tensor 'c': offset 516 is not aligned to 256 bytes (misaligned by 4)")


def test_parse_bucket_names_every_malformed_entry():
    message = manifest(entries=[raw_entry(name="a", nbytes=-1), raw_entry(name="b"), raw_entry(name="c", shape="4")])
    raises(ManifestError, lambda: C.parse_bucket(message, state(3)),
           f"{W}: 2 problems: {W}, tensor 'a': field nbytes is -1, expected a non-negative int; {W}, tensor 'c': field "
           "shape is '4', expected a list of non-negative ints")


def test_two_parts_that_cannot_be_read_are_both_named(tmp_path):
    import numpy as np
    from fixtures import files as F
    from fixtures import models as M
    from fixtures import snapshot as S
    from reference import WeightManager
    spec = M.spec(("a", "float32", (2,)), ("b", "float32", (2,)), ("c", "float32", (2,)))
    paths = S.write_parts(tmp_path, 0, 0, {i: {n: np.zeros(2, np.float32)} for i, n in enumerate("abc")})
    F.damage_safetensors(paths[0], "minus-one-byte")
    F.damage_safetensors(paths[2], "garbage-json")
    manager = WeightManager(M.build_models(spec), model_dir=str(tmp_path), shared_dir=str(tmp_path / "none"),
                            env={"CUDA_VISIBLE_DEVICES": "0", "FLAGS_selected_gpus": "0"})
    with pytest.raises(ValueError) as info:
        manager.update()
    assert str(info.value).startswith(f"2 snapshot files cannot be loaded: {paths[0]}: truncated")
    assert f"; {paths[2]}: not a valid safetensors file: the JSON header does not parse" in str(info.value)


def test_missing_parameters_name_the_tensors_ignored(tmp_path):
    import numpy as np
    from fixtures import models as M
    from fixtures import snapshot as S
    from reference import WeightManager
    spec = M.spec(("a", "float32", (2,)), ("b", "float32", (2,)))
    S.write_safetensors(S.single_path(tmp_path, 0, 0), {"a": np.zeros(2, np.float32), "model.b": np.ones(2, np.float32)})
    manager = WeightManager(M.build_models(spec), model_dir=str(tmp_path), shared_dir=str(tmp_path / "none"),
                            env={"CUDA_VISIBLE_DEVICES": "0", "FLAGS_selected_gpus": "0"})
    raises(RuntimeError, manager.update,
           "Model Parameter update verification failed: 1 of 2 parameter(s) landed; 1 parameter(s) not loaded: b; "
           "1 tensor(s) the sources carried were ignored, no parameter takes them: model.b")

# -- the V1 control surface (reference.control_v1) -----------------------------------------------------------
def _control(options=None, **manager):
    from reference import control_v1 as V
    from reference.agreement import Agreement
    from reference.request_gate import RequestGate
    from reference.status import Status

    fake = SimpleNamespace(requests=RequestGate(served=True), agreement=Agreement(1.0), load_strategy="rsync",
                           IN_PLACE=frozenset({"rsync", "gdr"}), options={}, version=None, status=Status.NORMAL, rank=0)
    fake.__dict__.update(manager)
    return V.Control(fake, options or {})


@pytest.mark.parametrize("tags, expected", [
    ("weights", "unknown tag(s) ['weights']: the tags are weight, kv_cache"),
    (["weight", "kv"], "unknown tag(s) ['kv']: the tags are weight, kv_cache"),
    ([], "unknown tag(s) []: the tags are weight, kv_cache"),
    ([7], "unknown tag(s) [7]: the tags are weight, kv_cache"),
])
def test_parse_tags_names_every_unknown_tag(tags, expected):
    from reference import control_v1 as V

    with pytest.raises(V.TagError) as info:
        V.parse_tags(tags)
    assert str(info.value) == expected


def test_parse_tags_orders_and_defaults():
    from reference import control_v1 as V

    assert V.parse_tags(None) == ("weight", "kv_cache")
    assert V.parse_tags("kv_cache, weight") == ("weight", "kv_cache")
    assert V.parse_tags(["kv_cache"]) == ("kv_cache",)


@pytest.mark.parametrize("version", ["step-3", "3.0", "", "٣", True, -1])
def test_step_version_refuses_what_is_no_step_number(version):
    from reference import control_v1 as V

    with pytest.raises(ValueError) as info:
        V._step_version(version)
    assert str(info.value) == f"update_weights: version {version!r} is not a step number (decimal digits)"


def test_control_options_are_named():
    with pytest.raises(ValueError) as info:
        _control({"engine": object()})
    assert str(info.value).startswith("options['engine'] must have release_kv_cache() and rebuild_kv_cache(), got <object")
    with pytest.raises(ValueError) as info:
        _control({"cuda_graph": "yes"})
    assert str(info.value) == "options['cuda_graph'] must be a bool, got 'yes'"


def test_update_weights_refusals():
    from reference import control_v1 as V

    control = _control()
    with pytest.raises(RuntimeError) as info:
        control.update_weights("2")
    assert str(info.value) == V.PAUSE_FIRST == "Pause LLM Engine first before calling updating weights"
    control.pause()
    control.asleep.add("weight")
    with pytest.raises(RuntimeError) as info:
        control.update_weights("2")
    assert str(info.value) == ("update_weights: the weights are asleep; wake them up (wakeup with tag weight) before "
                               "updating them in place")
    control.asleep.clear()
    control.manager.load_strategy = "ipc_snapshot"
    with pytest.raises(ValueError) as info:
        control.update_weights("2")
    assert str(info.value) == ("update_weights updates in place: the ipc_snapshot strategy loads into cleared weights "
                               "(in place: gdr, rsync)")
    control.manager.load_strategy = "rsync"
    with pytest.raises(ValueError) as info:
        control.update_weights("2", verify_checksum=1)
    assert str(info.value) == "update_weights: verify_checksum must be a bool, got 1"
    control.manager.version = 5
    with pytest.raises(Exception) as info:
        control.update_weights("4")
    assert str(info.value).startswith("update_weights on rank 0: version 4 is older than the version 5 this worker reports")


def test_wakeup_of_the_weights_alone_with_graphs_is_fastdeploys_refusal():
    from reference import control_v1 as V

    control = _control({"cuda_graph": True})
    control.asleep |= {"weight", "kv_cache"}
    with pytest.raises(RuntimeError) as info:
        control.wakeup(["weight"])
    assert str(info.value) == V.GRAPH_ORDER == (
        "Waking up [weight] alone is not supported when CUDA Graph is enabled, as recapturing the graph requires the "
        "KV cache to be rebuilt first. Please wake up [kv_cache] first.")


def test_pause_that_outlasts_its_deadline_says_how_many_steps_run(monkeypatch):
    from reference import control_v1 as V

    monkeypatch.setattr(V, "PAUSE_TIMEOUT_S", 0.01)
    control = _control()
    control._stepping = 2
    with pytest.raises(TimeoutError) as info:
        control.pause()
    assert str(info.value) == "pause: 2 request step(s) still running after 0.01s"


def test_routed_failure_names_it():
    from reference import control_v1 as V

    control = _control()
    control.asleep.add("weight")

    def wakeup(tags):
        raise RuntimeError("no snapshot")

    control.wakeup = wakeup
    assert V.RoutedControl(control).update_model_weight(1.0) == (500, "update model weight failed: RuntimeError: no snapshot")


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
