"""Smoke run of ``benchmarks/prefetch.py`` on a few MiB, so the script cannot rot: the command docs/benchmarks.md
shows (its malloc settings and loader), with smaller sizes."""
import json
import os
import subprocess
import sys

from tests.conftest import REPO


def test_prefetch_benchmark_smoke(tmp_path):
    out = tmp_path / "prefetch.json"
    cmd = [sys.executable, "-m", "benchmarks.prefetch", "--loader", "device", "--tensors", "6", "--tensor-mib", "1",
           "--repeat", "1", "--windows", "2", "--json", str(out)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="4294967296", MALLOC_TRIM_THRESHOLD_="17179869184")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-3000:]}"
    for column in ("queue", "median s", "x queue 1 (median)", "verified"):
        assert column in proc.stdout, f"table column {column!r} missing from the output:\n{proc.stdout}"
    result = json.loads(out.read_text())
    assert [r["window"] for r in result["rows"]] == [1, 2], result["rows"]
    assert all(r["verified"] and r["median_s"] > 0 for r in result["rows"]), result["rows"]
    assert result["rows"][0]["speedup_median"] == 1.0, "queue 1 is the baseline of the ratios"
