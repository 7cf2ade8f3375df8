"""``python -m sim roundtrip``: trainer processes publish, reference workers receive, every tensor is compared.

One spawned trainer per rank publishes deterministic weights (``fixtures.models.state(spec, seed +
rank, version)``); one reference ``WeightManager`` per rank, in this process, receives them through
``ipc_bucket`` (or the ``ipc`` meta file with ``--path meta``). After each version the model digest
of what landed (``WeightManager.digest()``: XXH3-128 and MD5 per tensor and for the model, SPEC.md §
DIGEST) is compared with the digest the trainer computed of what it sent, and the run ends with a
per-tensor table, the model digests of both ends and the throughput.
``--kill-trainer-at K`` SIGKILLs rank 0's trainer while it packs bucket K of the first version, to show
the worker's timeout error. Exit status: 0 every digest equal, 1 a difference, 2 an update failed or
a usage error, 130/143 interrupted by SIGINT/SIGTERM (trainers stopped, segments and the run's
directory removed; ``--hold-at PHASE`` pauses at a phase so that a signal can be put there).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait as wait_futures
from dataclasses import dataclass, field

import zmq

from weightsync.wire import protocol

from . import interrupt, leftovers
from .trainer import TrainerConfig, sweep_segments, trainer_main

# How long the CLI waits, after SIGTERM, for all its trainers together before it kills those left: a trainer's own
# kernel deadline (SIGALRM) is UNWIND_S, and the signal tests give the CLI 10 s in all.
STOP_S = interrupt.UNWIND_S + 2

MiB = 1 << 20


def model_spec(model_mib: float, layers: int = 2):
    """A decoder-shaped model of about ``model_mib`` MiB mixing every carried dtype: a bf16 embedding
    larger than typical buckets, fp8 weights with 0-d scales, an odd-sized uint8 tensor, bool, int64,
    and an empty tensor."""
    from weightsync.fixtures.models import spec

    total = int(model_mib * MiB)
    hidden = 1024 if total >= 16 * MiB else 64

    def rows(fraction: float, itemsize: int) -> int:
        return max(1, int(total * fraction) // (hidden * itemsize))

    params = [("embed_tokens.weight", "bfloat16", (rows(0.30, 2), hidden))]
    for i in range(layers):
        params += [
            (f"layers.{i}.input_layernorm.weight", "float32", (hidden,)),
            (f"layers.{i}.self_attn.qkv_proj.weight", "bfloat16", (rows(0.08, 2), hidden)),
            (f"layers.{i}.mlp.up_gate_proj.weight", "bfloat16", (rows(0.10, 2), hidden)),
            (f"layers.{i}.mlp.down_proj.weight", "float8_e4m3fn", (rows(0.06, 1), hidden)),
            (f"layers.{i}.mlp.down_proj.weight_scale", "float32", ()),
        ]
    params += [
        ("norm.weight", "float32", (hidden,)),
        ("lm_head.weight", "bfloat16", (rows(0.22, 2), hidden)),
        ("rotary_emb.inv_freq", "float16", (hidden // 2,)),
        ("position_ids", "int64", (1, 4096)),
        ("attn_mask", "bool", (64, 64)),
        ("vocab_bitmap", "uint8", (1001,)),
        ("mtp_head.weight", "float8_e5m2", (rows(0.04, 1), hidden)),
        ("mtp_head.empty_bias", "float16", (0,)),
    ]
    return spec(*params)


NOT_SENT, NOT_LANDED = "(not sent)", "(not landed)"


@dataclass
class TensorCheck:
    """One tensor's digests from both ends: ``sent``/``landed`` XXH3-128, ``sent_md5``/``landed_md5``."""

    rank: int
    version: int
    name: str
    dtype: str
    shape: tuple
    sent: str
    landed: str
    sent_md5: str = ""
    landed_md5: str = ""

    @property
    def ok(self) -> bool:
        return self.sent == self.landed and self.sent_md5 == self.landed_md5


@dataclass
class ModelCheck:
    """The whole-model digests of one rank's update, as the trainer sent it and as it landed."""

    rank: int
    version: int
    sent: dict  # algorithm -> hex
    landed: dict

    @property
    def ok(self) -> bool:
        return bool(self.sent) and self.sent == self.landed


@dataclass
class VersionResult:
    version: int
    nbytes: int = 0
    seconds: float = 0.0
    checks: list[TensorCheck] = field(default_factory=list)
    models: list[ModelCheck] = field(default_factory=list)
    errors: dict[int, BaseException] = field(default_factory=dict)  # rank -> the update's exception

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


@contextlib.contextmanager
def worker_identity(rank: int, ranks: int):
    """Run as worker ``rank`` of ``ranks`` (one GPU each): the env the manager reads its identity from."""
    from paddle.distributed import parallel

    keys = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(ranks),
                      CUDA_VISIBLE_DEVICES=",".join(str(r) for r in range(ranks)), FLAGS_selected_gpus=str(rank))
    parallel._global_parallel_env = None  # Paddle caches the rank; make it re-read the env
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        parallel._global_parallel_env = None


class Roundtrip:
    """Trainer processes plus one receiving reference WeightManager per rank. Use as a context manager:
    leaving it stops every trainer and removes every segment and socket it made."""

    def __init__(self, *, ranks: int = 2, model=None, model_mib: float = 64, bucket_bytes: int = 16 * MiB,
                 versions=(1, 2, 3), path: str = "bucket", timeout_s: float = 5.0, seed: int = 0,
                 kill_at: int | None = None, fast_fill: bool = False, verify: bool | tuple[int, ...] = True,
                 progress=None, hold_at: tuple | None = None):
        if path not in ("bucket", "meta"):
            raise ValueError(f"path must be 'bucket' or 'meta', got {path!r}")
        if kill_at is not None and path != "bucket":
            raise ValueError("--kill-trainer-at needs the bucket path")
        self.hold_at = hold_at  # ("ready",), ("verify",), ("bucket", k), ("end",): see --hold-at
        self.phase = "starting"
        self.ranks, self.path, self.timeout_s, self.seed = ranks, path, timeout_s, seed
        self.model = model if model is not None else model_spec(model_mib)
        self.bucket_bytes = bucket_bytes
        self.versions = tuple(versions)
        self.kill_at = kill_at
        self.fast_fill = fast_fill
        self.verify = verify  # True: compare every version; a tuple: only those versions
        self.progress = progress
        self.controls: dict[int, zmq.Socket] = {}
        self.procs: list = []
        self.managers = []
        self.messages: list[dict] = []
        self.status = None
        # Short (ipc:// paths are limited to ~107 bytes), and named with this pid: a SIGKILLed run's directory
        # is swept by the next run (sim.leftovers).
        self.dir = tempfile.mkdtemp(prefix=leftovers.run_dir_prefix("sim"))
        try:
            self.shared_dir = os.path.join(self.dir, "shared")
            os.makedirs(self.shared_dir)
            self.status = zmq.Context.instance().socket(zmq.PULL)
            self.status.setsockopt(zmq.LINGER, 0)
            self.status.bind(f"ipc://{self.dir}/status.sock")
        except BaseException:
            self.close()
            raise

    def endpoint(self, rank: int) -> str:
        return f"ipc://{self.dir}/rank{rank}.sock"

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self) -> None:
        from weightsync.fixtures.models import build_models
        from weightsync.reference.manager import WeightManager

        mp = multiprocessing.get_context("spawn")
        self.phase = "starting the trainers"
        for rank in range(self.ranks):
            kill = (self.versions[0], self.kill_at) if rank == 0 and self.kill_at is not None else None
            hold = (self.versions[0], *self.hold_at) if rank == 0 and self.hold_at and self.hold_at[0] in ("bucket", "end") else None
            cfg = TrainerConfig(rank=rank, model=self.model, endpoint=self.endpoint(rank), status=f"ipc://{self.dir}/status.sock",
                                versions=self.versions, bucket_bytes=self.bucket_bytes, seed=self.seed + rank, path=self.path,
                                shared_dir=self.shared_dir, gpu_id=rank, timeout_s=max(30.0, 4 * self.timeout_s),
                                kill_at=kill, fast_fill=self.fast_fill, report_digests=self.verify, hold_at=hold)
            proc = mp.Process(target=trainer_main, args=(cfg,), name=f"sim-trainer-{rank}", daemon=True)
            # A trainer started is a trainer recorded (so that close() stops it), and it starts with
            # SIGINT/SIGTERM blocked until its own handlers are set.
            with interrupt.shielded(), interrupt.blocked():
                proc.start()
                self.procs.append(proc)
        for rank in range(self.ranks):
            with worker_identity(rank, self.ranks):
                if self.path == "bucket":
                    options = {"endpoint": self.endpoint(rank), "timeout_s": self.timeout_s, "progress": self._tick}
                    manager = WeightManager(build_models(self.model), load_strategy="ipc_bucket", options=options)
                else:
                    manager = WeightManager(build_models(self.model), load_strategy="ipc", shared_dir=self.shared_dir)
                    sock = zmq.Context.instance().socket(zmq.REQ)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(self.endpoint(rank))
                    self.controls[rank] = sock
            self.managers.append(manager)

    _lock = threading.Lock()
    _env_lock = threading.Lock()

    def _tick(self, nbytes: int) -> None:
        if self.progress is not None:
            with self._lock:
                self.progress(nbytes)

    def _wait_status(self, kind: str, version: int, ranks) -> None:
        """Wait for ``kind`` from every rank in ``ranks``; a trainer that died or failed is an error."""
        waiting = set(ranks)
        deadline = time.monotonic() + max(60.0, 4 * self.timeout_s)
        while True:
            while self.status.poll(0):  # read everything already sent before judging who is dead
                self.messages.append(protocol.decode(self.status.recv(), "trainer status", allowed=("ready", "sent", "failed")))
            for m in self.messages:
                if m.get("type") == "failed" and m.get("rank") in waiting:
                    raise RuntimeError(f"trainer {m['rank']} failed: {m.get('error')}")
                if m.get("type") == kind and m.get("version") == version:
                    waiting.discard(m.get("rank"))
            if not waiting:
                return
            dead = [r for r in sorted(waiting) if not self.procs[r].is_alive()]
            if dead and not self.status.poll(200):
                proc = self.procs[dead[0]]
                raise RuntimeError(f"trainer {dead[0]} (pid {proc.pid}) exited with code {proc.exitcode} before "
                                   f"reporting {kind} for version {version}")
            if time.monotonic() > deadline:
                raise protocol.TransferTimeout(f"trainers {sorted(waiting)} reported no {kind} for version {version}")
            self.status.poll(100)

    def _update(self, rank: int, version: int) -> None:
        manager = self.managers[rank]
        if manager.status.name != "CLEARED":
            manager.clear()
        if self.path == "bucket":
            manager.options["version"] = version
            manager.update()
            return
        control = self.controls[rank]
        for request in ("publish", "release"):
            control.send(protocol.encode({"type": request, "version": version}))
            if not control.poll(int(max(30.0, 4 * self.timeout_s) * 1000)):
                raise protocol.TransferTimeout(f"trainer {rank}: no reply to {request} of version {version}")
            protocol.decode(control.recv(), f"trainer {rank} control reply", allowed=("published", "released"))
            if request == "publish":
                # The ipc path opens handles on the *process's* current device (FLAGS_selected_gpus),
                # as CUDA does; ranks sharing this process take turns holding their identity.
                with self._env_lock, worker_identity(rank, self.ranks):
                    manager.update()
                self._tick(self.model.nbytes)

    def run_version(self, version: int) -> VersionResult:
        """One update on every rank, concurrently; then (if ``verify``) the digests of both ends compared."""
        result = VersionResult(version)
        self.phase = f"waiting for the trainers of version {version}"
        self._wait_status("ready", version, range(self.ranks))
        if self.hold_at == ("ready",) and version == self.versions[0]:
            interrupt.hold("ready", "orchestrator, every trainer ready")
        for manager in self.managers:  # clear first, outside the timed span: clearing is not transfer
            if manager.status.name != "CLEARED":
                manager.clear()
        self.phase = f"transfer of version {version}"
        start = time.perf_counter()
        pool = ThreadPoolExecutor(self.ranks, thread_name_prefix="sim-update")
        try:
            futures = {rank: pool.submit(self._update, rank, version) for rank in range(self.ranks)}
            interrupt.sliced(lambda seconds: not wait_futures(futures.values(), timeout=seconds).not_done, math.inf)
            for rank, fut in futures.items():
                try:
                    fut.result()
                except Exception as e:  # the update's own failure; an interruption goes on up
                    result.errors[rank] = e
        finally:
            # Interrupted: the updates still running wait on trainers that close() is about to stop;
            # never wait for them here (interrupt.exit_process does not either).
            pool.shutdown(wait=not interrupt.pending(), cancel_futures=True)
        result.seconds = time.perf_counter() - start
        ok_ranks = [r for r in range(self.ranks) if r not in result.errors]
        result.nbytes = self.model.nbytes * len(ok_ranks)
        self._wait_status("sent", version, ok_ranks)
        if self.verify is True or version in (self.verify or ()):
            self.phase = f"verification of version {version}"
            result.checks, result.models = self.compare(version, ok_ranks)
        return result

    def compare(self, version: int, ranks) -> tuple[list[TensorCheck], list[ModelCheck]]:
        """The model digest of what landed (``WeightManager.digest()``) against the one the trainer
        computed of what it sent (its ``sent`` report), tensor by tensor and whole."""
        checks, models = [], []
        for rank in ranks:
            sent = next(m["digest"] for m in self.messages
                        if m.get("type") == "sent" and m.get("rank") == rank and m.get("version") == version)
            landed = self.managers[rank].digest().as_dict()
            if self.hold_at == ("verify",) and version == self.versions[0]:
                interrupt.hold("verify", f"orchestrator, rank {rank} digested")
            for p in self.model.all_params:
                s, d = sent["tensors"].get(p.name, {}), landed["tensors"].get(p.name, {})
                checks.append(TensorCheck(rank, version, p.name, p.dtype, p.shape, s.get("xxh3", NOT_SENT),
                                          d.get("xxh3", NOT_LANDED), s.get("md5", NOT_SENT), d.get("md5", NOT_LANDED)))
            for name in sorted(set(sent["tensors"]) - {p.name for p in self.model.all_params}):
                checks.append(TensorCheck(rank, version, name, "?", (), sent["tensors"][name].get("xxh3", ""), NOT_LANDED))
            models.append(ModelCheck(rank, version, dict(sent["model"]), dict(landed["model"])))
        return checks, models

    def close(self) -> None:
        """Stop every trainer, remove every segment, socket and the run's directory; idempotent."""
        with interrupt.shielded():  # a signal now is raised once everything is released
            self._close()

    def _end_stragglers(self) -> None:
        """Wait for the trainers told to stop, all together, as long as their own kernel deadline
        (``interrupt.UNWIND_S``) and a little more; one still running then never saw its SIGTERM or never
        finished unwinding: its stacks are printed (SIGUSR1), it is named and SIGKILLed. (One join of 10 s
        per trainer once kept the CLI 10.3 s after a SIGTERM.)"""
        deadline = time.monotonic() + STOP_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        stuck = [(rank, proc) for rank, proc in enumerate(self.procs) if proc.is_alive()]
        for _, proc in stuck:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)  # faulthandler, set by interrupt.trainer_signals
        if stuck:
            time.sleep(0.5)  # the stacks are written before the kill
        for rank, proc in stuck:
            print(f"trainer {rank} (pid {proc.pid}) still running {STOP_S:g}s after SIGTERM: killed",
                  file=sys.stderr, flush=True)
            proc.kill()
            proc.join(5)

    def _close(self) -> None:
        if interrupt.pending():
            # Updates still running fail as their trainers go; the run reports the interruption instead.
            import logging

            logging.disable(logging.CRITICAL)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the trainer unwinds and unlinks its segments
        self._end_stragglers()
        for proc in self.procs:
            if proc.pid is not None:
                sweep_segments(proc.pid)  # a SIGKILLed trainer could not unlink its own
            if proc.exitcode is not None:
                proc.close()
        self.procs = []
        for manager in self.managers:
            getattr(manager, "close", lambda: None)()
        self.managers = []
        if not interrupt.pending():  # else an update thread may still poll one: the process exit closes them
            for sock in self.controls.values():
                sock.close()
        self.controls = {}
        if self.status is not None:
            self.status.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_roundtrip(*, versions: int = 3, progress=None, **kwargs) -> list[VersionResult]:
    """Run ``versions`` updates (1..versions); stops after the first version with a failed update."""
    results = []
    rt = None
    try:
        with interrupt.shielded():  # a signal while the run's directory and socket are made waits until rt owns them
            rt = Roundtrip(versions=tuple(range(1, versions + 1)), progress=progress, **kwargs)
        with rt:
            for version in rt.versions:
                results.append(rt.run_version(version))
                if results[-1].errors:
                    break
    except interrupt.Interrupted as e:
        e.phase = rt.phase if rt is not None else "start-up"  # for the message: what the signal interrupted
        raise
    finally:
        if rt is not None:
            rt.close()
    return results


def _short(h: str) -> str:
    return h[:12]


def render(results: list[VersionResult], console, model, ranks: int) -> int:
    """Per-tensor and per-model digests of both ends, throughput; the exit status (0, 1 a digest
    differs, 2 an update failed)."""
    from rich.table import Table

    status = 0
    last = results[-1]
    bad = [c for r in results for c in r.checks if not c.ok]
    rows = bad + [c for c in last.checks if c.ok]
    table = Table(title=f"Tensor digests sent vs landed, version {last.version}" + (" (and every mismatch)" if bad else ""))
    for col in ("rank", "v", "tensor", "dtype", "shape", "sent xxh3", "landed xxh3", "md5", "result"):
        table.add_column(col, justify="right" if col in ("rank", "v") else "left", no_wrap=True)
    for c in sorted(rows, key=lambda c: (c.version, c.rank)):
        table.add_row(str(c.rank), str(c.version), c.name, c.dtype, "x".join(map(str, c.shape)) or "()", _short(c.sent),
                      _short(c.landed), "equal" if c.sent_md5 == c.landed_md5 else "[bold red]differs[/]",
                      "OK" if c.ok else "[bold red]MISMATCH[/]")
    if rows:
        console.print(table)
    bad_models = [m for r in results for m in r.models if not m.ok]
    models = bad_models + [m for m in last.models if m.ok]
    if models:
        mt = Table(title=f"Model digests sent vs landed, version {last.version}" + (" (and every mismatch)" if bad_models else ""))
        for col in ("rank", "v", "sent xxh3", "landed xxh3", "sent md5", "landed md5", "result"):
            mt.add_column(col, justify="right" if col in ("rank", "v") else "left", no_wrap=True)
        for m in sorted(models, key=lambda m: (m.version, m.rank)):
            mt.add_row(str(m.rank), str(m.version), *(_short(d.get(alg, "-")) for alg in ("xxh3", "md5") for d in (m.sent, m.landed)),
                       "OK" if m.ok else "[bold red]MISMATCH[/]")
        console.print(mt)
    summary = Table(title="Throughput per version (all ranks' bytes / wall time of the concurrent updates)")
    for col in ("version", "ranks ok", "tensors OK", "models OK", "bytes", "seconds", "GB/s"):
        summary.add_column(col, justify="right")
    for r in results:
        ok, models_ok = sum(c.ok for c in r.checks), sum(m.ok for m in r.models)
        summary.add_row(str(r.version), f"{ranks - len(r.errors)}/{ranks}", f"{ok}/{len(r.checks)}",
                        f"{models_ok}/{len(r.models)}", f"{r.nbytes:,}", f"{r.seconds:.3f}",
                        "-" if r.errors else f"{r.gbps:.2f}")
        if ok != len(r.checks) or models_ok != len(r.models):
            status = 1
    console.print(summary)
    for r in results:
        for rank, e in sorted(r.errors.items()):
            console.print(f"[bold red]version {r.version}, rank {rank}: update failed:[/] {type(e).__name__}: {e}", highlight=False)
            status = 2
    if status:  # a rate of a run that failed or landed wrong bytes would read as a result
        why = "an update failed" if status == 2 else "a digest differs"
        console.print(f"no throughput reported: the run failed ({why})", highlight=False)
        return status
    total_bytes = sum(r.nbytes for r in results)
    total_s = sum(r.seconds for r in results)
    console.print(f"throughput: {total_bytes / max(total_s, 1e-9) / 1e9:.2f} GB/s ({total_bytes / MiB:,.0f} MiB landed in "
                  f"{total_s:.2f} s over {len(results)} version(s), model {model.nbytes / MiB:,.1f} MiB x {ranks} rank(s))",
                  highlight=False)
    return status


HOLD_PHASES = ("ready", "bucket:K", "end", "verify")


def _hold_phase(text: str) -> tuple:
    """``--hold-at``: ready | bucket:K | end | verify -> ("ready",), ("bucket", K), ("end",), ("verify",)."""
    kind, sep, k = text.partition(":")
    if kind == "bucket" and sep and k.isdigit():
        return ("bucket", int(k))
    if not sep and kind in ("ready", "end", "verify"):
        return (kind,)
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(HOLD_PHASES)} (K a bucket index)")


def _usage_problems(args, model, bucket_bytes: int | None) -> list[str]:
    """What makes no sense in these arguments, each naming the option and the value (empty: fine)."""
    problems = []
    for opt, value in (("--ranks", args.ranks), ("--versions", args.versions)):
        if value < 1:
            problems.append(f"{opt} {value}: must be at least 1")
    for opt, value in (("--model-mib", args.model_mib), ("--bucket-mib", args.bucket_mib), ("--timeout-s", args.timeout_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"{opt} {value}: must be a positive finite number")
    if args.path == "meta":
        problems += [f"{opt} applies to the bucket path only (--path meta)" for opt, given in
                     (("--bucket-mib", args.bucket_mib is not None), ("--kill-trainer-at", args.kill_trainer_at is not None),
                      ("--hold-at " + ":".join(map(str, args.hold_at or ())), bool(args.hold_at) and args.hold_at[0] in ("bucket", "end")))
                     if given]
    if args.kill_trainer_at is not None and args.hold_at:
        problems.append("--kill-trainer-at and --hold-at exclude each other (the trainer that holds is the one killed)")
    if problems or model is None:
        return problems
    if bucket_bytes is not None:
        requested = int(args.bucket_mib * MiB)
        if requested < protocol.ALIGN:
            return [f"--bucket-mib {args.bucket_mib:g} is {requested} bytes, less than the {protocol.ALIGN}-byte alignment "
                    "of every entry: no tensor fits"]
    problems = _resource_problems(model, args.ranks, bucket_bytes)
    points = [(opt, k) for opt, k in (("--kill-trainer-at", args.kill_trainer_at),
                                      ("--hold-at bucket:K", args.hold_at[1] if args.hold_at and args.hold_at[0] == "bucket" else None))
              if k is not None]
    if points and not problems:
        buckets = len(protocol.plan_layout([(p.name, p.nbytes) for p in model.all_params], bucket_bytes))
        problems += [f"{opt} {k}: version 1 has {buckets} bucket(s) of {bucket_bytes / MiB:g} MiB, numbered 0..{buckets - 1}"
                     for opt, k in points if not 0 <= k < buckets]
    return problems


def _resource_problems(model, ranks: int, bucket_bytes: int | None) -> list[str]:
    """A run that cannot fit: each trainer's two buckets (or, on the meta path, its whole model) in
    /dev/shm; each rank's model twice in memory (the trainer's state, the worker's parameters)."""
    import psutil

    from .ipc_handles import SHM_DIR

    GiB = 1 << 30
    shm = ranks * (2 * bucket_bytes if bucket_bytes is not None else model.nbytes)
    shm_free = shutil.disk_usage(SHM_DIR).free
    ram = 2 * ranks * model.nbytes + shm
    ram_free = psutil.virtual_memory().available
    problems = []
    if shm > shm_free:
        problems.append(f"{ranks} rank(s) need {shm / GiB:.1f} GiB of {SHM_DIR}; {shm_free / GiB:.1f} GiB is free")
    if ram > ram_free:
        problems.append(f"a {model.nbytes / GiB:.1f} GiB model on {ranks} rank(s) needs about {ram / GiB:.1f} GiB of memory; "
                        f"{ram_free / GiB:.1f} GiB is available")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rt = sub.add_parser("roundtrip", help="trainers publish, reference workers receive, digests compared",
                        epilog="exit status: 0 every digest equal, 1 a digest differs, 2 an update failed or a usage "
                               "error, 130 SIGINT, 143 SIGTERM")
    rt.add_argument("--ranks", type=int, default=2)
    rt.add_argument("--model-mib", type=float, default=64)
    rt.add_argument("--bucket-mib", type=float, default=None, help="bucket size (bucket path; default 16)")
    rt.add_argument("--versions", type=int, default=3)
    rt.add_argument("--path", choices=("bucket", "meta"), default="bucket",
                    help="bucket: ipc_bucket over ZMQ; meta: the ipc_metas_{gpu} file of 7-field metas")
    rt.add_argument("--timeout-s", type=float, default=5.0, help="worker's timeout_s (longest trainer silence)")
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--kill-trainer-at", type=int, metavar="BUCKET", default=None,
                    help="SIGKILL rank 0's trainer while it packs this bucket of the first version")
    rt.add_argument("--hold-at", type=_hold_phase, metavar="PHASE", default=None,
                    help="pause version 1 at PHASE until a signal arrives (or 120 s pass), saying so on stderr: ready "
                         "(every trainer ready, no update started), bucket:K (rank 0's trainer, before bucket K), end "
                         "(rank 0's trainer, after the last bucket), verify (while digests are compared)")
    rt.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    problems = _usage_problems(args, None, None)
    if problems:
        parser.error("; ".join(problems))
    if args.path == "bucket" and args.bucket_mib is None:
        args.bucket_mib = 16.0
    model = model_spec(args.model_mib)
    bucket_bytes = protocol.align_up(int(args.bucket_mib * MiB)) if args.path == "bucket" else None
    problems = _usage_problems(args, model, bucket_bytes)
    if problems:
        parser.error("; ".join(problems))

    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # before Paddle's
    swept = leftovers.sweep_dead_runs()  # what SIGKILLed runs of ours left (their pid is dead)
    if swept:
        print(f"swept {len(swept)} leftover(s) of dead runs: {', '.join(swept[:6])}{' ...' if len(swept) > 6 else ''}",
              file=sys.stderr, flush=True)
    interrupt.install()
    try:
        import paddle  # noqa: F401  (imported here: it sets a SIGTERM handler of its own, replaced below)

        interrupt.install()
        return _roundtrip(args, model, bucket_bytes)
    except interrupt.Interrupted as e:
        where = getattr(e, "phase", None)  # unset: no trainer was running (start-up, the report)
        print(f"roundtrip {e}" + (f" during {where}: trainers stopped, their shared memory and the run's directory "
                                  "removed" if where else ""), file=sys.stderr, flush=True)
        return e.exit_status


def _roundtrip(args, model, bucket_bytes) -> int:
    from rich.console import Console
    from tqdm import tqdm

    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(f"model {model.nbytes / MiB:,.1f} MiB in {len(model.all_params)} tensors x {args.ranks} rank(s), "
                  f"{args.path} path" + (f", buckets of {bucket_bytes / MiB:g} MiB (x2 per trainer)" if bucket_bytes else "")
                  + f", versions 1..{args.versions}", highlight=False)
    bar = tqdm(total=model.nbytes * args.ranks * args.versions, unit="B", unit_scale=True, unit_divisor=1024,
               desc="landed", disable=args.no_progress, file=sys.stderr)
    try:
        results = run_roundtrip(versions=args.versions, progress=bar.update, ranks=args.ranks, model=model,
                                bucket_bytes=bucket_bytes or 16 * MiB, path=args.path, timeout_s=args.timeout_s,
                                seed=args.seed, kill_at=args.kill_trainer_at, hold_at=args.hold_at)
    except (RuntimeError, TimeoutError) as e:  # a trainer failed outside an update
        bar.close()
        console.print(f"[bold red]roundtrip failed:[/] {type(e).__name__}: {e}", highlight=False)
        return 2
    finally:
        bar.close()
    return render(results, console, model, args.ranks)


if __name__ == "__main__":
    interrupt.exit_process(main())
