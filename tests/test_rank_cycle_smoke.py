"""Smoke run of ``benchmarks/rank_cycle.py`` (one path, 2 ranks, a few MiB, 2 cycles), so the script cannot
rot: it launches the job, prints the phase table and verifies the last cycle bit for bit."""
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(330)  # the job's own 300 s bound below names the command; the default 120 s would cut it first
def test_rank_cycle_benchmark_smoke(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.rank_cycle", "--model-mib", "8", "--cycles", "2", "--path", "bucket",
           "--bucket-mib", "1", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # its group (the benchmark, its trainers); the launchers and ranks die with it (their death signal)
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(no output: a process outside its group still holds its pipes)"
        pytest.fail(f"{' '.join(cmd)} did not end within 300 s:\n{(stdout + stderr)[-3000:]}")
    output = stdout + stderr
    assert out.exists(), f"{' '.join(cmd)} wrote no rows (exit {proc.returncode}):\n{output[-3000:]}"
    report = json.loads(out.read_text())
    assert report["verified"] == {"bucket": True}, report
    (row,) = report["rows"]
    assert row["path"] == "bucket" and row["cycles"] == 2, row
    assert row["transfer_s"]["best"] > 0 and row["transfer_s"]["best"] <= row["transfer_s"]["median"], row
    for phase in ("clear", "apply", "agree", "finalize", "beyond"):
        assert 0 <= row[phase]["best"] <= row[phase]["median"], (phase, row)
    for column in ("transfer s", "clear", "agree", "beyond transfer", "verdict"):
        assert column in stdout, f"table column {column!r} missing:\n{stdout}"
