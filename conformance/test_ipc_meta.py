"""ipc: a metadata file of shared handles, ``{shared_dir}/ipc_metas_{id}``. Spec: SPEC.md § IPC."""
import os
import pickle

import pytest

from conformance import check
from conformance.harness import Worker
from fixtures import ipc as I
from fixtures import models as M
from sim.ipc_handles import PREFIX, leaked_segments

pytestmark = pytest.mark.ipc

SPEC = M.spec(
    ("embed.weight", "float32", (8, 4)),
    ("layers.0.mlp.weight", "bfloat16", (4, 4)),
    ("norm.bias", "float16", (4,)),
    ("lm_head.weight", "float32", (4, 8)),
)
LAST = "lm_head.weight"  # last in file order: a loader applying as it reads has applied the others


@pytest.fixture(scope="module", autouse=True)
def _no_segment_left():
    """Every segment the trainer fixture made in this process is gone after the module."""
    mine = f"{PREFIX}_{os.getpid()}"
    before = set(leaked_segments(mine))  # another module's leftovers are not ours to report
    yield
    left = sorted(set(leaked_segments(mine)) - before)
    assert not left, f"/dev/shm segments left behind by the ipc tests: {left}"


@pytest.fixture
def trainer():
    """``trainer(tensors, **kw)`` exports tensors to shared memory; every segment is freed at teardown."""
    made = []

    def export(tensors, **kw):
        made.append(I.Export(tensors, **kw))
        return made[-1]

    yield export
    for e in made:
        e.close()


def _publish(loader, trainer, tensors, gpu_id=0, **kw):
    export = trainer(tensors, **kw)
    return export, I.write_metas(I.meta_path(loader.shared_dir, gpu_id), export.metas)


@pytest.mark.rule("IPC-FILE-NAME")
@pytest.mark.requires("ipc.meta", "trace")
def test_meta_file_is_named_by_physical_gpu(loader, trainer):
    want, decoy = M.state(SPEC, version=1), M.state(SPEC, version=2)
    _publish(loader, trainer, want, gpu_id=3, device_id=1)
    _publish(loader, trainer, decoy, gpu_id=1, device_id=1)
    session = loader.open(SPEC, strategy="ipc", worker=Worker(0, "2,3,4", "1"))
    session.update()
    where = "CUDA_VISIBLE_DEVICES=2,3,4 FLAGS_selected_gpus=1"
    check.params_equal(session.observe(), want, where)
    check.labels(session.trace(), ["raw"], where)
    check.sources(session.trace(), ["ipc_metas_3"], where)


DTYPES = M.spec(
    ("a.bf16", "bfloat16", (4, 4)),
    ("a.fp16", "float16", (3, 5)),
    ("a.fp32", "float32", (7,)),
    ("a.fp64", "float64", (2, 3)),
    ("b.int8", "int8", (9,)),
    ("b.int32", "int32", (3, 3)),
    ("b.int64", "int64", (5,)),
    ("b.uint8", "uint8", (11,)),
    ("c.bool", "bool", (6,)),
    ("c.fp8_e4m3", "float8_e4m3fn", (4, 4)),
    ("c.fp8_e5m2", "float8_e5m2", (13,)),
    ("d.scalar", "float32", ()),
    ("d.empty", "bfloat16", (0, 4)),
)


@pytest.mark.rule("IPC-ROUNDTRIP-DTYPES")
@pytest.mark.requires("ipc.meta")
def test_every_dtype_roundtrips_bit_exact(loader, trainer):
    want = M.state(DTYPES, seed=3)
    _publish(loader, trainer, want, per_segment=4)
    session = loader.open(DTYPES, strategy="ipc")
    session.update()
    check.params_equal(session.observe(), want, f"{I.meta_path(loader.shared_dir, 0)}, 4 tensors per segment")


@pytest.mark.rule("IPC-DEVICE-ID-REPLACED")
@pytest.mark.requires("ipc.meta")
def test_trainer_device_id_is_replaced(loader, trainer):
    want = M.state(SPEC)
    export, path = _publish(loader, trainer, want, gpu_id=3, device_id=5)
    check.that(all(m[6] == 5 for m in export.metas.values()), f"{path}: fixture should store device_id 5")
    session = loader.open(SPEC, strategy="ipc", worker=Worker(0, "2,3", "1"))
    session.update()
    check.params_equal(session.observe(), want, f"{path}: metas from device 5, worker FLAGS_selected_gpus=1")


def _open_tampered(loader, export, tamper):
    """Rewrite ``export``'s meta file after ``tamper(metas)`` (name -> mutable 7-field list) and open a
    session on it; returns (session, meta file path, the tampered metas)."""
    metas = {n: list(m) for n, m in export.metas.items()}
    tamper(metas)
    path = I.write_metas(I.meta_path(loader.shared_dir, 0), metas)
    return loader.open(SPEC, strategy="ipc"), path, metas


@pytest.mark.rule("IPC-META-LENGTH")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("fields", [8, 6], ids=["8-fields-as-in-fd-unit-test", "6-fields"])
def test_meta_of_wrong_length_is_a_clear_error(loader, trainer, fields):
    export = trainer(M.state(SPEC))

    def tamper(metas):
        metas[LAST] = metas[LAST] + [7] if fields == 8 else metas[LAST][:6]

    session, path, _ = _open_tampered(loader, export, tamper)
    with check.raises(ValueError, match=r"7 fields", names=[LAST, f"{fields} fields"], where=f"{path}: {fields}-field meta"):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{path}: {fields}-field meta for {LAST}")


@pytest.mark.rule("IPC-META-TUPLE")
@pytest.mark.requires("ipc.meta")
def test_meta_stored_as_tuple_is_accepted(loader, trainer):
    want = M.state(SPEC)
    export = trainer(want)
    path = I.write_metas(I.meta_path(loader.shared_dir, 0), {n: tuple(m) for n, m in export.metas.items()})
    session = loader.open(SPEC, strategy="ipc")
    session.update()
    check.params_equal(session.observe(), want, f"{path}: every meta a tuple")


@pytest.mark.rule("IPC-HANDLE-BYTES")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("container", [list, tuple], ids=["list", "tuple-as-share-cuda-returns"])
def test_handle_stored_as_bytes_is_accepted(loader, trainer, container):
    want = M.state(SPEC)
    export = trainer(want)
    metas = {n: container([m[0].encode("latin-1"), *m[1:]]) for n, m in export.metas.items()}
    path = I.write_metas_pickle(I.meta_path(loader.shared_dir, 0), metas)
    session = loader.open(SPEC, strategy="ipc")
    session.update()
    check.params_equal(session.observe(), want, f"{path}: handles as 64 bytes in a {container.__name__}")


@pytest.mark.rule("IPC-META-MISSING")
@pytest.mark.requires("ipc.meta")
def test_missing_meta_file_names_the_path(loader, trainer):
    trainer(M.state(SPEC))  # segments exist, the file was never written
    path = I.meta_path(loader.shared_dir, 0)
    session = loader.open(SPEC, strategy="ipc")
    with check.raises(FileNotFoundError, match=r"ipc_metas_0", names=[path], where="no meta file"):
        session.update()


def _seg_size(export, name):
    return export.place[name][0].size


@pytest.mark.rule("IPC-RANGE-CHECKED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("where", ["past-end", "straddling-end"])
def test_range_outside_segment_is_a_clear_error(loader, trainer, where):
    export = trainer(M.state(SPEC), per_segment=1)
    seg = _seg_size(export, LAST)

    def tamper(metas):
        metas[LAST][1] = seg + 256 if where == "past-end" else seg - metas[LAST][2] // 2

    session, path, metas = _open_tampered(loader, export, tamper)
    with check.raises(ValueError, match=r"offset_bytes", names=[LAST], where=f"{path}: offset {metas[LAST][1]} in a {seg}-byte segment"):
        session.update()


@pytest.mark.rule("IPC-SIZE-CHECKED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("factor", [2, 0.5], ids=["size-double", "size-half"])
def test_size_disagreeing_with_dims_is_a_clear_error(loader, trainer, factor):
    export = trainer(M.state(SPEC), per_segment=1)

    def tamper(metas):
        metas[LAST][2] = int(metas[LAST][2] * factor)  # still inside the 256-aligned segment

    session, path, metas = _open_tampered(loader, export, tamper)
    with check.raises(ValueError, match=r"\bsize\b", names=[LAST], where=f"{path}: size {metas[LAST][2]} for dims {metas[LAST][4]}"):
        session.update()


@pytest.mark.rule("IPC-TYPE-UNKNOWN")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("type_idx", [99, 0], ids=["99", "0-undefined"])
def test_unknown_type_idx_is_a_clear_error(loader, trainer, type_idx):
    export = trainer(M.state(SPEC))

    def tamper(metas):
        metas[LAST][3] = type_idx

    session, path, _ = _open_tampered(loader, export, tamper)
    with check.raises(ValueError, match=r"type_idx", names=[LAST, str(type_idx)], where=f"{path}: type_idx {type_idx}"):
        session.update()


def _spoil(export, metas, kind):
    bad = metas[LAST]
    if kind == "range":
        bad[1] = _seg_size(export, LAST) + 256
    elif kind == "size":
        bad[2] *= 2
    elif kind == "type_idx":
        bad[3] = 99
    else:
        export.free(LAST)


@pytest.mark.rule("IPC-VALIDATE-FIRST")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("kind", ["range", "size", "type_idx", "freed-segment"])
def test_bad_last_meta_changes_no_parameter(loader, trainer, kind):
    export = trainer(M.state(SPEC), per_segment=1)
    session, path, _ = _open_tampered(loader, export, lambda metas: _spoil(export, metas, kind))
    with pytest.raises(ValueError):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in SPEC.all_params], f"{path}: {kind} bad in {LAST}, the last meta")


@pytest.mark.rule("IPC-META-NO-PICKLE-EXEC")
@pytest.mark.requires("ipc.meta")
def test_meta_file_pickle_never_runs_code(loader, trainer, tmp_path):
    export = trainer(M.state(SPEC))
    marker = tmp_path / "pwned"
    path = I.write_exec_pickle(I.meta_path(loader.shared_dir, 0), marker, export.metas)
    session = loader.open(SPEC, strategy="ipc")
    with check.raises((ValueError, pickle.UnpicklingError), match=r"ipc_metas_0", names=[path], where=f"{path}: pickle calling os.makedirs"):
        session.update()
    check.that(not marker.exists(), f"{path}: unpickling ran os.makedirs({str(marker)!r}): the marker exists")


@pytest.mark.rule("IPC-SEGMENT-GONE")
@pytest.mark.requires("ipc.meta")
def test_vanished_trainer_segment_names_the_tensor(loader, trainer):
    export, path = _publish(loader, trainer, M.state(SPEC), per_segment=1)
    export.free(LAST)
    session = loader.open(SPEC, strategy="ipc")
    with check.raises(ValueError, match=r"(?i)segment|handle", names=[LAST], where=f"{path}: segment of {LAST} freed"):
        session.update()


def _mapped(names) -> list[str]:
    with open("/proc/self/maps") as f:
        maps = f.read()
    return [n for n in names if n in maps]


@pytest.mark.rule("IPC-WORKER-OWNS-COPY")
@pytest.mark.requires("ipc.meta")
def test_worker_keeps_its_copy_after_trainer_moves_on(loader, trainer):
    v1, v2 = M.state(SPEC, version=1), M.state(SPEC, version=2)
    export, path = _publish(loader, trainer, v1, per_segment=2)
    session = loader.open(SPEC, strategy="ipc")
    session.update()
    export.overwrite(v2)  # the trainer's next step writes its buffers in place
    check.params_equal(session.observe(), v1, f"{path}: after the trainer overwrote its segments with version 2")
    export.vanish()  # the trainer unmaps and frees: any mapping left in this process is the worker's
    check.params_equal(session.observe(), v1, f"{path}: after the trainer freed its segments")
    if os.path.exists("/proc/self/maps"):
        mapped = _mapped(export.segment_names())
        check.that(not mapped, f"{path}: worker still maps trainer segments {mapped} after the update")
