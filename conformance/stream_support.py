"""What the streamed paths' tests share (test_stream_rsync.py, test_stream_gdr.py, test_draft.py).

The trainer is ``sim.stream_trainer.StreamTrainer`` (the CheckpointTransfer stand-in's trainer end) on a
private ``ipc://`` endpoint, answering from a thread of the test process; the models get the suite's
``load_weights`` (fixtures.streams). Options follow SPEC.md "Streamed updates": ``rsync_config`` (the
library's settings: the trainer's ``endpoint`` and ``recv_bucket_timeout_s``, plus the ``gdr_*`` keys),
``version``, ``verify_checksum``.
"""
from __future__ import annotations

import os

import pytest

from weightsync.fixtures import streams as S

STRATEGY_CAPS = {"rsync": "stream.rsync", "gdr": "stream.gdr", "gdr_ipc": "stream.gdr_ipc"}


@pytest.fixture
def ct_trainer():
    """A stream trainer, closed after the test."""
    trainer = S.trainer()
    yield trainer
    trainer.close()


def open_stream(loader, trainer, spec, strategy: str, *, version="1", timeout_s: float = 5.0, worker=None,
                verify=None, mtp_start=None, loaders=None, **cfg):
    """A session on ``strategy`` fed by ``trainer``, its models given the suite's ``load_weights``
    (``loaders``: options of fixtures.streams.attach_loaders) and, with ``mtp_start``, their MTP layers.
    ``version`` None leaves the version to ``version.yaml``; a version is also published as ``version.yaml``
    (``fixtures.streams.publish_version``: FastDeploy's first load is a bootstrap that reads it). Returns (session, load record)."""
    options = {"rsync_config": S.rsync_config(trainer, timeout_s, **cfg)}
    if version is not None:
        options["version"] = version
    if verify is not None:
        options["verify_checksum"] = verify
    session = loader.open(spec, strategy=strategy, options=options, worker=worker)
    S.publish_version(loader.model_dir, version)  # a first load without the argument asks for the same
    record = S.attach_loaders(session.models, **(loaders or {}))
    if mtp_start is not None:
        S.mark_mtp_layers(session.models, mtp_start)
    return session, record


def socket_fds() -> int:
    """Socket descriptors this process holds (ZMQ closes them asynchronously: compare within a grace)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def case(strategy: str, *values, extra=(), id=None, modes=None):
    """A pytest.param for one streamed strategy, requiring its capability and ``extra``; ``modes``: the modes the
    case exercises besides its path (conformance/modes.py)."""
    marks = [pytest.mark.requires(STRATEGY_CAPS[strategy], *extra)]
    if modes:
        marks.append(pytest.mark.modes(**modes))
    return pytest.param(strategy, *values, marks=marks, id=id)


def both_gdr(*values, extra=("mtp",), modes=None, suffix=""):
    """The same case on ``gdr`` and ``gdr_ipc`` (GDR in the library's IPC mode)."""
    return [case(s, *values, extra=extra, modes=modes, id=s + suffix) for s in ("gdr", "gdr_ipc")]


def reraise(outcome) -> None:
    """Raise the exception of a ``concurrently`` outcome (for ``check.raises``); nothing if it succeeded."""
    error, _ = outcome
    if error is not None:
        raise error
