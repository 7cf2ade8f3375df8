"""Multi-rank jobs: N inference ranks launched with ``python -m paddle.distributed.launch`` (gloo on the
CPU) against N simulator trainers (``sim.rank_trainer``), on every path, driven through the shared
status cell the way the engine's API drives it.

This process plays the engine: it creates one status cell per path, starts one trainer per rank and
path, launches the ranks (``conformance/rank_worker.py``, which runs the implementation under test),
and then, for each step of each path's plan, writes CLEARING and waits for CLEARED, has every trainer
publish the next version (one of them, optionally, with a fault), writes UPDATING and waits until every
rank has reported the update or its failure. A step's ``slow_clear_rank`` is held ``HOLD_S`` inside its
clear by its harness (``hold.{path}`` in the run directory, taken by ``rank_worker.ClearHold`` before the
CLEARING is written). A thread reads the cell every 0.2 ms throughout, so a
NORMAL that lasts a moment is still seen. Every wait has a deadline; the job's result is plain data
(what each rank reported, what each trainer sent, the cell's history, resources), judged by the caller
(the MR and CYCLE rules, ``benchmarks/rank_cycle.py``).

    python -m sim.ranks --path snapshot --path meta --path bucket --ranks 2 --cycles 3
    python -m sim.ranks --hosts 2          # two hosts x two ranks (network namespaces; root)

On two hosts (``sim.hosts``) each host runs its own ``paddle.distributed.launch --nnodes 2`` in its
network namespace, the master on the first host's address; the trainers stay in this process's
namespace (the ranks reach them through ``ipc://`` files and ``/dev/shm``, which namespaces share).

SIGINT (Ctrl-C) and SIGTERM end a job at any step with exit status 130 and 143: the launcher and the
ranks are killed, the trainers (which ignore SIGINT, and get SIGTERM if this process dies) stopped, the
status cells and the run's directory removed. A rank whose launcher or orchestrator is gone leaves by
itself; the kernel kills a launcher whose orchestrator died, and a rank whose launcher died (a rank stuck in
Paddle's rendezvous holds the GIL: no Python of it runs). Ranks that never join are named with their stacks
and started again, up to START_ATTEMPTS starts (nothing of the implementation has run before they join). The
run's directory is named with this process's pid, so that a SIGKILLed job's is swept by the next one
(``sim.leftovers``).
"""
from __future__ import annotations

import argparse
import functools
import json
import mmap
import multiprocessing
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import zmq

from weightsync.wire import protocol

from . import hosts as netns
from . import interrupt, leftovers
from .ipc_handles import SHM_DIR
from .trainer import sweep_segments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "conformance", "rank_worker.py")
STRATEGIES = {"snapshot": "ipc_snapshot", "meta": "ipc", "bucket": "ipc_bucket"}
TERMINAL = ("left", "crashed", "watchdog", "exit")
NORMAL, UPDATING, CLEARING, CLEARED = 0, 1, -1, -2
HOLD_S = 0.3  # how long a step's slow_clear_rank is held inside its clear
# Starts of the ranks before the job gives up: Paddle's store aborts, now and then, as it binds its port (seen
# in CI, and in one start of a whole `.ci/run` here); a start that fails that way says nothing of the next.
START_ATTEMPTS = 3
NEVER_JOINED = "the ranks never joined"  # a job's error when no start got every rank to join (tests key on it)
MASTER_PORT = 6170  # the launchers' master on the first host (a namespace of this job's own: the port is free)


class JobError(RuntimeError):
    """The job could not be driven: a rank or trainer went silent past a deadline, or crashed."""


@dataclass(frozen=True)
class Step:
    version: int
    fault: str | None = None  # sim.rank_trainer.FAULTS, on the trainer of `rank`
    rank: int | None = None
    slow_rank: int | None = None  # bucket: this rank's trainer pauses before every message (healthy)
    slow_clear_rank: int | None = None  # this rank is held HOLD_S inside its clear (once its status reads CLEARING)


@dataclass
class PathPlan:
    path: str  # "snapshot" | "meta" | "bucket"
    params: list  # [[name, dtype, shape], ...]: every rank's shard has this layout
    steps: list[Step]  # the first is the first load (healthy)
    cycles: int = 0  # healthy clear/update cycles after the steps, resources measured after the first and last
    hang_rank: int | None = None  # bucket, last: this rank's trainer never answers, past the agreement's deadline
    options: dict = field(default_factory=dict)  # extra session options (e.g. {"staged": True})


def _reads(path: str, text: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == text
    except FileNotFoundError:
        return False


# -- the cell ---------------------------------------------------------------------------------------
class CellWatch:
    """Reads the cell every ``interval_s`` in a thread; ``history`` lists (time, value) at each change."""

    def __init__(self, name: str, interval_s: float = 0.0002):
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 4)
        finally:
            os.close(fd)
        self.interval_s = interval_s
        self.history: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cell-watch", daemon=True)
        self._thread.start()

    def read(self) -> int:
        return struct.unpack("=i", self._map[:4])[0]

    def write(self, value: int) -> None:
        self._map[:4] = struct.pack("=i", value)
        self.history.append((time.time(), value))

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            value = self.read()
            if value != last:
                self.history.append((time.time(), value))
                last = value
            time.sleep(self.interval_s)

    def since(self, t: float) -> list[tuple[float, int]]:
        before = [v for ts, v in self.history if ts <= t]
        return ([(t, before[-1])] if before else []) + [(ts, v) for ts, v in self.history if ts > t]

    def note(self) -> int:
        """The cell's value now, put in ``history`` if it is not its last entry: the watching thread, starved on a
        loaded machine, may not have read the cell since it changed."""
        value = self.read()
        if not self.history or self.history[-1][1] != value:
            self.history.append((time.time(), value))
        return value

    def wait_for(self, value: int, deadline: float) -> bool:
        """Whether the cell reads ``value`` before ``deadline`` (a value seen here is in ``history`` at once)."""
        while time.monotonic() < deadline:
            if self.note() == value:
                return True
            time.sleep(0.001)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._map.close()


# -- trainers --------------------------------------------------------------------------------------
def _trainer_entry(config: dict) -> None:
    from .rank_trainer import serve

    serve(config)


class Trainer:
    def __init__(self, config: dict):
        self.config = config
        self.proc = None
        self.sock = None
        self.start()

    def start(self) -> None:
        # Forked: no second import of numpy, zmq and Paddle (a trainer is ready in milliseconds), and a
        # patched simulator (the zoo's trainer mutants) is the one that runs. It starts with SIGINT and
        # SIGTERM blocked until its own handlers are set (sim.interrupt.trainer_signals).
        ctx = multiprocessing.get_context("fork")
        self.config = dict(self.config, parent=os.getpid())
        self.proc = ctx.Process(target=_trainer_entry, args=(self.config,), daemon=True,
                                name=f"trainer-{self.config['path']}-{self.config['rank']}")
        with interrupt.blocked():
            self.proc.start()
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.config["control"])

    def request(self, message: dict, timeout_s: float) -> dict | None:
        """The trainer's reply, or None if it died (a ``kill`` fault) before replying."""
        self.sock.send(protocol.encode(message))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                return protocol.decode(self.sock.recv(), "trainer reply", allowed=("published", "bye", "served"))
            if not self.proc.is_alive():
                return None
        raise JobError(f"trainer {self.config['path']} rank {self.config['rank']} silent for {timeout_s:g}s "
                       f"after {message['type']}")

    def alive(self) -> bool:
        return self.proc.is_alive()

    def revive(self) -> list[str]:
        """Restart a trainer that died (a fault); returns the dead one's segments, swept as the
        driver frees a dead process's device memory."""
        self.proc.join(5)
        swept = sweep_segments(self.proc.pid)
        self.sock.close()
        self.start()
        return swept

    def resources(self) -> dict:
        return process_resources(self.proc.pid)

    def stop(self, graceful: bool = True) -> None:
        """Ask the trainer to exit (``graceful``), else, or if that fails, SIGTERM it: it unwinds and unlinks its
        segments. An interrupted job may have left a request unanswered, so its socket cannot ask."""
        if self.proc.is_alive() and graceful:
            try:
                self.request({"type": "exit"}, 10)
            except (JobError, zmq.ZMQError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        sweep_segments(self.proc.pid)
        self.sock.close()


def process_resources(pid: int) -> dict:
    """Resident memory, descriptors, sockets, threads, shared-memory segments and mappings of ``pid``."""
    import psutil

    proc = psutil.Process(pid)
    fds = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        fds += 1
        sockets += link.startswith("socket:")
    shm_maps = set()
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                shm_maps.add(parts[5].strip())
    segments = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"wscf_{pid}_"))
    return {"rss_kib": proc.memory_info().rss // 1024, "fds": fds, "sockets": sockets, "threads": proc.num_threads(),
            "segments": segments, "shm_maps": sorted(shm_maps)}


# -- what the ranks report --------------------------------------------------------------------------
class Events:
    def __init__(self, run_dir: str, ranks: int, log_dir: str, hosts: int = 1):
        self.paths = [os.path.join(run_dir, f"rank{r}.jsonl") for r in range(ranks)]
        self.offsets = [0] * ranks
        self.pending: list[list[dict]] = [[] for _ in range(ranks)]
        self.log_dir, self.per_host, self.hosts = log_dir, ranks // hosts, hosts
        self.all: list[list[dict]] = [[] for _ in range(ranks)]

    def _poll(self, rank: int) -> None:
        try:
            with open(self.paths[rank], encoding="utf-8") as f:
                f.seek(self.offsets[rank])
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offsets[rank] += len(complete.encode())
        for line in complete.splitlines():
            event = json.loads(line)
            self.pending[rank].append(event)
            self.all[rank].append(event)

    def next(self, rank: int, job: str | None, kinds: tuple, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll(rank)
            while self.pending[rank]:
                event = self.pending[rank].pop(0)
                if event["event"] in TERMINAL or (event["event"] in kinds and (job is None or event.get("job") == job)):
                    return event
            if time.monotonic() > deadline:
                raise JobError(f"rank {rank}: no {'/'.join(kinds)} event for {job} within {timeout_s:g}s; "
                               f"last events {[e['event'] for e in self.all[rank][-8:]]}\n{self.log_tail(rank)}")
            time.sleep(0.002)

    def log_tail(self, rank: int, chars: int = 2500) -> str:
        host, local = divmod(rank, self.per_host)  # a launcher names its ranks' logs by their local rank
        path = os.path.join(self.log_dir, f"h{host}" if self.hosts > 1 else "", f"workerlog.{local}")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f"--- {path} (tail) ---\n" + f.read()[-chars:]
        except FileNotFoundError:
            return f"(no {path})"


# -- the job ------------------------------------------------------------------------------------------
class Job:
    def __init__(self, impl: str, plans: list[PathPlan], *, ranks: int = 2, impl_opts: dict | None = None,
                 block: bool = False, agree_timeout_s: float = 3.0, transfer_timeout_s: float = 0.5,
                 stall_timeout_s: float = 5.0, step_timeout_s: float = 30.0, bucket_bytes: int = 1 << 20,
                 slow_pause_s: float = 0.05, keep: bool = False, progress=None, fast_fill: bool = False,
                 hosts: int = 1, levels: tuple = (), levels_params: list | None = None, start_timeout_s: float = 120.0,
                 snapshot_formats: dict | None = None, stall_join_rank: int | None = None):
        self.phase = "start-up"  # what the job is doing (the last progress line): an interruption names it
        self.impl, self.plans, self.ranks = impl, plans, ranks
        if hosts < 1 or ranks % hosts:
            raise ValueError(f"{ranks} ranks cannot be spread evenly over {hosts} hosts")
        # hosts > 1: one network namespace per host (sim.hosts), ranks [h * per_host, (h + 1) * per_host)
        # on host h, local ranks 0.. there; every host has the same CUDA_VISIBLE_DEVICES.
        self.hosts, self.per_host = hosts, ranks // hosts
        self._netns: netns.Hosts | None = None
        # SNAP-RANK-OWN-SHARD across the job's ranks: before the paths, every rank opens and updates one
        # session per snapshot level on a directory holding every rank's shard at that level.
        self.levels, self.levels_params = tuple(levels), levels_params or default_params(0.0625)
        self.snapshot_formats = dict(snapshot_formats or {})  # the adapter's (legacy: safetensors or paddle.save)
        self.impl_opts = dict(impl_opts or {})
        self.block, self.agree_timeout_s = block, agree_timeout_s
        self.transfer_timeout_s, self.stall_timeout_s = transfer_timeout_s, stall_timeout_s
        self.step_timeout_s, self.bucket_bytes, self.slow_pause_s = step_timeout_s, bucket_bytes, slow_pause_s
        # Every rank joined the group: four ranks importing Paddle at once on a loaded 2-core machine took 25 s.
        self.start_timeout_s = max(start_timeout_s, step_timeout_s)
        self.keep, self.fast_fill = keep, fast_fill
        self.stall_join_rank = stall_join_rank  # the harness's fault: that rank skips the first start's rendezvous
        self._progress = progress or (lambda text: None)
        # Physical ids: neither rank nor ordinal. Each host has the same ones (4,2 on two ranks a host), so
        # ranks 0 and 2 both sit on physical GPU 4: their snapshot names differ by the global rank alone.
        self.host_visible = [2 + 2 * (self.per_host - 1 - r) for r in range(self.per_host)]
        self.visible = [self.host_visible[r % self.per_host] for r in range(ranks)]

    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    def progress(self, text: str) -> None:
        self.phase = text
        self._progress(text)

    # the engine's side of one path
    def _setup(self, run_dir: str) -> list[dict]:
        from weightsync.fixtures.status_cell import Cell

        paths = []
        for plan in self.plans:
            base = os.path.join(run_dir, plan.path)
            # The model directory is one for every host (a shared file system: each rank's files are named by
            # its global rank); the shared directory is each host's own (ipc_metas_{gpu} is keyed by the GPU,
            # and GPU ids repeat from host to host).
            model_dir = os.path.join(base, "model")
            shared_dirs = [os.path.join(base, "shared" if self.hosts == 1 else f"shared.h{h}") for h in range(self.hosts)]
            for d in [model_dir, *shared_dirs]:
                os.makedirs(d)
            shared_dir = shared_dirs[0]
            cell = Cell(NORMAL)
            trainers = []
            for r in range(self.ranks):
                trainers.append(Trainer({
                    "path": plan.path, "rank": r, "gpu": self.visible[r], "params": plan.params,
                    "model_dir": model_dir, "shared_dir": shared_dirs[self.host_of(r)], "control": f"ipc://{base}/ctl{r}",
                    "endpoint": f"ipc://{base}/bkt{r}", "bucket_bytes": self.bucket_bytes, "timeout_s": 120.0,
                    "slow_pause_s": self.slow_pause_s, "fast_fill": self.fast_fill,
                }))
            paths.append({"plan": plan, "cell": cell, "trainers": trainers, "model_dir": model_dir,
                          "shared_dir": shared_dir, "shared_dirs": shared_dirs, "base": base})
        return paths

    def _setup_levels(self, run_dir: str) -> dict:
        """Every rank's shard at each of ``self.levels``, in a directory of that level's own: the model
        directory one for every host (parts and single files are named by the global rank), but each host's
        own for the legacy level (``tp0{gpu}``: keyed by the GPU alone, which repeats from host to host).
        Returns {level: {"sent": {rank: sha256 by name}, "dirs": [(model_dir, shared_dir) per host]}}."""
        from weightsync.fixtures import snapshot as S
        from weightsync.fixtures.models import spec as make_spec

        from .rank_trainer import hashes, shard

        spec = make_spec(*(tuple(p[:2]) + (tuple(p[2]),) for p in self.levels_params))
        out = {}
        before = S.legacy_format()
        S.set_legacy_format(self.snapshot_formats.get("legacy", "safetensors"))  # the format the adapter reads
        try:
            for i, level in enumerate(self.levels):
                base = os.path.join(run_dir, "levels", level)
                dirs = [(os.path.join(base, "model" if level != "legacy" else f"model.h{h}"), os.path.join(base, "shared"))
                        for h in range(self.hosts)]
                for model_dir, shared_dir in dirs:
                    os.makedirs(model_dir, exist_ok=True)
                    os.makedirs(shared_dir, exist_ok=True)
                sent = {}
                for r in range(self.ranks):
                    tensors = shard(spec, r, 100 + i, None)
                    model_dir, shared_dir = dirs[self.host_of(r)]
                    S.write_level(level, model_dir, shared_dir, r, self.visible[r], tensors)
                    sent[r] = hashes(tensors)
                out[level] = {"sent": sent, "dirs": dirs}
        finally:
            S.set_legacy_format(before)
        return out

    def _worker_config(self, run_dir: str, paths: list[dict], host: int = 0, levels: dict | None = None) -> str:
        jobs = []
        for p in paths:
            plan = p["plan"]
            timeouts = [self.stall_timeout_s if r == plan.hang_rank else self.transfer_timeout_s for r in range(self.ranks)]
            jobs.append({"name": plan.path, "path": plan.path, "strategy": STRATEGIES[plan.path], "params": plan.params,
                         "model_dir": p["model_dir"], "shared_dir": p["shared_dirs"][host], "cell": p["cell"].name,
                         "endpoints": [f"ipc://{p['base']}/bkt{r}" for r in range(self.ranks)],
                         "transfer_timeouts": timeouts, "options": dict(plan.options)})
        config = {"impl": self.impl, "impl_opts": self.impl_opts, "run_dir": run_dir, "block": self.block,
                  "orchestrator": os.getpid(), "host": host, "start_timeout_s": self.start_timeout_s * START_ATTEMPTS,
                  "agree_timeout_s": self.agree_timeout_s, "visible": ",".join(map(str, self.host_visible)),
                  "life_s": 600.0, "jobs": jobs, "stall_join_rank": self.stall_join_rank,
                  "levels": [{"level": level, "model_dir": v["dirs"][host][0], "shared_dir": v["dirs"][host][1]}
                             for level, v in (levels or {}).items()],
                  "levels_params": self.levels_params}
        path = os.path.join(run_dir, "worker.json" if self.hosts == 1 else f"worker.h{host}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        return path

    def _publish(self, p: dict, step: Step) -> dict:
        """Every trainer publishes ``step.version`` (the faulty one with its fault); rank -> sha256 by name."""
        sent = {}
        for r, trainer in enumerate(p["trainers"]):
            fault = step.fault if step.rank == r else ("slow" if step.slow_rank == r else None)
            reply = trainer.request({"type": "publish", "version": step.version, "fault": fault}, self.step_timeout_s)
            sent[r] = reply["hashes"] if reply else None
            if reply is None:  # died publishing: its memory goes with it, as a dead process's device memory does
                trainer.proc.join(5)
                sweep_segments(trainer.proc.pid)
        return sent

    def _served(self, p: dict) -> dict:
        out = {}
        for r, trainer in enumerate(p["trainers"]):
            if p["plan"].path == "bucket" and trainer.alive():
                reply = trainer.request({"type": "served"}, self.step_timeout_s)
                out[r] = reply["served"] if reply else None
        return out

    def _revive(self, p: dict) -> dict:
        return {r: t.revive() for r, t in enumerate(p["trainers"]) if not t.alive()}

    def _collect(self, events: Events, job: str | None, kinds: tuple, *, leaving_ok: bool = False,
                 timeout_s: float | None = None) -> dict:
        """Each rank's next event of ``kinds``. A rank that left the job (or crashed) ends it at once,
        unless ``leaving_ok``: the steps after a rank is gone could only time out."""
        deadline = time.monotonic() + (timeout_s or self.step_timeout_s)  # one deadline for all ranks' reports
        got = {r: events.next(r, job, kinds, max(deadline - time.monotonic(), 0.0) if timeout_s else self.step_timeout_s)
               for r in range(self.ranks)}
        gone = {r: e for r, e in got.items() if e["event"] in TERMINAL and e["event"] not in kinds}
        if gone and not leaving_ok:
            raise JobError(f"{job}: rank(s) {sorted(gone)} left the job while {'/'.join(kinds)} was awaited: "
                           + "; ".join(f"rank {r}: {e['event']} {e.get('error', '')}" for r, e in gone.items()))
        return got

    def _cycle(self, events: Events, p: dict, watch: CellWatch, step: Step, measure: bool = False) -> dict:
        job = p["plan"].path
        out = {"version": step.version, "fault": step.fault, "rank": step.rank, "slow_rank": step.slow_rank,
               "slow_clear_rank": step.slow_clear_rank}
        hold = os.path.join(self._run_dir, f"hold.{job}")
        if step.slow_clear_rank is not None:  # read by the ranks' harness (rank_worker), never by the implementation
            with open(hold + ".tmp", "w", encoding="utf-8") as f:
                json.dump({"rank": step.slow_clear_rank, "version": step.version, "hold_s": HOLD_S}, f)
            os.replace(hold + ".tmp", hold)
            armed, deadline = os.path.join(self._run_dir, f"armed.{job}"), time.monotonic() + self.step_timeout_s
            while not _reads(armed, str(step.version)):  # the rank took the order: its next iteration clears held
                if time.monotonic() > deadline:
                    raise JobError(f"{job}: rank {step.slow_clear_rank} never took the order to hold its clear")
                time.sleep(0.002)
            os.remove(armed)
        t_clear = time.time()
        watch.write(CLEARING)
        out["clear"] = self._collect(events, job, ("cleared", "failed"))
        out["cleared_cell"] = watch.wait_for(CLEARED, time.monotonic() + self.step_timeout_s)
        out["cell_clear"] = watch.since(t_clear)
        if os.path.exists(hold):
            os.remove(hold)
        out["sent"] = self._publish(p, step)
        t_update = out["t_update"] = time.time()
        watch.write(UPDATING)
        out["update"] = self._collect(events, job, ("updated", "failed"))
        time.sleep(0.05)  # a late NORMAL (or one that comes and goes) still shows in the history
        out["cell"] = watch.since(t_update)
        out["served"] = self._served(p)
        out["revived"] = self._revive(p)
        if measure:
            out["trainers"] = {r: t.resources() for r, t in enumerate(p["trainers"])}
        return out

    def _hang(self, events: Events, p: dict, watch: CellWatch, version: int) -> dict:
        """The stalled rank's trainer never answers; the others wait at the agreement past its deadline."""
        job, rank = p["plan"].path, p["plan"].hang_rank
        out = {"version": version, "fault": "stall", "rank": rank}
        watch.write(CLEARING)
        out["clear"] = self._collect(events, job, ("cleared", "failed"))
        watch.wait_for(CLEARED, time.monotonic() + self.step_timeout_s)
        out["sent"] = self._publish(p, Step(version, "stall", rank))
        t_update = out["t_update"] = time.time()
        watch.write(UPDATING)
        out["update"] = self._collect(events, job, ("updated", "failed"), leaving_ok=True)
        time.sleep(0.05)
        out["cell"] = watch.since(t_update)
        return out

    def _run_path(self, events: Events, p: dict, result: dict) -> None:
        """Fills ``result`` step by step, so that what ran before an error is kept."""
        plan = p["plan"]
        job = plan.path
        open(os.path.join(self._run_dir, f"go.{job}"), "w").close()  # the ranks may open this path now
        result.update({"path": job, "steps": [], "cycles": []})
        result["first"] = self._collect(events, job, ("loaded", "failed"))
        result["first_cell"] = p["cell"].read()
        result["first_sent"] = p["first_sent"]
        watch = CellWatch(p["cell"].name)
        try:
            for step in plan.steps[1:]:
                self.progress(f"{job}: version {step.version}" + (f", {step.fault} on rank {step.rank}" if step.fault else ""))
                result["steps"].append(self._cycle(events, p, watch, step))
            version = plan.steps[-1].version
            for i in range(plan.cycles):
                version += 1
                if i in (0, plan.cycles - 1):
                    self.progress(f"{job}: cycle {i + 1}/{plan.cycles}")
                result["cycles"].append(self._cycle(events, p, watch, Step(version), measure=i in (0, plan.cycles - 1)))
            if plan.hang_rank is not None:
                self.progress(f"{job}: rank {plan.hang_rank}'s trainer stalls past the agreement deadline")
                result["hang"] = self._hang(events, p, watch, version + 1)
        finally:
            open(os.path.join(self._run_dir, f"stop.{job}"), "w").close()
            watch.close()
        result["ended"] = self._collect(events, job, ("ended",), leaving_ok=plan.hang_rank is not None)

    def _launch_commands(self, configs: list[str], log_dir: str, attempt: int = 1) -> list[tuple[list[str], dict]]:
        """One ``paddle.distributed.launch`` per host: (command, extra environment). A later start's master
        has a port of its own: an earlier one's may not be bound again so soon."""
        launch = [sys.executable, "-m", "paddle.distributed.launch"]
        tail = ["--max_restart", "0"]
        if self.hosts == 1:
            return [(launch + ["--nproc_per_node", str(self.ranks)] + tail + ["--log_dir", log_dir, WORKER, configs[0]], {})]
        hosts = self._netns
        master = f"{hosts.addresses[0]}:{MASTER_PORT + attempt - 1}"
        return [(hosts.prefix(h) + launch + ["--nnodes", str(self.hosts), "--rank", str(h), "--host", hosts.addresses[h],
                                             "--master", master, "--nproc_per_node", str(self.per_host)] + tail
                 + ["--log_dir", os.path.join(log_dir, f"h{h}"), WORKER, configs[h]],
                 {"GLOO_SOCKET_IFNAME": hosts.interfaces[h]})  # gloo's own sockets on the veth, not on lo
                for h in range(self.hosts)]

    def run(self) -> dict:
        """The job's result; raises ``sim.hosts.Unavailable`` (before anything is started) when the hosts
        of a ``hosts > 1`` job cannot be made here."""
        if self.hosts > 1:
            self._netns = netns.Hosts.create(self.hosts)
        try:
            run_dir = self._run_dir = tempfile.mkdtemp(prefix=leftovers.run_dir_prefix("ranks"))
        except BaseException:
            self._remove_hosts()
            raise
        log_dir = os.path.join(run_dir, "log")
        paths, launches = [], []
        result = {"ranks": self.ranks, "hosts": self.hosts, "visible": self.visible, "paths": []}
        if self._netns is not None:
            result["addresses"] = self._netns.addresses
        started = time.monotonic()
        try:
            paths = self._setup(run_dir)
            levels = self._setup_levels(run_dir)
            configs = [self._worker_config(run_dir, paths, h, levels) for h in range(self.hosts)]
            env = launch_environment()
            failures: list[str] = []
            for attempt in range(1, START_ATTEMPTS + 1):
                attempt_log = log_dir if attempt == 1 else f"{log_dir}.{attempt}"
                commands = self._launch_commands(configs, attempt_log, attempt)
                if attempt == 1:
                    result["command"] = " & ".join(" ".join(cmd) for cmd, _ in commands)
                for cmd, extra in commands:
                    launches.append(subprocess.Popen(cmd, cwd=REPO, env=dict(env, **extra), stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, start_new_session=True,
                                                     preexec_fn=_LAUNCHER_DIES_WITH_US))
                events = Events(run_dir, self.ranks, attempt_log, self.hosts)
                if attempt == 1:
                    for p in paths:  # while the ranks start
                        p["first_sent"] = self._publish(p, p["plan"].steps[0])
                try:
                    # Each start waits longer than the one before (a loaded machine's Paddle imports, not a stall).
                    result["joined"] = self._await_join(events, launches, self.start_timeout_s * attempt)
                    break
                except JobError as e:
                    # Nothing of the implementation has run yet (a rank resolves it once it joined): this is
                    # Paddle's rendezvous failing (seen in CI: a store that aborts binding its port, a master
                    # that waits forever for a peer). Another start with fresh ports, said in the result.
                    failures.append(str(e))
                    if attempt == START_ATTEMPTS:
                        raise JobError(f"{NEVER_JOINED} in {START_ATTEMPTS} starts.\n"
                                       + "\n".join(f"start {i}: {f}" for i, f in enumerate(failures, 1))) from None
                    result["start_failures"] = list(failures)  # each failed start's account
                    self.progress("the ranks did not join; starting them again")
                    self._stop_ranks(launches, run_dir)
                    launches.clear()
                    for path in events.paths:  # the second start's ranks report afresh
                        if os.path.exists(path):
                            os.remove(path)
            result["start_s"] = time.monotonic() - started
            result["levels"] = {}
            for level, v in levels.items():
                self.progress(f"every rank loads its own shard at level {level}")
                got = self._collect(events, f"level.{level}", ("level",))
                result["levels"][level] = {"sent": v["sent"], "got": got}
            for p in paths:
                result["paths"].append({"path": p["plan"].path})
                self._run_path(events, p, result["paths"][-1])
            result["exit"] = self._collect(events, None, ("exit",), leaving_ok=True)
            deadline = time.monotonic() + self.step_timeout_s
            rcs, tails = [], []
            for launch in launches:
                out, _ = launch.communicate(timeout=max(0.1, deadline - time.monotonic()))
                rcs.append(launch.returncode)
                tails.append(out.decode(errors="replace")[-3000:])
            result["launch_rc"] = next((rc for rc in rcs if rc != 0), 0)
            result["launch_rcs"] = rcs
            result["launch_tail"] = "\n".join(tails)
            result["events"] = events.all
            result["wall_s"] = time.monotonic() - started
            return result
        except JobError as e:
            result["error"] = str(e)  # what ran before it stays in the result
            return result
        except subprocess.TimeoutExpired as e:
            result["error"] = f"a launcher did not exit within {self.step_timeout_s:g}s after every rank left: {e}"
            return result
        finally:
            with interrupt.shielded():  # a signal now is raised once everything is released
                self._release(launches, paths, run_dir)

    def _await_join(self, events: Events, launches: list, timeout_s: float) -> dict:
        """Every rank's ``joined`` event. A rank that left, a launcher that exited, or the start-up deadline
        first: a JobError naming every rank's last events, and the log of each rank not joined with the
        stack of each of its threads (SIGUSR1: faulthandler, which writes even while Paddle's rendezvous
        holds the GIL)."""
        joined: dict = {}
        deadline = time.monotonic() + timeout_s
        why = None
        while why is None:
            for r in range(self.ranks):
                events._poll(r)
                while r not in joined and events.pending[r]:
                    event = events.pending[r].pop(0)
                    if event["event"] == "joined":
                        joined[r] = event
                    elif event["event"] in TERMINAL:
                        why = f"rank {r} {event['event']} before it joined: {event.get('error', '')}"
            if len(joined) == self.ranks:
                return joined
            exited = [launch.returncode for launch in launches if launch.poll() is not None]
            if why is None and exited:
                why = f"a launcher exited ({exited[0]}) before every rank joined"
            elif why is None and time.monotonic() > deadline:
                why = f"not every rank joined within {timeout_s:g}s"
            time.sleep(0.01)
        run_dir = os.path.dirname(events.paths[0])
        for pid in _rank_pids(run_dir):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        lines = [why]
        for r in range(self.ranks):
            pids = [e["pid"] for e in events.all[r] if e["event"] == "joining"]
            lines.append(f"rank {r}: joined" if r in joined else
                         f"rank {r}: not joined{f' (pid {pids[0]})' if pids else ''}; its events "
                         f"{[e['event'] for e in events.all[r]]}\n{events.log_tail(r)}")
        raise JobError("\n".join(lines))

    def _stop_ranks(self, launches: list, run_dir: str) -> None:
        """Kill the launchers and every rank (a launcher puts each in a session of its own, so killing its
        group does not reach them)."""
        for launch in launches:
            if launch.poll() is None:
                os.killpg(launch.pid, signal.SIGKILL)
                launch.wait(10)
            if launch.stdout is not None:
                launch.stdout.close()
        for pid in _rank_pids(run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _remove_hosts(self) -> None:
        if self._netns is not None:
            self._netns.remove()
            self._netns = None

    def _release(self, launches: list, paths: list[dict], run_dir: str) -> None:
        """Kill the launchers and ranks, stop the trainers, unlink the cells, remove the run's directory and
        the hosts' namespaces."""
        self._stop_ranks(launches, run_dir)
        graceful = not interrupt.pending()
        for p in paths:
            for t in p["trainers"]:
                t.stop(graceful)
            p["cell"].unlink()
        self._remove_hosts()
        if not self.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def launch_environment() -> dict:
    """The launchers' environment: this process's, this repository importable, and gloo named. Where the
    launcher sees a device (CUDA_VISIBLE_DEVICES in this environment, as a GPU machine's shell has it or as a
    test that left a rank's variables behind had it, or a GPU build that finds one), it leaves the backend
    unset, and a rank's init_parallel_env then takes its old gloo path, whose store listens on another port
    than PADDLE_MASTER: no rank joined, in every multi-rank job of a CI run. A rank sets its own
    CUDA_VISIBLE_DEVICES and FLAGS_selected_gpus."""
    env = dict(os.environ, PADDLE_DISTRI_BACKEND="gloo")
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# A launcher's preexec_fn: the kernel kills it when this process dies (a SIGKILLed orchestrator cannot clean
# up), and its ranks, whose death signal is armed the same way, go with it.
_LAUNCHER_DIES_WITH_US = functools.partial(interrupt.die_with_parent, signal.SIGKILL)


def _rank_pids(run_dir: str) -> list[int]:
    """The live rank workers of this job: processes running the worker on this run's configuration (not its
    launchers, whose command line names both too: a SIGUSR1 meant for a rank's stack would end a launcher,
    and the kernel would then kill its ranks before they wrote it)."""
    import psutil

    configs = {os.path.join(run_dir, "worker.json")} | {os.path.join(run_dir, f"worker.h{h}.json") for h in range(16)}
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if configs & set(cmdline) and WORKER in cmdline and "paddle.distributed.launch" not in cmdline \
                and proc.pid != os.getpid():
            pids.append(proc.pid)
    return pids


def default_params(model_mib: float) -> list:
    """Every rank's shard: float32, bfloat16 and float16 tensors of about ``model_mib`` MiB in all."""
    cols = 256
    rows = max(1, int(model_mib * (1 << 20)) // (cols * 4) // 4)
    return [["layers.0.qkv.weight", "float32", [rows, cols]], ["layers.0.mlp.weight", "bfloat16", [2 * rows, cols]],
            ["layers.1.mlp.weight", "float16", [2 * rows, cols]], ["mtp.0.proj.weight", "bfloat16", [rows, cols]],
            ["norm.bias", "float16", [cols]]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.ranks", description=" ".join(__doc__.split("\n\n")[0].split()),
                                     epilog="exit status: 0 every shard bit for bit, 1 a mismatch, 2 the job could not be "
                                            "driven, 130 SIGINT, 143 SIGTERM")
    parser.add_argument("--impl", default="reference")
    parser.add_argument("--path", action="append", choices=sorted(STRATEGIES), help="repeatable; default all three")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per host (default 2)")
    parser.add_argument("--hosts", type=int, default=1, choices=(1, 2),
                        help="2: two hosts (network namespaces joined by a veth pair, root only; sim.hosts), one "
                             "paddle.distributed.launch --nnodes 2 on each: the second host's ranks have local "
                             "ranks 0.. and global ranks ranks..")
    parser.add_argument("--model-mib", type=float, default=4.0, help="per rank")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--staged", action="store_true")
    parser.add_argument("--json", help="write the job's result here")
    args = parser.parse_args(argv)
    plans = [PathPlan(path, default_params(args.model_mib), [Step(1)], cycles=args.cycles,
                      options={"staged": True} if args.staged else {})
             for path in (args.path or ["snapshot", "meta", "bucket"])]
    swept = leftovers.sweep_dead_runs()  # what SIGKILLed runs of ours left (their pid is dead)
    if swept:
        print(f"swept {len(swept)} leftover(s) of dead runs: {', '.join(swept[:6])}{' ...' if len(swept) > 6 else ''}",
              file=sys.stderr, flush=True)
    ranks = args.ranks * args.hosts
    job = Job(args.impl, plans, ranks=ranks, hosts=args.hosts, progress=lambda text: print(text, flush=True))
    interrupt.install()
    try:
        result = job.run()
    except netns.Unavailable as e:
        print(f"sim.ranks: two hosts cannot be made here: {e}", file=sys.stderr, flush=True)
        return 2
    except interrupt.Interrupted as e:
        print(f"sim.ranks {e} during {job.phase}: launcher, ranks and trainers stopped, status cells and the run's "
              "directory removed", file=sys.stderr, flush=True)
        return e.exit_status
    for i, failure in enumerate(result.get("start_failures", []), 1):
        print(f"sim.ranks: start {i} of the ranks failed, started again: {failure}", file=sys.stderr, flush=True)
    if "error" in result:
        print(f"sim.ranks: the job failed: {result['error']}", file=sys.stderr, flush=True)
        return 2
    ok = True
    for path in result["paths"]:
        for c in path["cycles"]:
            for r, e in c["update"].items():
                good = e["event"] == "updated" and e["digests"] == c["sent"][r]
                ok &= good
        where = f"{ranks} ranks" if args.hosts == 1 else f"{args.hosts} hosts x {args.ranks} ranks"
        print(f"{path['path']}: {len(path['cycles'])} cycles on {where}: "
              f"{'every shard bit for bit' if ok else 'MISMATCH'}")
    print(f"job: {result['wall_s']:.1f}s (ranks joined after {result['start_s']:.1f}s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in result.items() if k != "events"}, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
