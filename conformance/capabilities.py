"""The capability vocabulary. An adapter may only declare names listed here.

A rule that requires a capability the adapter does not declare is reported ``not_applicable``:
never passed, never silently skipped.
"""

CAPABILITIES = {
    "snapshot.parts": "ipc_snapshot priority 1: model_state.tp{rank}.{id}.part{N}.pdparams, numeric order",
    "snapshot.single": "ipc_snapshot priority 2: model_state.tp{rank}.{id}.pdparams",
    "snapshot.legacy": "ipc_snapshot priority 3: model_state.tp0{id}.pdparams",
    "snapshot.shared_fallback": "ipc_snapshot priority 4: {shared_dir}/model_state.tp{rank}.{id}.pdparams (pickle), "
    "with shared_dir taken from LoaderConfig",
    "ipc.meta": "ipc: {shared_dir}/ipc_metas_{id} of 7-field CUDA IPC metas (shared memory on CPU)",
    "ipc.buckets": "ipc_bucket: flat uint8 buckets announced by msgpack manifests over ZMQ",
    "trace": "session.trace() returns the sources applied in order, with their labels",
    "status": "session.status() returns the ModelWeightsStatus name",
    "mtp": "several models (main + MTP) captured and loaded by one session",
    "digest.model": "session.digest() returns the model digest of the parameters as landed (SPEC DIGEST): "
    '{"model": {"xxh3": HEX, "md5": HEX}, "tensors": {name: {"xxh3": HEX, "md5": HEX}}}',
    "digest.debug": "session.debug_digest(tensor) returns FastDeploy's debug digest line of a Paddle tensor or numpy "
    "array: shape=[..], dtype=.., nbytes=.., md5=.., sum=..",
    "model.post_load": "the steps a model declares in its post_load attribute run once after every update: "
    "transposes (2-D, 3-D per expert), fused and dequantised buffers, frozen models left alone (SPEC.md MODEL)",
    "model.hooks": "session.register_hook(name, fn): fn() runs once after each committed update, never after "
    "a failed one (stale-state hooks: reset the prefix cache, recapture graphs; SPEC.md MODEL-HOOKS)",
    "model.recapture": "options['recapture'] = fn: an update that gives any parameter other memory (a buffer swap, a "
    "new parameter object, the allocation after a clear) calls fn(names), the moved parameters' names, after the last "
    "one moved and before the status is NORMAL (the engine recaptures its CUDA graphs; SPEC.md MODEL-STORAGE-KEPT)",
    "stream.rsync": "rsync (update_weights_by_rdma): a CheckpointTransfer handle streams a step's (name, tensor) pairs, "
    "validated whole, then applied; version from options['version'] or {model_dir}/version.yaml",
    "stream.gdr": "GDR in rsync mode (update_weights_by_gdr, GPU_DIRECT): a CheckpointTransfer stream into each model's "
    "load_weights, MTP items routed to the MTP models in chunks",
    "stream.gdr_ipc": "GDR in IPC mode (Phase1Backend.IPC): step '0' unless options['version'] is given",
    "stream.prefetch": "GDR items received ahead of the loader on a receiving thread, bounded by gdr_prefetch_queue_size",
    "status.cell": "options['status_cell'] names the shared int32 status cell: tensor-parallel rank 0 writes CLEARED "
    "and NORMAL there (never for the first load); session.worker_iteration(run_model, block=, sync=) is one pass "
    "of the worker's event loop against it",
    "loop.runner": "session.worker_iteration(..., runner=R): the loop calls R.clear_requests() where it stops the runner's "
    "in-flight requests, and R.shutdown_process_group(name) / R.restart_process_group(name) for each communication "
    "group it shuts down or restarts; options['kv_cache_cell'] names the KV cache's status cell, which it sets "
    "CLEARING before a clear and UPDATING before an update",
    "control": "adapter.control(cell_name) returns the API side: clear_load_weight(timeout_s) and "
    "update_model_weight(timeout_s), each returning (code, message)",
    "staged": "options['staged'] = True: nothing is adopted before the whole update is complete and agreed",
    "version": "session.version() reports the version of the last committed update (from the bucket manifests, "
    "or version.yaml's step beside the snapshot or the meta file)",
    "serve": "session.serve(fn) runs fn() as one forward pass of a request, the way the engine runs one: a pass "
    "in flight when a clear or an update begins returns before any byte changes (drained); one arriving from then "
    "until the update commits waits and runs on the new version (held) (SPEC.md SERVE-NO-MIXED-VERSIONS)",
    "control.pause": "session.pause(), session.resume(), session.is_paused() and session.generate(step, steps): the "
    "engine's pause of request generation (FastDeploy /v1/pause, /v1/resume, /v1/is_paused; SPEC.md § CTL); "
    "generate runs step(i) for i < steps as one request's forward steps and returns ('finished' | 'aborted', steps run)",
    "control.sleep": "session.sleep(tags) / session.wakeup(tags) with the tag 'weight' (tags: a sequence of tag names): "
    "the weights of every captured model released, then reloaded from the configured source, verified and recaptured "
    "(FastDeploy /v1/sleep, /v1/wakeup; SPEC.md § CTL)",
    "control.kv_cache": "the tag 'kv_cache' of sleep / wakeup: the engine's KV cache, released and rebuilt through "
    "options['engine'] (engine.release_kv_cache(), engine.rebuild_kv_cache()); with options['cuda_graph'] True the "
    "weights' graphs are recaptured only with the KV cache there",
    "control.update_in_place": "session.update_weights(version=, verify_checksum=) -> dict: the loaded weights "
    "refreshed in place from the configured stream, the result's 'version' the version loaded (FastDeploy "
    "/v1/update_weights; SPEC.md § CTL)",
    "control.routed": "session.routed_control(): clear_load_weight(timeout_s) and update_model_weight(timeout_s), each "
    "returning (code, message), routed through sleep and wakeup (FastDeploy's FD_ENABLE_V1_UPDATE_WEIGHTS=1)",
    "multirank": "sessions run one per rank under paddle.distributed (gloo on CPU): ranks agree through the "
    "default process group before CLEARED or NORMAL, each collective bounded by options['agree_timeout_s']",
}


def validate(names) -> frozenset[str]:
    """The declared capabilities as a frozenset: a collection of names (a set, frozenset, list or tuple).
    A str is refused (``frozenset("snapshot.single")`` is a set of letters), as is anything not iterable."""
    if isinstance(names, (str, bytes)):
        raise ValueError(f"capabilities must be a collection of names, such as frozenset({{{names!r}}}); "
                         f"got the {type(names).__name__} {names!r}, which would be read letter by letter")
    try:
        names = list(names)
    except TypeError:
        raise ValueError(f"capabilities must be a collection of names, got {type(names).__name__} {names!r}") from None
    strange = [n for n in names if not isinstance(n, str)]
    if strange:
        raise ValueError(f"capabilities must be names (str), got {strange!r}")
    unknown = sorted(set(names) - set(CAPABILITIES))
    if unknown:
        raise ValueError(f"unknown capabilities {unknown}; the vocabulary is {sorted(CAPABILITIES)}")
    return frozenset(names)
