"""Mutants of the ipc_snapshot path: planning (FastDeploy #6815/#6826/#6844/#6852/#6909 history),
loading, applying, and the manager lifecycle around them.

Each patch replaces an attribute the reference looks up *at call time*: ``reference.snapshot``
imported ``plan_snapshot``/``list_dir``/``read_header``/``iter_safetensors``/``load_pickle_state_dict``
by name, so those are patched there; ``reference.apply`` and ``reference.snapshot_load`` call their
own module globals; the adapter builds ``reference.adapter.WeightManager``, so manager bugs are
subclasses patched in there. ``kills`` is the full set of rules each mutant fails (checked by
running it through the whole suite).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re

from reference import apply as _apply
from reference import manager as _manager
from reference import snapshot_load, snapshot_plan
from reference.dtypes import ITEMSIZE, dtype_name
from reference.status import Status

from .base import Mutant

_real_plan = snapshot_plan.plan_snapshot
_real_list_dir = snapshot_plan.list_dir
_real_part_index = snapshot_plan.part_index
_real_read_header = snapshot_load.read_header
_real_iter = snapshot_load.iter_safetensors
_real_load_pickle = snapshot_load.load_pickle_state_dict
_real_apply_tensors = _apply.apply_tensors
_real_check_match = _apply.check_match
_real_mismatch = _apply.mismatch
PDPARAMS = snapshot_plan.PDPARAMS


def _with_sources(plan, sources):
    return dataclasses.replace(plan, sources=tuple(sources))


# -- naming ---------------------------------------------------------------------------------------
class HardcodedTp0(Mutant):
    id = "hardcoded_tp0"
    bug = "every rank loads rank 0's shard: base name hard-coded as tp0 (before #6852/#6909)"
    kills = frozenset(
        {
            "LEVEL-NONE-FOUND",
            "LEVEL-PARTS-FIRST",
            "LEVEL-SHARED-LAST",
            "LEVEL-SINGLE-SECOND",
            "SNAP-NAME-PARTS",
            "SNAP-NAME-SINGLE",
            "SNAP-RANK-OWN-SHARD",
        }
    )

    def patches(self):
        def plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
            return _real_plan(model_dir, names, fallback_dir, fallback_names, 0, gpu_id)

        return {"reference.snapshot.plan_snapshot": plan}


class NoRankIdSeparator(Mutant):
    id = "no_rank_id_separator"
    bug = ("base name model_state.tp{rank}{id} with no separator (closed #6815/#6826): rank 1 on GPU 234 and "
           "rank 12 on GPU 34 both read tp1234, and every dotted file goes unfound")
    kills = frozenset(
        {
            "APPLY-DTYPE-BEFORE-SHAPE",
            "APPLY-DTYPE-MISMATCH",
            "APPLY-MISSING-FAILS",
            "APPLY-MTP-LOADED",
            "APPLY-ROUNDTRIP-DTYPES",
            "APPLY-SHAPE-MISMATCH",
            "APPLY-UNKNOWN-IGNORED",
            "FILE-CORRUPT-HEADER",
            "FILE-NO-TENSORS",
            "FILE-PICKLE-NO-EXEC",
            "FILE-TRUNCATED",
            "FILE-ZERO-BYTES",
            "LEVEL-NONE-FOUND",
            "LEVEL-PARTS-FIRST",
            "LEVEL-SHARED-LAST",
            "LEVEL-SINGLE-SECOND",
            "LIFE-CLEAR-RELEASES",
            "LIFE-FAILED-NOT-NORMAL",
            "LIFE-RELOAD-LATEST",
            "PART-DUPLICATE-LATER-WINS",
            "PART-INDEX-BASENAME",
            "PART-INVALID-IGNORED",
            "PART-LABEL-INDEX",
            "PART-ORDER-NUMERIC",
            "SNAP-GPU-ID",
            "SNAP-NAME-PARTS",
            "SNAP-NAME-SINGLE",
            "SNAP-RANK-OWN-SHARD",
        }
    )

    def patches(self):
        return {"reference.snapshot_plan.base_names": lambda rank, gpu_id: (f"model_state.tp{rank}{gpu_id}", f"model_state.tp0{gpu_id}")}


class LegacyKeyedOnRank(Mutant):
    id = "legacy_keyed_on_rank"
    bug = ("the legacy name 'generalised' from tp0{id} to tp{rank}{id} (the #6826 edit applied to the "
           "priority-3 name): a rank-2 worker on GPU 3 looks for tp23 and skips the real tp03 file")
    kills = frozenset({"LEVEL-LEGACY-THIRD"})

    def patches(self):
        real = snapshot_plan.base_names
        return {"reference.snapshot_plan.base_names": lambda rank, gpu_id: (real(rank, gpu_id)[0], f"model_state.tp{rank}{gpu_id}")}


# -- parts --------------------------------------------------------------------------------------
class LexicographicParts(Mutant):
    id = "lexicographic_parts"
    bug = "parts sorted by file name (closed #6844): part10 loads before part2 and part9 wins over part10"
    kills = frozenset({"PART-INDEX-BASENAME", "PART-LABEL-INDEX", "PART-ORDER-NUMERIC"})

    def patches(self):
        def plan(*args):
            p = _real_plan(*args)
            if p.sources and p.sources[0].level == 1:
                return _with_sources(p, sorted(p.sources, key=lambda s: s.path))
            return p

        return {"reference.snapshot.plan_snapshot": plan}


class EnumerateLabel(Mutant):
    id = "enumerate_label"
    bug = "parts labelled by their position (enumerate) instead of the parsed index (#6909 review): {0,2,10} -> part0,1,2"
    kills = frozenset({"PART-INDEX-BASENAME", "PART-LABEL-INDEX", "PART-ORDER-NUMERIC"})

    def patches(self):
        def plan(*args):
            p = _real_plan(*args)
            if p.sources and p.sources[0].level == 1:
                return _with_sources(p, (dataclasses.replace(s, label=f"snapshot-part{i}") for i, s in enumerate(p.sources)))
            return p

        return {"reference.snapshot.plan_snapshot": plan}


class WholePathIndex(Mutant):
    id = "whole_path_index"
    bug = ("part index found by re.search(r'\\.part(\\d+)\\.') on the full path (FastDeploy, fd-spec rule 6): "
           "under .../ckpt.part7.run/ every part is index 7 and the order falls back to directory order")
    kills = frozenset({"PART-INDEX-BASENAME"})

    def patches(self):
        def plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
            p = _real_plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id)
            if not p.sources or p.sources[0].level != 1:
                return p
            listing = list(names)  # glob order: the directory's own order
            by_name = {os.path.basename(s.path): s for s in p.sources}
            found = []
            for name in listing:
                if name in by_name:
                    path = by_name[name].path
                    index = int(re.search(r"\.part(\d+)\.", path).group(1))
                    found.append((index, path))
            found.sort(key=lambda item: item[0])  # stable: equal indices keep directory order
            return _with_sources(
                p, (snapshot_plan.Source(path, f"snapshot-part{i}", "safetensors", 1) for i, path in found)
            )

        return {"reference.snapshot.plan_snapshot": plan}


class LenientPartIndex(Mutant):
    id = "lenient_part_index"
    bug = ("part index taken by re.search(r'part(\\d+)') with no anchor on the extension: 'part1x' parses "
           "as part 1 and is loaded (fd-spec rule 8 / #6909 review asks for digits only)")
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        def part_index(basename, base_name):
            if not (basename.startswith(f"{base_name}.part") and basename.endswith(PDPARAMS)):
                return None
            m = re.search(r"part(\d+)", basename[len(base_name):])
            return int(m.group(1)) if m else None

        return {"reference.snapshot_plan.part_index": part_index}


class _QuietLogger:
    """A logger whose warnings go to debug: the invalid parts are dropped without a word."""

    def __init__(self, inner):
        self._inner = inner

    def warning(self, msg, *args, **kwargs):
        self._inner.debug(msg, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class InvalidPartsSilent(Mutant):
    id = "invalid_parts_silent"
    bug = "part files with invalid names skipped silently (debug log only): nobody sees why a trainer's file was ignored (#6909 review)"
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        return {"reference.snapshot.log": _QuietLogger(logging.getLogger("reference.snapshot"))}


class FirstLoadedWins(Mutant):
    id = "first_loaded_wins"
    bug = ("tensors whose parameter is already initialized in this update are skipped ('restore only cleared "
           "parameters', cf. #7951 restore_cleared_params): a tensor repeated across parts keeps the first part's value")
    kills = frozenset({"PART-DUPLICATE-LATER-WINS", "PART-INDEX-BASENAME", "PART-ORDER-NUMERIC"})

    def patches(self):
        def apply_tensors(targets, tensors, source):
            applied = seen = 0
            unknown = []
            for name, tensor in tensors:
                seen += 1
                target = targets.get(name)
                if target is None:
                    unknown.append(name)
                elif not target._is_initialized():
                    _apply.check_match(name, dtype_name(tensor), tensor.shape, target, source)
                    _apply.adopt(name, tensor, target)
                    applied += 1
            return applied, seen, unknown

        return {"reference.apply.apply_tensors": apply_tensors}


# -- levels -------------------------------------------------------------------------------------
class FallbackFirst(Mutant):
    id = "fallback_first"
    bug = "the /shared_ipc_meta pickle is tried before the model directory (inverts #6852's priority 4): stale shared weights win"
    kills = frozenset({"LEVEL-LEGACY-THIRD", "LEVEL-PARTS-FIRST", "LEVEL-SINGLE-SECOND"})

    def patches(self):
        def plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
            base, _ = snapshot_plan.base_names(rank, gpu_id)
            if base + PDPARAMS in set(fallback_names):
                return _real_plan(model_dir, [], fallback_dir, fallback_names, rank, gpu_id)
            return _real_plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id)

        return {"reference.snapshot.plan_snapshot": plan}


class LegacyBeforeSingle(Mutant):
    id = "legacy_before_single"
    bug = "levels 2 and 3 swapped: the legacy tp0{id} file is preferred to model_state.tp{rank}.{id}.pdparams (fd-spec §3.1, rule 11)"
    kills = frozenset({"LEVEL-SINGLE-SECOND"})

    def patches(self):
        def plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
            p = _real_plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id)
            _, legacy = snapshot_plan.base_names(rank, gpu_id)
            if p.sources and p.sources[0].level == 2 and legacy + PDPARAMS in set(names):
                path = os.path.join(model_dir, legacy + PDPARAMS)
                return _with_sources(p, [snapshot_plan.Source(path, "snapshot", "safetensors", 3)])
            return p

        return {"reference.snapshot.plan_snapshot": plan}


class FallbackLegacyName(Mutant):
    id = "fallback_legacy_name"
    bug = ("the shared fallback still read as /shared_ipc_meta/model_state.tp0{id}.pdparams (DWM-0, before #6852): "
           "a trainer writing tp{rank}.{id} there is never found, and the error names the wrong path")
    kills = frozenset(
        {
            "APPLY-MTP-LOADED",
            "APPLY-ROUNDTRIP-DTYPES",
            "APPLY-UNKNOWN-IGNORED",
            "FILE-NO-TENSORS",
            "FILE-PICKLE-NO-EXEC",
            "FILE-TRUNCATED",
            "FILE-ZERO-BYTES",
            "LEVEL-NONE-FOUND",
            "LEVEL-SHARED-LAST",
            "LIFE-RELOAD-LATEST",
            "SNAP-RANK-OWN-SHARD",
        }
    )

    def patches(self):
        def plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
            base, legacy = snapshot_plan.base_names(rank, gpu_id)
            try:
                return _real_plan(model_dir, names, fallback_dir, [], rank, gpu_id)  # levels 1-3 unchanged
            except FileNotFoundError:
                path = os.path.join(fallback_dir, legacy + PDPARAMS)
                if legacy + PDPARAMS in set(fallback_names):
                    return snapshot_plan.SnapshotPlan(base, (snapshot_plan.Source(path, "snapshot", "pickle", 4),), (), ())
                raise FileNotFoundError(f"No snapshot found for {base}: checked {model_dir} (new/legacy) and {path}") from None

        return {"reference.snapshot.plan_snapshot": plan}


# -- files --------------------------------------------------------------------------------------
class EmptyFilesUnlisted(Mutant):
    id = "empty_files_unlisted"
    bug = ("0-byte files left out of the directory listing ('still being written'): a 0-byte part is silently "
           "skipped and a 0-byte single file falls through to the next level instead of failing by name")
    kills = frozenset({"FILE-ZERO-BYTES"})

    def patches(self):
        def list_dir(path):
            return [n for n in _real_list_dir(path) if os.path.getsize(os.path.join(path, n)) > 0]

        return {"reference.snapshot.list_dir": list_dir}


class EmptyFileUnnamed(Mutant):
    id = "empty_file_unnamed"
    bug = "a file with no tensors raises FastDeploy's ValueError('No parameter found in state dict {}'), which names no file (fd-spec rule 9)"
    kills = frozenset({"FILE-NO-TENSORS"})

    def patches(self):
        def read_header(path):
            infos = _real_read_header(path)
            if not infos:
                raise ValueError("No parameter found in state dict {}")
            return infos

        def load_pickle_state_dict(path):
            sd = list(_real_load_pickle(path))
            if not sd:
                raise ValueError(f"No parameter found in state dict {sd}")
            return sd

        return {"reference.snapshot.read_header": read_header, "reference.snapshot.load_pickle_state_dict": load_pickle_state_dict}


class PaddleLoadFallback(Mutant):
    id = "paddle_load_fallback"
    bug = ("the shared fallback read with paddle.load(path) (FastDeploy priority 4): an unrestricted unpickler "
           "that runs any global the file names, and a 0-byte file is a bare EOFError")
    kills = frozenset({"FILE-PICKLE-NO-EXEC", "FILE-ZERO-BYTES"})

    def patches(self):
        def load_pickle_state_dict(path):
            import paddle

            sd = paddle.load(path)
            sd.pop(snapshot_load.PADDLE_NAME_TABLE, None)
            return sd.items()

        return {"reference.snapshot.load_pickle_state_dict": load_pickle_state_dict}


class ScalarAsVector(Mutant):
    id = "scalar_as_vector"
    bug = ("0-d tensors come back as shape [1] (np.ascontiguousarray / Paddle < 2.5 semantics), so a scalar "
           "parameter fails its own shape check")
    kills = frozenset({"APPLY-ROUNDTRIP-DTYPES"})

    def patches(self):
        def iter_safetensors(path, expect=None, wanted=None):
            for name, t in _real_iter(path, expect, wanted):
                yield name, (t.reshape([1]) if t is not None and t.ndim == 0 else t)

        return {"reference.snapshot.iter_safetensors": iter_safetensors}


# -- apply --------------------------------------------------------------------------------------
def _dtype_check(name, src_dtype, dst, where):
    if src_dtype != dtype_name(dst):
        raise TypeError(f"Type mismatch for {name}: {src_dtype} vs {dtype_name(dst)}{where}")


def _shape_check(name, src_shape, dst, where):
    if tuple(src_shape) != tuple(dst.shape):
        raise ValueError(f"Shape mismatch for {name}: {list(src_shape)} vs {list(dst.shape)}{where}")


class ShapeCheckSkipped(Mutant):
    id = "shape_check_skipped"
    bug = "only the dtype is validated: a wrong-shaped tensor is adopted and the parameter silently changes shape (fd-spec §3.2, rule 15)"
    kills = frozenset({"APPLY-SHAPE-MISMATCH"})

    def patches(self):
        def mismatch(name, src_dtype, src_shape, dst, source=""):  # (every path's validation asks apply.mismatch)
            return _real_mismatch(name, src_dtype, list(dst.shape), dst, source)  # the shape never compared

        return {"reference.apply.mismatch": mismatch}


class DtypeAfterShape(Mutant):
    id = "dtype_after_shape"
    bug = "shape validated before dtype: a tensor wrong in both raises ValueError, not the TypeError of _validate_parameter_match (fd-spec §3.2)"
    kills = frozenset({"APPLY-DTYPE-BEFORE-SHAPE"})

    def patches(self):
        def mismatch(name, src_dtype, src_shape, dst, source=""):
            if tuple(src_shape) != tuple(dst.shape):  # the shape first: a tensor wrong in both is a ValueError
                return ValueError(f"Shape mismatch for {name}: {list(src_shape)} vs {list(dst.shape)}"
                                  + (f" (from {source})" if source else ""))
            return _real_mismatch(name, src_dtype, src_shape, dst, source)

        return {"reference.apply.mismatch": mismatch}


class DtypeByItemsize(Mutant):
    id = "dtype_by_itemsize"
    bug = ("dtypes compared by element size, as byte-bucket loaders do: bf16 goes into an fp16 parameter (and "
           "e4m3 into e5m2) as raw bits, silently reinterpreted")
    kills = frozenset({"APPLY-DTYPE-BEFORE-SHAPE", "APPLY-DTYPE-MISMATCH"})

    def patches(self):
        def check_match(name, src_dtype, src_shape, dst, source=""):
            where = f" (from {source})" if source else ""
            if ITEMSIZE[src_dtype] != ITEMSIZE[dtype_name(dst)]:
                raise TypeError(f"Type mismatch for {name}: {src_dtype} vs {dtype_name(dst)}{where}")
            _shape_check(name, src_shape, dst, where)

        def apply_tensors(targets, tensors, source):
            # Same-size dtypes are reinterpreted on adoption, as a byte copy would.
            def cast():
                for name, t in tensors:
                    target = targets.get(name)
                    if target is not None and t.dtype != target.dtype and ITEMSIZE[dtype_name(t)] == ITEMSIZE[dtype_name(target)]:
                        t = t.view(target.dtype)
                    yield name, t

            return _real_apply_tensors(targets, cast(), source)

        return {"reference.apply.check_match": check_match, "reference.apply.apply_tensors": apply_tensors}


class UnknownNamesRaise(Mutant):
    id = "unknown_names_raise"
    bug = "names the model lacks are rejected, as the rsync path's validation does (fd-spec rule 20), instead of ignored (rule 16)"
    kills = frozenset({"APPLY-UNKNOWN-IGNORED"})

    def patches(self):
        def apply_tensors(targets, tensors, source):
            applied, seen, unknown = _real_apply_tensors(targets, tensors, source)
            if unknown:
                raise ValueError(f"Invalid new_state_dict from {source}: unknown parameters {unknown}")
            return applied, seen, unknown

        return {"reference.apply.apply_tensors": apply_tensors}


# -- manager lifecycle ---------------------------------------------------------------------------
def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


class FinalizeUnverified(Mutant):
    id = "finalize_unverified"
    bug = "finalize_update without _verify_parameters('update'): a snapshot missing parameters reads as a complete update (fd-spec §2.7)"
    kills = frozenset({"APPLY-MISSING-FAILS", "LIFE-FAILED-NOT-NORMAL"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                self.status = Status.NORMAL

        return _manager_patch(Manager)


class MissingNamesOnlyLogged(Mutant):
    id = "missing_names_only_logged"
    bug = ("FastDeploy's verification: each missing parameter only logged, the RuntimeError says just "
           "'Model Parameter update verification failed' (fd-spec §2.7)")
    kills = frozenset({"APPLY-MISSING-FAILS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                missing = _apply.unloaded(self.params)
                for name in missing:
                    _manager.log.error("Verification failed after update: Param %s initialized=False (expected True)", name)
                if missing:
                    raise RuntimeError("Model Parameter update verification failed")
                self.status = Status.NORMAL

        return _manager_patch(Manager)


class NormalOnFailure(Mutant):
    id = "normal_on_failure"
    bug = "status written NORMAL in a finally block: a failed update is reported as success (the guide; fd-spec rule 17)"
    kills = frozenset({"APPLY-MISSING-FAILS", "LIFE-FAILED-NOT-NORMAL"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                try:
                    super().update()
                finally:
                    self.status = Status.NORMAL

        return _manager_patch(Manager)


class MtpNotCaptured(Mutant):
    id = "mtp_not_captured"
    bug = "only the main model's state_dict is captured: the MTP draft model is never loaded (fd-spec §1.3, 'a draft model left on old weights')"
    kills = frozenset({"APPLY-MTP-LOADED", "LIFE-CLEAR-RELEASES", "LIFE-FAILED-NOT-NORMAL", "LIFE-RELOAD-LATEST"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def _capture(self):
                return dict(self.model_list[0].state_dict())

        return _manager_patch(Manager)


class ClearSkipsMtp(Mutant):
    id = "clear_skips_mtp"
    bug = "clear() frees and verifies only the main model: the MTP draft keeps its weights after a clear (fd-spec §2.6 iterates model_list)"
    kills = frozenset({"LIFE-CLEAR-RELEASES"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def clear(self):
                self.status = Status.CLEARING
                main = self.model_list[0].state_dict()
                for param in main.values():
                    param._clear_data()
                if _apply.still_loaded(main):
                    raise RuntimeError("Model Parameter clearance verification failed")
                self.status = Status.CLEARED

        return _manager_patch(Manager)


class MemoisedFiles(Mutant):
    id = "memoised_files"
    bug = "snapshot files read through a cache keyed by path (lru_cache-style): a file rewritten in place is never re-read, so reload applies the old version"
    kills = frozenset({"APPLY-MISSING-FAILS", "LIFE-FAILED-NOT-NORMAL", "LIFE-RELOAD-LATEST"})

    def patches(self):
        cache: dict = {}

        def iter_safetensors(path, expect=None, wanted=None):
            if path not in cache:
                cache[path] = list(_real_iter(path, expect, wanted))
            return iter(cache[path])

        def load_pickle_state_dict(path):
            if path not in cache:
                cache[path] = list(_real_load_pickle(path))
            return cache[path]

        return {"reference.snapshot.iter_safetensors": iter_safetensors, "reference.snapshot.load_pickle_state_dict": load_pickle_state_dict}


# -- candidates that are not regular files (LEVEL-CANDIDATE-NOT-FILE) ----------------------------
class SkipNonFiles(Mutant):
    id = "skip_non_files"
    bug = ("the directory listing keeps only regular files (os.scandir + is_file(), the reference before this "
           "rule): a directory, dangling symlink, FIFO or device at the single-file name is skipped and the "
           "stale legacy file is loaded, reported as success")
    kills = frozenset({"LEVEL-CANDIDATE-NOT-FILE"})

    def patches(self):
        def list_dir(path):
            return [n for n, kind in _real_list_dir(path).items() if kind == snapshot_plan.FILE]

        return {"reference.snapshot.list_dir": list_dir}


class DanglingLinkUnlisted(Mutant):
    id = "dangling_link_unlisted"
    bug = ("candidates probed with os.path.exists(), which is False for a dangling symlink: a trainer's link "
           "to a file not written yet falls through to the lower level")
    kills = frozenset({"LEVEL-CANDIDATE-NOT-FILE"})

    def patches(self):
        def list_dir(path):
            return {n: k for n, k in _real_list_dir(path).items() if k != snapshot_plan.DANGLING}

        return {"reference.snapshot.list_dir": list_dir}


class PartsFilteredByIsFile(Mutant):
    id = "parts_filtered_by_isfile"
    bug = ("part candidates filtered with [p for p in glob(...) if os.path.isfile(p)] while the single and "
           "legacy names are opened directly: a directory or FIFO among the parts is dropped silently and the "
           "update succeeds without it (or falls through to the single file)")
    kills = frozenset({"LEVEL-CANDIDATE-NOT-FILE"})

    def patches(self):
        def list_dir(path):
            return {
                n: k for n, k in _real_list_dir(path).items()
                if k == snapshot_plan.FILE or ".part" not in n
            }

        return {"reference.snapshot.list_dir": list_dir}


class CandidateKindUnchecked(Mutant):
    id = "candidate_kind_unchecked"
    bug = ("candidates taken from a listing of names only and opened to find out what they are: a FIFO at the "
           "single-file name blocks the update until some writer appears (here: the suite's watchdog)")
    kills = frozenset({"LEVEL-CANDIDATE-NOT-FILE"})

    def patches(self):
        return {"reference.snapshot.list_dir": lambda path: list(_real_list_dir(path))}


# -- level order against one loser at a time ------------------------------------------------------
def _level_options(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
    """The plan each level would give on its own, highest priority first."""
    names, fallback_names = list(names), list(fallback_names)
    base, legacy = snapshot_plan.base_names(rank, gpu_id)
    listings = (
        ([n for n in names if snapshot_plan.is_part_glob_hit(n, base)], []),
        ([n for n in names if n == base + PDPARAMS], []),
        ([n for n in names if n == legacy + PDPARAMS], []),
        ([], fallback_names),
    )
    options = []
    for listing, fallback in listings:
        try:
            options.append(_real_plan(model_dir, listing, fallback_dir, fallback, rank, gpu_id))
        except FileNotFoundError:
            pass
    return options


class NewestLevelWins(Mutant):
    id = "newest_level_wins"
    bug = ("the most recently written snapshot is taken, whatever its level ('the trainer's latest output'): a "
           "stale single file or fallback touched after the parts were written wins over them")
    kills = frozenset({"LEVEL-PARTS-FIRST", "LEVEL-SINGLE-SECOND", "LEVEL-LEGACY-THIRD"})

    def patches(self):
        def plan(*args):
            options = _level_options(*args)
            if not options:
                return _real_plan(*args)
            return max(options, key=lambda p: max(os.path.getmtime(s.path) for s in p.sources))

        return {"reference.snapshot.plan_snapshot": plan}


class AllLevelsApplied(Mutant):
    id = "all_levels_applied"
    bug = ("every level present is applied, lowest priority first, so the highest one 'wins' by being applied "
           "last: the values look right, but stale files are read and a bad tensor in any of them fails the update")
    kills = frozenset({"LEVEL-PARTS-FIRST", "LEVEL-SINGLE-SECOND", "LEVEL-LEGACY-THIRD"})

    def patches(self):
        def plan(*args):
            options = _level_options(*args)
            if len(options) < 2:
                return _real_plan(*args)
            sources = [s for p in reversed(options) for s in p.sources]
            return _with_sources(options[0], sources)

        return {"reference.snapshot.plan_snapshot": plan}


class SingleBeforeParts(Mutant):
    id = "single_before_parts"
    bug = ("the single file is checked before the part glob (levels 1 and 2 swapped): a trainer that switched "
           "to parts leaves its old single file behind, and the worker keeps loading it")
    kills = frozenset({"LEVEL-PARTS-FIRST"})

    def patches(self):
        def plan(*args):
            options = _level_options(*args)
            if len(options) >= 2 and options[0].sources[0].level == 1 and options[1].sources[0].level == 2:
                return options[1]
            return _real_plan(*args)

        return {"reference.snapshot.plan_snapshot": plan}


class SharedBeforeLegacy(Mutant):
    id = "shared_before_legacy"
    bug = ("levels 3 and 4 swapped: the shared /shared_ipc_meta pickle is preferred to the legacy tp0{id} file "
           "in the model directory")
    kills = frozenset({"LEVEL-LEGACY-THIRD"})

    def patches(self):
        def plan(*args):
            options = _level_options(*args)
            if len(options) >= 2 and options[0].sources[0].level == 3 and options[1].sources[0].level == 4:
                return options[1]
            return _real_plan(*args)

        return {"reference.snapshot.plan_snapshot": plan}


# -- naming: the part glob ------------------------------------------------------------------------
class PartGlobUnanchored(Mutant):
    id = "part_glob_unanchored"
    bug = ("parts found with startswith(base) and '.part' in the name (glob 'model_state.tp1.2*.part*.pdparams'): "
           "worker tp1.2 also takes tp1.23.part5 and tp1.20.part5")
    kills = frozenset({"SNAP-NAME-PARTS"})

    def patches(self):
        def is_part_glob_hit(basename, base_name):
            return basename.startswith(base_name) and ".part" in basename and basename.endswith(PDPARAMS)

        def part_index(basename, base_name):
            if not is_part_glob_hit(basename, base_name):
                return None
            m = re.search(r"\.part(\d+)\.pdparams$", basename)
            return int(m.group(1)) if m else None

        return {"reference.snapshot_plan.is_part_glob_hit": is_part_glob_hit,
                "reference.snapshot_plan.part_index": part_index}


class PartSuffixUnanchored(Mutant):
    id = "part_suffix_unanchored"
    bug = ("parts matched by the prefix '{base}.part' and re.match(r'(\\d+)') on the rest, without anchoring "
           "the '.pdparams' end: a trainer's temporary model_state.tp12.3.part7.pdparams.tmp loads as part 7")
    kills = frozenset({"SNAP-NAME-PARTS"})

    def patches(self):
        def is_part_glob_hit(basename, base_name):
            return basename.startswith(f"{base_name}.part") and PDPARAMS in basename

        def part_index(basename, base_name):
            if not is_part_glob_hit(basename, base_name):
                return None
            m = re.match(r"(\d+)\.pdparams", basename[len(base_name) + len(".part"):])
            return int(m.group(1)) if m else None

        return {"reference.snapshot_plan.is_part_glob_hit": is_part_glob_hit,
                "reference.snapshot_plan.part_index": part_index}


# -- part index grammar ---------------------------------------------------------------------------
def _digits(basename, base_name):
    prefix = f"{base_name}.part"
    if not (basename.startswith(prefix) and basename.endswith(PDPARAMS)):
        return None
    return basename[len(prefix):-len(PDPARAMS)]


class IntParsePartIndex(Mutant):
    id = "int_parse_part_index"
    bug = ("part index parsed with try: int(text) except ValueError: invalid — int() also accepts '-1', '+1', "
           "' 1', '1_0' and non-ASCII digits such as '١', so those files are loaded as parts")
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        def part_index(basename, base_name):
            text = _digits(basename, base_name)
            try:
                return int(text) if text is not None else None
            except ValueError:
                return None

        return {"reference.snapshot_plan.part_index": part_index}


class FdRegexPartIndex(Mutant):
    id = "fd_regex_part_index"
    bug = ("part index found with FastDeploy's re.search(r'\\.part(\\d+)\\.', name) on the basename: "
           "'part1.5.pdparams' parses as part 1 and is loaded (fd-spec rule 8 asks for digits only)")
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        def part_index(basename, base_name):
            if _digits(basename, base_name) is None:
                return None
            m = re.search(r"\.part(\d+)\.", basename[len(base_name):])
            return int(m.group(1)) if m else None

        return {"reference.snapshot_plan.part_index": part_index}


class BreakOnInvalidPart(Mutant):
    id = "break_on_invalid_part"
    bug = ("the sorted glob is walked with 'break' instead of 'continue' at the first invalid name: every "
           "valid part whose name sorts after it is silently dropped")
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        def plan(model_dir, names, fallback_dir, fallback_names, rank, gpu_id):
            base, _ = snapshot_plan.base_names(rank, gpu_id)
            names = list(names)
            kept, stop = [], False
            for name in sorted(names):
                if snapshot_plan.is_part_glob_hit(name, base):
                    stop = stop or snapshot_plan.part_index(name, base) is None
                    if stop and snapshot_plan.part_index(name, base) is not None:
                        continue
                kept.append(name)
            return _real_plan(model_dir, kept, fallback_dir, fallback_names, rank, gpu_id)

        return {"reference.snapshot.plan_snapshot": plan}


class _PerFileLogger(_QuietLogger):
    """One warning per invalid part file instead of one naming them all."""

    def warning(self, msg, *args, **kwargs):
        if len(args) == 2 and isinstance(args[1], str) and ", " in args[1]:
            for name in args[1].split(", "):
                self._inner.warning(msg, args[0], name, **kwargs)
            return
        self._inner.warning(msg, *args, **kwargs)


class WarningPerInvalidFile(Mutant):
    id = "warning_per_invalid_file"
    bug = "one WARNING per invalid part file (a loop around log.warning): the rule asks for one record naming them all"
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        return {"reference.snapshot.log": _PerFileLogger(logging.getLogger("reference.snapshot"))}


class InvalidPartsBlockFallthrough(Mutant):
    id = "invalid_parts_block_fallthrough"
    bug = ("level 1 chosen as soon as the part glob matches anything (if glob(...): use parts): with only invalid "
           "part names the update fails instead of falling through to the single file")
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        def plan(*args):
            p = _real_plan(*args)
            if p.invalid_parts and (not p.sources or p.sources[0].level != 1):
                raise FileNotFoundError(f"No valid snapshot part found for {p.base_name}: {', '.join(p.invalid_parts)}")
            return p

        return {"reference.snapshot.plan_snapshot": plan}


class LeadingZeroInvalid(Mutant):
    id = "leading_zero_invalid"
    bug = ("part indices with a leading zero rejected as invalid (a canonical-form check str(int(t)) == t): a "
           "trainer writing zero-padded part010 loses that part, and part9 wins")
    kills = frozenset({"PART-ORDER-NUMERIC", "PART-LABEL-INDEX"})

    def patches(self):
        def part_index(basename, base_name):
            index = _real_part_index(basename, base_name)
            text = _digits(basename, base_name)
            return None if index is None or str(index) != text else index

        return {"reference.snapshot_plan.part_index": part_index}


class NumpyInt64PartSort(Mutant):
    id = "numpy_int64_part_sort"
    bug = ("part indices sorted with np.argsort(np.array(indices, dtype=np.int64)): an index past 2**63 "
           "(part100000000000000000000) raises OverflowError instead of loading last")
    kills = frozenset({"PART-ORDER-NUMERIC"})

    def patches(self):
        import numpy as np

        def plan(*args):
            p = _real_plan(*args)
            if p.sources and p.sources[0].level == 1:
                indices = np.array([int(s.label.removeprefix("snapshot-part")) for s in p.sources], dtype=np.int64)
                return _with_sources(p, [p.sources[i] for i in np.argsort(indices, kind="stable")])
            return p

        return {"reference.snapshot.plan_snapshot": plan}


class InvalidPartsWarnedOnlyWithParts(Mutant):
    id = "invalid_parts_warned_only_with_parts"
    bug = ("the invalid-name warning is logged inside the 'if parts:' branch: when no valid part remains and "
           "loading falls through to the single, legacy or shared file, the ignored files go unreported")
    kills = frozenset({"PART-INVALID-IGNORED"})

    def patches(self):
        def plan(*args):
            p = _real_plan(*args)
            if p.sources and p.sources[0].level != 1:
                return dataclasses.replace(p, invalid_parts=())
            return p

        return {"reference.snapshot.plan_snapshot": plan}
