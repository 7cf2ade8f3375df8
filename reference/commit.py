"""What every path shares at the end of an update: staging, the version it carries, the commit options.

Staged mode (``options["staged"]``): each source is validated as usual but its tensors are kept, not
adopted; the commit adopts all of them at once, after the update is complete on this rank and every
rank agreed. A failure at any point before that leaves every parameter exactly as it was. The tensors
a staged update keeps are the ones the parameters would hold anyway, so staging adds no copy: the
host-memory peak of a snapshot update stays one model (the parameters were cleared first).

Versions: the version an update carries is announced by its path (``ipc_bucket``: the manifests;
``ipc_snapshot`` and ``ipc``: ``version.yaml`` with key ``step`` beside what the trainer publishes, as
FastDeploy's rsync bootstrap reads ``<model_dir>/version.yaml``, fd-spec §1.2, §3.5). It is checked when
announced (never older than the version reported now) and stamped only at the commit.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import paddle

from . import apply, storage
from .errors import brief
from .version_file import VersionError, load_version_yaml, read_version_bytes

VERSION_FILE = "version.yaml"


class Stage:
    """The tensors of a staged update, by parameter name; a later source replaces an earlier one's
    tensor of the same name, as adopting it would (PART-DUPLICATE-LATER-WINS)."""

    def __init__(self):
        self.tensors: dict[str, paddle.Tensor] = {}

    def _land(self, name: str, tensor: paddle.Tensor, target) -> None:
        self.tensors[name] = tensor

    def apply(self, targets, tensors: Iterable, source: str) -> tuple[int, int, list[str]]:
        """``apply.apply_tensors`` with landing in place of adopting."""
        return apply.apply_tensors(targets, tensors, source, land=self._land)

    def holds(self, name: str) -> bool:
        return name in self.tensors

    def commit(self, targets: Mapping[str, paddle.Tensor]) -> None:
        """Adopt every staged tensor (each was checked when it landed). The stage is spent afterwards."""
        with paddle.no_grad():
            for name, tensor in self.tensors.items():
                apply.adopt(name, tensor, targets[name])


def read_version_file(directory: str | None) -> int | None:
    """``step`` of ``{directory}/version.yaml`` as an int, None when there is no such file."""
    if not directory:
        return None
    path = os.path.join(directory, VERSION_FILE)
    text = read_version_bytes(path)  # YAML detects its own encoding
    if text is None:
        return None
    data = load_version_yaml(text, path)
    step = data.get("step") if isinstance(data, dict) else None
    if isinstance(step, str) and step.strip().isascii() and step.strip().isdigit():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise VersionError(f"{path}: field step is {brief(step)}, expected a non-negative integer version")
    return step


def check_forward(new: int | None, reported: int | None, where: str) -> None:
    """An update never moves the reported version backwards; the same version may be loaded again."""
    if new is not None and reported is not None and new < reported:
        raise VersionError(f"{where}: version {new} is older than the version {reported} this worker reports; "
                           "nothing was loaded")


@dataclass(frozen=True)
class CommitOptions:
    staged: bool = False
    status_cell: str | None = None
    agree_timeout_s: float = 60.0
    tp_size: int | None = None  # ranks per tensor-parallel group; None: the whole world
    kv_cache_cell: str | None = None  # the KV cache's status cell, which the worker loop sets CLEARING / UPDATING
    recapture: Callable | None = None  # the engine's graph recapture, called before NORMAL when storage moved

    @classmethod
    def parse(cls, options: Mapping) -> "CommitOptions":
        staged = options.get("staged", False)
        if not isinstance(staged, bool):
            raise ValueError(f"options['staged'] must be a bool, got {staged!r}")
        cell = options.get("status_cell")
        if cell is not None and not isinstance(cell, str):
            raise ValueError(f"options['status_cell'] must be a shared-memory name, got {cell!r}")
        timeout = options.get("agree_timeout_s", cls.agree_timeout_s)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"options['agree_timeout_s'] must be a positive number of seconds, got {timeout!r}")
        tp_size = options.get("tp_size")
        if tp_size is not None and (not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1):
            raise ValueError(f"options['tp_size'] must be a positive int, got {tp_size!r}")
        kv = options.get("kv_cache_cell")
        if kv is not None and not isinstance(kv, str):
            raise ValueError(f"options['kv_cache_cell'] must be a shared-memory name, got {kv!r}")
        return cls(staged, cell, float(timeout), tp_size, kv, storage.check_option(options.get("recapture")))

    def tp_rank(self, rank: int, world_size: int) -> int:
        return rank % (self.tp_size or world_size)
