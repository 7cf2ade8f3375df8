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

SIGINT (Ctrl-C) and SIGTERM end a job at any step with exit status 130 and 143: the launcher and the
ranks are killed, the trainers (which ignore SIGINT, and get SIGTERM if this process dies) stopped, the
status cells and the run's directory removed. A rank whose launcher or orchestrator is gone leaves by
itself. The run's directory is named with this process's pid, so that a SIGKILLed job's is swept by the
next one (``sim.leftovers``).
"""
from __future__ import annotations

import argparse
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

from wire import protocol

from . import interrupt, leftovers
from .ipc_handles import SHM_DIR
from .trainer import sweep_segments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "conformance", "rank_worker.py")
STRATEGIES = {"snapshot": "ipc_snapshot", "meta": "ipc", "bucket": "ipc_bucket"}
TERMINAL = ("left", "crashed", "watchdog", "exit")
NORMAL, UPDATING, CLEARING, CLEARED = 0, 1, -1, -2
HOLD_S = 0.3  # how long a step's slow_clear_rank is held inside its clear


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

    def wait_for(self, value: int, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self.read() == value:
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
    def __init__(self, run_dir: str, ranks: int, log_dir: str):
        self.paths = [os.path.join(run_dir, f"rank{r}.jsonl") for r in range(ranks)]
        self.offsets = [0] * ranks
        self.pending: list[list[dict]] = [[] for _ in range(ranks)]
        self.log_dir = log_dir
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
        path = os.path.join(self.log_dir, f"workerlog.{rank}")
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
                 slow_pause_s: float = 0.05, keep: bool = False, progress=None, fast_fill: bool = False):
        self.phase = "start-up"  # what the job is doing (the last progress line): an interruption names it
        self.impl, self.plans, self.ranks = impl, plans, ranks
        self.impl_opts = dict(impl_opts or {})
        self.block, self.agree_timeout_s = block, agree_timeout_s
        self.transfer_timeout_s, self.stall_timeout_s = transfer_timeout_s, stall_timeout_s
        self.step_timeout_s, self.bucket_bytes, self.slow_pause_s = step_timeout_s, bucket_bytes, slow_pause_s
        self.keep, self.fast_fill = keep, fast_fill
        self._progress = progress or (lambda text: None)
        self.visible = [2 + 2 * (ranks - 1 - r) for r in range(ranks)]  # physical ids: neither rank nor ordinal

    def progress(self, text: str) -> None:
        self.phase = text
        self._progress(text)

    # the engine's side of one path
    def _setup(self, run_dir: str) -> list[dict]:
        from fixtures.status_cell import Cell

        paths = []
        for plan in self.plans:
            base = os.path.join(run_dir, plan.path)
            model_dir, shared_dir = os.path.join(base, "model"), os.path.join(base, "shared")
            os.makedirs(model_dir)
            os.makedirs(shared_dir)
            cell = Cell(NORMAL)
            trainers = []
            for r in range(self.ranks):
                trainers.append(Trainer({
                    "path": plan.path, "rank": r, "gpu": self.visible[r], "params": plan.params,
                    "model_dir": model_dir, "shared_dir": shared_dir, "control": f"ipc://{base}/ctl{r}",
                    "endpoint": f"ipc://{base}/bkt{r}", "bucket_bytes": self.bucket_bytes, "timeout_s": 120.0,
                    "slow_pause_s": self.slow_pause_s, "fast_fill": self.fast_fill,
                }))
            paths.append({"plan": plan, "cell": cell, "trainers": trainers, "model_dir": model_dir,
                          "shared_dir": shared_dir, "base": base})
        return paths

    def _worker_config(self, run_dir: str, paths: list[dict]) -> str:
        jobs = []
        for p in paths:
            plan = p["plan"]
            timeouts = [self.stall_timeout_s if r == plan.hang_rank else self.transfer_timeout_s for r in range(self.ranks)]
            jobs.append({"name": plan.path, "path": plan.path, "strategy": STRATEGIES[plan.path], "params": plan.params,
                         "model_dir": p["model_dir"], "shared_dir": p["shared_dir"], "cell": p["cell"].name,
                         "endpoints": [f"ipc://{p['base']}/bkt{r}" for r in range(self.ranks)],
                         "transfer_timeouts": timeouts, "options": dict(plan.options)})
        config = {"impl": self.impl, "impl_opts": self.impl_opts, "run_dir": run_dir, "block": self.block,
                  "orchestrator": os.getpid(),
                  "agree_timeout_s": self.agree_timeout_s, "visible": ",".join(map(str, self.visible)),
                  "life_s": 600.0, "jobs": jobs}
        path = os.path.join(run_dir, "worker.json")
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

    def _collect(self, events: Events, job: str | None, kinds: tuple, *, leaving_ok: bool = False) -> dict:
        """Each rank's next event of ``kinds``. A rank that left the job (or crashed) ends it at once,
        unless ``leaving_ok``: the steps after a rank is gone could only time out."""
        got = {r: events.next(r, job, kinds, self.step_timeout_s) for r in range(self.ranks)}
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

    def run(self) -> dict:
        run_dir = self._run_dir = tempfile.mkdtemp(prefix=leftovers.run_dir_prefix("ranks"))
        log_dir = os.path.join(run_dir, "log")
        paths, launch, result = [], None, {"ranks": self.ranks, "visible": self.visible, "paths": []}
        started = time.monotonic()
        try:
            paths = self._setup(run_dir)
            config = self._worker_config(run_dir, paths)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
            cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(self.ranks),
                   "--max_restart", "0", "--log_dir", log_dir, WORKER, config]
            result["command"] = " ".join(cmd)
            launch = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            events = Events(run_dir, self.ranks, log_dir)
            for p in paths:  # while the ranks start
                p["first_sent"] = self._publish(p, p["plan"].steps[0])
            result["joined"] = self._collect(events, None, ("joined",))
            result["start_s"] = time.monotonic() - started
            for p in paths:
                result["paths"].append({"path": p["plan"].path})
                self._run_path(events, p, result["paths"][-1])
            result["exit"] = self._collect(events, None, ("exit",), leaving_ok=True)
            out, _ = launch.communicate(timeout=self.step_timeout_s)
            result["launch_rc"] = launch.returncode
            result["launch_tail"] = out.decode(errors="replace")[-3000:]
            result["events"] = events.all
            result["wall_s"] = time.monotonic() - started
            return result
        except JobError as e:
            result["error"] = str(e)  # what ran before it stays in the result
            return result
        finally:
            with interrupt.shielded():  # a signal now is raised once everything is released
                self._release(launch, paths, run_dir)

    def _release(self, launch, paths: list[dict], run_dir: str) -> None:
        """Kill the launcher and every rank (the launcher puts each in a session of its own, so killing its
        group does not reach them), stop the trainers, unlink the cells, remove the run's directory."""
        if launch is not None and launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait(10)
        for pid in _rank_pids(run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        graceful = not interrupt.pending()
        for p in paths:
            for t in p["trainers"]:
                t.stop(graceful)
            p["cell"].unlink()
        if not self.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _rank_pids(run_dir: str) -> list[int]:
    """The live rank workers of this job: processes running the worker on this run's configuration."""
    import psutil

    config = os.path.join(run_dir, "worker.json")
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if config in cmdline and WORKER in cmdline and proc.pid != os.getpid():
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
    parser.add_argument("--ranks", type=int, default=2)
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
    job = Job(args.impl, plans, ranks=args.ranks, progress=lambda text: print(text, flush=True))
    interrupt.install()
    try:
        result = job.run()
    except interrupt.Interrupted as e:
        print(f"sim.ranks {e} during {job.phase}: launcher, ranks and trainers stopped, status cells and the run's "
              "directory removed", file=sys.stderr, flush=True)
        return e.exit_status
    if "error" in result:
        print(f"sim.ranks: the job failed: {result['error']}", file=sys.stderr, flush=True)
        return 2
    ok = True
    for path in result["paths"]:
        for c in path["cycles"]:
            for r, e in c["update"].items():
                good = e["event"] == "updated" and e["digests"] == c["sent"][r]
                ok &= good
        print(f"{path['path']}: {len(path['cycles'])} cycles on {args.ranks} ranks: "
              f"{'every shard bit for bit' if ok else 'MISMATCH'}")
    print(f"job: {result['wall_s']:.1f}s (ranks joined after {result['start_s']:.1f}s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in result.items() if k != "events"}, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
