"""Mutants of the streamed paths (SPEC.md RSYNC, GDR, STREAM, DRAFT): rsync and GDR with one real bug put
back, many of them FastDeploy's own (fd-spec §4.4, §5.4) or other engines' (peers.md).

Patches follow tests/mutants/base.py: module attributes the reference looks up at call time.
"""
from __future__ import annotations

import os

import paddle

from reference import gdr, mtp_routing, prefetch, rsync, stream_config, transfer_lib
from reference.mtp_routing import Delivery

from .base import Mutant

_store = rsync.store
_problems = rsync.problems
_resolve = stream_config.resolve_version
_gdr_kwargs = stream_config.gdr_transfer_kwargs
_load_models = mtp_routing.load_models
_routing_layers = mtp_routing.routing_layers
_Prefetcher = prefetch.Prefetcher
_incomplete = gdr._incomplete
_destroy = transfer_lib.destroy
_ensure = transfer_lib.ensure
_update_from_rsync = rsync.update_from_rsync
_receive = rsync.receive
_worker_identity = stream_config.worker_identity


# -- rsync -------------------------------------------------------------------------------------------
class RsyncThroughFloat32(Mutant):
    id = "rsync_through_float32"
    bug = ("received tensors are cast through float32 before they are stored (a loader that 'normalizes' what it "
           "received): int64 loses its low bits, float64 its precision (peers.md §13: compare bytes, not sums)")
    kills = frozenset({"RSYNC-ROUNDTRIP"})

    def patches(self):
        def store(received, params, bootstrap):
            _store({k: v.astype("float32").astype(v.dtype) if v.dtype != paddle.bool else v for k, v in received.items()},
                   params, bootstrap)

        return {"reference.rsync.store": store}


class RsyncVersionFileOnly(Mutant):
    id = "rsync_version_file_only"
    bug = "the version argument is ignored: every update asks for version.yaml's step (#7171 half done)"
    kills = frozenset({"RSYNC-VERSION"})  # (RSYNC-RESULT: the trainer publishes version.yaml naming the same step)

    def patches(self):
        return {"reference.stream_config.resolve_version": lambda version, model_dir: _resolve(None, model_dir)}


class RsyncEmptyStepAccepted(Mutant):
    id = "rsync_empty_step_accepted"
    bug = ("a step that carries no tensor passes validation and applies nothing, reported as a success (FastDeploy's "
           "rsync: new may be any subset of old, the empty one included)")
    kills = frozenset({"APPLY-EMPTY-REFUSED"})

    def patches(self):
        return {"reference.rsync.problems": lambda received, params, models:
                [] if not received else _problems(received, params, models)}


class RsyncAllocatesBeforeBootstrap(Mutant):
    id = "rsync_allocates_before_bootstrap"
    bug = ("every unallocated parameter is allocated before a bootstrap load, which then copies the received step "
           "into it (FastDeploy before #7171: param.initialize() in _capture_model_state, the OOM): two models in memory")
    kills = frozenset({"MEM-STREAM-BOOTSTRAP"})

    def patches(self):
        def store(received, params, bootstrap):
            with paddle.no_grad():
                for param in params.values():
                    if not param._is_initialized():
                        paddle.ones(param.shape, param.dtype)._share_buffer_to(param)
            _store(received, params, False)

        return {"reference.rsync.store": store}


class RsyncApplyThenValidate(Mutant):
    id = "rsync_apply_then_validate"
    bug = ("the keys that match are applied before the step is refused (validation per key while applying, "
           "FastDeploy's _update_model_from_state, fd-spec rule 17): a refused step leaves a mixed model")
    kills = frozenset({"RSYNC-VALIDATE-ALL"})

    def patches(self):
        def problems(received, params, models):
            found = _problems(received, params, models)
            if found:
                _store({k: v for k, v in received.items() if k in params and tuple(v.shape) == tuple(params[k].shape)
                        and v.dtype == params[k].dtype}, params, False)
            return found

        return {"reference.rsync.problems": problems}


class RsyncMissingKeyIsError(Mutant):
    id = "rsync_missing_key_is_error"
    bug = "validation iterates the model's keys: a step without one is refused (DWM-fork, before #7675)"
    kills = frozenset({"RSYNC-SUBSET"})

    def patches(self):
        def problems(received, params, models):
            return _problems(received, params, models) + [f"Invalid parameter: {k} not in new_state_dict"
                                                          for k in params if k not in received]

        return {"reference.rsync.problems": problems}


class RsyncAlwaysAdopt(Mutant):
    id = "rsync_always_adopt"
    bug = ("every received tensor is adopted (buffer shared) even into loaded parameters: their addresses change "
           "under captured CUDA graphs (FastDeploy #8085)")
    kills = frozenset({"RSYNC-IN-PLACE"})

    def patches(self):
        def store(received, params, bootstrap):
            with paddle.no_grad():
                for key, new in received.items():
                    new._share_buffer_to(params[key])

        return {"reference.rsync.store": store}


class RsyncGlobalRankInResult(Mutant):
    id = "rsync_global_rank_in_result"
    bug = "the result's rank is the global rank, not the worker's local rank"
    kills = frozenset({"RSYNC-RESULT"})

    def patches(self):
        return {"reference.rsync.update_from_rsync": lambda manager: {**_update_from_rsync(manager), "rank": manager.rank}}


class RsyncHandlePerUpdate(Mutant):
    id = "rsync_handle_per_update"
    bug = "a new CheckpointTransfer handle is created, initialized and cleaned up for every rsync update (before #7042)"
    kills = frozenset({"RSYNC-HANDLE-ONCE"})

    def patches(self):
        def ensure(owner, make):
            _destroy(owner)
            return _ensure(owner, make)

        return {"reference.transfer_lib.ensure": ensure}


class RsyncChecksumDropped(Mutant):
    id = "rsync_checksum_dropped"
    bug = "verify_checksum is never passed to receive_stream (#7042's plumbing missing)"
    kills = frozenset({"RSYNC-CHECKSUM"})

    def patches(self):
        return {"reference.rsync.receive": lambda manager, handle, version, verify, wait_s:
                _receive(manager, handle, version, False, wait_s)}


class RsyncHandleNoGroupSize(Mutant):
    id = "rsync_handle_no_group_size"
    bug = "the handle is created without group_size: the library's default world of 1, whatever the world size"
    kills = frozenset({"RSYNC-HANDLE-CONFIG"})

    def patches(self):
        return {"reference.stream_config.rsync_kwargs": lambda cfg, who: {**cfg, "local_rank": who.local_rank}}


class RsyncApplyAsReceived(Mutant):
    id = "rsync_apply_as_received"
    bug = ("each tensor is applied as it arrives instead of after the whole step (no materialization): a stream "
           "that breaks half-way leaves a mixed model")
    kills = frozenset({"RSYNC-FAULTS"})

    def patches(self):
        def receive(manager, handle, version, verify, wait_s):
            received = {}
            for key, tensor in handle.receive_stream(step_id=version, verify_checksum=verify):
                target = manager.params.get(key)
                if target is not None and tuple(target.shape) == tuple(tensor.shape) and target.dtype == tensor.dtype:
                    _store({key: tensor}, manager.params, False)
                received[key] = tensor
            return received

        return {"reference.rsync.receive": receive}


# -- GDR ---------------------------------------------------------------------------------------------
def _load_models_variant(*, yield_routed=True, flush_first=False, final_flush=True):
    """mtp_routing.load_models with one of its steps changed."""

    def load_models(models, items, chunk, mtp_names=()):
        main, mtp_models = models[0], list(models[1:])
        if not mtp_models:
            return _load_models(models, items, chunk, mtp_names)
        out = Delivery()
        layers = mtp_routing.routing_layers(mtp_models)
        pending = []

        def flush():
            if pending:
                batch = list(pending)
                pending.clear()
                for model in mtp_models:
                    model.load_weights(iter(batch))

        def routed():
            for item in items:
                name = mtp_routing.item_name(item)
                is_mtp = mtp_routing.routes(name, layers)
                if is_mtp:
                    pending.append(item)
                    out.mtp_cache_count += 1
                if flush_first and len(pending) >= chunk:
                    flush()
                if yield_routed or not is_mtp:
                    out.update_count += 1
                    out.names.append(name)
                    yield item
                else:
                    out.names.append(name)
                if not flush_first and len(pending) >= chunk:
                    flush()

        main.load_weights(routed())
        if final_flush:
            flush()
        if out.mtp_cache_count == 0:
            raise ValueError(mtp_routing.NO_MTP_WEIGHTS)
        return out

    return load_models


class GdrMainSkipsMtpItems(Mutant):
    id = "gdr_main_skips_mtp_items"
    bug = "items routed to the MTP models are not handed to the main model (it sees only 'its' items)"
    kills = frozenset({"GDR-MAIN-EVERY-ITEM"})

    def patches(self):
        return {"reference.mtp_routing.load_models": _load_models_variant(yield_routed=False)}


class GdrFlushBeforeMain(Mutant):
    id = "gdr_flush_before_main"
    bug = "a full MTP chunk is flushed before the main model is handed its last item"
    kills = frozenset({"GDR-MTP-CHUNKS"})

    def patches(self):
        return {"reference.mtp_routing.load_models": _load_models_variant(flush_first=True)}


class GdrNoFinalFlush(Mutant):
    id = "gdr_no_final_flush"
    bug = "the last, partial MTP chunk is never flushed: the draft model misses the stream's tail"
    kills = frozenset({"GDR-MTP-CHUNKS", "DRAFT-PAIR-UPDATED"})

    def patches(self):
        return {"reference.mtp_routing.load_models": _load_models_variant(final_flush=False)}


class GdrRouteBySubstring(Mutant):
    id = "gdr_route_by_substring"
    bug = "MTP routing tests substrings (FastDeploy's tokens): sublayers.2. and xmtp_ reach MTP layer 2 (fd-spec rule 45)"
    kills = frozenset({"GDR-MTP-ROUTE-COMPONENTS"})

    def patches(self):
        def routes(name, layers):
            return "mtp_" in name or any(f"layers.{k}." in name for k in layers)

        return {"reference.mtp_routing.routes": routes}


class GdrRouteModelAttrsOnly(Mutant):
    id = "gdr_route_model_attrs_only"
    bug = "MTP layers are read from the model's own attributes only, never fd_config.model_config"
    kills = frozenset({"GDR-MTP-ROUTE"})

    def patches(self):
        def mtp_layers(model):
            start, count = getattr(model, "mtp_start_layer_idx", None), getattr(model, "num_mtp_layers", None)
            return None if start is None or count is None else range(int(start), int(start) + int(count))

        return {"reference.mtp_routing.mtp_layers": mtp_layers}


class GdrNoMtpCheckMissing(Mutant):
    id = "gdr_no_mtp_check_missing"
    bug = "no 'No MTP weights' check: a stream without MTP items only fails later, as an incomplete update"
    kills = frozenset({"GDR-NO-MTP-WEIGHTS"})

    def patches(self):
        def load_models(models, items, chunk, mtp_names=()):
            try:
                return _load_models(models, items, chunk, mtp_names)
            except ValueError as e:
                if mtp_routing.NO_MTP_WEIGHTS not in str(e):
                    raise
                return Delivery(0, 0, [])

        return {"reference.mtp_routing.load_models": load_models}


class _CancelIsEnd(_Prefetcher):
    def __iter__(self):
        try:
            yield from super().__iter__()
        except prefetch.StreamCancelled:
            return  # DWM-B: the finally queues done_marker, the consumer sees a normal end


class GdrCancelIsEnd(Mutant):
    id = "gdr_cancel_is_end"
    bug = ("a cancelled receive ends the stream as if it were complete (DWM-B: BaseException escapes "
           "`except Exception`, the finally queues the done marker; fd-spec rule 49)")
    kills = frozenset({"GDR-RECEIVER-ERROR"})

    def patches(self):
        return {"reference.prefetch.Prefetcher": _CancelIsEnd}


class GdrShortStreamAccepted(Mutant):
    id = "gdr_short_stream_accepted"
    bug = "a stream that ends early without an error is accepted (fd-spec §4.4: update_count is just smaller)"
    kills = frozenset({"GDR-SHORT-STREAM", "DRAFT-NOT-STALE"})

    def patches(self):
        return {"reference.gdr._incomplete": lambda manager, delivery, step, tracked: None}


class _DrainOnError(_Prefetcher):
    def stop(self):
        # "resynchronize": read the rest of the stream before giving up
        for _ in self._drain_all():
            pass
        super().stop()

    def _drain_all(self):
        while True:
            kind, value = self._queue.get(timeout=self._wait_s)
            if kind != "item":
                return
            self._window.release()
            yield value


class GdrConsumerErrorDrains(Mutant):
    id = "gdr_consumer_error_drains"
    bug = "after a loader error the receiver reads the rest of the stream before it stops (it never lets go early)"
    kills = frozenset({"GDR-CONSUMER-ERROR"})

    def patches(self):
        return {"reference.prefetch.Prefetcher": _DrainOnError}


class _Unbounded(_Prefetcher):
    def __init__(self, open_source, *, window, wait_s, where):
        super().__init__(open_source, window=1 << 20, wait_s=wait_s, where=where)


class GdrPrefetchUnbounded(Mutant):
    id = "gdr_prefetch_unbounded"
    bug = "the prefetch queue has no bound: the receiver holds the whole stream in memory ahead of the loader"
    kills = frozenset({"GDR-PREFETCH-BOUND"})

    def patches(self):
        return {"reference.prefetch.Prefetcher": _Unbounded}


class GdrNoRefresh(Mutant):
    id = "gdr_no_refresh"
    bug = "tracked parameters are not captured again after a load: those a loader replaced are stale (fd-spec rule 48)"
    kills = frozenset({"GDR-REFRESH"})

    def patches(self):
        from reference.manager import WeightManager

        class Stale(WeightManager):
            def __setattr__(self, name, value):
                if name == "params" and "params" in self.__dict__:
                    return  # the refresh after a GDR load is dropped
                super().__setattr__(name, value)

        return {"reference.adapter.WeightManager": Stale}


class GdrIndexIgnored(Mutant):
    id = "gdr_index_ignored"
    bug = "global_rank is the local rank: rsync_config's index is ignored (fd-spec rule 39)"
    kills = frozenset({"GDR-CONFIG"})

    def patches(self):
        def kwargs(cfg, who, **kw):
            out = _gdr_kwargs(cfg, who, **kw)
            if not kw["ipc"]:
                out["global_rank"] = who.local_rank
            return out

        return {"reference.stream_config.gdr_transfer_kwargs": kwargs}


class GdrMutatesCallerConfig(Mutant):
    id = "gdr_mutates_caller_config"
    bug = "the caller's rsync_config dict is changed in place (index popped, device_name renamed; fd-spec rule 40)"
    kills = frozenset({"GDR-CONFIG"})

    def patches(self):
        def settings(options):
            value = options.get("rsync_config")
            if not isinstance(value, dict):
                raise ValueError("rsync_config")
            value.pop("index", None)
            if "device_name" in value:
                value["device"] = value.pop("device_name")
            return value

        return {"reference.stream_config.settings": settings}


class GdrIpcGlobalRank(Mutant):
    id = "gdr_ipc_global_rank"
    bug = "IPC mode uses the global rank (IPC ranks are per node: the worker's FLAGS_selected_gpus)"
    kills = frozenset({"GDR-IPC-MODE"})

    def patches(self):
        import os

        def kwargs(cfg, who, **kw):
            out = _gdr_kwargs(cfg, who, **kw)
            if kw["ipc"]:
                out["global_rank"] = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
            return out

        return {"reference.stream_config.gdr_transfer_kwargs": kwargs}


def _manager_with_close(close):
    from reference.manager import WeightManager

    return type("ClosingManager", (WeightManager,), {"close": close})


class GdrHandleKeptOnFailure(Mutant):
    id = "gdr_handle_kept_on_failure"
    bug = "a failed update keeps its half-used handle cached (before #8078's destroy-on-failure)"
    kills = frozenset({"GDR-HANDLE-CLEANUP"})

    def patches(self):
        return {"reference.transfer_lib.destroy": lambda owner: None,
                "reference.adapter.WeightManager": _manager_with_close(lambda self: _destroy(self))}


class GdrHandlePerUpdate(Mutant):
    id = "gdr_handle_per_update"
    bug = ("every GDR update builds, initializes and cleans up its own CheckpointTransfer (FastDeploy before #8078: "
           "version 45 / DWM-B)")
    kills = frozenset({"GDR-HANDLE-REUSE"})

    def patches(self):
        def ensure(owner, make):
            _destroy(owner)
            return _ensure(owner, make)

        return {"reference.transfer_lib.ensure": ensure}


class GdrCleanupMissesCancellation(Mutant):
    id = "gdr_cleanup_misses_cancellation"
    bug = ("a cancelled stream reaches the update as asyncio.CancelledError (a BaseException) and the handle is "
           "destroyed under `except Exception` only: the cancelled handle stays cached (FastDeploy after #8078)")
    kills = frozenset({"GDR-HANDLE-CLEANUP"})

    def patches(self):
        import asyncio
        import contextlib

        class Cancelled(asyncio.CancelledError):
            pass

        @contextlib.contextmanager
        def receiving(owner, receiver):
            receiver.start()
            try:
                yield receiver
            except Exception:
                receiver.stop()
                _destroy(owner)
                receiver.join()
                raise
            else:
                receiver.join()

        return {"reference.prefetch.StreamCancelled": Cancelled, "reference.transfer_lib.receiving": receiving}


# -- both paths --------------------------------------------------------------------------------------
class StreamWaitsForever(Mutant):
    id = "stream_waits_forever"
    bug = "the consumer waits for the next item without a bound (DWM-B's q.get(), fd-spec §4.2): a hung library hangs the update"
    kills = frozenset({"STREAM-HANG-BOUNDED"})

    def patches(self):
        return {"reference.prefetch.wait_bound": lambda recv_timeout_s: 1e6}


class StreamHandleNeverClosed(Mutant):
    id = "stream_handle_never_closed"
    bug = "the cached handle is never cleaned up at the session's close: its socket and the trainer's session stay"
    kills = frozenset({"STREAM-NO-LEAK"})

    def patches(self):
        return {"reference.adapter.WeightManager": _manager_with_close(lambda self: None)}


class StreamOptionsUnchecked(Mutant):
    id = "stream_options_unchecked"
    bug = ("the per-item wait is taken as given (0, negative, a bool): checked by nobody before the library is "
           "initialized with it, as FastDeploy forwards rsync_config to TransferConfig")
    kills = frozenset({"STREAM-OPTIONS"})

    def patches(self):
        return {"reference.stream_config.recv_timeout": lambda cfg: float(cfg.get("recv_bucket_timeout_s", 60.0) or 0.0)
                if not isinstance(cfg.get("recv_bucket_timeout_s"), str) else 60.0}


class StreamIdentityReadAtUpdate(Mutant):
    id = "stream_identity_read_at_update"
    bug = ("the worker's local rank (FLAGS_selected_gpus) and world size (PADDLE_TRAINERS_NUM) for the transfer "
           "library read from os.environ when update() runs instead of from the environment the session was opened "
           "with: a worker whose environment changed since (an engine setting variables for another library, a "
           "reused process) creates its handle as another worker and returns another rank, on rsync and GDR alike")
    kills = frozenset({"STREAM-IDENTITY-AT-OPEN"})

    def patches(self):
        return {"reference.stream_config.worker_identity": lambda env: _worker_identity(os.environ)}


# -- the draft model ---------------------------------------------------------------------------------
class DraftRsyncMainOnly(Mutant):
    id = "draft_rsync_main_only"
    bug = "rsync stores the main model's tensors only, after the first load: the draft model stays on its first version"
    kills = frozenset({"DRAFT-PAIR-UPDATED"})

    def patches(self):
        main: set = set()

        def update(manager):
            main.clear()
            main.update(manager.model_list[0].state_dict())
            return _update_from_rsync(manager)

        def store(received, params, bootstrap):
            _store({k: v for k, v in received.items() if k in main or not params[k]._is_initialized()}, params, bootstrap)

        return {"reference.rsync.update_from_rsync": update, "reference.rsync.store": store}


class DraftStaleAccepted(Mutant):
    id = "draft_stale_accepted"
    bug = "rsync accepts a step that carries nothing for a model (FastDeploy's new-subset-of-old, rule 20): the draft stays stale"
    kills = frozenset({"DRAFT-NOT-STALE"})

    def patches(self):
        def problems(received, params, models):
            return [p for p in _problems(received, params, models) if not p.startswith("Stale model")]

        return {"reference.rsync.problems": problems}


class DraftRsyncUnnamed(Mutant):
    id = "draft_rsync_unnamed"
    bug = "rsync's error names nothing: the problems go to the log only (FastDeploy's 'Invalid new_state_dict')"
    kills = frozenset({"DRAFT-FAULT-NAMED"})

    def patches(self):
        def update(manager):
            try:
                return _update_from_rsync(manager)
            except ValueError as e:
                if rsync.INVALID in str(e):
                    raise ValueError(rsync.INVALID) from None
                raise

        return {"reference.rsync.update_from_rsync": update}
