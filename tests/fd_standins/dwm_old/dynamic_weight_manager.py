"""Stand-in for ``fastdeploy/rl/dynamic_weight_manager.py``, the pre-upstream variant (DWM-old).

Written from the behavioural contract in /work/shared/research/fastdeploy-spec.md (§0 DWM-old, §3.1
"History", §3.4 "Older and other strategies") and the facts of that version; none of FastDeploy's
code is copied. What sets it apart from DWM-0 (tests/fd_standins/dwm0):
  * module-level imports of the ``normal`` strategy's helpers: ``load_composite_checkpoint`` from
    ``fastdeploy.model_executor.load_weight_utils`` and ``MODEL_CLASSES`` from
    ``fastdeploy.model_executor.model_loader`` (modules a CPU machine without FastDeploy lacks);
  * ``DynamicWeightManager(fd_config, model)`` keeps a list ``models = [model]`` (``add_model`` appends
    and captures); the constructor skips its first load when ``load_strategy == "meta"``;
  * strategies ``ipc_snapshot``, ``ipc``, ``ipc_no_reshard`` (ipc metas, then ``set_state_dict``) and
    ``normal`` (``load_composite_checkpoint``, then ``set_state_dict``); ``update_parameters(pid)`` ends
    with its own ``_finalize_update(pid)`` as in DWM-0;
  * ipc_snapshot reads ``{parallel_config.model_name_or_path}/model_state.tp0{id}.pdparams`` with a plain
    ``paddle.load`` (fallback behind ``except FileNotFoundError``, unreachable); when applying it raises
    anything, it falls back to ``models[0].set_state_dict(state_dict)`` with a warning: a mismatch then
    surfaces as Paddle's own error or as finalize's verification failure, never as the TypeError or
    ValueError naming the tensor;
  * ``_update_model_from_state`` has no empty-state-dict check.
"""
import os
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Dict, List

import numpy as np
import paddle
from paddle import nn
from paddleformers.utils.log import logger

from fastdeploy.config import FDConfig
from fastdeploy.model_executor.load_weight_utils import load_composite_checkpoint
from fastdeploy.model_executor.model_loader import MODEL_CLASSES

SHARED_IPC_DIR = "/shared_ipc_meta"


class DynamicWeightManager:
    """Clears and reloads the captured parameters of one worker's models."""

    def __init__(self, fd_config: FDConfig, model: nn.Layer):
        self.fd_config = fd_config
        self.load_config = fd_config.load_config
        self.parallel_config = fd_config.parallel_config
        self.state_dict: Dict[str, paddle.Tensor] = {}
        self.rank = self.parallel_config.tensor_parallel_rank  # only rank 0 writes the status cell
        self.nranks = paddle.distributed.get_world_size()
        self.meta_src_id = self._get_gpu_id()
        self.first_load = True
        self.ipc_path = f"{SHARED_IPC_DIR}/ipc_metas_{self.meta_src_id}"
        self.models: List[nn.Layer] = [model]
        self._capture_model_state()
        if self.load_config.load_strategy != "meta":  # "meta": the trainer provides the weights later
            self.update_parameters()
        logger.info(f"DynamicLoad model built by {self.load_config.load_strategy}: rank={self.rank}, ranks={self.nranks}")

    @paddle.no_grad()
    def _capture_model_state(self):
        for model in self.models:
            for name, param in model.state_dict().items():
                self.state_dict[name] = param

    def add_model(self, model: nn.Layer):
        self.models.append(model)
        self._capture_model_state()

    def update_parameters(self, pid: int = 0) -> None:
        started = time.perf_counter()
        paddle.device.cuda.empty_cache()
        if not self.first_load:
            paddle.distributed.restart_process_group()
        handlers = {"ipc_snapshot": self._update_ipc_snapshot, "ipc": self._update_ipc,
                    "ipc_no_reshard": self._update_ipc_no_reshard, "normal": self.load_model}
        handler = handlers.get(self.load_config.load_strategy)
        if handler is None:
            raise ValueError(f"Unsupported strategy: {self.load_config.load_strategy}")
        handler()
        logger.info(f"Update parameters in {time.perf_counter() - started:.2f}s")
        self._finalize_update(pid)

    def _update_ipc_snapshot(self):
        name = f"model_state.tp0{self.meta_src_id}.pdparams"
        path = os.path.join(self.parallel_config.model_name_or_path, name)
        try:
            loaded = paddle.load(path)  # the trainer's paddle.save pickle
        except FileNotFoundError:  # never raised by paddle.load for a missing file (ValueError)
            loaded = paddle.load(f"{SHARED_IPC_DIR}/{name}")
        try:
            self._update_model_from_state(loaded, "snapshot")
        except Exception:  # a weight the shared buffer cannot take: let Paddle copy (more memory)
            self.models[0].set_state_dict(loaded)
            logger.warning("load model from no_reshard weight, maybe need more GPU memory")
        logger.info("IPC snapshot update parameters completed")

    def _update_ipc(self):
        metas = paddle.load(self.ipc_path)
        self._update_model_from_state(self._convert_ipc_meta_to_tensor(metas), "raw")

    def _update_ipc_no_reshard(self):
        metas = paddle.load(self.ipc_path)
        self.models[0].set_state_dict(self._convert_ipc_meta_to_tensor(metas))

    def load_model(self) -> nn.Layer:
        architecture = self.fd_config.model_config.architectures[0]
        state_dict = load_composite_checkpoint(self.parallel_config.model_name_or_path, MODEL_CLASSES[architecture],
                                               self.fd_config.model_config, return_numpy=True)
        self.models[0].set_state_dict(state_dict)

    def clear_parameters(self, pid: int = 0) -> None:
        paddle.device.cuda.empty_cache()
        for model in self.models:
            for param in model.state_dict().values():
                param._clear_data()
        self._verify_parameters("clearance")
        if self.nranks > 1:
            paddle.distributed.barrier()
        paddle.distributed.shutdown_process_group()
        self._update_shared_status(pid, -2)  # CLEARED

    def _update_model_from_state(self, state_dict: Dict[str, paddle.Tensor], src_type: str):
        applied = 0  # (no check for an empty state dict in this version)
        for name, incoming in state_dict.items():
            target = self.state_dict.get(name)
            if target is None:
                logger.debug(f"Ignoring unmatched {src_type} param: {name}")
                continue
            self._validate_parameter_match(name, incoming, target)
            incoming._share_buffer_to(target)
            applied += 1
        logger.info(f"Updated {applied}/{len(state_dict)} parameters from {src_type} source")

    def _validate_parameter_match(self, name: str, src: paddle.Tensor, dst: paddle.Tensor):
        if src.dtype != dst.dtype:
            raise TypeError(f"Type mismatch for {name}: {src.dtype} vs {dst.dtype}")
        if src.shape != dst.shape:
            raise ValueError(f"Shape mismatch for {name}: {src.shape} vs {dst.shape}")

    def _finalize_update(self, pid: int):
        self._verify_parameters("update")
        if self.nranks > 1:
            paddle.distributed.barrier()
        if not self.first_load:
            self._update_shared_status(pid, 0)  # NORMAL
        self.first_load = False

    def _get_gpu_id(self) -> int:
        visible = os.getenv("CUDA_VISIBLE_DEVICES", "0").split(",")
        return int(visible[int(os.getenv("FLAGS_selected_gpus", "0"))])

    def _verify_parameters(self, operation: str):
        want = operation == "update"
        wrong = [name for name, param in self.state_dict.items() if param._is_initialized() != want]
        for name in wrong:
            logger.error(f"Verification failed after {operation}: Param {name} initialized={not want} (expected {want})")
        if wrong:
            raise RuntimeError(f"❌ Model Parameter {operation} verification failed")

    @staticmethod
    def _convert_ipc_meta_to_tensor(ipc_meta: Dict[str, Any]) -> Dict[str, paddle.Tensor]:
        tensors = {}
        for name, meta in ipc_meta.items():
            meta[0] = meta[0].encode("latin-1")
            meta[6] = int(os.getenv("FLAGS_selected_gpus", "0"))
            tensors[name] = paddle.to_tensor(paddle.base.core.LoDTensor._new_shared_cuda(tuple(meta)))
        return tensors

    def _update_shared_status(self, pid: int, status: int) -> None:
        cell = SharedMemory(create=False, size=np.dtype(np.int32).itemsize, name=f"model_weights_status.{pid}")
        try:
            if self.rank == 0:
                cell.buf[:4] = np.array([status], dtype=np.int32).tobytes()
        finally:
            cell.close()

    @staticmethod
    def check_model_weights_status(model_weights_status, model_runner, pid):
        """DWM-0's worker loop (fd-spec §2.5): act on 1 (update) / -1 (clear) with 1 ms polls and no
        clear_requests, until the cell reads 0: it stays through CLEARED until the update (no ``block``);
        once it has cleared, it no longer waits for NORMAL after acting (``stopped``)."""
        cell = model_weights_status.value
        stopped = False
        while cell[0] != 0:
            if cell[0] == 1:
                model_runner.update_parameters(pid)
            elif cell[0] == -1:
                model_runner.clear_parameters(pid)
            while True:
                if cell[0] == 0:
                    break
                if stopped or cell[0] == -2:
                    stopped = True
                    time.sleep(0.001)
                    break
                time.sleep(0.001)
