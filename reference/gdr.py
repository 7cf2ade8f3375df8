"""The GDR strategies (FastDeploy #7951, fd-spec §3.6 and §4): ``gdr`` (GPU-direct, the rsync mode: the
version from the argument or version.yaml) and ``gdr_ipc`` (IPC mode: step "0" unless a version is given).

An update streams ``(name, tensor)`` items from the worker's cached CheckpointTransfer handle through a
receiving thread (``reference.prefetch``, window ``gdr_prefetch_queue_size``, default 2, 0 or less: 1)
into the models' own ``load_weights`` (``reference.mtp_routing``, MTP chunks of ``gdr_mtp_chunk_size``).
Parameters change as items arrive, as in FastDeploy: a stream that breaks leaves the items before the
break loaded, and the update fails. It fails too when the stream ends without every parameter (an early
end is not a complete update), and any failure destroys the handle. After a load the tracked parameters
are captured again: a model's loader may have replaced parameter objects.
"""
from __future__ import annotations

import logging
import time
from dataclasses import fields

from . import mtp_routing, prefetch, stream_config, transfer_lib, transforms

log = logging.getLogger("reference.gdr")

DEFAULT_WINDOW = 2


def update_from_gdr(manager) -> dict:
    return _update(manager, ipc=False)


def update_from_gdr_ipc(manager) -> dict:
    return _update(manager, ipc=True)


def window_size(value) -> int:
    try:
        return max(1, int(DEFAULT_WINDOW if value is None else value))
    except (TypeError, ValueError):
        raise ValueError(f"rsync_config['gdr_prefetch_queue_size'] must be an integer, got {value!r}") from None


def _step(manager, ipc: bool) -> str:
    version = manager.options.get("version")
    if ipc:
        return "0" if version in (None, "") else str(version)
    return stream_config.resolve_version(version, manager.model_dir)[0]


def _loaders(models) -> None:
    lacking = [i for i, m in enumerate(models) if not callable(getattr(m, "load_weights", None))]
    if lacking:
        raise TypeError(f"GDR loads through each model's load_weights(weights_iterator); model(s) {lacking} (0 is the main model) have none")


def live_models(models) -> list:
    """The models an update loads: the main one and every MTP model not declared frozen (a frozen draft,
    MODEL-TRANSFORM-FROZEN, is served as loaded at start-up: it is handed nothing, and a stream need not
    carry its names)."""
    return list(models[:1]) + [m for m in models[1:] if not transforms.is_frozen(m)]


def _incomplete(manager, delivery, step: str, tracked) -> None:
    """Every tracked parameter received, by any of its names: a tied pair (one parameter object under two
    names, MODEL-TIED) is complete when the stream carries either name. ``tracked``: name -> parameter,
    as captured before the load (a loader may replace the objects)."""
    missing = _missing(delivery, tracked)
    if missing:
        raise RuntimeError(f"GDR stream of step {step} ended after {delivery.update_count} item(s) without "
                           f"{len(missing)} parameter(s) {missing}: the update is incomplete, "
                           f"{manager.landed_of_sent(len(tracked) - len(missing), len(tracked))}")


def _missing(delivery, tracked) -> list[str]:
    got = {id(tracked[name]) for name in delivery.names if name in tracked}
    return [name for name, param in tracked.items() if id(param) not in got]


def _update(manager, *, ipc: bool) -> dict:
    cfg = stream_config.settings(manager.options)
    step = _step(manager, ipc)
    _loaders(manager.model_list)
    chunk = mtp_routing.chunk_size(cfg.get("gdr_mtp_chunk_size"))
    window = window_size(cfg.get("gdr_prefetch_queue_size"))
    lib, lib_config = transfer_lib.library()
    who = stream_config.worker_identity(manager.env)
    kwargs = stream_config.gdr_transfer_kwargs(
        cfg, who, ipc=ipc, fields={f.name for f in fields(lib_config.TransferConfig)}, role=lib_config.Role.INFERENCE,
        backends=(lib_config.Phase1Backend.GPU_DIRECT, lib_config.Phase1Backend.IPC))
    timeout = stream_config.recv_timeout(kwargs)
    started = time.perf_counter()
    handle = transfer_lib.ensure(manager, lambda: lib.CheckpointTransfer(lib_config.TransferConfig(**kwargs)))
    where = f"GDR stream of step {step} (rank {who.local_rank})"
    receiver = prefetch.Prefetcher(lambda: handle.receive_weights(step_id=step), window=window,
                                   wait_s=prefetch.wait_bound(timeout), where=where)
    models = live_models(manager.model_list)
    mtp_names = [n for m in models[1:] for n in m.state_dict()]
    tracked = dict(manager.params)

    def handed(items):  # a loader writes each item it is handed into its parameters
        for item in items:
            manager.changed_since_commit = True
            yield item

    with transfer_lib.receiving(manager, receiver):
        try:
            delivery = mtp_routing.load_models(models, handed(receiver), chunk, mtp_names)
        except mtp_routing.NoMtpWeights as e:
            landed = len(tracked) - len(_missing(e.delivery, tracked))
            raise mtp_routing.NoMtpWeights(f"{e}; {manager.landed_of_sent(landed, len(tracked))}", e.delivery) from None
        _incomplete(manager, delivery, step, tracked)
    manager.params = manager._capture()  # a loader may have replaced parameter objects
    total = time.perf_counter() - started
    log.info("GDR step %s: %d item(s), %d to the MTP models, in %.3fs", step, delivery.update_count, delivery.mtp_cache_count, total)
    return {"update_cost": total, "total_cost": total, "version": step, "rank": who.local_rank,
            "update_count": delivery.update_count, "mtp_cache_count": delivery.mtp_cache_count}
