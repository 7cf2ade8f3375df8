"""Multi-rank updates in the quick run: the MR rules (and the multi-rank half of STAGE-ATOMIC) on two or three
ranks forked from the test process and joined in one gloo group (``conformance.rank_group``), each rank
driving its own session of the implementation under test, as the ``multirank`` tier's ranks do under
``paddle.distributed.launch`` (test_multirank.py). Spec: SPEC.md § MR.

The test process plays the engine's API (it writes CLEARING and UPDATING into the job's status cell and reads
the cell's history every 0.2 ms, ``sim.ranks.CellWatch``) and every rank's trainer (``conformance.paths``
feeds: snapshot parts, ipc metas, one bucket trainer per rank), each rank's shard its own (``M.state`` seeded
by the rank). Every rank on physical GPU 4, 2 or 6 (``CUDA_VISIBLE_DEVICES=4,2,6``, ``FLAGS_selected_gpus`` its
rank: neither the rank nor the ordinal). A step writes the request and has every rank run one iteration of its
worker loop (``session.worker_iteration``); the first load, and the operations of the deadline rules, are the
session's own ``update()`` and ``clear()``.

Faults come only from inputs the suite owns: a rank's trainer sending a well-formed shard that lacks its last
tensor (``partial``: nothing but the rank's own check that every parameter arrived finds it), the last tensor
in the wrong dtype, the source gone mid-transfer; the runner the suite hands the loop (capability
``loop.runner``) raising in ``clear_requests()``, which the loop calls before it clears or updates: the engine
could not stop its requests, so the operation fails on that rank (clearing or loading under requests in flight
is FastDeploy #4286); a rank the test never asks to act (a peer that never comes), or kills (a peer that dies);
a rank held inside its clear (a profile function, as the tier's ``rank_worker.ClearHold``) or started late.

Timing is judged against the agreement's deadline the case configures (``agree_timeout_s``), never against a
wall-clock guess: a failure voted reaches every rank within 0.2 s of the operation's start, so with a deadline of
``PROMPT_S`` (10 s) "before the deadline" cannot be lost to a loaded machine, while a rank that waits for a
vote that never comes returns only at the deadline. Every wait is bounded from here (``RankGroup.wait``).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import sys
import time
import traceback

import numpy as np
import pytest

from conformance import check, harness, modes
from conformance.adapter import LoaderConfig, Observed, observe_paddle
from conformance.harness import Worker, open_session
from conformance.paths import Route
from conformance.rank_group import VISIBLE, GroupPool
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C
from weightsync.fixtures import tiny_transformer as TT
from sim.ranks import CellWatch

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)),
              ("norm.bias", "float16", (4,)))
LAST = sorted(p.name for p in SPEC.all_params)[-1]  # the tensor a faulty shard lacks or breaks
NEEDS = ("multirank", "status.cell")
# The agreement's deadline where a failure must reach every rank long before it: a voted failure reaches every
# rank within 0.2 s of the operation's start here (a loaded 2-core machine), 50 times less; a rank that waits for
# a vote that never comes returns only at the deadline.
PROMPT_S = 10.0
ABSENT_S = 1.0  # the agreement's deadline where a peer never comes: the cases wait it out once
# The agreement's deadline where no rank fails and nothing is judged against it (MR-OWN-SHARD): only a rank that
# never comes would wait it out. Gloo's own deadline, a fixed 30 s (Paddle's ProcessGroupGloo takes none), still
# ends a collective whose peer is later than that, whatever this says.
HEALTHY_S = 60.0
WORK_S = 10.0  # what a rank may spend on its own part of an operation (loading a tiny shard) before it waits
SLOW_S = 1.0  # a slow but healthy peer starts this late (with a deadline of PROMPT_S)
LATE_S = 0.2  # a rank started late, or held inside its clear, for the agreement rules
# The bucket path's wait for each message where its trainer is gone (STAGE-ATOMIC): the healthy rank's prompt trainer
# has all of it per message, as test_ipc_buckets.py's healthy updates have (HEALTHY_WAIT_S).
BUCKET_WAIT_S = 1.0
PATHS = ("parts", "ipc", "bucket")
NAMES = {C.NORMAL: "NORMAL", C.UPDATING: "UPDATING", C.CLEARING: "CLEARING", C.CLEARED: "CLEARED"}


# -- in each rank's process (forked before the case's trainers and threads exist) -------------------------
# What the suite's failing runner says: the engine naming every request it could not stop, several KiB (a loader
# that hands a failing rank's error to its peers must carry a long one too, cut if it must, never fail on it).
STUCK_REQUESTS = ", ".join(f"chatcmpl-{i:06d}" for i in range(256))


class _Runner:
    """The engine's GPU model runner as the suite hands it to the loop (capability ``loop.runner``): records
    each call; ``clear_requests()`` raises when the case has this rank's engine fail to stop its requests, naming
    each of the 256 requests still running (:data:`STUCK_REQUESTS`, about 4 KiB)."""

    def __init__(self, fail: bool):
        self.fail, self.calls = fail, []

    def clear_requests(self) -> None:
        self.calls.append("clear_requests")
        if self.fail:
            raise RuntimeError("the engine could not stop its in-flight requests (the suite's runner failed); "
                               f"still running: {STUCK_REQUESTS}")

    def shutdown_process_group(self, group="default") -> None:
        self.calls.append(f"shutdown:{group}")

    def restart_process_group(self, group="default") -> None:
        self.calls.append(f"restart:{group}")


def _caps(ctx) -> frozenset:
    return frozenset(ctx.adapter.capabilities)


def tiny(rank: int) -> TT.TinyTransformer:
    """Rank ``rank``'s model where a case needs post-load steps (``model="tiny"``): the tensor-parallel tiny
    transformer (transposed weights, fused buffers; float32 throughout, as every path of this module carries it)."""
    return TT.TinyTransformer(rank=rank, fp8=None)


def _observed_bytes(observed_: dict) -> dict:
    return {n: [o.dtype, list(o.shape), None if o.data is None else base64.b64encode(o.data).decode()]
            for n, o in observed_.items()}


def _state(ctx) -> dict:
    """What the rank's session holds now: status and version where claimed, every parameter's bytes."""
    session, caps = ctx.state["session"], _caps(ctx)
    out = {"status": None, "version": None, "params": {}}
    for key, cap, read in (("status", "status", "status"), ("version", "version", "version")):
        if cap in caps:
            try:
                out[key] = getattr(session, read)()
            except Exception as e:  # noqa: BLE001 (reported: a status that is not one fails whoever judges it)
                out[key] = f"unreadable ({type(e).__name__}: {e})"
    out["params"] = _observed_bytes(session.observe())
    model = ctx.state.get("tiny")
    if model is not None:  # the derived buffers, read from the rank's layers as the engine's kernels read them
        out["buffers"] = _observed_bytes(observe_paddle({b: TT.buffer(session.models, b) for b in model.buffer_specs()}))
    return out


def _act(ctx, call, **extra) -> dict:
    """Run ``call()``; what it returned or raised, then the rank's state (also after a failure)."""
    out = dict(extra)
    try:
        out["result"] = call()
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 (judged by the test)
        out["raised"] = f"{type(e).__name__}: {e}"
        out["types"] = [c.__name__ for c in type(e).__mro__]
    out["t_end"] = time.time()
    out["state"] = _state(ctx)
    return out


def a_open(ctx, strategy: str, model_dir: str, shared_dir: str, options: dict, visible: str, local_rank: int,
           model: str = "plain") -> dict:
    """Open the rank's session as the launcher starts a worker: global rank ``ctx.rank``, ``PADDLE_LOCAL_RANK`` its
    rank on its host, which is also its CUDA ordinal among ``visible`` (its host's ``CUDA_VISIBLE_DEVICES``);
    ``model`` "plain" (``SPEC``) or "tiny" (``tiny(rank)``, with its post-load steps)."""
    os.environ["PADDLE_LOCAL_RANK"] = str(local_rank)
    worker = Worker(ctx.rank, visible, str(local_rank))
    spec = ctx.state["tiny"] = tiny(ctx.rank) if model == "tiny" else None
    ctx.state["session"] = open_session(ctx.adapter, spec or SPEC, LoaderConfig(strategy, model_dir, shared_dir, options),
                                        worker)
    return {"gpu": worker.gpu_id}


def a_update(ctx) -> dict:
    def update():
        ctx.state["session"].update()  # (what a streamed path returns is not this module's business)

    return _act(ctx, update)


def a_clear(ctx) -> dict:
    return _act(ctx, lambda: ctx.state["session"].clear())


def _clear_hold(ctx, hold_s: float):
    """A profile function that sleeps ``hold_s`` at the first Python call after one of the rank's parameters was
    released (inside its clear: a rank that tells its peers before it releases anything is held after telling
    them), once; when the hold ended goes to ``ctx.state["held_until"]``. It writes and replaces nothing."""
    session = ctx.state["session"]
    params = [p for model in session.models for p in model.state_dict().values() if int(p.numel()) > 0]
    busy = [False]

    def probe(frame, event, arg):
        if event != "call" or busy[0] or "held_until" in ctx.state:
            return
        busy[0] = True
        try:
            if any(not p._is_initialized() for p in params):
                time.sleep(hold_s)
                ctx.state["held_until"] = time.time()
        finally:
            busy[0] = False

    return probe


def a_iterate(ctx, fail_runner: bool = False, hold_s: float = 0.0) -> dict:
    """One iteration of the rank's worker loop (non-blocking), with the suite's runner where claimed."""
    session, runs = ctx.state["session"], []
    runner = _Runner(fail_runner)
    kwargs = {"runner": runner} if "loop.runner" in _caps(ctx) else {}
    ctx.state.pop("held_until", None)

    def iterate():
        if hold_s:
            sys.setprofile(_clear_hold(ctx, hold_s))
        try:
            return session.worker_iteration(lambda: runs.append(1), block=False, **kwargs)
        finally:
            sys.setprofile(None)

    out = _act(ctx, iterate)
    out.update(runs=len(runs), runner=runner.calls, held_until=ctx.state.get("held_until"))
    return out


ACTIONS = {"open": a_open, "update": a_update, "clear": a_clear, "iterate": a_iterate}


# -- in the test process: the API, the trainers, and the judge -----------------------------------------------
def shard(rank: int, version: int, fault: str | None = None, model: str = "plain") -> dict[str, np.ndarray]:
    """What rank ``rank``'s trainer sends for ``version``: its own shard (seeded by the rank; the tiny model's
    tensor-parallel slice), with ``fault`` on its last tensor."""
    if model == "tiny":
        st = dict(sorted(TT.sent(tiny(rank), version, rank).items()))
    else:
        st = dict(sorted(M.state(SPEC, seed=rank, version=version).items()))
    last = list(st)[-1]
    if fault == "partial":
        del st[last]
    elif fault == "bad-dtype":
        st[last] = st[last].astype(np.float64)
    return st


def served(model: str, rank: int, sent: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What rank ``rank``'s parameters hold once ``sent`` committed (the tiny model's transposes applied)."""
    return TT.served_params(tiny(rank), sent) if model == "tiny" else sent


def observed(state: dict) -> dict[str, Observed]:
    return {n: Observed(d, tuple(s), None if b is None else base64.b64decode(b)) for n, (d, s, b) in state["params"].items()}


def sha(observed_: dict[str, Observed]) -> dict[str, str | None]:
    return {n: None if o.data is None else hashlib.sha256(o.data).hexdigest()[:12] for n, o in observed_.items()}


def timing(replies: dict) -> str:
    """When each rank started its action (from the first to start) and how long it took."""
    first = min(reply.get("t0", 0.0) for reply in replies.values())
    return "; ".join(f"rank {r} started at +{reply.get('t0', first) - first:.2f}s, took {reply.get('seconds', 0.0):.2f}s"
                     for r, reply in sorted(replies.items()))


def names(rank: int, text: str | None) -> bool:
    return bool(text) and re.search(rf"\brank {rank}\b", text) is not None


class Job:
    """One case's job: ``ranks`` forked ranks on ``path`` against the cell, their trainers, the cell's history."""

    def __init__(self, pool: GroupPool, loader, cell: C.Cell, path: str, ranks: int, *, deadline_s: float,
                 staged: bool = False, options: dict | None = None, reusable: bool = True, hosts: int = 1,
                 model: str = "plain"):
        self.pool, self.loader, self.cell, self.path, self.n = pool, loader, cell, path, ranks
        self.model = model
        self.deadline_s = deadline_s
        self.bound_s = deadline_s + 25.0  # the test's own bound on one step (a healthy one takes about a second)
        self.caps = frozenset(loader.adapter.capabilities)
        self.reusable = reusable  # False: the case leaves a collective unanswered, its group is killed at the end
        self.group = self.route = self.watch = None
        self.group = pool.take(ranks, fresh=not reusable)  # (its ranks forked before any of this case's trainers)
        # One host: rank r is local rank r, on physical GPU VISIBLE[r]. One rank per host (``hosts`` == ranks): each
        # is local rank 0 on its host's GPU VISIBLE[0], the same physical id on every host.
        self.workers = {r: Worker(r, ",".join(VISIBLE[:ranks]), str(r)) if hosts == 1 else Worker(r, VISIBLE[0], "0")
                        for r in range(ranks)}
        self.route = Route(loader, path, worker_of=self.workers.__getitem__)
        self.feed = self.route.feed
        self.watch = CellWatch(cell.name)
        self.sent: dict[int, dict[int, dict]] = {}  # version -> rank -> the tensors its trainer sent
        self.committed: int | None = None  # the version every rank committed last
        gpus = ",".join(str(w.gpu_id) for w in self.workers.values())
        self.where = f"{path}, {ranks} ranks" + (f" on {hosts} hosts" if hosts > 1 else "") + f" (physical GPUs {gpus})"
        extra = {"staged": True} if staged else {}
        per_rank = {r: {"strategy": self.route.path.strategy, "model_dir": loader.model_dir,
                        "shared_dir": loader.shared_dir, "visible": self.workers[r].visible,
                        "local_rank": int(self.workers[r].selected), "model": model,
                        "options": {**self.feed.options(r), "status_cell": cell.name, "agree_timeout_s": deadline_s,
                                    **extra, **(options or {})}}
                    for r in range(ranks)}
        replies = self.group.run("open", per_rank=per_rank, timeout_s=self.bound_s)
        for r, reply in replies.items():
            if not reply["ok"]:
                raise AssertionError(f"{self.where}: rank {r}'s open() failed: {reply['error']}\n{reply.get('traceback', '')}")

    def close(self) -> None:
        """Hand the group back (or kill it), stop watching the cell, close the trainers; a second call does nothing."""
        group, watch, route = self.group, self.watch, self.route
        self.group = self.watch = self.route = None
        try:
            if group is not None:
                self.pool.give(group, self.reusable)  # kept only if every rank is in step (GroupPool)
        finally:
            for part in (watch, route):
                if part is not None:
                    part.close()

    # -- the trainers ---------------------------------------------------------------------------------
    def publish(self, version: int, faults: dict[int, str] | None = None, skip=(), *, version_file: bool = True) -> None:
        """Every rank's trainer publishes ``version`` (rank r's with ``faults[r]``); ranks in ``skip`` will not
        ask (a bucket trainer then serves nothing). ``version.yaml`` beside the snapshot and the metas (none with
        ``version_file`` False: the last one removed)."""
        faults = faults or {}
        self.sent[version] = {}
        for r in range(self.n):
            st = shard(r, version, faults.get(r), self.model)
            self.sent[version][r] = st
            if r in skip and self.path == "bucket":
                continue
            layout = None
            if faults.get(r) == "gone" and self.path == "bucket":
                def layout(update):  # the trainer dies before its last bucket
                    update.fault = ("die", len(update.buckets) - 1)
            self.feed.publish(r, st, version, layout)
            if faults.get(r) == "gone" and self.path in ("parts", "single", "legacy", "shared"):  # the last file cut in half
                last = self.feed.written[r][-1]
                os.truncate(last, os.path.getsize(last) // 2)
            elif faults.get(r) == "gone" and self.path == "ipc":
                self.feed.exports[r].free(list(st)[-1])
        for directory in (self.loader.model_dir, self.loader.shared_dir):
            if version_file:
                C.write_version(directory, version)
            elif os.path.exists(os.path.join(directory, "version.yaml")):
                os.remove(os.path.join(directory, "version.yaml"))

    def history(self, since: float) -> list[str]:
        """The cell's values from ``since`` on (its value then first), its current value noted first."""
        self.watch.note()
        return [NAMES.get(v, str(v)) for _, v in self.watch.since(since)]

    def settle(self, ranks=None) -> None:
        for r in range(self.n) if ranks is None else ranks:
            try:
                self.feed.settle(r)
            except Exception:  # noqa: BLE001 (the update's own failure is what the case judges)
                pass

    # -- the ranks ------------------------------------------------------------------------------------
    def load(self, version: int = 1) -> dict[int, dict]:
        """The first load (each rank's own ``update()``, at once), then every rank must hold its shard."""
        self.publish(version)
        replies = self.group.run("update", timeout_s=self.bound_s)
        self.settle()
        self.healthy(replies, f"the first load of version {version}", version, None)
        self.committed = version
        return replies

    def step(self, request: int, *, fail: set = frozenset(), hold: int | None = None, late: int | None = None,
             late_s: float = LATE_S, ranks=None) -> "Step":
        """The API writes ``request``; every rank (of ``ranks``) runs one iteration of its loop; ranks in ``fail``
        with a runner that fails, rank ``hold`` held inside its clear, rank ``late`` started ``late_s`` after the
        others."""
        ranks = list(range(self.n) if ranks is None else ranks)
        t_request = time.time()
        self.watch.write(request)
        t_late = None
        for r in ranks:
            if r != late:
                self.group.start(r, "iterate", fail_runner=r in fail, hold_s=LATE_S if r == hold else 0.0)
        if late is not None:
            time.sleep(late_s)
            t_late = time.time()
            self.group.start(late, "iterate", fail_runner=late in fail, hold_s=0.0)
        replies = self.group.wait(ranks, self.bound_s)
        if request == C.UPDATING:
            self.settle(ranks)
        time.sleep(0.02)  # a late write to the cell (or one that comes and goes) still shows in its history
        self.watch.note()  # (and the cell's last value, whether or not the watching thread has read it yet)
        return Step(request, replies, self.watch.since(t_request), t_request, t_late)

    def direct(self, op: str, ranks, late: int | None = None, late_s: float = 0.0) -> dict[int, dict]:
        """Each of ``ranks`` calls its session's own ``op`` ("clear" or "update") at once (``late``: that rank
        ``late_s`` after the others)."""
        for r in ranks:
            if r != late:
                self.group.start(r, op)
        if late is not None:
            time.sleep(late_s)
            self.group.start(late, op)
        replies = self.group.wait(ranks, self.bound_s)
        if op == "update":
            self.settle(ranks)
        return replies

    # -- judging ----------------------------------------------------------------------------------------
    def value(self, reply: dict) -> dict:
        """An action's report; a rank that did not answer, died or broke the harness fails the case naming it."""
        if not reply["ok"]:
            raise AssertionError(f"{self.where}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply["value"]

    def healthy(self, replies: dict, where: str, version: int | None, result: str | None, status: bool = True) -> None:
        """Every rank returned (``result`` from its loop, where given) and holds its own shard of ``version``
        (bit for bit, not another rank's), reporting that version (and, with ``status``, NORMAL); with ``version``
        None (a clear): nothing (and CLEARED)."""
        check.equal(sorted(replies), list(range(self.n)), f"{self.where}: {where}: the ranks that answered")
        for r, reply in sorted(replies.items()):
            at = f"{self.where}: {where}, rank {r} (physical GPU {self.workers[r].gpu_id})"
            got = self.value(reply)
            check.that(got["raised"] is None, f"{at}: raised {got['raised']} ({timing(replies)})")
            if result is not None:
                check.equal(got["result"], result, f"{at}: what its worker loop's iteration returned")
            obs = observed(got["state"])
            if version is None:
                held = sorted(n for n, o in obs.items() if o.data)
                check.that(not held, f"{at}: parameters it still holds after its clear: {held}")
                if status and "status" in self.caps:
                    check.equal(got["state"]["status"], "CLEARED", f"{at}: status()")
                continue
            check.params_equal(obs, served(self.model, r, self.sent[version][r]), f"{at}: its own trainer's shard of version {version}")
            others = [o for o in range(self.n) if o != r]
            check.that(all(sha(obs) != sha(observed_of(served(self.model, o, self.sent[version][o]))) for o in others),
                       f"{at}: it holds another rank's shard")
            if status and "status" in self.caps:
                check.equal(got["state"]["status"], "NORMAL", f"{at}: status()")
            if "version" in self.caps:
                check.equal(got["state"]["version"], version, f"{at}: version()")

    def failed_everywhere(self, replies: dict, op: str, failing: set, where: str, *, within_s: float | None) -> None:
        """Every rank raised; each names every failing rank but itself; none reports the operation done (status
        NORMAL after an update, CLEARED after a clear) or a new version; each returned ``within_s`` of the request."""
        check.equal(sorted(replies), list(range(self.n)), f"{self.where}: {where}: the ranks that answered")
        done = {"update": "NORMAL", "clear": "CLEARED"}[op]
        for r, reply in sorted(replies.items()):
            at = f"{self.where}: {where}, rank {r}"
            got = self.value(reply)
            check.that(got["raised"] is not None, f"{at}: its {op} returned {got.get('result')!r} although rank(s) "
                       f"{sorted(failing)} failed it (status {got['state']['status']}); it must raise")
            named = [f for f in sorted(failing - {r}) if not names(f, got["raised"])]
            check.that(not named, f"{at}: its error does not name failing rank(s) {named}: {got['raised']!r}")
            if within_s is not None:
                check.that(reply["seconds"] < within_s,
                           f"{at}: raised {reply['seconds']:.1f}s after its {op} began, not before the agreement's "
                           f"{self.deadline_s:g}s deadline: it waited for a vote the failing rank(s) never cast")
            if "status" in self.caps:
                check.that(got["state"]["status"] != done, f"{at}: status {got['state']['status']} after the failed {op}")
            if "version" in self.caps and self.committed is not None:
                check.equal(got["state"]["version"], self.committed, f"{at}: version() after the failed {op}")


def observed_of(st: dict[str, np.ndarray]) -> dict[str, Observed]:
    return {n: Observed(a.dtype.name, tuple(a.shape), np.ascontiguousarray(a).tobytes()) for n, a in st.items()}


class Step:
    def __init__(self, request: int, replies: dict, history: list, t_request: float, t_late: float | None):
        self.request, self.replies, self.history, self.t_request, self.t_late = request, replies, history, t_request, t_late

    def cell(self) -> list[str]:
        """What the cell read from the request on (the request first), each change once."""
        out: list[str] = []
        for _, v in self.history[1:]:
            if not out or out[-1] != NAMES.get(v, str(v)):
                out.append(NAMES.get(v, str(v)))
        return out

    def first(self, value: int) -> float | None:
        """When the cell first read ``value`` after the request."""
        return next((t for t, v in self.history[1:] if v == value), None)


@pytest.fixture
def cell():
    """The job's status cell (``fixtures.status_cell``), NORMAL, as the engine leaves it once its workers started."""
    with C.Cell(C.NORMAL) as c:
        yield c


@pytest.fixture(scope="module")
def rank_groups(request):
    """This module's gloo groups of forked ranks (``rank_group.GroupPool``): a case takes one of its size and
    hands it back; a group is kept for the next case only if every rank answered every command and the ranks
    are in step, else killed. Every rank killed at the module's end."""
    from conformance.plugin import _adapter

    pool = GroupPool(ACTIONS, _adapter(request.config))
    yield pool
    pool.close()


@pytest.fixture
def job(rank_groups, loader, cell):
    """``job(path, ranks, deadline_s=..., staged=..., reusable=...)``: a :class:`Job` (a group of forked ranks, one
    session each, their trainers); at teardown its sessions are closed and its group handed back (or killed),
    every trainer closed."""
    made = []

    def make(path, ranks=2, **kw):
        j = Job.__new__(Job)
        made.append(j)
        j.__init__(rank_groups, loader, cell, path, ranks, **kw)  # (closed at teardown even if opening a rank failed)
        return j

    yield make
    for j in made:
        j.close()


def _requires(*caps):
    return pytest.mark.requires(*NEEDS, *caps)


def _path_caps(path):
    return modes.CAPABILITY_OF_PATH[path]


def _failing(combo) -> tuple[int, set[int]]:
    """(ranks, failing ranks) of a combination: one failing rank of two (rank 0 or the follower), or two of three
    (rank 0 and a follower, or both followers), so that a healthy rank must name both."""
    several = combo.get("failing") == "several"
    with_rank0 = combo.get("rank") == "rank0"
    if several:
        return 3, ({0, 1} if with_rank0 else {1, 2})
    return 2, ({0} if with_rank0 else {1})


# -- MR-OWN-SHARD ---------------------------------------------------------------------------------------------
@pytest.mark.rule("MR-OWN-SHARD")
@pytest.mark.parametrize("combo", modes.params("MR-OWN-SHARD", requires=lambda c: [*NEEDS, _path_caps(c["path"])]))
def test_every_rank_loads_its_own_shard(job, combo):
    """Every rank holds its own trainer's shard after the first load and each update after it; with ``hosts``
    two, each rank is alone on its host (local rank 0, the same physical GPU id as the other), every rank's
    snapshot files in one directory: a rank's identity is its global rank, never its local one."""
    path = combo["path"]
    j = job(path, deadline_s=HEALTHY_S, hosts=2 if combo["hosts"] == "two" else 1)
    j.load(1)
    for version in (2, 3):
        step = j.step(C.CLEARING)
        j.healthy(step.replies, f"the clear before version {version}", None, "cleared")
        j.publish(version)
        step = j.step(C.UPDATING)
        j.healthy(step.replies, f"update to version {version}", version, "updated")
        j.committed = version


# -- MR-AGREE-BEFORE-NORMAL ---------------------------------------------------------------------------------------
def _agree_requires(combo):
    return [*NEEDS, _path_caps(combo["path"]), *(["staged"] if combo["staged"] == "staged" else [])]


@pytest.mark.rule("MR-AGREE-BEFORE-NORMAL")
@pytest.mark.parametrize("combo", modes.params("MR-AGREE-BEFORE-NORMAL", requires=_agree_requires))
def test_normal_and_cleared_only_after_every_rank(job, combo):
    """Rank ``slow`` (rank 0, which writes the cell, or the follower) is held inside its clear, then starts its
    update late; then the other rank's shard lacks its last tensor. The cell reads CLEARED only after the held
    rank was let go, NORMAL only after the late rank began, and never NORMAL during the failed update."""
    slow = 0 if combo["rank"] == "rank0" else 1
    j = job(combo["path"], deadline_s=PROMPT_S, staged=combo["staged"] == "staged")
    j.load(1)
    step = j.step(C.CLEARING, hold=slow)
    where = f"the clear before version 2, rank {slow} held {LATE_S:g}s inside it"
    j.healthy(step.replies, where, None, "cleared")
    held = j.value(step.replies[slow])["held_until"]
    check.that(held is not None, f"{j.where}: {where}: rank {slow} was never held: none of its parameters was "
               "released during the iteration that cleared")
    t_cleared = step.first(C.CLEARED)
    check.that(t_cleared is not None and t_cleared >= held,
               f"{j.where}: {where}: the cell ({step.cell()}) read CLEARED "
               + (f"{held - t_cleared:.3f}s before rank {slow} was let go" if t_cleared is not None else "never")
               + ": CLEARED must come once every rank has cleared, and only then")
    j.publish(2)
    step = j.step(C.UPDATING, late=slow)
    where = f"update to version 2, rank {slow} starting {LATE_S:g}s late"
    j.healthy(step.replies, where, 2, "updated")
    j.committed = 2
    t_normal = step.first(C.NORMAL)
    check.that(t_normal is not None and t_normal >= step.t_late,
               f"{j.where}: {where}: the cell ({step.cell()}) read NORMAL "
               + (f"{step.t_late - t_normal:.3f}s before rank {slow} even began its update" if t_normal is not None else
                  "never after every rank updated"))
    step = j.step(C.CLEARING)
    j.healthy(step.replies, "the clear before version 3", None, "cleared")
    broken = 1 - slow
    j.publish(3, {broken: "partial"})
    step = j.step(C.UPDATING)
    check.that("NORMAL" not in step.cell(), f"{j.where}: update to version 3 whose rank {broken} shard lacks {LAST}: "
               f"the cell read {step.cell()}; it must never read NORMAL during an update a rank fails")
    check.that(all(j.value(r)["raised"] for r in step.replies.values()),
               f"{j.where}: update to version 3 with rank {broken}'s shard lacking {LAST}: "
               f"{[(r, j.value(x)['raised']) for r, x in step.replies.items()]}")


# -- MR-FAILURE-EVERY-RANK ---------------------------------------------------------------------------------------
def _failure_requires(combo):
    return [*NEEDS, _path_caps(combo["path"]), *(["loop.runner"] if combo["fault"] == "runner" else [])]


def _recover(j: Job, version: int, where: str) -> None:
    """After a failure: the API's clear, then an update of ``version`` from healthy trainers, on every rank."""
    step = j.step(C.CLEARING)
    j.healthy(step.replies, f"{where}: the recovery's clear", None, "cleared")
    check.equal(step.cell()[-1:], ["CLEARED"], f"{j.where}: {where}: the cell after the recovery's clear")
    j.publish(version)
    step = j.step(C.UPDATING)
    j.healthy(step.replies, f"{where}: the recovery's update to version {version}", version, "updated")
    check.equal(step.cell()[-1:], ["NORMAL"], f"{j.where}: {where}: the cell after the recovery")
    j.committed = version


def _failing_update(j: Job, version: int, fault: str, failing: set) -> Step:
    j.publish(version, {r: fault for r in failing}, skip=failing if fault == "runner" else ())
    return j.step(C.UPDATING, fail=failing if fault == "runner" else frozenset())


@pytest.mark.rule("MR-FAILURE-EVERY-RANK")
@pytest.mark.parametrize("combo", modes.params("MR-FAILURE-EVERY-RANK", requires=_failure_requires))
def test_update_failure_reaches_every_rank(job, combo):
    n, failing = _failing(combo)
    fault = combo["fault"]
    j = job(combo["path"], n, deadline_s=PROMPT_S)
    j.load(1)
    step = j.step(C.CLEARING)
    j.healthy(step.replies, "the clear before version 2", None, "cleared")
    version = 2
    if combo["call"] == "second":  # a failure right before, on the other ranks (rank 0's side swapped)
        first = set(range(n)) - failing or {0}
        step = _failing_update(j, version, fault, first)
        j.failed_everywhere(step.replies, "update", first, f"update to version {version} with {fault} on rank(s) "
                            f"{sorted(first)}", within_s=PROMPT_S)
        step = j.step(C.CLEARING)
        j.healthy(step.replies, "the clear after the first failure", None, "cleared")
        version += 1
    where = f"update to version {version} with {fault} on rank(s) {sorted(failing)} ({combo['call']} failure in a row)"
    step = _failing_update(j, version, fault, failing)
    j.failed_everywhere(step.replies, "update", failing, where, within_s=PROMPT_S)
    check.that("NORMAL" not in step.cell(), f"{j.where}: {where}: the cell read {step.cell()} after the UPDATING")
    _recover(j, version + 1, where)


# -- MR-FAILED-CLEAR ---------------------------------------------------------------------------------------------------
@pytest.mark.rule("MR-FAILED-CLEAR")
@pytest.mark.parametrize("combo", modes.params("MR-FAILED-CLEAR", requires=lambda c: [*NEEDS, "loop.runner", "snapshot.parts"]))
def test_failed_clear_reaches_every_rank(job, combo):
    n, failing = _failing(combo)
    j = job("parts", n, deadline_s=PROMPT_S)
    j.load(1)
    if combo["call"] == "second":  # a failed clear right before, on the other ranks
        first = set(range(n)) - failing or {0}
        step = j.step(C.CLEARING, fail=first)
        j.failed_everywhere(step.replies, "clear", first, f"the clear with rank(s) {sorted(first)}'s runner failing",
                            within_s=PROMPT_S)
    where = f"the clear with rank(s) {sorted(failing)}'s runner failing ({combo['call']} failure in a row)"
    step = j.step(C.CLEARING, fail=failing)
    j.failed_everywhere(step.replies, "clear", failing, where, within_s=PROMPT_S)
    check.that("CLEARED" not in step.cell(), f"{j.where}: {where}: the cell read {step.cell()} after the CLEARING")
    _recover(j, 2, where)


# -- MR-DEADLINE ---------------------------------------------------------------------------------------------------
def _cleared_directly(j: Job, version: int) -> None:
    """Every rank's own ``clear()``, then the trainers publish ``version``."""
    replies = j.direct("clear", range(j.n))
    j.healthy(replies, f"the clear before version {version}", None, None, status=False)  # (status: MR-AGREE-BEFORE-NORMAL)
    j.publish(version)


# The operations MR-DEADLINE and MR-BROKEN-GROUP judge wait: a peer that never comes is waited out to the
# agreement's deadline, a slow one for SLOW_S. They run together, once per module (``waited``): each job is set
# up alone (its ranks, the first load, the clear before an update), then every operation starts at once, so the
# module waits out one deadline, not one per case. A case judges its operation's record: the replies and the cell's
# history while it ran, read before any later operation on the job, so its verdict is the same whatever ran before.
DEADLINE_CASES = modes.params("MR-DEADLINE", requires=lambda c: [*NEEDS, "snapshot.parts"])
BROKEN_CASES = modes.params("MR-BROKEN-GROUP", requires=lambda c: [*NEEDS, "snapshot.parts"])


def _waiting(combo) -> tuple[str, int, str] | None:
    """The waiting operation a case judges: (the operation, the rank that never calls it or calls it late,
    "absent" or "slow"); None where nothing waits (a peer that died before the operation)."""
    if combo.get("cause") == "dead":
        return None
    return combo["op"], 0 if combo["rank"] == "rank0" else 1, combo.get("peer", "absent")


class Waited:
    """One waiting operation of the module's batch: its job, every reply, the cell's history from its start until
    every operation of the batch returned, the adapter calls its ranks made; ``error``: what failed while its job
    was set up (the cases judging it fail with it)."""

    def __init__(self, key: tuple[str, int, str]):
        self.op, self.other, self.peer = key
        self.job: Job | None = None
        self.replies: dict[int, dict] = {}
        self.history: list = []
        self.t0 = 0.0  # when the batch started its operation
        self.calls = 0
        self.error: str | None = None

    @property
    def absent(self) -> bool:
        return self.peer == "absent"

    def ranks(self) -> list[int]:
        """The ranks that call the operation: the survivor alone where the peer never comes."""
        return [1 - self.other] if self.absent else [0, 1]

    def judged(self) -> Job:
        """The job, for a case that judges this record (its ranks' adapter calls counted for it)."""
        if self.error is not None:
            raise AssertionError(self.error)
        harness.credit(self.calls)
        return self.job


def _selected_waits(session) -> list[tuple[str, int, str]]:
    """The waiting operations of this module's selected cases."""
    here = sys.modules[__name__]
    names = (test_no_rank_waits_past_its_deadline_for_a_peer.__name__,
             test_a_broken_group_fails_the_next_operation_at_once.__name__)
    keys = {_waiting(item.callspec.params["combo"]) for item in session.items
            if getattr(item, "module", None) is here and getattr(item, "originalname", None) in names}
    return sorted(k for k in keys if k is not None)


@pytest.fixture(scope="module")
def waited(request, rank_groups, tmp_path_factory):
    """``{(op, other, peer): Waited}``: every waiting operation of the module's selected MR-DEADLINE and
    MR-BROKEN-GROUP cases, run together (a slow peer's rank started ``SLOW_S`` after the others); each job on its
    own cell, model directory and ranks. The jobs of a peer that never came stay open for the cases that go on
    with them (MR-BROKEN-GROUP's next operations); every job is closed at the module's end."""
    from conformance.plugin import ADAPTER_KEY

    adapter = request.config.stash[ADAPTER_KEY]
    out = {key: Waited(key) for key in _selected_waits(request.session)}
    if not {*NEEDS, "snapshot.parts"} <= set(adapter.capabilities):
        yield {}  # every case is not_applicable: its test never asks
        return
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        for w in out.values():
            try:
                cell = stack.enter_context(C.Cell(C.NORMAL))
                loader = harness.Loader(adapter, tmp_path_factory.mktemp("waited"), mp)
                stack.callback(loader.close_all)
                j = Job.__new__(Job)
                j.group = j.route = j.watch = None
                stack.callback(j.close)
                j.__init__(rank_groups, loader, cell, "parts", 2, deadline_s=ABSENT_S if w.absent else PROMPT_S,
                           reusable=not w.absent)
                j.load(1)
                if w.op == "update":
                    _cleared_directly(j, 2)
                w.job = j
            except Exception as e:  # noqa: BLE001 (the cases judging this operation report it)
                w.error = (f"parts, 2 ranks: setting up the {w.op} with rank {w.other} {w.peer} failed: "
                           f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        ready = [w for w in out.values() if w.error is None]
        for w in ready:
            w.t0 = time.time()
            for r in w.ranks():
                if not (w.peer == "slow" and r == w.other):
                    w.job.group.start(r, w.op)
        if any(w.peer == "slow" for w in ready):
            time.sleep(SLOW_S)
            for w in ready:
                if w.peer == "slow":
                    w.job.group.start(w.other, w.op)
        for w in ready:
            before = harness.adapter_calls()
            w.replies = w.job.group.wait(w.ranks(), w.job.bound_s)
            w.calls = harness.adapter_calls() - before
            if w.op == "update":
                w.job.settle(w.ranks())
        time.sleep(0.02)  # a late write to the cell still shows in its history
        for w in ready:
            w.history = w.job.history(w.t0)
            if not w.absent:
                w.job.close()  # (done: its group goes back to the pool, its cell is no longer watched)
        yield out


@pytest.mark.rule("MR-DEADLINE")
@pytest.mark.parametrize("combo", DEADLINE_CASES)
def test_no_rank_waits_past_its_deadline_for_a_peer(waited, combo):
    """Rank ``other`` never calls the operation (``absent``: the others give up at the agreement's deadline and
    report the failure, nothing done), or calls it ``SLOW_S`` late (``slow``: every rank succeeds). Judged from
    the module's batch of waiting operations (``waited``)."""
    w = waited[_waiting(combo)]
    j = w.judged()
    op, other = w.op, w.other
    if w.absent:
        survivor = 1 - other
        where = f"{op} with rank {other} never calling it (the agreement's deadline {ABSENT_S:g}s)"
        got = j.value(w.replies[survivor])
        check.that(got["raised"] is not None, f"{j.where}: {where}: rank {survivor}'s {op} returned "
                   f"{got.get('result')!r} (status {got['state']['status']}) without rank {other}")
        check.that(w.replies[survivor]["seconds"] < ABSENT_S + WORK_S,
                   f"{j.where}: {where}: rank {survivor} gave up after {w.replies[survivor]['seconds']:.1f}s, past "
                   f"the {ABSENT_S:g}s deadline and the {WORK_S:g}s its own work may take")
        done = {"update": "NORMAL", "clear": "CLEARED"}[op]
        if "status" in j.caps:
            check.that(got["state"]["status"] != done, f"{j.where}: {where}: rank {survivor} status {got['state']['status']}")
        check.that(done not in w.history[1:], f"{j.where}: {where}: the cell read {w.history}")
        return
    where = f"{op} with rank {other} calling it {SLOW_S:g}s after the other (the agreement's deadline {PROMPT_S:g}s)"
    j.healthy(w.replies, where, 2 if op == "update" else None, None, status=False)  # (the status: MR-AGREE-BEFORE-NORMAL)


# -- MR-BROKEN-GROUP ---------------------------------------------------------------------------------------------
@pytest.mark.rule("MR-BROKEN-GROUP")
@pytest.mark.parametrize("combo", BROKEN_CASES)
def test_a_broken_group_fails_the_next_operation_at_once(request, job, combo):
    """The group breaks in ``op``: rank ``other`` never calls it (the agreement's deadline passes: the module's
    batch of waiting operations, ``waited``) or died before it. The surviving rank's next operations (its own
    ``clear()``, then its loop's iteration on the API's CLEARING) each fail at once, well within the deadline,
    naming the group, and report nothing done."""
    op, other = combo["op"], 0 if combo["rank"] == "rank0" else 1
    survivor = 1 - other
    if combo["cause"] == "dead":
        j = job("parts", deadline_s=ABSENT_S, reusable=False)
        j.load(1)
        if op == "update":
            _cleared_directly(j, 2)
        j.group.kill(other)
        t_op = time.time()
        replies = j.direct(op, [survivor])
        history = j.history(t_op)
    else:
        w = request.getfixturevalue("waited")[_waiting(combo)]
        j, replies, history = w.judged(), w.replies, w.history
        request.addfinalizer(j.close)  # (this case is the last to use it)
    cause = "never called it" if combo["cause"] == "deadline" else "died"
    where = f"after {op} broke the group (rank {other} {cause}; the agreement's deadline {ABSENT_S:g}s)"
    check.that(j.value(replies[survivor])["raised"] is not None,
               f"{j.where}: {op} on rank {survivor} returned although rank {other} {cause}")
    done = {"update": "NORMAL", "clear": "CLEARED"}[op]
    check.that(done not in history[1:], f"{j.where}: the cell read {done} after {op} although the group broke: {history}")
    steps = []
    for what, run in (("its clear()", lambda: j.direct("clear", [survivor])),
                      ("its loop's iteration on CLEARING", lambda: steps.append(j.step(C.CLEARING, ranks=[survivor]))
                       or steps[-1].replies)):
        reply = run()[survivor]
        got = j.value(reply)
        at = f"{j.where}: rank {survivor}, {what} {where}"
        check.that(got["raised"] is not None, f"{at}: returned {got.get('result')!r}; it must fail")
        check.that(reply["seconds"] < 0.9 * ABSENT_S,
                   f"{at}: failed after {reply['seconds']:.2f}s: it waited again on a group in an unknown state "
                   f"(it must fail at once, short of the {ABSENT_S:g}s deadline)")
        check.that(re.search(r"\bgroup\b", got["raised"] or "", re.IGNORECASE) is not None,
                   f"{at}: the error does not name the unusable (process) group: {got['raised']!r}")
        if "status" in j.caps:
            check.that(got["state"]["status"] not in ("CLEARED", "NORMAL"),
                       f"{at}: status {got['state']['status']} on a broken group")
    check.that("CLEARED" not in steps[0].cell(), f"{j.where}: the cell read {steps[0].cell()} after the API's CLEARING "
               f"{where}")


# -- STAGE-ATOMIC, the multi-rank half ------------------------------------------------------------------------------
STAGE_CASES = [("parts", "missing", 1), ("ipc", "bad-dtype", 0), ("bucket", "gone", 1),
               ("single", "gone", 0), ("legacy", "bad-dtype", 1), ("shared", "missing", 0)]


@pytest.mark.rule("STAGE-ATOMIC")
@pytest.mark.parametrize("path,fault,failing", [
    pytest.param(p, f, r, marks=[_requires(_path_caps(p), "staged"), pytest.mark.modes(fault=f, ranks="two")],
                 id=f"{p}:{f}:rank{r}") for p, f, r in STAGE_CASES])
def test_failure_on_one_rank_changes_no_rank(job, path, fault, failing):
    """Staged, 2 ranks: rank ``failing``'s update fails (its shard lacking the last tensor, the last tensor's dtype
    wrong, its source gone before the end); every rank, the healthy one too, keeps every parameter exactly as it
    was (cleared); the next clear and update load every rank bit for bit."""
    j = job(path, deadline_s=PROMPT_S, staged=True, options={"timeout_s": BUCKET_WAIT_S} if path == "bucket" else None)
    j.load(1)
    step = j.step(C.CLEARING)
    j.healthy(step.replies, "the clear before version 2", None, "cleared")
    before = {r: observed(j.value(x)["state"]) for r, x in step.replies.items()}
    j.publish(2, {failing: "partial" if fault == "missing" else fault})
    step = j.step(C.UPDATING)
    where = f"staged update to version 2 with {fault} on rank {failing}"
    for r, reply in sorted(step.replies.items()):
        got = j.value(reply)
        at = f"{j.where}: {where}, rank {r}"
        check.that(got["raised"] is not None, f"{at}: returned although rank {failing} failed")
        check.unchanged(before[r], observed(got["state"]), at)
    if not (path == "bucket" and fault == "gone"):  # the dead trainer's endpoint is gone: recovery is BKT-RECOVERY's
        _recover(j, 3, where)


# -- the window between a rank's own check and the ranks' vote ----------------------------------------------------
# A rank whose own part of an update passed every check waits for its peers' votes, and a peer's failure reaches it
# there. By then nothing of the update may have reached what the rank serves or reports: no post-load step run
# (MODEL-TRANSFORM-FAILED), no staged tensor adopted (STAGE-ATOMIC), no version kept for a later update to stamp
# (VER-FAILED-KEEPS). The ranks call their sessions' own clear() and update() here, outside the worker loop, so that
# what the failed update left is seen before anything releases it (the loop releases every parameter after a
# failed update, STATUS-FAILED-NOT-NORMAL, which would hide an adoption).
def _peer_fails(j: Job, failing: int, version: int = 2) -> dict:
    """Version 1 loaded and cleared on every rank; rank ``failing``'s shard of ``version`` lacks its last tensor and
    every rank calls update(): each must raise naming it (its own check found nothing wrong on the others)."""
    j.load(1)
    j.healthy(j.direct("clear", range(j.n)), "the clear before version 2", None, None)
    j.publish(version, {failing: "partial"})
    replies = j.direct("update", range(j.n))
    j.failed_everywhere(replies, "update", {failing}, f"update to version {version} whose rank {failing} shard lacks "
                        "its last tensor", within_s=PROMPT_S)
    return replies


def _recovered(j: Job, version: int, where: str) -> dict:
    """Every rank's clear() and an update of ``version`` from healthy trainers, each rank bit for bit."""
    j.healthy(j.direct("clear", range(j.n)), f"{where}: the recovery's clear", None, None)
    j.publish(version)
    replies = j.direct("update", range(j.n))
    j.healthy(replies, f"{where}: the recovery's update to version {version}", version, None)
    j.committed = version
    return replies


def _buffers_of(reply_value: dict) -> dict[str, Observed]:
    return observed({"params": reply_value["state"].get("buffers", {})})


VOTE_CASES = [("parts", 1, False), ("ipc", 0, False), ("bucket", 1, True)]


@pytest.mark.rule("MODEL-TRANSFORM-FAILED")
@pytest.mark.parametrize("path,failing,staged", [
    pytest.param(p, f, s, marks=_requires(_path_caps(p), "model.post_load", "mtp", *(["staged"] if s else [])),
                 id=f"{p}:rank{f}-fails" + (":staged" if s else "")) for p, f, s in VOTE_CASES])
def test_a_peers_failure_runs_no_post_load_step(job, path, failing, staged):
    """Two ranks of the tiny transformer; rank ``failing``'s shard of version 2 lacks its last tensor: the healthy
    rank's own check passes and its peer's failure reaches it at the vote. Every rank's derived buffers still hold
    version 1's values; the recovery to version 3 transforms every rank once."""
    j = job(path, deadline_s=PROMPT_S, staged=staged, model="tiny")
    replies = _peer_fails(j, failing)
    for r, reply in sorted(replies.items()):
        check.params_equal(_buffers_of(j.value(reply)), TT.served_buffers(tiny(r), j.sent[1][r]),
                           f"{j.where}: rank {r}'s derived buffers after rank {failing} failed version 2 (no post-load "
                           "step may have run: they hold version 1's)")
    where = f"after rank {failing} failed version 2"
    replies = _recovered(j, 3, where)
    for r, reply in sorted(replies.items()):
        check.params_equal(_buffers_of(j.value(reply)), TT.served_buffers(tiny(r), j.sent[3][r]),
                           f"{j.where}: {where}: rank {r}'s derived buffers after the recovery to version 3")


@pytest.mark.rule("STAGE-ATOMIC")
@pytest.mark.parametrize("path,failing", [
    pytest.param(p, f, marks=[_requires(_path_caps(p), "staged"), pytest.mark.modes(fault="missing", ranks="two")],
                 id=f"{p}:rank{f}-fails:at-the-vote") for p, f in (("parts", 0), ("ipc", 1), ("bucket", 0))])
def test_a_peers_failure_adopts_nothing_on_a_healthy_rank(job, path, failing):
    """Staged, two ranks: rank ``failing``'s shard lacks its last tensor; the healthy rank's own check passes and the
    failure reaches it at the vote. Right after its update() raised, before anything is released, every rank's
    parameters are exactly as they were (cleared): the healthy rank adopted none of its staged tensors."""
    j = job(path, deadline_s=PROMPT_S, staged=True, options={"timeout_s": BUCKET_WAIT_S} if path == "bucket" else None)
    replies = _peer_fails(j, failing)
    for r, reply in sorted(replies.items()):
        state = j.value(reply)["state"]
        held = sorted(n for n, o in observed(state).items() if o.data)
        check.that(not held, f"{j.where}: rank {r} after rank {failing} failed the staged version 2 at the vote: it holds "
                             f"parameters {held} (cleared before the update: a staged update that fails adopts nothing)")
    _recovered(j, 3, f"after rank {failing} failed the staged version 2")


@pytest.mark.rule("VER-FAILED-KEEPS")
@pytest.mark.parametrize("path,failing,staged", [
    pytest.param(p, f, s, marks=_requires(_path_caps(p), "version", *(["staged"] if s else [])),
                 id=f"{p}:rank{f}-fails" + (":staged" if s else "")) for p, f, s in (("parts", 1, True), ("ipc", 0, False))])
def test_a_version_failed_at_the_vote_is_never_stamped(job, path, failing, staged):
    """Two ranks; version 2 fails at the vote (rank ``failing``'s shard lacks its last tensor; the other rank's own
    check passed); after a clear, version 3 comes with no version.yaml: every rank loads it and still reports
    version 1, the last committed one, never the failed update's 2."""
    j = job(path, deadline_s=PROMPT_S, staged=staged)
    _peer_fails(j, failing)
    j.healthy(j.direct("clear", range(j.n)), "the clear after the failed version 2", None, None)
    j.publish(3, version_file=False)
    replies = j.direct("update", range(j.n))
    for r, reply in sorted(replies.items()):
        got = j.value(reply)
        at = f"{j.where}: rank {r}, the update after rank {failing} failed version 2 at the vote, with no version.yaml"
        check.that(got["raised"] is None, f"{at}: raised {got['raised']}")
        check.params_equal(observed(got["state"]), j.sent[3][r], f"{at}: its shard of the update")
        check.equal(got["state"]["version"], 1, f"{at}: version() (the last committed update's, never the failed one's)")
