"""The streamed paths' cases that wait out a timeout, for three rules (RSYNC-FAULTS, GDR-RECEIVER-ERROR,
STREAM-HANG-BOUNDED), run once and at once: one worker per case, each with its own trainer, all timed
updates started together, so that the module waits out one timeout instead of one per case. Each test then
judges its worker and updates it once more. Spec: SPEC.md § RSYNC, § GDR, § STREAM.
"""
import pytest

from conformance import check, harness
from conformance.plugin import ADAPTER_KEY
from conformance.stream_support import STRATEGY_CAPS, case, open_stream, reraise
from weightsync.fixtures import models as M
from weightsync.fixtures import streams as S

pytestmark = pytest.mark.streams

TIMING_SPEC_PARAMS = (("model.layers.0.q.weight", "bfloat16", (4, 4)), ("model.layers.1.mlp.weight", "float32", (4, 8)),
                      ("model.norm.weight", "float16", (4,)))
TIMING_PHASES = {"before-first": 0, "mid": 1, "after-last": 3}
VERSION = "31"  # the version every timing worker asks for: a timeout's message names it
HANG_CAP_S = 3.0  # the stand-in's session deadline: a hanging library gives up on its own after this
# The library's per-item wait of the stalls and hangs, which they all wait out together. It is also the wait of each
# case's next update, from a healthy trainer in this process: the consumer's 1.5 times it (1.2 s) holds beside a CI
# run and a second quick run (0.6 s did not). A failure must come within TIMING_BOUND_S: over the consumer's bound
# with room for a loaded machine, under HANG_CAP_S, so a loader that waits for the library's own deadline fails.
TIMING_WAIT_S = 0.8
TIMING_BOUND_S = 2.5
# The per-item wait of the two cases whose update must succeed, and the slow trainer's lateness per reply:
# each reply 0.6 s inside the wait (the 24 sessions of the run share one interpreter, and a trainer thread
# starved on a loaded machine must stay healthy: 0.28 s was not enough beside a CI run), 1.6 s in all, over
# the wait and over 1.5 times it (a loader that bounds the whole stream by its per-item wait, or by the
# reference's consumer bound of 1.5 times it, fails the slow case).
HEALTHY_WAIT_S = 1.0
SLOW_PAUSE_S = 0.4
TIMING_SCRIPTS = {
    **{f"stall-{p}": dict(fault=("stall", k)) for p, k in TIMING_PHASES.items()},
    **{f"hang-{p}": dict(fault=("hang", k)) for p, k in TIMING_PHASES.items()},
    "slow-but-healthy": dict(pause_s=SLOW_PAUSE_S),  # 4 replies, each 0.4 s late: 1.6 s in all
    "gone-after-end": dict(fault=("die-after-end", 3)),
}
HEALTHY = ("slow-but-healthy", "gone-after-end")


class TimingCase:
    """One worker of the timing run: its session and trainer, the versions it was served (1 loaded first on
    rsync, 2 the timed update, 3 queued for the judge's next update) and the timed update's outcome."""

    def __init__(self, strategy, name, session, trainer, states):
        self.strategy, self.name, self.session, self.trainer = strategy, name, session, trainer
        self.v1, self.v2, self.v3 = states
        self.outcome = (None, 0.0)

    @property
    def where(self) -> str:
        return f"{self.strategy}, trainer {self.name} ({self.trainer.endpoint})"


@pytest.fixture(scope="module")
def stream_timing(request, tmp_path_factory):
    """Every timing case of the streamed paths the implementation claims (stalls and library hangs at each
    phase, a slow trainer, a trainer gone after the end), one worker each; all timed updates run at
    once, so the whole run waits out one timeout. Yields ``{(strategy, case name): TimingCase}``; the rules'
    tests judge their cases and update once more. The rsync workers load version 1 first (their failures
    must leave it whole); a GDR worker's timed update is its first."""
    adapter = request.config.stash[ADAPTER_KEY]
    spec = M.spec(*TIMING_SPEC_PARAMS)
    states = tuple(M.state(spec, version=v) for v in (1, 2, 3))
    cases, trainers = {}, []
    with pytest.MonkeyPatch.context() as mp:
        loader = harness.Loader(adapter, tmp_path_factory.mktemp("stream-timing"), mp)
        try:
            for strategy in ("rsync", "gdr", "gdr_ipc"):
                if STRATEGY_CAPS[strategy] not in adapter.capabilities:
                    continue
                for name, script in TIMING_SCRIPTS.items():
                    trainers.append(S.trainer())
                    trainer = trainers[-1]
                    atomic = strategy == "rsync"  # its failures must leave version 1 whole: load it first
                    trainer.serve(*([S.stream_of(states[0])] if atomic else []), S.stream_of(states[1], **script),
                                  S.stream_of(states[2]))
                    session, _ = open_stream(loader, trainer, spec, strategy, version=VERSION,
                                             timeout_s=HEALTHY_WAIT_S if name in HEALTHY else TIMING_WAIT_S,
                                             session_total_timeout_s=HANG_CAP_S)
                    if atomic:
                        session.update()
                    cases[(strategy, name)] = TimingCase(strategy, name, session, trainer, states)
            outcomes = harness.concurrently({key: case.session.update for key, case in cases.items()})
            for key, case in cases.items():
                case.outcome = outcomes[key]
            yield cases
        finally:
            loader.close_all()
            for t in trainers:
                t.close()


def judge_timing(case: TimingCase, atomic: bool) -> None:
    """A timing case's verdict: stalls and hangs fail with a TimeoutError within TIMING_BOUND_S, leave the status not
    NORMAL (and, on an ``atomic`` path, version 1 whole), and the next update loads version 3; the slow
    trainer and the one gone after the end complete the update."""
    error, seconds = case.outcome
    where = case.where
    if case.name.startswith(("stall", "hang")):
        with check.raises(TimeoutError, match=".", names=[VERSION], where=where):  # what it waited for
            reraise(case.outcome)
        check.that(seconds < TIMING_BOUND_S, f"{where}: failed after {seconds:.2f}s, bound {TIMING_BOUND_S:g} s")
        if atomic:
            check.params_equal(case.session.observe(), case.v1, f"{where}: version 1 kept whole")
        check.status_not(case.session, "NORMAL", where)
        case.session.update()
        check.params_equal(case.session.observe(), case.v3, f"{where}: the next update")
    else:
        check.that(error is None, f"{where}: the update failed: {error!r}")
        check.params_equal(case.session.observe(), case.v2, where)
        check.status_is(case.session, "NORMAL", where)


PHASE_CASES = [pytest.param(f"stall-{p}", marks=pytest.mark.modes(phase=p), id=f"stall-{p}") for p in TIMING_PHASES] + [
    "slow-but-healthy", "gone-after-end"]


@pytest.mark.rule("RSYNC-FAULTS")
@pytest.mark.requires("stream.rsync", "status")
@pytest.mark.modes(start="loaded")
@pytest.mark.parametrize("name", PHASE_CASES)
def test_rsync_silence_at_every_phase(stream_timing, name):
    """rsync: silent before the first item, mid-stream or after the last item (a 0.8 s wait); slow (each reply
    0.4 s late: 1.6 s in all, over its 1.0 s wait); gone right after the end."""
    judge_timing(stream_timing[("rsync", name)], atomic=True)


@pytest.mark.rule("GDR-RECEIVER-ERROR")
@pytest.mark.requires("stream.gdr", "status")
@pytest.mark.modes(path="gdr", start="cleared")
@pytest.mark.parametrize("name", PHASE_CASES)
def test_gdr_silence_at_every_phase(stream_timing, name):
    """GDR: the same five cases."""
    judge_timing(stream_timing[("gdr", name)], atomic=False)


@pytest.mark.rule("STREAM-HANG-BOUNDED")
@pytest.mark.parametrize("name", [pytest.param(f"hang-{p}", marks=pytest.mark.modes(phase=p)) for p in TIMING_PHASES])
@pytest.mark.parametrize("strategy", [case(s, extra=("status",)) for s in ("rsync", "gdr", "gdr_ipc")])
def test_hung_library_does_not_hang_the_update(stream_timing, strategy, name):
    """A library that hangs (its own 0.8 s wait never fires; it gives up after 3 s) before the first item,
    mid-stream or after the last item."""
    judge_timing(stream_timing[(strategy, name)], atomic=strategy == "rsync")
