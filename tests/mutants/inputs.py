"""Mutants of input handling (issue 30): parsers that recurse without a bound, errors that name only the first
problem of an input, and a header step quadratic in the number of tensors. Each is a plausible bug of a loader
written from SPEC.md by someone else; ``kills`` is the set of rules it fails.
"""
from __future__ import annotations

import json
import pickle

from reference import apply, ipc_meta, safe_pickle, snapshot, snapshot_load, ties
from reference.errors import SnapshotFormatError

from .base import Mutant

_real_check_layout = snapshot_load._check_layout
_real_unloaded = apply.unloaded
_real_ties_missing = ties.missing
_real_normalize = ipc_meta.normalize_meta


# -- nesting ------------------------------------------------------------------------------------------------------
class _UnguardedJson:
    """``json`` whose decoder's RecursionError escapes as the bare error it is (a RuntimeError naming no file)."""

    JSONDecodeError = json.JSONDecodeError

    @staticmethod
    def loads(*args, **kwargs):
        try:
            return json.loads(*args, **kwargs)
        except RecursionError as e:
            raise RuntimeError(f"maximum recursion depth exceeded: {e}") from None


class HeaderRecursionUnguarded(Mutant):
    id = "header_recursion_unguarded"
    bug = ("the safetensors header is parsed with json.loads and nothing bounds its nesting: 128 levels in an entry's "
           "unknown key load, and a 2 KB header of 1000 '[' raises a bare RecursionError that names no file (issue 30)")
    kills = frozenset({"FILE-CORRUPT-HEADER"})

    def patches(self):
        return {"reference.snapshot_load.json": _UnguardedJson, "reference.snapshot_load.MAX_HEADER_DEPTH": 10**9}


class HeaderDepthAtRecursionLimit(Mutant):
    id = "header_depth_at_recursion_limit"
    bug = ("the header's nesting is bounded by Python's own recursion limit (the RecursionError caught and named), "
           "not by safetensors' 127 levels: a header safetensors refuses loads")
    kills = frozenset({"FILE-CORRUPT-HEADER"})

    def patches(self):
        return {"reference.snapshot_load.MAX_HEADER_DEPTH": 900}


class CUnpickler(pickle.Unpickler):
    """The reference's restricted unpickler before issue 30: the C unpickler, the same allow-list."""

    def __init__(self, file, path: str, allowed: frozenset):
        super().__init__(file)
        self._path = path
        self._allowed = allowed

    find_class = safe_pickle._Restricted.find_class


class PickleCUnpickler(Mutant):
    id = "pickle_c_unpickler"
    bug = ("the restricted unpickler subclasses the C pickle.Unpickler: a dict key that is a tuple nested 300 000 deep "
           "(a 300 KB file) is hashed by recursion in C and kills the process with SIGSEGV")
    kills = frozenset({"FILE-CORRUPT-HEADER", "IPC-FILE-CONTENT"})

    def patches(self):
        return {"reference.safe_pickle._Restricted": CUnpickler}


def _full_repr(value, limit: int = 80) -> str:
    return repr(value)[:limit]


class ReprInErrors(Mutant):
    id = "repr_in_errors"
    bug = ("error messages show a bad value with repr(): a value nested a thousand levels deep (a pickle entry, an ipc "
           "meta's dims, a manifest's shape) raises RecursionError from the message, naming nothing")
    kills = frozenset({"FILE-CORRUPT-HEADER", "IPC-FILE-CONTENT", "BKT-FIELDS"})

    def patches(self):
        return {"reference.snapshot_load.brief": _full_repr, "reference.ipc_meta.brief": _full_repr,
                "reference.bucket_checks.brief": _full_repr, "wire.protocol.brief": _full_repr}


def _safe_load(data, path):
    import yaml

    from reference.version_file import VersionError

    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as e:
        raise VersionError(f"{path}: not valid YAML ({e.__class__.__name__})") from None


class VersionYamlUnbounded(Mutant):
    id = "version_yaml_unbounded"
    bug = ("version.yaml is read with yaml.safe_load (FastDeploy's reader): 65 levels load, and 3000 nested '[' "
           "take seconds and end in a bare RecursionError")
    kills = frozenset({"VER-FILE-SAFE"})

    def patches(self):
        return {"reference.commit.load_version_yaml": _safe_load, "reference.stream_config.load_version_yaml": _safe_load}


# -- every problem ------------------------------------------------------------------------------------------------
def _first_only(found, what: str = "") -> None:
    if found:
        raise found[0]


class FirstMismatchOnly(Mutant):
    id = "first_mismatch_only"
    bug = ("validation stops at the first tensor that does not match (FastDeploy's _validate_parameter_match raises): "
           "a trainer whose dtypes drifted learns of one tensor per failed update")
    kills = frozenset({"APPLY-EVERY-PROBLEM"})

    def patches(self):
        return {"reference.apply.raise_all": _first_only}


class FirstMissingOnly(Mutant):
    id = "first_missing_only"
    bug = "the verification stops at the first parameter not loaded: the error names one of several missing parameters"
    kills = frozenset({"APPLY-EVERY-PROBLEM", "APPLY-MISSING-FAILS"})

    def patches(self):
        return {"reference.apply.unloaded": lambda params: _real_unloaded(params)[:1],
                "reference.ties.missing": lambda params, present: _real_ties_missing(params, present)[:1]}


def _headers_fail_fast(manager, plan) -> dict:
    """The header pass before issue 30: the first file that cannot be read, or the first tensor that does not match,
    ends it."""
    headers = {}
    for src in plan.sources:
        if src.fmt != "safetensors":
            continue
        infos = headers[src.path] = snapshot.read_header(src.path)
        if not infos:
            raise ValueError(f"No parameter found in state dict from {src.path} ({src.label}): file holds no tensors; "
                             f"{manager.landed_of_sent(0)}")
        for info in infos:
            target = manager.params.get(info.name)
            if target is not None:
                apply.check_match(info.name, info.dtype, info.shape, target, src.path)
    return headers


class FirstBadFileOnly(Mutant):
    id = "first_bad_file_only"
    bug = ("the header pass stops at the first part that cannot be read (or the first tensor that does not match): "
           "with two parts truncated, the trainer rewrites one and fails again on the other")
    kills = frozenset({"FILE-TRUNCATED", "APPLY-EVERY-PROBLEM"})

    def patches(self):
        return {"reference.snapshot.check_headers": _headers_fail_fast}


def _plan_fail_fast(path, metas, device, params):
    planned = []
    for name, meta in metas.items():
        try:
            fixed = _real_normalize(meta, name=name, device=device)
        except ipc_meta.MetaError as e:
            raise ipc_meta.MetaError(f"{path}: {e}") from None
        planned.append((name, fixed if name in params else None))
    return planned


class FirstBadMetaOnly(Mutant):
    id = "first_bad_meta_only"
    bug = "the meta file is checked meta by meta and the first malformed one ends the check: the others go unnamed"
    kills = frozenset({"APPLY-EVERY-PROBLEM"})

    def patches(self):
        return {"reference.ipc_meta.plan_metas": _plan_fail_fast}


class FirstBadEntryOnly(Mutant):
    id = "first_bad_entry_only"
    bug = "a bucket manifest's checks stop at the first entry at fault: its other bad entries go unnamed"
    kills = frozenset({"APPLY-EVERY-PROBLEM"})

    def patches(self):
        return {"reference.bucket_checks.raise_all": lambda problems, where: _first_only(problems)}


# -- scale --------------------------------------------------------------------------------------------------------
class QuadraticHeaderNames(Mutant):
    id = "quadratic_header_names"
    bug = ("the header check looks each name up in a list of the names seen before it (a duplicate check written with "
           "a list): quadratic in the tensors of a file, 10**5 of them (one part of a per-expert checkpoint) take minutes")
    kills = frozenset({"FILE-MANY-TENSORS"})

    def patches(self):
        def check_layout(path, entries, data_start, size):
            seen: list[str] = []
            for e in entries:
                if e.name in seen:
                    raise SnapshotFormatError(f"{path}: tensor {e.name!r} named twice")
                seen.append(e.name)
            _real_check_layout(path, entries, data_start, size)

        return {"reference.snapshot_load._check_layout": check_layout}

