"""The installed suite (docs/adapters.md, "Running from your own repository").

The wheel is built from the checkout's files (a copy: the checkout is not written), installed into a fresh venv
whose dependencies are the test environment's (its site-packages, less this project's own install, on the path
after the venv's own), and run from temporary directories outside the checkout:

* the documented command on the worked example adapter gives the checkout's exit status and per-rule report
  (every rule's verdict, every test's id and verdict; tests/conftest.py ``example_report`` is the checkout's run);
* ``python -m conformance.history`` finds a verdict change between two versions of a FastDeploy stand-in;
* ``python -m sim roundtrip`` round-trips every tensor;
* a project with its own ``reference``, ``fixtures`` and ``wire`` packages (its conftest imports them, its
  configuration is --strict-markers and sets no timeout) runs the suite and its own test in one process, through
  the console script ``weightsync-conformance``, with ``-p conformance.plugin`` given once more.

The wheel itself holds every file of the shipped trees, SPEC.md as the checkout has it, and nothing at top level
but ``conformance``, ``sim`` and ``weightsync``. The whole pipeline is one background job (tests/early.py);
``-m "not install"`` deselects it.
"""
from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile

import pytest

from tests import early
from tests.conftest import REPO
from tests.test_history import LEXICAL_SORT, NUMERIC_SORT, RULE, replaced, standin

SHIPPED = {"conformance": "conformance", "sim": "sim", "weightsync": "weightsync", "reference": "weightsync/reference",
           "fixtures": "weightsync/fixtures", "wire": "weightsync/wire"}  # checkout folder -> its place in the wheel
INTERNAL = ("reference", "fixtures", "wire")
TOP_LEVEL = {"conformance", "sim", "weightsync"}
EXAMPLE_FILE = os.path.join(REPO, "docs", "example_adapter.py")
INSTALLED_IMPL = "--impl=./example_adapter.py:MineAdapter"
DEFAULT_TIMEOUT_S = 120
# Names of the test environment's site-packages that are this project's own install, never the venv's dependencies.
OWN = ("weightsync", "__editable__", "conformance", "sim", "reference", "fixtures", "wire")


def checkout_files() -> list[str]:
    """The checkout's files as a build sees them: tracked or new, not ignored (git), present in the work tree."""
    try:
        out = subprocess.run(["git", "-C", REPO, "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                             capture_output=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        out = ""
    if out:
        return sorted(f for f in out.split("\0") if f and os.path.isfile(os.path.join(REPO, f)))
    skip = {".git", ".venv", "mutants", "build", "__pycache__", ".pytest_cache"}
    found = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        found += [os.path.relpath(os.path.join(dirpath, f), REPO) for f in filenames if not f.endswith(".pyc")]
    return sorted(found)


def shipped_files() -> dict[str, str]:
    """Every file of the shipped trees in the checkout -> its path in the wheel."""
    out = {}
    for name in checkout_files():
        top, _, rest = name.partition("/")
        if top in SHIPPED and rest and "__pycache__" not in name.split("/"):
            out[name] = f"{SHIPPED[top]}/{rest}"
    return out


def _venv_env() -> dict:
    """The jobs' environment, less what would point the venv's interpreter at the checkout or another install."""
    env = early.environment()
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def _in(cwd, cmd, timeout=300) -> dict:
    """Run ``cmd`` in ``cwd`` as a job's process (tests/early.py), with ``_venv_env()``: its exit status and its
    stdout and stderr (``code`` None when it ran past ``timeout`` and was killed)."""
    started = time.monotonic()
    try:
        proc = early.run([str(c) for c in cmd], str(cwd), timeout, env=_venv_env())
    except subprocess.TimeoutExpired as e:
        return {"code": None, "output": f"{' '.join(map(str, cmd))}: timed out after {timeout} s\n{e.stdout}{e.stderr}",
                "seconds": time.monotonic() - started}
    return {"code": proc.returncode, "output": proc.stdout + proc.stderr, "seconds": time.monotonic() - started}


def _load(path) -> dict | None:
    return json.loads(open(path).read()) if os.path.exists(path) else None


OWN_PROJECT = {
    "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "--strict-markers -p no:cacheprovider"\n',
    "fixtures/__init__.py": 'OWNER = "project"\n',
    "reference/__init__.py": 'OWNER = "project"\n',
    "wire/__init__.py": 'OWNER = "project"\n',
    "conftest.py": '''import json
import os

import fixtures
import reference
import wire

import pytest

assert fixtures.OWNER == reference.OWNER == wire.OWNER == "project"


@pytest.fixture
def own_packages():
    return fixtures, reference, wire


def pytest_collection_finish(session):
    """What the suite's plugin gave each collected test: its timeout marker's seconds."""
    timeouts = {}
    for item in session.items:
        mark = item.get_closest_marker("timeout")
        timeouts[item.nodeid] = mark.args[0] if mark is not None and mark.args else None
    with open(os.path.join(os.path.dirname(__file__), "timeouts.json"), "w") as f:
        json.dump(timeouts, f)
''',
    "test_own.py": '''import sys


def test_the_project_keeps_its_own_packages(own_packages):
    import conformance

    for module in own_packages:
        assert module.OWNER == "project" and sys.modules[module.__name__] is module, module
    assert "site-packages" in conformance.__file__, conformance.__file__
    for name in ("reference", "fixtures", "wire"):
        assert sys.modules["weightsync." + name] is not sys.modules[name], name
        assert "site-packages" in sys.modules["weightsync." + name].__file__, name
''',
}
PROBE = '''import importlib, json, sys
out = {}
for name in ("conformance", "sim", "weightsync", "weightsync.reference", "weightsync.fixtures", "weightsync.wire"):
    out[name] = importlib.import_module(name).__file__
for name in ("reference", "fixtures", "wire"):
    try:
        importlib.import_module(name)
        out[name] = "importable"
    except ModuleNotFoundError:
        out[name] = None
print(json.dumps(out))
'''


@early.job("installed")
def _installed(tmp_path_factory):
    """Build, install and run the installed suite; every step's result (a step that failed stops the rest)."""
    root = tmp_path_factory.mktemp("install")
    src, dist, venv, work = root / "src", root / "dist", root / "venv", root / "work"
    result = {"root": str(root)}
    for name in checkout_files():
        os.makedirs(os.path.dirname(src / name), exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), src / name)
    result["build"] = _in(root, [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                                 "--no-index", "-w", str(dist), str(src)])
    wheels = sorted(dist.glob("*.whl")) if dist.exists() else []
    if result["build"]["code"] != 0 or len(wheels) != 1:
        return result
    result["wheel"] = str(wheels[0])
    result["venv"] = _in(root, [sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, env=_venv_env()).stdout.strip()
    if result["venv"]["code"] != 0 or not site:
        return result
    # The dependencies: the test environment's packages, less this project's own install, after the venv's own.
    deps = root / "deps"
    deps.mkdir()
    for folder in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for entry in sorted(os.listdir(folder)):
            if entry.startswith(OWN) or entry.endswith(".pth") or os.path.lexists(deps / entry):
                continue
            os.symlink(os.path.join(folder, entry), deps / entry)
    with open(os.path.join(site, "zz_test_environment.pth"), "w") as f:
        f.write(str(deps) + "\n")
    result["install"] = _in(root, [sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                                   "--no-deps", "--no-index", result["wheel"]])
    if result["install"]["code"] != 0:
        return result
    work.mkdir()
    shutil.copy2(EXAMPLE_FILE, work / "example_adapter.py")
    result["probe"] = _in(work, [str(python), "-c", PROBE])
    # The documented command on the worked example; beside it, one after the other, the rest.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="install") as pool:
        example = pool.submit(_example, python, work)
        result.update(_tools(python, venv, work, root / "project"))
        result["example"] = example.result()
    # One test's repro command from the report, as a user would paste it.
    passed = [t for t in (result["example"]["report"] or {}).get("tests", []) if t["status"] == "passed"]
    if passed:
        result["repro"] = _in(work, shlex.split(passed[0]["repro"]))
        result["repro"]["command"] = passed[0]["repro"]
    return result


def _example(python, work) -> dict:
    run = _in(work, [python, "-m", "pytest", "--pyargs", "conformance", INSTALLED_IMPL, "-q", "--tb=native",
                     "--conformance-report=report.json"])
    run["report"] = _load(work / "report.json")
    return run


def _tools(python, venv, work, project) -> dict:
    """The history tool, the simulator, and the suite in a project with packages named as its internal ones."""
    out = {}
    # The history tool on two versions of a file: numeric part order (passes), then lexical (fails).
    copies = work / "copies"
    copies.mkdir()
    (copies / "01-numeric.py").write_text(standin("parts"))
    (copies / "02-lexical.py").write_text(replaced(standin("parts"), NUMERIC_SORT, LEXICAL_SORT))
    out["history"] = _in(work, [python, "-m", "conformance.history", "--versions", "copies", "-o", "history",
                                "--rule", RULE, "-k", "2-before-10 and trace", "--jobs", "2"])
    out["history"]["data"] = _load(work / "history" / "history.json")
    out["sim"] = _in(work, [python, "-m", "sim", "roundtrip", "--ranks", "2", "--model-mib", "1",
                            "--bucket-mib", "0.25", "--versions", "2", "--no-progress"])
    for name, text in OWN_PROJECT.items():
        os.makedirs(os.path.dirname(project / name), exist_ok=True)
        (project / name).write_text(text)
    shutil.copy2(EXAMPLE_FILE, project / "example_adapter.py")
    # The console script, -p naming the plugin its entry point loaded, the project's own test in the same run.
    out["project"] = _in(project, [venv / "bin" / "weightsync-conformance", INSTALLED_IMPL, "-p", "conformance.plugin",
                                   "--rule", "SNAP-GPU-ID", "--rule", "PART-ORDER-NUMERIC", "test_own.py", "-q",
                                   "--conformance-report=report.json"])
    out["project"]["report"] = _load(project / "report.json")
    out["project"]["timeouts"] = _load(project / "timeouts.json")
    return out


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    return early.result("installed", tmp_path_factory)


def _step(installed, name) -> dict:
    for step in ("build", "venv", "install", name):
        got = installed.get(step)
        assert got is not None, f"step {step!r} did not run; the steps before it: " + json.dumps(
            {k: (v.get("code"), v.get("output", "")[-2000:]) for k, v in installed.items() if isinstance(v, dict)})
        if step != name:
            assert got["code"] == 0, f"{step} failed (exit {got['code']}):\n{got['output'][-3000:]}"
    return installed[name]


# -- the wheel ------------------------------------------------------------------------------------------------------
@pytest.mark.install
@pytest.mark.timeout(600)
def test_the_wheel_holds_every_file_of_the_suite_and_nothing_else_at_top_level(installed):
    _step(installed, "install")
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
        spec = wheel.read("conformance/SPEC.md")
        entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    missing = sorted(f"{src} (as {dst})" for src, dst in shipped_files().items() if dst not in names)
    assert not missing, "the wheel lacks files of the checkout's shipped trees:\n  " + "\n  ".join(missing)
    with open(os.path.join(REPO, "SPEC.md"), "rb") as f:
        assert spec == f.read(), "the wheel's conformance/SPEC.md is not the checkout's SPEC.md"
    assert "conformance/report.schema.json" in names
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == TOP_LEVEL, f"the wheel installs {sorted(top)} at top level; only {sorted(TOP_LEVEL)} may be"
    assert "[pytest11]\nconformance.plugin = conformance.plugin" in entry_points, entry_points
    assert "weightsync-conformance = conformance.__main__:main" in entry_points, entry_points


@pytest.mark.install
@pytest.mark.timeout(600)
def test_the_installed_packages_are_the_venvs_and_the_generic_names_are_not_installed(installed):
    probe = _step(installed, "probe")
    assert probe["code"] == 0, probe["output"][-3000:]
    found = json.loads(probe["output"].strip().splitlines()[-1])
    venv = os.path.join(installed["root"], "venv") + os.sep
    for name in ("conformance", "sim", "weightsync", "weightsync.reference", "weightsync.fixtures", "weightsync.wire"):
        assert found[name].startswith(venv), f"{name} came from {found[name]}, not from the venv {venv}"
    assert {name: found[name] for name in INTERNAL} == dict.fromkeys(INTERNAL), found


# -- the documented command, the history tool, the simulator ---------------------------------------------------------
def _verdicts(report: dict) -> dict:
    """A report's per-rule verdicts: each rule's status and level, and its tests' ids and statuses."""
    return {r["id"]: (r["status"], r["level"], sorted((t["nodeid"], t["status"], t["actual"]) for t in r["tests"]))
            for r in report["rules"]}


@pytest.mark.install
@pytest.mark.timeout(600)
def test_the_documented_command_gives_the_checkouts_verdicts(installed, example_report):
    run = _step(installed, "example")
    code, report, output = example_report
    assert report is not None, f"the checkout's run wrote no report (exit {code}):\n{output[-3000:]}"
    assert run["report"] is not None, f"the installed run wrote no report (exit {run['code']}):\n{run['output'][-3000:]}"
    assert run["code"] == code == 0, f"exit {run['code']} installed, {code} in the checkout:\n{run['output'][-3000:]}"
    installed_verdicts, checkout_verdicts = _verdicts(run["report"]), _verdicts(report)
    differ = sorted(r for r in installed_verdicts.keys() | checkout_verdicts.keys()
                    if installed_verdicts.get(r) != checkout_verdicts.get(r))
    assert not differ, "\n".join(f"{r}: installed {installed_verdicts.get(r)}\n    checkout {checkout_verdicts.get(r)}"
                                 for r in differ[:5])
    assert run["report"]["summary"] == report["summary"], (run["report"]["summary"], report["summary"])
    assert sum(s == "passed" for s, _, _ in installed_verdicts.values()) >= 30, "too few rules passed to compare"
    # Each test's repro names the installed module, with the venv's interpreter.
    venv_python = os.path.join(installed["root"], "venv", "bin", "python")
    for test in run["report"]["tests"]:
        module, _, name = test["nodeid"].partition("::")
        want = f"{venv_python} -m pytest --pyargs {shlex.quote(module.removesuffix('.py').replace('/', '.') + '::' + name)} "
        assert test["repro"].startswith(want), (test["repro"], want)
    repro = installed["repro"]
    assert repro["code"] == 0 and re.search(r"\b1 passed\b", repro["output"]), (repro["command"], repro["output"][-3000:])
    for warning in ("PytestUnknownMarkWarning", "Unknown pytest.mark", "INTERNALERROR", "PytestAssertRewriteWarning"):
        assert warning not in run["output"], run["output"][-3000:]


@pytest.mark.install
@pytest.mark.timeout(600)
def test_the_history_tool_runs_from_the_install(installed):
    run = _step(installed, "history")
    assert run["code"] == 0 and run["data"] is not None, f"exit {run['code']}:\n{run['output'][-3000:]}"
    data = run["data"]
    assert [v["id"] for v in data["versions"]] == ["01-numeric.py", "02-lexical.py"], data["versions"]
    assert [r["id"] for r in data["rules"]] == [RULE]
    assert data["rules"][0]["verdicts"] == ["passed", "failed"], data["rules"]
    assert "--pyargs" in data["suite"]["command"], data["suite"]


@pytest.mark.install
@pytest.mark.timeout(600)
def test_the_simulator_runs_from_the_install(installed):
    run = _step(installed, "sim")
    assert run["code"] == 0, f"exit {run['code']}:\n{run['output'][-3000:]}"
    assert "MISMATCH" not in run["output"] and "throughput:" in run["output"], run["output"][-3000:]


@pytest.mark.install
@pytest.mark.timeout(600)
def test_a_project_with_its_own_reference_fixtures_and_wire_runs_the_suite(installed):
    run = _step(installed, "project")
    assert run["code"] == 0 and run["report"] is not None, f"exit {run['code']}:\n{run['output'][-3000:]}"
    statuses = {r["id"]: r["status"] for r in run["report"]["rules"]}
    assert statuses == {"SNAP-GPU-ID": "passed", "PART-ORDER-NUMERIC": "passed"}, statuses
    assert "test_the_project_keeps_its_own_packages" not in run["output"], run["output"][-3000:]  # passed quietly
    assert "PytestAssertRewriteWarning" not in run["output"], run["output"][-3000:]
    timeouts = run["timeouts"]
    own = {k: v for k, v in timeouts.items() if k.startswith("test_own.py")}
    suite = {k: v for k, v in timeouts.items() if not k.startswith("test_own.py")}
    assert list(own.values()) == [None], f"the plugin gave the project's own test a timeout: {own}"
    assert suite and set(suite.values()) <= {DEFAULT_TIMEOUT_S, 900}, suite  # 900: the tiers' own markers
    assert DEFAULT_TIMEOUT_S in suite.values(), suite


# -- without building anything ---------------------------------------------------------------------------------------
def test_shipped_code_imports_the_internal_packages_by_their_installed_names():
    """Installed, ``reference``, ``fixtures`` and ``wire`` exist only as ``weightsync.*``: a shipped module that
    imports or names one of them by its own name would fail there (or load a project's package of that name)."""
    found = []
    for src, dst in shipped_files().items():
        if not src.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(REPO, src), encoding="utf-8").read(), src)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
                module = node.value.partition(":")[0]  # an entry-point style "module:attr" string
                if module.replace(".", "").replace("_", "").isalnum() and "." in module:
                    names = [module]
            found += [f"{src}:{node.lineno}: {n}" for n in names if n.split(".")[0] in INTERNAL]
    assert not found, ("shipped code names internal packages by their own names (run /work/wt/rename.sh or "
                       "write weightsync.NAME):\n  " + "\n  ".join(found))


def test_repro_names_a_test_of_the_installed_suite_by_module():
    from conformance.plugin import repro_command

    class Config:
        options = {"--impl": "./mine.py:Mine", "--impl-opt": ["k=v w"]}
        rootpath = "/somewhere"
        invocation_params = type("Params", (), {"dir": "/elsewhere"})

        def getoption(self, name):
            return self.options[name]

    command = repro_command(Config(), "conformance/test_apply.py::test_x[single-1]", installed=True)
    assert command == (f"{sys.executable} -m pytest --pyargs 'conformance.test_apply::test_x[single-1]' "
                       "--impl=./mine.py:Mine '--impl-opt=k=v w'"), command
