"""Mutants of a snapshot reader that takes a read call's count for the whole request (FILE-OVER-2GIB).

Linux returns at most 0x7ffff000 bytes from one read call, and any call may return fewer than asked:
each mutant below loads every tensor under 2 GiB correctly on an ordinary disk, and a tensor over it
wrong or never; the capped-read case (every read cut at 4093 bytes) shows it in milliseconds.
"""
from __future__ import annotations

import os

from reference.errors import SnapshotFormatError

from .base import Mutant


def _ended_early(path, name):
    return SnapshotFormatError(f"{path}: file changed during load: the read of tensor {name!r} ended early")


class SingleReadAssumedComplete(Mutant):
    id = "snapshot_single_read_assumed_complete"
    bug = ("each tensor is read with one preadv, its count taken for the whole tensor (only an error or 0 is "
           "checked): a tensor over 0x7ffff000 bytes keeps what the fresh allocation held past that point")
    kills = frozenset({"FILE-OVER-2GIB"})

    def patches(self):
        def read_into(fd, view, offset, path, name):
            if os.preadv(fd, [view], offset) <= 0:
                raise _ended_early(path, name)

        return {"reference.snapshot_load._read_exactly_into": read_into}


class DoneIsLastCount(Mutant):
    id = "snapshot_read_done_is_last_count"
    bug = ("the read loop sets done = got instead of done += got (issue 17; mutmut's survivor of the 4 MiB-piece "
           "reader): after a short read it reads the same stretch again and again, and a tensor over 2 GiB "
           "never finishes loading")
    kills = frozenset({"FILE-OVER-2GIB"})

    def patches(self):
        def read_into(fd, view, offset, path, name):
            done = 0
            while done < view.nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise _ended_early(path, name)
                done = got

        return {"reference.snapshot_load._read_exactly_into": read_into}


class ContinuationFromTensorStart(Mutant):
    id = "snapshot_read_continues_from_tensor_start"
    bug = ("after a short read the loop fills the rest of the tensor but reads it from the tensor's first byte "
           "in the file again (the file offset is not advanced): past 0x7ffff000 bytes the tensor repeats its head")
    kills = frozenset({"FILE-OVER-2GIB"})

    def patches(self):
        def read_into(fd, view, offset, path, name):
            done = 0
            while done < view.nbytes:
                got = os.preadv(fd, [view[done:]], offset)
                if got <= 0:
                    raise _ended_early(path, name)
                done += got

        return {"reference.snapshot_load._read_exactly_into": read_into}


class ContinuationLandsAtStart(Mutant):
    id = "snapshot_read_continuation_lands_at_start"
    bug = ("after a short read the loop reads the next stretch of the file into the tensor's first bytes again "
           "(the destination is not advanced): the head holds the last stretch, the tail what the allocation held")
    kills = frozenset({"FILE-OVER-2GIB"})

    def patches(self):
        def read_into(fd, view, offset, path, name):
            done = 0
            while done < view.nbytes:
                got = os.preadv(fd, [view[: view.nbytes - done]], offset + done)
                if got <= 0:
                    raise _ended_early(path, name)
                done += got

        return {"reference.snapshot_load._read_exactly_into": read_into}


class HeaderSingleRead(Mutant):
    id = "snapshot_header_single_read"
    bug = ("the safetensors header is read with one pread and a shorter result is taken for a shrunk file "
           "(the reference's header reader before issue 17): a header read cut short fails a good file")
    kills = frozenset({"FILE-OVER-2GIB"})

    def patches(self):
        def read_exact(fd, offset, n, path):
            data = os.pread(fd, n, offset)
            if len(data) != n:
                raise SnapshotFormatError(f"{path}: file changed during load: the read at offset {offset} ended early (the file shrank)")
            return data

        return {"reference.snapshot_load._read_exact": read_exact}

