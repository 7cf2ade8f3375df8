"""One trainer per path for the lifecycle rules: publish a version of a model, healthy or with one
fault, and open a session that reads it.

``Sources(loader, kind)`` with kind ``snapshot`` (parts written to the model directory), ``ipc`` (a
shared-memory export and its ``ipc_metas_0``) or ``bucket`` (a ``fixtures.buckets.Publisher``).
``publish(spec, version, fault=None)`` makes the next update's source; faults, each at the *last* place
the path reaches so that a loader which applies as it goes has applied everything else first:

* ``missing``: the last parameter is absent;
* ``bad-dtype``: the last parameter has the wrong dtype;
* ``gone``: the source breaks mid-transfer (snapshot: the last part is truncated; ipc: the segment of
  the last tensors is freed; bucket: the trainer dies before its last bucket).

Versions: ``version.yaml`` (``step``) beside the snapshot or the meta file; the bucket manifests.
"""
from __future__ import annotations

import os
import re

import numpy as np

from weightsync.fixtures import buckets as B
from weightsync.fixtures import ipc as I
from weightsync.fixtures import models as M
from weightsync.fixtures import snapshot as S
from weightsync.fixtures import status_cell as C

KINDS = ("snapshot", "ipc", "bucket")
CAPS = {"snapshot": ("snapshot.parts",), "ipc": ("ipc.meta",), "bucket": ("ipc.buckets",)}
STRATEGY = {"snapshot": "ipc_snapshot", "ipc": "ipc", "bucket": "ipc_bucket"}
FAULTS = ("missing", "bad-dtype", "gone")
BUCKET_BYTES = 512


def broken_state(spec, version: int, fault: str | None) -> dict[str, np.ndarray]:
    st = dict(sorted(M.state(spec, version=version).items()))
    last = list(st)[-1]
    if fault == "missing":
        del st[last]
    elif fault == "bad-dtype":
        st[last] = st[last].astype(np.float64 if st[last].dtype != np.float64 else np.float32)
    return st


def failure_of(spec, fault: str, *, truncated: str | None = None) -> tuple[type, str, list[str]]:
    """(exception type, pattern, names) that an update from a source with ``fault`` at its last parameter must
    raise, as SPEC.md names them: a missing parameter the verification's RuntimeError (its words or the
    parameter's name: APPLY-MISSING-FAILS), a wrong dtype a TypeError naming the tensor (APPLY-DTYPE-MISMATCH), a
    snapshot file ``truncated`` to half (``gone``) a ValueError naming the file (FILE-TRUNCATED)."""
    last = sorted(p.name for p in spec.all_params)[-1]
    if fault == "missing":  # FastDeploy's verification names no parameter (fd-spec §2.7); the reference's does
        return RuntimeError, rf"verification failed|{re.escape(last)}", []
    if fault == "bad-dtype":
        return TypeError, re.escape(last), [last]
    if fault == "gone" and truncated is not None:
        return ValueError, re.escape(os.path.basename(truncated)), [truncated]
    raise ValueError(f"failure_of: no failure known for fault {fault!r} (truncated file: {truncated!r})")


class Sources:
    def __init__(self, loader, kind: str, *, timeout_s: float = 1.0, rank: int = 0, gpu: int = 0):
        """``rank``/``gpu``: the worker whose shard is published (global rank, physical GPU id)."""
        self.loader, self.kind, self.timeout_s = loader, kind, timeout_s
        self.rank, self.gpu = rank, gpu
        self.exports: list = []
        self.publisher = None
        self.where = ""
        self.paths: list[str] = []  # snapshot: the parts of the last publish
        self.last_bucket = 0  # bucket: the index of the last publish's last bucket

    def options(self, **extra) -> dict:
        if self.kind == "bucket":
            if self.publisher is None:
                self.publisher = B.Publisher(BUCKET_BYTES, wait_s=10.0)
            return {**self.publisher.options(None, self.timeout_s), **extra}
        return dict(extra)

    def open(self, spec, **options):
        return self.loader.open(spec, strategy=STRATEGY[self.kind], options=self.options(**options))

    def publish(self, spec, version: int, fault: str | None = None, *, write_version: bool = True) -> None:
        st = broken_state(spec, version, fault if fault != "gone" else None)
        if self.kind == "snapshot":
            d = self.loader.model_dir
            for name in os.listdir(d):
                os.remove(os.path.join(d, name))
            paths = self.paths = S.write_parts(d, self.rank, self.gpu, dict(enumerate(S.split(st, min(3, len(st))))))
            if fault == "gone":
                with open(paths[-1], "r+b") as f:
                    f.truncate(os.path.getsize(paths[-1]) // 2)
            if write_version:
                C.write_version(d, version)
            self.where = f"snapshot parts {[os.path.basename(p) for p in paths]}"
        elif self.kind == "ipc":
            for old in self.exports:
                old.close()
            export = I.Export(st, per_segment=2)
            self.exports = [export]
            path = I.write_metas(I.meta_path(self.loader.shared_dir, self.gpu), export.metas)
            if fault == "gone":
                export.free(list(st)[-1])
            if write_version:
                C.write_version(self.loader.shared_dir, version)
            elif os.path.exists(os.path.join(self.loader.shared_dir, "version.yaml")):
                os.remove(os.path.join(self.loader.shared_dir, "version.yaml"))  # the last version's, gone with it
            self.where = f"ipc metas {path}"
        else:
            update = B.pack(st, version, BUCKET_BYTES)
            self.last_bucket = len(update.buckets) - 1
            if fault == "gone":
                update.fault = ("die", self.last_bucket)
            self.options()
            self.publisher.serve(update)
            self.where = f"buckets of version {version} at {self.publisher.endpoint}"

    def failure(self, spec, fault: str) -> tuple[type, str, list[str]]:
        """(exception type, pattern, names) that the update of the last ``publish(spec, v, fault)`` must
        raise (:func:`failure_of`; the source gone: a ValueError naming a tensor of the freed segment,
        IPC-SEGMENT-GONE, or a TimeoutError naming the bucket awaited, BKT-TIMEOUT)."""
        if fault != "gone" or self.kind == "snapshot":
            return failure_of(spec, fault, truncated=self.paths[-1] if self.paths else None)
        if self.kind == "ipc":
            freed = self.exports[0].sharing(sorted(p.name for p in spec.all_params)[-1])
            return ValueError, "|".join(map(re.escape, freed)), []
        return TimeoutError, rf"bucket {self.last_bucket}\b", []

    def settle(self) -> None:
        """Wait for the trainer to finish serving (buckets); a publisher that died is replaced."""
        if self.publisher is not None:
            try:
                self.publisher.wait(5.0)
            except Exception:  # noqa: BLE001 (the update's own failure is what the test judges)
                pass

    def close(self) -> None:
        for export in self.exports:
            export.close()
        self.exports = []
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
