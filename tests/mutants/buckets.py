"""Mutants of the ipc_bucket path (SPEC.md § BKT): the receiver with one real bucketing bug put back."""
from __future__ import annotations

import dataclasses
import pickle
import time

from reference import apply, buckets
from reference import bucket_checks as checks
from reference.dtypes import paddle_dtype
from wire import protocol

from .base import Mutant

_stage = buckets.stage_bucket
_Link = buckets.Link
_check_nbytes = checks.check_nbytes
_check_version = checks.check_version
_check_targets = buckets.check_targets
_new_state = buckets.new_update_state


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

        return {"reference.bucket_checks.check_nbytes": check_nbytes}


class RangeOffByOne(Mutant):
    id = "bkt_range_off_by_one"
    bug = "range check written `offset + nbytes >= size`: a tensor ending exactly on the bucket boundary is refused"
    kills = frozenset({"BKT-BOUNDARY"})

    def patches(self):
        def check_ranges(entries, segment_size, where):
            for e in entries:
                if e.nbytes and e.end >= segment_size:
                    raise protocol.ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} out of range")

        return {"reference.bucket_checks.check_ranges": check_ranges}


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
        return {"reference.bucket_checks.check_unique": _skip, "reference.bucket_checks.check_chunks": _skip}


class NbytesTrusted(Mutant):
    id = "bkt_nbytes_trusted"
    bug = "nbytes is trusted instead of checked against prod(shape) * itemsize: a short entry leaves bytes unwritten"
    kills = frozenset({"BKT-MANIFEST-MISMATCH"})

    def patches(self):
        return {"reference.bucket_checks.check_nbytes": _skip}


class OffsetsTrusted(Mutant):
    id = "bkt_offsets_trusted"
    bug = "offsets are trusted (checkpoint-engine's worker): an entry past the buffer's end is read without a range check"
    kills = frozenset({"BKT-OFFSET-RANGE"})

    def patches(self):
        return {"reference.bucket_checks.check_ranges": _skip}


class OverlapUnchecked(Mutant):
    id = "bkt_overlap_unchecked"
    bug = "overlapping entries are not detected: two tensors read the same bytes"
    kills = frozenset({"BKT-OVERLAP"})

    def patches(self):
        return {"reference.bucket_checks.check_overlaps": _skip}


class NoAlignmentCheck(Mutant):
    id = "bkt_no_alignment_check"
    bug = "offsets are not checked for 256-byte alignment: a misaligned entry is read from the wrong bytes"
    kills = frozenset({"BKT-MISALIGNED"})

    def patches(self):
        return {"reference.bucket_checks.check_alignment": _skip}


class DtypeUnchecked(Mutant):
    id = "bkt_dtype_unchecked"
    bug = "the manifest's dtype string is looked up without a check: an unknown dtype is a bare KeyError"
    kills = frozenset({"BKT-DTYPE-UNKNOWN"})

    def patches(self):
        return {"reference.bucket_checks.check_dtype": _skip}


class UnknownNamesIgnored(Mutant):
    id = "bkt_unknown_names_ignored"
    bug = ("entries for tensors the model lacks are dropped with a debug log, as snapshots do: a trainer and "
           "worker that disagree about the model are not noticed")
    kills = frozenset({"BKT-UNKNOWN-NAME"})

    def patches(self):
        def check_targets(bucket, targets, source):
            known = [e for e in bucket.entries if e.name in targets]
            _check_targets(dataclasses.replace(bucket, entries=tuple(known)), targets, source)

        return {"reference.bucket_checks.check_known": _skip, "reference.buckets.check_targets": check_targets}


class ChunksTrusted(Mutant):
    id = "bkt_chunks_trusted"
    bug = "chunk_offset is trusted: chunks with a gap or out of order are reassembled into a wrong tensor"
    kills = frozenset({"BKT-CHUNKS"})

    def patches(self):
        return {"reference.bucket_checks.check_chunks": _skip}


class VersionFirstOnly(Mutant):
    id = "bkt_version_first_only"
    bug = "only the first manifest's version is checked: a trainer switching versions mid-update mixes two versions"
    kills = frozenset({"BKT-VERSION"})

    def patches(self):
        def check_version(got, state, where):
            if state.next_bucket == 0:
                _check_version(got, state, where)

        return {"reference.bucket_checks.check_version": check_version}


class EndUnchecked(Mutant):
    id = "bkt_end_unchecked"
    bug = "the closing message is taken on trust: tensor count and name digest are not compared with what arrived"
    kills = frozenset({"BKT-END-CHECK"})

    def patches(self):
        return {"reference.bucket_checks.validate_end": _skip}


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
                return self.parse(frame, where)

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
        class PickleFirst(_Link):
            def parse(self, frame, where):
                try:
                    return pickle.loads(frame)
                except Exception:
                    return super().parse(frame, where)

        return {"reference.buckets.Link": PickleFirst}


class ExtensionTypesDecoded(Mutant):
    id = "bkt_extension_types_decoded"
    bug = ("manifests are decoded with msgpack's default extension hook: an extension type in a field the worker "
           "does not define becomes an ExtType value that nobody looks at, and the frame loads")
    kills = frozenset({"BKT-NO-PICKLE"})

    def patches(self):
        import msgpack

        class Lenient(_Link):
            def parse(self, frame, where):
                try:
                    message = msgpack.unpackb(frame, raw=False)
                except Exception:  # noqa: BLE001 - not msgpack at all: refused as the reference does
                    return super().parse(frame, where)
                if not isinstance(message, dict) or message.get("type") not in protocol.TRAINER_TYPES:
                    return super().parse(frame, where)
                return message

        return {"reference.buckets.Link": Lenient}


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



# -- found by the phase/boundary/aftermath cases (issue 6) --------------------------------------------
_Staging = buckets.Staging
_commit = buckets.commit
_check_ranges = checks.check_ranges
_validate_end = checks.validate_end
_kept: list = []  # objects a leaking mutant keeps alive (a collected socket or pool would close itself)


class ThreadSplitOffByOne(Mutant):
    id = "bkt_thread_split_off_by_one"
    bug = ("the threaded copy of a large bucket cuts each share one byte short at the split point "
           "(`d[:room - 1]` then `d[room:]`): the byte at every thread boundary is never copied")
    kills = frozenset({"BKT-LARGE"})

    def patches(self):
        from concurrent.futures import wait

        class Split(_Staging):
            def copy(self, jobs):
                total = sum(d.nbytes for d, _ in jobs)
                if total < buckets.PARALLEL_MIN_BYTES:
                    return super().copy(jobs)
                share, parts, room = -(-total // self.threads), [[]], -(-total // self.threads)
                for d, s in jobs:
                    while d.nbytes > room and len(parts) < self.threads:
                        parts[-1].append((d[: room - 1], s[: room - 1]))
                        d, s = d[room:], s[room:]
                        parts.append([])
                        room = share
                    parts[-1].append((d, s))
                    room -= d.nbytes
                if self._pool is None:
                    self._pool = buckets.ThreadPoolExecutor(self.threads - 1)
                futures = [self._pool.submit(buckets._copy_all, p) for p in parts[1:]]
                buckets._copy_all(parts[0])
                wait(futures)

        return {"reference.buckets.Staging": Split}


def _recorded_links():
    """(the links made so far, a ``Link`` that records itself there): what a patched step tells the trainer through."""
    links = []

    class Recorded(_Link):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            links.append(self)

    return links, Recorded


class DoneBeforeCommit(Mutant):
    id = "bkt_done_before_commit"
    bug = ("`done` is sent as soon as the end message checks out, before the commit: when the commit then fails "
           "(a parameter never sent) the trainer has already been told the update was applied")
    kills = frozenset({"BKT-DONE-AFTER-COMMIT"})

    def patches(self):
        links, Recorded = _recorded_links()

        def commit(manager, state, staging, source):
            links[-1].tell(protocol.done(state.version, len(state.order)))
            _commit(manager, state, staging, source)

        return {"reference.buckets.Link": Recorded, "reference.buckets.commit": commit}


class DoneBeforeFinalize(Mutant):
    id = "bkt_done_before_finalize"
    bug = ("`done` is sent once every bucket is applied, before the manager's finalize (the vote, the recapture, the "
           "stale-state hooks): when a hook or the recapture then fails, the trainer was told the update was applied "
           "and releases its buffers while the worker reports a failure")
    kills = frozenset({"BKT-DONE-AFTER-COMMIT"})

    def patches(self):
        links, Recorded = _recorded_links()

        def commit(manager, state, staging, source):
            _commit(manager, state, staging, source)
            links[-1].tell(protocol.done(state.version, len(state.order)))

        return {"reference.buckets.Link": Recorded, "reference.buckets.commit": commit}


class ErrorNeverSent(Mutant):
    id = "bkt_error_never_sent"
    bug = "a rejected update just raises: the trainer is never sent an `error` and waits for its own timeout"
    kills = frozenset({"BKT-ERROR-REPORTED"})

    def patches(self):
        class Quiet(_Link):
            def tell(self, message):
                if message.get("type") != protocol.ERROR:
                    super().tell(message)

        return {"reference.buckets.Link": Quiet}


class ErrorNamesLastAccepted(Mutant):
    id = "bkt_error_names_last_accepted"
    bug = "the `error` names the last bucket accepted (k - 1) instead of the bucket rejected (k)"
    kills = frozenset({"BKT-ERROR-REPORTED"})

    def patches(self):
        class OffByOne(_Link):
            def tell(self, message):
                if message.get("type") == protocol.ERROR:
                    message = {**message, "bucket": message["bucket"] - 1}
                super().tell(message)

        return {"reference.buckets.Link": OffByOne}


class DeadlinePerUpdate(Mutant):
    id = "bkt_deadline_per_update"
    bug = ("timeout_s is a deadline for the whole update instead of a bound on each silence: a slow but healthy "
           "trainer (every pause shorter than timeout_s) is cut off mid-update")
    kills = frozenset({"BKT-TIMEOUT"})

    def patches(self):
        import time

        class Deadline(_Link):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.deadline = time.monotonic() + self.timeout_s

            def receive(self, where):
                left = max(0.0, self.deadline - time.monotonic())
                if not self.sock.poll(int(left * 1000), 1):
                    raise protocol.TransferTimeout(f"ipc_bucket: update not finished within {self.timeout_s}s at {where}")
                frame = self.sock.recv(copy=False).bytes
                self.can_send = True
                return self.parse(frame, where)

        return {"reference.buckets.Link": Deadline}


class TimeoutUnnamed(Mutant):
    id = "bkt_timeout_unnamed"
    bug = "the timeout is a bare `TimeoutError('trainer timed out')`: the operator cannot tell which bucket or version stalled"
    kills = frozenset({"BKT-TIMEOUT"})

    def patches(self):
        class Bare(_Link):
            def receive(self, where):
                try:
                    return super().receive(where)
                except TimeoutError:
                    raise TimeoutError("trainer timed out") from None

        return {"reference.buckets.Link": Bare}


class SocketKeptOnFailure(Mutant):
    id = "bkt_socket_kept_on_failure"
    bug = "the worker's socket is closed only on success: every failed or timed-out update leaks a connected socket"
    kills = frozenset({"BKT-NO-LEAK"})

    def patches(self):
        class Leaky(_Link):
            failed = False

            def tell(self, message):
                self.failed = self.failed or message.get("type") == protocol.ERROR
                super().tell(message)

            def close(self):
                if self.failed:
                    _kept.append(self)
                else:
                    super().close()

        return {"reference.buckets.Link": Leaky}


class CopyThreadsLeaked(Mutant):
    id = "bkt_copy_threads_leaked"
    bug = "the copy thread pool of large buckets is never shut down: each update leaves idle threads behind"
    kills = frozenset({"BKT-NO-LEAK"})

    def patches(self):
        class Leaky(_Staging):
            def close(self):
                _kept.append(self._pool)

        return {"reference.buckets.Staging": Leaky}


class LinkReused(Mutant):
    id = "bkt_link_reused"
    bug = ("one REQ socket per endpoint is cached and reused across updates: after a timeout (or the final done) it "
           "still awaits a reply, so the next update's hello fails (ZMQ EFSM) and the worker never recovers")
    kills = frozenset({"BKT-RECOVERY", "BKT-REPEAT"})

    def patches(self):
        cache: dict = {}

        class Cached(_Link):
            def __init__(self, endpoint, timeout_s):
                if endpoint in cache:
                    self.__dict__.update(cache[endpoint].__dict__)
                    self.timeout_s = timeout_s
                    return
                super().__init__(endpoint, timeout_s)
                cache[endpoint] = self

            def close(self):
                cache[self.endpoint].__dict__.update(self.__dict__)

        return {"reference.buckets.Link": Cached}


class RangeStartOnly(Mutant):
    id = "bkt_range_start_only"
    bug = "only the entry's start is range-checked (`offset < size`): an entry straddling the buffer's end is read past it"
    kills = frozenset({"BKT-OFFSET-RANGE"})

    def patches(self):
        def check_ranges(entries, segment_size, where):
            for e in entries:
                if e.offset >= segment_size:
                    raise protocol.ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} out of range")

        return {"reference.bucket_checks.check_ranges": check_ranges}


class RangeRejectsEmptyAtEnd(Mutant):
    id = "bkt_range_rejects_empty_at_end"
    bug = ("the range check also demands `offset < size`, so an empty tensor placed right after a bucket filled to "
           "its last byte (offset == size, 0 bytes) is refused")
    kills = frozenset({"BKT-EMPTY-SCALAR"})

    def patches(self):
        def check_ranges(entries, segment_size, where):
            for e in entries:
                if e.offset >= segment_size:
                    raise protocol.ManifestError(f"{where}, tensor {e.name!r}: offset {e.offset} out of range")
            _check_ranges(entries, segment_size, where)

        return {"reference.bucket_checks.check_ranges": check_ranges}


class OverlapMissesOneByte(Mutant):
    id = "bkt_overlap_misses_one_byte"
    bug = "overlap is tested on inclusive last bytes with `<` (`next.offset < end - 1`): a single shared byte passes"
    kills = frozenset({"BKT-OVERLAP"})

    def patches(self):
        def check_overlaps(entries, where):
            spans = sorted((e.offset, e.end, e.name) for e in entries if e.nbytes)
            for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
                if b0 < a1 - 1:
                    raise protocol.ManifestError(f"{where}: tensors {a!r} and {b!r} overlap")

        return {"reference.bucket_checks.check_overlaps": check_overlaps}


class OverlapCountsEmpty(Mutant):
    id = "bkt_overlap_counts_empty"
    bug = "two entries at the same offset are an overlap even when one is empty (0 bytes share nothing)"
    kills = frozenset({"BKT-OVERLAP"})

    def patches(self):
        def check_overlaps(entries, where):
            spans = sorted((e.offset, e.end, e.name) for e in entries)
            for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
                if b0 < a1 or b0 == a0:
                    raise protocol.ManifestError(f"{where}: tensors {a!r} and {b!r} overlap")

        return {"reference.bucket_checks.check_overlaps": check_overlaps}


class NbytesLongAccepted(Mutant):
    id = "bkt_nbytes_long_accepted"
    bug = "nbytes is only checked not to be short (so no byte is left unwritten): a longer entry is accepted"
    kills = frozenset({"BKT-MANIFEST-MISMATCH"})

    def patches(self):
        def check_nbytes(e, where):
            if e.total_nbytes >= checks.math.prod(e.shape) * protocol.DTYPES[e.dtype]:
                return
            _check_nbytes(e, where)

        return {"reference.bucket_checks.check_nbytes": check_nbytes}


def _end_patch(fix):
    def validate_end(message, state):
        _validate_end(fix(dict(message), state), state)

    return {"reference.bucket_checks.validate_end": validate_end}


class EndBucketsUnchecked(Mutant):
    id = "bkt_end_buckets_unchecked"
    bug = "the end's bucket count is not compared with the buckets that arrived (only count and digest are)"
    kills = frozenset({"BKT-END-CHECK"})

    def patches(self):
        return _end_patch(lambda m, st: {**m, "buckets": st.next_bucket})


class EndDigestCaseless(Mutant):
    id = "bkt_end_digest_caseless"
    bug = "the digest is compared case-insensitively (`.lower()`): a digest not in the wire's form is accepted"
    kills = frozenset({"BKT-END-CHECK"})

    def patches(self):
        return _end_patch(lambda m, st: {**m, "digest": m["digest"].lower()} if isinstance(m.get("digest"), str) else m)


class EndVersionProtoUnchecked(Mutant):
    id = "bkt_end_version_proto_unchecked"
    bug = "the end message's version and proto are not checked (only the manifests' are)"
    kills = frozenset({"BKT-END-CHECK"})

    def patches(self):
        return _end_patch(lambda m, st: {**m, "version": st.version, "proto": protocol.PROTO})


class AbortUnhandled(Mutant):
    id = "bkt_abort_unhandled"
    bug = "an `abort` is parsed as a malformed bucket manifest: the error says `field bucket is missing`, not why the trainer gave up"
    kills = frozenset({"BKT-ABORT"})

    def patches(self):
        return {"reference.buckets.check_abort": _skip}


class StatusClearedUntilCommit(Mutant):
    id = "bkt_status_cleared_until_commit"
    bug = "the status stays CLEARED while buckets arrive and reads UPDATING only at the commit"
    kills = frozenset({"BKT-STATUS-UPDATING"})

    def patches(self):
        from reference.status import Status

        update = buckets.update_from_buckets

        def update_from_buckets(manager):
            manager.status = Status.CLEARED
            try:
                update(manager)
            finally:
                manager.status = Status.UPDATING

        return {"reference.buckets.update_from_buckets": update_from_buckets}


class DtypeByItemsize(Mutant):
    id = "bkt_dtype_by_itemsize"
    bug = ("the manifest's dtype is compared with the parameter's by itemsize only (nbytes agree): bf16 sent for an "
           "fp16 parameter, or fp8 for uint8, is staged, and the mismatch shows only when applying, after earlier tensors")
    kills = frozenset({"APPLY-DTYPE-MISMATCH"})

    def patches(self):
        def check_targets(bucket, targets, source):
            for e in bucket.entries:
                t = targets[e.name]
                if protocol.DTYPES[e.dtype] != t.element_size():
                    raise TypeError(f"Type mismatch for {e.name}")
                if tuple(e.shape) != tuple(t.shape):
                    raise ValueError(f"Shape mismatch for {e.name}")

        return {"reference.buckets.check_targets": check_targets}


class ShapeByNumel(Mutant):
    id = "bkt_shape_by_numel"
    bug = "the manifest's shape is compared with the parameter's by element count: (8, 4) for a (4, 8) parameter passes"
    kills = frozenset({"APPLY-SHAPE-MISMATCH"})

    def patches(self):
        import math

        def check_targets(bucket, targets, source):
            for e in bucket.entries:
                t = targets[e.name]
                apply.check_match(e.name, e.dtype, t.shape if math.prod(e.shape) == math.prod(t.shape) else e.shape, t)

        return {"reference.buckets.check_targets": check_targets}


class MissingCheckedAfterApply(Mutant):
    id = "bkt_missing_checked_after_apply"
    bug = ("the commit adopts what arrived and leaves the missing-parameter check to the final verification: an "
           "update lacking a tensor raises, but after the others were applied")
    kills = frozenset({"APPLY-MISSING-FAILS", "BKT-ATOMIC"})

    def patches(self):
        def commit(manager, state, staging, source):
            staging.drop_views()
            manager.apply(((n, staging.tensors[n]) for n in state.order), f"bucket-{state.version}", source)

        return {"reference.buckets.commit": commit}


class RemoteEndpointAllowed(Mutant):
    id = "bkt_remote_endpoint_allowed"
    bug = "the endpoint is only checked for a zmq scheme: a remote tcp:// host puts the control socket on the network"
    kills = frozenset({"BKT-OPTIONS"})

    def patches(self):
        import re

        return {"reference.buckets.LOCAL_ENDPOINT": re.compile(r"^(ipc|tcp)://.+$")}


class EntryFieldsTrusted(Mutant):
    id = "bkt_entry_fields_trusted"
    bug = ("manifest entries are unpacked as they come (`Entry(**raw)` style): a missing field is a bare KeyError, "
           "a negative offset or a str nbytes reaches the copy")
    kills = frozenset({"BKT-FIELDS"})

    def patches(self):
        def parse_entry(raw, where):
            return checks.Entry(raw["name"], raw["dtype"], tuple(raw["shape"]), raw["offset"], raw["nbytes"],
                                raw.get("chunk_offset", 0), raw.get("total_nbytes", raw["nbytes"]))

        return {"reference.bucket_checks.parse_entry": parse_entry}


class NulInNameAccepted(Mutant):
    id = "bkt_nul_in_name_accepted"
    bug = ("a name holding a NUL character is taken as any other str, while the end message's digest ends each "
           "name with a NUL: ['a\\0b'] and ['a', 'b'] digest alike, so the end check cannot tell the two apart")
    kills = frozenset({"BKT-FIELDS"})

    def patches(self):
        return {"reference.bucket_checks.check_name_text": _skip}


class VersionUnsetWithoutExpected(Mutant):
    id = "bkt_version_unset_without_expected"
    bug = ("with no expected version configured, the first manifest's version is never recorded, so nothing is "
           "compared: a trainer switching versions mid-update mixes two versions")
    kills = frozenset({"BKT-VERSION"})

    def patches(self):
        class State(checks.UpdateState):
            def admit(self, bucket):
                version = self.version
                super().admit(bucket)
                self.version = version

        return {"reference.bucket_checks.UpdateState": State}


class ChunkEndUnchecked(Mutant):
    id = "bkt_chunk_end_unchecked"
    bug = ("only total_nbytes is checked against the shape, not that chunk_offset + nbytes stays within it: a last "
           "chunk longer than the rest of the tensor reaches the copy (a bare numpy broadcast error, or a write past it)")
    kills = frozenset({"BKT-CHUNKS"})

    def patches(self):
        def check_nbytes(e, where):
            _check_nbytes(checks.Entry(e.name, e.dtype, e.shape, e.offset, min(e.nbytes, e.total_nbytes - e.chunk_offset),
                                       e.chunk_offset, e.total_nbytes), where)

        return {"reference.bucket_checks.check_nbytes": check_nbytes}


class ErrorsWithoutVersion(Mutant):
    id = "bkt_errors_without_version"
    bug = ("manifest errors name the bucket and the tensor but not the version: with two trainers or a stale one the "
           "operator cannot tell which update was refused")
    kills = frozenset({"BKT-OVERLAP", "BKT-MISALIGNED", "BKT-OFFSET-RANGE", "BKT-DUPLICATE", "BKT-CHUNKS"})

    def patches(self):
        _validate_bucket = checks.validate_bucket

        def validate_bucket(bucket, state, segment_size):
            try:
                _validate_bucket(bucket, state, segment_size)
            except protocol.ManifestError as e:
                raise protocol.ManifestError(str(e).replace(f" of version {bucket.version}", "")) from None

        return {"reference.bucket_checks.validate_bucket": validate_bucket}


# -- found by the red team's loaders (issue 6, second pass): each bug class with its own mutant --------
_check_chunks = checks.check_chunks
_UpdateState = checks.UpdateState
_shared_pools: dict = {}  # the module-level pool of bkt_copy_pool_shared


class TotalNbytesFirstChunkOnly(Mutant):
    id = "bkt_total_nbytes_first_chunk_only"
    bug = ("total_nbytes is checked against the shape on a split tensor's first chunk only (chunk_offset 0); later "
           "chunks' total_nbytes is trusted, not compared with the first chunk's either")
    kills = frozenset({"BKT-MANIFEST-MISMATCH"})

    def patches(self):
        def check_nbytes(e, where):
            if e.chunk_offset == 0:
                _check_nbytes(e, where)
            elif e.chunk_offset + e.nbytes > e.total_nbytes:
                raise protocol.ManifestError(f"{where}, tensor {e.name!r}: chunk runs past total_nbytes")

        def check_chunks(entries, state, where):  # contiguity only: each chunk's total as the first chunk's
            totals = dict(state.totals)
            _check_chunks([dataclasses.replace(e, total_nbytes=totals.setdefault(e.name, e.total_nbytes))
                           for e in entries], state, where)

        return {"reference.bucket_checks.check_nbytes": check_nbytes, "reference.bucket_checks.check_chunks": check_chunks}


class CopyPoolShared(Mutant):
    id = "bkt_copy_pool_shared"
    bug = ("the copy thread pool is a module-level singleton created by the first large bucket and reused by every "
           "later update: its thread outlives update() (and a forked worker inherits a pool without its thread)")
    kills = frozenset({"BKT-NO-LEAK"})

    def patches(self):
        class Shared(_Staging):
            def copy(self, jobs):
                self._pool = self._pool or _shared_pools.get("copy")
                super().copy(jobs)
                if self._pool is not None:
                    _shared_pools["copy"] = self._pool

            def close(self):
                self._pool = None  # kept for the next update

        return {"reference.buckets.Staging": Shared}


class CopyNotAwaited(Mutant):
    id = "bkt_copy_not_awaited"
    bug = ("the threaded copy of a large bucket hands the back of the buffer to a helper thread and returns once "
           "its own share is copied: the ack goes out while the helper still reads the buffer the trainer reuses")
    kills = frozenset({"BKT-ACK-AFTER-COPY"})

    def patches(self):
        class NoWait(_Staging):
            def copy(self, jobs):
                total = sum(d.nbytes for d, _ in jobs)
                if total < buckets.PARALLEL_MIN_BYTES or any(d.nbytes != s.nbytes for d, s in jobs):
                    return super().copy(jobs)
                if self._pool is None:
                    self._pool = buckets.ThreadPoolExecutor(1, thread_name_prefix="bucket-copy")
                front, back, room = [], [], total // 2
                for d, s in jobs:
                    if room > 0:
                        n = min(room, d.nbytes)
                        front.append((d[:n], s[:n]))
                        d, s, room = d[n:], s[n:], room - n
                    if d.nbytes:
                        back.append((d, s))
                # never awaited; the helper starts late, as a descheduled thread does on a busy machine,
                # so that the race this bug loses in production is lost in every run of the zoo
                self._pool.submit(lambda: (time.sleep(0.05), buckets._copy_all(back)))
                buckets._copy_all(front)

        return {"reference.buckets.Staging": NoWait}


def _counting(count_of):
    """Patches that make ``done`` carry ``count_of(state)`` instead of the number of distinct tensors."""
    states = []

    class State(_UpdateState):
        def admit(self, bucket):
            self.entries_seen = getattr(self, "entries_seen", 0) + len(bucket.entries)
            self.with_bytes = getattr(self, "with_bytes", set()) | {e.name for e in bucket.entries if e.nbytes}
            super().admit(bucket)

    def new_update_state(known, version):
        states.append(State(known=frozenset(known), version=version))
        return states[-1]

    class Counting(_Link):
        def tell(self, message):
            if message.get("type") == protocol.DONE:
                message = {**message, "count": count_of(states[-1])}
            super().tell(message)

    return {"reference.buckets.new_update_state": new_update_state, "reference.buckets.Link": Counting}


class DoneCountsEntries(Mutant):
    id = "bkt_done_counts_entries"
    bug = "done's count is the number of manifest entries received, so a tensor split into chunks counts once per chunk"
    kills = frozenset({"BKT-DONE-AFTER-COMMIT"})

    def patches(self):
        return _counting(lambda state: state.entries_seen)


class DoneSkipsEmpty(Mutant):
    id = "bkt_done_skips_empty"
    bug = "done's count is the number of tensors whose bytes were copied: an empty (0-element) tensor is not counted"
    kills = frozenset({"BKT-DONE-AFTER-COMMIT"})

    def patches(self):
        return _counting(lambda state: len(state.with_bytes))


class AckVersionFromOptions(Mutant):
    id = "bkt_ack_version_from_options"
    bug = ("ack and done carry the version the worker was configured to expect (the hello's), so with no expected "
           "version configured they carry nil instead of the update's version")
    kills = frozenset({"BKT-ACK-AFTER-COPY", "BKT-DONE-AFTER-COMMIT"})

    def patches(self):
        class Configured(_Link):
            expected = None

            def request(self, message, where):
                if message.get("type") == protocol.HELLO:
                    self.expected = message.get("version")
                elif message.get("type") == protocol.ACK:
                    message = {**message, "version": self.expected}
                return super().request(message, where)

            def tell(self, message):
                if message.get("type") == protocol.DONE:
                    message = {**message, "version": self.expected}
                super().tell(message)

        return {"reference.buckets.Link": Configured}


class FrameLimitTypo(Mutant):
    id = "bkt_frame_limit_typo"
    bug = "the frame limit is written 64 << 30 (64 GiB) for 64 << 20: any frame is taken in and decoded, however large"
    kills = frozenset({"BKT-FRAME-LIMIT"})

    def patches(self):
        class Typo(_Link):
            max_frame = 64 << 30

        return {"reference.buckets.Link": Typo}


class FrameLimitInclusive(Mutant):
    id = "bkt_frame_limit_inclusive"
    bug = "the frame limit is checked `len(frame) >= limit`: a frame of exactly 64 MiB, which is allowed, is refused"
    kills = frozenset({"BKT-FRAME-LIMIT"})

    def patches(self):
        class Inclusive(_Link):
            max_frame = (64 << 20) - 1

        return {"reference.buckets.Link": Inclusive}


def _silent(link, where) -> Exception:
    """The reference receiver's timeout, as a receiver without its drop detection raises it."""
    return protocol.TransferTimeout(f"ipc_bucket: no message from the trainer at {link.endpoint} within "
                                    f"{link.timeout_s:g}s while waiting for {where}")


def _parsed(link, frame, where):
    """The reference receiver's tail: the REQ socket may send again, the frame decoded."""
    link.can_send = True
    return link.parse(frame, f"message from {link.endpoint} for {where}")


class RefusedFrameReadAsSilence(Mutant):
    id = "bkt_refused_frame_read_as_silence"
    bug = ("the receiver polls only its socket, not the connection's state: ZMQ drops a frame over MAXMSGSIZE with "
           "the connection, and the worker waits out timeout_s and reports a dead trainer that is alive and waiting")
    kills = frozenset({"BKT-FRAME-REFUSED"})

    def patches(self):
        class SocketOnly(_Link):
            def receive(self, where):
                if not self.sock.poll(int(self.timeout_s * 1000), 1):
                    raise _silent(self, where)
                return _parsed(self, self.sock.recv(copy=False).bytes, where)

        return {"reference.buckets.Link": SocketOnly}


class FrameLimitMisstated(Mutant):
    id = "bkt_frame_limit_misstated"
    bug = ("the refused frame's error gives the limit in MiB as max_frame >> 21 (a shift of 21 for 20): "
           "'67108864-byte (32 MiB) frame limit' tells the trainer's author to halve buckets that are not too large")
    kills = frozenset({"BKT-FRAME-REFUSED"})

    def patches(self):
        class Misstated(_Link):
            def receive(self, where):
                try:
                    return super().receive(where)
                except protocol.ManifestError as e:
                    right = f"({self.max_frame / (1 << 20):g} MiB)"
                    if right not in str(e):
                        raise
                    raise protocol.ManifestError(str(e).replace(right, f"({self.max_frame >> 21} MiB)")) from None

        return {"reference.buckets.Link": Misstated}


class SpinningWait(Mutant):
    id = "bkt_spinning_wait"
    bug = ("the receiver waits with non-blocking recv() in a loop until a reply or its deadline (zmq.Again "
           "retried at once): it burns a core of the inference host while a healthy trainer packs its next bucket")
    kills = frozenset({"BKT-IDLE-WAIT"})

    def patches(self):
        import zmq

        class Spinning(_Link):
            def receive(self, where):
                deadline = time.monotonic() + self.timeout_s
                while True:
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        if time.monotonic() >= deadline:
                            raise _silent(self, where) from None
                return _parsed(self, frame, where)

        return {"reference.buckets.Link": Spinning}
