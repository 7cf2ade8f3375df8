"""What both streamed paths (rsync, GDR) owe whatever the library does: nothing left behind. Spec: SPEC.md
§ STREAM (STREAM-HANG-BOUNDED: test_stream_timing.py).
"""
import asyncio
import time

import pytest

from conformance import check
from conformance.stream_support import FAULT_TIMEOUT_S, case, ct_trainer, open_stream, socket_fds  # noqa: F401
from fixtures import models as M
from fixtures import streams as S

pytestmark = pytest.mark.streams

SPEC = M.spec(("model.layers.0.q.weight", "bfloat16", (4, 4)), ("model.layers.1.mlp.weight", "float32", (4, 8)),
              ("model.norm.weight", "float16", (4,)))


def _failures(strategy, session, state):
    """(name, stream, prepare) of the failing updates each path goes through."""
    def loader_breaks():
        session.models[0].load_weights.fail_at = 1

    broken = [("stream breaks mid-way", S.stream_of(state, fault=("fail", 1)), None),
              ("stream cancelled", S.stream_of(state, fault=("cancel", 2)), None)]
    if strategy == "rsync":
        return broken + [("shape mismatch", S.stream_of({**state, "model.norm.weight": state["model.norm.weight"].reshape(2, 2)}), None)]
    return broken + [("loader fails", S.stream_of(state), loader_breaks)]


@pytest.mark.rule("STREAM-NO-LEAK")
@pytest.mark.parametrize("strategy", [case("rsync"), case("gdr")])
def test_nothing_left_after_close(loader, ct_trainer, strategy):
    """A success, each kind of failure, a success, then close(): no thread or socket of the session is
    left, and every library handle it initialized was cleaned up."""
    state = M.state(SPEC, version=2)
    session, _ = open_stream(loader, ct_trainer, SPEC, strategy, timeout_s=FAULT_TIMEOUT_S)
    failures = _failures(strategy, session, state)
    ct_trainer.serve(S.stream_of(state), *(stream for _, stream, _ in failures), S.stream_of(state))
    threads, sockets = check.live_threads(), socket_fds()  # the trainer's own already among them
    session.update()
    for name, _, prepare in failures:
        if prepare:
            prepare()
        with check.raises((Exception, asyncio.CancelledError), match=".", where=f"{strategy}: {name}"):
            session.update()
        session.models[0].load_weights.fail_at = None
    session.update()
    check.params_equal(session.observe(), state, f"{strategy}: after the failures")
    session.close()
    where = f"{strategy}: after close()"
    check.no_new_threads(threads, where)
    deadline = time.monotonic() + 2.0
    while socket_fds() > sockets and time.monotonic() < deadline:
        time.sleep(0.02)
    check.that(socket_fds() <= sockets, f"{where}: {socket_fds()} socket descriptors, {sockets} before the first update")
    registered = {r["handle"] for r in ct_trainer.of("register")}
    check.that(ct_trainer.wait_for(lambda: registered <= {u["handle"] for u in ct_trainer.of("unregister")}, 2.0),
               f"{where}: handles never cleaned up: {sorted(registered - {u['handle'] for u in ct_trainer.of('unregister')})}")
