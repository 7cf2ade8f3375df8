"""Stand-in for ``fastdeploy/rl/dynamic_weight_manager.py``, the first rsync generation (before #6852;
index version 55386054242 in the research notes).

Written from the behavioural contract in /work/shared/research/fastdeploy-spec.md (§1.4, §2.5-2.7,
§3.1 "History", §3.2, §3.3, §3.5); none of FastDeploy's code is copied. What makes this generation:
  * ``DynamicWeightManager(fd_config, models, local_rank)``; the constructor loads by rsync
    (``load_strategy == "rsync"``) or by ``update_parameters()``, then ``finalize_update()``; the
    runner finalizes later updates;
  * process groups are restarted / shut down only when the caller asks (``restart_process_group``,
    ``shutdown_process_group`` flags);
  * ipc_snapshot reads only ``{model_config.model}/model_state.tp0{id}.pdparams``, now with
    ``paddle.load(..., safetensors=True)``; its ``/shared_ipc_meta`` fallback of the same name (a plain
    ``paddle.load``) sits behind ``except FileNotFoundError``, which ``paddle.load`` never raises for a
    missing file (ValueError), nor for an unreadable one;
  * rsync: a module-level helper fetches one rank's ``paddle.save`` bytes through
    ``checkpoint_transfer.core.RDMAWeightsDownloader`` and ``paddle.load``s them from memory; the
    version comes from ``{model_dir}/version.txt``; every old key must be present in the new dict;
  * apply as in DWM-EP: per tensor, no stride branch, no rollback, messages naming no file or
    parameter, zero-element parameters never initialized;
  * module-level imports: io, os, time, SharedMemory, typing, numpy, paddle, paddleformers' logger,
    ``fastdeploy.config``, ``fastdeploy.inter_communicator`` (KVCacheStatus, ModelWeightsStatus).
"""
import io
import os
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Dict, List

import numpy as np
import paddle
from paddleformers.utils.log import logger

from fastdeploy.config import FDConfig
from fastdeploy.inter_communicator import KVCacheStatus, ModelWeightsStatus

SHARED_IPC_DIR = "/shared_ipc_meta"


def sync_weights_by_rdma(config, step, rank):
    """One rank's state dict for ``step``, fetched over RDMA as ``paddle.save`` bytes."""
    from checkpoint_transfer.core import RDMAWeightsDownloader

    downloader = RDMAWeightsDownloader(config)
    downloader.initialize()
    data = downloader.get_weights(step, rank)
    if data is None:
        raise Exception("Failed to rsync weights through checkpoint_transfer")
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    logger.info(f"Data size: {len(raw)} bytes")
    return paddle.load(io.BytesIO(raw))


class DynamicWeightManager:
    """Clears and reloads the captured parameters of one worker's models."""

    def __init__(self, fd_config: FDConfig, models, local_rank: int):
        self.fd_config = fd_config
        self.load_config = fd_config.load_config
        self.local_rank = local_rank
        self.parallel_config = fd_config.parallel_config
        self.state_dict: Dict[str, paddle.Tensor] = {}
        self.rank = self.parallel_config.tensor_parallel_rank
        self.nranks = paddle.distributed.get_world_size()
        self.meta_src_id = self._get_gpu_id()
        self.first_load = True
        self.ipc_path = f"{SHARED_IPC_DIR}/ipc_metas_{self.meta_src_id}"
        self.model_list = models if isinstance(models, List) else [models]
        self._capture_model_state()
        if self.load_config.load_strategy == "rsync":
            self.update_weights_by_rdma()
        else:
            self.update_parameters()
        self.finalize_update()
        pc = self.parallel_config
        logger.info(f"DynamicLoad model built by {self.load_config.load_strategy}: tp rank={self.rank}, "
                    f"dp rank={pc.local_data_parallel_id}, ep rank={pc.expert_parallel_rank}, ranks={self.nranks}")

    @paddle.no_grad()
    def _capture_model_state(self):
        for model in self.model_list:
            for name, param in model.state_dict().items():
                logger.info(f"Model param: {name}, shape={param.shape}, dtype={param.dtype}")
                self.state_dict[name] = param

    def update_weights_by_rdma(self, version: str = None, rsync_config: Dict[str, Any] = None):
        settings = rsync_config if rsync_config is not None else self.fd_config.load_config.rsync_config
        if not settings:
            raise Exception("rsync config not set, please set it in 1) launch arguments '--rsync-config' "
                            "or 2) interface arguments 'rsync_config'")
        if version in (None, ""):
            version = self.read_model_version_from_file()
        if version in (None, ""):
            raise Exception("rsync model version not set, please set it in 1) {model_version}/version.txt "
                            "or 2) interface arguments 'version'")
        started = time.perf_counter()
        received = sync_weights_by_rdma(settings, version, self.local_rank)
        sync_cost = time.perf_counter() - started
        # Every captured key must arrive, with its shape and dtype, before anything is set.
        problems = []
        for key, old in self.state_dict.items():
            new = received.get(key)
            if new is None:
                problems.append(f"Invalid parameter: {key} not in new_state_dict")
            elif old.shape != new.shape:
                problems.append(f"Invalid parameter: {key} shape mismatch, new shape:{new.shape}, old shape:{old.shape}")
            elif old.dtype != new.dtype:
                problems.append(f"Invalid parameter: {key} dtype mismatch")
        for line in problems:
            logger.error(line)
        if problems:
            raise ValueError("Invalid new_state_dict, update parameters failed")
        applying = time.perf_counter()
        for key, param in self.state_dict.items():
            param.set_value(received[key])
        done = time.perf_counter()
        return {"sync_cost": sync_cost, "update_cost": done - applying, "total_cost": done - started,
                "version": version, "rank": self.local_rank}

    def update_parameters(self, pid: int = 0, restart_process_group=False) -> None:
        started = time.perf_counter()
        paddle.device.cuda.empty_cache()
        pc = self.parallel_config
        if not self.first_load and restart_process_group:
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

    def _update_ipc_snapshot(self):
        name = f"model_state.tp0{self.meta_src_id}.pdparams"
        path = os.path.join(self.fd_config.model_config.model, name)
        try:
            loaded = paddle.load(path, safetensors=True)
        except FileNotFoundError:  # never raised by paddle.load for a missing file (ValueError)
            loaded = paddle.load(f"{SHARED_IPC_DIR}/{name}")
        self._update_model_from_state(loaded, "snapshot")
        logger.info(f"IPC snapshot update parameters completed from {path}")

    def _update_ipc(self):
        metas = paddle.load(self.ipc_path)
        self._update_model_from_state(self._convert_ipc_meta_to_tensor(metas), "raw")
        logger.info(f"IPC update parameters completed from file: {self.ipc_path}")

    def clear_parameters(self, pid: int = 0, shutdown_process_group=False) -> None:
        logger.info("start clear paramaters")
        pc = self.parallel_config
        if pc.enable_expert_parallel:
            from fastdeploy.model_executor.layers.moe.ep import DeepEPBufferManager

            DeepEPBufferManager.clear_buffer()
            paddle.distributed.barrier(pc.ep_group)
            if shutdown_process_group:
                paddle.distributed.shutdown_process_group(pc.ep_group)
        paddle.device.cuda.empty_cache()
        for model in self.model_list:
            for param in model.state_dict().values():
                param._clear_data()
        self._verify_parameters("clearance")
        for enabled, group in ((pc.tensor_parallel_size > 1, pc.tp_group), (pc.enable_expert_parallel, pc.ep_group)):
            if enabled:
                paddle.distributed.barrier(group)
                if shutdown_process_group:
                    paddle.distributed.shutdown_process_group(group)
        if shutdown_process_group:
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
        if not self.first_load:
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

    def read_model_version_from_file(self):
        """The stripped text of ``{model_dir}/version.txt``, or None (logged) when unreadable."""
        path = os.path.join(self.fd_config.model_config.model, "version.txt")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            logger.error(f"Failed to read model version file '{path}': {e}")
            return None

    @staticmethod
    def check_model_weights_status(model_weights_status, kv_cache_status, model_runner, pid, block):
        """The worker loop (fd-spec §2.5, after #5249): act on UPDATING / CLEARING until NORMAL, or
        until CLEARED when ``block`` is False; the KV cache status follows."""
        cell = model_weights_status.value

        def wait_for(value):
            while cell[0] != value:
                time.sleep(0.01)

        while cell[0] != ModelWeightsStatus.NORMAL and (block or cell[0] != ModelWeightsStatus.CLEARED):
            if cell[0] == ModelWeightsStatus.UPDATING:
                if kv_cache_status:
                    kv_cache_status.value[0] = KVCacheStatus.UPDATING
                model_runner.clear_requests()
                model_runner.update_parameters(pid)
                wait_for(ModelWeightsStatus.NORMAL)
            elif cell[0] == ModelWeightsStatus.CLEARING:
                if kv_cache_status:
                    kv_cache_status.value[0] = KVCacheStatus.CLEARING
                model_runner.clear_requests()
                model_runner.clear_parameters(pid)
                wait_for(ModelWeightsStatus.CLEARED)
            else:
                time.sleep(0.01)
