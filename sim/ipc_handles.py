"""Shared-memory segments standing in for CUDA IPC allocations on a CPU machine.

A CUDA IPC handle (``cudaIpcMemHandle_t``) is 64 opaque bytes naming an allocation in another
process. Here the 64 bytes are the POSIX shared-memory name, NUL-padded, so the 7-field meta keeps
its exact shape. Segments live in /dev/shm and are opened with ``os.open`` + ``mmap`` rather than
``multiprocessing.shared_memory``: on Python < 3.13 attaching through that module registers the
segment with the resource tracker, which unlinks it when the *attaching* process exits.
"""
from __future__ import annotations

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


def make_handle(name: str) -> bytes:
    raw = name.encode("ascii")
    if len(raw) >= HANDLE_SIZE:
        raise HandleError(f"segment name {name!r} does not fit a {HANDLE_SIZE}-byte handle")
    return raw.ljust(HANDLE_SIZE, b"\0")


def handle_name(handle: bytes | str) -> str:
    """Segment name from a 64-byte handle (bytes, or the latin-1 str FastDeploy trainers store)."""
    raw = handle.encode("latin-1") if isinstance(handle, str) else bytes(handle)
    if len(raw) != HANDLE_SIZE:
        raise HandleError(f"IPC handle must be {HANDLE_SIZE} bytes, got {len(raw)}")
    name = raw.rstrip(b"\0").decode("ascii", errors="replace")
    if not name or "/" in name or "\0" in name:
        raise HandleError(f"IPC handle {raw[:16]!r}... is not a shared-memory name")
    return name


def leaked_segments(prefix: str = PREFIX) -> list[str]:
    """Names of this project's segments still present in /dev/shm."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "_"))
    except FileNotFoundError:
        return []
