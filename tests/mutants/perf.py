"""Mutants of the reference's fast paths (issue 11): a large snapshot tensor read in pieces."""
from __future__ import annotations

from reference import snapshot_load

from .base import Mutant


class PieceOffsetStuck(Mutant):
    id = "snapshot_piece_offset_stuck"
    bug = ("a tensor read in pieces reads every piece from the tensor's first byte in the file (the file offset is not "
           "advanced with the piece): a tensor larger than one read holds its first piece over and over")
    kills = frozenset({"FILE-LARGE"})

    def patches(self):
        def pieces(view, offset):
            size = snapshot_load.READ_CHUNK_BYTES
            return [(view[at : at + size], offset) for at in range(0, view.nbytes, size)]

        return {"reference.snapshot_load._pieces": pieces}


class PieceLandsAtStart(Mutant):
    id = "snapshot_piece_lands_at_start"
    bug = ("each piece of a large tensor is landed at the start of the tensor's memory (the destination is not advanced): "
           "the head holds the last piece, the rest is whatever the fresh allocation held")
    kills = frozenset({"FILE-LARGE"})

    def patches(self):
        def pieces(view, offset):
            size = snapshot_load.READ_CHUNK_BYTES
            return [(view[: min(size, view.nbytes - at)], offset + at) for at in range(0, view.nbytes, size)]

        return {"reference.snapshot_load._pieces": pieces}
