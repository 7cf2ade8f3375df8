"""Digests: FastDeploy's debug digest line, and the model digest of what landed. Spec: SPEC.md § DIGEST.

The oracle is ``fixtures.digests``, written from the spec: the trainer's digest of what it sent. The
model digest is read from the session after updates over every path (snapshot single file and parts,
ipc metas, ipc buckets, main + MTP); the sensitivity cases reload one session with one element, dtype,
shape or name changed and compare the two digests tensor by tensor. Tensors are tiny (the largest is
1 KiB, longer than any prefix-and-suffix sample a digest might take), but for the middle-byte cases of
tensors over 1 MiB (1 MiB + 1 byte, 2 MiB + 2 KiB), where a digest might start sampling.
"""
import os
import re

import ml_dtypes
import numpy as np
import paddle
import pytest

from conformance import check
from conformance.paths import Route
from weightsync.fixtures import buckets as B
from weightsync.fixtures import digests as D
from weightsync.fixtures import ipc as I
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

ALGS = ("xxh3", "md5")
# Capture order is not name order, so a model digest taken in capture order differs from the spec's.
MAIN = (
    ("norm.weight", "float32", (16, 16)),
    ("embed.weight", "bfloat16", (4, 8)),
    ("layers.0.mlp.weight", "float8_e4m3fn", (4, 4)),
    ("layers.0.mlp.scale", "float32", ()),
    ("layers.0.bias", "float16", (0, 4)),
    ("lm_head.weight", "float8_e5m2", (2, 8)),
    ("position_ids", "int64", (1, 6)),
    ("attn_mask", "bool", (3, 3)),
    ("vocab", "uint8", (5,)),
    ("twin.a", "float32", (4,)),
    ("twin.b", "float32", (4,)),
)
MTP = (("mtp.0.proj.weight", "bfloat16", (4, 4)), ("mtp.0.norm.weight", "float32", (4,)))
SPEC = M.spec(*MAIN)
SPEC_MTP = M.spec(*MAIN, mtp=[MTP])


def _bits(arr: np.ndarray, index, bits: int) -> None:
    """Write the raw bit pattern ``bits`` into element ``index`` of ``arr`` (in place)."""
    raw = arr.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize])
    raw[index] = bits


def _state(spec, version=1) -> dict:
    """The spec's weights with the values a value-based digest gets wrong: -0.0 and NaNs with
    payloads in bf16, fp32 and fp8, and two tensors with the same dtype, shape and bytes."""
    st = {n: np.array(a) for n, a in M.state(spec, version=version).items()}  # 0-d as an array, not a scalar
    _bits(st["embed.weight"], (0, 0), 0x8000)  # bf16 -0.0
    _bits(st["embed.weight"], (0, 1), 0x7FC1)  # bf16 quiet NaN, payload 1
    _bits(st["norm.weight"], (3, 3), 0x7FC00001)  # fp32 NaN, payload 1
    _bits(st["lm_head.weight"], (1, 7), 0x7D)  # fp8 e5m2 NaN, payload 1
    st["twin.b"] = st["twin.a"].copy()
    return st


def _compare(got, want, where: str) -> None:
    """``got`` (the session's digest) equals ``want`` (the oracle's), tensor by tensor and whole."""
    check.that(isinstance(got, dict) and isinstance(got.get("tensors"), dict) and isinstance(got.get("model"), dict),
               f"{where}: digest() returned {type(got).__name__} {str(got)[:200]}, expected "
               "{'model': {alg: hex}, 'tensors': {name: {alg: hex}}}")
    problems = []
    for name in sorted(set(want["tensors"]) | set(got["tensors"])):
        g, w = got["tensors"].get(name), want["tensors"].get(name)
        if g is None or w is None:
            problems.append(f"{name}: {'missing from the digest' if g is None else 'not a tensor the trainer sent'}")
            continue
        problems += [f"{name} {alg}: got {g.get(alg)}, expected {w[alg]}" for alg in ALGS if g.get(alg) != w[alg]]
    problems += [f"(model) {alg}: got {got['model'].get(alg)}, expected {want['model'][alg]}"
                 for alg in ALGS if got["model"].get(alg) != want["model"][alg]]
    check.that(not problems, f"{where}: the receiver's digest differs from the trainer's in {len(problems)} place(s):\n  "
               + "\n  ".join(problems))


def _changed(a, b) -> set:
    """Names whose digests differ between two digests (any algorithm), plus ``(model)``."""
    out = {n for n in a["tensors"] if any(a["tensors"][n][alg] != b["tensors"].get(n, {}).get(alg) for alg in ALGS)}
    if any(a["model"][alg] != b["model"][alg] for alg in ALGS):
        out.add("(model)")
    return out


# -- the paths ------------------------------------------------------------------------------------
def _snapshot(kind):
    def publish(loader, st):
        for name in os.listdir(loader.model_dir):  # the trainer replaces the previous version's files
            os.remove(os.path.join(loader.model_dir, name))
        if kind == "single":
            S.write_safetensors(S.single_path(loader.model_dir, 0, 0), st)
        else:
            S.write_parts(loader.model_dir, 0, 0, dict(enumerate(S.split(st, 3))))
    return publish


@pytest.fixture
def exports():
    """The ipc trainer's exports, each freed at teardown."""
    made = []
    yield made
    for e in made:
        e.close()


def _open(loader, spec, path, exports, states):
    """A session on ``path`` that will see ``states`` in turn, one per update, and ``ready(st)``: what comes
    before each update (the trainer publishes ``st``; the clear, except on the streamed paths: in place)."""
    if path in ("rsync", "gdr"):
        rt = Route(loader, path)
        exports.append(rt)
        session = rt.open(spec)
        versions = iter(range(1, len(states) + 1))
        return session, lambda st: (rt.publish(0, st, next(versions)), rt.clear(0))
    if path == "buckets":
        pub = B.Publisher(512)
        exports.append(pub)
        pub.serve(*(B.pack(st, v, 512) for v, st in enumerate(states, 1)))
        session = loader.open(spec, strategy="ipc_bucket", options=pub.options(None, timeout_s=5.0))
        return session, lambda st: session.clear()
    if path == "meta":
        session = loader.open(spec, strategy="ipc")

        def publish(st):
            export = I.Export(st)
            exports.append(export)
            I.write_metas(I.meta_path(loader.shared_dir, 0), export.metas)
            session.clear()
        return session, publish
    publish = _snapshot(path)
    session = loader.open(spec)
    return session, lambda st: (publish(loader, st), session.clear())


def _update(session, ready, st) -> dict:
    ready(st)
    session.update()
    return session.digest()


PATHS = [
    pytest.param("single", SPEC, marks=pytest.mark.requires("snapshot.single", "digest.model"), id="single"),
    pytest.param("parts", SPEC, marks=pytest.mark.requires("snapshot.parts", "digest.model"), id="parts"),
    pytest.param("meta", SPEC, marks=[pytest.mark.requires("ipc.meta", "digest.model"), pytest.mark.ipc], id="ipc-meta"),
    pytest.param("buckets", SPEC, marks=[pytest.mark.requires("ipc.buckets", "digest.model"), pytest.mark.buckets],
                 id="ipc-buckets"),
    pytest.param("single", SPEC_MTP, marks=pytest.mark.requires("snapshot.single", "mtp", "digest.model"), id="single-mtp"),
    pytest.param("rsync", SPEC, marks=[pytest.mark.requires("stream.rsync", "digest.model"), pytest.mark.streams], id="rsync"),
    pytest.param("gdr", SPEC, marks=[pytest.mark.requires("stream.gdr", "digest.model"), pytest.mark.streams], id="gdr"),
]


@pytest.mark.rule("DIGEST-MODEL-LANDED")
@pytest.mark.parametrize("path, spec", PATHS)
def test_receiver_digest_equals_trainer_digest(loader, exports, path, spec):
    v1, v2 = _state(spec, 1), _state(spec, 2)
    session, publish = _open(loader, spec, path, exports, [v1, v2])
    for version, st in ((1, v1), (2, v2)):
        got = _update(session, publish, st)
        want = D.model(st)
        _compare(got, want, f"{path}, version {version} ({len(st)} tensors)")
        check.that(got["tensors"]["twin.a"] != got["tensors"]["twin.b"],
                   f"{path}: twin.a and twin.b (same dtype, shape and bytes, different names) share the digest "
                   f"{got['tensors']['twin.a']}")


# -- sensitivity: one element, dtype, shape or name changed ---------------------------------------
def _set(name, index, bits):
    def edit(st):
        _bits(st[name], index, bits)
    return edit


def _add_one(name, index):
    def edit(st):
        raw = st[name].view({1: np.uint8, 2: np.uint16, 4: np.uint32}[st[name].dtype.itemsize])
        raw[index] ^= 1  # the lowest bit of one element
    return edit


VALUE_CHANGES = {  # case -> (tensor, edit of a copy of the base state)
    "first element": ("norm.weight", _add_one("norm.weight", (0, 0))),
    "middle element": ("norm.weight", _add_one("norm.weight", (8, 0))),
    "last element": ("norm.weight", _add_one("norm.weight", (15, 15))),
    "bf16 -0.0 to +0.0": ("embed.weight", _set("embed.weight", (0, 0), 0x0000)),
    "bf16 NaN payload 1 to 2": ("embed.weight", _set("embed.weight", (0, 1), 0x7FC2)),
    "fp32 NaN payload 1 to 2": ("norm.weight", _set("norm.weight", (3, 3), 0x7FC00002)),
    "fp8 e5m2 NaN payload 1 to 2": ("lm_head.weight", _set("lm_head.weight", (1, 7), 0x7E)),
    "0-d scalar": ("layers.0.mlp.scale", _add_one("layers.0.mlp.scale", ())),
    "last bool": ("attn_mask", lambda st: st["attn_mask"].__setitem__((2, 2), not st["attn_mask"][2, 2])),
}


def _respec(name, dtype=None, shape=None):
    """SPEC with one tensor's dtype or shape changed, and the base state's bytes under it."""
    params = [(n, dtype or d, shape if shape is not None else s) if n == name else (n, d, s) for n, d, s in MAIN]

    def restate(st):
        arr = st[name]
        if dtype:
            arr = arr.view(M.NUMPY_DTYPES[dtype])
        st[name] = arr.reshape(shape) if shape is not None else arr
    return M.spec(*params), restate


LAYOUT_CHANGES = {  # case -> (tensor, (spec, edit)): same bytes, another dtype or shape
    "bf16 as fp16": ("embed.weight", _respec("embed.weight", dtype="float16")),
    "uint8 as fp8 e4m3": ("vocab", _respec("vocab", dtype="float8_e4m3fn")),
    "[16, 16] as [8, 32]": ("norm.weight", _respec("norm.weight", shape=(8, 32))),
    "[] as [1]": ("layers.0.mlp.scale", _respec("layers.0.mlp.scale", shape=(1,))),
}


def _only_changed(base, got, want, name, where):
    _compare(got, want, where)
    check.equal(_changed(base, got), {name, "(model)"}, f"{where}: tensors whose digest changed")


@pytest.mark.rule("DIGEST-MODEL-SENSITIVE")
@pytest.mark.requires("snapshot.single", "digest.model")
def test_one_change_changes_exactly_that_tensors_digest(loader):
    base_state = _state(SPEC)
    session, publish = _open(loader, SPEC, "single", None, [])
    base = _update(session, publish, base_state)
    _compare(base, D.model(base_state), "base model")
    for case, (name, edit) in VALUE_CHANGES.items():
        st = {n: a.copy() for n, a in base_state.items()}
        edit(st)
        _only_changed(base, _update(session, publish, st), D.model(st), name, f"{case} of {name}")
    for case, (name, (spec, restate)) in LAYOUT_CHANGES.items():
        st = dict(base_state)
        restate(st)
        other, publish = _open(loader, spec, "single", None, [])
        _only_changed(base, _update(other, publish, st), D.model(st), name, f"{name}: {case}")


# Above 1 MiB a "fast" digest may sample (the first and last half MiB, a stride), or sample only above a larger
# size. One byte changed in the middle must change the tensor's digest: the middle byte of tensors of 1 MiB + 1
# byte and 2 MiB + 2 KiB; and a tensor of 8 MiB + 1 byte (zeros, in a model of its own, loaded twice: cost)
# digests exactly, before and after a byte just past its middle, at an odd offset (on no power-of-two stride), changes.
LARGE = (("big.odd", "uint8", ((1 << 20) + 1,)), ("big.bf16", "bfloat16", (1024, 1025)))
SPEC_LARGE = M.spec(*LARGE)
SPEC_HUGE = M.spec(("big.8mib", "uint8", ((8 << 20) + 1,)))
MIDDLE_BYTES = {"middle byte": lambda size: size // 2, "odd byte past the middle": lambda size: size // 2 + 1027}


def _flip_byte(name, offset):
    def edit(st):
        raw = st[name].reshape(-1).view(np.uint8)
        raw[offset] ^= 0x10  # one bit of one byte
    return edit


@pytest.mark.rule("DIGEST-MODEL-SENSITIVE")
@pytest.mark.requires("snapshot.single", "digest.model")
def test_one_middle_byte_of_a_large_tensor_changes_its_digest(loader):
    for spec, offsets in ((SPEC_LARGE, {"middle byte": MIDDLE_BYTES["middle byte"]}),
                          (SPEC_HUGE, {"odd byte past the middle": MIDDLE_BYTES["odd byte past the middle"]})):
        base_state = M.state(spec) if spec is SPEC_LARGE else {p.name: np.zeros(p.shape, np.uint8) for p in spec.main}
        session, publish = _open(loader, spec, "single", None, [])
        base = _update(session, publish, base_state)
        _compare(base, D.model(base_state), f"base model of tensors over 1 MiB {[p.name for p in spec.main]}")
        for param in spec.main:
            for where, at in offsets.items():
                st = {n: a.copy() for n, a in base_state.items()}
                nbytes = st[param.name].nbytes
                _flip_byte(param.name, at(nbytes))(st)
                _only_changed(base, _update(session, publish, st), D.model(st), param.name,
                              f"byte {at(nbytes)} of {nbytes} ({where}; {param.dtype} {list(param.shape)}) changed in {param.name}")


@pytest.mark.rule("DIGEST-MODEL-INCOMPLETE")
@pytest.mark.requires("snapshot.single", "digest.model")
def test_no_digest_of_a_model_not_loaded(loader):
    names = [p.name for p in SPEC.all_params if 0 not in p.shape]  # a zero-element tensor is never "not loaded"
    any_name = "|".join(re.escape(n) for n in names)
    session, publish = _open(loader, SPEC, "single", None, [])

    def refused(when):
        with check.raises(RuntimeError, match=any_name, where=f"digest() {when}"):
            session.digest()

    refused("before the first update")
    v1 = _state(SPEC, 1)
    _compare(_update(session, publish, v1), D.model(v1), "version 1")
    session.clear()
    refused("after clear()")
    bad = _state(SPEC, 2)
    bad["twin.b"] = bad["twin.b"].astype(np.float16)  # the last tensor's dtype is wrong: the update fails
    publish(bad)
    with check.raises(TypeError, match="twin.b", where="update with twin.b as float16"):
        session.update()
    refused("after a failed update")
    v3 = _state(SPEC, 3)
    session.clear()
    _compare(_update(session, publish, v3), D.model(v3), "version 3 after the failed update")


# -- FastDeploy's debug digest --------------------------------------------------------------------
def _paddle(arr: np.ndarray):
    """A Paddle tensor holding ``arr``'s bytes (bf16 travels as uint16 bits, fp8 as uint8)."""
    name = arr.dtype.name
    if name == "bfloat16":
        return paddle.to_tensor(arr.view(np.uint16)).view(paddle.bfloat16)
    if name.startswith("float8"):
        return paddle.to_tensor(arr.view(np.uint8)).view(getattr(paddle, name))
    return paddle.to_tensor(arr)


def _values(dtype, shape, seed=0):
    return M.weights(M.ParamSpec("x", dtype, shape), seed=seed)


def _debug_cases():
    """case -> tensor: every carried dtype as a Paddle tensor, numpy arrays, 0-d, a transposed view,
    values whose float32 sum differs from their float64 sum, NaN and infinity, non-numeric data."""
    cases = {f"paddle {d}": _paddle(_values(d, (2, 3))) for d in
             ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "uint8", "bool")}
    signed_zero = np.zeros(3, ml_dtypes.bfloat16)
    _bits(signed_zero, 1, 0x8000)
    cases |= {
        "paddle 0-d": _paddle(np.float32(2.5).reshape(())),
        "paddle bf16 with -0.0": _paddle(signed_zero),
        "numpy float32": _values("float32", (2, 3)),
        "numpy int64": _values("int64", (4,)),
        "numpy bool": _values("bool", (3, 2)),
        "numpy 0-d": np.float32(-1.5).reshape(()),
        "numpy transposed [3, 4] view": np.arange(12, dtype=np.float32).reshape(3, 4).T,
        "numpy every other row": np.arange(24, dtype=np.int32).reshape(6, 4)[::2],
        "float32 sum rounding": np.array([1e8, 1.0, -1e8, 1.0], np.float32),
        "NaN and inf": np.array([np.nan, 1.0, np.inf], np.float32),
        "non-numeric": np.array(["a", "b"]),
    }
    return cases


def _same_line(session, tensor, case) -> None:
    before = np.asarray(tensor.numpy() if isinstance(tensor, paddle.Tensor) else tensor).copy()
    got = session.debug_digest(tensor)
    want = D.debug_line(tensor)
    check.equal(got, want, f"debug digest of {case}")
    after = np.asarray(tensor.numpy() if isinstance(tensor, paddle.Tensor) else tensor)
    check.that(after.tobytes() == before.tobytes(), f"{case}: debug_digest() changed the tensor it digested")


@pytest.mark.rule("DIGEST-DEBUG-FORMAT")
@pytest.mark.requires("digest.debug")
def test_debug_digest_line_is_fastdeploys(loader):
    session = loader.open(M.spec(("w", "float32", (1,))))
    for case, tensor in _debug_cases().items():
        _same_line(session, tensor, case)


@pytest.mark.rule("DIGEST-DEBUG-EDGE")
@pytest.mark.requires("digest.debug")
def test_debug_digest_of_empty_and_ml_dtypes_arrays(loader):
    session = loader.open(M.spec(("w", "float32", (1,))))
    cases = {
        "paddle [0, 4]": paddle.zeros([0, 4], dtype="float32"),
        "numpy [0, 4]": np.zeros((0, 4), np.float32),
        "numpy [3, 0] bf16": np.zeros((3, 0), ml_dtypes.bfloat16),
        "numpy bf16": _values("bfloat16", (2, 3)),
        "numpy fp8 e4m3 transposed": _values("float8_e4m3fn", (2, 3)).T,
        "numpy fp8 e5m2": _values("float8_e5m2", (4,)),
    }
    for case, tensor in cases.items():
        _same_line(session, tensor, case)
    check.that(D.EMPTY_MD5 in session.debug_digest(cases["numpy [0, 4]"]),
               f"zero-element digest {session.debug_digest(cases['numpy [0, 4]'])!r} lacks md5={D.EMPTY_MD5}")


# -- across the mode space -------------------------------------------------------------------------------
# SPEC.md's Modes lines of DIGEST-MODEL-LANDED / -SENSITIVE (path x layout x model x start) and -INCOMPLETE
# (path x layout x model x phase), every pair covered by the generated cases (conformance.modes). The model adds
# three parameters a strided layout may apply to: ``layout=strided`` lays out the model's (main: a column-major
# 2-D scale and a per-expert 3-D one; draft: the MTP model's column-major scale) as an engine's FP8
# post-processing does (fixtures.strided): the trainer's digest is of the values in logical (C) order, whatever
# the memory order (fixtures.digests computes it from the values, never from the reference). ``start=loaded``:
# the engine allocated every parameter before the first update (placeholders), and the streamed paths' second
# update is in place; ``cleared``: built without memory, and the second update follows a clear. A strided
# target after a clear is APPLY-STRIDED-CLEARED's, judged on the device the implementation serves on: that pair
# is excluded, and a clear-first path updates loaded weights only at its first update.
from conformance import modes  # noqa: E402
from conformance.paths import PATHS as ROUTES, route  # noqa: E402,F401 - route is a fixture
from weightsync.fixtures import streams as ST  # noqa: E402
from weightsync.fixtures import strided as SD  # noqa: E402

COLUMN_MAJOR, EXPERTS, DRAFT_SCALE = "scale.col", "experts.scale", "mtp_block.0.scale"
LAYOUTED = (("experts.scale", "bfloat16", (2, 3, 4)), ("scale.col", "float32", (4, 3)))
# The draft's names route to it on GDR (an ``mtp_`` component, or MTP layer 2: reference.mtp_routing).
DRAFT = (("model.layers.2.eh_proj.weight", "bfloat16", (4, 4)), ("mtp_block.0.norm.weight", "float32", (4,)),
         (DRAFT_SCALE, "float16", (3, 5)))
LAYOUTS = {"main": {COLUMN_MAJOR: (1, 0), EXPERTS: (0, 2, 1)}, "draft": {DRAFT_SCALE: (1, 0)}}
#: the tensor each case changes (SENSITIVE): the strided one of the case's model, at a logical index whose
#: memory position differs when it is column-major
TARGET = {"main": (COLUMN_MAJOR, (0, 1)), "draft": (DRAFT_SCALE, (1, 0))}
MTP_LAYER_OF_DRAFT = 2


def _modal_spec(combo, *, placeholders: bool):
    model = M.spec(*MAIN, *LAYOUTED, mtp=[DRAFT] if combo["model"] == "draft" else [])
    layouts = LAYOUTS[combo["model"]] if combo["layout"] == "strided" else {}
    return SD.StridedSpec(model, layouts, placeholders=placeholders)


def _modal_open(route, combo, spec):
    rt = route(combo["path"])
    session = rt.open(spec)
    ST.mark_mtp_layers(session.models, MTP_LAYER_OF_DRAFT)
    return rt, session


def _modal_updates(route, combo, states):
    """Load ``states`` in turn as the case's start mode says; yield (session, state, where) after each update.
    A clear-first path with ``start=loaded`` loads each state into a new session's placeholders."""
    path, loaded = combo["path"], combo["start"] == "loaded"
    spec = _modal_spec(combo, placeholders=loaded)
    rt, session = _modal_open(route, combo, spec)
    for version, st in enumerate(states, 1):
        if version > 1:
            if loaded and not ROUTES[path].in_place:
                session = rt.open(spec)  # the first update into placeholders again, in a new session
                ST.mark_mtp_layers(session.models, MTP_LAYER_OF_DRAFT)
            elif not loaded:
                session.clear()
        where = rt.publish(0, st, version) + f" ({combo['layout']}, {combo['model']} model, weights {combo['start']})"
        rt.update(0)
        yield session, st, where


def _layout_kept(session, spec, where):
    built = {n: spec.stride(n) for n in spec.layouts}
    now = SD.strides(session.models)
    check.equal({n: now[n] for n in built}, built, f"{where}: strides of the strided parameters")


def _storage(models) -> dict:
    """name -> (address, strides) of every parameter holding data (read from outside, never changed)."""
    return {n: (p.data_ptr(), list(p.strides)) for m in models for n, p in m.state_dict().items()
            if 0 not in tuple(p.shape) and p._is_initialized()}


def _digest_reading_only(session, where) -> dict:
    """``session.digest()``, which must leave every parameter where and as it was (a digest that makes a strided
    parameter contiguous moves it under the engine's graphs and loses its layout)."""
    before = _storage(session.models)
    got = session.digest()
    after = _storage(session.models)
    moved = {n: (before[n], after.get(n)) for n in before if after.get(n) != before[n]}
    check.that(not moved, f"{where}: digest() changed parameters' memory or strides ((address, strides) before -> "
               f"after): {moved}")
    return got


@pytest.mark.rule("DIGEST-MODEL-LANDED")
@pytest.mark.parametrize("combo", modes.params("DIGEST-MODEL-LANDED", requires=lambda c: [*modes.default_requires(c), "digest.model"]))
def test_receiver_digest_equals_trainer_digest_in_every_mode(route, combo):
    spec = _modal_spec(combo, placeholders=False)
    states = [_state(spec, 1), _state(spec, 2)]
    for version, (session, st, where) in enumerate(_modal_updates(route, combo, states), 1):
        check.params_equal(session.observe(), st, f"{where}: version {version}")
        _layout_kept(session, spec, where)
        _compare(_digest_reading_only(session, f"{where}: version {version}"), D.model(st), f"{where}: version {version}")


@pytest.mark.rule("DIGEST-MODEL-SENSITIVE")
@pytest.mark.parametrize("combo", modes.params("DIGEST-MODEL-SENSITIVE", requires=lambda c: [*modes.default_requires(c), "digest.model"]))
def test_one_change_changes_exactly_that_tensors_digest_in_every_mode(route, combo):
    """Version 1, then version 1 with the lowest bit of one element of the case's model's strided tensor flipped
    (row-major when ``contiguous``): exactly that tensor's digest (and the model's) changes, to the trainer's."""
    spec = _modal_spec(combo, placeholders=False)
    base = _state(spec, 1)
    name, index = TARGET[combo["model"]]
    changed = {n: a.copy() for n, a in base.items()}
    _add_one(name, index)(changed)
    digests = []
    for session, st, where in _modal_updates(route, combo, [base, changed]):
        digests.append(session.digest())
        _compare(digests[-1], D.model(st), where)
    check.equal(_changed(digests[0], digests[1]), {name, "(model)"},
                f"{combo}: tensors whose digest changed when element {index} of {name} changed by its lowest bit")


def _refused_naming_unloaded(session, when):
    """digest() raises RuntimeError naming a parameter the session does not hold loaded."""
    unloaded = [n for n, o in session.observe().items() if o.data is None and 0 not in o.shape]
    check.that(unloaded, f"{when}: the case left every parameter loaded (the suite's mistake)")
    with check.raises(RuntimeError, match="|".join(re.escape(n) for n in unloaded), where=f"digest() {when}"):
        session.digest()


@pytest.mark.rule("DIGEST-MODEL-INCOMPLETE")
@pytest.mark.parametrize("combo", modes.params("DIGEST-MODEL-INCOMPLETE", requires=lambda c: [*modes.default_requires(c), "digest.model"]))
def test_no_digest_of_a_model_not_loaded_in_every_mode(route, combo):
    """before-first: no update yet (a strided layout is allocated, the rest not); after-clear: version 1, then
    clear(); after-failed: version 1, clear(), and an update that fails (main: the last tensor of the wrong dtype;
    draft: no draft tensor). The digest names a parameter not loaded; then (where the layout allows a load after a
    clear) clear() and a whole version digest as the trainer's."""
    spec = _modal_spec(combo, placeholders=False)
    rt, session = _modal_open(route, combo, spec)
    phase, where = combo["phase"], f"{combo['path']} ({combo['layout']}, {combo['model']} model)"
    if phase != "before-first":
        v1 = _state(spec, 1)
        rt.publish(0, v1, 1)
        rt.update(0)
        _compare(session.digest(), D.model(v1), f"{where}: version 1")
        session.clear()
    if phase == "after-failed":
        bad = _state(spec, 2)
        if combo["model"] == "main":
            bad["twin.b"] = bad["twin.b"].astype(np.float16)
        else:
            bad = {n: a for n, a in bad.items() if n not in {p[0] for p in DRAFT}}
        failing = rt.publish(0, bad, 2)
        try:
            with check.refused(Exception, where=f"{failing}: {'twin.b as float16' if combo['model'] == 'main' else 'no draft tensor'}"):
                session.update()
        finally:
            rt.feed.settle(0)
    _refused_naming_unloaded(session, f"{where} {phase}")
    if combo["layout"] == "strided" and phase != "before-first":
        return  # a load into a cleared strided target: APPLY-STRIDED-CLEARED's, judged on the implementation's device
    v3 = _state(spec, 3)
    rt.publish(0, v3, 3)
    if phase != "before-first":
        session.clear()
    rt.update(0)
    _compare(session.digest(), D.model(v3), f"{where}: version 3 after the refusal ({phase})")
