"""Mutants of the gate between requests and changes of the weights (SPEC.md SERVE-NO-MIXED-VERSIONS): bugs an
engine that serves requests on other threads than the one changing the weights plausibly ships, each caught
by conformance/test_serve.py's forced interleavings (a pass in flight at the change, passes arriving once the
change began, at CLEARED, and mid-update with the trainer holding the update before its last bucket or item).

Each patches ``reference.request_gate.RequestGate`` where the manager builds it, or the manager itself.
"""
from __future__ import annotations

from contextlib import contextmanager

from reference import manager as _manager
from reference import request_gate as _gate

from .base import Mutant

_RealGate = _gate.RequestGate


def _gate_patch(cls):
    return {"reference.manager.RequestGate": cls}


class NoGate(Mutant):
    id = "serve_no_gate"
    bug = ("requests run beside clears and updates with nothing between them (an engine serving from its own threads "
           "whose weight update takes no lock, reef #86): a pass in flight reads half the old version and half the "
           "cleared or new one, and passes run on cleared parameters")
    kills = frozenset({"SERVE-NO-MIXED-VERSIONS"})

    def patches(self):
        class Gate(_RealGate):
            @contextmanager
            def forward(self):
                yield

            def shut(self):
                pass

            def drain(self):
                pass

        return _gate_patch(Gate)


class _OnlyOpens:
    """The manager's gate as an update sees it in ``GateOnClearNotUpdate``: the commit opens it, nothing shuts it."""

    def __init__(self, gate):
        self.gate = gate

    def forward(self):
        return self.gate.forward()

    def shut(self):
        pass

    def drain(self):
        pass

    def open(self):
        self.gate.open()


class GateOnClearNotUpdate(Mutant):
    id = "serve_gate_on_clear_not_update"
    bug = ("requests are drained and held by a clear (until the update after it commits), but an update does not "
           "shut the gate itself, as FastDeploy stopped requests before a clear only between #3601 and #4286 / #4402: "
           "the in-place updates (rsync, GDR) run under live requests")
    kills = frozenset({"SERVE-NO-MIXED-VERSIONS"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                gate = self.requests
                self.requests = _OnlyOpens(gate)
                try:
                    return super().update()
                finally:
                    self.requests = gate

        return {"reference.adapter.WeightManager": Manager}


class _Unheld(_OnlyOpens):
    """No gate around the change as a whole (``GateReleasedBetweenTensors`` takes it per write)."""

    def open(self):
        pass


class GateReleasedBetweenTensors(Mutant):
    id = "serve_gate_released_between_tensors"
    bug = ("the gate guards each write, not the change: the clear of the model, then the adoption of each tensor, "
           "each drains the requests and shuts them out while it writes (a lock around the copy); between two "
           "tensors, and between the clear and the update, requests run on what is there")
    kills = frozenset({"SERVE-NO-MIXED-VERSIONS"})

    def patches(self):
        from reference import apply as _apply
        from reference import mtp_routing as _routing
        from reference import rsync as _rsync

        gates: list = []  # the gate of the change under way (one session per test)
        real_adopt, real_store, real_load_models = _apply.adopt, _rsync.store, _routing.load_models

        @contextmanager
        def writing():
            gate = gates[-1] if gates else None
            if gate is None:
                yield
                return
            gate.shut()
            gate.drain()
            try:
                yield
            finally:
                gate.open()

        class Manager(_manager.WeightManager):
            def clear(self, publish=True):
                gate = self.requests
                self.requests = _Unheld(gate)
                gates.append(gate)
                try:
                    with writing():
                        return super().clear(publish)
                finally:
                    gates.pop()
                    self.requests = gate

            def update(self):
                gate = self.requests
                self.requests = _Unheld(gate)
                gates.append(gate)
                try:
                    return super().update()
                finally:
                    gates.pop()
                    self.requests = gate
                    if self.status.name == "NORMAL":
                        gate.open()

        def adopt(name, new, target):
            with writing():
                real_adopt(name, new, target)

        def store(received, params, bootstrap):
            for key, new in received.items():
                with writing():
                    real_store({key: new}, params, bootstrap)

        def load_models(models, items, chunk, mtp_names=()):
            def one_at_a_time():
                for item in items:
                    with writing():  # the model's loader writes the item before it asks for the next
                        yield item

            return real_load_models(models, one_at_a_time(), chunk, mtp_names)

        return {"reference.adapter.WeightManager": Manager, "reference.apply.adopt": adopt,
                "reference.rsync.store": store, "reference.mtp_routing.load_models": load_models}


class DrainsButAdmits(Mutant):
    id = "serve_drains_but_admits_new"
    bug = ("a change waits for the requests in flight to return, but nothing holds the ones that arrive meanwhile: "
           "a request admitted while the bytes change (or at CLEARED) runs on them")
    kills = frozenset({"SERVE-NO-MIXED-VERSIONS"})

    def patches(self):
        class Gate(_RealGate):
            def shut(self):  # the drain still waits for the passes in flight; nothing is ever held
                pass

        return _gate_patch(Gate)


class HoldsButNoDrain(Mutant):
    id = "serve_holds_but_no_drain"
    bug = ("a change shuts new requests out until the commit but does not wait for the ones in flight: a request "
           "that began on the old version reads the rest of its layers cleared or new")
    kills = frozenset({"SERVE-NO-MIXED-VERSIONS"})

    def patches(self):
        class Gate(_RealGate):
            def drain(self):
                pass

        return _gate_patch(Gate)


class OpenedAfterFailedUpdate(Mutant):
    id = "serve_opened_after_failed_update"
    bug = ("the update reopens the gate in a `finally`, whatever its outcome: after a failed update the held requests, "
           "and every later one, run on what it left (cleared or partly loaded parameters)")
    kills = frozenset({"SERVE-NO-MIXED-VERSIONS"})
    zoo_args = ("-k", "failed_update")

    def patches(self):
        class Manager(_manager.WeightManager):
            def update(self):
                try:
                    return super().update()
                finally:
                    self.requests.open()

        return {"reference.adapter.WeightManager": Manager}
