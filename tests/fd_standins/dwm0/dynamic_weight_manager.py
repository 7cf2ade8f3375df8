"""Stand-in for ``fastdeploy/rl/dynamic_weight_manager.py``, the first generation (DWM-0).

Written from the behavioural contract in /work/shared/research/fastdeploy-spec.md (§0 DWM-0, §2.5,
§3.1 "History", §3.2, §3.3); none of FastDeploy's code is copied. What makes this generation:
  * ``DynamicWeightManager(fd_config, model)``: one model (no MTP); the constructor captures and loads;
  * ``update_parameters(pid)`` restarts the default process group on every load but the first and
    ends with its own ``_finalize_update(pid)`` (verify, barrier when the world has several ranks,
    status NORMAL except on the first load): the runner calls no finalize;
  * ipc_snapshot reads only ``{parallel_config.model_name_or_path}/model_state.tp0{id}.pdparams`` with
    a plain ``paddle.load`` (the trainer's ``paddle.save`` pickle); its fallback
    ``/shared_ipc_meta/model_state.tp0{id}.pdparams`` sits behind ``except FileNotFoundError``, which
    ``paddle.load`` never raises for a missing file (it raises ValueError), so it is never reached;
  * ``clear_parameters(pid)`` clears, verifies, barriers when several ranks, shuts the default process
    group down and writes CLEARED as the literal -2 (no ``inter_communicator`` yet);
  * apply: each tensor checked (dtype, then shape) and adopted with ``_share_buffer_to`` in turn, no
    stride branch, no rollback; an empty state dict's error names no file; verification names no
    parameter; zero-element parameters never count as initialized;
  * module-level imports: os, time, SharedMemory, typing, numpy, paddle (and ``paddle.nn``),
    paddleformers' logger, ``fastdeploy.config``.
(One stored version, @00fe65a, reads ``self.model_config.model``, which it never sets: its
ipc_snapshot path cannot run at all. This stand-in is the runnable variant.)
"""
import os
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Dict

import numpy as np
import paddle
from paddle import nn
from paddleformers.utils.log import logger

from fastdeploy.config import FDConfig

SHARED_IPC_DIR = "/shared_ipc_meta"


class DynamicWeightManager:
    """Clears and reloads the captured parameters of one worker's model."""

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
        self.model = model
        self._capture_model_state()
        self.update_parameters()  # loads, then finalizes (no status write on the first load)
        logger.info(f"DynamicLoad model built by {self.load_config.load_strategy}: rank={self.rank}, ranks={self.nranks}")

    @paddle.no_grad()
    def _capture_model_state(self):
        for name, param in self.model.state_dict().items():
            logger.debug(f"Model param: {name}, shape={param.shape}, dtype={param.dtype}")
            self.state_dict[name] = param

    def update_parameters(self, pid: int = 0) -> None:
        started = time.perf_counter()
        paddle.device.cuda.empty_cache()
        if not self.first_load:
            paddle.distributed.restart_process_group()
        handlers = {"ipc_snapshot": self._update_ipc_snapshot, "ipc": self._update_ipc}
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
        self._update_model_from_state(loaded, "snapshot")
        logger.info(f"IPC snapshot update parameters completed from {path}")

    def _update_ipc(self):
        metas = paddle.load(self.ipc_path)
        self._update_model_from_state(self._convert_ipc_meta_to_tensor(metas), "raw")
        logger.info(f"IPC update parameters completed from file: {self.ipc_path}")

    def clear_parameters(self, pid: int = 0) -> None:
        logger.info("start clear paramaters")
        paddle.device.cuda.empty_cache()
        for param in self.model.state_dict().values():
            param._clear_data()
        self._verify_parameters("clearance")
        if self.nranks > 1:
            paddle.distributed.barrier()
        paddle.distributed.shutdown_process_group()
        self._update_shared_status(pid, -2)  # CLEARED

    def _update_model_from_state(self, state_dict: Dict[str, paddle.Tensor], src_type: str):
        if len(state_dict) == 0:
            raise ValueError(f"No parameter found in state dict {state_dict}")
        applied = 0
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
        logger.info(f"Model Parameter {operation} verified successfully")

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
