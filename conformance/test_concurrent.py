"""Concurrent calls on one session: a clear or an update that arrives while another runs. Spec: SPEC.md
LIFE-CONCURRENT (issue 30: ``clear()`` from another thread while ``update()`` ran was accepted, and either the
clear was undone or the status read CLEARED over loaded parameters).

One case per combination of the rule's modes, generated pairwise (``modes.params``): the path, the ordered pair
of operations (``pair``: the one held, then the one that arrives meanwhile; every pair on every path), where
the first is held (``hold``), plain or staged, the main model or main + draft, the session's first call of that
operation or a later one (``call``).
Each case:

1. brings a fresh session to the start of the first operation (call=first: nothing before an update, the first
   load before a clear; call=second: one more cycle before it);
2. starts the first operation on a thread of its own and holds it from outside (``conformance.holds``: a file
   under a lease, the trainer or the model's loader stopping, the recapture callable or a stale-state hook
   blocking, a forward pass in flight that a clear must drain);
3. looks at the session (status, every parameter, version), then calls the second operation from another
   thread and gives it ``REFUSE_S`` to be refused: an answer within it is a refusal (an Exception naming both
   operations; a return is a failure), none is a wait; the status is polled all along;
4. looks again: the second call, refused or waiting, changed nothing, and the status never contradicts the
   parameters;
5. lets the first go on: both must return within ``BOUND_S`` (a deadlock fails the case naming the call left);
   a second call that waited took its source from the trainer (the streamed paths) only after the first was let go;
6. judges: the first operation succeeded; the session holds what the last call that returned without raising
   left (status, every parameter bit for bit, version, digest);
7. recovery: a clear (where the path has one) and an update load the next version exactly.

Beside them, the re-entrant cases (``test_callback_calling_into_its_own_session_refused``): the second call comes
from the thread that runs the first, from inside a callback the loader calls during an update (the recapture
callable, capability ``model.recapture``; a stale-state hook, ``model.hooks``), pairwise over the path, plain or
staged, the model and the first or a later update. The callback calls ``clear()`` and then ``update()`` on its own
session, catching what each raised (nothing escapes into the loader), then a ``clear()`` from another thread. Judged:
each inner call refused at once (an Exception naming both operations), status, parameters and version unchanged;
the clear from another thread still refused (the refused calls did not let the session go) or held until the update
returned; the update's success, its version bit for bit, NORMAL, version and digest; then a clear and an update.
"""
from __future__ import annotations

import os
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conformance import check, harness, modes
from conformance.holds import CallHold, DrainHold, EventHold, HoldError, LeaseHold
from conformance.paths import route  # noqa: F401 (the fixture)
from weightsync.fixtures import buckets as B
from weightsync.fixtures import digests as D
from weightsync.fixtures import ipc as I
from weightsync.fixtures import models as M
from weightsync.fixtures import status_cell as C
from weightsync.fixtures import streams as S

RULE = "LIFE-CONCURRENT"
MAIN = (("embed.weight", "float32", (16, 16)), ("layers.0.mlp.weight", "bfloat16", (4, 4)),
        ("layers.1.mlp.weight", "float16", (4, 4)), ("norm.bias", "float32", (4,)))
MTP = (("model.layers.2.eh_proj.weight", "float32", (4, 4)), ("mtp_block.0.norm.weight", "bfloat16", (4,)))
SPECS = {"main": M.spec(*MAIN), "draft": M.spec(*MAIN, mtp=[MTP])}  # embed.weight fills one 1 KiB bucket alone
MTP_LAYER = 2  # the draft model serves layer 2 (GDR routes model.layers.2.* and mtp_* to it)

REFUSE_S = 2.0  # a refusal is a check of a flag: a second call not answered within this is taken as waiting
BOUND_S = 15.0  # every wait for a call to return, once nothing holds it (and for a hold to be reached)
IMPL_WAIT_S = 12.0  # the loader's own waits for its trainer (buckets' timeout_s, the stream library's), past every hold

FILE_PATHS = ("parts", "single", "legacy", "shared", "ipc")
IN_PLACE = ("rsync", "gdr")
VERSIONED = (*FILE_PATHS, "bucket")  # the paths whose source carries its version (version.yaml, the manifests)
ALGS = ("xxh3", "md5")


def _ops(combo) -> tuple[str, str]:
    """(the operation held, the one that arrives) of a combination's ``pair``."""
    first, second = combo["pair"].split("-")
    return first, second


def _valid(combo) -> bool:
    if _ops(combo)[0] == "clear":
        return combo["hold"] == "start"
    if combo["hold"] == "mid" and combo["path"] not in ("parts", "bucket", *IN_PLACE):
        return False
    # an update in place moves no storage: no recapture to hold it in (only the first load allocates)
    return not (combo["hold"] == "end" and combo["path"] in IN_PLACE and combo["call"] == "second")


def _requires(combo) -> list[str]:
    caps = [*modes.default_requires(combo), "status"]
    caps += {"end": ["model.recapture"], "after": ["model.hooks"]}.get(combo["hold"], [])
    if _ops(combo)[0] == "clear":
        caps.append("serve")  # the clear is held draining a forward pass in flight
    return caps


CASES = modes.params(RULE, requires=_requires, valid=_valid)
# Beside them, the cases a loader with the fewest capabilities can run (a path, status(), and mtp for the draft):
# an update held by its file or its trainer, a clear or an update arriving, every path, pairwise with the rest.
_BASIC = {"path": modes.declaration(RULE).axes["path"], "pair": ("update-clear", "update-update"),
          "hold": ("start", "mid"), "model": ("main", "draft"), "call": ("first", "second")}
CASES += [case for case in modes.params(RULE, axes=_BASIC, requires=_requires, valid=_valid)
          if {**case.values[0], "staged": "plain"} not in [c.values[0] for c in CASES]]


def _judge_refusal(at: str, second, op: str, second_op: str) -> None:
    """A second call that answered while the first was held: refused, with an Exception naming both operations."""
    check.that(second.error is not None,
               f"{at}: {second_op}() from another thread returned while {op}() was still held: it neither "
               f"waited for it nor was refused (a call that returns reports its work done)")
    check.that(isinstance(second.error, Exception),
               f"{at}: {second_op}() was refused with {type(second.error).__name__}, not an Exception")
    message = str(second.error)
    check.that(_names_both(message, op, second_op),
               f"{at}: {second_op}() was refused with {type(second.error).__name__}: {message!r}, which does "
               f"not name the operation in progress ({op}) and the one refused ({second_op})")


def _names_both(message: str, first: str, second: str) -> bool:
    return all(re.search(rf"\b{op}", message, re.IGNORECASE) for op in {first, second})


class Case:
    """One session of one combination, its trainer side and its oracle: ``committed`` is (version, state) of
    the last update that committed, or None; the session holds it unless it was cleared since (``loaded``)."""

    def __init__(self, route, loader, combo, callback=None):
        """``callback``: the callable handed to the loader at ``hold`` (end: the recapture callable; after: a
        stale-state hook) in place of a hold (the re-entrant cases, which carry no ``pair``)."""
        self.combo, self.loader = combo, loader
        self.path, self.hold_at = combo["path"], combo["hold"]
        self.op, self.second_op = _ops(combo) if "pair" in combo else ("update", None)
        self.where = f"{RULE} [{', '.join(f'{k}={v}' for k, v in combo.items())}]"
        self.caps = loader.adapter.capabilities
        self.rt = route(self.path)
        self.spec = SPECS[combo["model"]]
        self.names = [p.name for p in self.spec.all_params]
        options = {"staged": True} if combo.get("staged") == "staged" else {}
        if self.path == "bucket":
            self.rt.feed.WAIT_S = self.rt.feed.TIMEOUT_S = IMPL_WAIT_S
        if self.path in IN_PLACE:
            options["rsync_config"] = S.rsync_config(self.rt.feed._trainer(0), IMPL_WAIT_S,
                                                     discover_timeout_s=IMPL_WAIT_S)
        self.recapture = (callback or CallHold("in the recapture callable (every byte landed, before the commit)")) \
            if self.hold_at == "end" else None
        if self.recapture is not None:
            options["recapture"] = self.recapture
        self.session = self.rt.open(self.spec, options=options)
        if combo["model"] == "draft":
            S.mark_mtp_layers(self.session.models, MTP_LAYER)
        self.hook = None
        if self.hold_at == "after":
            self.hook = callback or CallHold("in a stale-state hook (committed, update() not yet returned)")
            self.session.register_hook("conformance-concurrent-hold", self.hook)
        self.committed: tuple[int, dict] | None = None
        self.loaded = False
        self.published = 0  # the newest version published

    # -- the trainer side ----------------------------------------------------------------------------
    def state(self, version: int) -> dict:
        return M.state(self.spec, version=version)

    def _layout(self):
        return [self.names[:2], self.names[2:]] if self.path == "parts" else None  # the draft's in the last part

    def publish(self, version: int, *, held: str | None = None, then: int | None = None):
        """Make ``version`` the next update's source; on the trainer paths queue ``then`` after it. ``held``
        ("start" or "mid"): the trainer or file holds that update there; returns the hold (None otherwise)."""
        self.published = max(self.published, version, then or 0)
        st = self.state(version)
        if self.path in FILE_PATHS:
            self.rt.publish(0, st, version, self._layout())
            C.write_version(self.loader.shared_dir if self.path == "ipc" else self.loader.model_dir, version)
            if held is None:
                return None
            if self.path == "ipc":
                target, what = I.meta_path(self.loader.shared_dir, 0), "the ipc meta file"
            else:
                files = self.rt.feed.written[0]
                target = files[-1] if held == "mid" else files[0]
                what = "the last part, the first landed" if held == "mid" and self.path == "parts" else "its first file"
            try:
                return LeaseHold(target, f"at the open of {what}, {os.path.basename(target)} (a write lease)")
            except HoldError as e:
                pytest.fail(f"{self.where}: {e}", pytrace=False)
        if self.path == "bucket":
            pub = self.rt.feed._publisher(0)
            pub.wait(BOUND_S)  # (the previous serve has ended)
            updates = [B.pack(dict(st), version, self.rt.feed.BUCKET_BYTES)]
            if then is not None:
                updates.append(B.pack(dict(self.state(then)), then, self.rt.feed.BUCKET_BYTES))
            k = None if held is None else (0 if held == "start" else len(updates[0].buckets) - 1)
            pub.holding.clear()
            pub.release.clear()
            # the second call's source is the update queued after the held one, or (nothing held) this one
            self._source_hello = len(pub.replies("hello")) + (2 if then is not None else 1)
            pub.serve(*updates, hold_before=k)
            return None if k is None else EventHold(pub.holding, pub.release,
                                                    f"with the trainer before bucket {k} of {len(updates[0].buckets)}")
        trainer = self.rt.feed._trainer(0)
        k = None
        if held is not None and self.path == "rsync":
            k = 0 if held == "start" else len(st) - 1
        stream = S.stream_of(dict(st), hold_before=k)
        queued = [S.stream_of(dict(self.state(then)))] if then is not None else []
        self._source_stream = queued[0] if queued else stream
        trainer.serve(stream, *queued)
        if k is not None:
            return EventHold(stream.holding, stream.release, f"with the trainer before item {k} of {len(st)}")
        if held is not None:  # gdr: the model's own loader holds
            draft = self.combo["model"] == "draft" and held == "mid"
            loader = self.session.models[1 if draft else 0].load_weights
            loader.hold_at = 0 if (held == "start" or draft) else len(st) - 1
            what = ("at the draft model's loader, its first item (the main model's landed)" if draft else
                    f"at the main model's loader, item {loader.hold_at} of {len(st)}")
            return EventHold(loader.holding, loader.release, what)
        return None

    def settle(self) -> None:
        if self.path == "bucket":
            self.rt.feed._publisher(0).wait(BOUND_S)

    def second_source_taken(self) -> bool:
        """On the trainer paths: whether an update took the source published for the second call (the version
        queued after the held update, or the one published before a held clear)."""
        if self.path == "bucket":
            return len(self.rt.feed._publisher(0).replies("hello")) >= self._source_hello
        return self.rt.feed._trainer(0).taken(self._source_stream)

    def second_source_taken_at(self) -> float | None:
        """On the streamed paths: when an update took the second call's source from the trainer (None: not
        taken). The trainer serves each receiver's stream on its own, a held one beside the others."""
        return self.rt.feed._trainer(0).taken_at(self._source_stream) if self.path in IN_PLACE else None

    # -- calls ---------------------------------------------------------------------------------------
    def call(self, name: str, fn, what: str) -> None:
        """A setup or recovery call, bounded: it must return."""
        c = harness.Call(name, fn)
        check.that(c.wait(BOUND_S), f"{self.where}: {what}: {name} had not returned {BOUND_S:g}s on")
        check.that(c.error is None, f"{self.where}: {what}: {name} {c.outcome()}")

    def update(self, version: int, what: str) -> None:
        try:
            self.call("update()", self.session.update, what)
        finally:
            self.settle()
        self.committed, self.loaded = (version, self.state(version)), True

    def clear(self, what: str) -> None:
        self.call("clear()", self.session.clear, what)
        self.loaded = False

    def setup(self) -> int:
        """Bring the session to the start of the first operation; returns the version its update holds (or
        the version loaded, before a held clear)."""
        again = self.combo["call"] == "second"
        if self.op == "update":
            if not again:
                return 1
            self.publish(1)
            self.update(1, "setup, the first load")
            if self.path not in IN_PLACE:
                self.clear("setup, the clear before the held update")
            return 2
        self.publish(1)
        self.update(1, "setup, the first load")
        if again:
            self.clear("setup, the first clear")
            self.publish(2)
            self.update(2, "setup, the second load")
        return self.committed[0]

    # -- what the session shows ----------------------------------------------------------------------
    def observe(self) -> dict:
        """The parameters as they are, read twice until two reads agree (a hold is a point where nothing moves)."""
        last = self.session.observe()
        for _ in range(5):
            time.sleep(0.005)
            now = self.session.observe()
            if now == last:
                break
            last = now
        return last

    def version(self):
        return self.session.version() if "version" in self.caps else None

    def ask(self, name: str, fn, at: str):
        """``fn()`` while an operation runs: it must answer at once (within ``REFUSE_S``), never waiting for it."""
        asked = harness.Call(name, fn)
        check.that(asked.wait(REFUSE_S), f"{at}: {name} had not answered {REFUSE_S:g}s on: it answers at once while "
                                         f"an operation runs, never waiting for it")
        check.that(asked.error is None, f"{at}: {name} {asked.outcome()}")
        return asked.result

    def looks(self, at: str, when: str):
        """(status(), every parameter, version()) while the first operation is held, each answering at once."""
        where = f"{at}, {when}"
        return (self.ask("status()", self.session.status, where), self.ask("observe()", self.observe, where),
                self.ask("version()", self.version, where))

    def digest_describes(self, obs, where: str) -> None:
        """While an operation runs, ``digest()`` answers at once: a RuntimeError, or the digest of the
        parameters as they are (``obs``: every one of them loaded)."""
        if "digest.model" not in self.caps:
            return
        asked = harness.Call("digest()", self.session.digest)
        check.that(asked.wait(REFUSE_S), f"{where} had not answered {REFUSE_S:g}s on (it answers at once)")
        if asked.error is not None:
            check.that(isinstance(asked.error, RuntimeError), f"{where} {asked.outcome()}; expected a digest of the "
                                                              "parameters as they are, or a RuntimeError")
            return
        unloaded = [n for n, o in obs.items() if o.data is None]
        check.that(not unloaded, f"{where} returned a model digest while {unloaded} hold no data (expected a "
                                 "RuntimeError: DIGEST-MODEL-INCOMPLETE)")
        held = {n: np.frombuffer(o.data, M.NUMPY_DTYPES[o.dtype]).reshape(o.shape) for n, o in obs.items()}
        want = D.model(held)["model"]
        got = asked.result.get("model") if isinstance(asked.result, dict) else asked.result
        check.that(isinstance(got, dict) and all(got.get(a) == want[a] for a in ALGS),
                   f"{where} model {got}, expected {want}: the digest of the parameters as they are")

    def loaded_names(self, obs) -> list[str]:
        return [n for n, o in obs.items() if o.data is not None and o.data != b""]

    def consistent(self, status: str, obs, committed, where: str) -> None:
        """The status never contradicts the parameters: CLEARED, nothing holds data; NORMAL, every parameter
        holds exactly ``committed`` (the state of the version last committed, or None)."""
        if status == "CLEARED":
            loaded = self.loaded_names(obs)
            check.that(not loaded, f"{where}: status() reads CLEARED while {len(loaded)} of {len(obs)} parameters "
                                   f"hold data: {loaded}")
        elif status == "NORMAL":
            check.that(committed is not None, f"{where}: status() reads NORMAL before any update committed; "
                                              f"{len(self.loaded_names(obs))} of {len(obs)} parameters hold data")
            check.params_equal(obs, committed, f"{where}: status() reads NORMAL, so every parameter must hold the "
                                               f"version last committed")
        else:
            check.that(status in ("UPDATING", "CLEARING"), f"{where}: status() read {status!r}")

    def digest_is(self, st, where: str) -> None:
        if "digest.model" not in self.caps:
            return
        want = D.model(st)["model"]
        try:
            got = self.session.digest()
        except Exception as e:  # noqa: BLE001 (judged)
            pytest.fail(f"{where}: digest() raised {type(e).__name__}: {e}; every parameter holds the committed "
                        "version, its digest is expected", pytrace=False)
        wrong = [a for a in ALGS if not isinstance(got, dict) or (got.get("model") or {}).get(a) != want[a]]
        check.that(not wrong, f"{where}: digest() model {got.get('model') if isinstance(got, dict) else got}, "
                              f"expected {want} (the weights the parameters hold)")

    def no_digest(self, where: str) -> None:
        if "digest.model" not in self.caps:
            return
        try:
            got = self.session.digest()
        except RuntimeError:
            check.that(True, where)
            return
        except Exception as e:  # noqa: BLE001 (judged)
            pytest.fail(f"{where}: digest() raised {type(e).__name__}: {e}; expected a RuntimeError (no parameter "
                        "holds data)", pytrace=False)
        pytest.fail(f"{where}: digest() returned {got.get('model') if isinstance(got, dict) else got} with no "
                    "parameter loaded; expected a RuntimeError (DIGEST-MODEL-INCOMPLETE)", pytrace=False)

    def holds(self, version: int, st: dict, where: str) -> None:
        """The session holds ``version`` after an update that returned: NORMAL, bit for bit, version, digest."""
        status = self.session.status()
        check.equal(status, "NORMAL", f"{where}: status() (the last call that returned was an update)")
        check.params_equal(self.session.observe(), st, f"{where}: every parameter holds version {version}")
        if self.path in VERSIONED and "version" in self.caps:
            check.equal(self.version(), version, f"{where}: version()")
        self.digest_is(st, where)

    def released(self, where: str) -> None:
        """The session holds nothing after a clear that returned: CLEARED, no parameter loaded, no digest."""
        check.equal(self.session.status(), "CLEARED", f"{where}: status() (the last call that returned was a clear)")
        obs = self.session.observe()
        loaded = self.loaded_names(obs)
        check.that(not loaded, f"{where}: {len(loaded)} of {len(obs)} parameters still hold data after a clear() "
                               f"that returned: {loaded}")
        self.no_digest(where)

    def close(self, *things) -> None:
        for thing in things:
            if thing is not None:
                thing.close()


@pytest.mark.rule("LIFE-CONCURRENT")
@pytest.mark.parametrize("combo", CASES)
def test_concurrent_calls_refused_or_held(route, loader, combo):  # noqa: F811 (route: the fixture)
    case = Case(route, loader, combo)
    session, op, second_op, where = case.session, case.op, case.second_op, case.where
    held_version = case.setup()
    # The second call's source, where it needs one: an update after a held update reads the same files (the
    # file paths) or the version queued after the held one (a trainer's); after a held clear, a new version.
    then = held_version + 1 if second_op == "update" and case.path not in FILE_PATHS else None
    hold = drain = None
    try:
        # -- 1. the first operation, held -----------------------------------------------------------------
        if op == "update":
            hold = case.publish(held_version, held=case.hold_at if case.hold_at in ("start", "mid") else None,
                                then=then)
            if case.hold_at == "end":
                hold = case.recapture
            elif case.hold_at == "after":
                hold = case.hook
            if isinstance(hold, CallHold):
                hold.arm()
            committed_at_hold = (case.state(held_version) if case.hold_at == "after"
                                 else case.committed[1] if case.committed and case.loaded else None)
        else:
            if second_op == "update":
                case.publish(held_version + 1, then=None)
                then = held_version + 1
            hold = drain = DrainHold(session, "draining a forward pass in flight (the clear begun, no byte changed)")
            check.that(drain.start(BOUND_S), f"{where}: a forward pass on the loaded version {held_version} did not "
                                             f"start within {BOUND_S:g}s (nothing was changing: it must run at once)")
            committed_at_hold = case.committed[1]
        version_before = case.version()
        first = harness.Call(f"the first operation, {op}()", session.update if op == "update" else session.clear)
        if drain is not None:
            drain.op = first
        at = f"{where}: {op}() held {hold.where}"
        reached = hold.reached(BOUND_S)
        check.that(reached, f"{at}: it never got there ({first.outcome()} {BOUND_S:g}s on)"
                   + (": a clear must wait for the forward passes in flight (SERVE-NO-MIXED-VERSIONS)"
                      if drain is not None and first.done.is_set() else ""))
        lost = (f"{at}: while its open() of the file was blocked, no other thread of the process ran for "
                f"{getattr(hold, 'grace_s', 0):g}s (the loader kept the interpreter lock): status() could not "
                "answer and no other call could arrive; a loader driven from several threads blocks only its own")
        check.that(not getattr(hold, "lost", False), lost)

        # -- 2. the second call, while the first is held -----------------------------------------------------
        status0, obs0, version0 = case.looks(at, "before the second call")
        case.consistent(status0, obs0, committed_at_hold, f"{at}, before the second call")
        if case.path in VERSIONED and "version" in case.caps:  # the version last committed (VER-STAMP-AT-COMMIT)
            stamped = held_version if op == "update" and case.hold_at == "after" else version_before
            check.equal(version0, stamped, f"{at}: version() (the version last committed)")
        case.digest_describes(obs0, f"{at}: digest()")
        # the threads blocked on the lease: the held operation's (one, where the kernel shows wait channels)
        openers = hold.openers_reach(1, 1.0) if isinstance(hold, LeaseHold) else None
        with harness.StatusWatcher(session, interval_s=0.0005) as watch:
            second = harness.Call(f"the second operation, {second_op}()",
                                  session.update if second_op == "update" else session.clear)
            answered = second.wait(REFUSE_S)
        if openers and not answered:
            check.that(hold.openers_reach(openers + 1, 0.5) <= openers,
                       f"{at}: {second_op}() from another thread is blocked opening {os.path.basename(hold.path)} "
                       f"too: it reads the files {op}() is reading, beside it, neither refused nor held until {op}() "
                       "returned")
        if answered:
            _judge_refusal(at, second, op, second_op)
        what = "refused" if answered else f"waiting ({REFUSE_S:g}s on)"
        status1, obs1, version1 = case.looks(at, f"with {second_op}() {what}")
        check.that(not watch.errors, f"{at}: status() raised while the second call was {what}: {watch.errors}")
        check.that(set(watch.seen) == {status0}, f"{at}: status() read {watch.seen} while {second_op}() was "
                                                 f"{what}; it read {status0} before and must not change")
        check.equal(status1, status0, f"{at}: status() after {second_op}() was {what}")
        changed = [n for n in obs0 if obs0[n] != obs1.get(n)]
        check.that(not changed, f"{at}: parameters changed while {second_op}() was {what} and {op}() held: {changed}")
        check.equal(version1, version0, f"{at}: version() after {second_op}() was {what}")
        case.consistent(status1, obs1, committed_at_hold, f"{at}, {second_op}() {what}")
        check.that(not (isinstance(hold, LeaseHold) and hold.let_go()), lost)  # (held all along)

        # -- 3. let go: both return ---------------------------------------------------------------------
        released_at = time.monotonic()
        hold.release()
        deadline = time.monotonic() + BOUND_S
        for call, other in ((first, second), (second, first)):
            check.that(call.wait(deadline - time.monotonic()),
                       f"{at}: {call.name} had not returned {BOUND_S:g}s after the hold was let go (deadlocked with "
                       f"{other.name}, which {other.outcome()})")
        if not answered and second.done.is_set() and second.ended_at < released_at:
            answered = True  # refused while the first was held, later than REFUSE_S (its thread ran late: loaded)
            _judge_refusal(at, second, op, second_op)
        took = case.second_source_taken_at() if then is not None else None
        if not answered and took is not None:  # (whatever the order in which the two then set their parameters)
            check.that(took >= released_at,
                       f"{at}: {second_op}() from another thread took its source (version {then}) from the trainer "
                       f"{released_at - took:.3f}s before {op}() was let go: it ran beside {op}(), neither refused "
                       f"nor held until {op}() returned")
        check.that(first.error is None, f"{at}: {first.name} {first.outcome()}; a call arriving while it ran must "
                                        f"not spoil it ({second.name} {second.outcome()})")
        if op == "update":
            case.committed, case.loaded = (held_version, case.state(held_version)), True
        else:
            case.loaded = False

        # -- 4. the outcome: what the last call that returned left ----------------------------------------
        after = f"{where}: after {op}() (held {hold.where}) and {second_op}() ({'refused' if answered else 'held'})"
        if not answered and second.error is None:  # it waited, then ran: its effect is the last
            if second_op == "update":
                version = held_version if op == "update" and case.path in FILE_PATHS else then
                case.committed, case.loaded = (version, case.state(version)), True
            else:
                case.loaded = False
        if not answered and second.error is not None:  # it waited, then failed: for a reason of its own
            check.that(second_op == "update" and isinstance(second.error, Exception),
                       f"{after}: {second_op}() waited and then {second.outcome()}; a call that waits runs whole once "
                       f"the other returned (a clear of a loaded model cannot fail)")
            committed = case.committed[1] if case.committed and case.loaded else None
            case.consistent(session.status(), session.observe(), committed, f"{after}: update() waited, then failed")
            if case.path in VERSIONED and "version" in case.caps and case.committed:
                check.equal(case.version(), case.committed[0], f"{after}: version() after the waiting update failed")
        elif case.loaded:
            case.holds(case.committed[0], case.committed[1], after)
        else:
            case.released(after)

        # -- 5. recovery -------------------------------------------------------------------------------
        if case.path not in IN_PLACE:
            case.clear("recovery")
        queued = then is not None and case.path not in FILE_PATHS and not case.second_source_taken()
        version = then if queued else case.published + 1
        if not queued:
            case.publish(version)
        case.update(version, f"recovery, version {version}")
        case.holds(version, case.state(version), f"{where}: recovery (clear and update of version {version})")
    finally:  # a case that failed half-way leaves nothing held
        case.close(hold if hold is not drain else None, drain)


# -- re-entrant calls: a callback the loader calls inside an update calls back into its own session ------------
# The recapture callable (capability model.recapture: every byte landed, before the commit) and a stale-state hook
# (model.hooks: committed, before update() returns) run on the thread of the update that calls them. A clear()
# or an update() they call on their own session arrives while that update runs, from the thread that runs it:
# refused at once (never run inside the update, never deadlocked), changing nothing, and the update, its
# callback returned, completes as if the callback had done nothing, still claiming the session until it returns.
# (A clear calls no callback of the loader's: the forward pass it drains is the caller's, on its caller's thread,
# which the cases above cover as a call from another thread.)
CALLBACKS = {"end": "the recapture callable (options['recapture']: every byte landed, before the commit)",
             "after": "a stale-state hook (register_hook: committed, update() not yet returned)"}
CALLBACK_CAPS = {"end": "model.recapture", "after": "model.hooks"}


class Reentry:
    """A callable handed to the loader (the recapture callable, a stale-state hook): a no-op until :meth:`arm`;
    then, on its next call (on the loader's own thread, inside the update), it calls ``clear()`` and then
    ``update()`` on its own session, catching what each raised (nothing escapes into the loader: the update's
    outcome stays its own) and looking at the session before and after each (``looks``); then it starts a
    ``clear()`` from another thread and gives it ``REFUSE_S`` to answer (``probe``: whether the update still
    claims the session, the inner calls having returned). ``calling`` names the call in progress (for a call
    that never returns)."""

    INNER = ("clear", "update")

    def __init__(self, where: str):
        self.where = where
        self.session = self.version = None
        self._armed = False
        self.calls = 0
        self.calling: str | None = None
        self.inner: dict[str, tuple[BaseException | None, float]] = {}  # op -> (what it raised, seconds)
        self.looks: list[tuple[str, object, object, object]] = []  # (when, status(), observe(), version())
        self.probe: harness.Call | None = None
        self.probe_answered = False
        self.crashed: BaseException | None = None
        self.done = threading.Event()

    def arm(self, session, version) -> None:
        self.session, self.version, self._armed = session, version, True

    def _look(self, when: str) -> None:
        got = []
        for fn in (self.session.status, self.session.observe, self.version):
            try:
                got.append(fn())
            except Exception as e:  # noqa: BLE001 (judged: they answer while an update runs)
                got.append(f"<raised {type(e).__name__}: {e}>")
        self.looks.append((when, *got))

    def __call__(self, *args, **kwargs) -> None:
        self.calls += 1
        if not self._armed:
            return
        self._armed = False
        try:
            self._look(f"in {self.where}, before its calls")
            for op in self.INNER:
                self.calling = f"{op}() from inside {self.where}"
                began = time.monotonic()
                try:
                    getattr(self.session, op)()
                    error = None
                except Exception as e:  # noqa: BLE001 (recorded and judged; never raised into the loader)
                    error = e
                self.inner[op] = (error, time.monotonic() - began)
                self._look(f"in {self.where}, after its {op}()")
            self.calling = f"{self.where}, waiting {REFUSE_S:g}s for a clear() from another thread"
            self.probe = harness.Call("clear() from another thread", self.session.clear)
            self.probe_answered = self.probe.wait(REFUSE_S)
            self.calling = None
        except Exception as e:  # noqa: BLE001 (judged)
            self.crashed = e
        finally:
            self.done.set()


def _reentry_valid(combo) -> bool:
    # an update in place moves no storage: only the first load on rsync and gdr calls a recapture
    return not (combo["hold"] == "end" and combo["path"] in IN_PLACE and combo["call"] == "second")


def _reentry_requires(combo) -> list[str]:
    return [*modes.default_requires(combo), "status", CALLBACK_CAPS[combo["hold"]]]


_DECLARED = modes.declaration(RULE).axes
_REENTRY = {"path": _DECLARED["path"], "hold": ("end", "after"), "staged": _DECLARED["staged"],
            "model": _DECLARED["model"], "call": ("first", "second")}
# each case calls clear() and then update() from inside the update: both pairs, update held at the callback
REENTRY_CASES = [pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.modes(pair=("update-clear",
                                                                                           "update-update"))])
                 for p in modes.params(RULE, axes=_REENTRY, requires=_reentry_requires, valid=_reentry_valid)]


@pytest.mark.rule("LIFE-CONCURRENT")
@pytest.mark.parametrize("combo", REENTRY_CASES)
def test_callback_calling_into_its_own_session_refused(route, loader, combo):  # noqa: F811 (route: the fixture)
    callback = Reentry(CALLBACKS[combo["hold"]])
    case = Case(route, loader, combo, callback=callback)
    session, where, cb = case.session, f"{case.where} (re-entrant)", callback.where
    held_version = case.setup()
    case.publish(held_version)
    callback.arm(session, case.version)
    outer = harness.Call(f"update() of version {held_version}", session.update)
    at = f"{where}: update() of version {held_version}, calling {cb}"
    try:
        # -- 1. the update returns (the callback's own calls bounded by the loader's waits for its trainer) -------
        bound = BOUND_S + IMPL_WAIT_S
        check.that(outer.wait(bound), f"{at}: update() had not returned {bound:g}s on: "
                                      + (f"deadlocked in {callback.calling}" if callback.calling
                                         else "the callback had returned"))
        case.settle()
        check.that(callback.done.is_set(), f"{at}: update() {outer.outcome()} without calling {cb} "
                                           f"({callback.calls} call(s) in all, none during this update)")
        check.that(callback.crashed is None, f"{at}: looking at the session from inside it raised "
                                             f"{type(callback.crashed).__name__}: {callback.crashed}")

        # -- 2. each call from inside: refused at once, with the rule's error, changing nothing ---------------
        before = callback.looks[0]
        check.that(not any(isinstance(v, str) and v.startswith("<raised") for v in before[1:3]),
                   f"{at}: status() / observe() {before[0]}: {before[1]!r}; they answer while an update runs")
        for (op, (error, took)), look in zip(callback.inner.items(), callback.looks[1:]):
            inside = f"{at}: {op}() called from inside it, on the update's own thread"
            check.that(error is not None,
                       f"{inside} returned after {took:.2f}s: it ran inside the update instead of being refused "
                       f"(update() is in progress on this session; a call that returns reports its work done)")
            _judge_refusal(inside, SimpleNamespace(error=error), "update", op)
            check.that(took <= REFUSE_S, f"{inside} was refused only {took:.2f}s on ({type(error).__name__}: "
                                         f"{error}); a refusal is at once, never a wait")
            check.equal(look[1], before[1], f"{inside}: status() after it was refused (before it)")
            changed = [n for n in before[2] if before[2][n] != look[2].get(n)]
            check.that(not changed, f"{inside}: parameters changed by a call that was refused: {changed}")
            check.equal(look[3], before[3], f"{inside}: version() after it was refused (before it)")

        # -- 3. the session is still claimed while the callback runs: a clear() from another thread ----------
        probe = callback.probe
        if callback.probe_answered:
            _judge_refusal(f"{at}: a clear() from another thread, {cb} having called clear() and update() "
                           f"(update() still running: the refused calls must not have let the session go)",
                           probe, "update", "clear")
        check.that(outer.error is None,
                   f"{at}: update() {outer.outcome()}; the callback's own calls were refused (caught inside it) and "
                   f"must not change the update's outcome")

        # -- 4. the update completed as if the callback had done nothing --------------------------------------
        after = f"{at}, its calls refused"
        if not callback.probe_answered:  # held: it ran once update() returned
            check.that(probe.wait(BOUND_S), f"{after}: the clear() from another thread, held, had not returned "
                                            f"{BOUND_S:g}s after update() returned")
            check.that(probe.error is None,
                       f"{after}: the clear() from another thread was held, then {probe.outcome()}")
            case.committed, case.loaded = (held_version, case.state(held_version)), False
            case.released(f"{after}, and a clear() from another thread held until update() returned")
        else:
            case.committed, case.loaded = (held_version, case.state(held_version)), True
            case.holds(held_version, case.state(held_version), after)

        # -- 5. recovery: the session, let go, takes a clear and an update ----------------------------------
        if case.path not in IN_PLACE and case.loaded:
            case.clear(f"{after}: a clear() once update() returned")
        version = case.published + 1
        case.publish(version)
        case.update(version, f"{after}: an update() of version {version} once update() returned")
        case.holds(version, case.state(version), f"{after}: then clear() and update() of version {version}")
    finally:
        callback._armed = False
