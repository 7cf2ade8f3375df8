"""pytest plugin: ``--impl``, capabilities, rule ids, the vacuity guard, and the report.

Loaded by the repository's root conftest.py (so the option exists from any start directory).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections import Counter, defaultdict

import pytest

from . import SUITE_PROTOCOL, SUITE_VERSION, check, harness
from .capabilities import CAPABILITIES
from .registry import ImplError, available_names, resolve
from .spec import area, rules

NOT_APPLICABLE = "not_applicable"
ADAPTER_KEY = pytest.StashKey[object]()
RESULTS_KEY = pytest.StashKey[dict]()
CONFORMANCE_DIR = os.path.dirname(os.path.abspath(__file__))


def pytest_addoption(parser):
    group = parser.getgroup("conformance")
    group.addoption("--impl", default=None, help=f"implementation under test: {', '.join(sorted(['reference', 'fastdeploy']))}, "
                    "module:attr, path/to/file.py:attr, or an entry point in group conformance.impls")
    group.addoption("--impl-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for the adapter factory (repeatable)")
    group.addoption("--conformance-report", default=None, metavar="PATH", help="write a JSON report to PATH")
    group.addoption("--rule", action="append", default=[], metavar="ID",
                    help="run only the tests of this SPEC.md rule (repeatable)")


def _is_conformance(item) -> bool:
    """A test under conformance/, or one marked ``rule``/``requires`` wherever it lives (so that a
    missing or stray marker is caught, and the plugin's own tests can build conformance tests)."""
    if item.get_closest_marker("rule") is not None or item.get_closest_marker("requires") is not None:
        return True
    return os.path.abspath(str(item.path)).startswith(CONFORMANCE_DIR + os.sep)


_STATE: dict = {}


def pytest_configure(config):
    config.stash[RESULTS_KEY] = {}
    _STATE["config"] = config
    name = config.getoption("--impl")
    if name is None:
        return
    options = {}
    for kv in config.getoption("--impl-opt"):
        key, sep, value = kv.partition("=")
        if not sep:
            raise pytest.UsageError(f"--impl-opt {kv!r}: expected KEY=VALUE")
        options[key] = value
    try:
        adapter, where = resolve(name, options)
    except ImplError as e:
        raise pytest.UsageError(str(e)) from None
    adapter._conformance_where = where
    config.stash[ADAPTER_KEY] = adapter


def _adapter(config):
    return config.stash.get(ADAPTER_KEY, None)


def pytest_report_header(config):
    adapter = _adapter(config)
    if adapter is None:
        return None
    env = {k: v for k, v in os.environ.items() if k.startswith("CONFORMANCE_")}
    return [
        f"conformance: impl={adapter.name} {adapter.version} ({adapter._conformance_where})",
        f"conformance: suite {SUITE_VERSION}, protocol {SUITE_PROTOCOL}, {len(rules())} rules in SPEC.md",
        f"conformance: capabilities {', '.join(sorted(adapter.capabilities)) or '(none)'}",
        f"conformance: env {env or '{}'}",
    ]


def pytest_collection_modifyitems(session, config, items):
    known = rules()
    conformance_items = [i for i in items if _is_conformance(i)]
    if conformance_items and _adapter(config) is None:
        raise pytest.UsageError(
            "conformance tests need --impl NAME (known: " + ", ".join(available_names()) + "); "
            "there is no default implementation"
        )
    errors = []
    for item in conformance_items:
        marks = list(item.iter_markers("rule"))
        if len(marks) != 1 or len(marks[0].args) != 1:
            errors.append(f"{item.nodeid}: needs exactly one @pytest.mark.rule('ID')")
            continue
        rule_id = marks[0].args[0]
        if rule_id not in known:
            errors.append(f"{item.nodeid}: rule {rule_id!r} is not defined in SPEC.md")
        for mark in item.iter_markers("requires"):
            unknown = [c for c in mark.args if c not in CAPABILITIES]
            if unknown:
                errors.append(f"{item.nodeid}: unknown capabilities {unknown}")
    if errors:
        raise pytest.UsageError("conformance collection errors:\n  " + "\n  ".join(errors))
    wanted = set(config.getoption("--rule"))
    if wanted:
        unknown = sorted(wanted - set(known))
        if unknown:
            raise pytest.UsageError(f"--rule: {unknown} not defined in SPEC.md")
        keep = [i for i in items if not _is_conformance(i) or rule_of(i) in wanted]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def rule_of(item) -> str | None:
    mark = item.get_closest_marker("rule")
    return mark.args[0] if mark else None


def pytest_runtest_setup(item):
    if not _is_conformance(item):
        return
    adapter = _adapter(item.config)
    needed = {c for mark in item.iter_markers("requires") for c in mark.args}
    missing = sorted(needed - set(adapter.capabilities))
    if missing:
        pytest.skip(f"{NOT_APPLICABLE}: {adapter.name} does not claim {', '.join(missing)}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not _is_conformance(item):
        return (yield)
    check.reset()
    harness.reset()
    result = yield
    # Reached only when the test body returned normally: it must have driven the implementation
    # and asserted something through conformance.check, or it proves nothing.
    if harness.adapter_calls() == 0 or check.count() == 0:
        raise AssertionError(
            f"vacuous conformance test {item.nodeid}: adapter calls={harness.adapter_calls()}, "
            f"checks={check.count()}; a test must drive the implementation and check a result"
        )
    return result


@pytest.fixture
def impl(request):
    """The adapter under test (as resolved from --impl)."""
    adapter = _adapter(request.config)
    if adapter is None:
        pytest.fail("no --impl given")
    return adapter


@pytest.fixture
def loader(impl, tmp_path, monkeypatch):
    """Opens sessions of the implementation on fresh models; model_dir and shared_dir are empty
    private directories; worker identity defaults to rank 0 on GPU 0."""
    h = harness.Loader(impl, tmp_path, monkeypatch)
    yield h
    h.close_all()


def _status_of(report) -> str | None:
    if report.when == "setup":
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            return NOT_APPLICABLE if NOT_APPLICABLE in reason else "skipped"
        return "error" if report.failed else None
    if report.when == "call":
        if report.skipped:
            return "skipped"
        return "passed" if report.passed else "failed"
    return "error" if report.failed else None


def _message(report, status: str) -> str:
    if status in (NOT_APPLICABLE, "skipped"):
        return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if status in ("failed", "error"):
        crash = getattr(report.longrepr, "reprcrash", None)
        return crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    return ""


def pytest_runtest_logreport(report):
    config = _STATE.get("config")
    info = config.stash[RESULTS_KEY].get(report.nodeid) if config else None
    status = _status_of(report) if info else None
    # The first non-passing phase decides (a teardown error after a pass is still an error).
    if status is not None and info["status"] in (None, "passed"):
        info["status"] = status
        info["message"] = _message(report, status)


def pytest_collection_finish(session):
    results = session.config.stash[RESULTS_KEY]
    for item in session.items:
        if not _is_conformance(item):
            continue
        rule_id = rule_of(item)
        if rule_id not in rules():
            continue  # a collection error already reported as a usage error (this hook runs anyway)
        rel = os.path.relpath(str(item.path))
        results[item.nodeid] = {
            "nodeid": item.nodeid,
            "rule": rule_id,
            "area": area(rule_id),
            "title": rules().get(rule_id, ""),
            "requires": sorted({c for m in item.iter_markers("requires") for c in m.args}),
            "status": None,
            "message": "",
            "repro": repro_command(session.config, rel, item.name),
        }


def repro_command(config, rel_path: str, name: str) -> str:
    """A shell command that reruns one test with the same implementation and options, from the
    directory the suite was run in."""
    args = [f"--impl={config.getoption('--impl')}"] + [f"--impl-opt={kv}" for kv in config.getoption("--impl-opt")]
    return f"pytest {shlex.quote(f'{rel_path}::{name}')} " + " ".join(shlex.quote(a) for a in args)


def summarize(results) -> dict:
    by_rule: dict[str, list[str]] = defaultdict(list)
    for r in results.values():
        by_rule[r["rule"]].append(r["status"] or "error")
    order = ["error", "failed", "passed", NOT_APPLICABLE, "skipped"]
    rule_status = {}
    for rule_id, statuses in by_rule.items():
        # A rule passes only if all its tests pass; one failure fails it.
        rule_status[rule_id] = next(s for s in order if s in statuses)
    return rule_status


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config.stash.get(RESULTS_KEY, {})
    adapter = _adapter(config)
    if not results or adapter is None:
        return
    rule_status = summarize(results)
    per_area: dict[str, Counter] = defaultdict(Counter)
    for rule_id, status in rule_status.items():
        per_area[area(rule_id)][status] += 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Conformance of {adapter.name} {adapter.version}: rules by area")
    for col in ("area", "passed", "failed", "error", "not applicable", "skipped"):
        table.add_column(col, justify="left" if col == "area" else "right")
    total = Counter()
    for name in sorted(per_area):
        c = per_area[name]
        total.update(c)
        table.add_row(name, *(str(c[s]) for s in ("passed", "failed", "error", NOT_APPLICABLE, "skipped")))
    table.add_row("all", *(str(total[s]) for s in ("passed", "failed", "error", NOT_APPLICABLE, "skipped")))
    console = Console(file=terminalreporter._tw, force_terminal=False, width=100, color_system=None)
    terminalreporter.write_line("")
    console.print(table)
    failing = sorted(r for r, s in rule_status.items() if s in ("failed", "error"))
    if failing:
        terminalreporter.write_line("failing rules: " + ", ".join(failing))
    path = config.getoption("--conformance-report")
    if path:
        write_report(path, config, adapter, results, rule_status)
        terminalreporter.write_line(f"conformance report written to {path}")


def write_report(path, config, adapter, results, rule_status) -> None:
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    report = {
        "run_info": {
            "implementation": adapter.name,
            "implementation_version": adapter.version,
            "adapter": adapter._conformance_where,
            "capabilities": sorted(adapter.capabilities),
            "suite_version": SUITE_VERSION,
            "suite_protocol": SUITE_PROTOCOL,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "versions": {d: version(d) for d in ("paddlepaddle", "paddlepaddle-gpu", "safetensors", "pyzmq", "numpy")},
        },
        "rules": [
            {"id": rule_id, "title": rules().get(rule_id, ""), "status": status,
             "tests": [r for r in results.values() if r["rule"] == rule_id]}
            for rule_id, status in sorted(rule_status.items())
        ],
        "tests": list(results.values()),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
