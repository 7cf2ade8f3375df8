"""Tensors above Linux's 2 GiB read limit (FILE-OVER-2GIB). Spec: SPEC.md § FILE.

One ``read``/``pread``/``preadv`` never returns more than 0x7ffff000 bytes on Linux, and POSIX lets any
read return fewer bytes than asked: a loader must continue each read where the last one ended, and a
read that returns nothing (end of file) is an error, never another turn of the loop. A 152k x 8192 bf16
embedding is 2.5 GB: real models carry tensors past the limit.

Two cases prove it:

- the quick one (every run): every read of a forked child is capped at 4093 bytes at the C library seam
  (``conformance.read_cap``, from outside the implementation), and every snapshot level loads bit-exact,
  the header too (padded past two caps): the continuation logic a 2 GiB tensor needs, in milliseconds;
- the ``huge`` tier (``-m huge``): a sparse file with one tensor of 2 GiB + 16 KiB (holes read as zeros,
  distinct bytes at both sides of 0x7ffff000 and 2**31, counted in the tensor and in the file, and at
  its end), loaded in a forked child whose peak memory stays within MEM-SNAPSHOT-PEAK's bound; the
  loaded tensor is compared at those places and in sampled holes.
"""
import json
import os

import numpy as np
import pytest
import safetensors.numpy

from conformance import check, harness, heap, read_cap
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

CAPPED_TIMEOUT_S = 10.0  # a loader that never ends under the cap (no continuation) is killed after this


def _p(where, caps, id, *marks):
    return pytest.param(where, marks=[pytest.mark.requires(*caps), *marks], id=id)


# -- the quick case: every read capped ---------------------------------------------------------------
# Each tensor larger than the cap ends in a partial one (12416 = 3 x 4093 + 137; 20000 = 4 x 4093 + 3628),
# a bf16 and a float32 one, after a 12-byte tensor (odd data offsets), and a 0-d one.
CAPPED = M.spec(
    ("a.bias", "float32", (3,)),
    ("embed.weight", "bfloat16", (64, 97)),
    ("lm_head.weight", "float32", (5000,)),
    ("norm.scale", "float32", ()),
)
# A safetensors header longer than two caps: its read has to continue too.
PADDING = {"format": "np", "padding": "x" * (2 * read_cap.CAP_BYTES + 100)}


def _random_state(spec, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {p.name: np.frombuffer(rng.bytes(p.nbytes), M.NUMPY_DTYPES[p.dtype]).reshape(p.shape) for p in spec.main}


def _write_safetensors(path, tensors) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    safetensors.numpy.save_file({k: np.require(v, requirements="C") for k, v in tensors.items()}, path, metadata=PADDING)
    return path


def _write_level(loader, level, state) -> list[str]:
    if level == "parts":
        return [_write_safetensors(S.part_path(loader.model_dir, 0, 0, i), group) for i, group in enumerate(S.split(state, 3))]
    if level == "single":
        return [_write_safetensors(S.single_path(loader.model_dir, 0, 0), state)]
    if level == "legacy":
        path = S.legacy_path(loader.model_dir, 0)
        return [S.write_pickle_fallback(path, state) if S.writes_pickle("legacy") else _write_safetensors(path, state)]
    return [S.write_pickle_fallback(S.fallback_path(loader.shared_dir, 0, 0), state)]


def _differences(observed, expected) -> list[str]:
    out = []
    for name, want in expected.items():
        got = observed.get(name)
        want_bytes = np.ascontiguousarray(want).tobytes()
        if got is None or got.data is None:
            out.append(f"{name}: {'not a parameter' if got is None else 'not loaded'}")
        elif got.data != want_bytes:
            if len(got.data) != len(want_bytes):
                out.append(f"{name}: {len(got.data)} bytes, expected {len(want_bytes)}")
                continue
            at = next(i for i, (a, b) in enumerate(zip(got.data, want_bytes)) if a != b)
            out.append(f"{name}: first wrong byte at {at} of {len(want_bytes)} (got {got.data[at]:#04x}, expected "
                       f"{want_bytes[at]:#04x}; the cap ends each read after {read_cap.CAP_BYTES} bytes)")
    return out


def _capped_update(session, capped, expected, with_status) -> dict:
    """In the forked child: cap every read, update, report what was loaded wrong."""
    capped.install()
    before = capped.shortened()
    try:
        session.update()
    except Exception as e:  # noqa: BLE001 (judged by the test: a read cut short is no reason to fail)
        return {"shortened": capped.shortened() - before, "raised": f"{type(e).__name__}: {e}"}
    result = {"shortened": capped.shortened() - before, "problems": _differences(session.observe(), expected)}
    if with_status:
        result["status"] = session.status()
    return result


@pytest.mark.rule("FILE-OVER-2GIB")
@pytest.mark.parametrize("level", [
    _p("single", ["snapshot.single"], "single"),
    _p("parts", ["snapshot.parts"], "parts"),
    _p("legacy", ["snapshot.legacy"], "legacy"),
    _p("shared", ["snapshot.shared_fallback"], "shared"),
])
def test_every_read_capped_loads_bit_exact(loader, level, read_capper):
    state = _random_state(CAPPED, 29)
    paths = _write_level(loader, level, state)
    session = loader.open(CAPPED)
    with_status = "status" in loader.adapter.capabilities
    where = f"{level} snapshot {paths}, every read of the loading process capped at {read_cap.CAP_BYTES} bytes"
    try:
        result = harness.in_child(_capped_update, session, read_capper, state, with_status, timeout_s=CAPPED_TIMEOUT_S)
    except harness.ChildTimedOut as e:
        check.that(False, f"{where}: the update did not end within {CAPPED_TIMEOUT_S:g} s: a read that returned fewer "
                          f"bytes than asked was not continued where it ended ({e})")
        return
    check.that("raised" not in result, f"{where} ({result['shortened']} reads shortened): the update raised "
               f"{result.get('raised')!r}: a read that returns fewer bytes than asked is not the end of the file")
    check.that(not result["problems"], f"{where} ({result['shortened']} reads shortened): tensors wrong: {result['problems']}")
    if with_status:
        check.that(result["status"] == "NORMAL", f"{where}: status {result['status']!r} after the update, expected 'NORMAL'")


# -- the huge tier: a sparse file with a tensor over 2 GiB --------------------------------------------
LINUX_READ_MAX = 0x7FFFF000  # MAX_RW_COUNT: the most one read call returns
TWO_GIB = 1 << 31
ROWS, COLS = (TWO_GIB >> 14) + 1, 8192  # bf16: 2 GiB + 16 KiB
HUGE = M.spec(("a.bias", "float32", (3,)), ("embed.weight", "bfloat16", (ROWS, COLS)))
HUGE_NBYTES = ROWS * COLS * 2
MARK = 16  # distinct bytes written at each place, half before it and half from it
HUGE_TIMEOUT_S = 420.0
SLACK_MIB = 64  # MEM-SNAPSHOT-PEAK's allowance for the allocator


def _places(tensor_file_offset: int) -> list[int]:
    """Tensor byte offsets to mark: its start and end, the read limit and 2 GiB counted in the tensor
    (where a second read starts) and counted in the file (where a 32-bit file offset wraps)."""
    places = {0, HUGE_NBYTES}
    for boundary in (LINUX_READ_MAX, TWO_GIB):
        places.add(boundary)
        places.add(boundary - tensor_file_offset)
    return sorted(places)


def _write_huge(path, small, seed: int) -> dict:
    """A safetensors file of ``a.bias`` (``small``; None: left out) then ``embed.weight`` (2 GiB + 16 KiB),
    sparse: only the header, the small tensor and the marks are written. Returns {tensor byte offset: bytes} of the marks."""
    lead = 0 if small is None else small.nbytes
    header = {} if small is None else {"a.bias": {"dtype": "F32", "shape": [3], "data_offsets": [0, lead]}}
    header["embed.weight"] = {"dtype": "BF16", "shape": [ROWS, COLS], "data_offsets": [lead, lead + HUGE_NBYTES]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    at = data_start + lead  # the big tensor's first byte in the file
    rng = np.random.default_rng(seed)
    marks = {}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, at + HUGE_NBYTES)
        os.pwrite(fd, len(raw).to_bytes(8, "little") + raw + (b"" if small is None else small.tobytes()), 0)
        for place in _places(at):
            begin, end = max(0, place - MARK // 2), min(HUGE_NBYTES, place + MARK // 2)
            marks[begin] = rng.bytes(end - begin).replace(b"\0", b"\1")  # never a zero: a hole cannot match
            os.pwrite(fd, marks[begin], at + begin)
    finally:
        os.close(fd)
    return marks, _places(at)


def _holes(places: list[int]) -> list[tuple[int, int]]:
    """Sampled ranges no mark touches, which must read as zeros: 64 bytes right after each mark (a
    continuation landed a few bytes off puts a mark there) and 4 KiB midway between two marks."""
    holes = []
    for a, b in zip(places, places[1:]):
        if b - a >= MARK + 64:
            holes.append((a + MARK // 2, a + MARK // 2 + 64))
        if b - a >= 4 * 4096:
            mid = (a + b) // 2 // 4096 * 4096
            holes.append((mid, mid + 4096))
    return holes


def _huge_update(session, small: np.ndarray, marks: dict, places: list) -> dict:
    """In the forked child: the update measured (VmHWM from the unloaded baseline), then the marks and
    holes of the loaded tensor compared (observe() copies it twice: after the measurement)."""
    with heap.isolated():  # the worker's freed holes must not serve (and inflate) the update
        base = harness.rss_kib()
        harness.reset_peak_rss()
        session.update()
        peak_kib = harness.peak_rss_kib() - base
    observed = session.observe()
    problems = []
    got = observed.get("a.bias")
    if got is None or got.data != small.tobytes():
        problems.append(f"a.bias: got {None if got is None else got.data!r}, expected {small.tobytes()!r}")
    big = observed.get("embed.weight")
    data = None if big is None else big.data
    if data is None or len(data) != HUGE_NBYTES:
        problems.append(f"embed.weight: {'not loaded' if data is None else f'{len(data)} bytes'}, expected {HUGE_NBYTES}")
    else:
        for begin, want in marks.items():
            if data[begin:begin + len(want)] != want:
                problems.append(f"embed.weight bytes [{begin:#x}, {begin + len(want):#x}): got "
                                f"{data[begin:begin + len(want)].hex()}, expected {want.hex()}")
        for begin, end in _holes(places):
            if data[begin:end].count(0) != end - begin:
                problems.append(f"embed.weight bytes [{begin:#x}, {end:#x}) (a hole of the file) are not all zero")
    return {"peak_kib": peak_kib, "problems": problems}


@pytest.mark.huge
@pytest.mark.timeout(HUGE_TIMEOUT_S + 120)
@pytest.mark.rule("FILE-OVER-2GIB")
@pytest.mark.parametrize("level", [
    _p("single", ["snapshot.single"], "single"),
    _p("parts", ["snapshot.parts"], "parts"),
])
def test_tensor_over_2gib_loads(loader, level):
    small = np.frombuffer(np.random.default_rng(5).bytes(12), np.float32)
    if level == "parts":  # the big tensor alone in the last of two parts, the small one before it
        S.write_safetensors(S.part_path(loader.model_dir, 0, 0, 0), {"a.bias": small})
        path = S.part_path(loader.model_dir, 0, 0, 1)
        marks, places = _write_huge(path, None, 7)
        k = 2
    else:
        path = S.single_path(loader.model_dir, 0, 0)
        marks, places = _write_huge(path, small, 7)
        k = 1
    session = loader.open(HUGE)
    where = f"{level} snapshot, {path} holding embed.weight bf16 {[ROWS, COLS]} ({HUGE_NBYTES} bytes, sparse)"
    try:
        result = harness.in_child(_huge_update, session, small, marks, places, timeout_s=HUGE_TIMEOUT_S)
    except harness.ChildTimedOut as e:
        check.that(False, f"{where}: the update did not end within {HUGE_TIMEOUT_S:g} s: a read past Linux's "
                          f"{LINUX_READ_MAX:#x}-byte limit per call was not continued where it ended ({e})")
        return
    check.that(not result["problems"], f"{where}: {result['problems']}")
    bound = HUGE.nbytes * (1 + 1.5 / k) / 1024 + SLACK_MIB * 1024
    check.that(result["peak_kib"] < bound, f"{where}: peak resident growth {result['peak_kib'] / 1024:.0f} MiB during "
               f"update(), expected under M (1 + 1.5/{k}) + {SLACK_MIB} MiB = {bound / 1024:.0f} MiB (MEM-SNAPSHOT-PEAK)")
