"""How a conformance run under pytest-xdist hands out its cases (``conformance.xdist_units``): the modules whose
cases share a fixture wider than one case run whole on one worker, every other case goes out on its own, the
whole modules first; ``WHOLE`` is exactly the modules that need it (the suite collected once
against the reference; tests/scope_probe.py writes which shared fixtures each module's cases use); and a real
``-n 2`` run uses it, with the verdicts of a serial run.
"""
from __future__ import annotations

import collections
import re
import types

import pytest

from conformance import xdist_units
from conformance.xdist_units import WHOLE, Units
from tests import pytest_server
from tests.conftest import REPO, probe_collection


@pytest.fixture(scope="module")
def shared_fixtures(tmp_path_factory):
    """Per collected conformance module: the fixtures of class, module or package scope its cases use."""
    return probe_collection("tests.scope_probe", tmp_path_factory.mktemp("scopes") / "scopes.json")


def test_whole_modules_are_the_ones_whose_cases_share_a_fixture(shared_fixtures):
    need = {module for module, names in shared_fixtures.items() if names}
    assert need == set(WHOLE), (
        f"modules whose cases share a fixture but are handed out in pieces: {sorted(need - set(WHOLE))} "
        f"({ {m: shared_fixtures[m] for m in sorted(need - set(WHOLE))} }); listed whole although no fixture of "
        f"theirs is shared: {sorted(set(WHOLE) - need)}")


class _Node:
    """A pytest-xdist worker as the scheduler sees it: what it is sent goes to ``log`` (worker, case index)."""

    def __init__(self, name: str, log: list):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []
        self.log = log

    def send_runtest_some(self, indices) -> None:
        self.sent.extend(indices)
        self.log.extend((self.gateway.id, i) for i in indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _collection() -> list[str]:
    """Node ids in collection order: two whole modules (a small one first, then a large one) between three that
    are not."""
    out = [f"conformance/test_a.py::test_a[{i}]" for i in range(3)]
    out += [f"conformance/test_memory.py::test_m[{i}]" for i in range(3)]
    out += [f"conformance/test_b.py::test_b[{i}]" for i in range(2)]
    out += [f"conformance/test_ipc_buckets.py::test_i[{i}]" for i in range(9)]
    out += ["conformance/test_c.py::test_c[0]"]
    return out


def _units(nodes: int, order_by_size: bool = True) -> Units:
    config = types.SimpleNamespace(getvalue=lambda name: {"tx": [f"{nodes}*popen"]}[name],
                                   option=types.SimpleNamespace(loadscopereorder=order_by_size))
    return Units(config)


def _run(nodes: int, order_by_size: bool = True) -> tuple[dict[str, list[str]], list[str]]:
    """Schedule ``_collection()`` on ``nodes`` workers, each finishing its cases one at a time in turn, as a
    run does: (the cases each worker ran, the units in the order they were handed out)."""
    collection, log = _collection(), []
    sched = _units(nodes, order_by_size)
    workers = [_Node(f"gw{i}", log) for i in range(nodes)]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    done = dict.fromkeys(workers, 0)
    while not sched.tests_finished:
        busy = [w for w in workers if done[w] < len(w.sent)]
        assert busy, "the scheduler has cases left and sent none to any worker"
        for w in busy:
            sched.mark_test_complete(w, w.sent[done[w]])
            done[w] += 1
    unit = _units(nodes)._split_scope
    handed = list(dict.fromkeys(unit(collection[i]) for _, i in log))
    return {w.gateway.id: [collection[i] for i in w.sent] for w in workers}, handed


@pytest.mark.parametrize("order_by_size", [True, False], ids=["loadscopereorder", "no-loadscopereorder"])
@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_every_case_runs_once_and_a_whole_module_on_one_worker(nodes, order_by_size):
    ran, handed = _run(nodes, order_by_size)
    every = [nodeid for cases in ran.values() for nodeid in cases]
    assert sorted(every) == sorted(_collection()), f"cases run twice or never: {sorted(every)}"
    for module in ("conformance/test_memory.py", "conformance/test_ipc_buckets.py"):
        workers = {w for w, cases in ran.items() if any(c.startswith(module + "::") for c in cases)}
        assert len(workers) == 1, f"{module}: run on workers {sorted(workers)}; it must run whole on one"
    # whole modules first, largest first; then every other case on its own, in the order collected
    assert handed == ["conformance/test_ipc_buckets.py", "conformance/test_memory.py",
                      *[c for c in _collection() if c.startswith(("conformance/test_a.py", "conformance/test_b.py",
                                                                  "conformance/test_c.py"))]], handed
    if nodes > 1:
        assert all(ran.values()), f"a worker ran nothing: {ran}"


def test_a_module_is_whole_by_its_file_name_wherever_pytest_names_it_from():
    for nodeid in ("conformance/test_ranks_quick.py::t[x]", "test_ranks_quick.py::t", "../site-packages/conformance/"
                   "test_ranks_quick.py::t[a::b]"):
        assert xdist_units.is_whole(xdist_units.module_of(nodeid)), nodeid
    assert not xdist_units.is_whole(xdist_units.module_of("conformance/test_apply.py::t[test_memory.py]"))


def test_a_run_with_two_workers_keeps_whole_modules_together():
    """A real ``-n 2`` run of two whole modules and one that is not: each whole module's cases all on one worker,
    and the verdicts a serial run gives."""
    args = ["conformance/test_stream_timing.py", "conformance/test_memory.py", "conformance/test_counts.py",
            "--impl=reference", "-p", "no:cacheprovider", "-p", "no:randomly"]
    proc = pytest_server.run([*args, "-n", "2", "-v"], REPO, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    where: dict[str, set] = collections.defaultdict(set)
    for worker, module in re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] \w+ (conformance/test_\w+\.py)::", out, re.MULTILINE):
        where[module].add(worker)
    assert set(where) == {"conformance/test_stream_timing.py", "conformance/test_memory.py",
                          "conformance/test_counts.py"}, out[-3000:]
    for module in ("conformance/test_stream_timing.py", "conformance/test_memory.py"):
        assert len(where[module]) == 1, f"{module} ran on workers {sorted(where[module])}: it must run whole on one"
    serial = pytest_server.run([*args, "-q"], REPO, timeout=300)
    assert serial.returncode == 0 and _counts(serial.stdout) and _counts(out) == _counts(serial.stdout), (
        out[-1500:], serial.stdout[-1500:])


def _counts(out: str) -> dict[str, int]:
    """The outcome counts of a run's last summary line (passed, failed, skipped, ...; warnings aside)."""
    last = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)][-1:]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last[0]) if word != "warnings"} if last else {}
