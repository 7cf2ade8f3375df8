"""Planning for the streamed paths (rsync, GDR): which version to ask for, which worker this is, and how
FastDeploy's ``rsync_config`` becomes the transfer library's configuration. Pure functions of their
arguments and of ``version.yaml``; nothing here talks to the library.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .version_file import VersionError, is_scalar, load_version_yaml, read_version_bytes

log = logging.getLogger("reference.stream_config")

VERSION_FILE = "version.yaml"
# FastDeploy's message, word for word ("{model_version}" is literal text there too), then what was found.
VERSION_NOT_SET = ("rsync model version not set, please set it in 1) {model_version}/version.yaml or 2) "
                   "interface arguments 'version'")


class VersionNotSetError(ValueError):
    """No version argument and no usable ``step`` in ``{model_dir}/version.yaml``."""


def read_version_file(model_dir: str | None) -> tuple[str | None, str]:
    """(``str(step)`` of ``{model_dir}/version.yaml``, "") or (None, why not). Each failure is logged."""
    import yaml

    path = os.path.join(model_dir or "", VERSION_FILE)
    try:
        data = read_version_bytes(path)
        if data is None:
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '{path}'")
        content = load_version_yaml(data.decode("utf-8"), path) or {}
    except (OSError, VersionError, yaml.YAMLError, UnicodeDecodeError) as e:
        why = f"Failed to read model step from '{path}': {e}"
    else:
        if not isinstance(content, dict):
            why = f"Failed to read model step from '{path}': yaml content is not a mapping"
        elif content.get("step") is None:
            why = f"Failed to read model step from '{path}': missing 'step' field"
        elif not is_scalar(content["step"]):  # (str() of an aliased one could run without end)
            why = (f"Failed to read model step from '{path}': 'step' is a {type(content['step']).__name__}, "
                   "expected a number or a string")
        else:
            return str(content["step"]), ""
    log.error("%s", why)
    return None, why


def resolve_version(version, model_dir: str | None) -> tuple[str, bool]:
    """(the version to request, bootstrap): the argument when given, else ``step`` from version.yaml; a
    bootstrap load is one without an argument (FastDeploy's ``_resolve_weight_update_version``)."""
    bootstrap = version in (None, "")
    why = ""
    if bootstrap:
        version, why = read_version_file(model_dir)
    if version in (None, ""):
        detail = why or f"version.yaml of {model_dir} gives an empty step"
        raise VersionNotSetError(f"{VERSION_NOT_SET} ({detail})")
    return str(version), bootstrap


def settings(options: Mapping) -> dict:
    """``options['rsync_config']`` (FastDeploy's ``--rsync_config``), a dict; a shallow copy."""
    value = options.get("rsync_config")
    if not isinstance(value, Mapping):
        raise ValueError(f"the streamed paths need options['rsync_config'], a dict of the transfer library's "
                         f"settings (FastDeploy's --rsync_config); got {value!r}")
    return dict(value)


@dataclass(frozen=True)
class WorkerIdentity:
    local_rank: int  # the worker's device ordinal, FLAGS_selected_gpus (FastDeploy's runner passes it)
    nranks: int  # world size (paddle.distributed.get_world_size())


def worker_identity(env: Mapping[str, str]) -> WorkerIdentity:
    """From the environment the session was opened with (FLAGS_selected_gpus was checked then)."""
    return WorkerIdentity(int(env.get("FLAGS_selected_gpus", "0")), int(env.get("PADDLE_TRAINERS_NUM", "1")))


RECV_TIMEOUT_S = 60.0  # TransferConfig.recv_bucket_timeout_s's default


def recv_timeout(cfg: Mapping) -> float:
    """The library's bound on each wait for an item (``recv_bucket_timeout_s``)."""
    value = cfg.get("recv_bucket_timeout_s", RECV_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rsync_config['recv_bucket_timeout_s'] must be a positive number of seconds, got {value!r}")
    return float(value)


def _int_setting(cfg: Mapping, key: str, default) -> int:
    value = cfg.get(key, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"rsync_config[{key!r}] must be an integer, got {value!r}") from None


def rsync_kwargs(cfg: Mapping, who: WorkerIdentity) -> dict:
    """``CheckpointTransfer(**rsync_config, local_rank=, group_size=)``'s keywords (fd-spec §3.5 step 2)."""
    return {**cfg, "local_rank": who.local_rank, "group_size": who.nranks}


def gdr_transfer_kwargs(cfg: Mapping, who: WorkerIdentity, *, ipc: bool, fields, role, backends) -> dict:
    """``TransferConfig`` keywords for GDR (fd-spec §3.6a ``_build_ct_transfer_config``): from a copy of
    ``rsync_config`` (the caller's dict is never changed), ``device_name`` becomes ``device`` unless
    ``device`` is given, role inference; rsync mode: ``global_rank = index * nranks + local_rank`` and the
    GPU-direct backend; IPC mode: ``global_rank = FLAGS_selected_gpus``, the IPC backend, ``qsize`` 2 by
    default; ``group_size`` defaults to the world size; keys that are not ``fields`` are dropped.
    ``backends`` = (gpu_direct, ipc)."""
    out = dict(cfg)
    device_name = out.pop("device_name", None)
    if device_name is not None and "device" not in out:
        out["device"] = device_name
    out["role"] = role
    out["group_size"] = _int_setting(out, "group_size", who.nranks)
    index = _int_setting(out, "index", 0)
    if ipc:
        out["global_rank"] = who.local_rank  # int(FLAGS_selected_gpus): ranks are per node in IPC mode
        out["phase1_backend"] = backends[1]
        out["qsize"] = _int_setting(out, "qsize", 2)
    else:
        out["global_rank"] = index * who.nranks + who.local_rank
        out["phase1_backend"] = backends[0]
    return {k: v for k, v in out.items() if k in fields}  # index, backend, gdr_*... are not the library's
