"""Mutants of the ``ipc`` path (metadata file of shared handles; fd-spec §3.3, rule 23)."""
from __future__ import annotations

import os
import pickle

import numpy as np
import paddle

from reference import ipc_meta
from sim import ipc_handles

from .base import Mutant

_normalize = ipc_handles.normalize_meta
_open = ipc_handles.open_tensor_meta
_read = ipc_meta.read_metas
_to_paddle = ipc_meta.to_paddle


class DeviceNotReplaced(Mutant):
    id = "ipc_device_not_replaced"
    bug = "the meta keeps the trainer's device_id (fd-spec §3.3 field 6: FastDeploy overwrites it with FLAGS_selected_gpus)"
    kills = frozenset({"IPC-DEVICE-ID-REPLACED"})

    def patches(self):
        def normalize(meta, *, name, device):
            return _normalize(meta, name=name, device=meta[6] if len(meta) == 7 else device)

        return {"reference.ipc_meta.normalize_meta": normalize}


class DevicePhysicalId(Mutant):
    id = "ipc_device_physical_id"
    bug = "device_id set to the physical GPU id (the file-name id) instead of the CUDA ordinal FLAGS_selected_gpus"
    kills = frozenset({"IPC-DEVICE-ID-REPLACED", "IPC-FILE-NAME"})

    def patches(self):
        return {"reference.ipc_meta.worker_device": lambda manager: manager.gpu_id}


class FileByOrdinal(Mutant):
    id = "ipc_file_by_ordinal"
    bug = "ipc_metas_{id} named by FLAGS_selected_gpus instead of the physical GPU id (fd-spec rule 12)"
    kills = frozenset({"IPC-FILE-NAME", "IPC-DEVICE-ID-REPLACED"})

    def patches(self):
        def meta_path(shared_dir, gpu_id):
            return os.path.join(shared_dir, f"ipc_metas_{os.environ.get('FLAGS_selected_gpus', '0')}")

        return {"reference.ipc_meta.meta_path": meta_path}


class FastDeployConvert(Mutant):
    id = "ipc_fastdeploy_convert"
    bug = ("FastDeploy's _convert_ipc_meta_to_tensor: meta[0] = meta[0].encode('latin-1'); meta[6] = device; "
           "tuple(meta) with no checks (fd-spec rule 23: tuples and bytes handles fail, 8 fields reach "
           "_new_shared_cuda, whose error names no tensor)")
    kills = frozenset({"IPC-META-TUPLE", "IPC-HANDLE-BYTES", "IPC-META-LENGTH", "IPC-TYPE-UNKNOWN", "IPC-VALIDATE-FIRST"})

    def patches(self):
        def convert(meta, *, name, device):
            meta[0] = meta[0].encode("latin-1")
            meta[6] = device
            return tuple(meta)

        return {"reference.ipc_meta.normalize_meta": convert}


class OffsetIgnored(Mutant):
    id = "ipc_offset_ignored"
    bug = "offset_bytes ignored: every tensor read from the start of its allocation (fd-spec §3.3 field 1: pointer = base + offset)"
    kills = frozenset({
        "IPC-ROUNDTRIP-DTYPES", "IPC-WORKER-OWNS-COPY", "IPC-FILE-NAME", "IPC-DEVICE-ID-REPLACED", "IPC-HANDLE-BYTES",
        "IPC-META-TUPLE", "IPC-RANGE-CHECKED", "IPC-VALIDATE-FIRST",
    })

    def patches(self):
        def normalize(meta, *, name, device):
            handle, _offset, *rest = _normalize(meta, name=name, device=device)
            return (handle, 0, *rest)

        return {"reference.ipc_meta.normalize_meta": normalize}


class MissingFileSkipped(Mutant):
    id = "ipc_missing_file_skipped"
    bug = "a missing ipc_metas file is read as an empty dict (trainer 'not written yet') instead of FileNotFoundError"
    kills = frozenset({"IPC-META-MISSING"})

    def patches(self):
        def read(path):
            return _read(path) if os.path.exists(path) else {}

        return {"reference.ipc_meta.read_metas": read}


def _unchecked_open(meta, *, device=None):
    """_new_shared_cuda without the range check: slices whatever the mapping holds."""
    handle, offset, size, type_idx, dims, _lod, _dev = meta
    dtype = ipc_handles.numpy_dtype(ipc_handles.dtype_of_code(type_idx))
    with ipc_handles.Segment.attach(handle) as seg:
        data = bytes(seg.buf[offset : offset + size])
    return np.frombuffer(data, dtype).reshape(dims).copy()


class RangeUnchecked(Mutant):
    id = "ipc_range_unchecked"
    bug = "offset_bytes/size trusted against the allocation, as CUDA does (fd-spec §3.3 fields 1-2)"
    kills = frozenset({"IPC-RANGE-CHECKED"})

    def patches(self):
        return {"reference.ipc_meta.open_tensor_meta": _unchecked_open}


class SizeUnchecked(Mutant):
    id = "ipc_size_unchecked"
    bug = "size not compared with dims x itemsize: the bytes are taken from dims alone (fd-spec §3.3 fields 2-4)"
    kills = frozenset({"IPC-SIZE-CHECKED", "IPC-VALIDATE-FIRST"})

    def patches(self):
        def normalize(meta, *, name, device):
            meta = list(meta)
            if len(meta) == 7 and isinstance(meta[4], (list, tuple)):
                dtype = ipc_handles.dtype_of_code(meta[3])
                if dtype is not None:
                    meta[2] = int(np.prod(meta[4], dtype=np.int64)) * ipc_handles.numpy_dtype(dtype).itemsize
            return _normalize(meta, name=name, device=device)

        return {"reference.ipc_meta.normalize_meta": normalize}


class UnknownTypeAsBytes(Mutant):
    id = "ipc_unknown_type_as_uint8"
    bug = "an unknown type_idx falls back to raw uint8 bytes instead of a clear error (fd-spec §3.3 field 3)"
    kills = frozenset({"IPC-TYPE-UNKNOWN"})

    def patches(self):
        real = ipc_handles.dtype_of_code

        def dtype_of_code(code):
            return real(code) or "uint8"

        return {"sim.ipc_handles.dtype_of_code": dtype_of_code, "reference.ipc_meta.dtype_of_code": dtype_of_code}


class ApplyAsYouGo(Mutant):
    id = "ipc_apply_as_you_go"
    bug = "each meta opened and applied in turn, so a bad meta k leaves 0..k-1 replaced (fd-spec rule 17)"
    kills = frozenset({"IPC-VALIDATE-FIRST", "IPC-FILE-NAME", "IPC-META-LENGTH"})

    def patches(self):
        def update(manager):
            path = ipc_meta.meta_path(manager.shared_dir, manager.gpu_id)
            device = ipc_meta.worker_device(manager)
            for name, meta in ipc_meta.read_metas(path).items():
                try:
                    fixed = ipc_handles.normalize_meta(meta, name=name, device=device)
                except ipc_handles.MetaError as e:
                    raise ipc_handles.MetaError(f"{path}: {e}") from None
                manager.apply([(name, ipc_meta.open_tensor(name, fixed, path))], ipc_meta.LABEL, path)

        return {"reference.ipc_meta.update_from_ipc_meta": update}


class PlainPickle(Mutant):
    id = "ipc_plain_pickle"
    bug = "the meta file read with plain pickle (FastDeploy: paddle.load), running any callable the file names"
    kills = frozenset({"IPC-META-NO-PICKLE-EXEC"})

    def patches(self):
        def read(path):
            with open(path, "rb") as f:
                return pickle.load(f)

        return {"reference.ipc_meta.read_metas": read}


class UnnamedOpenErrors(Mutant):
    id = "ipc_unnamed_open_errors"
    bug = "errors from opening a handle passed through without the tensor (FastDeploy: a bare CUDA error from _new_shared_cuda)"
    kills = frozenset({"IPC-SEGMENT-GONE", "IPC-RANGE-CHECKED"})

    def patches(self):
        return {"reference.ipc_meta.open_tensor": lambda name, meta, path: _to_paddle(ipc_meta.open_tensor_meta(meta))}


_kept: list = []  # mappings the aliasing mutant never closes


class AliasesSegment(Mutant):
    id = "ipc_aliases_segment"
    bug = ("parameters alias the trainer's shared memory (zero-copy, mapping kept open) as on GPU, so the trainer's "
           "next write changes the served weights (fd-spec §3.3)")
    kills = frozenset({"IPC-WORKER-OWNS-COPY"})

    def patches(self):
        def open_view(meta, *, device=None):
            _open(meta, device=device)  # every check of the real opener; only the copy is the bug
            handle, offset, size, type_idx, dims, _lod, _dev = meta
            seg = ipc_handles.Segment.attach(handle)
            _kept.append(seg)
            dtype = ipc_handles.numpy_dtype(ipc_handles.dtype_of_code(type_idx))
            return np.frombuffer(seg.buf[offset : offset + size], dtype).reshape(dims)

        def to_paddle(arr):
            if arr.size == 0:
                return _to_paddle(arr)
            flat = paddle.base.core.eager.Tensor(value=arr.reshape(-1).view(np.uint8), zero_copy=True, place=paddle.CPUPlace())
            return flat.view(ipc_meta.paddle_dtype(arr.dtype.name)).reshape(list(arr.shape))

        return {"reference.ipc_meta.open_tensor_meta": open_view, "reference.ipc_meta.to_paddle": to_paddle}
