"""Smoke runs of the benchmarks with a few MiB, so the scripts cannot rot.

Small enough to be quick, yet the snapshot one still catches a loader whose parameters stay views
of the snapshot file's mmap: their final RSS is then near 0, not near M. Times are not judged here
(a loaded machine would make that flaky): only that every figure is measured and reported.
"""
import json
import os
import subprocess
import sys

from tests.conftest import REPO

# tests/early.py: these benchmarks time cold reads from the disk, which the background jobs fill with gigabytes of
# writes (the smoke runs took 11 s alone, 62 s beside them): they run before the jobs start.
RUNS_BEFORE_THE_JOBS = True


def _snapshot_memory_smoke(tmp_path, model_mib: str, *extra: str) -> dict:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.snapshot_memory", "--model-mib", model_mib, "--parts", "2",
           "--tensors", "4", "--repeat", "1", "--work-dir", str(tmp_path), "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-3000:]}"
    for column in ("layout", "peak/M", "final/M", "target/M", "verdict", "load s", "cold read s", "load/read"):
        assert column in proc.stdout, f"table column {column!r} missing from the output:\n{proc.stdout}"
    report = json.loads(out.read_text())
    rows = {(r["layout"], r["k"]): r for r in report["rows"]}
    assert set(rows) == {("single", 1), ("parts", 2)}, f"rows {sorted(rows)}, expected single/1 and parts/2"
    for key, r in rows.items():
        assert r["status"] == "NORMAL", f"{key}: manager status {r['status']}, expected NORMAL"
        assert r["sources"] == key[1], f"{key}: {r['sources']} sources applied, expected {key[1]}"
        assert r["verdict"] == "pass", f"{key}: verdict {r['verdict']!r}, peak/M {r['peak_over_m']:.2f}"
        assert 0.8 <= r["final_over_m"] <= 1.5, (
            f"{key}: final RSS increase {r['final_over_m']:.2f} x M, expected about 1 (weights resident and owned)"
        )
        assert r["weights_file_over_m"] < 0.5, (
            f"{key}: {r['weights_file_over_m']:.2f} x M of the weights are file-backed (views of the snapshot mmap)"
        )
        assert len(r["load_seconds"]) == len(r["read_seconds"]) == 1 and min(r["read_seconds"]) > 0, (
            f"{key}: one round of load and cold read expected, got {r['load_seconds']} and {r['read_seconds']}"
        )
        assert r["load_over_read_median"] == r["load_seconds"][0] / r["read_seconds"][0], f"{key}: {r}"
    assert list(tmp_path.glob("snapshot-memory-*")) == [], "the benchmark left its snapshot files behind"
    return report


def test_snapshot_memory_benchmark_smoke(tmp_path):
    """RL's cycle: a load, clear(), then the update measured."""
    report = _snapshot_memory_smoke(tmp_path, "64")
    assert "--first-load" not in report["command"], report["command"]


def test_snapshot_memory_first_load_smoke(tmp_path):
    """``--first-load``: the first load of the lazily built model measured instead."""
    report = _snapshot_memory_smoke(tmp_path, "32", "--first-load")
    assert "--first-load" in report["command"], report["command"]


def test_snapshot_parts_benchmark_smoke(tmp_path):
    out = tmp_path / "parts.json"
    cmd = [sys.executable, "-m", "benchmarks.snapshot_parts", "--parts", "40", "--repeat", "1",
           "--work-dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert report["parts"] == 40 and run["read_bytes"] > 40 * 16 * 64 * 4, f"baseline read {run['read_bytes']} bytes"
    for key in ("update_s", "read_s", "gc_collect_s"):
        assert run[key] > 0, f"{key} not measured: {run}"
    assert "update()" in proc.stdout and "gc.collect()" in proc.stdout, proc.stdout
    assert list(tmp_path.glob("snapshot-parts-*")) == [], "the benchmark left its part files behind"


def test_snapshot_parts_one_file_benchmark_smoke(tmp_path):
    out = tmp_path / "one-file.json"
    cmd = [sys.executable, "-m", "benchmarks.snapshot_parts", "--parts", "4", "--tensors", "40", "--rows", "1",
           "--cols", "16", "--one-file", "--repeat", "2", "--work-dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    report = json.loads(out.read_text())
    assert report["tensors"] == 40 and len(report["runs"]) == 2, report
    assert [r["first"] for r in report["runs"]] == ["parts", "one-file"], "the layouts do not alternate going first"
    for run in report["runs"]:
        assert run["one_file_s"] > 0 and run["one_file_over_parts"] == run["one_file_s"] / run["update_s"], run
    assert "in one file" in proc.stdout and "one file / parts" in proc.stdout, proc.stdout
    assert list(tmp_path.glob("snapshot-parts-*")) == [], "the benchmark left its files behind"


def test_bucket_benchmark_smoke(tmp_path):
    out = tmp_path / "buckets.json"
    cmd = [sys.executable, "-m", "benchmarks.bucket_throughput", "--model-mib", "16", "--buckets", "4",
           "--repeat", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["seconds"]) == len(row["two_copy_s"]) == 2, f"two rounds of each expected: {row}"
    assert row["verified"] > 0 and row["mismatches"] == [], f"landed bytes not verified: {row}"
    assert row["x_two_copy_best"] == min(row["two_copy_s"]) / min(row["seconds"]), row
    for column in ("end to end s", "two copies s", "x two-copy"):
        assert column in proc.stdout, f"table column {column!r} missing from the output:\n{proc.stdout}"


def test_fresh_memory_benchmark_smoke(tmp_path):
    out = tmp_path / "fresh.json"
    cmd = [sys.executable, "-m", "benchmarks.fresh_memory", "--mib", "16", "--repeat", "1", "--gap-s", "0.1",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4 and all(len(v) == 1 and v[0] > 0 for v in results.values()), results


def test_wait_probe_tells_waiting_from_cpu(tmp_path):
    """benchmarks/wait_probe.py: a test that sleeps is counted as waiting, with next to no CPU; one that computes has
    its CPU counted to it, and its wall time split into that CPU and the rest (on a loaded machine the rest is the
    time it waited for a core, which the probe counts as waiting, as it should: nothing here depends on the load); an
    earlier run's file of the same name is not summed with this run's."""
    from benchmarks import wait_probe

    (tmp_path / "test_sleeps.py").write_text("import time\ndef test_sleeps():\n    time.sleep(0.5)\n")
    (tmp_path / "test_computes.py").write_text(
        "import time\ndef test_computes():\n    end = time.process_time() + 0.5\n    while time.process_time() < end:\n"
        "        pass\n")
    out = tmp_path / "probe"
    (tmp_path / "probe.1.json").write_text(json.dumps([["test_earlier_run.py::test_x", 9.0, 1.0]]))  # an earlier run's
    env = {**os.environ, "WAIT_PROBE_OUT": str(out), "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.wait_probe",
                           "test_sleeps.py", "test_computes.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = wait_probe.summarize(str(out))
    rows = {line.split()[-1]: [float(v) for v in line.split()[1:8:3]] for line in text.splitlines()[1:]}
    sleeps, computes = rows["test_sleeps.py"], rows["test_computes.py"]  # [waiting, wall, CPU]
    assert sleeps[0] >= 0.4 and sleeps[2] < 0.3, f"the sleeping test: {sleeps}\n{text}"
    assert computes[2] >= 0.45, f"the computing test's CPU (it burns 0.5 s of it): {computes}\n{text}"
    assert abs(computes[1] - computes[2] - computes[0]) <= 0.11, f"the computing test's wall is not its CPU and " \
        f"its waiting: {computes}\n{text}"
    assert text.startswith("2 tests:"), text
