"""Mutants of snapshot *file* handling (SPEC.md § FILE): header validation, errors, descriptors and
mappings, files that change while they are read, and the restricted unpickler.

Each one is a plausible bug of a loader written from SPEC.md by someone else; ``kills`` is the set of
FILE rules it fails (checked with ``python -m tests.zoo_runner``).
"""
from __future__ import annotations

import os
import pickle
import pickletools

from reference import safe_pickle, snapshot_load
from reference.errors import SnapshotFormatError

from .base import Mutant

_real_check_layout = snapshot_load._check_layout
_real_parse_header = snapshot_load._parse_header
_real_open_fd = snapshot_load._open_fd
_real_iter = snapshot_load.iter_safetensors
_real_read_header = snapshot_load.read_header


def _mmap_iter(keep_mapping: bool):
    """The reference's loading before this section's fix: safetensors' mmap, views cloned (or adopted)."""

    def iter_safetensors(path, expect=None, wanted=None):
        import paddle
        import safetensors

        from reference.dtypes import SAFETENSORS_TO_NAME, paddle_dtype

        f = safetensors.safe_open(path, framework="paddle")
        if keep_mapping:
            _leaked.append(f)  # views into the mapping keep it alive anyway
        with f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = list(sl.get_shape())
                if 0 in shape:
                    yield name, paddle.empty(shape, dtype=paddle_dtype(SAFETENSORS_TO_NAME[sl.get_dtype()]))
                    continue
                t = f.get_tensor(name)
                yield name, (t if keep_mapping else t.clone())

    return iter_safetensors


_leaked: list = []


class ReadsThroughMmap(Mutant):
    id = "reads_through_mmap"
    bug = ("tensors copied out of an mmap of the snapshot (safetensors.safe_open + clone, the reference before "
           "FILE-CHANGED-DURING-LOAD): a trainer truncating the file mid-copy kills the process with SIGBUS, a "
           "rewrite mid-copy yields a mix of old and new values reported as success")
    kills = frozenset({"FILE-CHANGED-DURING-LOAD"})

    def patches(self):
        return {"reference.snapshot.iter_safetensors": _mmap_iter(keep_mapping=False)}


class AdoptsMmapViews(Mutant):
    id = "adopts_mmap_views"
    bug = ("parameters adopt safetensors' zero-copy views of the file (no clone): the mapping outlives the update, "
           "a rewrite changes served weights, a truncation is a SIGBUS")
    kills = frozenset({"FILE-DETACHED", "FILE-RELEASED", "FILE-CHANGED-DURING-LOAD", "FILE-CHANGED-BETWEEN-PARTS"})

    def patches(self):
        return {"reference.snapshot.iter_safetensors": _mmap_iter(keep_mapping=True)}


class UnreadableAsCorrupt(Mutant):
    id = "unreadable_as_corrupt"
    bug = ("every failure to read a file wrapped as 'not a valid safetensors file' (one except clause around "
           "open+parse): a mode-000 file is reported as corrupt, and the operator rewrites a good snapshot")
    kills = frozenset({"FILE-UNREADABLE"})

    def patches(self):
        def _open_fd(path):
            try:
                return os.open(path, os.O_RDONLY)
            except OSError as e:
                raise SnapshotFormatError(f"{path}: not a valid safetensors file ({e})") from None

        def load_restricted(path, *, allow_arrays=True):
            try:
                open(path, "rb").close()
            except OSError as e:
                raise SnapshotFormatError(f"{path}: not a readable pickle ({e})") from None
            return _real_load_restricted(path, allow_arrays=allow_arrays)

        return {"reference.snapshot_load._open_fd": _open_fd, "reference.snapshot_load.load_restricted": load_restricted}


_real_load_restricted = safe_pickle.load_restricted


class FirstHeaderOnly(Mutant):
    id = "first_header_only"
    bug = ("only the first file's header is checked for layout (offsets tiling the data, no trailing bytes); later "
           "parts are read at whatever offsets they name")
    kills = frozenset({"FILE-CORRUPT-HEADER"})

    def patches(self):
        def check_layout(path, entries, data_start, size):
            base = os.path.basename(path)
            if ".part" in base and ".part0." not in base:
                end = max((e.end for e in entries), default=0)
                if data_start + end > size:
                    raise SnapshotFormatError(f"{path}: expects {data_start + end} bytes, file has {size}")
                return
            _real_check_layout(path, entries, data_start, size)

        return {"reference.snapshot_load._check_layout": check_layout}


class AcceptsTrailingBytes(Mutant):
    id = "accepts_trailing_bytes"
    bug = ("a file longer than its header describes is accepted (only 'too short' is checked), so a file with a "
           "stale tail, or two files concatenated, loads as the first")
    kills = frozenset({"FILE-CORRUPT-HEADER"})

    def patches(self):
        def check_layout(path, entries, data_start, size):
            end = data_start + (entries[-1].end if entries else 0)
            _real_check_layout(path, entries, data_start, max(end, 0) if end < size else size)

        return {"reference.snapshot_load._check_layout": check_layout}


class OffsetsInRangeOnly(Mutant):
    id = "offsets_in_range_only"
    bug = ("each tensor's data_offsets are checked to lie inside the data, not to tile it: overlapping or gapped "
           "tensors load with bytes shifted into their neighbours")
    kills = frozenset({"FILE-CORRUPT-HEADER"})

    def patches(self):
        def check_layout(path, entries, data_start, size):
            for e in entries:
                if data_start + e.end > size:
                    raise SnapshotFormatError(f"{path}: tensor {e.name!r} ends past the data: expects "
                                              f"{data_start + e.end} bytes, file has {size}")

        return {"reference.snapshot_load._check_layout": check_layout}


class SizesNotReported(Mutant):
    id = "sizes_not_reported"
    bug = "every header problem reported as '<file>: not a valid safetensors file', without saying how many bytes were expected"
    kills = frozenset({"FILE-TRUNCATED", "FILE-CORRUPT-HEADER"})

    def patches(self):
        def parse_header(fd, path):
            try:
                return _real_parse_header(fd, path)
            except SnapshotFormatError:
                raise SnapshotFormatError(f"{path}: not a valid safetensors file") from None

        return {"reference.snapshot_load._parse_header": parse_header}


class NoChangeDetection(Mutant):
    id = "no_change_detection"
    bug = ("reads with pread but never compares the file's size/mtime after the read: a file rewritten mid-read "
           "loads as a mix of old and new tensors, reported NORMAL")
    kills = frozenset({"FILE-CHANGED-DURING-LOAD"})

    def patches(self):
        return {"reference.snapshot_load._identity": lambda st: ()}


class KeepsDescriptor(Mutant):
    id = "keeps_descriptor"
    bug = ("the file object is kept open after the load (a handle cached for the next update, or a generator never "
           "closed): a deleted multi-GiB snapshot stays on disk")
    kills = frozenset({"FILE-RELEASED"})

    def patches(self):
        def _open_fd(path):
            fd = _real_open_fd(path)
            _leaked.append(os.dup(fd))
            return fd

        return {"reference.snapshot_load._open_fd": _open_fd}


class RejectedFileStaysOpen(Mutant):
    id = "rejected_file_stays_open"
    bug = "a file rejected by the header check is never closed (close only on the success path)"
    kills = frozenset({"FILE-RELEASED"})

    def patches(self):
        def read_header(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.close(fd)
                return _real_read_header(path)
            except Exception:
                _leaked.append(os.open(path, os.O_RDONLY))
                raise

        return {"reference.snapshot.read_header": read_header}


class MemoizedFailure(Mutant):
    id = "memoized_failure"
    bug = ("headers cached by path, failures included: after the trainer fixes the file, clear() and update() "
           "still raise the old error")
    kills = frozenset({"FILE-ZERO-BYTES", "FILE-TRUNCATED", "FILE-CORRUPT-HEADER"})

    def patches(self):
        failed: dict[str, Exception] = {}

        def read_header(path):
            if path in failed:
                raise failed[path]
            try:
                return _real_read_header(path)
            except ValueError as e:
                failed[path] = e
                raise

        return {"reference.snapshot.read_header": read_header}


class PickleModuleAllowList(Mutant):
    id = "pickle_module_allow_list"
    bug = "the unpickler's allow-list checks the module only (numpy.*, collections.*): numpy.save and numpy.load run"
    kills = frozenset({"FILE-PICKLE-NO-EXEC"})

    def patches(self):
        modules = {m for m, _ in safe_pickle.ARRAY_GLOBALS}

        class Restricted(safe_pickle._Restricted):
            def find_class(self, module, name):
                if module in modules:
                    import importlib

                    return getattr(importlib.import_module(module), name)
                return super().find_class(module, name)

        return {"reference.safe_pickle._Restricted": Restricted}


class PickleScanGlobalOpcode(Mutant):
    id = "pickle_scan_global_opcode"
    bug = ("the pickle is pre-scanned for GLOBAL opcodes naming forbidden globals, then loaded with the full "
           "unpickler: STACK_GLOBAL (protocol 4/5) and INST slip through and run")
    kills = frozenset({"FILE-PICKLE-NO-EXEC"})

    def patches(self):
        def load_restricted(path, *, allow_arrays=True):
            allowed = safe_pickle.ARRAY_GLOBALS if allow_arrays else frozenset()
            data = open(path, "rb").read()
            if not data:
                raise SnapshotFormatError(f"{path}: file is empty (0 bytes)")
            try:
                for op, arg, _pos in pickletools.genops(data):
                    if op.name == "GLOBAL":
                        module, name = arg.split(" ", 1)
                        if (module, name) not in allowed:
                            raise safe_pickle.UnsafePickleError(f"{path}: refusing global {module}.{name}")
                return pickle.loads(data)
            except safe_pickle.UnsafePickleError:
                raise
            except Exception as e:
                raise SnapshotFormatError(f"{path}: not a readable pickle ({e})") from None

        return {"reference.snapshot_load.load_restricted": load_restricted}


class LibraryErrorsUnwrapped(Mutant):
    id = "library_errors_unwrapped"
    bug = ("header errors propagate as the parsing library raised them (safetensors' 'header too small', "
           "json's 'Expecting value'), naming no file: the operator cannot tell which of 40 parts to rewrite")
    kills = frozenset({"FILE-ZERO-BYTES", "FILE-TRUNCATED", "FILE-CORRUPT-HEADER"})

    def patches(self):
        def parse_header(fd, path):
            try:
                return _real_parse_header(fd, path)
            except SnapshotFormatError as e:
                raise ValueError(str(e).replace(path, "<file>")) from None

        return {"reference.snapshot_load._parse_header": parse_header}


class ValidatedHeaderTrusted(Mutant):
    id = "validated_header_trusted"
    bug = ("every header is validated in a first pass, then each file is read without checking that it is still "
           "the file that was validated: a trainer rewriting it in between gets a half-old, half-new file loaded "
           "as NORMAL")
    kills = frozenset({"FILE-CHANGED-BETWEEN-PARTS"})

    def patches(self):
        def iter_safetensors(path, expect=None, wanted=None):
            return _real_iter(path, wanted=wanted)

        return {"reference.snapshot.iter_safetensors": iter_safetensors}
