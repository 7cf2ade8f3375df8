"""The gate between requests and changes of the weights (SPEC.md SERVE-NO-MIXED-VERSIONS).

A forward pass reads the weights; a clear or an update writes them. The gate lets any number of forward
passes run together while the weights are served, and makes a change of the weights wait until every
forward pass in flight has returned (drained) before the first byte changes; from the moment a change
begins until the update that follows commits, a forward pass that arrives waits (held) and then runs on
the new version whole. A clear opens a cycle that only a committed update ends: between the clear and the
update the parameters hold nothing, and no forward pass may run on them. A failed update leaves the gate
shut (the parameters are partial); the next committed update opens it. FastDeploy's worker runs forward
passes and changes in one loop and stops its requests before each change (``runner.clear_requests()``,
fd-spec §2.5); this is the same guarantee for an engine that serves requests on other threads.

Writers come first: once a change has begun, new forward passes wait even while older ones drain, so a
steady flow of overlapping requests can never starve an update.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager


class RequestGate:
    def __init__(self, served: bool):
        """``served``: whether the parameters hold weights to serve now (a model built empty is not)."""
        self._cond = threading.Condition()
        self._in_flight = 0
        self._shut = not served

    @contextmanager
    def forward(self):
        """One forward pass: waits while a change is under way, then runs alongside the others."""
        with self._cond:
            self._cond.wait_for(lambda: not self._shut)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def shut(self) -> None:
        """A change begins: forward passes that arrive from now on wait until :meth:`open`."""
        with self._cond:
            self._shut = True

    def drain(self) -> None:
        """Wait until every forward pass in flight has returned (call after :meth:`shut`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0)

    def open(self) -> None:
        """The update committed: the held forward passes run, on the new version."""
        with self._cond:
            self._shut = False
            self._cond.notify_all()
