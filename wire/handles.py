"""IPC handles on a CPU machine: the format both ends agree on, and the segment a handle names.

A CUDA IPC handle (``cudaIpcMemHandle_t``) is 64 opaque bytes naming an allocation in another
process. Here the 64 bytes are the POSIX shared-memory name, NUL-padded, so the 7-field meta keeps
its exact shape. Segments live in /dev/shm and are opened with ``os.open`` + ``mmap`` rather than
``multiprocessing.shared_memory``: on Python < 3.13 attaching through that module registers the
segment with the resource tracker, which unlinks it when the *attaching* process exits.

Also here, because the trainer, the receiver and the test harness must agree on them: the fields of
a stored 7-field meta and the phi DataType codes of its ``type_idx``; and the device rule of CUDA IPC
(a handle opens only on the opener's current device: ``attach_on_device``), with the process's
current device that the harness sets. The trainer side (``share_array``) and a complete CPU
``_new_shared_cuda`` live in ``sim.ipc_handles``; the receiver's checks of a stored meta in
``reference.ipc_meta``.
"""
from __future__ import annotations

import functools
import mmap
import os
import secrets

HANDLE_SIZE = 64  # CUDA_IPC_HANDLE_SIZE
SHM_DIR = "/dev/shm"
PREFIX = "wscf"  # every segment this project creates starts with this, so leaks can be found


class HandleError(ValueError):
    """A handle that does not name an open segment, or is malformed."""


class Segment:
    """A named shared-memory segment. The creator unlinks it; attachers only unmap."""

    def __init__(self, name: str, size: int, owner: bool, fd: int):
        self.name = name
        self.size = size
        self.owner = owner
        try:
            self._map = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        self.buf = memoryview(self._map) if self._map is not None else memoryview(b"")

    @classmethod
    def create(cls, nbytes: int, prefix: str = PREFIX) -> "Segment":
        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(6)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        return cls(name, nbytes, True, fd)

    @classmethod
    def attach(cls, handle: bytes | str) -> "Segment":
        name = handle_name(handle)
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError:
            raise HandleError(f"IPC handle {name!r} names no shared-memory segment (trainer gone or segment freed)") from None
        size = os.fstat(fd).st_size
        return cls(name, size, False, fd)

    @property
    def handle(self) -> bytes:
        return make_handle(self.name)

    def close(self) -> None:
        if self._map is not None:
            self.buf.release()
            self._map.close()
            self._map = None

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        if self.owner:
            self.unlink()


# After the name's NUL terminator a handle is filled with bytes >= 0x80, as opaque as a real
# cudaIpcMemHandle_t: stored as a latin-1 str, a handle encoded back as UTF-8 (or decoded as ASCII) breaks.
_FILL = bytes(range(0xC0, 0x100))


def make_handle(name: str) -> bytes:
    raw = name.encode("ascii")
    if len(raw) >= HANDLE_SIZE:
        raise HandleError(f"segment name {name!r} does not fit a {HANDLE_SIZE}-byte handle")
    return (raw + b"\0" + _FILL)[:HANDLE_SIZE].ljust(HANDLE_SIZE, b"\0")


def handle_name(handle: bytes | str) -> str:
    """Segment name from a 64-byte handle (bytes, or the latin-1 str FastDeploy trainers store)."""
    raw = handle.encode("latin-1") if isinstance(handle, str) else bytes(handle)
    if len(raw) != HANDLE_SIZE:
        raise HandleError(f"IPC handle must be {HANDLE_SIZE} bytes, got {len(raw)}")
    name = raw.split(b"\0", 1)[0].decode("ascii", errors="replace")
    if not name or "/" in name or "\0" in name:
        raise HandleError(f"IPC handle {raw[:16]!r}... is not a shared-memory name")
    return name


def leaked_segments(prefix: str = PREFIX) -> list[str]:
    """Names of this project's segments still present in /dev/shm."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "_"))
    except FileNotFoundError:
        return []


# --- 7-field metas: Paddle's ``DenseTensor._share_cuda()`` tuple ---------------------------------
#
# [handle, offset_bytes, size, type_idx, dims, lod, device_id] (fd-spec §3.3). Trainers store the
# handle as a latin-1 ``str`` because ``paddle.save`` refuses ``bytes`` values, and the file as a
# list per tensor.

META_FIELDS = ("handle", "offset_bytes", "size", "type_idx", "dims", "lod", "device_id")

# phi::DataType values in Paddle 3.x, used only where Paddle cannot be imported. Note INT16 is 5
# (UINT16 is 4): a table written from memory gets this wrong, so the live one comes from Paddle.
PHI_DTYPE_CODES_PADDLE3 = {
    "bool": 1, "uint8": 2, "int8": 3, "int16": 5, "int32": 7, "int64": 9,
    "float32": 10, "float64": 11, "float16": 15, "bfloat16": 16,
    "float8_e4m3fn": 17, "float8_e5m2": 18,
}


@functools.cache
def phi_dtype_codes() -> dict[str, int]:
    """dtype name -> phi DataType int, read from the installed Paddle (static Paddle 3.x table without it)."""
    try:
        from paddle.base import core
    except ImportError:
        return dict(PHI_DTYPE_CODES_PADDLE3)
    return {name: int(getattr(core.DataType, name.upper())) for name in PHI_DTYPE_CODES_PADDLE3}


# The process's current device, as ``cudaSetDevice`` leaves it: an engine sets it once when the worker
# starts, from FLAGS_selected_gpus, and it does not follow later changes of the environment.
_current: int | None = None


def set_current_device(device: int | None) -> None:
    """``cudaSetDevice`` for the stand-in (None: follow ``FLAGS_selected_gpus`` of the environment)."""
    global _current
    _current = device


def current_device(env=None) -> int:
    """The device a CUDA worker has current: the one set by ``set_current_device``, else its
    ``FLAGS_selected_gpus`` ordinal."""
    if _current is not None and env is None:
        return _current
    env = os.environ if env is None else env
    return int(env.get("FLAGS_selected_gpus", "0"))


def attach_on_device(handle: bytes, device_id, *, device: int | None = None) -> Segment:
    """The transport half of ``_new_shared_cuda``: attach the segment ``handle`` names, refusing a
    ``device_id`` other than the process's current device (``device``, default ``FLAGS_selected_gpus``
    from the environment), as a CUDA IPC handle opens only on the opener's own device. HandleError
    when the segment is gone. The caller checks the byte range and closes the segment."""
    here = current_device() if device is None else device
    if device_id != here:
        raise HandleError(
            f"field device_id is {device_id} but this worker's current device is {here} "
            "(FLAGS_selected_gpus); an IPC handle opens on the opener's own device"
        )
    return Segment.attach(handle)
