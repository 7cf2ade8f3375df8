"""Planning for ``ipc_snapshot``: which files to load and in which order.

Pure functions of directory listings, so ordering and priority rules are testable without files.

Priority (the first level that yields a source wins):
1. part files ``model_state.tp{rank}.{id}.part{N}.pdparams`` in ``model_dir``, numeric N order;
2. the single file ``model_state.tp{rank}.{id}.pdparams`` in ``model_dir``;
3. the legacy file ``model_state.tp0{id}.pdparams`` in ``model_dir`` (pre-#6852, keyed on GPU only);
4. ``{fallback_dir}/model_state.tp{rank}.{id}.pdparams`` in Paddle's pickle format.
Levels 1-3 are safetensors.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

PDPARAMS = ".pdparams"


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
        sources = tuple(
            Source(os.path.join(model_dir, name), f"snapshot-part{index}", "safetensors", 1)
            for index, name in parts
        )
        return SnapshotPlan(base, sources, tuple(invalid), checked)
    if base + PDPARAMS in names:
        return SnapshotPlan(base, (Source(single, "snapshot", "safetensors", 2),), tuple(invalid), checked)
    if legacy + PDPARAMS in names:
        return SnapshotPlan(base, (Source(legacy_path, "snapshot", "safetensors", 3),), tuple(invalid), checked)
    if base + PDPARAMS in set(fallback_dir_names):
        return SnapshotPlan(base, (Source(fallback, "snapshot", "pickle", 4),), tuple(invalid), checked)
    raise FileNotFoundError(f"No snapshot found for {base}: checked {', '.join(checked[:-1])} and {checked[-1]}")


def list_dir(path: str) -> list[str]:
    """Names in a directory; a missing directory lists as empty (it is simply not a source)."""
    try:
        return [e.name for e in os.scandir(path) if e.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []
