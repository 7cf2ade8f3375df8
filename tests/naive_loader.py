"""A loader as a newcomer writes it from docs/adapters.md in their first hour (issue 19): check which
snapshot files exist with ``os.path.exists``, hand each to ``safetensors.paddle.load_file``, assign
the tensors. No care for what kind of file a candidate is: ``load_file`` opens a FIFO in Rust with
the GIL held, which blocks the whole process until a writer comes. The suite must end such a run
with failed rules naming the case, never hang (tests/test_hang_bounds.py).

``HoldingAdapter`` is the same loader opening each candidate for reading *and* writing through
``ctypes.PyDLL`` (GIL held) and reading it until it has data: on a FIFO neither a writer's open nor
end of file ever comes, so it blocks until killed, and retries on EINTR as Rust's std does.

    pytest conformance --impl=tests/naive_loader.py:Adapter
"""
from __future__ import annotations

import os

import paddle

from conformance.adapter import LoaderConfig, LoadEvent, observe_paddle


def _rank_and_gpu():
    rank = paddle.distributed.get_rank()
    gpu = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[int(os.environ.get("FLAGS_selected_gpus", "0"))])
    return rank, gpu


class NaiveSession:
    def __init__(self, models, config: LoaderConfig, read):
        self.params = {}
        for model in models:
            self.params.update(model.state_dict())
        self.model_dir, self.read = config.model_dir, read
        self.rank, self.gpu = _rank_and_gpu()
        self.state, self.applied = "CLEARED", []

    def _sources(self):
        base = os.path.join(self.model_dir, f"model_state.tp{self.rank}.{self.gpu}")
        parts, i = [], 0
        while os.path.exists(f"{base}.part{i}.pdparams"):
            parts.append((f"snapshot-part{i}", f"{base}.part{i}.pdparams"))
            i += 1
        if parts:
            return parts
        for label, path in (("snapshot", f"{base}.pdparams"),
                            ("snapshot", os.path.join(self.model_dir, f"model_state.tp0{self.gpu}.pdparams"))):
            if os.path.exists(path):
                return [(label, path)]
        raise FileNotFoundError(f"No snapshot found for model_state.tp{self.rank}.{self.gpu} in model directory {self.model_dir}")

    def update(self):
        self.state, self.applied = "UPDATING", []
        for label, path in self._sources():
            tensors = self.read(path)
            with paddle.no_grad():
                for name, tensor in tensors.items():
                    if name in self.params:
                        paddle.assign(tensor, output=self.params[name])
            self.applied.append((label, path))
        self.state = "NORMAL"

    def clear(self):
        self.state = "CLEARING"
        for param in self.params.values():
            param._clear_data()
        self.state = "CLEARED"

    def observe(self):
        return observe_paddle(self.params)

    def trace(self):
        return [LoadEvent(label, path) for label, path in self.applied]

    def status(self):
        return self.state

    def close(self):
        pass


def _load_file(path):
    import safetensors.paddle

    return safetensors.paddle.load_file(path)


def _read_holding_the_gil(path):
    """open(O_RDWR) and read() through ctypes.PyDLL, which keeps the GIL: on a FIFO this never returns."""
    import ctypes

    libc = ctypes.PyDLL(None, use_errno=True)
    fd = libc.open(path.encode(), os.O_RDWR)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), path)
    buf = ctypes.create_string_buffer(8)
    while libc.read(fd, buf, 8) < 0 and ctypes.get_errno() == 4:  # EINTR: retried, as Rust's std does
        pass
    libc.close(fd)
    return _load_file(path)


class Adapter:
    name = "naive"
    version = "0.1"
    capabilities = frozenset({"snapshot.parts", "snapshot.single", "snapshot.legacy", "trace", "status"})

    def open(self, models, config: LoaderConfig) -> NaiveSession:
        return NaiveSession(models, config, _load_file)


class HoldingAdapter(Adapter):
    name = "naive-holding"

    def open(self, models, config: LoaderConfig) -> NaiveSession:
        return NaiveSession(models, config, _read_holding_the_gil)
