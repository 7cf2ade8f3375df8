"""The model digest as the trainer computes it (``sim.trainer.state_digest``: numpy arrays of any layout)
and as the receiver does (``reference.digest.paddle_model_digest``: Paddle tensors), both on the shared
definition in ``reference.digest``: against the spec's oracle (fixtures.digests) for generated arrays, one
changed bit or dtype or shape changing exactly one tensor's digest, C order for every view, no copy of
contiguous memory, and the errors. The conformance rules (SPEC.md § DIGEST) judge the receiver through
an adapter; these judge the trainer's side and the shared module itself.
"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fixtures import digests as D
from reference import digest as R
from sim.trainer import array_hashes, state_digest
from tests.conftest import REPO

DTYPES = [np.dtype(d) for d in (np.float32, np.float16, np.float64, np.int64, np.int32, np.int8, np.uint8, np.bool_)] + [
    np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]


def _raw(dtype, shape):
    """Arrays of ``dtype`` whose bytes are arbitrary: NaN payloads, -0.0, subnormals, every bool byte 0/1."""
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    elements = st.integers(0, 1) if dtype == np.bool_ else None
    return hnp.arrays(uint, shape, elements=elements).map(lambda a: a.view(dtype))


arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: _raw(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))
names = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), min_size=1, max_size=12)


def _digest(state, algorithms=R.DEFAULT_ALGORITHMS):
    return state_digest(state, algorithms).as_dict()


def _differences(a, b) -> list[str]:
    """Names whose digests differ (or that one side lacks), then ``(model)`` if the model digests differ."""
    names = sorted(set(a["tensors"]) | set(b["tensors"]))
    out = [n for n in names if a["tensors"].get(n) != b["tensors"].get(n)]
    return out + (["(model)"] if a["model"] != b["model"] else [])


@settings(max_examples=200, deadline=None)
@given(state=st.dictionaries(names, arrays, min_size=1, max_size=5))
def test_model_digest_equals_the_spec(state):
    assert _digest(state) == D.model(state)


@settings(max_examples=200, deadline=None)
@given(arr=arrays.filter(lambda a: a.size > 0), data=st.data())
def test_one_flipped_bit_changes_exactly_that_tensor(arr, data):
    state = {"a": arr, "b": arr.copy(), "c": np.zeros(3, np.float32)}
    byte = data.draw(st.integers(0, arr.nbytes - 1), "byte")
    bit = data.draw(st.integers(0, 0 if arr.dtype == np.bool_ else 7), "bit")
    changed = arr.copy()
    changed.reshape(-1).view(np.uint8)[byte] ^= 1 << bit
    before, after = _digest(state), _digest({**state, "a": changed})
    assert _differences(before, after) == ["a", "(model)"], (byte, bit)


@pytest.mark.parametrize("case, a, b", [
    ("bf16 as fp16", np.ones((2, 3), ml_dtypes.bfloat16), np.ones((2, 3), ml_dtypes.bfloat16).view(np.float16)),
    ("uint8 as fp8", np.arange(4, dtype=np.uint8), np.arange(4, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)),
    ("int32 as float32", np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32).view(np.float32)),
    ("[2, 3] as [3, 2]", np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(6, dtype=np.float32).reshape(3, 2)),
    ("[] as [1]", np.array(7, np.int64), np.array([7], np.int64)),
    ("[0] as [0, 4]", np.zeros(0, np.float32), np.zeros((0, 4), np.float32)),
    ("-0.0 as +0.0", np.array([-0.0], ml_dtypes.bfloat16), np.array([0.0], ml_dtypes.bfloat16)),
])
def test_same_bytes_other_dtype_or_shape(case, a, b):
    state = {"x": np.ones(2, np.float32), "t": a}
    assert _differences(_digest(state), _digest({**state, "t": b})) == ["t", "(model)"], case


def test_names_order_and_twins():
    arr = np.arange(4, dtype=np.float32)
    forward, backward = _digest({"a": arr, "b": arr}), _digest({"b": arr, "a": arr})
    assert forward == backward  # name order, not insertion order
    assert forward["tensors"]["a"] != forward["tensors"]["b"]
    assert _differences(forward, _digest({"a": arr, "c": arr})) == ["b", "c", "(model)"]


@pytest.mark.parametrize("view", [
    lambda a: a.T, lambda a: a[::2], lambda a: a[:, ::-1], lambda a: a[1:, 1:3], lambda a: np.asfortranarray(a),
    lambda a: a.astype(a.dtype.newbyteorder(">")),
], ids=["transposed", "every-other-row", "reversed-columns", "window", "fortran", "big-endian"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "float8_e5m2"])
def test_views_digest_in_c_order_little_endian(view, dtype):
    base = np.arange(24, dtype=np.float32).reshape(4, 6).astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))
    v = view(base)
    assert array_hashes("t", v) == array_hashes("t", np.array(v, order="C", dtype=v.dtype.newbyteorder("=")))
    assert array_hashes("t", v) == D.model({"t": v})["tensors"]["t"]


def test_contiguous_memory_is_hashed_in_place(monkeypatch):
    seen = []
    real = R.tensor_hashes

    def spy(name, dtype, shape, data, algorithms):
        seen.append(np.frombuffer(data, np.uint8).ctypes.data)
        return real(name, dtype, shape, data, algorithms)

    monkeypatch.setattr(R, "tensor_hashes", spy)
    arr = np.arange(1 << 16, dtype=np.float32)
    array_hashes("w", arr)
    t = paddle.to_tensor(arr)
    R.paddle_tensor_hashes("w", t, ["xxh3"])
    assert seen == [arr.ctypes.data, t.data_ptr()], "a C-contiguous array or a CPU tensor was copied before hashing"


PADDLE_CASES = [pytest.param(d, shape, id=f"{d}-{label}") for d in
                ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "uint8", "bool")
                for label, shape in (("0-d", ()), ("zero-element", (0, 4)), ("small", (3, 5)))]
PADDLE_CASES += [pytest.param(d, (1 << 22,), id=f"{d}-large") for d in ("float32", "bfloat16")]  # 16 and 8 MiB


@pytest.mark.parametrize("dtype, shape", PADDLE_CASES)
def test_paddle_tensor_digests_like_its_numpy_array(dtype, shape):
    """The receiver's Paddle parameter and the trainer's numpy array of the same bytes digest alike."""
    from fixtures.models import ParamSpec, weights

    arr = np.array(weights(ParamSpec("w", dtype, shape)))
    if dtype == "bfloat16":
        t = paddle.to_tensor(arr.view(np.uint16))
    elif dtype.startswith("float8"):
        t = paddle.to_tensor(arr.view(np.uint8)).view(getattr(paddle, dtype))
    else:
        t = paddle.to_tensor(arr)
    assert R.paddle_tensor_hashes("w", t, R.DEFAULT_ALGORITHMS) == array_hashes("w", arr) == D.model({"w": arr})["tensors"]["w"]


def test_errors_name_the_tensor():
    with pytest.raises(ValueError, match="'o'.*objects"):
        array_hashes("o", np.array([object()]))
    with pytest.raises(KeyError, match="sha1"):
        state_digest({"x": np.zeros(1)}, ["sha1"])
    with paddle.LazyGuard():
        lazy = paddle.nn.Layer().create_parameter([2, 3], dtype="float32")
    with pytest.raises(RuntimeError, match=r"'p' \(float32\[2, 3\]\) holds no data"):
        R.paddle_model_digest([("p", lazy)], ["xxh3"])


def test_one_algorithm_alone():
    state = {"w": np.arange(3, dtype=np.float32)}
    full = D.model(state)
    for alg in ("xxh3", "md5"):
        got = _digest(state, [alg])
        assert got == {"model": {alg: full["model"][alg]}, "tensors": {"w": {alg: full["tensors"]["w"][alg]}}}
    assert _differences(_digest(state, ["xxh3"]), _digest(state, ["md5"])) == ["w", "(model)"]  # nothing in common


def test_the_trainer_side_needs_no_paddle():
    code = "import sys, numpy as np; from sim.trainer import state_digest; state_digest({'w': np.zeros(3)}); " \
           "assert 'paddle' not in sys.modules, 'the trainer side imported paddle'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_benchmark_script_smoke(tmp_path):
    """benchmarks/digest_throughput.py on 8 MiB, one round, so the script cannot rot."""
    import json

    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.digest_throughput", "--model-mib", "8", "--repeat", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode in (0, 1), f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    for want in ("memcpy", "md5, one buffer", "sha256, one buffer", "xxh3-128, one buffer", "model digest, xxh3 (receiver"):
        assert any(n.startswith(want) for n in names), f"row {want!r} missing: {names}"
    assert report["bytes"] >= 8 << 20 and all(r["best_s"] > 0 and r["x_memcpy_best"] > 0 for r in report["rows"]), report
    assert "x memcpy (median)" in proc.stdout and "target:" in proc.stdout, proc.stdout
