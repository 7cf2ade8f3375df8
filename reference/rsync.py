"""The ``rsync`` strategy (FastDeploy ``update_weights_by_rdma``, fd-spec §3.5): a whole step streamed from
the trainer through the worker's cached CheckpointTransfer handle, validated whole, then applied.

Options: ``rsync_config`` (the library's keywords), ``version`` (absent: ``step`` of
``{model_dir}/version.yaml``, a bootstrap load), ``verify_checksum`` (passed to the library).

Validation before anything is applied: every received key must be a parameter, with its shape and dtype;
one ValueError lists every problem (the manager logs it at ERROR) and no parameter has changed. Keys the stream
lacks keep their values (FastDeploy allows a subset, #7675), unless a whole model (the main one or an MTP
one) receives nothing: that model would be left on the previous version, and the update is refused the
same way. Applying: on a bootstrap load a parameter that holds nothing adopts the received tensor;
otherwise the new values are copied into the parameter's own memory (its address stays: CUDA graphs
captured on it stay valid). Returns FastDeploy's cost dictionary.
"""
from __future__ import annotations

import logging
import time

import paddle

from . import apply, prefetch, stream_config, ties, transfer_lib, transforms
from .dtypes import dtype_name

log = logging.getLogger("reference.rsync")

INVALID = "Invalid new_state_dict, update parameters failed"
WINDOW = 2  # items received ahead while the previous one is stored


def problems(received, params, models) -> list[str]:
    """Every reason to refuse ``received`` (name -> tensor) for the captured ``params``."""
    out = []
    for key, new in received.items():
        old = params.get(key)
        if old is None:
            out.append(f"Invalid parameter: {key} not in old_state_dict")
            continue
        if tuple(new.shape) != tuple(old.shape):
            out.append(f"Invalid parameter: {key} shape mismatch, new shape:{list(new.shape)}, old shape:{list(old.shape)}")
        if dtype_name(new) != dtype_name(old):
            out.append(f"Invalid parameter: {key} dtype mismatch, old:{dtype_name(old)}, new:{dtype_name(new)}")
    for index, model in enumerate(models):
        # a frozen model is served as loaded at start-up: a step need not carry its names
        names = [] if transforms.is_frozen(model) else list(model.state_dict())
        if names and not any(name in received for name in names):
            out.append(f"Stale model: model {index} (0 is the main one) receives no tensor from the stream; "
                       f"its parameters {names} would keep the previous version")
    return out


def receive(manager, handle, version: str, verify: bool, wait_s: float) -> dict:
    where = f"rsync stream of version {version}"
    receiver = prefetch.Prefetcher(lambda: handle.receive_stream(step_id=version, verify_checksum=verify),
                                   window=WINDOW, wait_s=wait_s, where=where)
    received = {}
    with transfer_lib.receiving(manager, receiver):
        for key, tensor in receiver:
            received[key] = tensor
    return received


def store(received, params, bootstrap: bool) -> None:
    with paddle.no_grad():
        for key, new in received.items():
            target = params[key]
            if not target._is_initialized():  # a bootstrap load, or the first update after a clear
                # fresh from the library (materialized), contiguous: shared, or copied into a strided target
                apply.adopt(key, new, target)
            else:
                target.set_value(new)


def update_from_rsync(manager) -> dict:
    cfg = stream_config.settings(manager.options)
    version, bootstrap = stream_config.resolve_version(manager.options.get("version"), manager.model_dir)
    verify = manager.options.get("verify_checksum", False)
    if not isinstance(verify, bool):
        raise ValueError(f"options['verify_checksum'] must be a bool, got {verify!r}")
    lib, _ = transfer_lib.library()
    who = stream_config.worker_identity(manager.env)
    kwargs = stream_config.rsync_kwargs(cfg, who)
    wait_s = prefetch.wait_bound(stream_config.recv_timeout(cfg))
    started = time.perf_counter()
    handle = transfer_lib.ensure(manager, lambda: lib.CheckpointTransfer(**kwargs))
    received = receive(manager, handle, version, verify, wait_s)
    synced = time.perf_counter()
    found = problems(received, manager.params, manager.model_list)
    # A cleared parameter (a bootstrap load, an update after clear()) is owed by the step: RSYNC-SUBSET lets
    # only loaded ones keep their values.
    # (A tied pair, MODEL-TIED, is covered by either name.)
    cleared = [name for name in ties.missing(manager.params, received) if not manager.params[name]._is_initialized()]
    found += [f"Missing parameter: {name} is cleared and not in the step" for name in cleared]
    if found:  # (logged at ERROR, every problem, with the update's failure)
        short = ""
        if cleared or any(p.startswith("Stale model") for p in found):  # a step owing every parameter
            short = f"; {manager.landed_of_sent(len(set(received) & set(manager.params)))} (none was applied)"
        raise ValueError(f"{INVALID}: {len(found)} problem(s): {found}{short}")
    store(received, manager.params, bootstrap)
    done = time.perf_counter()
    log.info("rsync version %s: %d tensor(s) in %.3fs", version, len(received), done - started)
    return {"sync_cost": synced - started, "update_cost": done - synced, "total_cost": done - started,
            "version": version, "rank": who.local_rank}
