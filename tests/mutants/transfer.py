"""Mutants of the count an update owes (APPLY-COUNT-MATCHES): success without a transfer (tokenspeed #1373),
an update judged by what was announced rather than what landed, a message naming one count, a cut stream taken
for a shorter complete one."""
from __future__ import annotations

from reference import apply as _apply
from reference import gdr as _gdr
from reference import manager as _manager
from reference import prefetch as _prefetch

from .base import Mutant

_incomplete = _gdr._incomplete


def _manager_patch(cls):
    return {"reference.adapter.WeightManager": cls}


class GdrEmptyStreamNoop(Mutant):
    id = "gdr_empty_stream_noop"
    bug = ("a GDR stream that delivered nothing is an update with nothing to do: the completeness check runs only "
           "when an item arrived, so in place an empty stream (a trainer that never sent) reports success on the "
           "old weights (tokenspeed #1373: success without a transfer)")
    kills = frozenset({"APPLY-COUNT-MATCHES", "APPLY-EMPTY-REFUSED"})
    zoo_args = ("-k", "gdr")

    def patches(self):
        def incomplete(manager, delivery, step, tracked):
            if delivery.update_count:
                _incomplete(manager, delivery, step, tracked)

        return {"reference.gdr._incomplete": incomplete}


class CountsAnnounced(Mutant):
    id = "counts_announced"
    bug = ("the verification counts the tensors the sources held (announced) against the parameters instead of "
           "the parameters that landed: a snapshot or meta file missing a parameter but carrying a stray tensor "
           "under a name no parameter takes has as many tensors as the model, and passes")
    kills = frozenset({"APPLY-COUNT-MATCHES"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def finalize(self):
                if sum(event.seen for event in self.trace) < len(self.params):
                    return super().finalize()
                unloaded = _apply.unloaded
                _apply.unloaded = lambda params: []  # "every parameter had a tensor"
                try:
                    return super().finalize()
                finally:
                    _apply.unloaded = unloaded

        return _manager_patch(Manager)


class OneCountNamed(Mutant):
    id = "one_count_named"
    bug = ("a short update's error says how many parameters landed, never how many were sent: `2 parameter(s) "
           "landed` cannot tell a lost tensor from a model that has two")
    kills = frozenset({"APPLY-COUNT-MATCHES"})

    def patches(self):
        class Manager(_manager.WeightManager):
            def landed_of_sent(self, landed, sent=None, verb="landed"):
                return f"{landed} parameter(s) {verb}"

        return _manager_patch(Manager)


class _CutIsEnd(_prefetch.Prefetcher):
    """A broken transfer after at least one item reads as the end of the stream (a closed connection as EOF)."""

    def __iter__(self):
        got = 0
        try:
            for item in super().__iter__():
                got += 1
                yield item
        except ConnectionError:
            if not got:
                raise


class StreamCutIsEnd(Mutant):
    id = "stream_cut_is_end"
    bug = ("a stream that breaks after some items is taken as ended (the connection's close read as EOF): in "
           "place, rsync applies the cut step as a subset it may leave keys out of (RSYNC-SUBSET), and the "
           "tensors that never came stay stale under a NORMAL status")
    kills = frozenset({"APPLY-COUNT-MATCHES"})
    zoo_args = ("-k", "rsync or gdr")

    def patches(self):
        return {"reference.prefetch.Prefetcher": _CutIsEnd}
