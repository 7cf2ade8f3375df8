"""Planning for ``ipc_snapshot``: which files to load and in which order.

Pure functions of directory listings, so ordering and priority rules are testable without files.

Priority (the first level that yields a source wins):
1. part files ``model_state.tp{rank}.{id}.part{N}.pdparams`` in ``model_dir``, numeric N order;
2. the single file ``model_state.tp{rank}.{id}.pdparams`` in ``model_dir``;
3. the legacy file ``model_state.tp0{id}.pdparams`` in ``model_dir`` (pre-#6852, keyed on GPU only);
4. ``{fallback_dir}/model_state.tp{rank}.{id}.pdparams`` in Paddle's pickle format.
Levels 1-3 are safetensors.

A listing is either an iterable of names (every entry taken for a regular file) or a mapping
name -> kind as ``list_dir`` returns it. A candidate that exists at a level but is not a regular
file (``kind != FILE``: a directory, a dangling symlink, a FIFO, a device) is an error naming it:
falling through to a lower level would report success on stale weights.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import SnapshotNotAFileError

PDPARAMS = ".pdparams"
FILE = "regular file"  # the one entry kind a snapshot may be read from (symlinks are followed)


@dataclass(frozen=True)
class Source:
    path: str
    label: str  # "snapshot-part{N}" or "snapshot": the trace label FastDeploy uses
    fmt: str  # "safetensors" or "pickle"
    level: int  # 1..4, the priority level that produced it


@dataclass(frozen=True)
class SnapshotPlan:
    base_name: str
    sources: tuple[Source, ...]
    invalid_parts: tuple[str, ...]  # basenames that matched the part glob but not the part grammar
    checked: tuple[str, ...]  # every path/pattern looked at, in priority order


def base_names(rank: int, gpu_id: int) -> tuple[str, str]:
    """(current, legacy) base names. The dot separates rank from id: tp1.234 is not tp12.34."""
    return f"model_state.tp{rank}.{gpu_id}", f"model_state.tp0{gpu_id}"


def part_index(basename: str, base_name: str) -> int | None:
    """N for ``{base_name}.part{N}.pdparams``; None for any other name.

    Parsed from the basename alone, so a directory called ``x.part7.y`` cannot supply an index,
    and strictly (digits only between ``.part`` and ``.pdparams``).
    """
    prefix = f"{base_name}.part"
    if not (basename.startswith(prefix) and basename.endswith(PDPARAMS)):
        return None
    digits = basename[len(prefix) : -len(PDPARAMS)]
    return int(digits) if digits.isascii() and digits.isdigit() else None


def is_part_glob_hit(basename: str, base_name: str) -> bool:
    """True for names that ``glob('{base_name}.part*.pdparams')`` would return."""
    prefix = f"{base_name}.part"
    return (
        basename.startswith(prefix)
        and basename.endswith(PDPARAMS)
        and len(basename) >= len(prefix) + len(PDPARAMS)
    )


def plan_snapshot(
    model_dir: str,
    model_dir_names: Iterable[str],
    fallback_dir: str,
    fallback_dir_names: Iterable[str],
    rank: int,
    gpu_id: int,
) -> SnapshotPlan:
    """Choose the snapshot sources for (rank, gpu_id) from two directory listings.

    Raises FileNotFoundError naming the base name and every path checked when no level matches.
    """
    base, legacy = base_names(rank, gpu_id)
    kinds = dict(model_dir_names) if isinstance(model_dir_names, Mapping) else {}
    fallback_kinds = dict(fallback_dir_names) if isinstance(fallback_dir_names, Mapping) else {}
    names = set(model_dir_names)
    part_pattern = os.path.join(model_dir, f"{base}.part*{PDPARAMS}")
    single = os.path.join(model_dir, base + PDPARAMS)
    legacy_path = os.path.join(model_dir, legacy + PDPARAMS)
    fallback = os.path.join(fallback_dir, base + PDPARAMS)
    checked = (part_pattern, single, legacy_path, fallback)

    parts, invalid = [], []
    for name in sorted(n for n in names if is_part_glob_hit(n, base)):
        index = part_index(name, base)
        (invalid.append(name) if index is None else parts.append((index, name)))
    if parts:
        # Numeric order; equal indices (part1, part01) fall back to name order, never to glob order.
        parts.sort()
        for index, name in parts:
            _require_file(os.path.join(model_dir, name), kinds.get(name, FILE), f"part {index}")
        sources = tuple(
            Source(os.path.join(model_dir, name), f"snapshot-part{index}", "safetensors", 1)
            for index, name in parts
        )
        return SnapshotPlan(base, sources, tuple(invalid), checked)
    if base + PDPARAMS in names:
        _require_file(single, kinds.get(base + PDPARAMS, FILE), "single-file")
        return SnapshotPlan(base, (Source(single, "snapshot", "safetensors", 2),), tuple(invalid), checked)
    if legacy + PDPARAMS in names:
        _require_file(legacy_path, kinds.get(legacy + PDPARAMS, FILE), "legacy")
        return SnapshotPlan(base, (Source(legacy_path, "snapshot", "safetensors", 3),), tuple(invalid), checked)
    if base + PDPARAMS in set(fallback_dir_names):
        _require_file(fallback, fallback_kinds.get(base + PDPARAMS, FILE), "shared fallback")
        return SnapshotPlan(base, (Source(fallback, "snapshot", "pickle", 4),), tuple(invalid), checked)
    raise FileNotFoundError(f"No snapshot found for {base}: checked {', '.join(checked[:-1])} and {checked[-1]}")


_NOT_A_FILE = (
    "{path}: the {what} snapshot candidate is a {kind}, not a regular file; refusing to fall through to a "
    "lower-priority snapshot level (its weights may be stale)"
)
# What an entry is when it is not a regular file, by stat.S_IFMT; a symlink is followed first.
_KINDS = {
    stat.S_IFDIR: "directory",
    stat.S_IFIFO: "FIFO",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFSOCK: "socket",
}
DANGLING = "dangling symlink"


def _require_file(path: str, kind: str, what: str) -> None:
    if kind != FILE:
        raise SnapshotNotAFileError(_NOT_A_FILE.format(path=path, what=what, kind=kind))


def entry_kind(path: str) -> str:
    """What ``path`` is, following symlinks, without opening it (opening a FIFO blocks)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # listed by scandir, so a symlink to nothing (or removed since)
        return DANGLING
    except OSError as e:  # a symlink loop, a name too long...
        return f"unreadable entry ({e.strerror})"
    return FILE if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "special file")


def list_dir(path: str) -> dict[str, str]:
    """Every entry of a directory, name -> kind (``FILE`` for regular files and symlinks to them);
    a missing directory lists as empty (it is simply not a source)."""
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {e.name: entry_kind(e.path) for e in entries}
