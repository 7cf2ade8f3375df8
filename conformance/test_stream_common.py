"""What both streamed paths (rsync, GDR) owe whatever the library does: no wait without end, nothing left
behind. Spec: SPEC.md § STREAM.
"""
import time

import pytest

from conformance import check
from conformance.stream_support import FAULT_TIMEOUT_S, case, concurrently, ct_trainer, open_stream, reraise, socket_fds  # noqa: F401
from fixtures import models as M
from fixtures import streams as S

pytestmark = pytest.mark.streams

SPEC = M.spec(("model.layers.0.q.weight", "bfloat16", (4, 4)), ("model.layers.1.mlp.weight", "float32", (4, 8)),
              ("model.norm.weight", "float16", (4,)))
HANG_CAP_S = 3.0  # the stand-in's session deadline: a library that hangs gives up on its own after this


@pytest.mark.rule("STREAM-HANG-BOUNDED")
@pytest.mark.requires("stream.rsync", "stream.gdr", "status")
def test_hung_library_does_not_hang_the_update(loader):
    """Six workers at once, rsync and GDR, each with a library that hangs (its own per-item wait of 0.15 s
    never fires) before the first item, mid-stream or after the last item: each update fails with a
    TimeoutError within 2 s, and the next one loads."""
    trainers, cases = [], {}
    v1, v2, v3 = (M.state(SPEC, version=v) for v in (1, 2, 3))
    try:
        for strategy in ("rsync", "gdr"):
            for phase, k in (("before-first", 0), ("mid", 1), ("after-last", 3)):
                trainers.append(S.trainer())
                trainers[-1].serve(S.stream_of(v1), S.stream_of(v2, fault=("hang", k)), S.stream_of(v3))
                session, _ = open_stream(loader, trainers[-1], SPEC, strategy, timeout_s=FAULT_TIMEOUT_S,
                                         session_total_timeout_s=HANG_CAP_S)
                session.update()
                check.params_equal(session.observe(), v1, f"{strategy}: first load")
                cases[f"{strategy}-hang-{phase}"] = session
        outcomes = concurrently({name: s.update for name, s in cases.items()})
        for name, session in cases.items():
            where = f"{name}: the library hangs"
            with check.raises(TimeoutError, match=".", where=where):
                reraise(outcomes[name])
            check.that(outcomes[name][1] < 2.0, f"{where}: the update ended after {outcomes[name][1]:.2f}s, bound 2 s")
            check.status_not(session, "NORMAL", where)
            session.update()
            check.params_equal(session.observe(), v3, f"{where}: the next update")
    finally:
        for t in trainers:
            t.close()


def _failures(strategy, session, state):
    """(name, stream, prepare) of the failing updates each path goes through."""
    def loader_breaks():
        session.models[0].load_weights.fail_at = 1

    broken = [("stream breaks mid-way", S.stream_of(state, fault=("fail", 1)), None),
              ("stream stalls", S.stream_of(state, fault=("stall", 1)), None)]
    if strategy == "rsync":
        return broken + [("unknown key", S.stream_of({**state, "zzz.unknown": state["model.norm.weight"]}), None)]
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
        with check.raises(Exception, match=".", where=f"{strategy}: {name}"):
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
