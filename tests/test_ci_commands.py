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


def test_readme_commands_run_with_the_venvs_interpreter():
    """A new user has the venv of the first code block, not an activated one: every ``python -m`` command in the
    README's code blocks is ``.venv/bin/python -m`` (a bare ``python`` fails with ModuleNotFoundError: zmq)."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    bare = [line for block in blocks for line in block.splitlines() if re.search(r"(^|[\s;&|])python3? -m (?!venv)", line)]
    assert blocks and not bare, f"README commands without the venv's interpreter: {bare}"
