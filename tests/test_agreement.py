"""The reference's agreement (``reference.agreement``) on a real two-rank gloo group, in forked processes.

The MR rules judge agreement through whole jobs (the ``multirank`` tier); these tests pin the pieces in
seconds, and are what mutation testing of ``reference/agreement.py`` runs: the vote's wire form, a failure
named on every rank, votes out of step, a peer that never comes (the deadline, then a broken group), and
the loop's broadcast.
"""
import contextlib
import json
import os
import socket
import threading
import time

import pytest

from reference import agreement as A

DEADLINE_S = 1.0  # the deadline the cases that wait one out wait
HEALTHY_S = 10.0  # the deadline of collectives that must complete (two ranks just joined, on a loaded machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int, endpoints: list[str]) -> None:
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM="2", PADDLE_MASTER=f"127.0.0.1:{port}",
                      PADDLE_DISTRI_BACKEND="gloo", PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[rank])
    from paddle.distributed import parallel

    parallel._global_parallel_env = None
    if rank:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # Paddle's store client retries after 3 s if it comes too early
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.01)
    import paddle.distributed as dist

    dist.init_parallel_env()


@contextlib.contextmanager
def in_this_process():
    """Around a rank's script run in this process: it sets the rank's variables (CUDA_VISIBLE_DEVICES, ...);
    left in ``os.environ`` they reached every later test and every process those start (every later
    multi-rank job of a CI run hung: Paddle's launcher took its CPU ranks for GPU ones)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def two_ranks(script, timeout_s: float = 60.0, in_process: bool = True, deadline_s: float = HEALTHY_S) -> list:
    """``script(rank, agreement) -> JSON-able`` in two forked processes joined in one gloo group. With
    ``in_process``, the script first runs here as rank 0 of one (every call local, its result unused): tools
    that trace calls, coverage and mutation testing, then see the functions the test drives; the two ranks'
    calls die with their processes."""
    if in_process:
        with in_this_process():
            script(0, A.Agreement(DEADLINE_S))
    port, endpoints = _free_port(), [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    children = []
    for rank in range(2):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                _join(rank, port, endpoints)
                out = {"ok": True, "value": script(rank, A.Agreement(deadline_s))}
            except BaseException as e:  # noqa: BLE001 (handed to the parent)
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            os.write(write_end, json.dumps(out).encode())
            os._exit(0)  # at once: a collective stuck in a thread must not hold the child
        os.close(write_end)
        children.append((pid, read_end))
    results, deadline = [], time.monotonic() + timeout_s
    for pid, read_end in children:
        chunks = []
        while time.monotonic() < deadline:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(read_end)
        os.waitpid(pid, 0)
        results.append(json.loads(b"".join(chunks) or b'{"ok": false, "error": "no result"}'))
    for rank, r in enumerate(results):
        assert r["ok"], f"rank {rank}: {r['error']}"
    return [r["value"] for r in results]


# -- the vote's wire form ------------------------------------------------------------------------------
@pytest.mark.parametrize("ok", [True, False])
def test_vote_roundtrips_through_its_fixed_size_form(ok):
    vote = A.Vote(3, 17, "update", ok, "FileNotFoundError: no shard é")
    raw = A.encode_vote(vote)
    assert raw.dtype.name == "uint8" and raw.shape == (A.VOTE_BYTES,)
    assert A.decode_vote(raw, 3) == vote


def test_a_vote_fills_its_form_exactly_and_no_more():
    # msgpack of [0, 1, what, True, ""]: 1 (array) + 1 + 1 + 3 (str16 header) + len(what) + 1 + 1 bytes
    fits = A.Vote(0, 1, "u" * (A.VOTE_BYTES - 4 - 8), True)
    assert A.decode_vote(A.encode_vote(fits), 0) == fits
    with pytest.raises(ValueError, match=rf"needs {A.VOTE_BYTES + 1} bytes > {A.VOTE_BYTES}"):
        A.encode_vote(A.Vote(0, 1, "u" * (A.VOTE_BYTES - 4 - 7), True))


def test_a_vote_with_an_extension_type_is_refused():
    import msgpack

    body = msgpack.packb([0, 1, msgpack.ExtType(5, b"x"), True, ""])
    raw = A.encode_vote(A.Vote(0, 1, "clear", True))
    raw[:] = 0
    raw[:4] = list(len(body).to_bytes(4, "little"))
    raw[4 : 4 + len(body)] = list(body)
    with pytest.raises(A.AgreementError, match=r"vote from rank 1 is not readable \(ValueError: msgpack extension type 5 refused\)"):
        A.decode_vote(raw, 1)


def test_a_long_error_is_cut_to_its_limit_and_an_oversized_vote_refused():
    long = A.Vote(0, 1, "update", False, "x" * 5000)
    assert A.decode_vote(A.encode_vote(long), 0).error == "x" * A.ERROR_CHARS
    with pytest.raises(ValueError, match=r"rank 2.*needs \d+ bytes > 1024"):
        A.encode_vote(A.Vote(2, 1, "u" * 2000, True))


def test_an_unreadable_vote_names_its_sender():
    raw = A.encode_vote(A.Vote(0, 1, "clear", True))
    raw[4:12] = 0xC1  # msgpack's never-used byte
    with pytest.raises(A.AgreementError, match=r"vote from rank 5 is not readable"):
        A.decode_vote(raw, 5)


def test_failures_are_the_failed_votes():
    votes = [A.Vote(0, 1, "update", False, "mine"), A.Vote(1, 1, "update", True), A.Vote(2, 1, "update", False, "")]
    assert A.failures(votes) == [votes[0], votes[2]]
    assert A.describe(A.failures(votes)) == "rank 0: mine; rank 2: failed"


def test_one_rank_is_local(monkeypatch):
    from paddle.distributed import parallel

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")  # a job of 4 as launched, but no group joined here
    # Paddle reads the job's size once per process, at its first get_world_size(): a manager made by an
    # earlier test (tests/test_reference_messages.py) must not decide this test's verdict.
    monkeypatch.setattr(parallel, "_global_parallel_env", None)
    agreement = A.Agreement(DEADLINE_S)
    assert agreement.world_size() == 1 and agreement.declared_world_size() == 4
    assert agreement.vote("update", False, "e") == [A.Vote(agreement.rank(), 1, "update", False, "e")]
    agreement.require_all("update")
    assert agreement.report_failure("update", ValueError("x")) == []
    assert agreement.broadcast(-2) == -2 and agreement.epoch == 3


def test_a_collective_runs_in_a_thread_with_a_deadline():
    agreement = A.Agreement(0.2)
    assert agreement._bounded("probe", lambda: 5) == 5 and agreement.broken is None
    with pytest.raises(A.AgreementError, match=r"rank 0: probe \(epoch 0\) failed: KeyError: 'gone'") as info:
        agreement._bounded("probe", lambda: {}["gone"])
    assert not isinstance(info.value, A.AgreementTimeout) and isinstance(info.value.__cause__, KeyError)
    assert agreement.broken == "probe (epoch 0) failed: KeyError: 'gone'"
    fresh = A.Agreement(0.2)
    start = time.monotonic()
    with pytest.raises(A.AgreementTimeout, match=r"rank 0: slow \(epoch 0\) did not complete within 0.2s"):
        fresh._bounded("slow", lambda: threading.Event().wait(30.0))
    assert 0.2 <= time.monotonic() - start < 10.0 and fresh.broken == "slow (epoch 0) missed its 0.2s deadline"
    stuck = [t for t in threading.enumerate() if t.name == "agreement-slow"]
    assert stuck and all(t.daemon for t in stuck), "a collective past its deadline runs on in a named daemon thread"
    with pytest.raises(A.AgreementTimeout, match=r"cannot run next: the process group is unusable since slow"):
        fresh._bounded("next", lambda: 1)


# -- two ranks ------------------------------------------------------------------------------------------
def _exchange(rank, agreement):
    out = {"broadcast": agreement.broadcast(-1 if rank == 0 else 1), "world": agreement.world_size()}
    out["votes"] = [list(v.__dict__.values()) for v in agreement.vote("clear", True)]
    try:
        if rank == 1:
            agreement.report_failure("update", FileNotFoundError("no shard tp1.2"))
            out["failed"] = None
        else:
            agreement.require_all("update")
            out["failed"] = None
    except A.RankFailure as e:
        out["failed"] = str(e)
    try:  # out of step: rank 0 votes on an update, rank 1 on a clear
        agreement.vote("update" if rank == 0 else "clear", True)
        out["step"] = None
    except A.AgreementError as e:
        out["step"] = str(e)
    out["broken"] = agreement.broken
    return out


def test_two_ranks_agree_and_each_names_the_failure():
    zero, one = two_ranks(_exchange)
    assert zero["world"] == one["world"] == 2
    assert zero["broadcast"] == one["broadcast"] == -1, "the broadcast is rank 0's value on every rank"
    assert zero["votes"] == one["votes"] == [[0, 1, "clear", True, ""], [1, 1, "clear", True, ""]]
    assert zero["failed"] == "rank 0: update failed on 1 other rank(s): rank 1: FileNotFoundError: no shard tp1.2"
    assert one["failed"] is None
    for rank, out in enumerate((zero, one)):
        other = 1 - rank
        assert out["step"] and f"out of step with rank {other} at" in out["step"], f"rank {rank}: {out['step']}"
        assert out["broken"] == "votes out of step at epoch 3"


def _deadline(rank, agreement):
    if rank == 1:
        time.sleep(3 * DEADLINE_S)  # never votes in time
        return {}
    start = time.monotonic()
    try:
        agreement.vote("update", True)
        return {"raised": None}
    except A.AgreementTimeout as e:
        waited = time.monotonic() - start
        out = {"raised": str(e), "waited": waited, "broken": agreement.broken}
    start = time.monotonic()
    try:
        agreement.broadcast(0)
    except A.AgreementTimeout as e:
        out["again"], out["again_s"] = str(e), time.monotonic() - start
    return out


def test_a_peer_that_never_votes_breaks_the_group_at_the_deadline():
    zero, _ = two_ranks(_deadline, deadline_s=DEADLINE_S)
    assert zero["raised"] and "did not complete within 1s" in zero["raised"] and "vote on update" in zero["raised"]
    assert DEADLINE_S <= zero["waited"] < DEADLINE_S + 2.0, zero
    assert zero["broken"] == "vote on update (epoch 1) missed its 1s deadline"
    assert "unusable since vote on update (epoch 1)" in zero["again"] and zero["again_s"] < 0.5, zero


def _late(rank, agreement):
    """Rank 1 votes half a deadline after rank 0's deadline has passed."""
    if rank == 1:
        time.sleep(1.5 * DEADLINE_S)
    start = time.monotonic()
    try:
        return {"votes": [v.ok for v in agreement.vote("update", True)], "waited": time.monotonic() - start}
    except A.AgreementError as e:
        out = {"raised": str(e), "waited": time.monotonic() - start, "broken": agreement.broken}
        time.sleep(1.5 * DEADLINE_S)  # alive while rank 1 comes (the group's store and the pending collective are here)
        return out


def test_a_peer_past_the_deadline_fails_the_waiting_rank_then_meets_its_collective():
    """Rank 0 fails at its deadline, not later (its collective is left pending, the group broken); rank 1,
    coming half a deadline after, meets that pending collective within gloo's own time (30 s) and gets both
    votes, as gloo's pairing gives them."""
    zero, one = two_ranks(_late, deadline_s=DEADLINE_S)
    assert "raised" in zero and "did not complete within 1s" in zero["raised"], zero
    assert DEADLINE_S <= zero["waited"] < 1.5 * DEADLINE_S, zero
    assert zero["broken"] == "vote on update (epoch 1) missed its 1s deadline", zero
    assert one.get("votes") == [True, True], one


def _peer_dies(rank, agreement):
    agreement.broadcast(0)  # both joined and talked once
    if rank == 1:
        return {}  # leaves before the vote (the child exits at once): its sockets close
    start = time.monotonic()
    try:
        agreement.vote("clear", True)
        return {"raised": None}
    except A.AgreementTimeout as e:
        return {"raised": f"timeout: {e}"}
    except A.AgreementError as e:
        return {"raised": str(e), "waited": time.monotonic() - start, "broken": agreement.broken}


def test_a_dead_peer_fails_the_vote_at_once():
    zero, _ = two_ranks(_peer_dies)
    assert zero["raised"] and zero["raised"].startswith("rank 0: vote on clear (epoch 1) failed: "), zero
    assert zero["waited"] < HEALTHY_S / 2 and zero["broken"].startswith("vote on clear (epoch 1) failed: "), zero


# -- the manager's votes on two ranks ------------------------------------------------------------------------
SPEC = [("embed.weight", "float32", (8, 4)), ("norm.bias", "float16", (4,))]


def _manager_ranks(rank, agreement, shared):
    """Both ranks' managers (staged), each publishing its own shard as its trainer would; rank 1's shard of
    version 2 is missing, version 3 loads on both, then rank 1's clear leaves a parameter loaded."""
    from fixtures import models as M
    from fixtures import snapshot as S
    from fixtures.status_cell import Cell, write_version
    from reference.manager import WeightManager

    os.environ.update(CUDA_VISIBLE_DEVICES="4,2", FLAGS_selected_gpus=str(rank))
    spec, gpu = M.spec(*SPEC), (4, 2)[rank]
    cell = Cell.existing(shared["cell"])

    def publish(version):
        for name in os.listdir(shared["dir"]):
            if name.startswith(f"model_state.tp{rank}."):
                os.remove(os.path.join(shared["dir"], name))
        if not (rank == 1 and version == 2):
            S.write_safetensors(S.single_path(shared["dir"], rank, gpu), M.state(spec, seed=rank, version=version))
        if rank == 0:
            write_version(shared["dir"], version)

    manager = WeightManager(M.build_models(spec), load_strategy="ipc_snapshot", model_dir=shared["dir"],
                            shared_dir=shared["dir"], options={"status_cell": cell.name, "staged": True,
                                                               "agree_timeout_s": 20.0})
    out = {}
    publish(1)
    agreement.broadcast(0)
    manager.update()
    manager.clear()
    out["cleared_cell"] = cell.read()
    publish(2)
    agreement.broadcast(0)  # both published before either updates
    try:
        manager.update()
        out["update"] = None
    except Exception as e:  # noqa: BLE001
        out["update"] = f"{type(e).__name__}: {e}"
    out["after_update"] = [manager.status.name, manager.version, manager.params["embed.weight"]._is_initialized(),
                           cell.read()]
    manager.clear()
    publish(3)
    agreement.broadcast(0)
    manager.update()
    out["recovered"] = [manager.status.name, manager.version]
    agreement.broadcast(0)
    if rank == 0:
        cell.write(7)  # a value nobody writes: whether rank 0 publishes CLEARED shows
    if rank == 1:
        manager.params["norm.bias"]._clear_data = lambda: None  # this rank's clear leaves a parameter loaded
    agreement.broadcast(0)
    try:
        manager.clear()
        out["clear"] = None
    except Exception as e:  # noqa: BLE001
        out["clear"] = f"{type(e).__name__}: {e}"
    out["after_clear"] = [manager.status.name, cell.read()]
    return out


def _one_rank(directory) -> dict:
    """The same lifecycle on one rank, in this process: a missing shard, a load, a clear, a clear that leaves a
    parameter loaded. (Tools that trace calls, coverage and mutation testing, see the manager called by this
    test this way; the two ranks' calls die with their processes.)"""
    from fixtures import models as M
    from fixtures import snapshot as S
    from reference.manager import WeightManager

    spec = M.spec(*SPEC)
    manager = WeightManager(M.build_models(spec), load_strategy="ipc_snapshot", model_dir=str(directory),
                            shared_dir=str(directory), options={"staged": True}, env={})
    out = {}
    try:
        manager.update()
    except FileNotFoundError as e:
        out["missing"] = str(e)
    manager.clear()
    S.write_safetensors(S.single_path(str(directory), 0, 0), M.state(spec, version=1))
    manager.update()
    manager.clear()
    manager.update()
    manager.params["norm.bias"]._clear_data = lambda: None
    try:
        manager.clear()
    except RuntimeError as e:
        out["clear"] = str(e)
    out["status"] = manager.status.name
    return out


def test_every_rank_reports_the_failure_of_one(tmp_path):
    from fixtures.status_cell import Cell

    single = _one_rank(tmp_path / "one")
    assert single["missing"].startswith("No snapshot found") and single["status"] == "CLEARING", single
    assert single["clear"].startswith("Model Parameter clearance verification failed"), single

    (tmp_path / "two").mkdir()
    with Cell(0) as cell:
        shared = {"dir": str(tmp_path / "two"), "cell": cell.name}
        zero, one = two_ranks(lambda rank, agreement: _manager_ranks(rank, agreement, shared), in_process=False)
    assert zero["cleared_cell"] == -2, "rank 0 writes CLEARED once both ranks cleared"
    assert one["update"].startswith("FileNotFoundError: "), one["update"]
    assert zero["update"].startswith("RankFailure: rank 0: update failed on 1 other rank(s): rank 1: FileNotFoundError: "), zero
    for rank, out in enumerate((zero, one)):
        assert out["after_update"] == ["UPDATING", 1, False, -2], (rank, out["after_update"])
    assert zero["recovered"] == one["recovered"] == ["NORMAL", 3], (zero, one)
    assert one["clear"].startswith("RuntimeError: Model Parameter clearance verification failed"), one["clear"]
    assert zero["clear"].startswith("RankFailure: rank 0: clear failed on 1 other rank(s): rank 1: RuntimeError: Model "
                                    "Parameter clearance verification failed"), zero["clear"]
    assert zero["after_clear"] == ["CLEARING", 7], f"rank 0 must not write CLEARED after rank 1's clear failed: {zero}"


# -- a restarted worker's first pass on a rank that does not write the cell (STATUS-RESTART-RECOVERS) -------
HOLD_S = 1.0  # rank 0 holds its NORMAL this long, or until rank 1's first pass has returned
ANSWERED_S = 10.0  # the agreement's timeout when rank 0 answers (rank 1 waits HOLD_S of it)
UNANSWERED_S = 3.0  # and when it never does: rank 1 gives up after this (its start-up votes are healthy, loaded)


def _restarted_ranks(rank, agreement, shared, rank0_answers: bool):
    """Both ranks restarted against a cell left at UPDATING: each loads at startup (the update asked for,
    answered by that load), then runs the loop's first pass. Rank 0 writes NORMAL after it held
    HOLD_S (or saw rank 1's first pass return); with ``rank0_answers`` False it never does. Rank 1, which
    does not write the cell, must return from its first pass only once the cell has left UPDATING (the
    request is answered: reading it again would repeat it), and after the agreement's timeout raise
    LoopTimeout naming the cell and why it waited."""
    from fixtures import models as M
    from fixtures import snapshot as S
    from fixtures.status_cell import Cell, write_version
    from reference import worker_loop
    from reference.manager import WeightManager

    os.environ.update(CUDA_VISIBLE_DEVICES="4,2", FLAGS_selected_gpus=str(rank))
    spec, gpu = M.spec(*SPEC), (4, 2)[rank]
    cell = Cell.existing(shared["cell"])
    world = agreement.world_size()
    S.write_safetensors(S.single_path(shared["dir"], rank, gpu), M.state(spec, seed=rank, version=1))
    if rank == 0:
        write_version(shared["dir"], 1)
    agreement.broadcast(0)  # both published before either loads
    manager = WeightManager(M.build_models(spec), load_strategy="ipc_snapshot", model_dir=shared["dir"],
                            shared_dir=shared["dir"], options={"status_cell": cell.name, "staged": True,
                                                               "agree_timeout_s": ANSWERED_S if rank0_answers else UNANSWERED_S})
    manager.update()  # the startup load, with the cell at UPDATING
    marker = os.path.join(shared["dir"], "rank1-returned")

    def hold(value):
        value = manager.agreement.broadcast(value)
        deadline = time.monotonic() + (HOLD_S if world > 1 else 0)
        while time.monotonic() < deadline and not os.path.exists(marker):
            time.sleep(0.01)
        out["rank1_returned_first"] = os.path.exists(marker)  # here, before rank 0 can write NORMAL: after it,
        return value  # a healthy rank 1 may see NORMAL and return before a preempted rank 0 looks

    out = {"rank1_returned_first": os.path.exists(marker)}
    if rank == 0 and not rank0_answers:
        manager.agreement.broadcast(cell.read())  # rank 0's part in the first pass's broadcast, then nothing
        time.sleep(UNANSWERED_S + 2.0 if world > 1 else 0)
        return out
    try:
        out["result"] = worker_loop.iteration(manager, lambda: None, block=False, sync=hold if rank == 0 else None)
    except Exception as e:  # noqa: BLE001
        out["result"] = f"{type(e).__name__}: {e}"
    out["cell_at_return"] = cell.read()
    if rank == 1:
        with open(marker, "w"):
            pass
    return out


@pytest.mark.parametrize("rank0_answers", [True, False], ids=["rank0-writes-normal", "rank0-never-writes"])
def test_a_restarted_rank_that_does_not_write_waits_for_rank_0(tmp_path, rank0_answers):
    from fixtures.status_cell import Cell
    from reference.status import Status

    for directory in ("one", "two"):
        (tmp_path / directory).mkdir()
    with Cell(Status.UPDATING) as cell, in_this_process():  # one rank alone: it writes NORMAL itself
        alone = _restarted_ranks(0, A.Agreement(DEADLINE_S), {"dir": str(tmp_path / "one"), "cell": cell.name}, True)
    assert alone["result"] == "updated" and alone["cell_at_return"] == Status.NORMAL, alone
    with Cell(Status.UPDATING) as cell:
        shared = {"dir": str(tmp_path / "two"), "cell": cell.name}
        zero, one = two_ranks(lambda rank, agreement: _restarted_ranks(rank, agreement, shared, rank0_answers),
                              in_process=False)
    if rank0_answers:
        assert zero["result"] == one["result"] == "updated", (zero, one)
        assert not zero["rank1_returned_first"], f"rank 1's first pass returned before rank 0 wrote NORMAL: {one}"
        assert one["cell_at_return"] == Status.NORMAL, f"rank 1 returned with the cell at {one['cell_at_return']}"
    else:
        assert one["result"] == (f"LoopTimeout: status cell {cell.name!r} still reads UPDATING {UNANSWERED_S:g}s after rank 1 "
                                 "answered the update left in the cell"), one
        assert one["cell_at_return"] == Status.UPDATING, one


def _three_ranks(monkeypatch, raws_of):
    """An agreement that believes it is rank 0 of three and whose all-gather hands back ``raws_of(own)``
    (the vote's own checks run on them; no group is joined)."""
    agreement = A.Agreement(DEADLINE_S)
    monkeypatch.setattr(agreement, "world_size", lambda: 3)
    monkeypatch.setattr(agreement, "_bounded", lambda what, fn: raws_of(agreement.epoch))
    return agreement


def test_every_rank_out_of_step_is_named_in_one_message(monkeypatch):
    def raws(epoch):
        return [A.encode_vote(v) for v in (A.Vote(0, epoch, "update", True), A.Vote(1, epoch, "clear", True),
                                          A.Vote(2, epoch + 1, "update", True))]

    agreement = _three_ranks(monkeypatch, raws)
    with pytest.raises(A.AgreementError) as info:
        agreement.vote("update", True)
    assert str(info.value) == ("rank 0: update (epoch 1) is out of step with rank 1 at clear (epoch 1), "
                               "rank 2 at update (epoch 2)"), str(info.value)
    assert agreement.broken == "votes out of step at epoch 1"


def test_an_unreadable_vote_in_a_gather_names_its_rank(monkeypatch):
    def raws(epoch):
        out = [A.encode_vote(A.Vote(r, epoch, "clear", True)) for r in range(3)]
        out[2][4:12] = 0xC1  # msgpack's never-used byte
        return out

    with pytest.raises(A.AgreementError, match=r"^vote from rank 2 is not readable \("):
        _three_ranks(monkeypatch, raws).vote("clear", True)
