"""Worked example: a small snapshot loader (``MineLoader``, standing for yours) and its adapter.

``MineLoader`` loads FastDeploy ``ipc_snapshot`` files written as safetensors: the part files
``model_state.tp{rank}.{id}.part{N}.pdparams``, else the single file ``model_state.tp{rank}.{id}.pdparams``,
else the legacy file ``model_state.tp0{id}.pdparams``. It is written from SPEC.md and
conformance/adapter.py only, in three steps per update:

1. plan: which files (one directory listing; a candidate that is not a regular file is an error);
2. check: every file's header, against the file's size and against the parameters, before any
   parameter changes (a bad tensor anywhere changes nothing);
3. load: file by file, read the whole file through a descriptor (never mapped), make sure it is still
   the file whose header was checked, and copy each tensor into its parameter.

``MineSession`` / ``MineAdapter`` at the end are the adapter. docs/adapters.md walks through it. Run:

    .venv/bin/python -m pytest conformance --impl=docs/example_adapter.py:MineAdapter
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import threading

import numpy as np
import paddle

from conformance.adapter import LoaderConfig, LoadEvent, UnsupportedLoadPath, observe_paddle

log = logging.getLogger("mine")
MAX_DEPTH = 128  # safetensors (serde_json) refuses a header nested deeper; the header object counts as one
MAX_HEADER = 100_000_000  # safetensors refuses a longer JSON header (before it reads it)

# safetensors dtype -> (Paddle dtype, numpy dtype of the same item size that carries the bytes).
# numpy has no bfloat16 or fp8: bf16 bytes travel as uint16, fp8 bytes as uint8, and the Paddle
# tensor is viewed as the right dtype afterwards (docs/paddle-recipes.md).
DTYPES = {
    "BOOL": (paddle.bool, np.bool_), "U8": (paddle.uint8, np.uint8), "I8": (paddle.int8, np.int8),
    "I16": (paddle.int16, np.int16), "I32": (paddle.int32, np.int32), "I64": (paddle.int64, np.int64),
    "F16": (paddle.float16, np.float16), "BF16": (paddle.bfloat16, np.uint16),
    "F32": (paddle.float32, np.float32), "F64": (paddle.float64, np.float64),
    "F8_E4M3": (paddle.float8_e4m3fn, np.uint8), "F8_E5M2": (paddle.float8_e5m2, np.uint8),
}


# -- who this worker is (read once, when the loader is created) -------------------------------
def _index(text: str, variable: str) -> int:
    value = text.strip()  # whitespace around an entry is not part of it
    if not (value.isascii() and value.isdigit()):  # int() would take "-1", "1_0" and non-ASCII digits
        raise ValueError(f"{variable}: {text!r} is not a non-negative integer")
    return int(value)


def physical_gpu_id() -> int:
    """The ``FLAGS_selected_gpus``-th entry of ``CUDA_VISIBLE_DEVICES`` (each unset reads "0"); a bad
    value raises an error naming the variable at fault, never a bare int() or IndexError."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    index = _index(os.environ.get("FLAGS_selected_gpus", "0"), "FLAGS_selected_gpus")
    entries = visible.split(",")
    if index >= len(entries):
        raise IndexError(f"FLAGS_selected_gpus={index} is out of range: "
                         f"CUDA_VISIBLE_DEVICES={visible!r} has {len(entries)} entries")
    return _index(entries[index], f"CUDA_VISIBLE_DEVICES (entry {index})")


# -- 1. plan: which files -----------------------------------------------------------------------
def plan(model_dir: str, rank: int, gpu: int) -> list[tuple[str, str]]:
    """(trace label, path) of every file to load, in order: the first level that exists wins."""
    base, legacy = f"model_state.tp{rank}.{gpu}", f"model_state.tp0{gpu}"
    names = os.listdir(model_dir) if os.path.isdir(model_dir) else []
    prefix, suffix = base + ".part", ".pdparams"
    parts, invalid = [], []
    for name in names:  # what glob("{base}.part*.pdparams") matches, parsed from the basename only
        if name.startswith(prefix) and name.endswith(suffix) and len(name) >= len(prefix + suffix):
            digits = name[len(prefix):-len(suffix)]
            if digits.isascii() and digits.isdigit():
                parts.append((int(digits), name))
            else:
                invalid.append(name)
    if invalid:  # one warning naming each ignored file once
        log.warning("ignoring part files whose index is not a number: %s", ", ".join(sorted(invalid)))
    if parts:
        chosen = [(f"snapshot-part{index}", name) for index, name in sorted(parts)]  # numeric order
    elif base + suffix in names:
        chosen = [("snapshot", base + suffix)]
    elif legacy + suffix in names:
        chosen = [("snapshot", legacy + suffix)]
    else:
        raise FileNotFoundError(f"No snapshot found for {base}: checked {prefix}*{suffix}, {base}{suffix} and "
                                f"{legacy}{suffix} in the model directory {model_dir}")
    sources = [(label, os.path.join(model_dir, name)) for label, name in chosen]
    for _, path in sources:
        # A directory, FIFO or device here is an error, never a reason to fall through to a lower
        # level (stale weights). os.stat follows symlinks and, unlike open(), never blocks on a FIFO.
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise ValueError(f"{path}: a dangling symlink, not a snapshot file") from None
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file ({stat.filemode(mode)}); refusing to load another level")
    return sources


# -- 2. check: headers --------------------------------------------------------------------------
def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except PermissionError:
        raise PermissionError(f"{path}: permission denied (cannot open it for reading: fix its mode)") from None


def _identity(fd: int) -> tuple:
    """What tells one version of a file from another: a rewrite changes the size or the times."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _unique(pairs):
    names = [k for k, _ in pairs]
    if len(names) != len(set(names)):
        raise ValueError(f"a name appears twice: {sorted(k for k in set(names) if names.count(k) > 1)}")
    return dict(pairs)


def pread_exact(fd: int, n: int, offset: int, path: str) -> bytearray:
    """``n`` bytes of the file from ``offset``. One read may return fewer bytes than asked (POSIX; Linux
    never returns more than 0x7ffff000 from one call, FILE-OVER-2GIB): each next read continues where the
    last one ended; a read that returns nothing means the file ended early (it shrank)."""
    data = bytearray(n)
    view, done = memoryview(data), 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ValueError(f"{path}: the file changed during load (it shrank while being read)")
        done += got
    view.release()
    return data


def read_header(path: str) -> tuple[list, tuple]:
    """([(name, dtype, shape, begin, end)], file identity) of a safetensors file, with every check the
    safetensors library makes; offsets are from the start of the file. ValueError names the file."""
    fd = _open(path)
    try:
        ident = _identity(fd)
        size = ident[2]
        if size == 0:
            raise ValueError(f"{path}: the file is empty (0 bytes)")
        if size < 8:
            raise ValueError(f"{path}: truncated: expects at least 8 bytes (the header length), file has {size}")
        n = int.from_bytes(pread_exact(fd, 8, 0, path), "little")
        if 8 + n > size:
            raise ValueError(f"{path}: truncated: the header length {n} expects {8 + n} bytes, file has {size}")
        if n > MAX_HEADER:
            raise ValueError(f"{path}: not a valid safetensors file: a header of {n} bytes, over the limit of {MAX_HEADER}")
        raw = pread_exact(fd, n, 8, path)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw, object_pairs_hook=_unique)
    except ValueError as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ValueError(f"{path}: not a valid safetensors file: the JSON header does not parse ({e})") from None
    except RecursionError:  # nested past Python's recursion limit: never a bare RecursionError
        header = None
    if header is None or _depth(header) > MAX_DEPTH:
        raise ValueError(f"{path}: not a valid safetensors file: the JSON header nests deeper than {MAX_DEPTH} levels")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a valid safetensors file: the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError(f"{path}: not a valid safetensors file: __metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= info.keys()):
            raise ValueError(f"{path}: tensor {name!r} needs dtype, shape and data_offsets, got {info!r:.80}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype!r}, not one of {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}, expected a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, expected [begin, end]")
        nbytes = math.prod(shape) * np.dtype(DTYPES[dtype][1]).itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(f"{path}: tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                             f"{dtype} x {shape} needs {nbytes}")
        entries.append((name, dtype, shape, 8 + n + offsets[0], 8 + n + offsets[1]))
    entries.sort(key=lambda e: (e[3], e[4]))
    end = 8 + n
    for name, _, _, begin, stop in entries:  # the tensors tile the data: no overlap, no gap
        if begin != end:
            raise ValueError(f"{path}: not a valid safetensors file: tensor {name!r} starts at byte {begin}, "
                             f"expected {end} (offsets overlap or leave a gap)")
        end = stop
    if end != size:  # too short, or trailing bytes (safetensors rejects both)
        what = "truncated" if end > size else "trailing bytes"
        raise ValueError(f"{path}: {what}: expects {end} bytes, file has {size}")
    return entries, ident  # (no entries at all: reload() refuses the file, FILE-NO-TENSORS)


def _depth(value) -> int:
    """How deep a parsed JSON value nests, the value itself counting as one (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            stack += [(v, level + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, level + 1) for v in item]
    return deepest


def raise_all(problems: list[Exception], what: str) -> None:
    """Every problem of an input, not the first: one alone is raised as it is; several as one error of the
    first one's type naming each (a TypeError if any is one)."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        kind = TypeError if any(isinstance(p, TypeError) for p in problems) else ValueError
        raise kind(f"{len(problems)} {what}: " + "; ".join(str(p) for p in problems))


def check_against(params: dict, entries: list, path: str) -> list[Exception]:
    """Dtype (TypeError), then shape (ValueError), naming the tensor and the file: every mismatch of the
    file, returned. Names the model does not have are ignored, and named in a warning (a trainer's names
    may have drifted)."""
    unknown = [name for name, *_ in entries if name not in params]
    if unknown:
        log.warning("%s: ignoring %d tensor(s) the model does not have: %s", path, len(unknown), ", ".join(unknown))
    problems = []
    for name, dtype, shape, _, _ in entries:
        param = params.get(name)
        if param is None:
            continue
        want = DTYPES[dtype][0]
        if param.dtype != want:
            problems.append(TypeError(f"Type mismatch for {name}: {want} in {path}, the parameter is {param.dtype}"))
        if list(param.shape) != shape:
            problems.append(ValueError(f"Shape mismatch for {name}: {shape} in {path}, "
                                       f"the parameter is {list(param.shape)}"))
    return problems


# -- 3. load: one file at a time --------------------------------------------------------------
def read_tensors(path: str, entries: list, ident: tuple, wanted):
    """Yield (name, tensor) for the names in ``wanted``, each tensor in memory of its own. The whole
    file is read first, through a descriptor (a mapping would SIGBUS if the trainer truncated it),
    and closed; it must be the very file whose header was checked, unchanged until the read ended."""
    fd = _open(path)
    try:
        if _identity(fd) != ident:
            raise ValueError(f"{path}: the file changed after its header was checked; write it, then update again")
        data = pread_exact(fd, ident[2], 0, path)
        if _identity(fd) != ident:
            raise ValueError(f"{path}: the file changed during load; write it, then update again")
    finally:
        os.close(fd)
    for name, dtype, shape, begin, _ in entries:
        if name in wanted:
            want, carrier = DTYPES[dtype]
            array = np.frombuffer(data, carrier, count=math.prod(shape), offset=begin).reshape(shape)
            tensor = paddle.to_tensor(array)  # a copy: the tensor owns its memory (uint16 arrives as bfloat16)
            yield name, (tensor if tensor.dtype == want else tensor.view(want))  # fp8: uint8 bytes, viewed


def copy_into(param: paddle.Tensor, tensor: paddle.Tensor) -> None:
    """Copy ``tensor``'s values into ``param``, keeping the parameter's own layout: a strided parameter
    (an FP8 scale laid out column-major) keeps its strides (APPLY-STRIDED-TARGET), and a cleared one is
    first given storage of that layout (APPLY-STRIDED-CLEARED); a row-major one is simply assigned."""
    shape, stride = list(param.shape), list(param.stride())
    row_major = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    if stride == row_major:
        paddle.assign(tensor, output=param)
        return
    if math.prod(shape) == 0:
        return  # holds no data; its layout stays its own
    if not param._is_initialized():
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        param.data = paddle.as_strided(paddle.empty([span], dtype=param.dtype), shape, stride)
    param[...] = tensor


class MineLoader:
    """The implementation under test (yours would live in its own package)."""

    def __init__(self, models, model_dir: str):
        self.params = {}
        for model in models:  # main model first, then MTP models: one flat name space
            for name, param in model.state_dict().items():
                if name in self.params:
                    raise ValueError(f"parameter {name!r} appears in two models")
                self.params[name] = param
        self.model_dir = model_dir
        self.rank = paddle.distributed.get_rank()  # identity: read now, kept for the loader's life
        self.gpu = physical_gpu_id()
        self.state = "CLEARED"  # a plain attribute: status() reads it from any thread, at once
        self.applied: list[tuple[str, str]] = []  # (label, path) of the last update, in order

    def reload(self) -> None:
        self.state, self.applied = "UPDATING", []  # stays UPDATING if anything below raises
        sources = plan(self.model_dir, self.rank, self.gpu)
        headers, unreadable = [], []
        for _, path in sources:  # every file that cannot be read is named, not the first
            try:
                headers.append(read_header(path))
            except ValueError as e:
                unreadable.append(e)
        raise_all(unreadable, "snapshot files cannot be loaded")
        mismatches = []
        for (_, path), (entries, _) in zip(sources, headers):
            if not entries:  # an update of nothing: both counts named (APPLY-COUNT-MATCHES)
                raise ValueError(f"{path}: no parameter found: the file holds no tensors; "
                                 f"0 of {len(self.params)} parameter(s) landed")
            mismatches += check_against(self.params, entries, path)  # every file, before any parameter changes
        raise_all(mismatches, "tensor(s) do not match their parameters")
        loaded = set()
        for (label, path), (entries, ident) in zip(sources, headers):  # one file in memory at a time
            with paddle.no_grad():
                for name, tensor in read_tensors(path, entries, ident, self.params):
                    copy_into(self.params[name], tensor)  # a copy; a later part overwrites
                    loaded.add(id(self.params[name]))  # by object: a tied pair is loaded by either name
            self.applied.append((label, path))
        missing = sorted(name for name, param in self.params.items() if id(param) not in loaded)
        if missing:
            raise RuntimeError(f"{len(self.params) - len(missing)} of {len(self.params)} parameter(s) landed; "
                               f"{len(missing)} missing from the snapshot: {', '.join(missing)}")
        self.state = "NORMAL"

    def drop(self) -> None:
        self.state = "CLEARING"
        for param in self.params.values():
            param._clear_data()  # the parameter stays, its memory is released
        self.state = "CLEARED"


# -- the adapter --------------------------------------------------------------------------------
class MineSession:
    def __init__(self, models, config: LoaderConfig):
        if config.load_strategy != "ipc_snapshot":  # (not reached: the capabilities say so already)
            raise UnsupportedLoadPath(f"mine loads ipc_snapshot only, not {config.load_strategy}")
        self.loader = MineLoader(models, config.model_dir)  # captures only: nothing is loaded yet
        self.running = None  # the clear or update in progress: one at a time (LIFE-CONCURRENT)
        self.lock = threading.Lock()

    def update(self):
        with self.one_at_a_time("update"):
            self.loader.reload()

    def clear(self):
        with self.one_at_a_time("clear"):
            self.loader.drop()

    @contextlib.contextmanager
    def one_at_a_time(self, what):
        with self.lock:  # a call arriving while another runs is refused at once, having changed nothing
            if self.running is not None:
                raise RuntimeError(f"{what}() refused: {self.running}() is in progress on this session")
            self.running = what
        try:
            yield
        finally:
            self.running = None

    def observe(self):
        return observe_paddle(self.loader.params)

    def trace(self):
        return [LoadEvent(label, path) for label, path in self.loader.applied]

    def status(self):
        return self.loader.state

    def close(self):
        pass  # nothing is held between calls


class MineAdapter:
    name = "mine"
    version = "0.3"
    capabilities = frozenset({"snapshot.parts", "snapshot.single", "snapshot.legacy", "trace", "status", "mtp"})

    def open(self, models, config: LoaderConfig) -> MineSession:
        return MineSession(models, config)
