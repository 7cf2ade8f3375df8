"""docs/ci/conformance-gate.yml, the workflow an engine repository copies: it checks out the whole history,
installs the suite, runs the history tool's gate on the pull request's range with options the tool really
has (its own argument parser reads the command), and uploads what the tool writes."""
from __future__ import annotations

import os
import re
import shlex

import pytest
import yaml

from conformance.history import cli
from tests.conftest import REPO

WORKFLOW = os.path.join(REPO, "docs", "ci", "conformance-gate.yml")
BASE, HEAD = "${{ github.event.pull_request.base.sha }}", "${{ github.event.pull_request.head.sha }}"


@pytest.fixture(scope="module")
def workflow():
    with open(WORKFLOW, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    job = data["jobs"]["gate"]
    return data, job, job["steps"]


def _step(steps, predicate):
    found = [s for s in steps if predicate(s)]
    assert len(found) == 1, f"expected one such step, found {len(found)}: {found}"
    return found[0]


def _expand(command: str, env: dict) -> list[str]:
    """The step's shell command as argv: GitHub's ${{ }} expressions and the job's $VARS substituted."""
    command = command.replace(BASE, "BASESHA").replace(HEAD, "HEADSHA")
    assert "${{" not in command, f"an expression the test does not know: {command}"
    for name, value in env.items():
        command = command.replace(f'"${name}"', shlex.quote(str(value))).replace(f"${name}", str(value))
    assert "$" not in command, f"an unexpanded variable: {command}"
    return shlex.split(command)


def test_it_runs_on_pull_requests_with_the_whole_history(workflow):
    data, job, steps = workflow
    on = data.get("on", data.get(True))  # YAML 1.1 reads a bare `on` as true
    assert "pull_request" in on, on
    checkout = _step(steps, lambda s: str(s.get("uses", "")).startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0, "the gate reads the base and every commit of the request"
    assert _step(steps, lambda s: str(s.get("uses", "")).startswith("actions/setup-python@"))
    install = _step(steps, lambda s: "pip install" in str(s.get("run", "")))
    assert install["name"] == "Install the conformance suite", install
    lines = [line for line in install["run"].splitlines() if line.strip()]
    assert len(lines) == 1 and re.match(r'python -m pip install "weightsync-conformance( @ \S+)?"$', lines[0]), lines
    text = open(WORKFLOW, encoding="utf-8").read()
    assert "# ---- the suite: this one line installs it" in text, "the install line is marked for the reader"


def test_the_gate_command_is_one_the_tool_accepts(workflow):
    data, job, steps = workflow
    gate = _step(steps, lambda s: "conformance.history" in str(s.get("run", "")))
    argv = _expand(gate["run"], job.get("env", {}))
    assert argv[:3] == ["python", "-m", "conformance.history"], argv
    parser, args = cli.parse(argv[3:])  # exits (SystemExit) on an option the tool does not have
    assert args.fail_on_regression and args.repo == "." and args.rev_range == "BASESHA..HEADSHA", args
    assert args.path == job["env"]["GATE_FILE"] == "fastdeploy/rl/dynamic_weight_manager.py"
    assert args.impl == "fastdeploy" and args.extra == [], f"arguments passed on to pytest: {args.extra}"
    assert args.output == job["env"]["GATE_OUT"]
    # What is uploaded is what the tool writes into -o, whatever the step's outcome.
    upload = _step(steps, lambda s: str(s.get("uses", "")).startswith("actions/upload-artifact@"))
    assert upload.get("if") == "always()", "a failed gate's reports are what the author needs"
    paths = [p.strip() for p in upload["with"]["path"].splitlines() if p.strip()]
    assert sorted(paths) == sorted(f"{args.output}/{n}" for n in ("gate.json", "history.json", "history.html",
                                                                   "reports/")), paths
    cache = _step(steps, lambda s: str(s.get("uses", "")).startswith("actions/cache@"))
    assert cache["with"]["path"] == f"{args.output}/.history-cache", "the tool's default cache folder"


def test_the_file_it_watches_is_the_file_it_gates(workflow):
    data, job, steps = workflow
    on = data.get("on", data.get(True))
    assert job["env"]["GATE_FILE"] in on["pull_request"]["paths"]
    assert re.search(r"\.github/workflows/conformance-gate\.yml", " ".join(on["pull_request"]["paths"]))
