"""The ``ipc_snapshot`` strategy: plan, validate every file's header, then load file by file."""
from __future__ import annotations

import logging

from . import apply
from .snapshot_load import iter_safetensors, load_pickle_state_dict, read_header
from .snapshot_plan import list_dir, plan_snapshot

log = logging.getLogger("reference.snapshot")


def update_from_snapshot(manager) -> None:
    model_dir = manager.model_dir
    if not model_dir:
        raise ValueError("ipc_snapshot needs model_dir (the directory holding model_state.tp{rank}.{id}* files)")
    plan = plan_snapshot(
        model_dir, list_dir(model_dir), manager.shared_dir, list_dir(manager.shared_dir), manager.rank, manager.gpu_id
    )
    if plan.invalid_parts:
        log.warning(
            "Found snapshot part files with invalid naming pattern under %s: %s. "
            "These files will be ignored when loading IPC snapshot parts.",
            model_dir,
            ", ".join(plan.invalid_parts),
        )
    # Validate every safetensors header before any parameter changes: a bad part 7 must not leave
    # parts 0-6 applied. (The pickle fallback has no header; it is validated as it is applied.)
    headers = check_headers(manager, plan)

    count = len(plan.sources)
    for position, src in enumerate(plan.sources, 1):
        log.info("Loading snapshot %s (%d/%d) from %s", src.label, position, count, src.path)
        if src.fmt == "safetensors":  # read only if it is still the file whose header was checked (parsed once)
            tensors = iter_safetensors(src.path, expect=headers[src.path], wanted=manager.params)
        else:
            tensors = load_pickle_state_dict(src.path)
        manager.apply(tensors, src.label, src.path)
        # Only one file's tensors may be alive at once (FastDeploy #6852, host-memory peak). They were
        # read into memory the parameters now own, and what was not adopted (a name the model lacks, a
        # tensor a later part replaces) is freed by reference counting when the last reference goes:
        # here, not at a full garbage collection (FastDeploy's gc.collect() per part, ~60 ms each).
        del tensors
    log.info("IPC snapshot update completed from %d file(s) for %s", count, plan.base_name)


def check_headers(manager, plan) -> dict:
    """path -> ``read_header`` of every safetensors source of ``plan``, each tensor checked against its parameter.
    Every file is read before anything is refused, so that the error names every file at fault (a truncated
    part 2 and part 5 both: FILE-TRUNCATED), then every tensor of them that does not match (APPLY-EVERY-PROBLEM)."""
    headers, unreadable, mismatched = {}, [], []
    for src in plan.sources:
        if src.fmt != "safetensors":
            continue
        try:
            infos = headers[src.path] = read_header(src.path)
        except (ValueError, OSError) as e:  # the file's own error (FILE-*): corrupt, truncated, unreadable
            unreadable.append(e)
            continue
        if not infos:
            unreadable.append(ValueError(f"No parameter found in state dict from {src.path} ({src.label}): file holds "
                                         f"no tensors; {manager.landed_of_sent(0)}"))
            continue
        for info in infos:
            target = manager.params.get(info.name)
            if target is not None:
                problem = apply.mismatch(info.name, info.dtype, info.shape, target, src.path)
                if problem is not None:
                    mismatched.append(problem)
    if len(unreadable) > 1:  # the first file's error type; every file named
        raise type(unreadable[0])(f"{len(unreadable)} snapshot files cannot be loaded: "
                                  + "; ".join(str(e) for e in unreadable)) from None
    if unreadable:
        raise unreadable[0]
    apply.raise_all(mismatched)
    return headers
