"""Stand-in for ``fastdeploy/rl/dynamic_weight_manager.py``, the generation of #6761 (a7f52c300, 2026-03-25, "support
v1 update/clear api for RL"; its cherry-pick #6974 holds the same file): the first with the split operations the
runner's V1 sleep and wakeup call.

Written from the behavioural contract in /work/shared/research/fastdeploy-spec.md (§1.4, §2.5-2.8, §3.1-3.3,
§3.5 "History"); none of FastDeploy's code is copied. Its ipc_snapshot, apply, clear, status and loop behaviour is
the #6852 generation's (tests/fd_standins/parts), quirks included, with two differences of its era:
  * rsync is still the first protocol (as tests/fd_standins/rsync_tp0): ``update_weights_by_rdma(version,
    rsync_config)`` fetches one rank's ``paddle.save`` bytes through ``checkpoint_transfer.core.RDMAWeightsDownloader``,
    the version from ``{model_dir}/version.txt``, every old key required, no ``verify_checksum`` (it came with
    #7042); no ``yaml`` import;
  * capture logs each parameter without its place.
What this generation adds (fd-spec §2.8): the runner's ``sleep("weight")`` calls ``clear_deepep_buffer()`` (EP),
``clear_model_weight()`` and ``clear_communication_group()`` (with ``shutdown_comm_group_if_worker_idle``); its
``wakeup("weight")`` calls ``restart_communication_group()``, ``recreate_deepep_buffer()`` (EP) and
``reload_model_weights()``, then recaptures. The split operations write no status, verify nothing, take no barrier
but the groups' own, and ``reload_model_weights`` knows only ``ipc_snapshot`` and ``ipc`` (fd-spec rule 37).
"""
import gc
import glob
import io
import os
import re
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Dict, List

import numpy as np
import paddle
from paddleformers.utils.log import logger

from fastdeploy.config import FDConfig
from fastdeploy.inter_communicator import KVCacheStatus, ModelWeightsStatus

SHARED_IPC_DIR = "/shared_ipc_meta"  # hard-coded in FastDeploy, not configurable
# Searched on the whole path (FastDeploy's behaviour, fd-spec rule 6).
PART_INDEX = re.compile(r"\.part(\d+)\.")


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


def _elapsed(since: float) -> float:
    return time.perf_counter() - since


class DynamicWeightManager:
    """Clears and reloads the captured parameters of one worker's model(s)."""

    def __init__(self, fd_config: FDConfig, models, local_rank: int):
        self.fd_config = fd_config
        self.load_config = fd_config.load_config
        self.parallel_config = fd_config.parallel_config
        self.local_rank = local_rank
        self.state_dict: Dict[str, paddle.Tensor] = {}
        self.rank = self.parallel_config.tensor_parallel_rank  # only TP rank 0 writes the status cell
        self.nranks = paddle.distributed.get_world_size()
        self.meta_src_id = self._get_gpu_id()
        self.first_load = True
        self.ipc_path = f"{SHARED_IPC_DIR}/ipc_metas_{self.meta_src_id}"
        self.model_list = models if isinstance(models, List) else [models]
        self._capture_model_state()
        # The first load happens here; finalize_update then skips the status write (fd-spec rule 32).
        if self.load_config.load_strategy == "rsync":
            self.update_weights_by_rdma()
        else:
            self.update_parameters()
        self.finalize_update()
        logger.info(
            f"DynamicLoad model built by {self.load_config.load_strategy}: tp rank={self.rank}, "
            f"dp rank={self.parallel_config.local_data_parallel_id}, "
            f"ep rank={self.parallel_config.expert_parallel_rank}, ranks={self.nranks}"
        )

    @paddle.no_grad()
    def _capture_model_state(self):
        # Never initialize here (FastDeploy #7171: OOM on the ipc path). A later model's parameter
        # replaces an earlier one of the same name.
        for model in self.model_list:
            for name, param in model.state_dict().items():
                logger.info(f"Model param: {name}, shape={param.shape}, dtype={param.dtype}")
                self.state_dict[name] = param

    # -- rsync, the first protocol (fd-spec §3.5 "History") ---------------------------------------
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

    # -- update, fd-spec §2.7 ------------------------------------------------------------------
    def _strategy_handler(self):
        handlers = {"ipc_snapshot": self._update_ipc_snapshot, "ipc": self._update_ipc}
        strategy = self.load_config.load_strategy
        if strategy not in handlers:
            raise ValueError(f"Unsupported strategy: {strategy}")
        return handlers[strategy]

    def update_parameters(self, pid: int = 0, restart_process_group=False) -> None:
        started = time.perf_counter()
        paddle.device.cuda.empty_cache()
        if not self.first_load and restart_process_group:
            self._restart_groups()
        if not self.first_load and self.parallel_config.enable_expert_parallel:
            from fastdeploy.model_executor.layers.moe.ep import DeepEPBufferManager

            DeepEPBufferManager.recreate_buffer()
            paddle.distributed.barrier(self.parallel_config.ep_group)
        self._strategy_handler()()
        logger.info(f"Update parameters in {_elapsed(started):.2f}s")
        # The runner then rebuilds the KV cache and CUDA graphs and calls finalize_update(pid).

    def _restart_groups(self):
        paddle.distributed.restart_process_group()
        paddle.distributed.restart_process_group(self.parallel_config.tp_group)
        if self.parallel_config.enable_expert_parallel:
            paddle.distributed.restart_process_group(self.parallel_config.ep_group)

    def restart_communication_group(self):
        if self.first_load:
            return
        started = time.perf_counter()
        self._restart_groups()
        logger.info(f"finish restarting communication groups! time cost: {_elapsed(started):.3f}s")

    def recreate_deepep_buffer(self):
        if self.first_load:
            return
        started = time.perf_counter()
        from fastdeploy.model_executor.layers.moe.ep import DeepEPBufferManager

        DeepEPBufferManager.recreate_buffer()
        paddle.distributed.barrier(self.parallel_config.ep_group)
        logger.info(f"finish recreating deepep buffer! time cost: {_elapsed(started):.3f}s")

    def reload_model_weights(self):
        if self.first_load:
            return
        started = time.perf_counter()
        self._strategy_handler()()
        logger.info(f"finish reload model weights! time cost: {_elapsed(started):.3f}s")

    # -- ipc_snapshot, fd-spec §3.1 ------------------------------------------------------------
    def _update_ipc_snapshot(self):
        """Priorities: part files, single file, legacy ``tp0{id}`` file, then /shared_ipc_meta."""
        model_dir = self.fd_config.model_config.model
        base = f"model_state.tp{paddle.distributed.get_rank()}.{self.meta_src_id}"

        parts, unparsable = [], []
        for path in glob.glob(os.path.join(model_dir, f"{base}.part*.pdparams")):
            found = PART_INDEX.search(path)  # the whole path: a ".part7." directory wins (rule 6)
            if found is None:
                unparsable.append(os.path.basename(path))
            else:
                parts.append((int(found.group(1)), path))
        if unparsable:
            logger.warning(
                "Found snapshot part files with invalid naming pattern under %s: %s. "
                "These files will be ignored when loading IPC snapshot parts.",
                model_dir,
                ", ".join(unparsable),
            )
        parts.sort(key=lambda entry: entry[0])  # numeric and stable: equal indices keep glob order
        if parts:
            logger.info(f"Found {len(parts)} snapshot part files for {base}")
            for index, path in parts:
                logger.info(f"Loading snapshot part {index + 1}/{len(parts)} from {path}")
                loaded = paddle.load(path, safetensors=True)
                self._update_model_from_state(loaded, f"snapshot-part{index}")
                del loaded  # one part's tensors alive at a time (#6852)
                gc.collect()
            logger.info(f"IPC snapshot update completed from {len(parts)} part files under {model_dir}")
            return

        for path, kind in (
            (os.path.join(model_dir, f"{base}.pdparams"), ""),
            (os.path.join(model_dir, f"model_state.tp0{self.meta_src_id}.pdparams"), "legacy format "),
        ):
            if os.path.exists(path):
                self._update_model_from_state(paddle.load(path, safetensors=True), "snapshot")
                logger.info(f"IPC snapshot update completed from {kind}{path}")
                return

        fallback = f"{SHARED_IPC_DIR}/{base}.pdparams"
        if not os.path.exists(fallback):
            raise FileNotFoundError(f"No snapshot found for {base}: checked {model_dir} (new/legacy) and {fallback}")
        logger.info(f"No local snapshot in {model_dir}, fallback to {fallback}")
        self._update_model_from_state(paddle.load(fallback), "snapshot")  # a pickle, no safetensors=True
        logger.info(f"IPC snapshot update completed from {fallback}")

    # -- ipc, fd-spec §3.3 ---------------------------------------------------------------------
    def _update_ipc(self):
        metas = paddle.load(self.ipc_path)
        self._update_model_from_state(self._convert_ipc_meta_to_tensor(metas), "raw")
        logger.info(f"IPC update parameters completed from file: {self.ipc_path}")

    @staticmethod
    def _convert_ipc_meta_to_tensor(ipc_meta: Dict[str, Any]) -> Dict[str, paddle.Tensor]:
        tensors = {}
        for name, meta in ipc_meta.items():
            # In place: each meta must be a mutable 7-item list with a latin-1 str handle (rule 23).
            meta[0] = meta[0].encode("latin-1")
            meta[6] = int(os.getenv("FLAGS_selected_gpus", "0"))
            shared = paddle.base.core.LoDTensor._new_shared_cuda(tuple(meta))
            tensors[name] = paddle.to_tensor(shared)
        return tensors

    # -- clear, fd-spec §2.6 -------------------------------------------------------------------
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
        self._drop_weights()
        self._verify_parameters("clearance")
        if pc.tensor_parallel_size > 1:
            paddle.distributed.barrier(pc.tp_group)
            if shutdown_process_group:
                paddle.distributed.shutdown_process_group(pc.tp_group)
        if pc.enable_expert_parallel:
            paddle.distributed.barrier(pc.ep_group)
            if shutdown_process_group:
                paddle.distributed.shutdown_process_group(pc.ep_group)
        if shutdown_process_group:
            paddle.distributed.shutdown_process_group()
        self._update_shared_status(pid, ModelWeightsStatus.CLEARED)

    def _drop_weights(self):
        for model in self.model_list:
            for param in model.state_dict().values():
                param._clear_data()

    def clear_deepep_buffer(self):
        started = time.perf_counter()
        from fastdeploy.model_executor.layers.moe.ep import DeepEPBufferManager

        DeepEPBufferManager.clear_buffer()
        logger.info(f"finish clearing deepep buffer! time cost: {_elapsed(started):.3f}s")

    def clear_model_weight(self):
        started = time.perf_counter()
        self._drop_weights()
        logger.info(f"finish clearing model weight! time cost: {_elapsed(started):.3f}s")

    def clear_communication_group(self):
        started = time.perf_counter()
        pc = self.parallel_config
        groups = ([pc.ep_group] if pc.enable_expert_parallel else []) + ([pc.tp_group] if pc.tensor_parallel_size > 1 else [])
        for group in groups:
            paddle.distributed.barrier(group)
            paddle.distributed.shutdown_process_group(group)
        logger.info(f"finish clearing communication groups! time cost: {_elapsed(started):.3f}s")

    # -- apply, fd-spec §3.2 -------------------------------------------------------------------
    def _update_model_from_state(self, state_dict: Dict[str, paddle.Tensor], src_type: str):
        if len(state_dict) == 0:
            raise ValueError(f"No parameter found in state dict {state_dict}")  # names no file (rule 9)
        applied = 0
        with paddle.no_grad():
            for name, incoming in state_dict.items():
                target = self.state_dict.get(name)
                if target is None:
                    logger.debug(f"Ignoring unmatched {src_type} param: {name}")
                    continue
                # Checked per tensor while applying: no rollback of earlier ones (rule 17).
                self._validate_parameter_match(name, incoming, target)
                if incoming.stride() == target.stride():
                    incoming._share_buffer_to(target)  # zero-copy alias
                else:
                    logger.warning(
                        f"name:[{name}] target_param.stride():[{target.stride()}] != new_param.stride():[{incoming.stride()}]"
                    )
                    if not target._is_initialized():
                        target[...] = paddle.empty(target.shape, dtype=target.dtype)
                    target[...] = incoming
                applied += 1
        logger.info(f"Updated {applied}/{len(state_dict)} parameters from {src_type} source")

    def _validate_parameter_match(self, name: str, src: paddle.Tensor, dst: paddle.Tensor):
        if src.dtype != dst.dtype:
            raise TypeError(f"Type mismatch for {name}: {src.dtype} vs {dst.dtype}")
        if src.shape != dst.shape:
            raise ValueError(f"Shape mismatch for {name}: {src.shape} vs {dst.shape}")

    def finalize_update(self, pid: int = 0):
        self._verify_parameters("update")
        if self.parallel_config.tensor_parallel_size > 1:
            paddle.distributed.barrier(self.parallel_config.tp_group)
        if self.parallel_config.enable_expert_parallel:
            paddle.distributed.barrier(self.parallel_config.ep_group)
        if not self.first_load:  # the first load writes no status (fd-spec rule 32)
            self._update_shared_status(pid, ModelWeightsStatus.NORMAL)
        self.first_load = False

    def _get_gpu_id(self) -> int:
        # Bare int() and list indexing: a UUID entry or an out-of-range selection raises an error
        # that does not name the variable (fd-spec rule 12).
        visible = os.getenv("CUDA_VISIBLE_DEVICES", "0").split(",")
        selected = int(os.getenv("FLAGS_selected_gpus", "0"))
        return int(visible[selected])

    def _verify_parameters(self, operation: str):
        want = operation == "update"
        wrong = [name for name, param in self.state_dict.items() if param._is_initialized() != want]
        for name in wrong:
            logger.error(f"Verification failed after {operation}: Param {name} initialized={not want} (expected {want})")
        if wrong:
            raise RuntimeError(f"❌ Model Parameter {operation} verification failed")
        logger.info(f"Model Parameter {operation} verified successfully")

    def _log_memory(self, context: str):
        gib = 1024**3
        cuda = paddle.device.cuda
        logger.warning(
            f"GPU memory usage {context}:"
            f"max_allocated: {cuda.max_memory_allocated() / gib:.2f}GB\n"
            f"max_reserved: {cuda.max_memory_reserved() / gib:.2f}GB\n"
            f"current_allocated: {cuda.memory_allocated() / gib:.2f}GB\n"
            f"current_reserved: {cuda.memory_reserved() / gib:.2f}GB"
        )

    def _update_shared_status(self, pid: int, status: int) -> None:
        """Write ``status`` into the engine's int32 cell ``model_weights_status.{pid}`` (TP rank 0 only)."""
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
        """The worker's legacy status loop (fd-spec §2.5): act on UPDATING / CLEARING until NORMAL,
        or until CLEARED when ``block`` is False."""
        cell = model_weights_status.value
        logger.info(f"dynamic weight manager is check model weights status! {cell[0]}")

        def wait_for(value):
            while cell[0] != value:
                time.sleep(0.01)

        while cell[0] != ModelWeightsStatus.NORMAL and (block or cell[0] != ModelWeightsStatus.CLEARED):
            if cell[0] == ModelWeightsStatus.UPDATING:
                logger.info("infer engine stopped! start to load new checkpoint...")
                if kv_cache_status:
                    kv_cache_status.value[0] = KVCacheStatus.UPDATING
                model_runner.clear_requests()
                model_runner.update_parameters(pid)
                wait_for(ModelWeightsStatus.NORMAL)
                logger.info("finished loading new checkpoint")
            elif cell[0] == ModelWeightsStatus.CLEARING:
                logger.info("infer engine stopped! start to clear checkpoint...")
                if kv_cache_status:
                    kv_cache_status.value[0] = KVCacheStatus.CLEARING
                model_runner.clear_requests()
                model_runner.clear_parameters(pid)
                wait_for(ModelWeightsStatus.CLEARED)
                logger.info("finished clearing checkpoint")
            else:
                time.sleep(0.01)
