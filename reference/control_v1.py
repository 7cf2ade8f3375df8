"""The V1 control surface (FastDeploy >= 2.6; fd-spec §2.8; PRs #6052, #6761, #7042; SPEC.md § CTL): pause and
resume of request generation, sleep and wakeup by tag, update_weights in place, and the legacy pair routed
through sleep and wakeup (``FD_ENABLE_V1_UPDATE_WEIGHTS=1``), beside the legacy status-cell control.

One :class:`Control` per worker session, over its manager:

* **pause** stops new work and aborts the requests in flight: a request arriving once a pause began is refused
  before any step runs, one in flight ends (aborted) at its next step boundary, and ``pause()`` returns once no
  step runs; ``is_paused()`` is True from then on (FastDeploy since #6761: paused once drained, so that an
  update_weights that sees it paused never runs under a step). Re-entrant. **resume** is a no-op when not
  paused. ``is_paused()`` answers at once, whatever operation runs.
* **sleep(tags)** pauses, then releases exactly what its tags name, each tag on its own (a tag already asleep
  is skipped, never a reason to stop): ``weight`` clears every captured parameter, main and draft
  (``manager.clear()``: its agreement across ranks, CLEARED); ``kv_cache`` has the engine release its KV cache
  (``options["engine"].release_kv_cache()``).
* **wakeup(tags)** restores exactly what slept of its tags, the KV cache first (with ``options["cuda_graph"]``,
  a reload of the weights while the KV cache stays asleep is refused before anything changes: FastDeploy's
  message), then the weights: reloaded from the configured source by ``manager.update()`` (verified, agreed
  across ranks, recaptured through ``options["recapture"]`` before NORMAL); a reload that a failure left
  behind is cleared first. Only when every tag succeeded does it resume.
* **update_weights(version, verify_checksum)** is refused unless paused (FastDeploy's message) and while the
  weights sleep; it runs the session's streamed update in place with that version and checksum setting,
  announces the version (a step number) so that the commit stamps it, and never resumes. A refusal that wrote
  nothing leaves the committed weights to be served after a resume.

Every operation but pause and resume ends with one agreement across ranks (``manager.agreement``): a failure
on any rank fails it on every rank, and each rank then keeps what slept asleep (a KV cache rebuilt here while
another rank failed is released again, one released is rebuilt). Operations run one at a time; ``is_paused()`` never waits for them.
Planning (the tags) is :func:`parse_tags`; the rest applies.
"""
from __future__ import annotations

import itertools
import threading

from . import commit
from .agreement import AgreementError
from .errors import OperationInProgressError
from .status import Status

TAGS = ("weight", "kv_cache")
# FastDeploy's messages (fd-spec §2.8), word for word.
PAUSE_FIRST = "Pause LLM Engine first before calling updating weights"
GRAPH_ORDER = ("Waking up [weight] alone is not supported when CUDA Graph is enabled, as recapturing the graph "
               "requires the KV cache to be rebuilt first. Please wake up [kv_cache] first.")
PAUSE_TIMEOUT_S = 60.0  # FastDeploy waits 60 s for the workers' in-flight requests


class TagError(ValueError):
    """A sleep or wakeup named no tag, or tags the engine does not know."""


def parse_tags(tags) -> tuple[str, ...]:
    """The tags of a call, in the engine's order: None means every tag; a comma-separated str or a sequence of
    names; an unknown or empty name is a TagError naming each one and the known tags."""
    if tags is None:
        return TAGS
    names = tags.split(",") if isinstance(tags, str) else list(tags)
    bad = [t for t in names if not isinstance(t, str) or t.strip() not in TAGS]
    if bad or not names:
        raise TagError(f"unknown tag(s) {bad or names!r}: the tags are {', '.join(TAGS)}")
    wanted = {t.strip() for t in names}
    return tuple(t for t in TAGS if t in wanted)


def _step_version(version) -> int | None:
    """A version the reference can stamp: a step number (int, or a str of decimal digits), or None."""
    if version is None:
        return None
    if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
        return version
    if isinstance(version, str) and version.isascii() and version.isdigit():
        return int(version)
    raise ValueError(f"update_weights: version {version!r} is not a step number (decimal digits)")


class _Request:
    __slots__ = ("aborted",)

    def __init__(self):
        self.aborted = False


class Control:
    """The control surface of one worker session (module docstring)."""

    def __init__(self, manager, options):
        self.manager = manager
        self.engine = options.get("engine")
        if self.engine is not None and not all(callable(getattr(self.engine, m, None))
                                               for m in ("release_kv_cache", "rebuild_kv_cache")):
            raise ValueError(f"options['engine'] must have release_kv_cache() and rebuild_kv_cache(), got {self.engine!r}")
        self.cuda_graph = options.get("cuda_graph", False)
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"options['cuda_graph'] must be a bool, got {self.cuda_graph!r}")
        self.asleep: set[str] = set()
        self.running: str | None = None  # the operation under way (the routed legacy API answers from it)
        self._cond = threading.Condition()
        self._paused = False  # is_paused(): set once a pause has drained the steps in flight
        self._rejecting = False  # a pause began: new requests are refused
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._stepping = 0
        self._op = threading.Lock()

    # -- pause, resume, requests -----------------------------------------------------------------------
    def is_paused(self) -> bool:
        with self._cond:
            return self._paused

    def pause(self) -> None:
        """Refuse new requests and abort those in flight at once; paused (``is_paused()``) once no step runs."""
        with self._cond:
            if self._paused:
                return
            self._rejecting = True
            for request in self._requests.values():
                request.aborted = True
            if not self._cond.wait_for(lambda: self._stepping == 0, PAUSE_TIMEOUT_S):
                raise TimeoutError(f"pause: {self._stepping} request step(s) still running after {PAUSE_TIMEOUT_S:g}s")
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = self._rejecting = False
            self._cond.notify_all()

    def generate(self, step, steps: int) -> tuple[str, int]:
        """One request: ``step(i)`` for each of its ``steps`` forward steps, each under the request gate, unless
        the engine pauses. Returns ("finished" | "aborted", steps run)."""
        with self._cond:
            if self._paused or self._rejecting:
                return "aborted", 0
            key, request = next(self._ids), _Request()
            self._requests[key] = request
        done = 0
        try:
            for i in range(steps):
                with self.manager.requests.forward():
                    with self._cond:
                        if request.aborted:
                            return "aborted", done
                        self._stepping += 1
                    try:
                        step(i)
                    finally:
                        with self._cond:
                            self._stepping -= 1
                            self._cond.notify_all()
                done += 1
            with self._cond:
                return ("aborted" if request.aborted else "finished"), done
        finally:
            with self._cond:
                del self._requests[key]

    # -- sleep and wakeup ------------------------------------------------------------------------------
    def _agreed(self, what: str, apply, undo=None) -> None:
        """``apply()`` on this rank, then every rank's vote; a peer's failure undoes this rank's success."""
        try:
            apply()
        except Exception as e:
            self.manager.agreement.report_failure(what, e)
            raise
        try:
            self.manager.agreement.require_all(what)
        except AgreementError:
            if undo is not None:
                undo()
            raise

    def _kv(self, release: bool) -> None:
        if self.engine is None:  # no KV cache handed in: nothing of the engine's to release or rebuild
            return
        if release:
            self._agreed("sleep kv_cache", self.engine.release_kv_cache, undo=self.engine.rebuild_kv_cache)
        else:
            self._agreed("wakeup kv_cache", self.engine.rebuild_kv_cache, undo=self.engine.release_kv_cache)

    def _run(self, name: str, fn):
        with self._op:
            self.running = name
            try:
                return fn()
            finally:
                self.running = None

    def sleep(self, tags=None) -> None:
        wanted = parse_tags(tags)
        self._run("sleep", lambda: self._sleep(wanted))

    def _sleep(self, wanted) -> None:
        self.pause()
        for tag in wanted:
            if tag in self.asleep:
                continue  # this tag only: the others are still released
            if tag == "weight":
                self.manager.clear()
            else:
                self._kv(release=True)
            self.asleep.add(tag)

    def wakeup(self, tags=None) -> None:
        wanted = parse_tags(tags)
        self._run("wakeup", lambda: self._wakeup(wanted))

    def _wakeup(self, wanted) -> None:
        reload = "weight" in wanted and "weight" in self.asleep
        if self.cuda_graph and reload and "kv_cache" in self.asleep and "kv_cache" not in wanted:
            raise RuntimeError(GRAPH_ORDER)
        if "kv_cache" in wanted and "kv_cache" in self.asleep:  # before the weights: their graphs need it
            self._kv(release=False)
            self.asleep.discard("kv_cache")
        if reload:
            if self.manager.status != Status.CLEARED:  # a failed reload left something behind
                self.manager.clear()
            self.manager.update()
            self.asleep.discard("weight")
        self.resume()

    # -- update in place -------------------------------------------------------------------------------
    def update_weights(self, version=None, verify_checksum: bool = False) -> dict:
        return self._run("update_weights", lambda: self._update_weights(version, verify_checksum))

    def _update_weights(self, version, verify_checksum) -> dict:
        if not self.is_paused():
            raise RuntimeError(PAUSE_FIRST)
        if "weight" in self.asleep:
            raise RuntimeError("update_weights: the weights are asleep; wake them up (wakeup with tag weight) "
                               "before updating them in place")
        manager = self.manager
        if manager.load_strategy not in manager.IN_PLACE:
            raise ValueError(f"update_weights updates in place: the {manager.load_strategy} strategy loads into "
                             f"cleared weights (in place: {', '.join(sorted(manager.IN_PLACE))})")
        if not isinstance(verify_checksum, bool):
            raise ValueError(f"update_weights: verify_checksum must be a bool, got {verify_checksum!r}")
        step = _step_version(version)
        if step is not None:  # refused before anything changes (the update would refuse it once under way)
            commit.check_forward(step, manager.version, f"update_weights on rank {manager.rank}")
        saved = {key: manager.options[key] for key in ("version", "verify_checksum") if key in manager.options}
        manager.options.update({"verify_checksum": verify_checksum}, **({} if version is None else {"version": str(version)}))
        try:
            return manager.update(version=step)
        except OperationInProgressError:
            raise  # another clear or update runs: its gate is its own (LIFE-CONCURRENT)
        except BaseException:
            # Refused before its commit vote and nothing written (rsync validates the whole step before it stores,
            # and its store is followed by the vote): the committed weights are intact, so the requests a resume
            # lets in may read them (the update shut the gate; a GDR update that applied items keeps it shut).
            if not manager.changed_since_commit and not manager._voted:
                manager.requests.open()
            raise
        finally:
            for key in ("version", "verify_checksum"):
                manager.options.pop(key, None)
            manager.options.update(saved)


class RoutedControl:
    """The legacy ``clear_load_weight`` / ``update_model_weight`` routed through sleep and wakeup
    (``FD_ENABLE_V1_UPDATE_WEIGHTS=1``; fd-spec §2.3, §2.8), answering as the legacy API does: from serving a
    clear sleeps every tag, from asleep it answers that the weights are cleared; from asleep an update wakes every
    tag, from serving it answers that they are updated and reloads nothing (fd-spec rule 31); while the other
    operation runs the legacy refusals; a failure is answered 500 naming it. ``timeout_s`` is the legacy
    signature's: the routed call runs the operation itself."""

    REFUSED = {("clear", "sleep"): (400, "worker is clearing model weight already"),
               ("clear", "wakeup"): (403, "worker is updating model weight, cannot clear now"),
               ("update", "wakeup"): (400, "worker is updating model weight already"),
               ("update", "sleep"): (403, "worker is clearing model weight, cannot update now")}

    def __init__(self, control: Control):
        self.control = control

    def _answer(self, verb: str, done: bool, already: str, operation) -> tuple[int, str]:
        refused = self.REFUSED.get((verb, self.control.running))
        if refused is not None:
            return refused
        if done:
            return 200, already
        try:
            operation(None)
        except Exception as e:  # noqa: BLE001 (answered)
            return 500, f"{verb} model weight failed: {type(e).__name__}: {e}"
        return 200, f"{verb} model weight successfully"

    def clear_load_weight(self, timeout_s: float) -> tuple[int, str]:
        return self._answer("clear", "weight" in self.control.asleep, "model weight is cleared", self.control.sleep)

    def update_model_weight(self, timeout_s: float) -> tuple[int, str]:
        return self._answer("update", "weight" not in self.control.asleep, "model weight is updated",
                            self.control.wakeup)
