"""The README a newcomer reads first: short, and what it shows works.

* It stays under 250 lines: the rest is in docs/.
* The minimal adapter it shows inline, saved as the file its command names, passes every rule of the capabilities it
  claims and is not applicable elsewhere (a subset of areas: the worked example, docs/example_adapter.py, runs the
  whole suite in tests/test_example_adapter.py).
* ``source .venv/bin/activate`` makes ``python`` the venv's, with the suite's dependencies.
* Every relative link of the README and docs/ reaches a file, and a heading where it names an anchor.
(Its install block and four commands are .ci/run's: tests/test_ci_commands.py; every other command runs in a test
or is said to run by hand: tests/test_docs_commands.py.)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_conformance

MAX_LINES = 250
AREAS = ("SNAP", "PART", "LEVEL")  # the snapshot levels' naming, parts and level rules


def _readme() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_the_readme_is_short():
    lines = _readme().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; at most {MAX_LINES} (move the details to docs/)"


def _adapter() -> tuple[str, str, str]:
    """(file name, class name, source) of the README's inline adapter: the ``python`` block whose first line names
    its file, and the class its run command names."""
    text = _readme()
    block = re.search(r"```python\n(# (\S+\.py)\b.*?)```", text, re.S)
    assert block, "README.md shows no python block starting with the adapter's file name (# my_adapter.py ...)"
    source, name = block.group(1), block.group(2)
    run = re.search(rf"--impl={re.escape(name)}:(\w+)", text)
    assert run, f"README.md shows no command running --impl={name}:CLASS"
    return name, run.group(1), source


def test_the_readmes_adapter_is_about_twenty_lines():
    _, _, source = _adapter()
    code = [line for line in source.splitlines() if line.strip()]
    assert len(code) <= 30, f"the README's adapter has {len(code)} lines of code; keep it minimal (about 20)"


def test_the_readmes_adapter_passes_what_it_claims(tmp_path):
    name, cls, source = _adapter()
    (tmp_path / name).write_text(source)
    rules = [f"--rule={area}" for area in AREAS]
    code, report, output = run_conformance([f"--impl={tmp_path / name}:{cls}", *rules], tmp_path / "report.json")
    assert report is not None, f"no report (exit {code}):\n{output[-3000:]}"
    assert code == 0, f"the README's adapter fails (exit {code}):\n{output[-3000:]}"
    claimed = set(report["run_info"]["capabilities"])
    statuses = {r["id"]: r["status"] for r in report["rules"]}
    bad = {rule: s for rule, s in statuses.items() if s not in ("passed", "not_applicable")}
    assert not bad, f"rules neither passed nor not applicable: {bad}\n{output[-3000:]}"
    assert sum(s == "passed" for s in statuses.values()) >= 10, statuses
    for test in report["tests"]:
        applicable = set(test["requires"]) <= claimed
        want = ("passed", "skipped") if applicable else ("not_applicable",)
        assert test["status"] in want, f"{test['nodeid']} (requires {test['requires']}): {test['status']} {test['message']}"


def test_activating_the_venv_gives_its_python():
    """The README's ``source .venv/bin/activate``, with the venv running these tests."""
    activate = os.path.join(sys.prefix, "bin", "activate")
    if sys.prefix == sys.base_prefix or not os.path.exists(activate):
        pytest.skip(f"these tests do not run in a venv ({sys.prefix}): nothing to activate")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = "/usr/bin:/bin"  # no venv on the path before activating
    script = f'source "{activate}" && python -c "import sys, zmq, conformance; print(sys.prefix)"'
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.path.realpath(proc.stdout.strip()) == os.path.realpath(sys.prefix), proc.stdout


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_every_relative_link_resolves():
    """Every relative link of README.md and docs/*.md names a file that exists and, with ``#anchor``, a heading of it."""
    import glob

    pages = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
    broken = []
    for page in pages:
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(REPO, os.path.dirname(page), path)) if path else os.path.join(REPO, page)
            if not os.path.exists(file):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor:
                with open(file, encoding="utf-8") as f:
                    body = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
                anchors = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", body, re.M)}
                if anchor not in anchors:
                    broken.append(f"{page}: {target} (no heading gives #{anchor})")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)
