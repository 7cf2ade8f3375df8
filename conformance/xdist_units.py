"""How pytest-xdist hands the suite's cases to its workers in a conformance run (``--impl`` and ``-n N``, with
pytest-xdist's default ``--dist load``; any other ``--dist`` is left as given).

A module whose cases share a fixture wider than one case (``WHOLE``) goes to one worker as a single unit, so
that fixture is set up once per run: the batches that start every case's timed operation at once and wait
out one deadline for all of them (test_stream_timing.py, test_ipc_buckets.py's dead trainers, test_ranks_quick.py's
waiting operations), its pool of forked ranks, test_memory.py's snapshots, the read-capping library prepared
for test_snapshot_files.py, test_snapshot_huge.py and test_versions.py. Under ``--dist load`` each worker that got
any case of such a module built the whole batch again (test_stream_timing.py's 24 sessions: 1.7 s a worker).
Every other case is a unit of its own, handed out in the order collected, after the whole modules (they hold
the long cases; largest first, whatever ``--loadscopereorder`` says): the last units are single cases, so the
workers finish close together (runs of eight cases left one worker 1.3 s alone with test_worker_loop.py's last
eight).

``tests/test_xdist_units.py`` keeps ``WHOLE`` equal to the modules whose cases use a fixture of module (or
package, or class) scope, and checks that each runs on one worker.
"""
from __future__ import annotations

import collections

from xdist.scheduler import LoadScopeScheduling

WHOLE = frozenset({
    "test_ipc_buckets.py", "test_ipc_meta.py", "test_memory.py", "test_ranks_quick.py", "test_snapshot_files.py",
    "test_snapshot_huge.py", "test_stream_timing.py", "test_versions.py",
})


def module_of(nodeid: str) -> str:
    """The file part of a node id, as named from wherever pytest's rootdir is (a checkout's
    ``conformance/test_x.py``, an installed run's ``test_x.py`` or ``../site-packages/conformance/test_x.py``)."""
    return nodeid.split("::", 1)[0]


def is_whole(module: str) -> bool:
    return module.rsplit("/", 1)[-1] in WHOLE


class Units(LoadScopeScheduling):
    """pytest-xdist's scope scheduling with the suite's units (above) as its scopes."""

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return module if is_whole(module) else nodeid

    def schedule(self) -> None:
        if self.collection is None and self.collection_is_completed:
            # The queue's order, set before pytest-xdist fills it (an OrderedDict keeps a key where it was put):
            # whole modules first, largest first, then the other units in the order collected.
            collected = list(self.registered_collections.values())
            if collected and all(c == collected[0] for c in collected):
                size = collections.Counter(self._split_scope(nodeid) for nodeid in collected[0])
                for unit in sorted(size, key=lambda u: (0, -size[u]) if is_whole(u) else (1, 0)):
                    self.workqueue[unit] = {}
        super().schedule()
