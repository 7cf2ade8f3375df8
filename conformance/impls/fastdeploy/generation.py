"""What a given ``DynamicWeightManager`` is: its calling convention and the paths it can be driven on.

FastDeploy's class changed shape across generations (fd-spec §0, §1.4, §3.1): DWM-0 takes
``(fd_config, model)`` and finalizes inside ``update_parameters``; DWM-EP takes ``(fd_config, models)``
and leaves ``finalize_update`` to the runner; from the rsync era on it takes ``(fd_config, models,
local_rank)``; before #6852 ``ipc_snapshot`` reads only ``model_state.tp0{id}.pdparams`` (a ``paddle.save``
pickle, later safetensors), after it parts, the single file, the legacy file and the shared fallback.
Nothing here is keyed to a version: every fact is read from the class.

* Calling convention, from the signatures: constructor parameters are passed by name (``fd_config``,
  ``model`` or ``models``, ``local_rank``); a class with ``finalize_update`` is finished by the runner after
  ``update_parameters(pid)``, one without it finishes inside ``update_parameters`` (DWM-0's
  ``_finalize_update``).
* ipc_snapshot levels and their formats, by a dry run (``probe_levels``): the constructor runs on a
  one-parameter lazy model in empty scratch directories (rank 1, physical GPU 7, so that every level's
  name is distinct), in the same ``worker_world`` as a session. Every path it looks up (``glob``,
  ``os.path.exists``, ``paddle.load``) is a candidate; each candidate is then created as an empty file
  and the constructor run again: if it calls ``paddle.load`` on that file, the level is readable, and
  ``safetensors=True`` or its absence gives the format (the load is stopped there). A last run makes
  ``paddle.load`` raise ``FileNotFoundError`` for a missing file, which Paddle never does (it raises
  ValueError), to find fallbacks that only such an error would reach.
* A class whose own code fails before the first lookup by reading an attribute it never sets (DWM-0
  @00fe65a: ``self.model_config``, set nowhere) is FastDeploy's defect, not something the adapter could
  supply: no file or config reaches past it. The dry run cannot observe the levels then, so they are
  read from the source of ``_update_ipc_snapshot`` (``source_levels``: the legacy file it names, read
  with ``safetensors=True`` or not); every load fails the same way, and the run reports those failed
  rules with one root cause. Any other early failure remains a usage error naming it.
* ``ipc.meta`` is never claimed: every generation opens metas with ``LoDTensor._new_shared_cuda``
  (its ``_convert_ipc_meta_to_tensor`` source, read with ``inspect.getsource``), which a CPU Paddle lacks,
  and the suite's trainer stand-in exports ``/dev/shm`` segments, not CUDA allocations, in any case.
"""
from __future__ import annotations

import ast
import inspect
import logging
import os
import shutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field

from conformance.registry import ImplError

from .loop import check_function
from .world import fd_config, worker_world

PROBE_RANK, PROBE_GPU = 1, 7
PROBE_ENV = {"PADDLE_TRAINER_ID": str(PROBE_RANK), "PADDLE_TRAINERS_NUM": str(PROBE_RANK + 1),
             "CUDA_VISIBLE_DEVICES": str(PROBE_GPU), "FLAGS_selected_gpus": "0"}
LEVEL_CAPABILITY = {"parts": "snapshot.parts", "single": "snapshot.single", "legacy": "snapshot.legacy",
                    "shared": "snapshot.shared_fallback"}
# The format in which the suite writes each level (the legacy file: either, see fixtures.snapshot).
SUITE_FORMATS = {"parts": ("safetensors",), "single": ("safetensors",), "legacy": ("safetensors", "paddle.save"),
                 "shared": ("paddle.save",)}
CONSTRUCTOR_PARAMS = ("fd_config", "model", "models", "local_rank")
# What the runner's V1 sleep / wakeup of the weights calls on the manager (#6761), EP's buffers aside.
SPLIT_OPERATIONS = ("clear_model_weight", "reload_model_weights", "clear_communication_group", "restart_communication_group")


@dataclass(frozen=True)
class Generation:
    init_params: tuple[str, ...]  # constructor parameters after self, in order
    runner_finalizes: bool  # the runner calls finalize_update(pid) after update_parameters(pid)
    levels: dict  # level -> format, in the order the class looks for them
    capabilities: frozenset
    not_claimed: dict = field(default_factory=dict)  # capability -> why not
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        levels = ", ".join(f"{lvl} ({fmt})" for lvl, fmt in self.levels.items()) or "none"
        text = f"DynamicWeightManager({', '.join(self.init_params)}); ipc_snapshot levels: {levels}"
        if self.not_claimed:
            text += "; not claimed: " + "; ".join(f"{c} ({why})" for c, why in self.not_claimed.items())
        if self.notes:
            text += "; " + "; ".join(self.notes)
        return text


class _Hit(Exception):
    """The probe stops the constructor at its first load of an existing file."""

    def __init__(self, path, configs):
        super().__init__(path)
        self.path, self.configs = path, dict(configs)


def init_params(cls) -> tuple[str, ...]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    unknown = [p.name for p in params if p.name not in CONSTRUCTOR_PARAMS and p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unknown or not {"fd_config"} <= {p.name for p in params} or not {"model", "models"} & {p.name for p in params}:
        raise ImplError(f"--impl=fastdeploy: DynamicWeightManager.__init__{inspect.signature(cls.__init__)}: the adapter "
                        f"passes {', '.join(CONSTRUCTOR_PARAMS)} by name and cannot supply {unknown or 'fd_config and model(s)'}")
    return tuple(p.name for p in params if p.name in CONSTRUCTOR_PARAMS)


def constructor_kwargs(params, config, models: list, local_rank: int) -> dict:
    """Arguments by name: a single model alone, several as a list (main first), as the runner passes them."""
    values = {"fd_config": config, "local_rank": local_rank,
              "model": models[0], "models": models[0] if len(models) == 1 else list(models)}
    return {name: values[name] for name in params}


def _tiny_model():
    import paddle

    with paddle.LazyGuard():
        return paddle.nn.Linear(2, 2, bias_attr=False)


class _Probe:
    def __init__(self, cls, params, root):
        self.cls, self.params = cls, params
        self.model_dir, self.shared_dir = os.path.join(root, "model"), os.path.join(root, "shared")

    def run(self, present=None, missing_is_fnf=False):
        """Construct once; returns (lookups, hit or None, other error or None)."""
        for d in (self.model_dir, self.shared_dir):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        if present:
            os.makedirs(os.path.dirname(present), exist_ok=True)
            open(present, "wb").close()
        lookups = []

        def hook(path, configs, real_load):
            if os.path.lexists(path):
                raise _Hit(path, configs)
            if missing_is_fnf:
                raise FileNotFoundError(path)
            return real_load(path, **configs)

        kwargs = constructor_kwargs(self.params, fd_config("ipc_snapshot", self.model_dir, {}, 0), [_tiny_model()], 0)
        # The dry run's log lines (parameters, "loading part ...") would read as a real load: muted.
        logger = getattr(sys.modules.get(self.cls.__module__), "logger", None)
        muted = isinstance(logger, logging.Logger) and not logger.disabled
        if muted:
            logger.disabled = True
        try:
            with worker_world(PROBE_ENV, self.shared_dir, load_hook=hook, watch=lambda how, p: lookups.append((how, p))):
                self.cls(**kwargs)
        except _Hit as hit:
            return lookups, hit, None
        except Exception as e:  # noqa: BLE001 - every way the dry run ends is information
            return lookups, None, e
        finally:
            if muted:
                logger.disabled = False
        return lookups, None, None

    def level_of(self, path) -> str | None:
        base = f"model_state.tp{PROBE_RANK}.{PROBE_GPU}"
        return {
            os.path.join(self.model_dir, f"{base}.part0.pdparams"): "parts",
            os.path.join(self.model_dir, f"{base}.pdparams"): "single",
            os.path.join(self.model_dir, f"model_state.tp0{PROBE_GPU}.pdparams"): "legacy",
            os.path.join(self.shared_dir, f"{base}.pdparams"): "shared",
        }.get(path)

    def describe(self, path) -> str:
        for d, name in ((self.model_dir, "{model_dir}"), (self.shared_dir, "{shared_dir}")):
            if path.startswith(d + os.sep):
                rest = path[len(d):].replace(f"tp{PROBE_RANK}.{PROBE_GPU}", "tp{rank}.{id}")
                return name + rest.replace(f"tp0{PROBE_GPU}", "tp0{id}")
        return path


def _candidates(lookups, root) -> list[str]:
    """Paths looked up under the probe's scratch directory (the only place it creates files)."""
    out = []
    for how, path in lookups:
        if not isinstance(path, str) or not path.startswith(root + os.sep):
            continue
        if how == "glob":
            if path.count("*") != 1:
                continue
            path = path.replace("*", "0")  # e.g. {base}.part*.pdparams -> {base}.part0.pdparams
        if path not in out:
            out.append(path)
    return out


def _own_missing_attribute(cls, error) -> bool:
    """The class read an attribute of its own instance that nothing set (FastDeploy's defect)."""
    return isinstance(error, AttributeError) and isinstance(getattr(error, "obj", None), cls)


def source_levels(cls) -> dict:
    """{"legacy": format} when the source of ``_update_ipc_snapshot`` names ``model_state.tp0{id}``; the
    format is safetensors when a ``paddle.load`` there passes ``safetensors=True``. Only for a class the
    dry run cannot observe (module docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls._update_ipc_snapshot)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return {}
    names, safetensors = [], False
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # an f-string, its fields as {}
            names.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            safetensors |= any(k.arg == "safetensors" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in node.keywords)
    if not any("model_state.tp0{}" in name for name in names):
        return {}
    return {"legacy": "safetensors" if safetensors else "paddle.save"}


def probe_levels(cls, params) -> tuple[dict, list[str]]:
    """(level -> format, notes) for the ipc_snapshot levels the class reads (module docstring)."""
    levels, notes = {}, []
    with tempfile.TemporaryDirectory(prefix="fd-conformance-probe-") as root:
        probe = _Probe(cls, params, root)
        lookups, hit, error = probe.run()
        candidates = _candidates(lookups, root)
        if not candidates and _own_missing_attribute(cls, error) and (levels := source_levels(cls)):
            notes.append(f"ipc_snapshot levels read from the source of _update_ipc_snapshot: its dry run stops in "
                         f"FastDeploy's own code before any lookup ({type(error).__name__}: {error}), so every load "
                         "fails the same way (FastDeploy's defect, reported as the rules it fails)")
            return levels, notes
        if not candidates:
            what = f"fails before it looks for any file ({type(error).__name__}: {error})" if error else "looks for no file"
            raise ImplError(f"--impl=fastdeploy: cannot drive this DynamicWeightManager: its ipc_snapshot load {what}, so "
                            f"no snapshot level can be tested; and ipc is out of reach too: {_ipc_reason(cls)}")
        for path in candidates:
            _, hit, _ = probe.run(present=path)
            if hit is None or hit.path != path:
                continue
            level = probe.level_of(path)
            fmt = "safetensors" if hit.configs.get("safetensors") else "paddle.save"
            if level is None:
                notes.append(f"also reads {probe.describe(path)} ({fmt}), not a level of the suite")
            elif level not in levels:
                levels[level] = fmt
        fnf_lookups, _, _ = probe.run(missing_is_fnf=True)
        for path in _candidates(fnf_lookups, root):
            if path not in candidates:
                notes.append(f"{probe.describe(path)} is read only after paddle.load raises FileNotFoundError for a "
                             "missing file, which Paddle never does (it raises ValueError): unreachable")
    return levels, notes


def _ipc_reason(cls) -> str:
    convert = getattr(cls, "_convert_ipc_meta_to_tensor", None)
    try:
        source = inspect.getsource(convert) if convert is not None else ""
    except (OSError, TypeError):
        source = ""
    if "_new_shared_cuda" in source:
        return ("its ipc path opens each meta with paddle-gpu's LoDTensor._new_shared_cuda (CUDA IPC), and the "
                "suite's trainer stand-in shares /dev/shm segments")
    return "its ipc path is not one the suite's CPU trainer stand-in can feed"


def derive(cls) -> Generation:
    params = init_params(cls)
    if hasattr(cls, "finalize_update"):
        runner_finalizes = True
    elif hasattr(cls, "_finalize_update"):
        runner_finalizes = False  # DWM-0: update_parameters(pid) ends with self._finalize_update(pid)
    else:
        raise ImplError("--impl=fastdeploy: DynamicWeightManager has neither finalize_update nor _finalize_update")
    levels, notes = probe_levels(cls, params)
    capabilities, not_claimed = set(), {}
    for level, capability in LEVEL_CAPABILITY.items():
        if level not in levels:
            not_claimed[capability] = "no such level"
        elif levels[level] not in SUITE_FORMATS[level]:
            not_claimed[capability] = f"read as {levels[level]}, the suite writes {' or '.join(SUITE_FORMATS[level])}"
        else:
            capabilities.add(capability)
    if not capabilities:
        raise ImplError(f"--impl=fastdeploy: this DynamicWeightManager reads no ipc_snapshot level the suite can write "
                        f"(levels found: {levels or 'none'}; {'; '.join(notes) or 'no other lookup'})")
    if "models" in params:
        capabilities.add("mtp")  # a list of models is accepted: [main, mtp...]
    else:
        not_claimed["mtp"] = "the constructor takes one model"
    if hasattr(cls, "_update_model_from_state"):
        capabilities.add("trace")
    if hasattr(cls, "_update_shared_status"):
        capabilities.add("status")
    loop_fn, why = check_function(cls)
    if loop_fn is None:
        not_claimed["status.cell"] = not_claimed["loop.runner"] = not_claimed["control"] = not_claimed["multirank"] = why
    else:
        capabilities |= {"status.cell", "loop.runner"}  # FastDeploy's own check_model_weights_status (loop.py)
        # The API side (EngineClient's clear_load_weight / update_model_weight guards, fd-spec §2.3) is the
        # engine's, outside the manager: the adapter plays it (FastDeployAdapter.control).
        capabilities.add("control")
        # One session per rank under paddle.distributed (the suite's rank workers): the loop's broadcast of
        # rank 0's value and FastDeploy's barriers run on the real group (world.py, loop.py).
        capabilities.add("multirank")
    # The runner's capture_model() (fd-spec §2.7 step 3: after update_parameters, before finalize_update), which
    # the adapter plays: options["recapture"] is called where FastDeploy's runner recaptures its CUDA graphs.
    capabilities.add("model.recapture")
    # The V1 control path (fd-spec §2.8): what the manager holds of it is #6761's split operations, which the
    # runner's sleep / wakeup of the weights call (session.py); the rest is the engine's and the runner's.
    split = [m for m in SPLIT_OPERATIONS if not hasattr(cls, m)]
    if split:
        not_claimed["control.sleep"] = f"no {', '.join(split)} (the runner's split operations came with #6761)"
    else:
        capabilities.add("control.sleep")
    not_claimed["control.pause"] = ("pause, resume and is_paused are the engine's (common_engine.py _control_pause, "
                                    "_control_resume, _control_is_paused), not the manager's")
    not_claimed["control.kv_cache"] = ("the KV cache is the runner's (gpu_model_runner.py clear_cache, "
                                       "initialize_kv_cache), and so are its sleep / wakeup tag loop and graph order")
    not_claimed["control.routed"] = ("the legacy pair's routing through sleep and wakeup (FD_ENABLE_V1_UPDATE_WEIGHTS) "
                                     "is the api server's and the engine's")
    not_claimed["ipc.meta"] = _ipc_reason(cls)
    not_claimed["ipc.buckets"] = "FastDeploy has no bucket path (fd-spec §3.7)"
    # SERVE-NO-MIXED-VERSIONS: the manager has no request gate; the engine keeps forward passes off a change by
    # running both in the worker's one loop (fd-spec §2.4-2.5), which is not the class's to be driven through.
    not_claimed["serve"] = ("the manager serves no requests: the worker's loop runs forward passes and changes in "
                            "one thread and stops its requests before a change (fd-spec §2.4-2.5), outside this class")
    return Generation(params, runner_finalizes, levels, frozenset(capabilities), not_claimed, tuple(notes))
