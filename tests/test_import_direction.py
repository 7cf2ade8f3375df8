"""The dependency between the product and the simulator runs one way.

``reference`` (the receiver) never imports ``sim`` (trainers, device stand-in); ``wire`` (what both
ends agree on) imports neither. Checked twice: statically, every import statement and every
module-path string of the source (function-level imports and ``importlib`` targets included), and at
run time, by importing every module of the package in a fresh interpreter and listing what got loaded.
"""
from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO as _REPO

REPO = pathlib.Path(_REPO)

# package -> top-level packages it must never import
FORBIDDEN = {"reference": ("sim",), "wire": ("reference", "sim")}
# "sim", "sim.trainer", "sim.cli:main": a module path a dynamic import could be given (the internal packages
# also under their installed names: "weightsync.reference.manager", weightsync/__init__.py)
_MODULE_STRING = r"^(weightsync\.)?{top}(\.[A-Za-z_][\w.]*)?(:[A-Za-z_]\w*)?$"


def top_level(name: str) -> str:
    """The package a module name is of: ``reference`` for ``reference.manager`` and for its installed name
    ``weightsync.reference.manager`` alike."""
    parts = name.split(".")
    return parts[1] if parts[0] == "weightsync" and len(parts) > 1 else parts[0]


def forbidden_imports(source: str, filename: str, banned: tuple[str, ...]) -> list[str]:
    """Every ``import``/``from`` of a banned top-level package, and every string naming one of its
    modules, as ``file:line: text``. Relative imports stay inside the package and are allowed."""
    found = []
    patterns = [re.compile(_MODULE_STRING.format(top=re.escape(top))) for top in banned]
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "weightsync":
            names = [f"weightsync.{alias.name}" for alias in node.names]  # from weightsync import reference
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if any(p.match(node.value) for p in patterns):
                found.append(f"{filename}:{node.lineno}: module path string {node.value!r}")
            continue
        for name in names:
            if top_level(name) in banned:
                found.append(f"{filename}:{node.lineno}: imports {name}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def _sources(package: str) -> list[pathlib.Path]:
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no Python files under {REPO / package}"
    return files


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_source_never_imports_the_other_side(package):
    banned = FORBIDDEN[package]
    found = []
    for path in _sources(package):
        found += forbidden_imports(path.read_text(), str(path.relative_to(REPO)), banned)
    assert not found, f"{package} must not import {' or '.join(banned)}:\n" + "\n".join(found)


def test_the_static_check_finds_every_form():
    """The checker itself: each way of reaching ``sim`` is reported, a relative or unrelated import is not."""
    source = (
        "import os\n"
        "from . import apply\n"
        "from .simulate import x\n"
        "import simple\n"
        "import sim.trainer as t\n"
        "def f():\n"
        "    from sim import protocol\n"
        "    return importlib.import_module('sim.cli')\n"
        "STRATEGIES = {'x': 'sim.trainer:trainer_main', 'doc': 'sim is the simulator'}\n"
        "from weightsync.sim import trainer\n"
        "from weightsync import sim\n"
        "import weightsync.sim.cli as c\n"
        "X = 'weightsync.sim.cli:main'\n"
        "from weightsync.simple import s\n"
    )
    found = forbidden_imports(source, "probe.py", ("sim",))
    assert found == [
        "probe.py:5: imports sim.trainer",
        "probe.py:7: imports sim",
        "probe.py:8: module path string 'sim.cli'",
        "probe.py:9: module path string 'sim.trainer:trainer_main'",
        "probe.py:10: imports weightsync.sim",
        "probe.py:11: imports weightsync.sim",
        "probe.py:12: imports weightsync.sim.cli",
        "probe.py:13: module path string 'weightsync.sim.cli:main'",
    ], found


_PROBE = """
import importlib, json, pkgutil, sys
package = sys.argv[1]
root = importlib.import_module(package)
for info in pkgutil.walk_packages(root.__path__, package + "."):
    importlib.import_module(info.name)
def top(name):
    parts = name.split(".")
    return parts[1] if parts[0] == "weightsync" and len(parts) > 1 else parts[0]
loaded = sorted(m for m in sys.modules if top(m) in ("reference", "sim", "wire"))
print(json.dumps(loaded))
"""


def test_importing_every_module_loads_nothing_of_the_other_side():
    loaded = {}
    for package in sorted(FORBIDDEN):
        proc = subprocess.run([sys.executable, "-c", _PROBE, package], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"importing every module of {package} failed:\n{proc.stderr[-3000:]}"
        loaded[package] = json.loads(proc.stdout.strip().splitlines()[-1])
    for package, modules in loaded.items():
        assert any(m.startswith(package + ".") for m in modules), f"{package}: no submodule was imported: {modules}"
        wrong = [m for m in modules if top_level(m) in FORBIDDEN[package]]
        assert not wrong, f"importing every module of {package} loaded {wrong}"
