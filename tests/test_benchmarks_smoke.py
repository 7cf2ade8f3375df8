"""Smoke run of ``benchmarks/snapshot_memory.py`` with a few MiB, so the script cannot rot.

Small enough to be quick (two child processes), yet it still catches a loader whose parameters
stay views of the snapshot file's mmap: their final RSS is then near 0, not near M.
"""
import json
import subprocess
import sys

from tests.conftest import REPO


def test_snapshot_memory_benchmark_smoke(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.snapshot_memory", "--model-mib", "64", "--parts", "2",
           "--tensors", "4", "--work-dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-3000:]}"
    for column in ("layout", "peak/M", "final/M", "target/M", "verdict"):
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
    assert list(tmp_path.glob("snapshot-memory-*")) == [], "the benchmark left its snapshot files behind"
