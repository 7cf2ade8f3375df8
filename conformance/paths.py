"""Every load path behind one interface, for rules that hold on all of them (SPEC.md § MODEL).

A rule written against :class:`Route` runs on every path in :data:`PATHS`: the snapshot levels (parts,
single file, legacy ``tp0{id}`` file, shared ``paddle.save`` fallback), ``ipc`` metas and ``ipc_bucket``
buckets, and the streamed ``rsync`` and ``gdr`` (a CheckpointTransfer trainer per rank; ``gdr_ipc`` differs from
``gdr`` only in the library's configuration, GDR-IPC-MODE, and is left out of the default "every path" to keep the
run short: it is in ``MORE_PATHS``, for the rules that name it). A path
is a :class:`Path` (its capabilities, the strategy a session is opened with, whether it updates loaded
weights in place, and a feed: the trainer side, which publishes one rank's tensors of a version where that
rank's session will read them). Adding a path is one line in ``PATHS`` plus its feed class; :func:`cases` turns the table into
``pytest.param`` s, each requiring exactly its path's capability.

    route = Route(loader, "bucket")
    session = route.open(model, rank=1)          # worker rank 1 on physical GPU 1
    route.publish(1, tensors, version=2)         # the trainer side
    route.clear(1)                                # the clear before an update, where the path has one
    route.update(1)                               # session.update(), then the feed settles

Ranks are workers ``(rank r, CUDA_VISIBLE_DEVICES=r, FLAGS_selected_gpus=0)``: physical GPU ``r``.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pytest

from .harness import Worker


def worker(rank: int) -> Worker:
    """Rank ``r`` in a process of its own that sees only physical GPU ``r`` (its CUDA ordinal 0): ranks'
    sessions can then share this test process, each opening IPC handles on its current device 0."""
    return Worker(rank, str(rank), "0")


class Feed:
    """The trainer side of one path: ``options(rank)`` for opening a rank's session, ``opened(session)``
    after it opened, ``publish`` a version, ``settle(rank)`` after each update, ``close()``. ``worker_of(rank)``
    is the worker each rank's session is opened as (default :func:`worker`; a :class:`Route` hands its own):
    the feed writes a rank's files under that worker's physical GPU id, for its CUDA ordinal."""

    worker_of: Callable[[int], Worker] = staticmethod(worker)

    def gpu(self, rank: int) -> int:
        return self.worker_of(rank).gpu_id

    def ordinal(self, rank: int) -> int:
        return int(self.worker_of(rank).selected)

    def options(self, rank: int) -> dict:
        return {}

    def opened(self, session) -> None:
        pass

    def settle(self, rank: int) -> None:
        pass

    def close(self) -> None:
        pass


class SnapshotFeed(Feed):
    """Writes a rank's snapshot at one level; the files of the previous version are removed first."""

    def __init__(self, loader, level: str):
        self.loader, self.level = loader, level
        self.written: dict[int, list[str]] = {}

    def publish(self, rank: int, tensors: Mapping[str, np.ndarray], version: int, layout=None) -> str:
        """``layout``: for parts, the names of each part (default: two parts, round-robin)."""
        from weightsync.fixtures import snapshot as S

        for path in self.written.pop(rank, []):
            os.remove(path)
        st = dict(sorted(tensors.items()))
        if self.level == "parts" and layout is not None:
            paths = S.write_parts(self.loader.model_dir, rank, self.gpu(rank), {i: {n: st[n] for n in names}
                                                                                for i, names in enumerate(layout)})
        else:
            paths = S.write_level(self.level, self.loader.model_dir, self.loader.shared_dir, rank, self.gpu(rank), st)
        self.written[rank] = paths
        return f"{self.level} snapshot of version {version} for rank {rank}: {[os.path.basename(p) for p in paths]}"


class IpcFeed(Feed):
    """Exports a rank's tensors to shared memory and writes its ``ipc_metas_{gpu}`` file."""

    def __init__(self, loader):
        self.loader = loader
        self.exports: dict[int, object] = {}

    def publish(self, rank: int, tensors, version: int, layout=None) -> str:
        from weightsync.fixtures import ipc as I

        old = self.exports.pop(rank, None)
        if old is not None:  # the worker holds its own copy of the previous version (IPC-WORKER-OWNS-COPY)
            old.close()
        export = self.exports[rank] = I.Export(dict(tensors), device_id=self.ordinal(rank))  # the worker's CUDA ordinal
        path = I.write_metas(I.meta_path(self.loader.shared_dir, self.gpu(rank)), export.metas)
        return f"ipc metas of version {version} for rank {rank}: {os.path.basename(path)}"

    def close(self) -> None:
        for export in self.exports.values():
            export.close()
        self.exports.clear()


class BucketFeed(Feed):
    """One trainer (fixtures.buckets.Publisher) per rank, serving each published version once."""

    BUCKET_BYTES = 1024
    WAIT_S = 5.0  # the trainer's wait for the receiver (and at a hold: ``Publisher.release``)
    TIMEOUT_S = 5.0  # the receiver's wait for the trainer (the session's ``timeout_s``)

    def __init__(self, loader):
        self.loader = loader
        self.publishers: dict[int, object] = {}

    def _publisher(self, rank: int):
        from weightsync.fixtures import buckets as B

        if rank not in self.publishers:
            self.publishers[rank] = B.Publisher(self.BUCKET_BYTES, wait_s=self.WAIT_S)
        return self.publishers[rank]

    def options(self, rank: int) -> dict:
        return self._publisher(rank).options(None, timeout_s=self.TIMEOUT_S)

    def publish(self, rank: int, tensors, version: int, layout=None) -> str:
        """``layout``: a function given the packed update (``fixtures.buckets.Update``) to tamper with."""
        from weightsync.fixtures import buckets as B

        pub = self._publisher(rank)
        update = B.pack(dict(tensors), version, self.BUCKET_BYTES)
        if layout is not None:
            layout(update)
        pub.serve(update)
        return f"ipc_bucket version {version} for rank {rank} in {len(update.buckets)} bucket(s) from {pub.endpoint}"

    def settle(self, rank: int) -> None:
        self.publishers[rank].wait(10.0)

    def close(self) -> None:
        for pub in self.publishers.values():
            pub.close()
        self.publishers.clear()


class StreamFeed(Feed):
    """One CheckpointTransfer trainer per rank (``fixtures.streams.trainer``: one thread of this process,
    reused across versions), each published version one scripted stream, answered to the next update.
    The sessions' models get the suite's ``load_weights`` (``fixtures.streams.attach_loaders``): GDR loads
    through each model's own loader (FastDeploy's contract), and rsync's sessions have them as an engine's
    models do. The version the sessions are opened with is published as ``version.yaml`` beside the model,
    as a trainer does (``fixtures.streams.publish_version``)."""

    TIMEOUT_S = 5.0  # the library's per-item wait: never reached by a healthy stream or a scripted fault

    def __init__(self, loader, strategy: str):
        self.loader, self.strategy = loader, strategy
        self.trainers: dict[int, object] = {}

    def _trainer(self, rank: int):
        from weightsync.fixtures import streams as S

        if rank not in self.trainers:
            self.trainers[rank] = S.trainer()
        return self.trainers[rank]

    def options(self, rank: int) -> dict:
        from weightsync.fixtures import streams as S

        return {"rsync_config": S.rsync_config(self._trainer(rank), self.TIMEOUT_S), "version": "1"}

    def opened(self, session) -> None:
        from weightsync.fixtures import streams as S

        S.attach_loaders(session.models)
        S.publish_version(self.loader.model_dir, self.options(0)["version"])  # for a bootstrap first load

    def publish(self, rank: int, tensors, version: int, layout=None) -> str:
        """``layout``: a trainer fault ``(kind, k)`` for this stream (``sim.stream_trainer.Stream.fault``)."""
        from weightsync.fixtures import streams as S

        trainer = self._trainer(rank)
        trainer.serve(S.stream_of(dict(tensors), fault=layout))
        fault = f", fault {layout}" if layout is not None else ""
        return f"{self.strategy} stream of version {version} for rank {rank} ({len(tensors)} items{fault}) from {trainer.endpoint}"

    def close(self) -> None:
        for trainer in self.trainers.values():
            trainer.close()
        self.trainers.clear()


@dataclass(frozen=True)
class Path:
    id: str
    capabilities: tuple[str, ...]
    strategy: str
    feed: Callable  # loader -> feed
    #: whether the path can carry fp8 tensors (``paddle.save`` pickles cannot)
    fp8: Callable[[], bool] = lambda: True
    #: whether an update writes into loaded weights without a clear (FastDeploy's rsync and GDR)
    in_place: bool = False


def _legacy_fp8() -> bool:
    from weightsync.fixtures import snapshot as S

    return not S.writes_pickle("legacy")


PATHS = {
    "parts": Path("parts", ("snapshot.parts",), "ipc_snapshot", lambda loader: SnapshotFeed(loader, "parts")),
    "single": Path("single", ("snapshot.single",), "ipc_snapshot", lambda loader: SnapshotFeed(loader, "single")),
    "legacy": Path("legacy", ("snapshot.legacy",), "ipc_snapshot", lambda loader: SnapshotFeed(loader, "legacy"),
                   _legacy_fp8),
    "shared": Path("shared", ("snapshot.shared_fallback",), "ipc_snapshot",
                   lambda loader: SnapshotFeed(loader, "shared"), lambda: False),
    "ipc": Path("ipc", ("ipc.meta",), "ipc", IpcFeed),
    "bucket": Path("bucket", ("ipc.buckets",), "ipc_bucket", BucketFeed),
    "rsync": Path("rsync", ("stream.rsync",), "rsync", lambda loader: StreamFeed(loader, "rsync"), in_place=True),
    "gdr": Path("gdr", ("stream.gdr",), "gdr", lambda loader: StreamFeed(loader, "gdr"), in_place=True),
}
#: Paths a rule names explicitly (``cases(paths=[...])``, ``Route``), left out of the default "every path":
#: ``gdr_ipc`` is GDR with the library in IPC mode (GDR-IPC-MODE).
MORE_PATHS = {
    "gdr_ipc": Path("gdr_ipc", ("stream.gdr_ipc",), "gdr_ipc", lambda loader: StreamFeed(loader, "gdr_ipc"),
                    in_place=True),
}
ALL_PATHS = {**PATHS, **MORE_PATHS}


# Paths whose updates a loader cannot stage: GDR hands each item to the model's own load_weights as it arrives.
UNSTAGED = ("gdr", "gdr_ipc")


def cases(*values, paths=None, extra: tuple[str, ...] = (), id_suffix: str = "", staged: bool = False):
    """One ``pytest.param(path, *values)`` per path (default: every path of ``PATHS``; ``paths`` may name
    ``MORE_PATHS`` too), requiring its capability and ``extra``; ids ``{path}{id_suffix}``. With ``staged``, each
    param ends with a bool, False, and each path a loader can stage gets a second one ending with True (requiring
    ``staged``, id ``...:staged``): the rule in both modes (conformance/modes.py: staged)."""
    out = []
    for p in (paths or PATHS):
        caps = (*ALL_PATHS[p].capabilities, *extra)
        if not staged:
            out.append(pytest.param(p, *values, marks=pytest.mark.requires(*caps), id=p + id_suffix))
            continue
        out.append(pytest.param(p, *values, False, marks=pytest.mark.requires(*caps), id=p + id_suffix))
        if p not in UNSTAGED:
            out.append(pytest.param(p, *values, True, marks=pytest.mark.requires(*caps, "staged"), id=p + id_suffix + ":staged"))
    return out


def staged_options(staged: bool) -> dict:
    """The session options of a case made by ``cases(..., staged=True)``."""
    return {"staged": True} if staged else {}


class Route:
    """Sessions of one path, one per rank, and the trainer side feeding them. ``worker_of(rank)``: the worker
    each rank is (default :func:`worker`: rank r on physical GPU r, its ordinal 0)."""

    def __init__(self, loader, path_id: str, worker_of: Callable[[int], Worker] = worker):
        self.loader = loader
        self.path = ALL_PATHS[path_id]
        self.feed = self.path.feed(loader)
        self.feed.worker_of = worker_of
        self.worker_of = worker_of
        self.sessions: dict[int, object] = {}

    @property
    def fp8(self) -> bool:
        return self.path.fp8()

    def open(self, model, rank: int = 0, options=None, without=()):
        """``options``: added to the path's own (e.g. ``recapture``, capability ``model.recapture``); ``without``:
        the path's own options left out (``version``: a streamed session whose steps come from version.yaml)."""
        own = {k: v for k, v in self.feed.options(rank).items() if k not in without}
        session = self.loader.open(model, strategy=self.path.strategy, worker=self.worker_of(rank),
                                   options={**own, **(options or {})})
        self.sessions[rank] = session
        self.feed.opened(session)
        return session

    def publish(self, rank: int, tensors, version: int, layout=None) -> str:
        return self.feed.publish(rank, tensors, version, layout)

    def clear(self, rank: int = 0) -> None:
        """The clear before an update (after the first), on the paths whose contract has one; the
        streamed paths update loaded weights in place, as FastDeploy runs rsync and GDR."""
        if not self.path.in_place:
            self.sessions[rank].clear()

    def update(self, rank: int = 0) -> None:
        try:
            self.sessions[rank].update()
        finally:
            self.feed.settle(rank)

    def close(self) -> None:
        self.feed.close()


@pytest.fixture
def route(loader):
    """``route(path)``: a :class:`conformance.paths.Route` of the path (the fixture every "every path" rule uses; import it); its trainers are closed at teardown."""
    made = []

    def make(path_id):
        made.append(Route(loader, path_id))
        return made[-1]

    yield make
    for r in made:
        r.close()
