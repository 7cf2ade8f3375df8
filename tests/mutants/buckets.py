"""Mutants of the ipc_bucket path (SPEC.md § BKT): the receiver with one real bucketing bug put back."""
from __future__ import annotations

import dataclasses
import pickle


from reference import apply, buckets
from reference.dtypes import paddle_dtype
from sim import protocol

from .base import Mutant

_stage = buckets.stage_bucket
_Link = buckets.Link
_check_nbytes = protocol.check_nbytes
_check_version = protocol.check_version
_check_targets = buckets.check_targets
_new_state = buckets.new_update_state
_decode = protocol.decode


def _skip(*args, **kwargs) -> None:
    return None


class Fp8DtypeTable(Mutant):
    id = "bkt_fp8_dtype_table"
    bug = ("the receiver's dtype table maps float8_e5m2 to float8_e4m3fn (one fp8 entry copied for both), so "
           "e5m2 tensors are staged with the wrong dtype; fp8 needed an engine patch in checkpoint-engine/vLLM")
    kills = frozenset({"BKT-ROUNDTRIP-DTYPES"})

    def patches(self):
        return {"reference.buckets.paddle_dtype":
                lambda name: paddle_dtype("float8_e4m3fn" if name == "float8_e5m2" else name)}


class ZeroSizeRejected(Mutant):
    id = "bkt_zero_size_rejected"
    bug = "an entry of 0 bytes is refused (checkpoint-engine's zero-size assertion, #91): empty tensors cannot be sent"
    kills = frozenset({"BKT-EMPTY-SCALAR"})

    def patches(self):
        def check_nbytes(e, where):
            _check_nbytes(e, where)
            if e.nbytes == 0:
                raise protocol.ManifestError(f"{where}, tensor {e.name!r}: entry of 0 bytes")

        return {"sim.protocol.check_nbytes": check_nbytes}


class RangeOffByOne(Mutant):
    id = "bkt_range_off_by_one"
    bug = "range check written `offset + nbytes >= size`: a tensor ending exactly on the bucket boundary is refused"
    kills = frozenset({"BKT-BOUNDARY"})

    def patches(self):
        def check_ranges(entries, segment_size, where):
            for e in entries:
                if e.nbytes and e.end >= segment_size:
                    raise protocol.ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} out of range")

        return {"sim.protocol.check_ranges": check_ranges}


class ChunkOffsetIgnored(Mutant):
    id = "bkt_chunk_offset_ignored"
    bug = ("every chunk of a split tensor is copied to the start of the tensor (chunk_offset dropped): a tensor "
           "larger than a bucket ends with its last chunk at the front (verl split/merge_weight_chunks)")
    kills = frozenset({"BKT-SPLIT"})

    def patches(self):
        def stage(staging, segment, entries):
            _stage(staging, segment, [dataclasses.replace(e, chunk_offset=0) for e in entries])

        return {"reference.buckets.stage_bucket": stage}


class OffsetsRecomputed(Mutant):
    id = "bkt_offsets_recomputed"
    bug = ("the receiver recomputes offsets as the running sum of nbytes (verl's unpadded IPC layout) instead of "
           "reading the manifest's aligned offsets: everything after an odd-sized tensor is read shifted")
    kills = frozenset({"BKT-ALIGN-ODD"})

    def patches(self):
        def stage(staging, segment, entries):
            fixed, cursor = [], 0
            for e in entries:
                fixed.append(dataclasses.replace(e, offset=cursor))
                cursor += e.nbytes
            _stage(staging, segment, fixed)

        return {"reference.buckets.stage_bucket": stage}


class AckBeforeCopy(Mutant):
    id = "bkt_ack_before_copy"
    bug = ("the bucket is acknowledged before it is copied: the receiver keeps views into the trainer's buffer "
           "and copies later, after the trainer reused it (slime's warning; verl #7987)")
    kills = frozenset({"BKT-ACK-AFTER-COPY"})

    def patches(self):
        pending = []

        def stage(staging, segment, entries):
            pending.append(lambda: _stage(staging, segment, entries))  # views kept, copy deferred

        class LazyLink(_Link):
            def receive(self, where):
                message = super().receive(where)  # the ack went out before this...
                while pending:
                    pending.pop(0)()  # ...and only now are the bytes read
                return message

        return {"reference.buckets.stage_bucket": stage, "reference.buckets.Link": LazyLink}


class DuplicatesLaterWin(Mutant):
    id = "bkt_duplicates_later_win"
    bug = ("names are not tracked across an update: a tensor announced twice is silently overwritten by the "
           "later copy (snapshot-part semantics carried over to buckets)")
    kills = frozenset({"BKT-DUPLICATE"})

    def patches(self):
        return {"sim.protocol.check_unique": _skip, "sim.protocol.check_chunks": _skip}


class NbytesTrusted(Mutant):
    id = "bkt_nbytes_trusted"
    bug = "nbytes is trusted instead of checked against prod(shape) * itemsize: a short entry leaves bytes unwritten"
    kills = frozenset({"BKT-MANIFEST-MISMATCH"})

    def patches(self):
        return {"sim.protocol.check_nbytes": _skip}


class OffsetsTrusted(Mutant):
    id = "bkt_offsets_trusted"
    bug = "offsets are trusted (checkpoint-engine's worker): an entry past the buffer's end is read without a range check"
    kills = frozenset({"BKT-OFFSET-RANGE"})

    def patches(self):
        return {"sim.protocol.check_ranges": _skip}


class OverlapUnchecked(Mutant):
    id = "bkt_overlap_unchecked"
    bug = "overlapping entries are not detected: two tensors read the same bytes"
    kills = frozenset({"BKT-OVERLAP"})

    def patches(self):
        return {"sim.protocol.check_overlaps": _skip}


class NoAlignmentCheck(Mutant):
    id = "bkt_no_alignment_check"
    bug = "offsets are not checked for 256-byte alignment: a misaligned entry is read from the wrong bytes"
    kills = frozenset({"BKT-MISALIGNED"})

    def patches(self):
        return {"sim.protocol.check_alignment": _skip}


class DtypeUnchecked(Mutant):
    id = "bkt_dtype_unchecked"
    bug = "the manifest's dtype string is looked up without a check: an unknown dtype is a bare KeyError"
    kills = frozenset({"BKT-DTYPE-UNKNOWN"})

    def patches(self):
        return {"sim.protocol.check_dtype": _skip}


class UnknownNamesIgnored(Mutant):
    id = "bkt_unknown_names_ignored"
    bug = ("entries for tensors the model lacks are dropped with a debug log, as snapshots do: a trainer and "
           "worker that disagree about the model are not noticed")
    kills = frozenset({"BKT-UNKNOWN-NAME"})

    def patches(self):
        def check_targets(bucket, targets, source):
            known = [e for e in bucket.entries if e.name in targets]
            _check_targets(dataclasses.replace(bucket, entries=tuple(known)), targets, source)

        return {"sim.protocol.check_known": _skip, "reference.buckets.check_targets": check_targets}


class ChunksTrusted(Mutant):
    id = "bkt_chunks_trusted"
    bug = "chunk_offset is trusted: chunks with a gap or out of order are reassembled into a wrong tensor"
    kills = frozenset({"BKT-CHUNKS"})

    def patches(self):
        return {"sim.protocol.check_chunks": _skip}


class VersionFirstOnly(Mutant):
    id = "bkt_version_first_only"
    bug = "only the first manifest's version is checked: a trainer switching versions mid-update mixes two versions"
    kills = frozenset({"BKT-VERSION"})

    def patches(self):
        def check_version(got, state, where):
            if state.next_bucket == 0:
                _check_version(got, state, where)

        return {"sim.protocol.check_version": check_version}


class EndUnchecked(Mutant):
    id = "bkt_end_unchecked"
    bug = "the closing message is taken on trust: tensor count and name digest are not compared with what arrived"
    kills = frozenset({"BKT-END-CHECK"})

    def patches(self):
        return {"sim.protocol.validate_end": _skip}


class StaleUpdateState(Mutant):
    id = "bkt_stale_update_state"
    bug = ("the receiver's per-update bookkeeping outlives the update (checkpoint-engine #106, a stale key on "
           "repeated update()): the second update finds bucket 0 'already received'")
    kills = frozenset({"BKT-REPEAT"})

    def patches(self):
        cache = []

        def new_update_state(known, version):
            if not cache:
                cache.append(_new_state(known, version))
            return cache[0]

        return {"reference.buckets.new_update_state": new_update_state}


class NoDeadline(Mutant):
    id = "bkt_no_deadline"
    bug = "the receiver blocks on recv() with no deadline: a trainer killed mid-update hangs the worker forever"
    kills = frozenset({"BKT-TIMEOUT"})

    def patches(self):
        class BlockingLink(_Link):
            def receive(self, where):
                frame = self.sock.recv()
                self.can_send = True
                return protocol.decode(frame, where)

        return {"reference.buckets.Link": BlockingLink}


class StreamingApply(Mutant):
    id = "bkt_streaming_apply"
    bug = ("each tensor is adopted by the model as soon as its bucket is copied (no staging): a failure at bucket "
           "k leaves buckets 0..k-1 applied (SGLang: 'partially updated, discard the whole weights')")
    kills = frozenset({"BKT-ATOMIC"})

    def patches(self):
        def stage(staging, segment, entries):
            _stage(staging, segment, entries)
            for e in entries:
                if e.chunk_offset + e.nbytes == e.total_nbytes:
                    apply.adopt(e.name, staging.tensors[e.name], staging.targets[e.name])

        return {"reference.buckets.stage_bucket": stage}


class ManifestUnpickled(Mutant):
    id = "bkt_manifest_unpickled"
    bug = "manifests are read with recv_pyobj() (pickle) when they are not msgpack: a trainer can run code in the worker"
    kills = frozenset({"BKT-NO-PICKLE"})

    def patches(self):
        def decode(frame, where, allowed=protocol.TRAINER_TYPES):
            try:
                return pickle.loads(frame)
            except Exception:
                return _decode(frame, where, allowed)

        return {"sim.protocol.decode": decode}


class MappingCached(Mutant):
    id = "bkt_mapping_cached"
    bug = ("attached buffers are cached for the next update instead of unmapped: the trainer's freed memory stays "
           "pinned (slime #1731, CUDA IPC handles kept until ipc_collect)")
    kills = frozenset({"BKT-NO-LEAK"})

    def patches(self):
        cache = []

        def release(attached):
            cache.extend(attached.segments.values())
            attached.segments.clear()

        return {"reference.buckets.release": release}

