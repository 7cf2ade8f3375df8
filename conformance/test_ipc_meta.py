"""ipc: a metadata file of shared handles, ``{shared_dir}/ipc_metas_{id}``. Spec: SPEC.md § IPC, and the
APPLY and LIFE rules on this source (dtype/shape checks, unknown and missing names, MTP, 0-d, empty and
large tensors; status, repeated updates, recovery).

Tampered metas are rewritten from the trainer fixture's (``_open_tampered``), one segment per tensor
where a range or a freed segment must hit one tensor only. Error messages are checked for the tensor,
the file and the field, the field outside the file's path (pytest's tmp_path holds the test's name).
"""
import os
import pickle
import re

import numpy as np
import pytest

from conformance import check, harness
from conformance import mode_run as R
from conformance import modes
from conformance.harness import Worker
from weightsync.fixtures import ipc as I
from weightsync.fixtures import models as M
from weightsync.wire.handles import PREFIX, leaked_segments

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


FIRST, MIDDLE = "embed.weight", "norm.bias"
POSITIONS = {"first": FIRST, "middle": MIDDLE, "last": LAST}
NAMES = [p.name for p in SPEC.all_params]
PHYSICAL = Worker(0, "5,3,7", "1")  # CUDA ordinal 1 is physical GPU 3: never 1, never 5
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _meta_file(loader, gpu_id=0):
    return I.meta_path(loader.shared_dir, gpu_id)


@pytest.mark.rule("IPC-FILE-NAME")
@pytest.mark.parametrize(
    "rank",
    [pytest.param(0, marks=[pytest.mark.requires("ipc.meta", "trace"), pytest.mark.modes(rank="rank0")], id="rank0"),
     pytest.param(1, marks=[pytest.mark.requires("ipc.meta", "trace"), pytest.mark.modes(rank="follower")], id="rank1")],
)
def test_meta_file_is_named_by_physical_gpu(loader, trainer, rank):
    want = M.state(SPEC, version=1)
    _publish(loader, trainer, want, gpu_id=3, device_id=1)
    # decoys: the ordinal (1), the first visible GPU (5), a name sharing the prefix (31), rank/GPU 0, the last (7)
    for version, decoy in enumerate((1, 5, 31, 0, 7), start=2):
        _publish(loader, trainer, M.state(SPEC, version=version), gpu_id=decoy, device_id=1)
    session = loader.open(SPEC, strategy="ipc", worker=Worker(rank, "5,3,7", "1"))
    session.update()
    where = f"rank {rank}, CUDA_VISIBLE_DEVICES=5,3,7 FLAGS_selected_gpus=1 (decoys ipc_metas_1/5/31/0/7)"
    check.params_equal(session.observe(), want, where)
    check.labels(session.trace(), ["raw"], where)
    check.sources(session.trace(), ["ipc_metas_3"], where)


@pytest.mark.rule("IPC-IDENTITY-AT-OPEN")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("order", ["opened-order", "reverse-order", "environment-changed-after-open"])
def test_overlapping_sessions_keep_their_own_file(loader, trainer, order, monkeypatch):
    """Two workers opened with different physical GPUs (3 and 6, both at CUDA ordinal 1, as each would
    be in its own process) and then updated: each reads the file of the identity it was opened with,
    although the environment now holds the second worker's. In the last case one worker is opened and
    the environment then names another identity (ordinal 2, physical 9, whose file exists too): the
    worker still reads ipc_metas_3 and opens its handles on ordinal 1, the device it started on."""
    if order == "environment-changed-after-open":
        want = M.state(SPEC, version=1)
        _publish(loader, trainer, want, gpu_id=3, device_id=1)
        _publish(loader, trainer, M.state(SPEC, version=9), gpu_id=9, device_id=2)
        session = loader.open(SPEC, strategy="ipc", worker=Worker(0, "5,3,7", "1"))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,6,9")
        monkeypatch.setenv("FLAGS_selected_gpus", "2")
        session.update()
        check.params_equal(session.observe(), want, "opened as CUDA_VISIBLE_DEVICES=5,3,7 FLAGS_selected_gpus=1 "
                           "(ipc_metas_3, ordinal 1), updated after the environment changed to 2,6,9 / 2")
        return
    workers = {3: Worker(0, "5,3,7", "1"), 6: Worker(1, "2,6", "1")}
    want = {gpu: M.state(SPEC, version=v) for v, gpu in enumerate(workers, start=1)}
    for gpu in workers:
        _publish(loader, trainer, want[gpu], gpu_id=gpu, device_id=1)
    sessions = {gpu: loader.open(SPEC, strategy="ipc", worker=w) for gpu, w in workers.items()}
    for gpu in (list(workers) if order == "opened-order" else list(workers)[::-1]):
        sessions[gpu].update()
    for gpu, w in workers.items():
        check.params_equal(sessions[gpu].observe(), want[gpu],
                           f"worker CUDA_VISIBLE_DEVICES={w.visible} FLAGS_selected_gpus={w.selected} (ipc_metas_{gpu}), "
                           f"updated {order} after both were opened")


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
    check.params_equal(session.observe(), want, f"{_meta_file(loader)}, 4 tensors per segment")


@pytest.mark.rule("IPC-DEVICE-ID-REPLACED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize(
    "visible,selected,trainer_device",
    [("5,3,7", "1", 5), ("5,3,7", "1", 0), ("5,3,7", "1", 3), ("5,3,7", "1", 1), ("5,3,7", "2", 5)],
    ids=["ordinal1-physical3-from-dev5", "from-dev0", "from-dev-equal-physical", "from-dev-equal-ordinal",
         "ordinal2-physical7"],
)
def test_trainer_device_id_is_replaced(loader, trainer, visible, selected, trainer_device):
    worker = Worker(0, visible, selected)
    want = M.state(SPEC)
    export, path = _publish(loader, trainer, want, gpu_id=worker.gpu_id, device_id=trainer_device)
    check.that(all(m[6] == trainer_device for m in export.metas.values()), f"{path}: fixture should store device_id {trainer_device}")
    session = loader.open(SPEC, strategy="ipc", worker=worker)
    session.update()
    check.params_equal(session.observe(), want, f"{path}: metas from device {trainer_device}, worker "
                       f"CUDA_VISIBLE_DEVICES={visible} FLAGS_selected_gpus={selected} (handles open on ordinal {selected})")


@pytest.mark.rule("IPC-DEVICE-ID-REPLACED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("visible", ["5,3,7", None], ids=["selection-unset-physical5", "both-unset"])
def test_unset_selection_opens_ordinal_0(loader, trainer, monkeypatch, visible):
    """``FLAGS_selected_gpus`` left unset reads as "0" (SNAP-GPU-ID-INVALID, fd-spec §1.4): the worker reads
    ``ipc_metas_{first entry}`` and opens the handles on ordinal 0, never failing on the missing variable."""
    unset = ["FLAGS_selected_gpus"] + (["CUDA_VISIBLE_DEVICES"] if visible is None else [])
    real_set = harness.set_worker_env

    def set_env_then_unset(environ, *args):  # the harness always sets both; drop what the case leaves unset
        real_set(environ, *args)
        for var in unset:
            environ.pop(var, None)

    monkeypatch.setattr(harness, "set_worker_env", set_env_then_unset)
    worker = Worker(0, visible or "0", "0")  # ordinal 0 is the device stand-in's current device
    want = M.state(SPEC)
    _, path = _publish(loader, trainer, want, gpu_id=worker.gpu_id, device_id=3)
    session = loader.open(SPEC, strategy="ipc", worker=worker)
    session.update()
    check.params_equal(session.observe(), want, f"{path}: metas from device 3, worker CUDA_VISIBLE_DEVICES="
                       f"{visible!r} FLAGS_selected_gpus unset (handles open on ordinal 0)")


def _open_tampered(loader, export, tamper, spec=SPEC, pickle_writer=False):
    """Rewrite ``export``'s meta file after ``tamper(metas)`` (name -> mutable 7-field list) and open a
    session on it; returns (session, meta file path, the tampered metas)."""
    metas = {n: list(m) for n, m in export.metas.items()}
    tamper(metas)
    write = I.write_metas_pickle if pickle_writer else I.write_metas
    path = write(_meta_file(loader), metas)
    return loader.open(spec, strategy="ipc"), path, metas


def _names_field(info, path, field, where):
    """The error names ``field`` outside the file's path (pytest's tmp_path holds the test's name)."""
    message = str(info.value).replace(os.path.dirname(path), "<shared_dir>")
    check.that(re.search(rf"\b{re.escape(field)}\b", message) is not None,
               f"{where}: error message {message!r} does not name the field {field!r}")


def _rejected(session, path, name, field, what, exc=ValueError):
    """The update raises ``exc`` naming the tensor (and ``field``), and no parameter is loaded."""
    where = f"{path}: {what} in the meta of {name}"
    with check.raises(exc, match=re.escape(name), names=[name, os.path.basename(path)], where=where) as info:
        session.update()
    if field:
        _names_field(info, path, field, where)
    check.not_loaded(session.observe(), NAMES, where)


@pytest.mark.rule("IPC-META-LENGTH")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize(
    "bad",
    ["8-fields-as-in-fd-unit-test", "6-fields", "0-fields", "dict", "str-of-7-chars", "none"],
)
def test_meta_of_wrong_length_is_a_clear_error(loader, trainer, bad):
    export = trainer(M.state(SPEC))
    fields = {"8-fields-as-in-fd-unit-test": 8, "6-fields": 6, "0-fields": 0}.get(bad)

    def tamper(metas):
        m = metas[LAST]
        if fields is not None:
            metas[LAST] = (m + [7])[:fields] if fields <= 8 else m
        elif bad == "dict":
            metas[LAST] = dict(zip(("handle", "offset_bytes", "size", "type_idx", "dims", "lod", "device_id"), m))
        elif bad == "str-of-7-chars":
            metas[LAST] = "abcdefg"
        else:
            metas[LAST] = None

    session, path, _ = _open_tampered(loader, export, tamper, pickle_writer=True)
    names = [f"{fields} field"] if fields is not None else []
    with check.raises(ValueError, match=r"7 fields", names=[LAST, *names], where=f"{path}: meta of {LAST} is {bad}"):
        session.update()
    check.not_loaded(session.observe(), NAMES, f"{path}: meta of {LAST} is {bad}")


# (worker, the trainer's device_id): ordinal 0 from device 0, and ordinal 1 (physical 3) from device 0 and 5:
# a tuple's device_id must be replaced like a list's (IPC-DEVICE-ID-REPLACED), not kept because it is immutable;
# and by the device the worker was opened on (IPC-IDENTITY-AT-OPEN), not one the environment names at the update.
TUPLE_WORKERS = {"ordinal0-from-dev0": (Worker(0, "0", "0"), 0), "ordinal1-physical3-from-dev0": (PHYSICAL, 0),
                 "ordinal1-physical3-from-dev5": (PHYSICAL, 5),
                 "ordinal1-physical3-from-dev5-environment-changed-after-open": (PHYSICAL, 5)}


@pytest.mark.rule("IPC-META-TUPLE")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", list(TUPLE_WORKERS))
def test_meta_stored_as_tuple_is_accepted(loader, trainer, case, monkeypatch):
    worker, trainer_device = TUPLE_WORKERS[case]
    want = M.state(SPEC)
    export = trainer(want, device_id=trainer_device)
    path = I.write_metas(_meta_file(loader, worker.gpu_id), {n: tuple(m) for n, m in export.metas.items()})
    session = loader.open(SPEC, strategy="ipc", worker=worker)
    where = (f"{path}: every meta a tuple with device_id {trainer_device}, worker "
             f"CUDA_VISIBLE_DEVICES={worker.visible} FLAGS_selected_gpus={worker.selected}")
    if case.endswith("environment-changed-after-open"):
        # ordinal 2 is physical 9 now, whose tuples (another version) lie beside: the worker still loads
        # ipc_metas_3 and opens its handles on ordinal 1, the device it started on
        decoy = trainer(M.state(SPEC, version=9), device_id=trainer_device)
        I.write_metas(_meta_file(loader, 9), {n: tuple(m) for n, m in decoy.metas.items()})
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,6,9")
        monkeypatch.setenv("FLAGS_selected_gpus", "2")
        where += ", updated after the environment changed to CUDA_VISIBLE_DEVICES=2,6,9 FLAGS_selected_gpus=2"
    session.update()
    check.params_equal(session.observe(), want, where)


BAD_HANDLES = {
    "63-bytes": lambda h: h[:63],
    "65-bytes-as-bytes": lambda h: (h + "\0").encode("latin-1"),
    "not-latin1": lambda h: "\u20ac" * 64,
    "int": lambda h: 12345,
    "empty": lambda h: "",
}


@pytest.mark.rule("IPC-HANDLE-BYTES")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", ["bytes-in-list", "bytes-in-tuple-as-share-cuda-returns", "bytes-in-tuple-on-ordinal1",
                                  *BAD_HANDLES])
def test_handle_stored_as_bytes_is_accepted(loader, trainer, case):
    want = M.state(SPEC)
    worker = PHYSICAL if case.endswith("ordinal1") else Worker(0, "0", "0")
    export = trainer(want, device_id=5 if worker is PHYSICAL else 0)
    if case in BAD_HANDLES:
        session, path, metas = _open_tampered(
            loader, export, lambda metas: metas[LAST].__setitem__(0, BAD_HANDLES[case](metas[LAST][0])), pickle_writer=True)
        _rejected(session, path, LAST, "handle", f"handle {case}")
        return
    container = tuple if "tuple" in case else list
    metas = {n: container([m[0].encode("latin-1"), *m[1:]]) for n, m in export.metas.items()}
    path = I.write_metas_pickle(_meta_file(loader, worker.gpu_id), metas)
    session = loader.open(SPEC, strategy="ipc", worker=worker)
    session.update()
    check.params_equal(session.observe(), want, f"{path}: handles as 64 bytes in a {container.__name__}, device_id "
                       f"{metas[LAST][6]}, worker FLAGS_selected_gpus={worker.selected}")


@pytest.mark.rule("IPC-META-MISSING")
@pytest.mark.requires("ipc.meta")
def test_missing_meta_file_names_the_path(loader, trainer):
    trainer(M.state(SPEC))  # segments exist, the file was never written
    _publish(loader, trainer, M.state(SPEC), gpu_id=1)  # only the ordinal's file exists
    path = _meta_file(loader, 3)
    session = loader.open(SPEC, strategy="ipc", worker=PHYSICAL)
    with check.raises(FileNotFoundError, match=r"ipc_metas_3", names=[path], where="no ipc_metas_3 (ipc_metas_1 present)"):
        session.update()


def _seg_size(export, name):
    return export.place[name][0].size


RANGE_SPEC = M.spec(*((p.name, p.dtype, p.shape) for p in SPEC.main), ("z.empty", "float32", (0, 4)))
RANGE_CASES = {
    # case -> (tensor, offset(segment size, tensor bytes), loads?)
    "ends-at-last-byte": (LAST, lambda seg, n: seg - n, True),
    "one-byte-past": (LAST, lambda seg, n: seg - n + 1, False),
    "straddling-end": (LAST, lambda seg, n: seg - n // 2, False),
    "starts-at-end": (LAST, lambda seg, n: seg, False),
    "starts-past-end": (LAST, lambda seg, n: seg + 256, False),
    "near-2**63": (LAST, lambda seg, n: 2**63 - n // 2, False),
    "wraps-2**64": (LAST, lambda seg, n: 2**64 - n, False),
    "negative": (LAST, lambda seg, n: -1, False),
    "negative-ending-inside": (LAST, lambda seg, n: -n, False),
    "empty-at-segment-end": ("z.empty", lambda seg, n: seg, True),
    "empty-one-past-end": ("z.empty", lambda seg, n: seg + 1, False),
}


@pytest.mark.rule("IPC-RANGE-CHECKED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_range_outside_segment_is_a_clear_error(loader, trainer, case):
    name, offset_of, loads = RANGE_CASES[case]
    want = M.state(RANGE_SPEC)
    export = trainer(want, per_segment=1)
    seg, nbytes = _seg_size(export, name), want[name].nbytes
    offset = offset_of(seg, nbytes)
    if loads:
        export.move(name, offset)
    session, path, _ = _open_tampered(loader, export, lambda metas: metas[name].__setitem__(1, offset), spec=RANGE_SPEC)
    where = f"{path}: {name} ({nbytes} bytes) at offset_bytes {offset} of a {seg}-byte segment"
    if loads:
        session.update()
        check.params_equal(session.observe(), want, where)
        return
    with check.raises(ValueError, match=re.escape(name), names=[name, os.path.basename(path)], where=where) as info:
        session.update()
    _names_field(info, path, "offset_bytes", where)
    check.not_loaded(session.observe(), [p.name for p in RANGE_SPEC.all_params], where)


SIZE_CASES = {  # LAST is float32 (4, 8): 32 items, 128 bytes
    "one-item-short": lambda n: n - 4,
    "one-item-long": lambda n: n + 4,
    "half": lambda n: n // 2,
    "double": lambda n: n * 2,
    "zero": lambda n: 0,
    "numel-not-bytes": lambda n: n // 4,
    "negative": lambda n: -n,
    "bool": lambda n: True,
    "float": lambda n: float(n),
}
# A 1-byte tensor last: there ``True == 1`` and ``1.0 == 1``, so only a type check rejects them.
ONE_BYTE = M.spec(*((p.name, p.dtype, p.shape) for p in SPEC.main), ("z.flag", "uint8", (1,)))
ONE_BYTE_CASES = {"bool-True-for-1-byte": True, "float-1.0-for-1-byte": 1.0}


@pytest.mark.rule("IPC-SIZE-CHECKED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", list(SIZE_CASES) + list(ONE_BYTE_CASES))
def test_size_disagreeing_with_dims_is_a_clear_error(loader, trainer, case):
    spec, name = (ONE_BYTE, "z.flag") if case in ONE_BYTE_CASES else (SPEC, LAST)
    export = trainer(M.state(spec), per_segment=1)
    size = ONE_BYTE_CASES[case] if case in ONE_BYTE_CASES else SIZE_CASES[case](export.metas[name][2])
    # every bad size still lies inside the 256-byte segment: only the size check can catch it
    session, path, _ = _open_tampered(loader, export, lambda metas: metas[name].__setitem__(2, size), spec=spec,
                                      pickle_writer=True)
    _rejected(session, path, name, "size", f"size {size!r} for dims {export.metas[name][4]} ({export.metas[name][2]} bytes)")


DIMS_CASES = {
    "negative-pair": [-4, -8],  # prod 32: the size still agrees
    "negative-one": [4, -8],
    "float": [4, 8.0],
    "bool": [4, True, 8],
    "str": "4x8",
    "none": None,
}


@pytest.mark.rule("IPC-DIMS-CHECKED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", list(DIMS_CASES))
def test_dims_that_are_not_non_negative_ints_are_a_clear_error(loader, trainer, case):
    export = trainer(M.state(SPEC), per_segment=1)
    session, path, _ = _open_tampered(loader, export, lambda metas: metas[LAST].__setitem__(4, DIMS_CASES[case]), pickle_writer=True)
    _rejected(session, path, LAST, "dims", f"dims {DIMS_CASES[case]!r}")


TYPE_CASES = {"99": 99, "0-undefined": 0, "-1": -1, "4-uint16": 4, "bool-True": True, "str-10": "10", "float-10.0": 10.0}


@pytest.mark.rule("IPC-TYPE-UNKNOWN")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", list(TYPE_CASES))
def test_unknown_type_idx_is_a_clear_error(loader, trainer, case):
    export = trainer(M.state(SPEC))
    session, path, _ = _open_tampered(loader, export, lambda metas: metas[LAST].__setitem__(3, TYPE_CASES[case]), pickle_writer=True)
    _rejected(session, path, LAST, "type_idx", f"type_idx {TYPE_CASES[case]!r}")


def _other_dtype(name):
    return {"float32": "int32", "bfloat16": "float16", "float16": "bfloat16"}[SPEC.param(name).dtype]


def _spoil(export, metas, kind, name):
    bad = metas[name]
    if kind == "range":
        bad[1] = _seg_size(export, name) - bad[2] + 1
    elif kind == "size":
        bad[2] += ITEMSIZE[SPEC.param(name).dtype]
    elif kind == "type_idx":
        bad[3] = 99
    elif kind == "length":
        bad.append(7)
    elif kind == "handle":
        bad[0] = bad[0][:63]
    elif kind == "dims":
        bad[4] = [-d for d in bad[4]] if len(bad[4]) == 2 else [-1]  # a pair keeps its product
    elif kind == "dtype":
        bad[3] = I.type_code(_other_dtype(name))
    elif kind == "shape":
        bad[4] = bad[4][::-1] if len(bad[4]) == 2 else [1, *bad[4]]
    else:
        export.free(name)


SPOIL_KINDS = ["range", "size", "type_idx", "length", "handle", "dims", "dtype", "shape", "freed-segment"]
# every kind in the middle of the file (a loader applying as it reads has applied the first); those
# whose check needs the segment or the model also first and last (the others' own rules put them last)
SPOIL_CASES = [(k, p) for k in SPOIL_KINDS for p in POSITIONS if p == "middle" or k in ("range", "size", "dtype", "freed-segment")]


@pytest.mark.rule("IPC-VALIDATE-FIRST")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("kind,position", SPOIL_CASES, ids=[f"{k}-{p}" for k, p in SPOIL_CASES])
def test_bad_meta_changes_no_parameter(loader, trainer, kind, position):
    name = POSITIONS[position]
    export = trainer(M.state(SPEC), per_segment=1)
    session, path, _ = _open_tampered(loader, export, lambda metas: _spoil(export, metas, kind, name), pickle_writer=True)
    where = f"{path}: {kind} bad in {name}, the {position} meta of the file"
    with check.raises((ValueError, TypeError), match=re.escape(name), names=[name], where=where):
        session.update()
    check.not_loaded(session.observe(), NAMES, where)


@pytest.mark.rule("IPC-UNKNOWN-VALIDATED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("kind", ["length", "size", "type_idx", "handle", "dims"])
def test_malformed_meta_of_unknown_name_is_rejected(loader, trainer, kind):
    extra = "extra.unknown.weight"
    st = dict(M.state(SPEC))
    st[extra] = M.state(M.spec((extra, "float32", (2, 2))))[extra]
    export = trainer(st, per_segment=1)

    def tamper(metas):
        bad = metas[extra]
        if kind == "length":
            bad.append(7)
        elif kind == "size":
            bad[2] += 4
        elif kind == "type_idx":
            bad[3] = 99
        elif kind == "handle":
            bad[0] = bad[0][:63]
        else:
            bad[4] = [-2, -2]

    session, path, _ = _open_tampered(loader, export, tamper, pickle_writer=True)
    _rejected(session, path, extra, None, f"{kind} bad (a name the model does not have)")


@pytest.mark.rule("IPC-META-NO-PICKLE-EXEC")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", ["reduce-calls-makedirs", "numpy-int-in-lod", "numpy-array-lod"])
def test_meta_file_pickle_never_runs_code(loader, trainer, tmp_path, case):
    export = trainer(M.state(SPEC))
    marker = tmp_path / "pwned"
    path = _meta_file(loader)
    if case == "reduce-calls-makedirs":
        I.write_exec_pickle(path, marker, export.metas)
    else:  # array reconstruction is a global too, refused even in the ignored lod field: no meta needs one
        metas = {n: list(m) for n, m in export.metas.items()}
        metas[LAST][5] = [np.int64(0)] if case == "numpy-int-in-lod" else np.zeros(0, np.int64)
        I.write_metas_pickle(path, metas)
    session = loader.open(SPEC, strategy="ipc")
    with check.raises((ValueError, pickle.UnpicklingError), match=r"ipc_metas_0", names=[path], where=f"{path}: pickle naming a global ({case})"):
        session.update()
    check.that(not marker.exists(), f"{path}: unpickling ran os.makedirs({str(marker)!r}): the marker exists")
    check.not_loaded(session.observe(), NAMES, f"{path}: pickle naming a global ({case})")


FILE_CASES = {
    "list": lambda metas: list(metas.values()),
    "none": lambda metas: None,
    "int-key": lambda metas: {**metas, 7: metas[LAST]},
    "empty-dict": lambda metas: {},
    "zero-bytes": None,
    "truncated": None,
}


@pytest.mark.rule("IPC-FILE-CONTENT")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", list(FILE_CASES))
def test_meta_file_that_is_not_a_dict_of_metas_is_a_clear_error(loader, trainer, case):
    export = trainer(M.state(SPEC))
    path = _meta_file(loader)
    if case == "zero-bytes":
        open(path, "wb").close()
    elif case == "truncated":
        I.write_metas(path, export.metas)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:
        with open(path, "wb") as f:
            pickle.dump(FILE_CASES[case](export.metas), f, protocol=4)
    session = loader.open(SPEC, strategy="ipc")
    where = f"{path}: the file holds {case}"
    with check.raises(ValueError, match=re.escape(path), names=[path], where=where):
        session.update()
    check.not_loaded(session.observe(), NAMES, where)


# A meta file nested far deeper than a meta needs (fixtures.files.pickle_nesting: no pickler writes it). case ->
# (where, kind, depth): the whole file, the meta of the last tensor, one field of it, the meta of a name the
# model lacks (validated all the same: IPC-UNKNOWN-VALIDATED), a dict key that is a tuple nested 300 000 deep
# (hashing it recurses in C: it crashes a C unpickler's process).
NESTED_FILES = {
    "file-list-5000": ("file", "list", 5000),
    "meta-list-5000": ("meta", "list", 5000),
    "dims-list-5000": ("dims", "list", 5000),
    "handle-dicts-3000": ("handle", "dict", 3000),
    "unknown-name-meta-list-5000": ("unknown", "list", 5000),
    "key-tuple-300000": ("key", "tuple", 300_000),
}
NESTED_BOUND_S = 30.0


def _nested_metas_cases(loader, metas) -> bool:
    """In the child: each nested file refused with a ValueError naming the file (and the tensor and field where a
    meta holds the nesting); nothing loaded."""
    from weightsync.fixtures import files as F

    path = _meta_file(loader)
    extra = "extra.unknown.weight"
    for case, (where, kind, depth) in NESTED_FILES.items():
        with open(_nesting_progress(loader), "w", encoding="utf-8") as f:
            f.write(case)
        ops = F.nested_pickle_ops(kind, depth)
        named = [path]
        if where == "file":
            F.write_bytes(path, b"\x80\x02" + ops + b".")
        else:
            obj = {n: list(m) for n, m in metas.items()}
            if where == "meta":
                obj[LAST], named = F.NESTED, named + [LAST]
            elif where in ("dims", "handle"):
                obj[LAST][{"dims": 4, "handle": 0}[where]], named = F.NESTED, named + [LAST, where]
            elif where == "unknown":
                obj[extra], named = F.NESTED, named + [extra]
            else:
                obj[F.NESTED] = list(metas[LAST])
            F.write_bytes(path, F.pickle_nesting(obj, ops))
        session = loader.open(SPEC, strategy="ipc")
        where_ = f"{path}: {case} ({kind} nested {depth} deep at the {where})"
        with check.raises(ValueError, match=re.escape(path), names=named, where=where_):
            session.update()
        check.not_loaded(session.observe(), NAMES, where_)
    return True


def _nesting_progress(loader) -> str:
    return os.path.join(os.path.dirname(loader.shared_dir.rstrip("/")), "ipc-nesting-case")


@pytest.mark.rule("IPC-FILE-CONTENT")
@pytest.mark.requires("ipc.meta")
def test_meta_file_nested_deep_is_a_clear_error(loader, trainer):
    """Every nesting in turn, in a forked child with a deadline: a loader whose error message recurses into the value
    (RecursionError), or whose unpickler crashes on the tuple key, fails naming the case, never the run."""
    export = trainer(M.state(SPEC))
    try:
        done = harness.in_child(_nested_metas_cases, loader, export.metas, timeout_s=NESTED_BOUND_S)
    except harness.ChildFailed as e:
        try:
            with open(_nesting_progress(loader), encoding="utf-8") as f:
                case = f.read()
        except OSError:
            case = "before the first case"
        raise AssertionError(f"at {case}: {e}") from None
    check.that(done is True, f"the nested meta file cases {list(NESTED_FILES)} did not complete")


@pytest.mark.rule("IPC-SEGMENT-GONE")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("position", list(POSITIONS))
def test_vanished_trainer_segment_names_the_tensor(loader, trainer, position):
    name = POSITIONS[position]
    export, path = _publish(loader, trainer, M.state(SPEC), per_segment=1)
    export.free(name)
    session = loader.open(SPEC, strategy="ipc")
    with check.raises(ValueError, match=re.escape(name), names=[name, os.path.basename(path)], where=f"{path}: segment of {name} ({position}) freed"):
        session.update()
    check.not_loaded(session.observe(), NAMES, f"{path}: segment of {name} ({position}) freed")


def _held(names) -> list[str]:
    """Trainer segments this process still maps (/proc/self/maps) or holds a descriptor of (/proc/self/fd)."""
    held = []
    with open("/proc/self/maps") as f:
        maps = f.read()
    held += [f"mapping of {n}" for n in names if n in maps]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        held += [f"descriptor {fd} -> {target}" for n in names if n in target]
    return held


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


NO_LEAK_CASES = ["success", "success-large", "range-last", "size-last", "dtype-last", "freed-last", "freed-first", "type_idx-middle"]


@pytest.mark.rule("IPC-NO-LEAK")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("case", NO_LEAK_CASES)
def test_no_mapping_or_descriptor_of_trainer_segments_is_kept(loader, trainer, case):
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps and /proc/self/fd (Linux)")
    spec = M.spec(*((p.name, p.dtype, p.shape) for p in SPEC.main), ("big.weight", "float32", (1024, 2048))) \
        if case == "success-large" else SPEC
    want = M.state(M.spec(*((p.name, p.dtype, p.shape) for p in SPEC.main)))
    if case == "success-large":
        want["big.weight"] = I.patterned((1024, 2048), "float32", seed=5)  # 8 MiB
    export = trainer(want, per_segment=1)
    if case.startswith("success"):
        session, path, _ = _open_tampered(loader, export, lambda metas: None, spec=spec)
        session.update()
        check.params_equal(session.observe(), want, f"{path}: {case}")
    else:
        kind, position = case.rsplit("-", 1)
        name = POSITIONS[position]
        session, path, _ = _open_tampered(loader, export, lambda metas: _spoil(export, metas, kind.replace("freed", "freed-segment"), name))
        with check.refused((ValueError, TypeError), where=f"{path}: {kind} of {name} ({case})"):
            session.update()
    segments = export.segment_names()
    export.vanish()  # the trainer's own mappings go: whatever is left is the worker's
    held = _held(segments)
    check.that(not held, f"{path}: after the update ({case}) and the trainer exiting, the worker still holds {held}")


# --- the APPLY and LIFE rules on the ipc source ---------------------------------------------------

def _export_as(want, dtypes=None, shapes=None):
    """The trainer's tensors, with some exported under another dtype (same bytes when the itemsize
    agrees) or another shape."""
    out = dict(want)
    for name, dt in (dtypes or {}).items():
        arr = want[name]
        target = M.NUMPY_DTYPES[dt]
        out[name] = arr.view(target) if arr.dtype.itemsize == target.itemsize else arr.astype(np.float32).astype(target)
    for name, shape in (shapes or {}).items():
        out[name] = np.zeros(shape, out[name].dtype) if np.prod(shape) != out[name].size else out[name].reshape(shape)
    return out


DTYPE_PAIRS = [  # (model dtype, exported dtype, position)
    ("bfloat16", "float16", "last"), ("float16", "bfloat16", "last"), ("float32", "int32", "last"),
    ("uint8", "int8", "last"), ("bool", "uint8", "last"), ("float8_e4m3fn", "float8_e5m2", "last"), ("float64", "int64", "last"),
    ("float32", "bfloat16", "last"), ("bfloat16", "float16", "first"), ("bfloat16", "float16", "middle"),
]


def _three(name_dtype_shape, position):
    """A 3-parameter spec with the given parameter at ``position``."""
    others = [("w.a", "float32", (2, 3)), ("w.b", "float16", (4,))]
    at = {"first": 0, "middle": 1, "last": 2}[position]
    others.insert(at, name_dtype_shape)
    return M.spec(*others)


@pytest.mark.rule("APPLY-DTYPE-MISMATCH")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("model_dtype,meta_dtype,position", DTYPE_PAIRS, ids=[f"{a}-vs-{b}-{p}" for a, b, p in DTYPE_PAIRS])
def test_ipc_dtype_mismatch_is_type_error(loader, trainer, model_dtype, meta_dtype, position):
    name = "x.weight"
    spec = _three((name, model_dtype, (4, 2)), position)
    _, path = _publish(loader, trainer, _export_as(M.state(spec), dtypes={name: meta_dtype}), per_segment=1)
    session = loader.open(spec, strategy="ipc")
    where = f"{path}: {name} is {model_dtype} in the model, type_idx {I.type_code(meta_dtype)} ({meta_dtype}) in the meta ({position})"
    with check.raises(TypeError, match=r"Type mismatch for " + re.escape(name), names=[name], where=where):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in spec.all_params], where)


SHAPE_PAIRS = [  # (model shape, exported shape, position)
    ((8, 4), (4, 8), "last"), ((8, 4), (32,), "last"), ((8, 4), (8, 3), "last"),
    ((), (1,), "last"), ((0, 4), (4, 0), "last"),
    ((8, 4), (4, 8), "first"), ((8, 4), (4, 8), "middle"),
]


@pytest.mark.rule("APPLY-SHAPE-MISMATCH")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("model_shape,meta_shape,position", SHAPE_PAIRS, ids=[f"{a}-vs-{b}-{p}" for a, b, p in SHAPE_PAIRS])
def test_ipc_shape_mismatch_is_value_error(loader, trainer, model_shape, meta_shape, position):
    name = "x.weight"
    spec = _three((name, "bfloat16", model_shape), position)
    _, path = _publish(loader, trainer, _export_as(M.state(spec), shapes={name: meta_shape}), per_segment=1)
    session = loader.open(spec, strategy="ipc")
    where = f"{path}: {name} is {list(model_shape)} in the model, dims {list(meta_shape)} in the meta ({position})"
    with check.raises(ValueError, match=r"Shape mismatch for " + re.escape(name), names=[name], where=where):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in spec.all_params], where)


@pytest.mark.rule("APPLY-DTYPE-BEFORE-SHAPE")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("meta_dtype,meta_shape", [("float16", (4, 8)), ("float32", (8, 3)), ("int64", ())])
def test_ipc_dtype_checked_before_shape(loader, trainer, meta_dtype, meta_shape):
    name = "x.weight"
    spec = _three((name, "bfloat16", (8, 4)), "middle")
    st = M.state(spec)
    st[name] = np.zeros(meta_shape, M.NUMPY_DTYPES[meta_dtype])
    _, path = _publish(loader, trainer, st, per_segment=1)
    session = loader.open(spec, strategy="ipc")
    where = f"{path}: {name} bfloat16[8, 4] in the model, {meta_dtype}{list(meta_shape)} in the meta"
    with check.raises(TypeError, match=r"Type mismatch for " + re.escape(name), names=[name], where=where):
        session.update()


@pytest.mark.rule("APPLY-UNKNOWN-IGNORED")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("position", list(POSITIONS))
def test_ipc_unknown_names_are_ignored(loader, trainer, position):
    want = M.state(SPEC)
    extra = {"embed": np.ones((3,), np.float32), f"{FIRST}.extra": np.ones((2, 2), np.float16)}
    names = list(want)
    at = {"first": 0, "middle": 2, "last": len(names)}[position]
    st = {n: want[n] for n in names[:at]} | extra | {n: want[n] for n in names[at:]}
    _, path = _publish(loader, trainer, st, per_segment=2)
    session = loader.open(SPEC, strategy="ipc")
    session.update()
    check.params_equal(session.observe(), want, f"{path}: unknown names {list(extra)} placed {position} in the file")
    check.equal(sorted(session.observe()), sorted(want), f"{path}: the model's parameters after ignoring {list(extra)}")


SPEC_MTP = M.spec(*((p.name, p.dtype, p.shape) for p in SPEC.main),
                  mtp=[(("mtp.0.proj.weight", "bfloat16", (4, 4)), ("mtp.0.norm.weight", "float32", (4,)))])

MISSING_CASES = [
    pytest.param([FIRST], SPEC, marks=pytest.mark.requires("ipc.meta"), id="first"),
    pytest.param([MIDDLE], SPEC, marks=pytest.mark.requires("ipc.meta"), id="middle"),
    pytest.param([LAST], SPEC, marks=pytest.mark.requires("ipc.meta"), id="last"),
    pytest.param([FIRST, LAST], SPEC, marks=pytest.mark.requires("ipc.meta"), id="two"),
    pytest.param(["mtp.0.norm.weight"], SPEC_MTP, marks=pytest.mark.requires("ipc.meta", "mtp"), id="mtp"),
]


@pytest.mark.rule("APPLY-MISSING-FAILS")
@pytest.mark.parametrize("missing,spec", MISSING_CASES)
def test_ipc_missing_parameter_fails_by_name(loader, trainer, missing, spec):
    st = {n: a for n, a in M.state(spec).items() if n not in missing}
    _, path = _publish(loader, trainer, st)
    session = loader.open(spec, strategy="ipc")
    with check.raises(RuntimeError, match="|".join(map(re.escape, missing)), names=missing, where=f"{path} lacks {missing}"):
        session.update()


@pytest.mark.rule("APPLY-MTP-LOADED")
@pytest.mark.requires("ipc.meta", "mtp")
def test_ipc_main_and_mtp_both_loaded(loader, trainer):
    want = M.state(SPEC_MTP, version=4)
    names = list(want)
    interleaved = {n: want[n] for n in names[::2] + names[1::2]}  # MTP tensors among the main ones
    _, path = _publish(loader, trainer, interleaved, per_segment=2)
    session = loader.open(SPEC_MTP, strategy="ipc")
    session.update()
    check.params_equal(session.observe(), want, f"{path}: main + MTP tensors in one meta file")


EDGE = M.spec(
    ("s.fp32", "float32", ()), ("s.bf16", "bfloat16", ()), ("s.int64", "int64", ()), ("s.bool", "bool", ()),
    ("s.fp8", "float8_e4m3fn", ()), ("e.bf16", "bfloat16", (0, 4)), ("e.fp32", "float32", (4, 0)),
    ("e.int8", "int8", (0,)), ("after.fp16", "float16", (3,)),
)
LARGE = M.spec(("small.fp16", "float16", (3,)), ("large.bf16", "bfloat16", (2048, 2048)), ("tail.fp32", "float32", (5,)))


@pytest.mark.rule("APPLY-ROUNDTRIP-DTYPES")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("spec", [pytest.param(EDGE, id="0-d-and-zero-element"), pytest.param(LARGE, id="8MiB-among-small")])
def test_ipc_edge_tensors_roundtrip(loader, trainer, spec):
    want = {p.name: I.patterned(p.shape, p.dtype, seed=7) if p.name.startswith("large") else M.weights(p, version=2)
            for p in spec.all_params}
    _, path = _publish(loader, trainer, want, per_segment=3)
    session = loader.open(spec, strategy="ipc")
    session.update()
    check.params_equal(session.observe(), want, f"{path}: {', '.join(f'{p.name}{list(p.shape)}' for p in spec.all_params)}")


def _publish_failing(loader, export, kind, name=MIDDLE):
    """Write a meta file for ``export`` that fails in ``kind`` at ``name`` (no file at all for no-file)."""
    path = _meta_file(loader)
    if kind == "missing":
        I.write_metas(path, {n: m for n, m in export.metas.items() if n != name})
    elif kind != "no-file":
        metas = {n: list(m) for n, m in export.metas.items()}
        _spoil(export, metas, kind, name)
        I.write_metas(path, metas)
    return path


FAILURES = [("range", "first-load"), ("size", "first-load"), ("dtype", "first-load"), ("freed-segment", "first-load"),
            ("missing", "first-load"), ("no-file", "first-load"), ("dtype", "after-clear"), ("freed-segment", "after-clear")]


@pytest.mark.rule("LIFE-FAILED-NOT-NORMAL")
@pytest.mark.requires("ipc.meta", "status")
@pytest.mark.parametrize("kind,when", [
    pytest.param(k, w, marks=pytest.mark.modes(call="first" if w == "first-load" else "second", model="main"),
                 id=f"{k}-{w}") for k, w in FAILURES])
def test_ipc_failed_update_is_not_normal(loader, trainer, kind, when):
    session = loader.open(SPEC, strategy="ipc")
    if when == "after-clear":
        _publish(loader, trainer, M.state(SPEC, version=3), per_segment=1)
        session.update()
        session.clear()
    export = trainer(M.state(SPEC, version=1), per_segment=1)
    path = _publish_failing(loader, export, kind)
    with check.refused((ValueError, TypeError, RuntimeError, FileNotFoundError),
                       where=f"{path}: update ({when}) from a file with {kind} in {MIDDLE}"):
        session.update()
    check.status_not(session, "NORMAL", f"{path}: after an update ({when}) rejected for {kind} in {MIDDLE}")


RECOVERIES = ["range", "dtype", "freed-segment", "no-file"]


@pytest.mark.rule("LIFE-RECOVERY")
@pytest.mark.requires("ipc.meta", "status")
@pytest.mark.parametrize("kind", RECOVERIES)
def test_ipc_recovers_after_a_rejected_meta_file(loader, trainer, kind):
    bad_v, good_v = M.state(SPEC, version=1), M.state(SPEC, version=2)
    path = _publish_failing(loader, trainer(bad_v, per_segment=1), kind)
    session = loader.open(SPEC, strategy="ipc")
    with check.refused((ValueError, TypeError, RuntimeError, FileNotFoundError), where=f"{path}: update from a file with {kind}"):
        session.update()
    _publish(loader, trainer, good_v, per_segment=1)  # the trainer publishes a fixed file
    session.clear()
    session.update()
    check.params_equal(session.observe(), good_v, f"{path}: fixed file, clear(), update() after an update rejected for {kind}")
    check.status_is(session, "NORMAL", f"{path}: after the recovering update ({kind} before)")


@pytest.mark.rule("LIFE-STATUS")
@pytest.mark.requires("ipc.meta", "status")
def test_ipc_status_through_updates_and_clears(loader, trainer):
    path = _meta_file(loader)
    session = loader.open(SPEC, strategy="ipc")
    check.status_is(session, "CLEARED", f"{path}: a session opened on unloaded models")
    for version in (1, 2):
        _publish(loader, trainer, M.state(SPEC, version=version))
        if version > 1:
            session.clear()
            check.status_is(session, "CLEARED", f"{path}: clear() after update {version - 1}")
            session.clear()
            check.status_is(session, "CLEARED", f"{path}: a second clear() in a row")
        session.update()
        check.status_is(session, "NORMAL", f"{path}: after successful update {version}")


@pytest.mark.rule("LIFE-RELOAD-LATEST")
@pytest.mark.requires("ipc.meta")
@pytest.mark.parametrize("spec", [pytest.param(SPEC, id="main"), pytest.param(SPEC_MTP, marks=pytest.mark.requires("mtp"), id="main+mtp")])
def test_ipc_updates_each_leave_the_latest_version(loader, trainer, spec):
    session = loader.open(spec, strategy="ipc")
    previous = None
    for version in (1, 2, 3):
        want = M.state(spec, version=version)
        export, path = _publish(loader, trainer, want, per_segment=2)  # a fresh meta file and fresh segments
        if version > 1:
            session.clear()
            check.not_loaded(session.observe(), [p.name for p in spec.all_params], f"{path}: clear() before v{version}")
        session.update()
        if previous is not None:
            previous.close()  # the last version's trainer buffers go away
        check.params_equal(session.observe(), want, f"{path}: update {version} of v1 -> clear -> v2 -> clear -> v3")
        previous = export


# -- every rule in every pair of its modes (SPEC.md Modes:) ---------------------------------------------------------
# The cases above hold each rule's boundaries on a plain session's first update of the main model; the cases below
# run a representative of them in every pair of the rule's declared modes (conformance/modes.py): staged, a later
# call of the session (healthy updates loaded and cleared first), the draft model (its tensors after the main
# ones in the file: the bad meta is the draft's first, middle or last), the bad meta's position.
def _params(rule, *more):
    return modes.params(rule, requires=lambda combo: ["ipc.meta", *more,
                                                      *(["staged"] if combo.get("staged") == "staged" else []),
                                                      *(["mtp"] if combo.get("model") == "draft" else [])])


def _modal(loader, trainer, combo, spec=SPEC, worker=None):
    """(session, spec): a session of ``spec`` (with a draft model for ``model=draft``) in ``combo``'s modes, its
    earlier updates done, each from a fresh export written to the worker's meta file."""
    spec = R.with_draft(spec, combo)
    worker = worker or Worker(0, "0", "0")
    session = loader.open(spec, strategy="ipc", worker=worker, options=R.options(combo))
    R.earlier(combo, session, lambda v: _publish(loader, trainer, M.state(spec, version=v), gpu_id=worker.gpu_id))
    return session, spec


def _write_tampered(loader, export, tamper, gpu_id=0):
    metas = {n: list(m) for n, m in export.metas.items()}
    tamper(metas)
    return I.write_metas_pickle(_meta_file(loader, gpu_id), metas)


_FIELD_SPOILS = {  # rule -> (field the error names, spoil of one meta (spec, name, meta, export))
    "IPC-META-LENGTH": ("7 fields", lambda spec, name, m, export: m.append(7)),
    "IPC-RANGE-CHECKED": ("offset_bytes", lambda spec, name, m, export: m.__setitem__(1, _seg_size(export, name) - m[2] + 1)),
    "IPC-SIZE-CHECKED": ("size", lambda spec, name, m, export: m.__setitem__(2, m[2] + ITEMSIZE[spec.param(name).dtype])),
    "IPC-DIMS-CHECKED": ("dims", lambda spec, name, m, export: m.__setitem__(4, [-d for d in m[4]] if len(m[4]) == 2 else [-1])),
    "IPC-TYPE-UNKNOWN": ("type_idx", lambda spec, name, m, export: m.__setitem__(3, 99)),
}


def _field_case(loader, trainer, rule, combo):
    field, spoil = _FIELD_SPOILS[rule]
    session, spec = _modal(loader, trainer, combo)
    name = R.judged(POSITIONS[combo["position"]], combo)
    export = trainer(M.state(spec), per_segment=1)
    path = _write_tampered(loader, export, lambda metas: spoil(spec, name, metas[name], export))
    where = f"{path}: {rule} fault in the meta of {name} ({R.label(combo)})"
    with check.raises(ValueError, match=re.escape(name), names=[name, os.path.basename(path)], where=where) as info:
        session.update()
    if field != "7 fields":
        _names_field(info, path, field, where)
    check.not_loaded(session.observe(), [p.name for p in spec.all_params], where)


@pytest.mark.rule("IPC-META-LENGTH")
@pytest.mark.parametrize("combo", _params("IPC-META-LENGTH"))
def test_meta_of_wrong_length_in_every_mode(loader, trainer, combo):
    _field_case(loader, trainer, "IPC-META-LENGTH", combo)


@pytest.mark.rule("IPC-RANGE-CHECKED")
@pytest.mark.parametrize("combo", _params("IPC-RANGE-CHECKED"))
def test_range_outside_segment_in_every_mode(loader, trainer, combo):
    _field_case(loader, trainer, "IPC-RANGE-CHECKED", combo)


@pytest.mark.rule("IPC-SIZE-CHECKED")
@pytest.mark.parametrize("combo", _params("IPC-SIZE-CHECKED"))
def test_size_disagreeing_with_dims_in_every_mode(loader, trainer, combo):
    _field_case(loader, trainer, "IPC-SIZE-CHECKED", combo)


@pytest.mark.rule("IPC-DIMS-CHECKED")
@pytest.mark.parametrize("combo", _params("IPC-DIMS-CHECKED"))
def test_bad_dims_in_every_mode(loader, trainer, combo):
    _field_case(loader, trainer, "IPC-DIMS-CHECKED", combo)


@pytest.mark.rule("IPC-TYPE-UNKNOWN")
@pytest.mark.parametrize("combo", _params("IPC-TYPE-UNKNOWN"))
def test_unknown_type_idx_in_every_mode(loader, trainer, combo):
    _field_case(loader, trainer, "IPC-TYPE-UNKNOWN", combo)


@pytest.mark.rule("IPC-VALIDATE-FIRST")
@pytest.mark.parametrize("combo", _params("IPC-VALIDATE-FIRST"))
def test_bad_meta_changes_no_parameter_in_every_mode(loader, trainer, combo):
    """A size one item long at the position (of the main model's metas or the draft's), after the earlier
    updates: nothing of the metas before it is adopted."""
    session, spec = _modal(loader, trainer, combo)
    name = R.judged(POSITIONS[combo["position"]], combo)
    export = trainer(M.state(spec), per_segment=1)
    path = _write_tampered(loader, export, lambda metas: metas[name].__setitem__(
        2, metas[name][2] + ITEMSIZE[spec.param(name).dtype]))
    where = f"{path}: size bad in {name}, the {combo['position']} meta ({R.label(combo)})"
    with check.raises((ValueError, TypeError), match=re.escape(name), names=[name], where=where):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in spec.all_params], where)


@pytest.mark.rule("IPC-UNKNOWN-VALIDATED")
@pytest.mark.parametrize("combo", _params("IPC-UNKNOWN-VALIDATED"))
def test_malformed_meta_of_unknown_name_in_every_mode(loader, trainer, combo):
    """A meta of a name the model lacks, its size one item long, first, in the middle or last of the file."""
    session, spec = _modal(loader, trainer, combo)
    extra = "extra.unknown.weight"
    state = M.state(spec)
    names = list(state)
    at = {"first": 0, "middle": len(names) // 2, "last": len(names)}[combo["position"]]
    names.insert(at, extra)
    state[extra] = M.state(M.spec((extra, "float32", (2, 2))))[extra]
    export = trainer({n: state[n] for n in names}, per_segment=1)
    path = _write_tampered(loader, export, lambda metas: metas[extra].__setitem__(2, metas[extra][2] + 4))
    where = f"{path}: size bad in the meta of {extra} ({combo['position']}; {R.label(combo)})"
    with check.raises(ValueError, match=re.escape(extra), names=[extra], where=where):
        session.update()
    check.not_loaded(session.observe(), [p.name for p in spec.all_params], where)


@pytest.mark.rule("IPC-SEGMENT-GONE")
@pytest.mark.parametrize("combo", _params("IPC-SEGMENT-GONE"))
def test_vanished_trainer_segment_in_every_mode(loader, trainer, combo):
    session, spec = _modal(loader, trainer, combo)
    name = POSITIONS[combo["position"]]
    export, path = _publish(loader, trainer, M.state(spec), per_segment=1)
    export.free(name)
    where = f"{path}: segment of {name} ({combo['position']}) freed ({R.label(combo)})"
    with check.raises(ValueError, match=re.escape(name), names=[name, os.path.basename(path)], where=where):
        session.update()
    check.not_loaded(session.observe(), NAMES, where)


@pytest.mark.rule("IPC-META-TUPLE")
@pytest.mark.parametrize("combo", _params("IPC-META-TUPLE"))
def test_meta_stored_as_tuple_in_every_mode(loader, trainer, combo):
    session, spec = _modal(loader, trainer, combo, worker=PHYSICAL)
    want = M.state(spec)
    export = trainer(want, device_id=5)
    path = I.write_metas(_meta_file(loader, 3), {n: tuple(m) for n, m in export.metas.items()})
    session.update()
    check.params_equal(session.observe(), want, f"{path}: every meta a tuple from device 5, worker on ordinal 1 "
                       f"({R.label(combo)})")


@pytest.mark.rule("IPC-HANDLE-BYTES")
@pytest.mark.parametrize("combo", _params("IPC-HANDLE-BYTES"))
def test_handle_stored_as_bytes_in_every_mode(loader, trainer, combo):
    session, spec = _modal(loader, trainer, combo)
    want = M.state(spec)
    export = trainer(want)
    path = I.write_metas_pickle(_meta_file(loader), {n: [m[0].encode("latin-1"), *m[1:]] for n, m in export.metas.items()})
    session.update()
    check.params_equal(session.observe(), want, f"{path}: handles as 64 bytes ({R.label(combo)})")


@pytest.mark.rule("IPC-ROUNDTRIP-DTYPES")
@pytest.mark.parametrize("combo", _params("IPC-ROUNDTRIP-DTYPES"))
def test_every_dtype_roundtrips_in_every_mode(loader, trainer, combo):
    session, spec = _modal(loader, trainer, combo, spec=DTYPES)
    want = M.state(spec, seed=3)
    _publish(loader, trainer, want, per_segment=4)
    session.update()
    check.params_equal(session.observe(), want, f"{_meta_file(loader)}, 4 tensors per segment ({R.label(combo)})")


@pytest.mark.rule("IPC-WORKER-OWNS-COPY")
@pytest.mark.parametrize("combo", _params("IPC-WORKER-OWNS-COPY"))
def test_worker_keeps_its_copy_in_every_mode(loader, trainer, combo):
    session, spec = _modal(loader, trainer, combo)
    v1, v2 = M.state(spec, version=1), M.state(spec, version=2)
    export, path = _publish(loader, trainer, v1, per_segment=2)
    session.update()
    export.overwrite(v2)
    check.params_equal(session.observe(), v1, f"{path}: after the trainer overwrote its segments ({R.label(combo)})")
    export.vanish()
    check.params_equal(session.observe(), v1, f"{path}: after the trainer freed its segments ({R.label(combo)})")


@pytest.mark.rule("IPC-FILE-NAME")
@pytest.mark.parametrize("combo", _params("IPC-FILE-NAME", "trace"))
def test_meta_file_is_named_by_physical_gpu_in_every_mode(loader, trainer, combo):
    rank = 0 if combo["rank"] == "rank0" else 1
    want = M.state(SPEC, version=1)
    _publish(loader, trainer, want, gpu_id=3, device_id=1)
    for version, decoy in enumerate((1, 5, 31), start=2):
        _publish(loader, trainer, M.state(SPEC, version=version), gpu_id=decoy, device_id=1)
    session = loader.open(SPEC, strategy="ipc", worker=Worker(rank, "5,3,7", "1"), options=R.options(combo))
    session.update()
    where = f"rank {rank}, physical GPU 3 on ordinal 1, decoys ipc_metas_1/5/31 ({R.label(combo)})"
    check.params_equal(session.observe(), want, where)
    check.sources(session.trace(), ["ipc_metas_3"], where)


@pytest.mark.rule("IPC-IDENTITY-AT-OPEN")
@pytest.mark.parametrize("combo", _params("IPC-IDENTITY-AT-OPEN"))
def test_session_keeps_its_identity_in_every_mode(loader, trainer, combo, monkeypatch):
    """Opened on physical GPU 3 (ordinal 1), its earlier updates done, then the environment names physical 9
    (ordinal 2, whose file exists too): the update under test still reads ipc_metas_3 on ordinal 1."""
    session, spec = _modal(loader, trainer, combo, worker=Worker(0, "5,3,7", "1"))
    want = M.state(spec, version=1)
    _publish(loader, trainer, want, gpu_id=3, device_id=1)
    _publish(loader, trainer, M.state(spec, version=9), gpu_id=9, device_id=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,6,9")
    monkeypatch.setenv("FLAGS_selected_gpus", "2")
    session.update()
    check.params_equal(session.observe(), want, f"opened on ipc_metas_3 / ordinal 1, updated after the environment "
                       f"changed to 2,6,9 / 2 ({R.label(combo)})")


@pytest.mark.rule("IPC-DEVICE-ID-REPLACED")
@pytest.mark.parametrize("combo", _params("IPC-DEVICE-ID-REPLACED"))
def test_trainer_device_id_is_replaced_in_every_mode(loader, trainer, combo):
    session, spec = _modal(loader, trainer, combo, worker=PHYSICAL)
    want = M.state(spec)
    _, path = _publish(loader, trainer, want, gpu_id=3, device_id=5)
    session.update()
    check.params_equal(session.observe(), want, f"{path}: metas from device 5, worker on ordinal 1 ({R.label(combo)})")


@pytest.mark.rule("IPC-META-MISSING")
@pytest.mark.parametrize("combo", _params("IPC-META-MISSING"))
def test_missing_meta_file_in_every_mode(loader, trainer, combo):
    """After the earlier updates, the trainer's file is gone (the ordinal's file lies beside): the update under
    test names the missing path."""
    session, _ = _modal(loader, trainer, combo, worker=PHYSICAL)
    own = _meta_file(loader, 3)
    if os.path.exists(own):
        os.remove(own)
    _publish(loader, trainer, M.state(SPEC), gpu_id=1)
    with check.raises(FileNotFoundError, match=r"ipc_metas_3", names=[own],
                      where=f"no ipc_metas_3 (ipc_metas_1 present; {R.label(combo)})"):
        session.update()


@pytest.mark.rule("IPC-META-NO-PICKLE-EXEC")
@pytest.mark.parametrize("combo", _params("IPC-META-NO-PICKLE-EXEC"))
def test_meta_file_pickle_never_runs_code_in_every_mode(loader, trainer, tmp_path, combo):
    export = trainer(M.state(SPEC))
    marker = tmp_path / "pwned"
    path = I.write_exec_pickle(_meta_file(loader), marker, export.metas)
    session = loader.open(SPEC, strategy="ipc", options=R.options(combo))
    where = f"{path}: pickle calling os.makedirs ({R.label(combo)})"
    with check.raises((ValueError, pickle.UnpicklingError), match=r"ipc_metas_0", names=[_meta_file(loader)], where=where):
        session.update()
    check.that(not marker.exists(), f"{where}: the marker exists")


@pytest.mark.rule("IPC-NO-LEAK")
@pytest.mark.parametrize("combo", _params("IPC-NO-LEAK"))
def test_no_mapping_of_trainer_segments_in_every_mode(loader, trainer, combo):
    want = M.state(SPEC)
    export = trainer(want, per_segment=1)
    session = loader.open(SPEC, strategy="ipc", options=R.options(combo))
    if combo["outcome"] == "success":
        path = I.write_metas(_meta_file(loader), export.metas)
        session.update()
        check.params_equal(session.observe(), want, f"{path}: {R.label(combo)}")
    else:
        path = _write_tampered(loader, export, lambda metas: _spoil(export, metas, "size", LAST))
        with check.refused((ValueError, TypeError), where=f"{path}: size of {LAST} ({R.label(combo)})"):
            session.update()
    segments = export.segment_names()
    export.vanish()
    held = _held(segments)
    check.that(not held, f"{path}: after the update ({combo['outcome']}, {R.label(combo)}) the worker still holds {held}")
