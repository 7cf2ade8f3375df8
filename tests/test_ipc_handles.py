"""Unit tests of the IPC handle transport (``wire.handles`` through ``sim.ipc_handles``: segments, 7-field metas, the CPU _new_shared_cuda) and fixtures.ipc."""
import os
import pickle

import numpy as np
import pytest

from fixtures import ipc as I
from fixtures.models import NUMPY_DTYPES
from reference import ipc_meta as R
from sim import ipc_handles as H

MINE = f"{H.PREFIX}_{os.getpid()}"


@pytest.fixture(scope="module", autouse=True)
def _no_segment_left():
    before = set(H.leaked_segments(MINE))  # another module's leftovers are not ours to report
    yield
    left = sorted(set(H.leaked_segments(MINE)) - before)
    assert not left, f"/dev/shm segments left behind by this module: {left}"


@pytest.fixture
def seg():
    with H.Segment.create(4096) as s:
        yield s


def _arrays():
    rng = np.random.default_rng(7)
    out = {}
    for name, dt in NUMPY_DTYPES.items():
        if name == "bool":
            out[name] = rng.integers(0, 2, size=(3, 5)).astype(np.bool_)
        elif np.issubdtype(dt, np.integer):
            out[name] = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, size=(3, 5), dtype=dt, endpoint=True)
        else:
            out[name] = rng.uniform(-4, 4, size=(3, 5)).astype(dt)
    out["int16"] = rng.integers(-30000, 30000, size=(7,), dtype=np.int16)
    out["scalar"] = np.array(2.5, np.float32)
    out["empty"] = np.zeros((0, 3), NUMPY_DTYPES["bfloat16"])
    return out


# --- dtype codes ----------------------------------------------------------------------------

def test_type_codes_come_from_paddle_and_match_the_paddle3_table():
    from paddle.base import core

    live = H.phi_dtype_codes()
    assert live == H.PHI_DTYPE_CODES_PADDLE3, f"installed Paddle's DataType differs from the 3.x table: {live}"
    assert live["int16"] == int(core.DataType.INT16) == 5 and int(core.DataType.UINT16) == 4
    for name, code in live.items():
        assert H.dtype_of_code(code) == name
        assert I.type_code(name) == code, f"fixture and sim disagree on {name}"
    assert H.dtype_of_code(0) is None and H.dtype_of_code(12) is None  # UNDEFINED, COMPLEX64


# --- share_array / open_tensor_meta ---------------------------------------------------------

def test_share_and_open_roundtrip_every_dtype_bitwise(seg):
    offset, metas, arrays = 0, {}, _arrays()
    for name, arr in arrays.items():
        metas[name] = H.share_array(seg, offset, arr, device_id=4)
        offset = -(-(offset + arr.nbytes) // 256) * 256
    for name, arr in arrays.items():
        meta = R.normalize_meta(metas[name], name=name, device=0)
        got = H.open_tensor_meta(meta, device=0)
        assert got.dtype == arr.dtype and got.shape == arr.shape, f"{name}: {got.dtype}{got.shape} vs {arr.dtype}{arr.shape}"
        assert got.tobytes() == arr.tobytes(), f"{name}: bytes differ"


def test_share_array_stores_fastdeploy_format(seg):
    meta = H.share_array(seg, 256, np.arange(6, dtype=np.float32).reshape(2, 3), device_id=5)
    assert isinstance(meta, list) and len(meta) == 7
    assert isinstance(meta[0], str) and meta[0].encode("latin-1") == seg.handle
    assert meta[1:] == [256, 24, 10, [2, 3], [], 5]


def test_share_array_refuses_to_overrun(seg):
    with pytest.raises(H.HandleError, match="do not fit"):
        H.share_array(seg, 4090, np.zeros(4, np.float32))


def test_opened_array_is_a_copy_and_no_mapping_is_left(seg):
    meta = R.normalize_meta(H.share_array(seg, 0, np.ones(4, np.float32)), name="w", device=0)
    got = H.open_tensor_meta(meta, device=0)
    seg.buf[:16] = np.zeros(4, np.float32).tobytes()
    assert got.tolist() == [1, 1, 1, 1], "opened array follows later writes: it aliases the segment"
    with open("/proc/self/maps") as f:
        assert f.read().count(seg.name) == 1, "the opener left its own mapping of the segment"


def test_open_refuses_another_device(seg):
    meta = R.normalize_meta(H.share_array(seg, 0, np.ones(4, np.float32)), name="w", device=1)
    with pytest.raises(H.HandleError, match=r"device_id is 1 .* current device is 0"):
        H.open_tensor_meta(meta, device=0)


def test_open_reads_current_device_from_flags_selected_gpus(seg, monkeypatch):
    meta = R.normalize_meta(H.share_array(seg, 0, np.ones(4, np.float32)), name="w", device=2)
    monkeypatch.setenv("FLAGS_selected_gpus", "2")
    assert H.open_tensor_meta(meta).tolist() == [1, 1, 1, 1]
    monkeypatch.setenv("FLAGS_selected_gpus", "0")
    with pytest.raises(H.HandleError, match="FLAGS_selected_gpus"):
        H.open_tensor_meta(meta)


@pytest.mark.parametrize("offset", [4096, 4090, 10**6])
def test_open_checks_the_range(seg, offset):
    meta = (seg.handle, offset, 16, 10, [4], [], 0)
    with pytest.raises(H.HandleError, match=r"offset_bytes .* outside segment"):
        H.open_tensor_meta(meta, device=0)


def test_open_of_a_freed_segment_is_a_handle_error():
    with H.Segment.create(256) as s:
        handle = s.handle
    with pytest.raises(H.HandleError, match="trainer gone"):
        H.open_tensor_meta((handle, 0, 16, 10, [4], [], 0), device=0)


def test_open_mimics_paddles_length_check_and_wants_bytes(seg):
    with pytest.raises(H.HandleError, match="Invalid Tensor meta info for shared cuda tensor!"):
        H.open_tensor_meta((seg.handle, 0, 16, 10, [4], [], 0, 7), device=0)
    with pytest.raises(H.HandleError, match="must be bytes"):
        H.open_tensor_meta((seg.handle.decode("latin-1"), 0, 16, 10, [4], [], 0), device=0)


# --- normalize_meta -------------------------------------------------------------------------

def _stored(seg):
    return H.share_array(seg, 0, np.arange(8, dtype=np.float16).reshape(2, 4), device_id=5)


def test_normalize_accepts_list_tuple_str_and_bytes_alike(seg):
    stored = _stored(seg)
    as_bytes = [stored[0].encode("latin-1"), *stored[1:]]
    outs = [R.normalize_meta(m, name="w", device=3) for m in (stored, tuple(stored), as_bytes, tuple(as_bytes))]
    assert all(o == outs[0] for o in outs)
    assert outs[0] == (seg.handle, 0, 16, 15, [2, 4], [], 3)


def test_normalize_replaces_device_without_mutating_the_meta(seg):
    stored = _stored(seg)
    before = pickle.dumps(stored)
    assert R.normalize_meta(stored, name="w", device=1)[6] == 1
    assert pickle.dumps(stored) == before, "normalize_meta changed the caller's list"


def test_latin1_handle_with_high_bytes_roundtrips():
    raw = bytes(range(192, 256))  # a real cudaIpcMemHandle_t is arbitrary bytes
    meta = [raw.decode("latin-1"), 0, 4, 10, [1], [], 0]
    assert R.normalize_meta(meta, name="w", device=0)[0] == raw


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda m: m + [7], "8 fields"),
        (lambda m: m[:6], "6 fields"),
        (lambda m: ["\u20ac" * 64, *m[1:]], "handle"),
        (lambda m: [m[0][:63], *m[1:]], "handle"),
        (lambda m: [123, *m[1:]], "handle"),
        (lambda m: [m[0], -1, *m[2:]], "offset_bytes"),
        (lambda m: [m[0], True, *m[2:]], "offset_bytes"),
        (lambda m: [*m[:2], 15, *m[3:]], "size"),
        (lambda m: [*m[:3], 99, *m[4:]], "type_idx"),
        (lambda m: [*m[:3], "float16", *m[4:]], "type_idx"),
        (lambda m: [*m[:4], [2, -4], *m[5:]], "dims"),
        (lambda m: [*m[:4], "2x4", *m[5:]], "dims"),
    ],
    ids=["8-fields", "6-fields", "handle-not-latin1", "handle-63-bytes", "handle-int", "offset-negative",
         "offset-bool", "size-mismatch", "type-unknown", "type-str", "dims-negative", "dims-str"],
)
def test_normalize_errors_name_tensor_and_field(seg, edit, field):
    with pytest.raises(R.MetaError) as info:
        R.normalize_meta(edit(_stored(seg)), name="layers.3.w", device=0)
    assert "'layers.3.w'" in str(info.value) and field in str(info.value), str(info.value)


def test_normalize_rejects_non_sequences():
    with pytest.raises(R.MetaError, match=r"'w' is a dict"):
        R.normalize_meta({"handle": b""}, name="w", device=0)


# --- fixtures.ipc ---------------------------------------------------------------------------

def test_export_packs_aligned_and_writes_a_global_free_pickle(tmp_path):
    from reference.safe_pickle import load_restricted

    arrays = _arrays()
    with I.Export(arrays, device_id=5, per_segment=4) as ex:
        assert len(ex.segments) == -(-len(arrays) // 4)
        assert all(m[1] % I.ALIGN == 0 for m in ex.metas.values())
        assert len({m[0] for m in ex.metas.values()}) == len(ex.segments)
        path = I.write_metas(I.meta_path(tmp_path, 0), ex.metas)
        back = load_restricted(path, allow_arrays=False)  # no global at all
        assert back == ex.metas
        for name, arr in arrays.items():
            got = H.open_tensor_meta(R.normalize_meta(back[name], name=name, device=0), device=0)
            assert got.tobytes() == arr.tobytes() and got.shape == arr.shape, name
        names = ex.segment_names()
    assert not [n for n in names if n in H.leaked_segments()], "Export.close left segments"


def test_paddle_save_refuses_bytes_which_is_why_handles_are_latin1(tmp_path):
    import paddle

    with pytest.raises(NotImplementedError, match="bytes"):
        paddle.save({"w": [b"\0" * 64, 0, 0, 10, [0], [], 0]}, str(tmp_path / "m"))


# --- real CUDA IPC (needs a GPU) ------------------------------------------------------------
#
# A CUDA IPC handle can only be opened by another process, so a spawned child allocates device
# memory, stores a FastDeploy-format meta (handle as latin-1 str, 256-byte offset, trainer device 7)
# and waits; the parent normalises the meta, opens the handle and compares the bytes. The runtime
# calls go through cupy.cuda.runtime, or through libcudart via ctypes where torch provides CUDA.

_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


class _CudartCtypes:
    """The few runtime calls the test needs, with cupy.cuda.runtime's names, over libcudart."""

    def __init__(self):
        import ctypes
        import ctypes.util

        import torch

        torch.cuda.init()  # loads torch's libcudart, so the soname below resolves to the same library
        self.c = ctypes
        names = ["libcudart.so.12", "libcudart.so.11.0", "libcudart.so", ctypes.util.find_library("cudart")]
        self.lib = None
        for n in filter(None, names):
            try:
                self.lib = ctypes.CDLL(n)
                break
            except OSError:
                continue
        if self.lib is None:
            raise OSError("libcudart not found")

        class Handle(ctypes.Structure):
            _fields_ = [("reserved", ctypes.c_char * H.HANDLE_SIZE)]

        self.Handle = Handle

    def _ok(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: cudaError {rc}")

    def setDevice(self, d):
        self._ok(self.lib.cudaSetDevice(self.c.c_int(d)), "cudaSetDevice")

    def malloc(self, n):
        p = self.c.c_void_p()
        self._ok(self.lib.cudaMalloc(self.c.byref(p), self.c.c_size_t(n)), "cudaMalloc")
        return p.value

    def free(self, p):
        self._ok(self.lib.cudaFree(self.c.c_void_p(p)), "cudaFree")

    def memcpy(self, dst, src, n, kind):
        c = self.c
        self._ok(self.lib.cudaMemcpy(c.c_void_p(dst), c.c_void_p(src), c.c_size_t(n), c.c_int(kind)), "cudaMemcpy")

    def deviceSynchronize(self):
        self._ok(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def ipcGetMemHandle(self, p):
        h = self.Handle()
        self._ok(self.lib.cudaIpcGetMemHandle(self.c.byref(h), self.c.c_void_p(p)), "cudaIpcGetMemHandle")
        return bytes(h)

    def ipcOpenMemHandle(self, handle, flags=1):
        p = self.c.c_void_p()
        self.lib.cudaIpcOpenMemHandle.argtypes = [self.c.POINTER(self.c.c_void_p), self.Handle, self.c.c_uint]
        self._ok(self.lib.cudaIpcOpenMemHandle(self.c.byref(p), self.Handle.from_buffer_copy(handle), flags), "cudaIpcOpenMemHandle")
        return p.value

    def ipcCloseMemHandle(self, p):
        self._ok(self.lib.cudaIpcCloseMemHandle(self.c.c_void_p(p)), "cudaIpcCloseMemHandle")


def _runtime(kind: str):
    if kind == "cupy":
        import cupy

        return cupy.cuda.runtime
    return _CudartCtypes()


def _cuda_backend():
    """'cupy' or 'torch' when that library sees a CUDA device; otherwise the test skips."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except Exception:
        pass
    pytest.skip("needs cupy or torch with a CUDA device")


_WANT = np.arange(1000, dtype=np.float32) * 0.5


def _cuda_trainer(kind, conn, done):
    rt = _runtime(kind)
    rt.setDevice(0)
    base = rt.malloc(256 + _WANT.nbytes)
    try:
        rt.memcpy(base + 256, _WANT.ctypes.data, _WANT.nbytes, _H2D)
        rt.deviceSynchronize()
        handle = bytes(rt.ipcGetMemHandle(base))
        code = H.PHI_DTYPE_CODES_PADDLE3["float32"]
        conn.send([handle.decode("latin-1"), 256, _WANT.nbytes, code, [1000], [], 7])
        done.wait(60)  # the allocation must outlive the parent's read
    finally:
        rt.free(base)


@pytest.mark.gpu
def test_real_cuda_ipc_handle_through_a_meta():
    kind = _cuda_backend()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    done = ctx.Event()
    proc = ctx.Process(target=_cuda_trainer, args=(kind, child, done))
    proc.start()
    try:
        assert parent.poll(120), "trainer child sent no meta"
        handle, offset, size, _t, dims, _lod, device = R.normalize_meta(parent.recv(), name="w", device=0)
        assert device == 0 and len(handle) == H.HANDLE_SIZE and offset == 256
        rt = _runtime(kind)
        rt.setDevice(device)
        ptr = rt.ipcOpenMemHandle(handle)
        try:
            got = np.empty(dims, np.float32)
            rt.memcpy(got.ctypes.data, ptr + offset, size, _D2H)
        finally:
            rt.ipcCloseMemHandle(ptr)
        assert got.tobytes() == _WANT.tobytes(), f"bytes read through the IPC handle differ: {got[:4]} vs {_WANT[:4]}"
    finally:
        done.set()
        proc.join(60)
    assert proc.exitcode == 0, f"trainer child exited with {proc.exitcode}"
