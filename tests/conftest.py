import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_conformance(impl_args: list[str], report_path, extra: list[str] = (), timeout: int = 300):
    """Run the conformance suite in a subprocess; return (exit code, report dict, output)."""
    cmd = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider",
           f"--conformance-report={report_path}", *impl_args, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    report = None
    if os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)
    return proc.returncode, report, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def reference_report(tmp_path_factory):
    """The full conformance run against the reference, once per session."""
    path = tmp_path_factory.mktemp("reference") / "report.json"
    code, report, output = run_conformance(["--impl=reference"], path)
    return code, report, output
