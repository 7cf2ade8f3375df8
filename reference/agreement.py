"""Ranks agreeing through the process group before the status changes, every collective bounded.

FastDeploy takes a tensor-parallel barrier before rank 0 writes CLEARED or NORMAL (fd-spec §2.6-2.7).
A barrier says nothing about *what* each rank did, so here every rank contributes a vote (rank, epoch,
operation, ok, error) through one ``all_gather`` of the default group, and a rank whose peer failed
raises ``RankFailure`` naming it. Votes are msgpack in a fixed-size uint8 tensor: nothing is pickled.

Gloo collectives have no deadline of their own, so each one runs in a thread joined with the
agreement's timeout. A collective that misses its deadline or fails (a peer died) leaves the group in
an unknown state: the agreement is then broken, every later collective raises at once, and the rank
is expected to report and leave the job (its peers see the connection drop, never a hang).
Without an initialized group of two or more ranks every operation is local.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import msgpack
import numpy as np

VOTE_BYTES = 1024
ERROR_CHARS = 600  # of a failing rank's error, carried in its vote
DEFAULT_TIMEOUT_S = 60.0


class AgreementError(RuntimeError):
    """The ranks could not agree: a collective failed, or the votes are out of step."""


class RankFailure(AgreementError):
    """Another rank failed the operation; the message names every failing rank and its error."""


class AgreementTimeout(AgreementError, TimeoutError):
    """A collective missed its deadline; the group is unusable afterwards."""


@dataclass(frozen=True)
class Vote:
    rank: int
    epoch: int
    what: str
    ok: bool
    error: str = ""


def encode_vote(vote: Vote) -> np.ndarray:
    body = msgpack.packb([vote.rank, vote.epoch, vote.what, vote.ok, vote.error[:ERROR_CHARS]])
    if len(body) + 4 > VOTE_BYTES:  # an operation name long enough to overflow: never silently cut
        raise ValueError(f"vote of rank {vote.rank} for {vote.what!r} needs {len(body) + 4} bytes > {VOTE_BYTES}")
    out = np.zeros(VOTE_BYTES, np.uint8)
    out[:4] = np.frombuffer(struct.pack("<I", len(body)), np.uint8)
    out[4 : 4 + len(body)] = np.frombuffer(body, np.uint8)
    return out


def decode_vote(raw: np.ndarray, sender: int) -> Vote:
    data = raw.tobytes()
    (length,) = struct.unpack("<I", data[:4])
    try:
        fields = msgpack.unpackb(data[4 : 4 + length], ext_hook=_no_ext)
        rank, epoch, what, ok, error = fields
    except Exception as e:
        raise AgreementError(f"vote from rank {sender} is not readable ({type(e).__name__}: {e})") from None
    return Vote(int(rank), int(epoch), str(what), bool(ok), str(error))


def _no_ext(code, data):
    raise ValueError(f"msgpack extension type {code} refused")


def failures(votes: list[Vote]) -> list[Vote]:
    """The votes that failed."""
    return [v for v in votes if not v.ok]


def describe(failed: list[Vote]) -> str:
    return "; ".join(f"rank {v.rank}: {v.error or 'failed'}" for v in failed)


class Agreement:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = float(timeout_s)
        self.epoch = 0
        self.broken: str | None = None

    # -- the group -------------------------------------------------------------------------------
    @staticmethod
    def _dist():
        import paddle.distributed as dist

        return dist

    def world_size(self) -> int:
        dist = self._dist()
        return int(dist.get_world_size()) if dist.is_initialized() else 1

    def rank(self) -> int:
        return int(self._dist().get_rank())

    def declared_world_size(self) -> int:
        """The job's size as launched (``PADDLE_TRAINERS_NUM``), whether or not a group is up."""
        return int(self._dist().get_world_size())

    def _bounded(self, what: str, fn):
        """Run one collective in a thread joined with the deadline."""
        if self.broken:
            raise AgreementTimeout(f"rank {self.rank()}: cannot run {what}: the process group is unusable since {self.broken}")
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                box["error"] = e

        thread = threading.Thread(target=run, name=f"agreement-{what}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self.broken = f"{what} (epoch {self.epoch}) missed its {self.timeout_s:g}s deadline"
            raise AgreementTimeout(f"rank {self.rank()}: {what} (epoch {self.epoch}) did not complete within "
                                   f"{self.timeout_s:g}s: a peer is dead or stalled; the process group is now unusable")
        if "error" in box:
            e = box["error"]
            self.broken = f"{what} (epoch {self.epoch}) failed: {type(e).__name__}: {e}"
            raise AgreementError(f"rank {self.rank()}: {what} (epoch {self.epoch}) failed: {type(e).__name__}: {e}") from e
        return box["value"]

    # -- operations ------------------------------------------------------------------------------
    def vote(self, what: str, ok: bool, error: str = "") -> list[Vote]:
        """Every rank's vote for this operation, in rank order."""
        self.epoch += 1
        own = Vote(self.rank(), self.epoch, what, bool(ok), error)
        if self.world_size() < 2:
            return [own]
        import paddle

        dist = self._dist()
        mine = paddle.to_tensor(encode_vote(own))

        def gather():
            out: list = []
            dist.all_gather(out, mine)
            return [t.numpy() for t in out]

        raws = self._bounded(f"vote on {what}", gather)
        votes = [decode_vote(raw, sender) for sender, raw in enumerate(raws)]
        off = [v for v in votes if (v.epoch, v.what) != (own.epoch, own.what)]
        if off:
            self.broken = f"votes out of step at epoch {own.epoch}"
            raise AgreementError(f"rank {own.rank}: {what} (epoch {own.epoch}) is out of step with "
                                 + ", ".join(f"rank {v.rank} at {v.what} (epoch {v.epoch})" for v in off))
        return votes

    def require_all(self, what: str) -> None:
        """This rank succeeded; raise ``RankFailure`` if any other rank did not."""
        failed = failures(self.vote(what, True))  # (this rank's own vote is a success)
        if failed:
            raise RankFailure(f"rank {self.rank()}: {what} failed on {len(failed)} other rank(s): {describe(failed)}")

    def report_failure(self, what: str, error: BaseException) -> list[Vote]:
        """This rank failed: tell the others. Returns the votes of the *other* ranks that failed this
        operation too (empty when none did, or when telling failed: the group is broken, ``broken`` says
        why); the caller raises its own error either way, naming those ranks."""
        try:
            votes = self.vote(what, False, f"{type(error).__name__}: {error}")
        except AgreementError:
            return []
        return [v for v in failures(votes) if v.rank != self.rank()]

    def broadcast(self, value: int, src: int = 0) -> int:
        """Rank ``src``'s int32 ``value`` on every rank (the worker loop's status signal)."""
        if self.world_size() < 2:
            return int(value)
        import paddle

        dist = self._dist()
        box = paddle.to_tensor(np.array([value], np.int32))

        def send():
            dist.broadcast(box, src=src)
            return int(box.numpy()[0])

        return self._bounded("status broadcast", send)
