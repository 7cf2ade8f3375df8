"""``checkpoint_transfer.config`` of the stand-in: the roles, backends and ``TransferConfig``.

The fields and defaults are those of the fake in FastDeploy's tests (fd-spec §3.6a); that list mirrors a
fake, so it is what FastDeploy's config translation is written against, not the real library's. One field is
the stand-in's own: ``endpoint``, the trainer's address (the real library discovers its peers through
redis; without it the stand-in refuses to initialize).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields


class Role(enum.Enum):
    TRAINER = "trainer"
    INFERENCE = "inference"


class Phase1Backend(enum.Enum):
    GPU_DIRECT = "gpu_direct"  # RDMA straight into device memory (rsync mode)
    IPC = "ipc"  # same-node CUDA IPC (GDR's ipc mode)


class Phase2Backend(enum.Enum):
    NONE = "none"
    NCCL = "nccl"


@dataclass
class TransferConfig:
    role: Role
    global_rank: int
    group_size: int = 1
    phase1_backend: Phase1Backend | None = None  # the fake's default is not known: a caller must choose
    phase2_backend: Phase2Backend | None = None
    phase2_fan_out: int = 4
    bucket_size_mb: int = 512
    num_buffers: int = 2
    redis_host: str = "127.0.0.1"
    redis_port: int = 6379
    discover_timeout_s: float = 60.0
    redis_ttl_s: int = 60
    recv_bucket_timeout_s: float = 60.0
    session_total_timeout_s: float = 600.0
    device: str | None = None
    log_level: str | None = None
    log_file: str | None = None
    perf_log_file: str | None = None
    materialize_tensors: bool = True
    qsize: int = 3
    gpu_id: int = -1
    endpoint: str | None = None  # stand-in only: the trainer's address

    @property
    def address(self) -> str:
        """The trainer's address: ``endpoint``. The stand-in has no redis to discover its peers through."""
        if not self.endpoint:
            raise ConnectionRefusedError("CheckpointTransfer stand-in: no endpoint configured (it does not discover "
                                         f"peers through redis at {self.redis_host}:{self.redis_port})")
        return self.endpoint

    def as_wire(self) -> dict:
        """Every field, enums by value: what ``register`` tells the trainer."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
        return out


FIELD_NAMES = frozenset(f.name for f in fields(TransferConfig))
