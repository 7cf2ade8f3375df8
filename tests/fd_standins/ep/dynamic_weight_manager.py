"""Stand-in for ``fastdeploy/rl/dynamic_weight_manager.py``, the expert-parallel generation (DWM-EP,
@d0968e1: MTP and EP, no rsync yet).

Written from the behavioural contract in /work/shared/research/fastdeploy-spec.md (§0 DWM-EP, §2.5-2.7,
§3.1 "History", §3.2, §3.3); none of FastDeploy's code is copied. What makes this generation:
  * ``DynamicWeightManager(fd_config, models)``: a model or a list ``[main, mtp...]``; the constructor
    captures, loads and calls ``finalize_update()``; afterwards the runner calls ``update_parameters(pid)``
    and then ``finalize_update(pid)``;
  * every load but the first restarts the default, tp and (EP) ep process groups; every clear shuts
    them down (no flag yet); EP recreates / clears the DeepEP buffer around them;
  * ipc_snapshot reads only ``{model_config.model}/model_state.tp0{id}.pdparams`` with a plain
    ``paddle.load`` (the trainer's ``paddle.save`` pickle); the ``/shared_ipc_meta`` fallback of the same
    name sits behind ``except FileNotFoundError``, which ``paddle.load`` never raises (ValueError);
  * status through ``ModelWeightsStatus`` (CLEARED after a clear, NORMAL after a non-first finalize);
  * apply as in DWM-0: per tensor, no stride branch, no rollback, messages naming no file or parameter,
    zero-element parameters never initialized;
  * module-level imports: os, time, SharedMemory, typing, numpy, paddle, paddleformers' logger,
    ``fastdeploy.config``, ``fastdeploy.inter_communicator`` (ModelWeightsStatus only).
"""
import os
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Dict, List

import numpy as np
import paddle
from paddleformers.utils.log import logger

from fastdeploy.config import FDConfig
from fastdeploy.inter_communicator import ModelWeightsStatus

SHARED_IPC_DIR = "/shared_ipc_meta"


class DynamicWeightManager:
    """Clears and reloads the captured parameters of one worker's models."""

    def __init__(self, fd_config: FDConfig, models):
        self.fd_config = fd_config
        self.load_config = fd_config.load_config
        self.parallel_config = fd_config.parallel_config
        self.state_dict: Dict[str, paddle.Tensor] = {}
        self.rank = self.parallel_config.tensor_parallel_rank
        self.nranks = paddle.distributed.get_world_size()
        self.meta_src_id = self._get_gpu_id()
        self.first_load = True
        self.ipc_path = f"{SHARED_IPC_DIR}/ipc_metas_{self.meta_src_id}"
        self.model_list = models if isinstance(models, List) else [models]
        self._capture_model_state()
        self.update_parameters()
        self.finalize_update()
        pc = self.parallel_config
        logger.info(f"DynamicLoad model built by {self.load_config.load_strategy}: tp rank={self.rank}, "
                    f"dp rank={pc.local_data_parallel_id}, ep rank={pc.expert_parallel_rank}, ranks={self.nranks}")

    @paddle.no_grad()
    def _capture_model_state(self):
        for model in self.model_list:  # a later model's parameter replaces one of the same name
            for name, param in model.state_dict().items():
                logger.info(f"Model param: {name}, shape={param.shape}, dtype={param.dtype}")
                self.state_dict[name] = param

    def update_parameters(self, pid: int = 0) -> None:
        started = time.perf_counter()
        paddle.device.cuda.empty_cache()
        pc = self.parallel_config
        if not self.first_load:
            paddle.distributed.restart_process_group()
            paddle.distributed.restart_process_group(pc.tp_group)
            if pc.enable_expert_parallel:
                paddle.distributed.restart_process_group(pc.ep_group)
        if pc.enable_expert_parallel and not self.first_load:
            from fastdeploy.model_executor.layers.moe.ep import DeepEPBufferManager

            DeepEPBufferManager.recreate_buffer()
            paddle.distributed.barrier(pc.ep_group)
        handlers = {"ipc_snapshot": self._update_ipc_snapshot, "ipc": self._update_ipc}
        handler = handlers.get(self.load_config.load_strategy)
        if handler is None:
            raise ValueError(f"Unsupported strategy: {self.load_config.load_strategy}")
        handler()
        logger.info(f"Update parameters in {time.perf_counter() - started:.2f}s")
        # The runner then rebuilds the KV cache and CUDA graphs and calls finalize_update(pid).

    def _update_ipc_snapshot(self):
        name = f"model_state.tp0{self.meta_src_id}.pdparams"
        path = os.path.join(self.fd_config.model_config.model, name)
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
        pc = self.parallel_config
        if pc.enable_expert_parallel:
            from fastdeploy.model_executor.layers.moe.ep import DeepEPBufferManager

            DeepEPBufferManager.clear_buffer()
            paddle.distributed.barrier(pc.ep_group)
            paddle.distributed.shutdown_process_group(pc.ep_group)
        paddle.device.cuda.empty_cache()
        for model in self.model_list:
            for param in model.state_dict().values():
                param._clear_data()
        self._verify_parameters("clearance")
        if pc.tensor_parallel_size > 1:
            paddle.distributed.barrier(pc.tp_group)
            paddle.distributed.shutdown_process_group(pc.tp_group)
        if pc.enable_expert_parallel:
            paddle.distributed.barrier(pc.ep_group)
            paddle.distributed.shutdown_process_group(pc.ep_group)
        paddle.distributed.shutdown_process_group()
        self._update_shared_status(pid, ModelWeightsStatus.CLEARED)

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

    def finalize_update(self, pid: int = 0):
        self._verify_parameters("update")
        pc = self.parallel_config
        if pc.tensor_parallel_size > 1:
            paddle.distributed.barrier(pc.tp_group)
        if pc.enable_expert_parallel:
            paddle.distributed.barrier(pc.ep_group)
        if not self.first_load:  # the first load writes no status (fd-spec rule 32)
            self._update_shared_status(pid, ModelWeightsStatus.NORMAL)
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
        """The worker loop (fd-spec §2.5): on UPDATING clear requests and update, then wait for
        NORMAL; on CLEARING clear requests and clear, then wait for CLEARED; until NORMAL."""
        cell = model_weights_status.value
        while cell[0] != ModelWeightsStatus.NORMAL:
            if cell[0] == ModelWeightsStatus.UPDATING:
                model_runner.clear_requests()
                model_runner.update_parameters(pid)
                while cell[0] != ModelWeightsStatus.NORMAL:
                    time.sleep(0.01)
            elif cell[0] == ModelWeightsStatus.CLEARING:
                model_runner.clear_requests()
                model_runner.clear_parameters(pid)
                while cell[0] != ModelWeightsStatus.CLEARED:
                    time.sleep(0.01)
            time.sleep(0.01)
