"""Mutants of a snapshot reader that reads a large tensor in chunks (FILE-LARGE)."""
from __future__ import annotations

import os

from .base import Mutant

CHUNK = 1 << 20  # what a chunked reader might use: smaller than the tensors FILE-LARGE loads


class ChunkOffsetStuck(Mutant):
    id = "snapshot_chunk_offset_stuck"
    bug = ("a tensor is read in 1 MiB chunks, every chunk from the tensor's first byte in the file (the file offset is "
           "not advanced with the chunk): a tensor larger than one chunk holds its first chunk over and over")
    kills = frozenset({"FILE-LARGE"})

    def patches(self):
        def read_into(fd, view, offset, path, name):
            for at in range(0, view.nbytes, CHUNK):
                os.preadv(fd, [view[at : at + CHUNK]], offset)

        return {"reference.snapshot_load._read_exactly_into": read_into}


class ChunkLandsAtStart(Mutant):
    id = "snapshot_chunk_lands_at_start"
    bug = ("a tensor is read in 1 MiB chunks, each landed at the start of the tensor's memory (the destination is not "
           "advanced): the head holds the last chunk, the rest is whatever the fresh allocation held")
    kills = frozenset({"FILE-LARGE"})

    def patches(self):
        def read_into(fd, view, offset, path, name):
            for at in range(0, view.nbytes, CHUNK):
                os.preadv(fd, [view[: min(CHUNK, view.nbytes - at)]], offset + at)

        return {"reference.snapshot_load._read_exactly_into": read_into}
