"""CI runs what the README tells a new user to run: the README's "Install once" block and its four commands are
lines of ``.ci/run``, the commands in the same order (every other command of the README and docs/ is checked by
tests/test_docs_commands.py)."""
import os
import re

from tests.conftest import REPO


def _block(heading: str) -> list[str]:
    """The command lines of the first ``bash`` block under the README's ``## heading``, comments stripped."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"README.md has no section '## {heading}'"
    block = re.search(r"```bash\n(.*?)```", section.group(1), re.S)
    assert block, f"README.md's section '## {heading}' has no bash block"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _ci_lines() -> list[str]:
    return open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().splitlines()


def test_ci_runs_every_readme_command():
    commands = _block("The four commands")
    assert len(commands) == 4 and all(c.startswith(".venv/bin/python -m pytest ") for c in commands), (
        f"the README's four commands (quick run, project tests, tiers, two hosts), got {commands}")
    ci = [line for line in _ci_lines() if line.startswith(".venv/bin/python -m pytest ")]
    assert ci == commands, f".ci/run's test commands {ci} are not the README's four, in order: {commands}"


def test_ci_installs_as_the_readme_says():
    install = _block("Install once")
    assert install and install[0] == "python3 -m venv .venv", install
    missing = [line for line in install if line not in _ci_lines()]
    assert not missing, f".ci/run does not run these lines of the README's 'Install once': {missing}"


def _chromium_step(tmp_path, apt_script: str | None, present: bool = False):
    """Run .ci/chromium with a stub apt-get first on PATH (recording its calls) and CHROMIUM in tmp_path."""
    import stat
    import subprocess

    stubs = tmp_path / "bin"
    stubs.mkdir()
    chromium = tmp_path / "chromium"
    calls = tmp_path / "calls"
    if present:
        chromium.write_text("#!/bin/sh\n")
        chromium.chmod(0o755)
    if apt_script is not None:
        apt = stubs / "apt-get"
        apt.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n{apt_script}\n')
        apt.chmod(apt.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", CHROMIUM=str(chromium))
    proc = subprocess.run([os.path.join(REPO, ".ci", "chromium")], env=env, capture_output=True, text=True, timeout=60)
    return proc, (calls.read_text().splitlines() if calls.exists() else [])


def test_ci_installs_chromium_when_missing(tmp_path):
    """The matrix page's browser test must not skip in CI for want of a browser: apt-get update, then install -y
    chromium, only when it is missing."""
    chromium = tmp_path / "chromium"
    proc, calls = _chromium_step(tmp_path, f'[ "$1" = install ] && printf "#!/bin/sh\\n" > {chromium} && chmod +x {chromium}; exit 0')
    if os.getuid() != 0:
        import pytest

        pytest.skip("installing with apt-get needs root (or passwordless sudo) on this machine")
    assert calls == ["update", "install -y chromium"], calls
    assert proc.returncode == 0 and "chromium installed from the system's packages" in proc.stdout, proc.stdout + proc.stderr


def test_ci_leaves_a_present_chromium_alone(tmp_path):
    proc, calls = _chromium_step(tmp_path, "exit 0", present=True)
    assert calls == [] and proc.returncode == 0 and "chromium present" in proc.stdout, (calls, proc.stdout, proc.stderr)


def test_ci_goes_on_when_apt_is_unreachable(tmp_path):
    """apt unreachable: the step says the browser check will skip and CI goes on (exit 0)."""
    proc, calls = _chromium_step(tmp_path, 'echo "E: Failed to fetch http://deb.debian.org/ Temporary failure" >&2; exit 100')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "could not be installed" in proc.stdout and "browser check will skip" in proc.stdout, proc.stdout
    if os.getuid() == 0:
        assert calls == ["update"] and "Temporary failure" in proc.stdout, (calls, proc.stdout)


def test_ci_runs_the_chromium_step_before_the_tests():
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().splitlines()
    step = next(i for i, line in enumerate(ci) if line.startswith(".ci/chromium"))
    tests = next(i for i, line in enumerate(ci) if line.startswith(".venv/bin/python -m pytest tests"))
    assert step < tests, ".ci/chromium must run before the project tests"
