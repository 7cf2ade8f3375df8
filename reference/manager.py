"""The reference weight manager: FastDeploy's DynamicWeightManager contract, written fresh.

Lifecycle: ``clear()`` -> ``update()`` (load with the configured strategy, then ``finalize()``).
Status values follow ModelWeightsStatus; a failed update leaves the status at UPDATING (never
NORMAL) with the exception in ``last_error``. ``update()`` needs ``CLEARED``: after a failed update the
caller clears, then updates again (SPEC LIFE-RECOVERY; the contract always clears first).

Across ranks (``reference.agreement``): every rank votes at the end of a clear and of an update, a
failure included, and none reports CLEARED or NORMAL unless all succeeded; tensor-parallel rank 0 then
writes the shared status cell (``reference.status_cell``; never for the first load). ``finalize()`` is
the commit point every path shares: verify, agree, adopt what a staged update kept
(``reference.commit``), stamp the version, NORMAL.

One clear or update at a time (``reference.operations``, SPEC LIFE-CONCURRENT): a clear or an update that
arrives while another runs is refused at once with ``OperationInProgressError``, having changed nothing.
"""
from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import paddle

from . import apply, commit, hooks, identity, restart, storage, ties, transforms
from .request_gate import RequestGate
from . import digest as _digest
from .agreement import Agreement, RankFailure, describe
from .operations import OperationGuard
from .phases import Phases, pulled
from .status import Status
from .status_cell import CellWriter, StatusCell

log = logging.getLogger("reference.manager")

DEFAULT_SHARED_DIR = "/shared_ipc_meta"

# Strategy name -> "module:function" taking the manager. Imported lazily so that a path's extra
# dependencies (zmq for buckets) are only needed when that path is used. Named from this package's own name:
# "reference" in the checkout, "weightsync.reference" installed (weightsync/__init__.py).
STRATEGIES = {
    "ipc_snapshot": f"{__package__}.snapshot:update_from_snapshot",
    "ipc": f"{__package__}.ipc_meta:update_from_ipc_meta",
    "ipc_bucket": f"{__package__}.buckets:update_from_buckets",
    "rsync": f"{__package__}.rsync:update_from_rsync",
    "gdr": f"{__package__}.gdr:update_from_gdr",
    "gdr_ipc": f"{__package__}.gdr:update_from_gdr_ipc",
}
# Streamed strategies write into loaded parameters (FastDeploy runs rsync and GDR without a clear), so
# they may start from NORMAL, or again after a failure; never during a clear.
IN_PLACE_STRATEGIES = frozenset({"rsync", "gdr", "gdr_ipc"})


@dataclass(frozen=True)
class LoadEvent:
    label: str  # "snapshot-part{N}", "snapshot", "raw", "bucket-{version}-{index}"...
    source: str | None  # file path or endpoint the tensors came from
    applied: int
    seen: int


class WeightManager:
    def __init__(
        self,
        models,
        *,
        load_strategy: str = "ipc_snapshot",
        model_dir: str | None = None,
        shared_dir: str = DEFAULT_SHARED_DIR,
        env: Mapping[str, str] | None = None,
        options: Mapping | None = None,
    ):
        if load_strategy not in STRATEGIES:
            raise ValueError(f"Unsupported strategy: {load_strategy} (supported: {', '.join(STRATEGIES)})")
        self.load_strategy = load_strategy
        self.model_list = list(models) if isinstance(models, (list, tuple)) else [models]
        self.model_dir = model_dir
        self.shared_dir = shared_dir
        self.env = dict(os.environ if env is None else env)
        self.options = dict(options or {})
        self.rank = identity.global_rank()
        self.gpu_id = identity.physical_gpu_id(self.env)
        self.params = self._capture()
        self.post_load = transforms.plan(self.model_list)  # MODEL-*: declared post-load steps
        self.hooks = hooks.Hooks()  # MODEL-HOOKS: stale-state hooks an engine registers
        self.status = Status.CLEARED if not apply.still_loaded(self.params) else Status.NORMAL
        # SERVE-NO-MIXED-VERSIONS: forward passes (the engine's requests) against clears and updates
        self.requests = RequestGate(served=self.status == Status.NORMAL)
        self.trace: list[LoadEvent] = []
        self.ignored: list[str] = []  # names this update's sources carried that no parameter takes
        self.last_error: BaseException | None = None
        self.commit_options = commit.CommitOptions.parse(self.options)
        self.agreement = Agreement(self.commit_options.agree_timeout_s)
        self.cell = CellWriter(self.commit_options.status_cell,
                               self.commit_options.tp_rank(self.rank, self.agreement.declared_world_size()))
        if self.commit_options.kv_cache_cell is not None:
            StatusCell(self.commit_options.kv_cache_cell).close()  # a bad name or a missing cell: an error at open
        self.version: int | None = None  # of the last committed update
        self.first_load = True
        self.cell_at_startup: int | None = None  # the cell when the first load began (reference.restart)
        self.loop_started = False  # the worker loop's first pass recovers a cell a dead worker left
        self._stage: commit.Stage | None = None
        self._pending_version: int | None = None
        self._voted = self._committed = False
        # Set when an update changes loaded parameters before it can still fail (GDR hands items to the models'
        # loaders as they arrive; snapshot, ipc and buckets load into cleared parameters, rsync validates the
        # whole step before it stores), cleared by the commit: after such a failure no digest describes the
        # parameters (LIFE-FAILED-KEEPS-OLD).
        self.changed_since_commit = False
        self._storage_before = None  # MODEL-STORAGE-KEPT: where the parameters' memory was when the update began
        self.phases = Phases()  # of the last clear/update cycle
        self.operations = OperationGuard()  # LIFE-CONCURRENT: the clear or update in flight, if any

    def _capture(self) -> dict[str, paddle.Tensor]:
        # Never initialize here: capturing must not allocate (FastDeploy #7171, OOM on ipc).
        params: dict[str, paddle.Tensor] = {}
        owner: dict[str, int] = {}
        for index, model in enumerate(self.model_list):
            if transforms.is_frozen(model):  # MODEL-TRANSFORM-FROZEN: served as loaded at start-up
                continue
            for name, param in model.state_dict().items():
                if name in params:
                    raise ValueError(
                        f"parameter {name!r} appears in model {owner[name]} and model {index}; "
                        "main and MTP parameter names must be unique"
                    )
                params[name], owner[name] = param, index
        return params

    # -- clear -------------------------------------------------------------------------------
    IN_PLACE = IN_PLACE_STRATEGIES

    def clear(self, publish: bool = True) -> None:
        """``publish=False``: write nothing to the cell (a restarted worker releasing what the cell
        already says is released, ``reference.restart``)."""
        with self.operations.claim("clear"):  # LIFE-CONCURRENT: refused at once while another runs
            self.requests.shut()  # before the status says so: a forward that sees CLEARING is held
            self.status = Status.CLEARING
            self.phases = Phases()
            self.requests.drain()  # every forward in flight returns on the weights it started with
            try:
                span = self.phases.span("clear")
                for param in self.params.values():
                    param._clear_data()
                left = apply.still_loaded(self.params)
                span.end()
                if left:
                    raise RuntimeError(f"Model Parameter clearance verification failed: still initialized: {', '.join(left)}")
            except Exception as e:
                raised = self.failed("clear", e)
                if raised is e:
                    raise
                raise raised from e
            span = self.phases.span("clear_agree")
            self.agreement.require_all("clear")
            span.end()
            self.status = Status.CLEARED
            # The startup load is over once a clear has run, whether or not it committed: the cell now says
            # CLEARED, and the next committed update must say NORMAL (STATUS-FIRST-LOAD-SILENT).
            self.first_load = False
            if publish:
                self.cell.publish(Status.CLEARED, self.first_load)
            log.info("cleared %d parameters", len(self.params))

    # -- update ------------------------------------------------------------------------------
    def update(self, version: int | None = None):
        """Load every parameter from the configured source, then verify; raises on any failure. Returns
        what the strategy returns (the streamed paths' cost dictionary; None for the others). ``version``: the
        version the caller asks for (the V1 control's ``update_weights``), announced before anything loads."""
        with self.operations.claim("update"):  # LIFE-CONCURRENT: refused at once while another runs
            if self.first_load:
                restart.note_startup(self)
            self._voted = self._committed = False
            self._pending_version = None
            self._stage = commit.Stage() if self.commit_options.staged else None
            try:
                # The streamed paths may update in place, without a clear (FastDeploy's rsync and GDR).
                in_place = self.load_strategy in IN_PLACE_STRATEGIES and self.status != Status.CLEARING
                # The first load may find the engine's placeholders allocated (an FP8 layout: APPLY-STRIDED-TARGET);
                # FastDeploy's constructor loads into them, whatever they hold.
                if self.status != Status.CLEARED and not in_place and not self.first_load:
                    raise RuntimeError(
                        f"update() needs cleared weights, status is {self.status.name}: call clear() first"
                    )
                if self.status != Status.CLEARED:
                    self.phases = Phases()  # no clear() started this cycle's spans
                self.requests.shut()  # (shut since the clear, unless the update is in place)
                self.status = Status.UPDATING
                self.requests.drain()
                self._storage_before = storage.snapshot(self.params)
                self.trace = []
                self.ignored = []
                self.last_error = None
                transforms.before_load(self.post_load)
                self.announce(commit.read_version_file(self._version_dir()))
                self.announce(version)
                module, func = STRATEGIES[self.load_strategy].split(":")
                span = self.phases.span("update")
                result = getattr(importlib.import_module(module), func)(self)
                self.finalize()
                span.end()
            except BaseException as e:
                self._stage = None  # a staged update's tensors are dropped, never adopted
                raised = self.failed("update", e) if not self._voted else e  # the others learn of it now
                transforms.restore(self.post_load)  # then the served layout back on what the failed update left
                self.last_error = raised
                log.error("update via %s failed: %s", self.load_strategy, e)
                if raised is e:
                    raise
                raise raised from e
            return result

    def failed(self, what: str, error: BaseException) -> BaseException:
        """This rank failed ``what`` ("clear" or "update", or what the worker loop does before one): its vote,
        so that every other rank learns of it now, not at its deadline. Returns what to raise: ``error``
        itself, or, when other ranks failed ``what`` too, a ``RankFailure`` naming each of them beside this
        rank's own error (its cause): every rank names every failing rank (MR-FAILURE-EVERY-RANK)."""
        others = self.agreement.report_failure(what, error) or []
        if not others:
            return error
        return RankFailure(f"rank {self.rank}: {what} failed on this rank ({type(error).__name__}: {error}) and on "
                           f"{len(others)} other rank(s): {describe(others)}")

    def close(self) -> None:
        """Release what outlives an update: the streamed paths' cached transfer handle."""
        from . import transfer_lib

        transfer_lib.destroy(self)

    def _version_dir(self) -> str | None:
        """Where a trainer leaves ``version.yaml`` for paths that carry no version in-band."""
        return {"ipc_snapshot": self.model_dir, "ipc": self.shared_dir}.get(self.load_strategy)

    def announce(self, version: int | None) -> None:
        """The version this update carries, as soon as its path knows it; refused at once if older
        than the one reported."""
        if version is None:
            return
        commit.check_forward(version, self.version, f"{self.load_strategy} update on rank {self.rank}")
        self._pending_version = version

    def apply(self, tensors: Iterable[tuple[str, paddle.Tensor]], label: str, source: str | None) -> int:
        """Validate and adopt tensors from one source (staged: keep them for the commit); an empty
        source is a ValueError."""
        span = self.phases.span("apply")
        tensors = pulled(tensors, self.phases, "apply")  # reading a lazy source is transfer, not apply
        applied, seen, unknown = (self._stage.apply if self._stage is not None else apply.apply_tensors)(
            self.params, tensors, source or label)
        span.end()
        if seen == 0:
            landed = sum(event.applied for event in self.trace)
            raise ValueError(f"No parameter found in state dict from {source or label} ({label}); "
                             f"{self.landed_of_sent(landed)}")
        if unknown:  # ignored as the contract says (APPLY-UNKNOWN-IGNORED), never silently (APPLY-UNKNOWN-REPORTED)
            self.ignored.extend(unknown)
            log.warning("Ignored %d tensor(s) from %s that no parameter takes: %s", len(unknown), source or label,
                        ", ".join(unknown))
        self.trace.append(LoadEvent(label, source, applied, seen))
        log.info("Updated %d/%d parameters from %s source %s", applied, seen, label, source)
        return applied

    def landed_of_sent(self, landed: int, sent: int | None = None, verb: str = "landed") -> str:
        """Both counts of a short update, ``{landed} of {sent}`` (APPLY-COUNT-MATCHES): a whole update is sent
        every parameter (``sent`` None)."""
        return f"{landed} of {len(self.params) if sent is None else sent} parameter(s) {verb}"

    def finalize(self) -> None:
        """The commit point: verify, agree with every rank, adopt the staged tensors, stamp the version,
        NORMAL. A path that must answer its trainer only after the commit calls it itself; ``update()``
        calls it for the others. Idempotent within one update."""
        if self._committed:
            return
        span = self.phases.span("finalize")
        missing = apply.unloaded(self.params)
        if self._stage is not None:  # a staged tensor loads its parameter at the commit, under every tied name
            uncarried = set(ties.missing(self.params, self._stage.tensors))
            missing = [name for name in missing if name in uncarried]
        span.end()
        if missing:
            # A name the trainer renamed shows twice: missing here, and ignored where it arrived (APPLY-EVERY-PROBLEM).
            ignored = (f"; {len(self.ignored)} tensor(s) the sources carried were ignored, no parameter takes them: "
                       + ", ".join(self.ignored)) if self.ignored else ""
            raise RuntimeError(
                f"Model Parameter update verification failed: {self.landed_of_sent(len(self.params) - len(missing))}; "
                f"{len(missing)} parameter(s) not loaded: " + ", ".join(missing) + ignored
            )
        self._voted = True
        span = self.phases.span("update_agree")
        self.agreement.require_all("update")
        span.end()
        span = self.phases.span("finalize")
        if self._stage is not None:
            self._stage.commit(self.params)
            self._stage = None
        transforms.after_load(self.post_load)  # once, on this update's weights only (staged: once adopted)
        storage.recapture(self)  # after the last parameter moved, before NORMAL (MODEL-STORAGE-KEPT)
        if self._pending_version is not None:
            self.version = self._pending_version
        self._committed = True
        self.changed_since_commit = False
        self.status = Status.NORMAL
        hooks.after_commit(self)  # after the commit, never after a failure; a failing hook leaves NORMAL
        self.requests.open()  # the held forwards run on the new version, stale state reset
        self.cell.publish(Status.NORMAL, self.first_load)  # so the cell never says NORMAL for a failed hook
        self.first_load = False
        span.end()

    # -- digest ------------------------------------------------------------------------------
    def digest(self, algorithms=_digest.DEFAULT_ALGORITHMS) -> _digest.ModelDigest:
        """The model digest of every parameter as it landed (SPEC DIGEST-MODEL-LANDED), computed
        afresh from the parameters' memory on every call; a parameter not loaded is a RuntimeError
        naming it (DIGEST-MODEL-INCOMPLETE), never a digest of part of the model. After a failed update
        that wrote into loaded parameters (GDR applies items as they arrive), they hold neither the last
        committed weights nor the failed update's: a RuntimeError says so (LIFE-FAILED-KEEPS-OLD) until an
        update commits."""
        digest = _digest.paddle_model_digest(self.params.items(), algorithms)
        if self.changed_since_commit:
            raise RuntimeError(
                f"no model digest: the last {self.load_strategy} update changed parameters in place and did not "
                f"commit ({self.last_error}); they hold neither version {self.version} nor the failed update's")
        return digest
