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
SELF_SKIP_KEY = pytest.StashKey[str]()
# Exit status of a run that tested nothing: every selected conformance test was not applicable (or
# skipped), or no conformance test was collected although --impl was given. pytest's own status for
# "no tests collected"; a run that tested nothing must never read as a pass.
NOTHING_TESTED_EXIT = pytest.ExitCode.NO_TESTS_COLLECTED
STATUSES = ("passed", "failed", "error", NOT_APPLICABLE, "skipped")
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
        if item.get_closest_marker("xfail") is not None:
            errors.append(f"{item.nodeid}: a conformance test cannot be marked xfail (it would hide a failure)")
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
    try:
        result = yield
    except (pytest.skip.Exception, pytest.xfail.Exception) as e:
        # A test body may only step aside as not_applicable (the capability mechanism's reason);
        # any other skip or xfail from inside the body hides what it would have found: an error.
        reason = str(getattr(e, "msg", None) or e)
        if isinstance(e, pytest.skip.Exception) and NOT_APPLICABLE in reason:
            raise
        kind = "xfail" if isinstance(e, pytest.xfail.Exception) else "skip"
        item.stash[SELF_SKIP_KEY] = reason
        pytest.fail(
            f"conformance test {item.nodeid} called pytest.{kind}() from its body ({reason!r}); "
            f"a conformance test may only be skipped as {NOT_APPLICABLE} (through @pytest.mark.requires): "
            "a self-skip hides a failure",
            pytrace=False,
        )
    # Reached only when the test body returned normally: it must have driven the implementation
    # and asserted something through conformance.check, or it proves nothing.
    if harness.adapter_calls() == 0 or check.count() == 0:
        raise AssertionError(
            f"vacuous conformance test {item.nodeid}: adapter calls={harness.adapter_calls()}, "
            f"checks={check.count()}; a test must drive the implementation and check a result"
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and SELF_SKIP_KEY in item.stash:
        report.conformance_status = "error"  # read by _status_of (the report in the JSON and the table)
    return report


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
        forced = getattr(report, "conformance_status", None)
        if forced:
            return forced
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            return NOT_APPLICABLE if NOT_APPLICABLE in reason else "skipped"
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


def run_summary(config, results=None) -> dict:
    """Counts of tests and rules per status, and the reason the run tested nothing (or None)."""
    results = config.stash.get(RESULTS_KEY, {}) if results is None else results
    tests = Counter(r["status"] or "not_run" for r in results.values())
    rule_counts = Counter(summarize(results).values())
    return {
        "tests": {s: tests[s] for s in (*STATUSES, "not_run")},
        "rules": {s: rule_counts[s] for s in STATUSES},
        "nothing_tested": nothing_tested(config, results),
    }


def nothing_tested(config, results=None) -> str | None:
    """Why this run proves nothing about the implementation, or None when it tested something.

    Nothing was tested when --impl was given and either no conformance test was collected (paths,
    -k, -m or --rule selected none), or none of those selected reached a verdict (passed, failed,
    error): every one was not applicable to the claimed capabilities, or skipped."""
    adapter = _adapter(config)
    if adapter is None or config.getoption("collectonly", False):
        return None
    results = config.stash.get(RESULTS_KEY, {}) if results is None else results
    impl = config.getoption("--impl")
    if not results:
        return (f"no conformance test was collected for {adapter.name} (--impl={impl}): the paths, -k/-m "
                "expressions or --rule selection matched none; nothing was tested")
    counts = Counter(r["status"] for r in results.values())
    if any(counts[s] for s in ("passed", "failed", "error")):
        return None
    caps = ", ".join(sorted(adapter.capabilities))
    detail = f"{counts[NOT_APPLICABLE]} not applicable"
    if counts["skipped"]:
        detail += f", {counts['skipped']} skipped"
    if counts[None]:
        detail += f", {counts[None]} not run"
    rule_ids = {r["rule"] for r in results.values()}
    return (f"no conformance rule was applicable to {adapter.name}: it claims capabilities [{caps}]; "
            f"of {len(results)} selected test(s) of {len(rule_ids)} rule(s), {detail}; nothing was tested")


def pytest_sessionfinish(session, exitstatus):
    if nothing_tested(session.config) and session.exitstatus in (pytest.ExitCode.OK, 0):
        session.exitstatus = NOTHING_TESTED_EXIT


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config.stash.get(RESULTS_KEY, {})
    adapter = _adapter(config)
    if adapter is None:
        return
    if exitstatus == pytest.ExitCode.USAGE_ERROR:
        return  # the collection errors say it all; no test ran
    rule_status = summarize(results)
    if results:
        _print_table(terminalreporter, adapter, rule_status)
    failing = sorted(r for r, s in rule_status.items() if s in ("failed", "error"))
    if failing:
        terminalreporter.write_line("failing rules: " + ", ".join(failing))
    empty = nothing_tested(config, results)
    if empty:
        terminalreporter.write_line("")
        exit_note = f" (exit status {int(NOTHING_TESTED_EXIT)})" if exitstatus in (pytest.ExitCode.OK, NOTHING_TESTED_EXIT) else ""
        terminalreporter.write_line(f"NOTHING TESTED: {empty}{exit_note}", red=True, bold=True)
    path = config.getoption("--conformance-report")
    if path:
        write_report(path, config, adapter, results, rule_status)
        terminalreporter.write_line(f"conformance report written to {path}")


def _print_table(terminalreporter, adapter, rule_status) -> None:
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
        table.add_row(name, *(str(c[s]) for s in STATUSES))
    table.add_row("all", *(str(total[s]) for s in STATUSES))
    console = Console(file=terminalreporter._tw, force_terminal=False, width=100, color_system=None)
    terminalreporter.write_line("")
    console.print(table)


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
        "summary": run_summary(config, results),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
