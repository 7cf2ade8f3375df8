"""Worked example: a conformance adapter for a hypothetical loader called ``mine``.

``MineLoader`` stands for your implementation (it loads the single-file snapshot
``model_state.tp{rank}.{gpu}.pdparams``, a safetensors file, with a small reader of its own);
``MineSession``/``MineAdapter`` are the adapter. It passes every rule that applies to what it claims
(``snapshot.single``, ``trace``, ``status``). Run:

    pytest conformance --impl=docs/example_adapter.py:MineAdapter
"""
import ctypes
import json
import math
import os

import paddle

from conformance.adapter import LoaderConfig, LoadEvent, observe_paddle


def _non_negative_int(text: str, variable: str, what: str) -> int:
    value = text.strip()  # whitespace around an entry is not part of it
    if not (value.isascii() and value.isdigit()):  # int() would take "-1", " 1_0" and non-ASCII digits
        raise ValueError(f"{variable}: {what} {text!r} is not a non-negative integer")
    return int(value)


def physical_gpu_id() -> int:
    """The physical GPU id: the ``FLAGS_selected_gpus``-th entry of ``CUDA_VISIBLE_DEVICES``. A bad
    value is an error naming the variable at fault, never a bare ``int()`` or ``IndexError``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    entries = visible.split(",")
    index = _non_negative_int(os.environ.get("FLAGS_selected_gpus", "0"), "FLAGS_selected_gpus", "selection")
    if index >= len(entries):
        raise IndexError(f"FLAGS_selected_gpus={index} is out of range: CUDA_VISIBLE_DEVICES={visible!r} has {len(entries)} entries")
    return _non_negative_int(entries[index], "CUDA_VISIBLE_DEVICES", f"entry {index} (selected by FLAGS_selected_gpus)")


# safetensors dtype -> (Paddle dtype, bytes per item)
DTYPES = {
    "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}


def read_snapshot(path: str) -> dict:
    """Every tensor of a safetensors file, each in memory of its own. The file is read once through
    a descriptor (never mapped: a trainer truncating it would kill a reader of a mapping with SIGBUS),
    closed before returning, and rejected if it changed while it was read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        raise PermissionError(f"{path}: permission denied; the snapshot file cannot be opened for reading") from None
    try:
        before = os.fstat(fd)
        data = bytearray()
        while chunk := os.read(fd, 1 << 20):
            data += chunk
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise ValueError(f"{path}: the file changed while it was read; write it completely, then update again")
    return parse_safetensors(path, data)


def parse_safetensors(path: str, data: bytearray) -> dict:
    """Tensors from the bytes of a safetensors file, validated as strictly as the safetensors
    library does; a bad file is a ValueError naming it (and the sizes, when it is too short)."""
    size = len(data)
    if size == 0:
        raise ValueError(f"{path}: file is empty (0 bytes), expected a safetensors snapshot")
    if size < 8:
        raise ValueError(f"{path}: truncated: {size} bytes cannot hold the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > size:
        raise ValueError(f"{path}: truncated or corrupt: header length {n} expects {8 + n} bytes, file has {size}")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as e:  # also UnicodeDecodeError
        raise ValueError(f"{path}: not a valid safetensors file: the JSON header does not parse ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a valid safetensors file: the header is {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    entries = []
    for name, info in header.items():
        info = info if isinstance(info, dict) else {}
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype!r}, not one of {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}, expected a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, expected [begin, end]")
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets} ({offsets[1] - offsets[0]} bytes); "
                             f"{dtype}{shape} is {nbytes} bytes")
        entries.append((offsets[0], offsets[1], name, dtype, shape))
    entries.sort()
    end = 0
    for begin, stop, name, _, _ in entries:  # contiguous from 0: no overlap, no gap
        if begin != end:
            raise ValueError(f"{path}: tensor {name!r} starts at byte {begin} of the data, expected {end} "
                             "(tensors must cover the data contiguously)")
        end = stop
    if 8 + n + end != size:
        raise ValueError(f"{path}: {'truncated' if size < 8 + n + end else 'trailing bytes after the data'}: "
                         f"the header expects {8 + n + end} bytes, file has {size}")
    if not entries:
        raise ValueError(f"{path}: no parameter found in the snapshot (it holds no tensors)")
    source = (ctypes.c_char * size).from_buffer(data)
    tensors = {}
    for begin, stop, name, dtype, shape in entries:
        tensor = paddle.empty(shape, dtype=DTYPES[dtype][0])  # memory of its own, then one copy into it
        if stop > begin:
            ctypes.memmove(tensor.data_ptr(), ctypes.addressof(source) + 8 + n + begin, stop - begin)
        tensors[name] = tensor
    del source  # (a live ctypes view would keep ``data`` from being freed)
    return tensors


class MineLoader:
    """The implementation under test (yours would live in its own package)."""

    def __init__(self, models, model_dir):
        self.params = {name: p for model in models for name, p in model.state_dict().items()}
        self.model_dir = model_dir
        # Worker identity, read once when the loader is created, the way production reads it: global
        # rank and physical GPU id. The loader keeps it even if the environment changes later.
        self.rank = paddle.distributed.get_rank()
        self.gpu = physical_gpu_id()
        self.state = "CLEARED"  # a plain attribute: status() may read it from another thread
        self.applied = []

    def reload(self):
        self.state, self.applied = "UPDATING", []  # stays UPDATING if anything below raises
        base = f"model_state.tp{self.rank}.{self.gpu}"
        path = os.path.join(self.model_dir, base + ".pdparams")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No snapshot found for {base}: checked {path} (model directory {self.model_dir})")
        incoming = read_snapshot(path)
        # Validate everything before touching any parameter: a rejected update changes nothing.
        for name, target in self.params.items():
            tensor = incoming.get(name)
            if tensor is None:
                continue
            if tensor.dtype != target.dtype:
                raise TypeError(f"Type mismatch for {name}: {tensor.dtype} vs {target.dtype} (from {path})")
            if tensor.shape != target.shape:
                raise ValueError(f"Shape mismatch for {name}: {tensor.shape} vs {target.shape} (from {path})")
        missing = sorted(set(self.params) - set(incoming))
        if missing:
            raise RuntimeError(f"{path} lacks {', '.join(missing)}")
        for name, target in self.params.items():  # names the model does not have are ignored
            incoming[name]._share_buffer_to(target)
        self.applied.append(path)
        self.state = "NORMAL"

    def drop(self):
        self.state = "CLEARING"
        for p in self.params.values():
            p._clear_data()
        self.applied = []
        self.state = "CLEARED"


class MineSession:
    def __init__(self, models, config: LoaderConfig):
        self.loader = MineLoader(models, config.model_dir)  # captures only: nothing is loaded yet

    def update(self):
        self.loader.reload()

    def clear(self):
        self.loader.drop()

    def observe(self):
        return observe_paddle(self.loader.params)

    def trace(self):
        return [LoadEvent("snapshot", path) for path in self.loader.applied]

    def status(self):
        return self.loader.state

    def close(self):
        pass


class MineAdapter:
    name = "mine"
    version = "0.2"
    capabilities = frozenset({"snapshot.single", "trace", "status"})

    def open(self, models, config: LoaderConfig) -> MineSession:
        return MineSession(models, config)
