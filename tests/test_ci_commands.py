"""CI runs what the README tells a new user to run: every test command of the README's first code block is
a line of ``.ci/run`` (as run from the fresh venv)."""
import os
import re

from tests.conftest import REPO


def _readme_commands() -> list[str]:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split(" && ")[-1].strip() for line in block.splitlines() if "-m pytest" in line]


def test_ci_runs_every_readme_command():
    commands = _readme_commands()
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert len(commands) >= 3, f"expected the README's test commands (quick run, project tests, tiers), got {commands}"
    missing = [c for c in commands if c not in ci]
    assert not missing, f".ci/run does not run these README commands: {missing}"
