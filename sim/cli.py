"""``python -m sim roundtrip``: trainer processes publish, reference workers receive, every tensor is compared.

One spawned trainer per rank publishes deterministic weights (``fixtures.models.state(spec, seed +
rank, version)``); one reference ``WeightManager`` per rank, in this process, receives them through
``ipc_bucket`` (or the ``ipc`` meta file with ``--path meta``). After each version every parameter's
sha256 as landed is compared with the sha256 the trainer reports for what it sent, and the run ends
with a per-tensor table and the throughput.
``--kill-trainer-at K`` SIGKILLs rank 0's trainer while it packs bucket K of the first version, to show
the worker's timeout error. Exit status: 0 all tensors OK, 1 a mismatch, 2 an update failed.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from wire import protocol
from .trainer import TrainerConfig, sweep_segments, trainer_main

MiB = 1 << 20


def model_spec(model_mib: float, layers: int = 2):
    """A decoder-shaped model of about ``model_mib`` MiB mixing every carried dtype: a bf16 embedding
    larger than typical buckets, fp8 weights with 0-d scales, an odd-sized uint8 tensor, bool, int64,
    and an empty tensor."""
    from fixtures.models import spec

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


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def landed_bytes(param) -> bytes:
    return b"" if 0 in param.shape else param.numpy().tobytes()


@dataclass
class TensorCheck:
    rank: int
    version: int
    name: str
    dtype: str
    shape: tuple
    sent: str
    landed: str

    @property
    def ok(self) -> bool:
        return self.sent == self.landed


@dataclass
class VersionResult:
    version: int
    nbytes: int = 0
    seconds: float = 0.0
    checks: list[TensorCheck] = field(default_factory=list)
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
                 progress=None):
        if path not in ("bucket", "meta"):
            raise ValueError(f"path must be 'bucket' or 'meta', got {path!r}")
        if kill_at is not None and path != "bucket":
            raise ValueError("--kill-trainer-at needs the bucket path")
        self.ranks, self.path, self.timeout_s, self.seed = ranks, path, timeout_s, seed
        self.model = model if model is not None else model_spec(model_mib)
        self.bucket_bytes = bucket_bytes
        self.versions = tuple(versions)
        self.kill_at = kill_at
        self.fast_fill = fast_fill
        self.verify = verify  # True: compare every version; a tuple: only those versions
        self.progress = progress
        self.dir = tempfile.mkdtemp(prefix="wscf-sim-")  # short: ipc:// paths are limited to ~107 bytes
        self.shared_dir = os.path.join(self.dir, "shared")
        os.makedirs(self.shared_dir)
        ctx = zmq.Context.instance()
        self.status = ctx.socket(zmq.PULL)
        self.status.setsockopt(zmq.LINGER, 0)
        self.status.bind(f"ipc://{self.dir}/status.sock")
        self.controls: dict[int, zmq.Socket] = {}
        self.procs: list = []
        self.managers = []
        self.messages: list[dict] = []

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
        from fixtures.models import build_models
        from reference.manager import WeightManager

        mp = multiprocessing.get_context("spawn")
        for rank in range(self.ranks):
            kill = (self.versions[0], self.kill_at) if rank == 0 and self.kill_at is not None else None
            cfg = TrainerConfig(rank=rank, model=self.model, endpoint=self.endpoint(rank), status=f"ipc://{self.dir}/status.sock",
                                versions=self.versions, bucket_bytes=self.bucket_bytes, seed=self.seed + rank, path=self.path,
                                shared_dir=self.shared_dir, gpu_id=rank, timeout_s=max(30.0, 4 * self.timeout_s),
                                kill_at=kill, fast_fill=self.fast_fill, report_hashes=self.verify)
            proc = mp.Process(target=trainer_main, args=(cfg,), name=f"sim-trainer-{rank}", daemon=True)
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
        """One update on every rank, concurrently; then (if ``verify``) every tensor compared."""
        result = VersionResult(version)
        self._wait_status("ready", version, range(self.ranks))
        for manager in self.managers:  # clear first, outside the timed span: clearing is not transfer
            if manager.status.name != "CLEARED":
                manager.clear()
        start = time.perf_counter()
        with ThreadPoolExecutor(self.ranks) as pool:
            futures = {rank: pool.submit(self._update, rank, version) for rank in range(self.ranks)}
            for rank, fut in futures.items():
                try:
                    fut.result()
                except BaseException as e:
                    result.errors[rank] = e
        result.seconds = time.perf_counter() - start
        ok_ranks = [r for r in range(self.ranks) if r not in result.errors]
        result.nbytes = self.model.nbytes * len(ok_ranks)
        self._wait_status("sent", version, ok_ranks)
        if self.verify is True or version in (self.verify or ()):
            result.checks = self.compare(version, ok_ranks)
        return result

    def compare(self, version: int, ranks) -> list[TensorCheck]:
        """sha256 of every parameter as landed vs as the trainer sent it (its ``sent`` report)."""
        checks = []
        for rank in ranks:
            sent = next(m["hashes"] for m in self.messages
                        if m.get("type") == "sent" and m.get("rank") == rank and m.get("version") == version)
            params = self.managers[rank].params
            for p in self.model.all_params:
                checks.append(TensorCheck(rank, version, p.name, p.dtype, p.shape, sent.get(p.name, "(not sent)"),
                                          sha256(landed_bytes(params[p.name]))))
        return checks

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the trainer unwinds and unlinks its segments
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            if proc.pid is not None:
                sweep_segments(proc.pid)  # a SIGKILLed trainer could not unlink its own
            if proc.exitcode is not None:
                proc.close()
        self.procs = []
        for manager in self.managers:
            getattr(manager, "close", lambda: None)()
        self.managers = []
        for sock in self.controls.values():
            sock.close()
        self.controls = {}
        self.status.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_roundtrip(*, versions: int = 3, progress=None, **kwargs) -> list[VersionResult]:
    """Run ``versions`` updates (1..versions); stops after the first version with a failed update."""
    results = []
    with Roundtrip(versions=tuple(range(1, versions + 1)), progress=progress, **kwargs) as rt:
        for version in rt.versions:
            results.append(rt.run_version(version))
            if results[-1].errors:
                break
    return results


def _short(h: str) -> str:
    return h[:16]


def render(results: list[VersionResult], console, model, ranks: int) -> int:
    from rich.table import Table

    status = 0
    last = results[-1]
    rows = [c for r in results for c in r.checks if not c.ok] + [c for c in last.checks if c.ok]
    table = Table(title=f"Sent vs landed, version {last.version}" + (" (and every mismatch)" if any(not c.ok for r in results for c in r.checks) else ""))
    for col in ("rank", "v", "tensor", "dtype", "shape", "sent sha256", "landed sha256", "result"):
        table.add_column(col, justify="right" if col in ("rank", "v") else "left", no_wrap=True)
    for c in sorted(rows, key=lambda c: (c.version, c.rank)):
        table.add_row(str(c.rank), str(c.version), c.name, c.dtype, "x".join(map(str, c.shape)) or "()", _short(c.sent),
                      _short(c.landed), "OK" if c.ok else "[bold red]MISMATCH[/]")
    if rows:
        console.print(table)
    summary = Table(title="Throughput per version (all ranks' bytes / wall time of the concurrent updates)")
    for col in ("version", "ranks ok", "tensors OK", "bytes", "seconds", "GB/s"):
        summary.add_column(col, justify="right")
    for r in results:
        ok = sum(c.ok for c in r.checks)
        summary.add_row(str(r.version), f"{ranks - len(r.errors)}/{ranks}", f"{ok}/{len(r.checks)}", f"{r.nbytes:,}",
                        f"{r.seconds:.3f}", f"{r.gbps:.2f}")
        if ok != len(r.checks):
            status = 1
    console.print(summary)
    for r in results:
        for rank, e in sorted(r.errors.items()):
            console.print(f"[bold red]version {r.version}, rank {rank}: update failed:[/] {type(e).__name__}: {e}", highlight=False)
            status = 2
    total_bytes = sum(r.nbytes for r in results)
    total_s = sum(r.seconds for r in results)
    console.print(f"throughput: {total_bytes / max(total_s, 1e-9) / 1e9:.2f} GB/s ({total_bytes / MiB:,.0f} MiB landed in "
                  f"{total_s:.2f} s over {len(results)} version(s), model {model.nbytes / MiB:,.1f} MiB x {ranks} rank(s))",
                  highlight=False)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rt = sub.add_parser("roundtrip", help="trainers publish, reference workers receive, tensors compared")
    rt.add_argument("--ranks", type=int, default=2)
    rt.add_argument("--model-mib", type=float, default=64)
    rt.add_argument("--bucket-mib", type=float, default=16)
    rt.add_argument("--versions", type=int, default=3)
    rt.add_argument("--path", choices=("bucket", "meta"), default="bucket",
                    help="bucket: ipc_bucket over ZMQ; meta: the ipc_metas_{gpu} file of 7-field metas")
    rt.add_argument("--timeout-s", type=float, default=5.0, help="worker's timeout_s (longest trainer silence)")
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--kill-trainer-at", type=int, metavar="BUCKET", default=None,
                    help="SIGKILL rank 0's trainer while it packs this bucket of the first version")
    rt.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.versions < 1 or args.model_mib <= 0 or args.bucket_mib <= 0:
        parser.error("--ranks, --versions, --model-mib and --bucket-mib must be positive")

    import logging

    from rich.console import Console
    from tqdm import tqdm

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(width=None if sys.stdout.isatty() else 130)
    model = model_spec(args.model_mib)
    bucket_bytes = protocol.align_up(int(args.bucket_mib * MiB))
    console.print(f"model {model.nbytes / MiB:,.1f} MiB in {len(model.all_params)} tensors x {args.ranks} rank(s), "
                  f"{args.path} path" + (f", buckets of {bucket_bytes / MiB:g} MiB (x2 per trainer)" if args.path == "bucket" else "")
                  + f", versions 1..{args.versions}", highlight=False)
    bar = tqdm(total=model.nbytes * args.ranks * args.versions, unit="B", unit_scale=True, unit_divisor=1024,
               desc="landed", disable=args.no_progress, file=sys.stderr)
    try:
        results = run_roundtrip(versions=args.versions, progress=bar.update, ranks=args.ranks, model=model,
                                bucket_bytes=bucket_bytes, path=args.path, timeout_s=args.timeout_s, seed=args.seed,
                                kill_at=args.kill_trainer_at)
    except (RuntimeError, TimeoutError) as e:  # a trainer failed outside an update
        bar.close()
        console.print(f"[bold red]roundtrip failed:[/] {type(e).__name__}: {e}", highlight=False)
        return 2
    finally:
        bar.close()
    return render(results, console, model, args.ranks)


if __name__ == "__main__":
    sys.exit(main())
