"""One inference rank of a multi-rank job, started by ``python -m paddle.distributed.launch`` (gloo on
the CPU) from ``sim.ranks``: ``python rank_worker.py CONFIG.json`` (on two hosts, one launcher per host,
each in its network namespace, with that host's configuration).

The rank joins the default process group, resolves the implementation under test (``--impl`` as the
suite does), and for each path of the job opens a session on its own shard, loads it (the first load),
then runs the implementation's worker loop (``session.worker_iteration``) against the job's status cell
until the orchestrator ends the path. What the rank sees goes to ``RUN_DIR/rank{R}.jsonl``, one JSON
object per line: every clear, update and failure with the status, version and sha256 of every parameter
afterwards, and the process's resources (resident memory, descriptors, sockets, threads, shared-memory
mappings). Nothing is pickled.

Every wait is bounded: joining the group, the harness's own collectives (whether to end the path), and
the rank's whole life (``life_s``). A rank whose group is broken (a collective missed its deadline)
reports and leaves, so its peers see the connection drop instead of waiting.
"""
from __future__ import annotations

import ctypes
import faulthandler
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback


HARNESS_DEADLINES = 3  # the harness's own collective waits this many of the agreement's deadlines


class Reporter:
    def __init__(self, run_dir: str, rank: int):
        self.rank = rank
        self.path = os.path.join(run_dir, f"rank{rank}.jsonl")
        self.file = open(self.path, "a", encoding="utf-8")

    def __call__(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"rank": self.rank, "event": event, "t": time.time(), **fields}) + "\n")
        self.file.flush()


def resources() -> dict:
    """What this process holds now: the numbers the CYCLE rules compare between cycles."""
    from sim.ranks import process_resources

    return dict(process_resources(os.getpid()), py_threads=sorted(t.name for t in threading.enumerate()))


def settled_resources(wait_s: float = 0.5) -> dict:
    """``resources()`` once two samples 20 ms apart agree on every count: a socket closed with a linger
    (the last ``done`` still being flushed) is released, not leaked."""
    keys = ("fds", "sockets", "threads", "shm_maps")
    last, deadline = resources(), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = resources()
        if all(now[k] == last[k] for k in keys):
            return now
        last = now
    return last


def digests(session) -> dict:
    return {n: (None if o.data is None else hashlib.sha256(o.data).hexdigest()) for n, o in session.observe().items()}


def wait_for_master(deadline: float) -> None:
    """Connect to the rendezvous store only once it listens: Paddle's store client retries after a
    fixed 3 s when its first attempt comes too early, which would triple the job's start."""
    host, port = os.environ["PADDLE_MASTER"].split(":")
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.01)
    raise TimeoutError(f"rendezvous store at {host}:{port} not listening")


def stall_join(config: dict, rank: int) -> None:
    """The harness's own fault (``sim.ranks.Job(stall_join_rank=R)``), never the implementation's: rank R
    never joins on the job's first start, so its peers wait in Paddle's rendezvous, as they do when it
    fails; it waits holding the GIL, as a rank inside the rendezvous does (``PyDLL`` keeps it across the C
    call), so that no Python thread of it runs either. A marker in the run's directory lets the second start
    go on."""
    if config.get("stall_join_rank") != rank:
        return
    marker = os.path.join(config["run_dir"], f"stalled-join.{rank}")
    if not os.path.exists(marker):
        open(marker, "w").close()
        while True:
            ctypes.PyDLL(None).sleep(3600)  # a signal's handler (faulthandler's) ends it early


RUN, WAIT, STOP = 0, 1, 2


class ClearHold:
    """The orchestrator's order to hold this rank inside its clear (``hold.{job}``: rank, version, hold_s):
    a profile function, set around the worker loop's iterations until it fires, sleeps ``hold_s`` at the
    first Python call after the session's ``status()`` reads CLEARING and one of the rank's parameters
    has been released, i.e. inside the implementation's clear, after it began to release the weights and
    before it can have released them all and told a peer so (a rank that tells its peers first, then
    releases, is held after telling them). It writes nothing and replaces nothing: a peer that publishes
    CLEARED before this rank's clear ended did not wait for it. ``armed.{job}`` tells the orchestrator the
    order was taken (it writes CLEARING only then: no iteration can slip past it)."""

    def __init__(self, run_dir: str, job: str, rank: int, session, params=()):
        self.order_path = os.path.join(run_dir, f"hold.{job}")
        self.armed_path = os.path.join(run_dir, f"armed.{job}")
        self.rank, self.session = rank, session
        # the rank's parameters that hold data when loaded (a zero-element one never does)
        self.params = [p for p in params if int(p.numel()) > 0]
        self.held: dict[int, float] = {}  # version -> when the hold ended (wall clock)
        self.armed: set[int] = set()

    def probe(self):
        """The profile function for the next iteration, or None when there is no pending order."""
        try:
            with open(self.order_path, encoding="utf-8") as f:
                order = json.load(f)
        except (FileNotFoundError, ValueError):
            return None
        if order["rank"] != self.rank or order["version"] in self.held:
            return None
        if order["version"] not in self.armed:
            self.armed.add(order["version"])
            with open(self.armed_path + ".tmp", "w", encoding="utf-8") as f:
                f.write(str(order["version"]))
            os.replace(self.armed_path + ".tmp", self.armed_path)
        busy = [False]

        def probe(frame, event, arg):
            if event != "call" or busy[0] or order["version"] in self.held:
                return
            busy[0] = True
            try:
                if self.session.status() == "CLEARING" and self.releasing():
                    time.sleep(order["hold_s"])
                    self.held[order["version"]] = time.time()
            finally:
                busy[0] = False

        return probe

    def releasing(self) -> bool:
        """One of the rank's parameters holds no data any more (its clear has begun to release them)."""
        return any(not p._is_initialized() for p in self.params)

    def held_until(self, version) -> float | None:
        return self.held.get(version)


class Collective:
    """The harness's own bounded collective: rank 0's word on every rank. Every rank takes the same
    decision from it, so the harness's collectives and the implementation's stay in step."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def word_of_rank0(self, word: int) -> int:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        box = paddle.to_tensor(np.array([word], np.int32))
        result: dict = {}

        def run():
            try:
                dist.broadcast(box, src=0)
                result["value"] = int(box.numpy()[0])
            except BaseException as e:  # noqa: BLE001
                result["error"] = e

        thread = threading.Thread(target=run, name="harness-broadcast", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if "value" not in result:
            raise TimeoutError(f"harness broadcast: {result.get('error') or f'no answer within {self.timeout_s:g}s'}")
        return result["value"]


def run_path(job: dict, config: dict, adapter, rank: int, report: Reporter, collective: Collective) -> bool:
    """One path: open, first load, then the worker loop until the orchestrator ends it. False when the
    group broke and the rank must leave."""
    from conformance.adapter import LoaderConfig
    from weightsync.fixtures.models import build_models
    from weightsync.fixtures.models import spec as make_spec
    from weightsync.fixtures.status_cell import UPDATING, Cell

    spec = make_spec(*(tuple(p[:2]) + (tuple(p[2]),) for p in job["params"]))
    options = {"status_cell": job["cell"], "agree_timeout_s": config["agree_timeout_s"], **job.get("options", {})}
    if job["path"] == "bucket":
        options.update(endpoint=job["endpoints"][rank], timeout_s=job["transfer_timeouts"][rank])
    models = build_models(spec)
    go = os.path.join(config["run_dir"], f"go.{job['name']}")
    deadline = time.monotonic() + config["life_s"]
    while not os.path.exists(go):  # the orchestrator has published this path's first version
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go} within {config['life_s']:g}s")
        time.sleep(0.005)
    session = adapter.open(models, LoaderConfig(job["strategy"], job["model_dir"], job["shared_dir"], options))
    name = job["name"]
    stop_file = os.path.join(config["run_dir"], f"stop.{name}")
    cell = Cell.existing(job["cell"])  # the harness reads it only to wait out a failed update

    def state(**extra) -> dict:
        phases = session.phases() if hasattr(session, "phases") else {}
        version = observed(session.version) if "version" in adapter.capabilities else None  # read only where claimed
        return {"job": name, "status": observed(session.status), "version": version, "digests": digests(session),
                "resources": settled_resources(), "phases": phases, **extra}

    try:
        session.update()
        report("loaded", **state())
    except Exception as e:  # noqa: BLE001 (reported; the orchestrator judges)
        report("failed", **state(error=f"{type(e).__name__}: {e}", step="first"))
    runs = [0]
    hold = ClearHold(config["run_dir"], name, rank, session,
                     [p for model in models for p in model.state_dict().values()])

    def run_model() -> None:
        runs[0] += 1

    failed = False
    while True:
        # Rank 0 decides for all: stop, wait (after a failed update the cell stays UPDATING until the
        # orchestrator recovers with a CLEARING), or run one iteration of the implementation's loop.
        try:
            word = STOP if os.path.exists(stop_file) else WAIT if failed and cell.read() == UPDATING else RUN
        except FileNotFoundError as e:  # the cell was removed under the job (see observed): this rank leaves
            report("left", job=name, error=f"the status cell is gone: {type(e).__name__}: {e}", runs=runs[0])
            return False
        try:
            word = collective.word_of_rank0(word)
        except Exception as e:  # noqa: BLE001
            report("left", job=name, error=f"{type(e).__name__}: {e}", runs=runs[0])
            return False
        if word == STOP:
            break
        if word == WAIT:
            time.sleep(0.005)
            continue
        failed = False
        probe = hold.probe()
        if probe is not None:
            sys.setprofile(probe)
        try:
            result = session.worker_iteration(run_model, block=config["block"])
        except Exception as e:  # noqa: BLE001
            sys.setprofile(None)
            report("failed", **state(error=f"{type(e).__name__}: {e}", held_until=dict(hold.held)))
            failed = True
            continue
        finally:
            sys.setprofile(None)
        if result in ("cleared", "updated"):
            report(result, **state(runs=runs[0], held_until=dict(hold.held)))
        else:
            time.sleep(0.002)
    report("ended", job=name, runs=runs[0], resources=resources())
    session.close()
    return True


def run_levels(config: dict, adapter, rank: int, report: Reporter) -> None:
    """SNAP-RANK-OWN-SHARD across the job: for each snapshot level, a session on a directory that holds
    every rank's shard at that level (on two hosts the parts and single files of all four ranks, named by
    the global rank, with ranks 0 and 2 on the same physical GPU), updated once; reports what it holds."""
    from conformance.adapter import LoaderConfig
    from weightsync.fixtures.models import build_models
    from weightsync.fixtures.models import spec as make_spec

    spec = make_spec(*(tuple(p[:2]) + (tuple(p[2]),) for p in config["levels_params"]))
    for entry in config["levels"]:
        job = f"level.{entry['level']}"
        options = {"agree_timeout_s": config["agree_timeout_s"]}
        session = adapter.open(build_models(spec), LoaderConfig("ipc_snapshot", entry["model_dir"], entry["shared_dir"], options))
        try:
            session.update()
            report("level", job=job, level=entry["level"], status=observed(session.status), digests=digests(session))
        except Exception as e:  # noqa: BLE001 (reported; the orchestrator judges)
            report("level", job=job, level=entry["level"], error=f"{type(e).__name__}: {e}", digests=digests(session))
        finally:
            session.close()


def observed(read):
    """What ``read()`` says, or why it could not say: what the rank reports, never the reason it crashes. (A
    FastDeploy rank that left took the engine's status cell with it: Python's resource tracker unlinks at a
    process's exit a segment it merely attached with SharedMemory(create=False); its peer's next read of
    the cell, reporting its own failure, raised FileNotFoundError and crashed the rank.)"""
    try:
        return read()
    except Exception as e:  # noqa: BLE001 (reported: a status that is not one fails whoever judges it)
        return f"unreadable ({type(e).__name__}: {e})"


def leave_when_orphaned(orchestrator: int | None, rank: int, interval_s: float = 0.2) -> None:
    """Leave (exit 4) as soon as the launcher (this process's parent) or the orchestrator is gone: a job
    whose driver was killed must not leave its ranks polling the cell, re-parented to init. The kernel
    also kills the rank when its launcher dies: Paddle's rendezvous holds the GIL while it waits for a
    peer that never comes, so no Python thread of a rank stuck there can leave."""
    from sim.interrupt import die_with_parent

    launcher = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died before the death signal was armed
        os._exit(4)

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            gone = "launcher" if os.getppid() != launcher else \
                "orchestrator" if orchestrator and not alive(orchestrator) else None
            if gone:
                print(f"rank {rank}: the {gone} is gone; leaving", file=sys.stderr, flush=True)
                os._exit(4)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def main(config_path: str) -> int:
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    rank = int(os.environ["PADDLE_TRAINER_ID"])  # the global rank (on a second host, not the local one)
    local = int(os.environ.get("PADDLE_LOCAL_RANK", rank))
    # Identity: physical GPU ids that are neither the rank nor the ordinal (SNAP-GPU-ID's point); this
    # host's list, every host's the same, indexed by the local rank (the CUDA ordinal on this host).
    os.environ["CUDA_VISIBLE_DEVICES"] = config["visible"]
    os.environ["FLAGS_selected_gpus"] = str(local)
    report = Reporter(config["run_dir"], rank)
    # SIGUSR1 writes every thread's stack to the rank's log, even from inside C++ holding the GIL: how the
    # orchestrator shows where a rank that never joined was.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    watchdog = threading.Timer(config["life_s"], lambda: (report("watchdog", life_s=config["life_s"]), os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    leave_when_orphaned(config.get("orchestrator"), rank)
    code = 0
    try:
        start = time.monotonic()
        report("joining", pid=os.getpid(), master=os.environ.get("PADDLE_MASTER"),
               endpoint=os.environ.get("PADDLE_CURRENT_ENDPOINT"))
        stall_join(config, rank)
        if rank != 0:
            wait_for_master(start + config.get("start_timeout_s", 30))
        import paddle.distributed as dist

        dist.init_parallel_env()
        report("joined", world=dist.get_world_size(), seconds=time.monotonic() - start, pid=os.getpid(),
               local_rank=local, host=config.get("host", 0), master=os.environ.get("PADDLE_MASTER"),
               endpoint=os.environ.get("PADDLE_CURRENT_ENDPOINT"))
        from weightsync.wire import handles

        handles.set_current_device(local)
        from conformance.registry import resolve

        adapter, _ = resolve(config["impl"], dict(config.get("impl_opts", {})))
        # The harness's word waits for every rank's pass of the loop, and a pass may itself wait out the agreement's
        # deadline (a rank at a barrier whose peer failed) before it does its own work: three deadlines, not one (a
        # rank 0 that gave up after one, while rank 1 was still loading on a loaded machine, ended a healthy job).
        collective = Collective(HARNESS_DEADLINES * config["agree_timeout_s"])
        if config.get("levels"):
            run_levels(config, adapter, rank, report)
        for job in config["jobs"]:
            if not run_path(job, config, adapter, rank, report, collective):
                break
        report("exit")
    except BaseException as e:  # noqa: BLE001 (reported, then leave)
        report("crashed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        code = 2
    finally:
        report.file.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave at once: a collective stuck in a thread (a broken group) must not hold the process.
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1])
