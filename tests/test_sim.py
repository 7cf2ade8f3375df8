"""The simulator (sim/): wire-format units, the CLI run as docs/simulator.md shows it, and nothing left behind.

After every test no shared-memory segment of ours is left in /dev/shm and no child process runs.
"""
import hashlib
import io
import os
import pickle
import re
import subprocess
import sys
import time

import msgpack
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import bucket_checks as C
from wire import protocol as P
from wire.handles import leaked_segments
from tests.conftest import REPO

# tests/early.py: this module runs before the background jobs start. Its leak check counts a segment of any
# process that is gone (a trainer of ours that died) as this test's: a job's dead processes would be too.
RUNS_BEFORE_THE_JOBS = True


def _left_by_us(name: str) -> bool:
    """A segment of this process, or of a process that is gone (a trainer of ours that died).
    Live segments of other processes (a test run beside this one) are theirs to clean up."""
    try:
        pid = int(name.split("_")[1])
    except (IndexError, ValueError):
        return True
    return pid == os.getpid() or not psutil.pid_exists(pid)


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = set(leaked_segments())
    me = psutil.Process()
    earlier = {p.pid for p in me.children(recursive=True)}  # started by other test modules, not ours to judge
    yield
    children = [p for p in me.children(recursive=True) if p.pid not in earlier]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"child processes still running after the test: {[(p.pid, p.cmdline()) for p in alive]}"
    left = [n for n in leaked_segments() if n not in before and _left_by_us(n)]
    assert not left, f"shared-memory segments left in /dev/shm after the test: {left}"


def _documented_command() -> list[str]:
    """The first round-trip command of docs/simulator.md (the page's first code block)."""
    text = open(os.path.join(REPO, "docs", "simulator.md"), encoding="utf-8").read()
    line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith(".venv/bin/python -m sim roundtrip"))
    return line.split()


def _run(args, timeout=120):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


SUMMARY_ROW = re.compile(r"│\s+(\d+) │\s+(\d+)/(\d+) │\s+(\d+)/(\d+) │\s+(\d+)/(\d+) │")


def _summary(output: str):
    return [tuple(int(g) for g in m.groups()) for m in SUMMARY_ROW.finditer(output)]


def test_the_documented_roundtrip_command():
    """``.venv/bin/python -m sim roundtrip --ranks 2 --model-mib 64 --bucket-mib 16 --versions 3``, verbatim from
    docs/simulator.md."""
    cmd = _documented_command()
    code, out, _ = _run(cmd)
    assert code == 0, f"{' '.join(cmd)} exited {code}:\n{out[-4000:]}"
    versions = int(cmd[cmd.index("--versions") + 1])
    ranks = int(cmd[cmd.index("--ranks") + 1])
    rows = _summary(out)
    assert [r[0] for r in rows] == list(range(1, versions + 1)), f"per-version rows {rows} in:\n{out[-3000:]}"
    for version, ok_ranks, n_ranks, ok, total, models_ok, models in rows:
        assert (ok_ranks, n_ranks) == (ranks, ranks), f"version {version}: ranks ok {ok_ranks}/{n_ranks}"
        assert ok == total > 0, f"version {version}: tensors OK {ok}/{total}\n{out[-3000:]}"
        assert models_ok == models == ranks, f"version {version}: models OK {models_ok}/{models}\n{out[-3000:]}"
    assert "MISMATCH" not in out and "throughput:" in out, out[-3000:]
    for title in ("Tensor digests sent vs landed", "Model digests sent vs landed"):
        assert title in out, f"{title!r} table missing:\n{out[-3000:]}"


def test_killed_trainer_is_a_timeout_naming_bucket_and_version():
    cmd = ["python", "-m", "sim", "roundtrip", "--ranks", "2", "--model-mib", "4", "--bucket-mib", "1", "--versions", "2",
           "--kill-trainer-at", "1", "--timeout-s", "3", "--no-progress"]
    code, out, elapsed = _run(cmd)
    assert code == 2, f"{' '.join(cmd)} exited {code}, expected 2 (update failed):\n{out[-3000:]}"
    flat = " ".join(out.split())  # rich wraps long lines
    assert "rank 0: update failed: TransferTimeout" in flat and "bucket 1 of version 1" in flat, out[-3000:]
    assert "within 3s" in flat, out[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f}s"


def test_meta_file_path_roundtrip():
    cmd = ["python", "-m", "sim", "roundtrip", "--ranks", "2", "--model-mib", "4", "--versions", "2", "--path", "meta",
           "--no-progress"]
    code, out, _ = _run(cmd)
    assert code == 0, f"{' '.join(cmd)} exited {code}:\n{out[-3000:]}"
    rows = _summary(out)
    assert len(rows) == 2 and all(r[3] == r[4] > 0 and r[5] == r[6] == 2 for r in rows), f"rows {rows}:\n{out[-3000:]}"


def test_benchmark_script_smoke(tmp_path):
    """benchmarks/bucket_throughput.py on a tiny model, so the script cannot rot."""
    out_json = tmp_path / "rows.json"
    cmd = ["python", "-m", "benchmarks.bucket_throughput", "--model-mib", "8", "--buckets", "1,4", "--repeat", "1",
           "--json", str(out_json), "--png", str(tmp_path / "plot.png")]
    code, out, _ = _run(cmd, timeout=180)
    assert code == 0, f"{' '.join(cmd)} exited {code}:\n{out[-3000:]}"
    for column in ("bucket MiB", "GB/s", "x memcpy", "verified"):
        assert column in out, f"column {column!r} missing:\n{out[-3000:]}"
    import json

    rows = json.loads(out_json.read_text())["rows"]
    assert [r["bucket_mib"] for r in rows] == [1, 4] and all(not r["mismatches"] and r["verified"] for r in rows), rows
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_render_reports_mismatch_and_exit_status():
    from rich.console import Console

    from sim.cli import ModelCheck, TensorCheck, VersionResult, model_spec, render

    model = model_spec(1)
    good = TensorCheck(0, 1, "w", "float32", (2,), "a" * 32, "a" * 32, "c" * 32, "c" * 32)
    bad = TensorCheck(0, 1, "v", "float32", (2,), "a" * 32, "b" * 32, "c" * 32, "d" * 32)
    md5_only = TensorCheck(0, 1, "u", "float32", (2,), "a" * 32, "a" * 32, "c" * 32, "d" * 32)
    same = ModelCheck(0, 1, {"xxh3": "e" * 32, "md5": "f" * 32}, {"xxh3": "e" * 32, "md5": "f" * 32})
    differs = ModelCheck(0, 1, {"xxh3": "e" * 32, "md5": "f" * 32}, {"xxh3": "e" * 32, "md5": "0" * 32})
    cases = [([bad], [same], 1), ([md5_only], [same], 1), ([good], [differs], 1), ([good], [same], 0),
             ([good], [ModelCheck(0, 1, {}, {})], 1)]
    for checks, models, want in cases:
        buf = io.StringIO()
        status = render([VersionResult(1, 8, 0.1, checks, models)], Console(file=buf, width=200), model, 1)
        assert status == want, (checks, models, buf.getvalue())
        assert ("MISMATCH" in buf.getvalue()) == bool(want), buf.getvalue()


def test_a_failed_run_reports_no_throughput():
    """A run whose update failed (or whose digests differ) prints no throughput: a rate would read as a result."""
    from rich.console import Console

    from sim.cli import ModelCheck, TensorCheck, VersionResult, model_spec, render

    model = model_spec(1)
    good = TensorCheck(0, 1, "w", "float32", (2,), "a" * 32, "a" * 32, "c" * 32, "c" * 32)
    same = ModelCheck(0, 1, {"xxh3": "e" * 32}, {"xxh3": "e" * 32})
    failed = VersionResult(1, 8 << 20, 0.1, [], [], {1: TimeoutError("no bucket 1 of version 1 within 1s")})
    for results, want, line in (([VersionResult(1, 8 << 20, 0.1, [good], [same])], 0, "throughput: 0.08 GB/s"),
                                ([failed], 2, "no throughput reported: the run failed (an update failed)")):
        buf = io.StringIO()
        assert render(results, Console(file=buf, width=200), model, 2) == want, buf.getvalue()
        out = buf.getvalue()
        assert line in out and (want == 0) == ("throughput:" in out), out
        if want:
            assert not re.search(r"\d GB/s|│\s+\d+\.\d\d\s+│\s*$", out, re.M), f"a rate for a failed version:\n{out}"


CORRUPTING_RECEIVER = """
import sys
import numpy as np
from reference import buckets
from sim.cli import main
from sim.interrupt import exit_process

real = buckets.stage_bucket

def stage_bucket(staging, segment, entries):  # a receiver that lands one wrong bit in one tensor
    real(staging, segment, entries)
    view = staging._bytes.get("norm.weight")
    if view is not None and any(e.name == "norm.weight" for e in entries):
        view[-1] ^= 1

buckets.stage_bucket = stage_bucket
exit_process(main(sys.argv[1:]))
"""


def test_a_wrong_landed_bit_fails_the_run():
    """A receiver that flips the last bit of one tensor: the CLI names that tensor and the model, on
    every rank and version, and exits 1, not 0 (and not 2: the update itself succeeded)."""
    args = ["roundtrip", "--ranks", "2", "--model-mib", "1", "--bucket-mib", "0.25", "--versions", "2", "--no-progress"]
    proc = subprocess.run([sys.executable, "-c", CORRUPTING_RECEIVER, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"exit {proc.returncode}, expected 1 (a digest differs):\n{out[-3000:]}"
    flat = " ".join(out.split())
    bad = [line for line in out.splitlines() if "MISMATCH" in line]
    assert len([b for b in bad if "norm.weight" in b]) == 4, f"norm.weight on 2 ranks x 2 versions:\n{out[-3000:]}"
    assert len(bad) == 4 + 4, f"4 tensor rows and 4 model rows, nothing else:\n{out[-4000:]}"
    rows = _summary(out)
    assert [r[3:] for r in rows] == [(36, 38, 0, 2)] * 2, f"tensors OK 36/38, models OK 0/2 per version: {rows}"


# -- wire format units -----------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12), bucket=st.integers(1, 12).map(lambda k: k * 256))
def test_plan_layout_invariants(sizes, bucket):
    names = [f"t{i}" for i in range(len(sizes))]
    layout = P.plan_layout(list(zip(names, sizes)), bucket)
    covered = {n: 0 for n in names}
    for k, entries in enumerate(layout):
        spans = sorted((p.offset, p.offset + p.nbytes) for p in entries if p.nbytes)
        assert all(b0 >= a1 for (_, a1), (b0, _) in zip(spans, spans[1:])), f"bucket {k} overlaps: {entries}"
        for p in entries:
            assert p.offset % P.ALIGN == 0 and p.offset + p.nbytes <= bucket, f"bucket {k}: {p}"
            assert p.chunk_offset == covered[p.name], f"{p.name}: chunk at {p.chunk_offset}, expected {covered[p.name]}"
            covered[p.name] += p.nbytes
            if p.nbytes != p.total_nbytes:
                assert p.total_nbytes > bucket, f"{p.name} ({p.total_nbytes} bytes) split although it fits a bucket"
    assert covered == dict(zip(names, sizes))


def test_decode_never_unpickles(tmp_path):
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (os.makedirs, (str(marker),))

    with pytest.raises(P.ManifestError, match="pickle"):
        P.decode(pickle.dumps({"type": "bucket", "x": Boom()}), "test")
    assert not marker.exists()


@pytest.mark.parametrize(
    "frame,match",
    [(msgpack.packb([1, 2]), "expected a map"), (msgpack.packb({"type": "nope"}), "field type"),
     (msgpack.packb({"type": "bucket", "x": msgpack.ExtType(5, b"x")}), "extension type"), (b"\xc1", "not a msgpack")],
    ids=["list", "unknown-type", "ext-type", "garbage"],
)
def test_decode_rejects(frame, match):
    with pytest.raises(P.ManifestError, match=match):
        P.decode(frame, "test")


def test_manifest_roundtrip_and_digest():
    placements = P.plan_layout([("a", 3), ("b", 8)], 1024)[0]
    msg = P.bucket_manifest(7, 0, b"h" * 64, placements, {"a": "uint8", "b": "float32"}, {"a": (3,), "b": (2,)})
    state = C.UpdateState(known={"a", "b"}, version=7)
    bucket = C.parse_bucket(P.decode(P.encode(msg), "test"), state)
    C.validate_bucket(bucket, state, 1024)
    assert [(e.name, e.offset, e.nbytes) for e in bucket.entries] == [("a", 0, 3), ("b", 256, 8)]
    state.admit(bucket)
    C.validate_end(P.decode(P.encode(P.end(7, 1, ["a", "b"])), "test"), state)
    assert P.name_digest(["ab", "c"]) != P.name_digest(["a", "bc"]), "digest must keep name boundaries"
    with pytest.raises(P.ManifestError, match="digest"):
        C.validate_end(P.end(7, 1, ["b", "a"]), state)


def test_the_trainer_side_refuses_a_name_holding_a_nul():
    """BKT-FIELDS on the trainer's side: NUL ends each name in the end digest, so ["a\\0b"] and ["a", "b"] would
    digest alike; planning a layout or building the digest of such a name is refused naming it, and the
    receiver's check refuses it in a manifest (the conformance case entry-name-nul drives a real worker)."""
    assert P.name_digest(["a", "b"]) == hashlib.sha256(b"a\0b\0").hexdigest()
    for call in (lambda: P.name_digest(["a\0b"]), lambda: P.plan_layout([("w", 4), ("a\0b", 4)], 1024),
                 lambda: P.end(1, 1, ["a\0b"])):
        with pytest.raises(ValueError, match=r"tensor 'a\\x00b': a name may not hold a NUL character \(index 1\)"):
            call()
    assert P.plan_layout([("a\N{NO-BREAK SPACE}b", 4)], 1024)[0][0].name == "a\xa0b", "any other character is carried"
    entry = C.Entry("a\0b", "uint8", (4,), 0, 4, 0, 4)
    with pytest.raises(P.ManifestError, match=r"bucket 0 of version 1, tensor 'a\\x00b': field name holds a NUL"):
        C.check_name_text(entry, "bucket 0 of version 1")
    C.check_name_text(C.Entry("a.b", "uint8", (4,), 0, 4, 0, 4), "bucket 0 of version 1")


def test_a_frame_over_the_limit_is_reported_as_such_not_as_a_dead_trainer():
    """ZMQ drops a frame over MAXMSGSIZE together with the connection; the receiver says the frame was too
    large (at once, not after its timeout as "trainer dead or stalled"). A trainer that really went away is
    still a timeout naming a dead or stalled trainer, and a frame at the limit is taken in."""
    import shutil
    import tempfile
    import zmq

    from reference.buckets import Link

    class SmallFrames(Link):
        max_frame = 4096

    base = tempfile.mkdtemp(prefix="wsfl")
    ctx = zmq.Context.instance()
    try:
        for case, reply, timeout_s in (("over", 4097, 30.0), ("at", 4096, 30.0), ("gone", None, 0.3)):
            endpoint = f"ipc://{base}/{case}.sock"
            trainer = ctx.socket(zmq.ROUTER)
            trainer.setsockopt(zmq.LINGER, 0)
            trainer.bind(endpoint)
            link = SmallFrames(endpoint, timeout_s)
            try:
                link.sock.send(P.encode(P.hello(3)))
                ident, _, _ = trainer.recv_multipart()
                if reply is None:
                    trainer.close()  # the trainer goes away while a reply is due
                else:
                    pad = reply
                    while len(frame := P.encode(P.abort(3, "x" * pad))) != reply:
                        pad -= len(frame) - reply  # msgpack's str header grows with the str
                    assert len(frame) == reply, (case, len(frame))
                    trainer.send_multipart([ident, b"", frame])
                start = time.monotonic()
                if case == "at":
                    assert link.receive("bucket 0 of version 3")["type"] == P.ABORT
                    continue
                expected = (P.ManifestError, r"trainer at ipc://\S+ sent a frame the transport refused while bucket 0 of "
                            r"version 3 was awaited: a frame over the 4096-byte \(0.00390625 MiB\) frame limit") \
                    if case == "over" else (P.TransferTimeout, r"within 0.3s while waiting for bucket 0 of version 3 "
                                                               r"\(trainer dead or stalled\)")
                with pytest.raises(expected[0], match=expected[1]):
                    link.receive("bucket 0 of version 3")
                elapsed = time.monotonic() - start
                assert elapsed < 10.0, f"{case}: raised after {elapsed:.2f}s (the frame limit at once, the deadline once)"
            finally:
                link.close()
                trainer.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
