"""The ``ipc_bucket`` strategy: flat uint8 buckets in shared memory, announced by msgpack manifests
over ZMQ (SPEC.md "Async IPC buckets"; wire format in ``wire.protocol``, the receiver's checks in
``reference.bucket_checks``).

Options (``LoaderConfig.options``): ``endpoint`` (``ipc://...`` or ``tcp://127.0.0.1:port``, where
the trainer has bound), ``version`` (expected version; absent: the first manifest's), ``timeout_s``
(longest silence tolerated from the trainer, default 5 s) and, for in-process callers only,
``progress`` (called with the byte count of each bucket copied).

Atomicity: each bucket is validated completely before a byte of it is read, then copied into Paddle
tensors this worker owns, then acknowledged. The model's parameters adopt those tensors only after
the end message checks out (bucket count, tensor count, name digest) and every parameter arrived. A
failure at bucket k thus leaves the model exactly as ``clear()`` left it. The price is that a whole
update is staged at once, as the snapshot path holds a whole file.
"""
from __future__ import annotations

import logging
import math
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import paddle
import zmq

from weightsync.wire import protocol
from weightsync.wire.handles import Segment

from . import apply, ties
from . import bucket_checks as checks
from .dtypes import paddle_dtype
from .host_memory import advise_huge_pages, writable_bytes

log = logging.getLogger("reference.buckets")

DEFAULT_TIMEOUT_S = 5.0
CLOSE_LINGER_MS = 1000
# Shared memory is local by nature, so only local endpoints make sense; refusing others keeps the
# control socket off the network.
LOCAL_ENDPOINT = re.compile(r"^(ipc://.+|tcp://(127\.0\.0\.1|localhost|\[::1\]):\d+)$")


# The transport's account of the connection (a monitor socket). ZMQ drops a frame over MAXMSGSIZE together
# with the connection and, this being a protocol error, never reconnects; a peer that went away is
# reconnected to at once (CONNECT_DELAYED or CONNECT_RETRIED right after DISCONNECTED). A drop with no
# reconnect attempt within DROP_GRACE_S is therefore a refused frame, not a dead trainer.
_RECONNECTING = (zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECTED)
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED
DROP_GRACE_S = 0.1


class Link:
    """The receiver's REQ socket: every request gets exactly one reply within ``timeout_s``."""

    #: the largest frame taken in; ZMQ drops a larger one before it is buffered, ``parse`` refuses it
    max_frame = protocol.MAX_FRAME

    def __init__(self, endpoint: str, timeout_s: float):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        self.monitor = self.sock.get_monitor_socket(_MONITORED)
        self.sock.connect(endpoint)
        self.can_send = True

    def request(self, message: dict, where: str) -> dict:
        self.sock.send(protocol.encode(message))
        self.can_send = False
        return self.receive(where)

    def _dropped(self, dropped_at: float | None) -> float | None:
        """Read the monitor's events: when the connection dropped with no reconnect attempt since, else None."""
        from zmq.utils.monitor import parse_monitor_message

        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                dropped_at = time.monotonic()
            elif event in _RECONNECTING:
                dropped_at = None
        return dropped_at

    def receive(self, where: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        dropped_at = None
        while True:
            now = time.monotonic()
            until = deadline if dropped_at is None else min(deadline, dropped_at + DROP_GRACE_S)
            ready = dict(poller.poll(max(0, int((until - now) * 1000)))) if until > now else {}
            if self.sock in ready:
                break
            dropped_at = self._dropped(dropped_at)
            now = time.monotonic()
            if dropped_at is not None and (now >= dropped_at + DROP_GRACE_S or now >= deadline):
                raise protocol.ManifestError(
                    f"ipc_bucket: the trainer at {self.endpoint} sent a frame the transport refused while {where} was "
                    f"awaited: a frame over the {self.max_frame}-byte ({self.max_frame / (1 << 20):g} MiB) frame limit "
                    "(ZMQ MAXMSGSIZE drops it with the connection; the trainer was not reconnected to, so it is alive)"
                )
            if now >= deadline:
                raise protocol.TransferTimeout(
                    f"ipc_bucket: no message from the trainer at {self.endpoint} within {self.timeout_s:g}s while "
                    f"waiting for {where} (trainer dead or stalled)"
                )
        frame = self.sock.recv(copy=False).bytes
        self.can_send = True
        return self.parse(frame, f"message from {self.endpoint} for {where}")

    def parse(self, frame: bytes, where: str) -> dict:
        """A trainer's frame -> its message: msgpack only (never a pickle), within the frame limit."""
        return protocol.decode(frame, where, protocol.TRAINER_TYPES, limit=self.max_frame)

    def tell(self, message: dict) -> None:
        """Best effort, no reply expected (error reports, the final done)."""
        if self.can_send:
            try:
                self.sock.send(protocol.encode(message), zmq.NOBLOCK)
                self.can_send = False
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        # Bounded linger: a done or error just queued still reaches a live trainer (LINGER 0 would
        # drop it), and the caller never waits for it (the context, not close(), does the flushing).
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=CLOSE_LINGER_MS)


class Attachments:
    """The trainer's buffers mapped in this process, each handle opened once per update."""

    def __init__(self):
        self.segments: dict[bytes, Segment] = {}

    def get(self, handle: bytes) -> Segment:
        seg = self.segments.get(handle)
        if seg is None:
            seg = self.segments[handle] = Segment.attach(handle)
        return seg


def release(attached: Attachments) -> None:
    """Unmap every buffer: a mapping kept past the update pins the trainer's memory (slime #1731)."""
    for seg in attached.segments.values():
        seg.close()
    attached.segments.clear()


def _writable_bytes(tensor: paddle.Tensor, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's own allocation, so one copy lands the bytes in it; 2 MiB
    pages asked for before the first touch (the copy into fresh memory is then ~2.5x faster)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    advise_huge_pages(tensor.data_ptr(), nbytes)
    return writable_bytes(tensor, nbytes)


# Two copy threads: the trainer needs far less CPU packing a bucket than the worker needs landing it
# in fresh memory (page faults), so even on 2 cores the second thread wins (~1.5x on a 64 MiB bucket).
COPY_THREADS = 2
PARALLEL_MIN_BYTES = 8 << 20


class Staging:
    """Receiver-owned tensors of the update, filled chunk by chunk, adopted only at commit."""

    def __init__(self, targets, threads: int = COPY_THREADS):
        self.targets = targets
        self.tensors: dict[str, paddle.Tensor] = {}
        self._bytes: dict[str, np.ndarray] = {}
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def dest(self, e: checks.Entry) -> np.ndarray:
        view = self._bytes.get(e.name)
        if view is None:
            tensor = paddle.empty(list(e.shape), dtype=paddle_dtype(e.dtype))
            self.tensors[e.name] = tensor
            # Sized from the tensor itself, not the manifest, so no manifest can write past it.
            nbytes = math.prod(e.shape) * tensor.element_size()
            view = self._bytes[e.name] = _writable_bytes(tensor, nbytes)
        return view

    def copy(self, jobs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for every job, split over the copy threads when large."""
        total = sum(d.nbytes for d, _ in jobs)
        if self.threads < 2 or total < PARALLEL_MIN_BYTES or any(d.nbytes != s.nbytes for d, s in jobs):
            for d, s in jobs:
                np.copyto(d, s)  # (a size mismatch raises here, never silently)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="bucket-copy")
        share = -(-total // self.threads)
        parts: list[list] = [[]]
        room = share
        for d, s in jobs:
            while d.nbytes > room and len(parts) < self.threads:
                parts[-1].append((d[:room], s[:room]))
                d, s = d[room:], s[room:]
                parts.append([])
                room = share
            parts[-1].append((d, s))
            room -= d.nbytes
        futures = [self._pool.submit(_copy_all, part) for part in parts[1:]]
        try:
            _copy_all(parts[0])  # numpy releases the GIL while copying
        finally:
            wait(futures)  # even on error: the buffer must not be unmapped under a running copy
        for f in futures:
            f.result()

    def drop_views(self) -> None:
        self._bytes.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _copy_all(jobs) -> None:
    for d, s in jobs:
        np.copyto(d, s)


def stage_bucket(staging: Staging, segment: Segment, entries) -> None:
    """Copy every entry of a validated bucket out of the trainer's buffer (before the ack)."""
    src = np.frombuffer(segment.buf, np.uint8)
    jobs = []
    try:
        for e in entries:
            dst = staging.dest(e)
            if e.nbytes:
                jobs.append((dst[e.chunk_offset : e.chunk_offset + e.nbytes], src[e.offset : e.end]))
        staging.copy(jobs)
    finally:
        del src, jobs  # no export of the mapping may outlive this call, or it could not be unmapped


def check_targets(bucket: checks.Bucket, targets, source: str) -> None:
    """dtype, then shape, against the model's parameter (the APPLY rules' errors)."""
    where = f"{source}, bucket {bucket.index} of version {bucket.version}"
    apply.raise_all([problem for e in bucket.entries  # every entry at fault (APPLY-EVERY-PROBLEM)
                     if (problem := apply.mismatch(e.name, e.dtype, e.shape, targets[e.name], where)) is not None])


def new_update_state(known, version) -> checks.UpdateState:
    return checks.UpdateState(known=frozenset(known), version=version)


def check_abort(message: dict, endpoint: str, state: checks.UpdateState) -> None:
    """A trainer's ``abort`` ends the update with its reason (never read as a malformed manifest)."""
    if message["type"] == protocol.ABORT:
        reason = message.get("message", "(no reason given)")
        raise RuntimeError(f"ipc_bucket: the trainer at {endpoint} aborted {state.where()}: "
                           f"{reason if isinstance(reason, str) else protocol.brief(reason)}")


def receive(link: Link, attached: Attachments, state: checks.UpdateState, staging: Staging, rank: int,
            progress=None) -> None:
    """Run the exchange up to a validated end message; every tensor is staged on return."""
    message = link.request(protocol.hello(state.version, rank), state.where())
    while True:
        check_abort(message, link.endpoint, state)
        kind = message["type"]
        if kind == protocol.END:
            checks.validate_end(message, state)
            return
        bucket = checks.parse_bucket(message, state)
        segment = attached.get(bucket.handle)
        checks.validate_bucket(bucket, state, segment.size)
        check_targets(bucket, staging.targets, link.endpoint)
        stage_bucket(staging, segment, bucket.entries)
        state.admit(bucket)
        if progress is not None:
            progress(sum(e.nbytes for e in bucket.entries))
        message = link.request(protocol.ack(bucket.version, bucket.index), state.where())


def commit(manager, state: checks.UpdateState, staging: Staging, source: str) -> None:
    """Adopt the staged tensors, one trace event per bucket that completed at least one tensor."""
    missing = ties.missing(manager.params, staging.tensors)  # a tied pair is complete by one name
    if missing:
        raise RuntimeError(
            f"ipc_bucket update of version {state.version} from {source} lacks {len(missing)} parameter(s): "
            + ", ".join(missing) + f"; {manager.landed_of_sent(len(manager.params) - len(missing), verb='arrived')}, "
            "nothing was applied"
        )
    staging.drop_views()
    by_bucket: dict[int, list[str]] = defaultdict(list)
    for name in state.order:
        by_bucket[state.completed_in[name]].append(name)
    for index in sorted(by_bucket):
        manager.apply(((n, staging.tensors[n]) for n in by_bucket[index]), f"bucket-{state.version}-{index}", source)


def _options(manager) -> tuple[str, int | None, float]:
    opts = manager.options
    endpoint = opts.get("endpoint")
    if not isinstance(endpoint, str) or not LOCAL_ENDPOINT.match(endpoint):
        raise ValueError(f"ipc_bucket needs options['endpoint'] = 'ipc://PATH' or 'tcp://127.0.0.1:PORT' where "
                         f"the trainer binds; got {endpoint!r}")
    version = opts.get("version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise ValueError(f"ipc_bucket options['version'] must be an int, got {version!r}")
    timeout = opts.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"ipc_bucket options['timeout_s'] must be a positive number of seconds, got {timeout!r}")
    return endpoint, version, float(timeout)


def update_from_buckets(manager) -> None:
    endpoint, version, timeout = _options(manager)
    state = new_update_state(manager.params, version)
    staging = Staging(manager.params)
    attached = Attachments()
    link = Link(endpoint, timeout)
    start = time.perf_counter()
    try:
        receive(link, attached, state, staging, manager.rank, manager.options.get("progress"))
        manager.announce(state.version)  # an older version is refused before anything is adopted
        release(attached)
        commit(manager, state, staging, endpoint)
        manager.finalize()  # every rank agreed and the update committed: only now is it done
        link.tell(protocol.done(state.version, len(state.order)))
    except BaseException as e:
        # Tell the trainer why (it is waiting for our next request), so it does not wait for a timeout.
        link.tell(protocol.error(state.version, state.next_bucket, f"{type(e).__name__}: {e}"))
        raise
    finally:
        staging.close()
        release(attached)
        link.close()
    seconds = time.perf_counter() - start
    log.info("ipc_bucket version %s: %d tensors, %d bytes in %d bucket(s) from %s in %.3fs (%.2f GB/s)",
             state.version, len(state.order), state.nbytes, state.next_bucket, endpoint, seconds,
             state.nbytes / max(seconds, 1e-9) / 1e9)
