import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sigint_at_default() -> None:
    """``preexec_fn`` for a child a test sends SIGINT: the signal at its default disposition, as a terminal's
    child has it. A run started in the background by a non-interactive shell inherits SIGINT ignored, and
    Python leaves an ignored SIGINT ignored (no KeyboardInterrupt), so the test would measure the shell."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
