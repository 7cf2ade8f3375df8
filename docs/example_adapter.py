"""Worked example: a conformance adapter for a hypothetical loader called ``mine``.

``MineLoader`` stands for your implementation (it loads the single-file snapshot
``model_state.tp{rank}.{gpu}.pdparams``); ``MineSession``/``MineAdapter`` are the adapter. Run:

    pytest conformance --impl=docs/example_adapter.py:MineAdapter --rule SNAP-NAME-SINGLE --rule SNAP-GPU-ID
"""
import os

import paddle
import safetensors

from conformance.adapter import LoaderConfig, LoadEvent, observe_paddle


class MineLoader:
    """The implementation under test (yours would live in its own package)."""

    def __init__(self, models, model_dir):
        self.params = {name: p for model in models for name, p in model.state_dict().items()}
        self.model_dir = model_dir
        # Worker identity, read the way production reads it: global rank and physical GPU id.
        self.rank = paddle.distributed.get_rank()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")
        self.gpu = int(visible[int(os.environ.get("FLAGS_selected_gpus", "0"))])
        self.state = "CLEARED"
        self.applied = []

    def reload(self):
        path = os.path.join(self.model_dir, f"model_state.tp{self.rank}.{self.gpu}.pdparams")
        self.state, self.applied = "UPDATING", []
        with safetensors.safe_open(path, framework="paddle") as f:
            for name in f.keys():
                target = self.params.get(name)
                if target is None:
                    continue
                tensor = f.get_tensor(name)
                if tensor.dtype != target.dtype:
                    raise TypeError(f"Type mismatch for {name}: {tensor.dtype} vs {target.dtype} (from {path})")
                if tensor.shape != target.shape:
                    raise ValueError(f"Shape mismatch for {name}: {tensor.shape} vs {target.shape} (from {path})")
                tensor._share_buffer_to(target)
        missing = [name for name, p in self.params.items() if not p._is_initialized()]
        if missing:
            raise RuntimeError(f"{path} lacks {', '.join(missing)}")
        self.applied.append(path)
        self.state = "NORMAL"

    def drop(self):
        for p in self.params.values():
            p._clear_data()
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
    version = "0.1"
    capabilities = frozenset({"snapshot.single", "trace", "status"})

    def open(self, models, config: LoaderConfig) -> MineSession:
        return MineSession(models, config)
