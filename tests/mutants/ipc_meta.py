"""Mutants of the ``ipc`` path (metadata file of shared handles; fd-spec §3.3, rule 23)."""
from __future__ import annotations

import os
import pickle

import numpy as np
import paddle

from reference import ipc_meta
from reference.dtypes import dtype_name
from sim import ipc_handles

from .base import Mutant

_normalize = ipc_meta.normalize_meta
_open = ipc_meta.open_tensor
_plan = ipc_meta.plan_metas
_dtype_of_code = ipc_meta.dtype_of_code
_read = ipc_meta.read_metas
_update = ipc_meta.update_from_ipc_meta


def _to_paddle(arr: np.ndarray) -> paddle.Tensor:
    """A Paddle tensor owning a copy of ``arr`` (bf16/fp8 via a uint8 view)."""
    dtype = ipc_meta.paddle_dtype(arr.dtype.name)
    if arr.size == 0:
        return paddle.empty(list(arr.shape), dtype=dtype)
    flat = paddle.to_tensor(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    return flat.view(dtype).reshape(list(arr.shape))


def _read_bytes(meta, check_range=True):
    """Attach, (check the range,) copy the bytes out as numpy, unmap."""
    handle, offset, size, type_idx, dims, _lod, device_id = meta
    dtype = ipc_handles.numpy_dtype(ipc_meta.dtype_of_code(type_idx))
    with ipc_handles.attach_on_device(handle, device_id) as seg:
        if check_range and offset + size > seg.size:
            raise ipc_meta.MetaError(f"field offset_bytes {offset} + size {size} outside segment of {seg.size} bytes")
        data = bytes(seg.buf[offset : offset + size])
    return np.frombuffer(data, dtype).reshape(dims).copy()


class DeviceNotReplaced(Mutant):
    id = "ipc_device_not_replaced"
    bug = "the meta keeps the trainer's device_id (fd-spec §3.3 field 6: FastDeploy overwrites it with FLAGS_selected_gpus)"
    kills = frozenset({"IPC-DEVICE-ID-REPLACED"})

    def patches(self):
        def normalize(meta, *, name, device):
            return _normalize(meta, name=name, device=meta[6] if len(meta) == 7 else device)

        return {"reference.ipc_meta.normalize_meta": normalize}


class TupleKeepsTrainerDevice(Mutant):
    id = "ipc_tuple_keeps_trainer_device"
    bug = ("a meta stored as a tuple (what _share_cuda() returns) cannot be assigned to, so the loader converts its "
           "handle but keeps the trainer's device_id (meta[6] = FLAGS_selected_gpus only for a list): on a worker whose "
           "ordinal is not the trainer's device the handle opens on the wrong device")
    kills = frozenset({"IPC-META-TUPLE", "IPC-HANDLE-BYTES"})

    def patches(self):
        def normalize(meta, *, name, device):
            kept = isinstance(meta, tuple) and len(meta) == 7
            return _normalize(meta, name=name, device=meta[6] if kept else device)

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


def _unchecked_open(name, meta, path):
    """_new_shared_cuda without the range check: slices whatever the mapping holds."""
    try:
        return _to_paddle(_read_bytes(meta, check_range=False))
    except ipc_handles.HandleError as e:
        raise ipc_meta.MetaError(f"{path}: cannot open IPC handle of tensor {name!r}: {e}") from None


class RangeUnchecked(Mutant):
    id = "ipc_range_unchecked"
    bug = "offset_bytes/size trusted against the allocation, as CUDA does (fd-spec §3.3 fields 1-2)"
    kills = frozenset({"IPC-RANGE-CHECKED"})

    def patches(self):
        return {"reference.ipc_meta.open_tensor": _unchecked_open}


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
        def dtype_of_code(code):
            return _dtype_of_code(code) or "uint8"

        return {"reference.ipc_meta.dtype_of_code": dtype_of_code}


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
                    fixed = ipc_meta.normalize_meta(meta, name=name, device=device)
                except ipc_meta.MetaError as e:
                    raise ipc_meta.MetaError(f"{path}: {e}") from None
                known = name in manager.params
                manager.apply([(name, ipc_meta.open_tensor(name, fixed, path) if known else None)], ipc_meta.LABEL, path)

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
        return {"reference.ipc_meta.open_tensor": lambda name, meta, path: _to_paddle(_read_bytes(meta))}


_kept: list = []  # mappings the aliasing mutant never closes


class AliasesSegment(Mutant):
    id = "ipc_aliases_segment"
    bug = ("parameters alias the trainer's shared memory (zero-copy, mapping kept open) as on GPU, so the trainer's "
           "next write changes the served weights (fd-spec §3.3)")
    kills = frozenset({"IPC-WORKER-OWNS-COPY"})

    def patches(self):
        def open_view(name, meta, path):
            real = _open(name, meta, path)  # every check of the real opener; only the copy is the bug
            handle, offset, size, type_idx, dims, _lod, _dev = meta
            if size == 0:
                return real
            seg = ipc_handles.Segment.attach(handle)
            _kept.append(seg)
            arr = np.frombuffer(seg.buf[offset : offset + size], np.uint8)
            flat = paddle.base.core.eager.Tensor(value=arr, zero_copy=True, place=paddle.CPUPlace())
            return flat.view(real.dtype).reshape(list(dims))

        return {"reference.ipc_meta.open_tensor": open_view}


# --- boundaries, positions, identity, aftermath (added with the ipc axes of the testing guide) ----


class RangeEndExclusive(Mutant):
    id = "ipc_range_end_exclusive"
    bug = "range check `offset + size >= segment size` (< instead of <=): a tensor ending on the segment's last byte is refused"
    kills = frozenset({"IPC-RANGE-CHECKED"})

    def patches(self):
        def open_tensor(name, meta, path):
            with ipc_handles.attach_on_device(meta[0], meta[6]) as seg:
                size = seg.size
            if meta[2] and meta[1] + meta[2] >= size:
                raise ipc_meta.MetaError(f"{path}: tensor {name!r}: field offset_bytes {meta[1]} outside segment of {size} bytes")
            return _open(name, meta, path)

        return {"reference.ipc_meta.open_tensor": open_tensor}


class RangeStartOnly(Mutant):
    id = "ipc_range_start_only"
    bug = "only offset_bytes is checked against the segment, not offset_bytes + size: a tensor straddling the end is read short"
    kills = frozenset({"IPC-RANGE-CHECKED"})

    def patches(self):
        def open_tensor(name, meta, path):
            with ipc_handles.attach_on_device(meta[0], meta[6]) as seg:
                size = seg.size
            if meta[1] >= size and meta[2]:
                raise ipc_meta.MetaError(f"{path}: tensor {name!r}: field offset_bytes {meta[1]} past segment of {size} bytes")
            return _unchecked_open(name, meta, path)

        return {"reference.ipc_meta.open_tensor": open_tensor}


class RangeWraps64(Mutant):
    id = "ipc_range_wraps_64bit"
    bug = "offset_bytes + size computed in uint64 (as C does): an offset near 2**64 wraps and passes the range check"
    kills = frozenset({"IPC-RANGE-CHECKED"})

    def patches(self):
        def open_tensor(name, meta, path):
            end = (meta[1] + meta[2]) % 2**64
            with ipc_handles.attach_on_device(meta[0], meta[6]) as seg:
                size = seg.size
            if end > size:
                raise ipc_meta.MetaError(f"{path}: tensor {name!r}: field offset_bytes {meta[1]} outside segment of {size} bytes")
            return _unchecked_open(name, meta, path)

        return {"reference.ipc_meta.open_tensor": open_tensor}


class SizeAtLeast(Mutant):
    id = "ipc_size_at_least"
    bug = "size only required to cover dims x itemsize (`size >= need`): an oversized meta is read from its first bytes"
    kills = frozenset({"IPC-SIZE-CHECKED"})

    def patches(self):
        def normalize(meta, *, name, device):
            meta = list(meta) if isinstance(meta, (list, tuple)) else meta
            if isinstance(meta, list) and len(meta) == 7 and isinstance(meta[2], int) and isinstance(meta[4], list):
                dtype = ipc_meta.dtype_of_code(meta[3])
                if dtype is not None and all(isinstance(d, int) for d in meta[4]):
                    need = int(np.prod(meta[4], dtype=np.int64)) * ipc_handles.numpy_dtype(dtype).itemsize
                    if meta[2] > need:
                        meta[2] = need
            return _normalize(meta, name=name, device=device)

        return {"reference.ipc_meta.normalize_meta": normalize}


class TypeIdxByEquality(Mutant):
    id = "ipc_type_idx_by_equality"
    bug = "type_idx looked up by equality in the code table, so True reads as BOOL and 10.0 as FLOAT32"
    kills = frozenset({"IPC-TYPE-UNKNOWN"})

    def patches(self):
        def dtype_of_code(code):
            table = {c: n for n, c in ipc_handles.phi_dtype_codes().items()}
            try:
                return table.get(code)
            except TypeError:
                return None

        return {"reference.ipc_meta.dtype_of_code": dtype_of_code}


class DimsSignUnchecked(Mutant):
    id = "ipc_dims_sign_unchecked"
    bug = "dims only checked through size == prod(dims) x itemsize: negative dims whose product agrees pass, and reshape fails unnamed"
    kills = frozenset({"IPC-DIMS-CHECKED"})

    def patches(self):
        def normalize(meta, *, name, device):
            if isinstance(meta, (list, tuple)) and len(meta) == 7 and isinstance(meta[4], (list, tuple)) \
                    and all(type(d) is int for d in meta[4]) and any(d < 0 for d in meta[4]):
                fixed = _normalize([*meta[:4], [abs(d) for d in meta[4]], *meta[5:]], name=name, device=device)
                return (*fixed[:4], list(meta[4]), *fixed[5:])
            return _normalize(meta, name=name, device=device)

        return {"reference.ipc_meta.normalize_meta": normalize}


class ChecksFirstMetaOnly(Mutant):
    id = "ipc_checks_first_meta_only"
    bug = "the first meta is validated as a sample of the file, the rest converted FastDeploy-style and trusted"
    kills = frozenset({"IPC-VALIDATE-FIRST", "IPC-META-LENGTH", "IPC-SIZE-CHECKED", "IPC-TYPE-UNKNOWN"})

    def patches(self):
        def plan(path, metas, device, params):
            first = dict(list(metas.items())[:1])
            planned = _plan(path, first, device, params)
            for name, meta in list(metas.items())[1:]:
                meta = list(meta) if isinstance(meta, (list, tuple)) else [meta] * 7
                meta[0] = meta[0].encode("latin-1") if isinstance(meta[0], str) else meta[0]
                meta[6] = device
                planned.append((name, tuple(meta) if name in params else None))
            return planned

        return {"reference.ipc_meta.plan_metas": plan}


class UnknownSkippedUnchecked(Mutant):
    id = "ipc_unknown_skipped_unchecked"
    bug = "metas of names the model does not have are dropped before validation, so a malformed entry passes"
    kills = frozenset({"IPC-UNKNOWN-VALIDATED"})

    def patches(self):
        def plan(path, metas, device, params):
            known = {n: m for n, m in metas.items() if n in params}
            return _plan(path, known, device, params) + [(n, None) for n in metas if n not in params]

        return {"reference.ipc_meta.plan_metas": plan}


class IdentityAtUpdate(Mutant):
    id = "ipc_identity_at_update"
    bug = "the ipc_metas id is read from the environment at update time, not kept from when the worker was opened"
    kills = frozenset({"IPC-IDENTITY-AT-OPEN"})

    def patches(self):
        def update(manager):
            from reference import identity

            manager.gpu_id = identity.physical_gpu_id(dict(os.environ))
            return _update(manager)

        return {"reference.ipc_meta.update_from_ipc_meta": update}


class OpenAllLeakOnError(Mutant):
    id = "ipc_open_all_leak_on_error"
    bug = "every handle is attached first and copied at apply; when a later handle fails, the attached ones are never unmapped"
    kills = frozenset({"IPC-NO-LEAK"})

    def patches(self):
        def update(manager):
            path = ipc_meta.meta_path(manager.shared_dir, manager.gpu_id)
            planned = ipc_meta.plan_metas(path, ipc_meta.read_metas(path), ipc_meta.worker_device(manager), manager.params)
            attached = []
            for name, meta in planned:
                if meta is not None:
                    attached.append(ipc_handles.attach_on_device(meta[0], meta[6]))  # not closed if a later one fails
                    if meta[1] + meta[2] > attached[-1].size:
                        raise ipc_meta.MetaError(f"{path}: tensor {name!r}: field offset_bytes {meta[1]} outside its segment")
            for seg in attached:
                seg.close()
            return _update(manager)

        return {"reference.ipc_meta.update_from_ipc_meta": update}


_fds: list = []


class KeepsDescriptor(Mutant):
    id = "ipc_keeps_descriptor"
    bug = "the segment is opened with open() and mapped, but the file descriptor is never closed (one leaked per tensor)"
    kills = frozenset({"IPC-NO-LEAK"})

    def patches(self):
        def open_tensor(name, meta, path):
            try:
                _fds.append(os.open(os.path.join(ipc_handles.SHM_DIR, ipc_handles.handle_name(meta[0])), os.O_RDONLY))
            except OSError:
                pass
            return _open(name, meta, path)

        return {"reference.ipc_meta.open_tensor": open_tensor}


class ModelDtypeTrusted(Mutant):
    id = "ipc_model_dtype_trusted"
    bug = "the bytes are read as the parameter's dtype whenever the itemsize agrees (type_idx only used for the size), so bf16 loads as fp16"
    kills = frozenset({"APPLY-DTYPE-MISMATCH"})

    def patches(self):
        def plan(path, metas, device, params):
            codes = ipc_handles.phi_dtype_codes()
            fixed = {}
            for name, meta in metas.items():
                target = params.get(name)
                if target is not None and isinstance(meta, (list, tuple)) and len(meta) == 7:
                    have, want = ipc_meta.dtype_of_code(meta[3]), dtype_name(target)
                    if have and want in codes and ipc_handles.numpy_dtype(have).itemsize == ipc_handles.numpy_dtype(want).itemsize:
                        meta = [*meta[:3], codes[want], *meta[4:]]
                fixed[name] = meta
            return _plan(path, fixed, device, params)

        return {"reference.ipc_meta.plan_metas": plan}


class ReshapedToModel(Mutant):
    id = "ipc_reshaped_to_model"
    bug = "dims replaced by the parameter's shape when the element count agrees (a transposed or flattened tensor loads silently)"
    kills = frozenset({"APPLY-SHAPE-MISMATCH"})

    def patches(self):
        def plan(path, metas, device, params):
            fixed = {}
            for name, meta in metas.items():
                target = params.get(name)
                if target is not None and isinstance(meta, (list, tuple)) and len(meta) == 7 and isinstance(meta[4], (list, tuple)):
                    if int(np.prod(meta[4])) == int(np.prod(target.shape)):
                        meta = [*meta[:4], list(target.shape), *meta[5:]]
                fixed[name] = meta
            return _plan(path, fixed, device, params)

        return {"reference.ipc_meta.plan_metas": plan}


class FileContentUnchecked(Mutant):
    id = "ipc_file_content_unchecked"
    bug = "whatever the meta file unpickles to is iterated as a dict: a list or None fails with an AttributeError naming no file"
    kills = frozenset({"IPC-FILE-CONTENT"})

    def patches(self):
        from reference.safe_pickle import load_restricted

        def read(path):
            if not os.path.exists(path):
                raise FileNotFoundError(path)
            return load_restricted(path, allow_arrays=False)

        return {"reference.ipc_meta.read_metas": read}


class EmptyFileIsNoop(Mutant):
    id = "ipc_empty_file_is_noop"
    bug = "an empty meta dict is taken as 'the trainer has nothing new' and the update goes on to report missing parameters, naming no file"
    kills = frozenset({"IPC-FILE-CONTENT"})

    def patches(self):
        def update(manager):
            path = ipc_meta.meta_path(manager.shared_dir, manager.gpu_id)
            if ipc_meta.read_metas(path):
                _update(manager)

        return {"reference.ipc_meta.update_from_ipc_meta": update}


class HandleUtf8(Mutant):
    id = "ipc_handle_utf8"
    bug = "the latin-1 str handle encoded back with Python's default UTF-8: every byte >= 0x80 of the opaque handle doubles"
    kills = frozenset({"IPC-ROUNDTRIP-DTYPES", "IPC-FILE-NAME", "IPC-DEVICE-ID-REPLACED"})

    def patches(self):
        def normalize(meta, *, name, device):
            if isinstance(meta, (list, tuple)) and meta and isinstance(meta[0], str):
                meta = [meta[0].encode("utf-8"), *meta[1:]]
            return _normalize(meta, name=name, device=device)

        return {"reference.ipc_meta.normalize_meta": normalize}


class ArraysAdmitted(Mutant):
    id = "ipc_arrays_admitted"
    bug = "the meta file read with the snapshot fallback's unpickler, which admits numpy array reconstruction"
    kills = frozenset({"IPC-META-NO-PICKLE-EXEC"})

    def patches(self):
        from reference.safe_pickle import load_restricted

        def read(path):
            if not os.path.exists(path):
                raise FileNotFoundError(path)
            return load_restricted(path, allow_arrays=True)

        return {"reference.ipc_meta.read_metas": read}


class SizeTypeByIsinstance(Mutant):
    id = "ipc_size_isinstance_int"
    bug = ("offset_bytes and size checked with isinstance(v, int), which admits bools (and a float 1.0 compares equal): a "
           "1-byte tensor whose size is True passes as 1 byte")
    kills = frozenset({"IPC-SIZE-CHECKED"})

    def patches(self):
        def normalize(meta, *, name, device):
            if isinstance(meta, (list, tuple)) and len(meta) == 7 and isinstance(meta[2], (bool, float)) and meta[2] == int(meta[2]):
                meta = [*meta[:2], int(meta[2]), *meta[3:]]
            return _normalize(meta, name=name, device=device)

        return {"reference.ipc_meta.normalize_meta": normalize}


class DeviceFromEnvironmentAtUpdate(Mutant):
    id = "ipc_device_env_at_update"
    bug = ("the CUDA ordinal for opening handles read from os.environ when update() runs, not from the identity the "
           "session was opened with: after the environment changes, meta[6] names a device the worker is not on")
    kills = frozenset({"IPC-IDENTITY-AT-OPEN"})

    def patches(self):
        return {"reference.ipc_meta.worker_device": lambda manager: int(os.environ.get("FLAGS_selected_gpus", "0"))}
