"""Ranks of a job as forked children of the test process, joined in one gloo group: the quick run's
multi-rank cases (``conformance/test_ranks_quick.py``). The ``multirank`` tier runs whole jobs under
``paddle.distributed.launch`` (``sim.ranks``); here the same sessions, one per rank, are driven step by
step from the test process, which plays the API (the status cell) and the trainers.

    with RankGroup(2, ACTIONS, adapter=adapter) as group:   # 2 children, joined in one gloo group
        group.run("open", strategy="ipc_snapshot", ...)   # every rank, one deadline for all
        group.start(1, "update")                          # one rank...
        replies = group.wait([1], timeout_s=30.0)         # ...and its reply

Each child joins the default process group (gloo, a fresh rendezvous per group) as global rank ``r`` of
``n`` on physical GPU ``VISIBLE[r]`` (``CUDA_VISIBLE_DEVICES`` 4,2,6 with ``FLAGS_selected_gpus`` r: neither
the rank nor the CUDA ordinal), then serves commands: the name of an action (``ACTIONS``: functions of the
child's :class:`RankContext`, defined before the fork, so the child has them) with JSON arguments. A reply
is JSON (no pickle crosses the pipes): ``ok``, ``value`` or the error (``error`` as ``Type: message``,
``types``: the names of its class and bases), ``t0``/``t1`` (wall clock, comparable with the parent's)
and ``seconds`` (monotonic). The children's adapter calls count for the test (vacuity guard).

Every wait is bounded from here: the parent waits in ``select`` with one deadline for all the ranks it
awaits; a rank that has not answered by then is reported ``timed_out`` (the case fails naming it, with
where its threads were blocked) and is killed when the group ends. ``close()`` (the context's exit, Ctrl-C
included) kills and reaps every child, and each child dies with the test process (``PR_SET_PDEATHSIG``).
Joining is the harness's, not the implementation's: a group whose ranks did not all join in time is
started again with fresh ports, and after ``JOIN_ATTEMPTS`` the error says ``NEVER_JOINED`` (a harness
failure, never counted as a kill of a mutant: tests/conftest.py ``unstarted_jobs``).

Joining costs about half a second (a second for three ranks on a loaded machine), most of a case's time, so a
module keeps its groups (:class:`GroupPool`): a case takes a group of its size and hands it back; the group
is kept only if every rank answered every command of the case (none timed out, died or was killed, and the
case did not leave a collective unanswered on purpose: ``reusable=False``), and then only if every rank
closed its session, has no thread left but the ones it had once it joined (a collective left running in a
thread at a deadline would take the next case's messages), and two bounded all-reduces of the harness's own
(``__sync__``) give the expected sums on every rank: the group is in step. Anything else kills it, and the
next case forks a fresh one, so that no case's verdict depends on the cases before it.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from . import harness

VISIBLE = ("4", "2", "6")  # physical GPU ids of ranks 0, 1, 2 (CUDA_VISIBLE_DEVICES), ordinals 0, 1, 2
JOIN_TIMEOUT_S = 30.0  # one start of the group (fork, rendezvous): about half a second on an idle machine
JOIN_ATTEMPTS = 3
RESET_S = 10.0  # the harness's all-reduce when a group is handed back (milliseconds when the ranks are in step)
NEVER_JOINED = "the ranks never joined"  # as sim.ranks says it: tests/conftest.py unstarted_jobs keys on it
_LEN = struct.Struct("=I")


@dataclass
class RankContext:
    """What an action sees in its child: its rank, the group's size, the ``adapter`` under test (forked with
    the child, its patches included) and ``state``, kept between commands (``state["session"]``: the session
    an action opened, closed by ``__close__``)."""

    rank: int
    ranks: int
    adapter: object = None
    state: dict = field(default_factory=dict)
    threads: frozenset = frozenset()  # the idents of the threads the rank had once it joined


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, ranks: int, master: int, endpoints: list[str]) -> None:
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(ranks), PADDLE_MASTER=f"127.0.0.1:{master}",
                      PADDLE_DISTRI_BACKEND="gloo", PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[rank], CUDA_VISIBLE_DEVICES=",".join(VISIBLE[:ranks]),
                      FLAGS_selected_gpus=str(rank))
    from paddle.distributed import parallel

    parallel._global_parallel_env = None
    if rank:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while time.monotonic() < deadline:  # Paddle's store client retries after 3 s if it comes too early
            try:
                socket.create_connection(("127.0.0.1", master), 0.2).close()
                break
            except OSError:
                time.sleep(0.01)
    import paddle.distributed as dist

    dist.init_parallel_env()


def _error_reply(e: BaseException) -> dict:
    return {"ok": False, "error": f"{type(e).__name__}: {e}", "types": [c.__name__ for c in type(e).__mro__],
            "traceback": traceback.format_exc()}


def _all_reduce(value: int, timeout_s: float) -> int:
    """The harness's own collective: the sum of ``value`` over the group, in a thread bounded by ``timeout_s``."""
    import threading

    import numpy as np
    import paddle
    import paddle.distributed as dist

    box, out = paddle.to_tensor(np.array([value], np.int64)), {}

    def run():
        try:
            dist.all_reduce(box)
            out["value"] = int(box.numpy()[0])
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    thread = threading.Thread(target=run, name="harness-all-reduce", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "value" not in out:
        raise RuntimeError(f"harness all-reduce: {out.get('error') or f'no answer within {timeout_s:g}s'}")
    return out["value"]


def _close(ctx: RankContext) -> None:
    """Between two cases: close the rank's session and forget its state; then no thread may be left but the ones
    the rank had once it joined (a collective still in flight in a thread, left behind at a deadline, would take
    the next case's messages)."""
    import threading

    session = ctx.state.get("session")
    ctx.state.clear()
    if session is not None:
        session.close()
    deadline = time.monotonic() + 1.0
    while True:
        extra = [t.name for t in threading.enumerate() if t.ident not in ctx.threads and t.is_alive()]
        if not extra:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {ctx.rank}: thread(s) {extra} still running after the case: the group is not reused")
        time.sleep(0.01)


def _sync(ctx: RankContext, token: int) -> list[int]:
    """Two harness all-reduces (``token``, ``token + 1``): their sums say the ranks are in step."""
    return [_all_reduce(token, RESET_S), _all_reduce(token + 1, RESET_S)]


HARNESS_ACTIONS = {"__close__": _close, "__sync__": _sync}


def _serve(rank: int, ranks: int, master: int, endpoints: list[str], ctl: int, rep: int,
           actions: Mapping[str, Callable], adapter) -> None:
    """A child's life: join, say so, then run each command it is sent until the pipe closes."""
    from sim.interrupt import die_with_parent

    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    harness.reset()
    started = time.monotonic()
    try:
        _join(rank, ranks, master, endpoints)
        reply = {"ok": True, "value": {"joined": time.monotonic() - started, "pid": os.getpid()}}
    except BaseException as e:  # noqa: BLE001 (the parent starts the group again)
        reply = _error_reply(e)
    _write_all(rep, json.dumps(reply).encode())
    if not reply["ok"]:
        return
    import threading

    ctx = RankContext(rank, ranks, adapter, threads=frozenset(t.ident for t in threading.enumerate()))
    actions = {**actions, **HARNESS_ACTIONS}
    while True:
        head = _read_exactly(ctl, _LEN.size)
        if head is None:
            return
        command = json.loads(_read_exactly(ctl, _LEN.unpack(head)[0]))
        t0, m0 = time.time(), time.monotonic()
        try:
            reply = {"ok": True, "value": actions[command["do"]](ctx, **command["args"])}
        except BaseException as e:  # noqa: BLE001 (judged by the test)
            reply = _error_reply(e)
        reply.update(t0=t0, t1=time.time(), seconds=time.monotonic() - m0, calls=harness.adapter_calls())
        harness.reset()
        try:
            data = json.dumps(reply).encode()
        except (TypeError, ValueError) as e:
            data = json.dumps({**_error_reply(e), "error": f"reply of {command['do']} is not JSON: {e}",
                               "t0": t0, "t1": time.time(), "seconds": time.monotonic() - m0, "calls": 0}).encode()
        _write_all(rep, data)


class RankGroup:
    def __init__(self, ranks: int, actions: Mapping[str, Callable], *, adapter=None):
        self.ranks = ranks
        self.actions = dict(actions)
        self.adapter = adapter
        self.damaged = False  # a rank timed out, died or was killed: the group is never reused
        self.children: dict[int, tuple[int, int, int]] = {}  # rank -> (pid, ctl write end, reply read end)
        self._buffers: dict[int, bytes] = {}
        self.busy: dict[int, str] = {}  # rank -> the action it was sent and has not answered
        self.timed_out: set[int] = set()
        self.joined: dict[int, dict] = {}

    # -- the group ------------------------------------------------------------------------------------
    def launch(self) -> "RankGroup":
        """Fork the ranks and return at once; entering the group then waits for them to join (a spare group's
        ranks join while its pool's caller runs a case: joining is mostly waiting on the rendezvous)."""
        try:
            self._fork()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "RankGroup":
        failures = []
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            try:
                if not self.children:  # (forked by launch(), or not yet; a failed start is closed below)
                    self._fork()
                replies = self.wait(range(self.ranks), JOIN_TIMEOUT_S)
                bad = {r: (p.get("error") or "no answer") for r, p in replies.items() if not p["ok"]}
                if not bad:
                    self.joined = {r: p["value"] for r, p in replies.items()}
                    return self
                failures.append("; ".join(f"rank {r}: {why}" for r, why in sorted(bad.items())))
            except BaseException:
                self.close()
                raise
            self.close()
        raise AssertionError(f"{NEVER_JOINED}: {self.ranks} forked ranks did not all join their gloo group in "
                             f"{JOIN_ATTEMPTS} starts of {JOIN_TIMEOUT_S:g}s: " + " | ".join(failures))

    def _fork(self) -> None:
        master, endpoints = _free_port(), [f"127.0.0.1:{_free_port()}" for _ in range(self.ranks)]
        self.timed_out.clear()
        for rank in range(self.ranks):
            ctl_r, ctl_w = os.pipe()
            rep_r, rep_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never return into pytest
                code = 0
                try:
                    os.close(ctl_w)
                    os.close(rep_r)
                    for _, w, r in self.children.values():  # the pipes of ranks forked before this one
                        os.close(w)
                        os.close(r)
                    _serve(rank, self.ranks, master, endpoints, ctl_r, rep_w, self.actions, self.adapter)
                except BaseException:  # noqa: BLE001
                    code = 70
                finally:
                    os._exit(code)
            os.close(ctl_r)
            os.close(rep_w)
            self.children[rank] = (pid, ctl_w, rep_r)
            self._buffers[rank] = b""
            self.busy[rank] = "join"

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every child and reap it; close the pipes."""
        for rank, (pid, ctl, rep) in list(self.children.items()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for fd in (ctl, rep):
                try:
                    os.close(fd)
                except OSError:
                    pass
        for pid, _, _ in self.children.values():
            harness._reap(pid)
        self.children.clear()
        self.busy.clear()

    def kill(self, rank: int) -> None:
        """Rank ``rank`` dies (SIGKILL), as a crashed worker does: its sockets close under its peers."""
        self.damaged = True
        pid, ctl, rep = self.children.pop(rank)
        os.kill(pid, signal.SIGKILL)
        harness._reap(pid)
        for fd in (ctl, rep):
            os.close(fd)
        self.busy.pop(rank, None)

    def pid(self, rank: int) -> int:
        return self.children[rank][0]

    # -- commands -------------------------------------------------------------------------------------
    def start(self, rank: int, action: str, **args) -> None:
        """Send ``action`` to ``rank`` (which must have answered its previous command)."""
        if rank in self.busy:
            raise AssertionError(f"rank {rank} is still running {self.busy[rank]!r} (it never answered): "
                                 f"it cannot be sent {action!r}")
        if action not in self.actions and action not in HARNESS_ACTIONS:
            raise KeyError(f"no action {action!r} (actions: {sorted(self.actions)})")
        _write_all(self.children[rank][1], json.dumps({"do": action, "args": args}).encode())
        self.busy[rank] = action

    def wait(self, ranks: Iterable[int], timeout_s: float) -> dict[int, dict]:
        """The reply of each of ``ranks`` to its last command, waiting at most ``timeout_s`` for all of them;
        a rank still silent then gets ``{"ok": False, "timed_out": True, "error": ..., "blocked_in": ...}``."""
        ranks = list(ranks)
        out: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            for rank in ranks:
                if rank not in out:
                    reply = self._take(rank)
                    if reply is not None:
                        out[rank] = reply
            pending = {self.children[r][2]: r for r in ranks if r not in out}
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            ready, _, _ = select.select(list(pending), [], [], left)
            for fd in ready:
                rank = pending[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.damaged = True
                    out[rank] = {"ok": False, "died": True, "error": f"rank {rank} died while running "
                                 f"{self.busy.get(rank)!r} (its process ended without an answer)", "types": []}
                    self.busy.pop(rank, None)
                    continue
                self._buffers[rank] += chunk
        for rank in ranks:
            if rank not in out:
                self.damaged = True
                self.timed_out.add(rank)
                where = harness.blocked_in(self.children[rank][0])
                out[rank] = {"ok": False, "timed_out": True, "types": [], "blocked_in": where,
                             "error": f"rank {rank} did not answer {self.busy.get(rank)!r} within {timeout_s:g}s"
                                      + (f" (blocked in {where})" if where else "")}
        return out

    def _take(self, rank: int) -> dict | None:
        buf = self._buffers[rank]
        if len(buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack(buf[: _LEN.size])
        if len(buf) < _LEN.size + n:
            return None
        self._buffers[rank] = buf[_LEN.size + n:]
        reply = json.loads(buf[_LEN.size: _LEN.size + n])
        harness._calls["adapter"] += reply.get("calls", 0)
        self.busy.pop(rank, None)
        return reply

    def run(self, action: str, ranks: Iterable[int] | None = None, *, timeout_s: float = 60.0,
            per_rank: Mapping[int, Mapping] | None = None, **args) -> dict[int, dict]:
        """``action`` on every rank of ``ranks`` (default all) at once, with ``args`` (and ``per_rank[r]``'s
        for rank r); every reply, waited for against one deadline."""
        ranks = list(range(self.ranks) if ranks is None else ranks)
        for rank in ranks:
            self.start(rank, action, **{**args, **dict((per_rank or {}).get(rank, {}))})
        return self.wait(ranks, timeout_s)

    def reset(self, token: int) -> bool:
        """Make the group ready for another case: every rank closes its session, forgets its state and has no
        thread left of the case (``__close__``), then two harness all-reduces must give ``ranks * token`` and
        ``ranks * (token + 1)`` on every rank (``__sync__``). False (the group must be killed) if the group is
        damaged, or any rank fails, disagrees or stays silent."""
        if self.damaged or len(self.children) != self.ranks or self.busy:
            return False
        if not all(r["ok"] for r in self.run("__close__", timeout_s=RESET_S).values()):
            return False
        replies = self.run("__sync__", token=token, timeout_s=2 * RESET_S + 5.0)
        return all(r["ok"] and r["value"] == [self.ranks * token, self.ranks * (token + 1)] for r in replies.values())


class GroupPool:
    """Groups of forked ranks kept across the cases of a module (see the module's docstring): ``take(n)`` a
    group of ``n`` ranks (a kept one, or a new one; ``fresh=True``: always a new one), ``give(group,
    reusable)`` it back when the case ends, ``close()`` every kept group."""

    def __init__(self, actions: Mapping[str, Callable], adapter):
        self.actions, self.adapter = actions, adapter
        self.idle: dict[int, list[RankGroup]] = {}
        self.spare: dict[int, RankGroup] = {}  # size -> a group forked ahead, its ranks joining meanwhile
        self._tokens = iter(range(1, 1 << 30, 2))

    def take(self, ranks: int, fresh: bool = False) -> RankGroup:
        """A kept group of ``ranks`` (unless ``fresh``), else a new one: the spare forked at the last new one of
        this size (joined now), and a spare forked for the next."""
        kept = self.idle.get(ranks) or []
        if kept and not fresh:
            return kept.pop()
        spare = self.spare.pop(ranks, None)
        group = (spare or RankGroup(ranks, self.actions, adapter=self.adapter)).__enter__()
        self.spare[ranks] = RankGroup(ranks, self.actions, adapter=self.adapter).launch()
        return group

    def give(self, group: RankGroup, reusable: bool) -> None:
        try:
            kept = reusable and group.reset(next(self._tokens))
        except BaseException:
            group.close()
            raise
        if kept:
            self.idle.setdefault(group.ranks, []).append(group)
        else:
            group.close()

    def close(self) -> None:
        for group in [g for groups in self.idle.values() for g in groups] + list(self.spare.values()):
            group.close()
        self.idle.clear()
        self.spare.clear()
