"""pytest plugin: ``--impl``, capabilities, rule ids and levels, the vacuity guard, expectations and
the report.

Loaded as the ``pytest11`` entry point ``conformance.plugin`` of the installed suite (pyproject.toml), so that
``python -m pytest --pyargs conformance --impl=...`` works from any directory under any project's configuration:
the plugin registers its own markers (``MARKERS``) and gives each conformance test pytest-timeout's default of
``DEFAULT_TIMEOUT_S`` where the run configures no timeout. The checkout's root conftest.py names it too (a
checkout that is not installed); under the same name, it is registered once.

Every conformance test carries its rule, level, area and required capabilities in
``item.user_properties``; they travel on each test report, so the results (and the JSON report, the
table and the exit status) are built from reports alone: a ``pytest-xdist`` controller, which
collects nothing itself, builds the same results as a serial run, and ``--junitxml`` carries the
rule and level of every test case.
"""
from __future__ import annotations

import difflib
import os
import platform
import shlex
import sys
import threading
from collections import Counter, defaultdict

import pytest

from . import SUITE_PROTOCOL, SUITE_VERSION, check, harness
from . import modes as mode_space
from . import expectations as expect
from . import report as rep
from .capabilities import CAPABILITIES
from .registry import ImplError, available_names, resolve
from .spec import area, devices, levels, rules

NOT_APPLICABLE = rep.NOT_APPLICABLE
ADAPTER_KEY = pytest.StashKey[object]()
RESULTS_KEY = pytest.StashKey[dict]()
EXPECT_KEY = pytest.StashKey[list]()
SELF_SKIP_KEY = pytest.StashKey[str]()
LISTING_KEY = pytest.StashKey[list]()
# Exit status of a run that tested nothing: every selected conformance test was not applicable (or
# skipped), or no conformance test was collected although --impl was given. pytest's own status for
# "no tests collected"; a run that tested nothing must never read as a pass.
NOTHING_TESTED_EXIT = pytest.ExitCode.NO_TESTS_COLLECTED
STATUSES = rep.STATUSES
CONFORMANCE_DIR = os.path.dirname(os.path.abspath(__file__))
PROPERTY_KEYS = ("rule", "level", "area", "requires", "device", "race", "modes", "test_id")
# Installed (the wheel), SPEC.md is a file of this package (setup.py copies it there); in a checkout it is not.
INSTALLED = os.path.isfile(os.path.join(CONFORMANCE_DIR, "SPEC.md"))
# The suite's markers, registered here rather than in a project's configuration (--strict-markers holds).
MARKERS = (
    "rule(rule_id): the SPEC.md rule this conformance test proves",
    "requires(*capabilities): adapter capabilities the rule needs; absent ones make it not_applicable",
    "modes(**axis_values): the modes this case exercises (conformance/modes.py; a rule's Modes: line in SPEC.md declares its axes)",
    "race(why): the verdict depends on a race with the implementation (--update-expectations writes it as flaky)",
    "snapshot: ipc_snapshot path",
    "ipc: ipc metadata-file path",
    "buckets: async IPC bucket path",
    "streams: streamed paths (rsync, GDR) through the CheckpointTransfer stand-in",
    "multirank: multi-rank jobs under paddle.distributed.launch (tier: runs with -m multirank)",
    "cycles: many clear/update cycles with resources compared (tier: runs with -m cycles)",
    "restart: a worker SIGKILLed at every phase on every path, then restarted (tier: runs with -m restart)",
    "pairs: the cases of a rule declared 'quick: each' that its quick run leaves out, which cover the rest of its mode "
    "pairs (tier: runs with -m pairs; conformance/modes.py)",
    "hosts: a multirank test that only two hosts can prove (runs with -m multirank --hosts 2)",
    "huge: a tensor over 2 GiB from a sparse file, about 7 GiB of memory and a minute; headers of 10^5 tensors (tier: runs with -m huge)",
)
# pytest-timeout's limit for a conformance test whose run sets none (no --timeout, no PYTEST_TIMEOUT, no ini
# timeout) and that has no timeout marker of its own: a backstop behind the suite's own bounded waits.
DEFAULT_TIMEOUT_S = 120


def pytest_addoption(parser):
    group = parser.getgroup("conformance")
    group.addoption("--impl", default=None, help=f"implementation under test: {', '.join(sorted(['reference', 'fastdeploy']))}, "
                    "module:attr, path/to/file.py:attr, or an entry point in group conformance.impls")
    group.addoption("--impl-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for the adapter factory (repeatable)")
    group.addoption("--conformance-report", default=None, metavar="PATH", help="write a JSON report to PATH "
                    "(schema: conformance/report.schema.json)")
    group.addoption("--project-tests-count", action="store_true", default=False,
                    help="a run that selects no conformance test but runs plain project tests is not 'nothing "
                    "tested' (mutmut runs only the tests that reach a mutant; some are the project's own)")
    group.addoption("--rule", action="append", default=[], metavar="ID",
                    help="run only the tests of this SPEC.md rule, or of every rule under an id prefix such as "
                    "an area (--rule BKT, --rule SNAP-GPU); repeatable")
    group.addoption("--fail-on", default="all", choices=("contract", "all"),
                    help="which failing rules fail the run: 'contract' (behaviour FastDeploy implements or that no "
                    "correct loader can do without) or 'all' (also 'hardening' rules); default all")
    group.addoption("--expectations", default=None, metavar="PATH",
                    help="TOML file of known failures (see conformance/expectations.py); an expected failure that "
                    "passes, or an entry that matches no test, fails the run")
    group.addoption("--update-expectations", default=None, metavar="PATH",
                    help="write a candidate expectations file for this run's failures to PATH")
    group.addoption("--hosts", type=int, default=1, choices=(1, 2),
                    help="the multi-rank job (tier multirank) on this many hosts: 2 runs it as 2 hosts x 2 ranks, "
                    "two network namespaces joined by a veth pair (needs root), one paddle.distributed.launch "
                    "--nnodes 2 on each, so that local rank != global rank on the second host; default 1")
    group.addoption("--list-rules", action="store_true", default=False,
                    help="list the rules (id, level, area, capabilities, title) of the collected tests and exit")


def test_id(item) -> str:
    """A conformance test's id in the report, the summary and an expectations file: its file's path from the
    folder the ``conformance`` package is in, then pytest's test name (``conformance/test_apply.py::test_x[a]``).
    It is pytest's node id in a checkout run from its root, and the same id installed, where pytest names the
    package's files from another rootdir (``test_apply.py::...``), so that one expectations file gates both. A
    test outside the package (a project's own, marked ``rule``) keeps pytest's node id."""
    path = os.path.abspath(str(item.path))
    if not path.startswith(CONFORMANCE_DIR + os.sep):
        return item.nodeid
    name = item.nodeid.partition("::")[2]
    return os.path.relpath(path, os.path.dirname(CONFORMANCE_DIR)).replace(os.sep, "/") + ("::" + name if name else "")


def _is_conformance(item) -> bool:
    """A test under conformance/, or one marked ``rule`` wherever it lives, or, in a run with ``--impl``, one
    marked ``requires`` (so that a missing or stray marker is caught, and the plugin's own tests can build
    conformance tests). The plugin loads in every pytest run of an environment the suite is installed in: a
    project test marked ``requires`` of its own, in a run that is not a conformance run, is left alone."""
    if item.get_closest_marker("rule") is not None:
        return True
    if item.get_closest_marker("requires") is not None and _adapter(item.config) is not None:
        return True
    return os.path.abspath(str(item.path)).startswith(CONFORMANCE_DIR + os.sep)


_STATE: dict = {}


_AST_LOCK = threading.RLock()


def _serialize_ast_parse() -> None:
    """CPython 3.11 keeps the AST constructor's recursion depth in state its threads share (gh-106905): two threads
    building ASTs at once (pytest formatting a failure while another thread prints its traceback, whose carets 3.11
    places with ``ast.parse``) raise ``SystemError: AST constructor recursion depth mismatch`` inside pytest, an
    INTERNALERROR that ends the run without its report. A case's threads run the implementation under test, so any
    of them may die printing a traceback: ``ast.parse`` runs one call at a time in a conformance run."""
    import ast

    parse = ast.parse
    if getattr(parse, "_conformance_serialized", False):
        return

    def serialized(*args, **kwargs):
        with _AST_LOCK:
            return parse(*args, **kwargs)

    def reset_in_child():  # a fork while another thread parsed: the child's lock starts free
        global _AST_LOCK
        _AST_LOCK = threading.RLock()

    serialized._conformance_serialized = True
    ast.parse = serialized
    os.register_at_fork(after_in_child=reset_in_child)


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")  # a pytest-xdist worker: the controller reports


def pytest_configure(config):
    _serialize_ast_parse()
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    config.stash[RESULTS_KEY] = {}
    config.stash[EXPECT_KEY] = []
    _STATE["config"] = config
    _STATE["other_failures"] = 0
    _STATE["plain_tests_run"] = 0
    path = config.getoption("--expectations")
    if path:
        try:
            config.stash[EXPECT_KEY] = expect.load(path, rules())
        except expect.ExpectationsError as e:
            raise pytest.UsageError(str(e)) from None
    name = config.getoption("--impl")
    if name is None:
        return
    if "hypothesis" not in sys.modules:
        # No conformance test uses hypothesis; its plugin's summary would import it at the end of the run
        # (about 1 s where bytecode is not cached).
        config.pluginmanager.set_blocked("hypothesispytest")
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
    serves_on = getattr(adapter, "serves_on", None)
    if serves_on not in (None, "cpu", "gpu"):
        raise pytest.UsageError(f"--impl {name!r}: serves_on must be 'cpu' or 'gpu', got {serves_on!r}")
    adapter._conformance_where = where
    config.stash[ADAPTER_KEY] = adapter


def _adapter(config):
    return config.stash.get(ADAPTER_KEY, None)


# The suite's environment variables, named in the header so that a run's output says how to repeat it.
ENV_MEANING = ("CONFORMANCE_LOOP_SEED replays one seed of the status loop's schedules, CONFORMANCE_FASTDEPLOY_SOURCE "
               "is the file --impl=fastdeploy loads")


def pytest_report_header(config):
    adapter = _adapter(config)
    if adapter is None:
        return None
    env = {k: v for k, v in os.environ.items() if k.startswith("CONFORMANCE_")}
    lines = [
        f"conformance: impl={adapter.name} {adapter.version} ({adapter._conformance_where})",
        f"conformance: suite {SUITE_VERSION}, protocol {SUITE_PROTOCOL}, {len(rules())} rules in SPEC.md",
        f"conformance: capabilities {', '.join(sorted(adapter.capabilities)) or '(none)'}",
        f"conformance: fail on {config.getoption('--fail-on')}; expectations {config.getoption('--expectations') or 'none'}",
        f"conformance: env: {ENV_MEANING}; set in this run: {env}" if env else f"conformance: env: none set ({ENV_MEANING})",
    ]
    notes = getattr(adapter, "notes", None)
    if notes:
        lines += [f"conformance: note: {note}" for note in notes]
    return lines


def select_rules(wanted, known) -> set[str]:
    """Rule ids named by ``--rule`` values: an exact id (that rule alone), or else an id prefix ending
    at a dash (``BKT``, ``SNAP-GPU``). A value that names none is a usage error suggesting the closest ids or areas."""
    chosen: set[str] = set()
    for value in wanted:
        # An exact id is that rule alone (SNAP-GPU-ID is not also SNAP-GPU-ID-INVALID).
        hits = {value} if value in known else {r for r in known if r.startswith(value + "-")}
        if not hits:
            candidates = sorted(set(known) | {area(r) for r in known})
            close = difflib.get_close_matches(value.upper(), candidates, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else "; see --list-rules"
            raise pytest.UsageError(f"--rule {value!r} matches no rule in SPEC.md{hint}")
        chosen |= hits
    return chosen


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    known = rules()
    conformance_items = [i for i in items if _is_conformance(i)]
    if conformance_items and _adapter(config) is None and not config.getoption("--list-rules"):
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
            unknown = [c for c in mark.args if not set(c.split("|")) <= set(CAPABILITIES)]
            if unknown:
                errors.append(f"{item.nodeid}: unknown capabilities {unknown}")
        if item.get_closest_marker("xfail") is not None:
            errors.append(f"{item.nodeid}: a conformance test cannot be marked xfail (it would hide a failure)")
        if rule_id in known:
            errors += _mode_errors(item, rule_id)
    if errors:
        raise pytest.UsageError("conformance collection errors:\n  " + "\n  ".join(errors))
    if conformance_items and not _timeout_configured(config):
        for item in conformance_items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))
    for item in conformance_items:
        rule_id = rule_of(item)
        requires = sorted({c for m in item.iter_markers("requires") for c in m.args})
        item.user_properties.extend([("rule", rule_id), ("level", levels()[rule_id]), ("area", area(rule_id)),
                                     ("requires", ",".join(requires)), ("device", devices().get(rule_id, "")),
                                     ("modes", mode_space.encode(mode_space.item_modes(item))),
                                     ("test_id", test_id(item))])
        race = item.get_closest_marker("race")  # a verdict that depends on a race with the implementation
        if race is not None:
            item.user_properties.append(("race", " ".join(map(str, race.args)) or "race"))
    entries = config.stash[EXPECT_KEY]
    if entries and conformance_items:
        # Before any selection (--rule, -k): an entry for a rule this run deselects is still valid. An
        # entry is checked only where this run can tell: an id or glob when its file was collected, a rule
        # entry when every rule's tests were (a run of some files is not a run of the suite).
        stale = expect.unmatched(expect.checkable(entries, {test_id(i).partition("::")[0] for i in conformance_items},
                                                  {rule_of(i) for i in conformance_items} >= set(known)),
                                 [(test_id(i), rule_of(i)) for i in conformance_items])
        if stale:
            message = (f"--expectations {config.getoption('--expectations')}: "
                       + "; ".join(f"{e.describe()} matches no conformance test" for e in stale)
                       + " (remove it, or fix the selector)")
            if not _is_worker(config):
                raise pytest.UsageError(message)
            # An xdist worker's UsageError is lost (the controller sees a worker gone with a test pending): the
            # worker runs nothing and hands the message to the controller (pytest_testnodedown).
            config.workeroutput[USAGE_ERROR_OUTPUT] = message
            items[:] = []
            return
    if config.getoption("--list-rules"):
        config.stash[LISTING_KEY] = _listing(conformance_items)
    wanted = config.getoption("--rule")
    if wanted:
        chosen = select_rules(wanted, known)
        keep = [i for i in items if not _is_conformance(i) or rule_of(i) in chosen]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def _mode_errors(item, rule_id: str) -> list[str]:
    """A ``modes`` mark naming a value its rule's ``Modes:`` line does not declare for that axis (a typo would
    leave a pair uncovered without saying why), or a value outside a known axis's vocabulary."""
    decl = mode_space.declarations().get(rule_id)
    errors = []
    for mark in item.iter_markers("modes"):
        for axis, value in mark.kwargs.items():
            allowed = decl.axes.get(axis) if decl is not None and axis in decl.axes else mode_space.AXES.get(axis)
            bad = [v for v in mode_space.values_of(value) if allowed is not None and v not in allowed]
            if bad:
                errors.append(f"{item.nodeid}: modes mark {axis}={value!r}: {', '.join(map(repr, bad))} is not a value "
                              f"of axis {axis} ({', '.join(allowed)}) declared for {rule_id}")
    return errors


def _timeout_configured(config) -> bool:
    """Whether this run sets pytest-timeout's limit itself (``--timeout``, ``PYTEST_TIMEOUT`` or the ini
    ``timeout``, 0 included), or has no pytest-timeout to apply one (then there is nothing to default)."""
    if not config.pluginmanager.hasplugin("timeout"):
        return True
    return (config.getoption("timeout", None) is not None or bool(os.environ.get("PYTEST_TIMEOUT"))
            or bool(config.getini("timeout")))


def _listing(items) -> list[tuple[str, str, str, str, str, str]]:
    caps: dict[str, set] = defaultdict(set)
    cases: dict[str, list] = defaultdict(list)
    for item in items:
        caps[rule_of(item)].update(c for m in item.iter_markers("requires") for c in m.args)
        cases[rule_of(item)].append(mode_space.item_modes(item))
    return [(rule_id, levels()[rule_id], area(rule_id), ",".join(sorted(caps[rule_id])) or "-", title,
             mode_space.coverage(rule_id, cases[rule_id]).listing())
            for rule_id, title in rules().items() if rule_id in caps]


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    if session.config.getoption("--list-rules"):
        return True  # listed in the terminal summary; nothing runs


def rule_of(item) -> str | None:
    mark = item.get_closest_marker("rule")
    return mark.args[0] if mark else None


_RUN_DEVICE: list[str] = []


def run_device() -> str:
    """The device this run's tensors live on: 'gpu' when Paddle sees a CUDA device, else 'cpu'."""
    if not _RUN_DEVICE:
        import paddle

        cuda = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
        _RUN_DEVICE.append("gpu" if cuda else "cpu")
    return _RUN_DEVICE[0]


def pytest_runtest_setup(item):
    if not _is_conformance(item):
        return
    adapter = _adapter(item.config)
    needed = {c for mark in item.iter_markers("requires") for c in mark.args}
    # "a|b": either capability will do (a rule that runs on whichever snapshot level the loader reads)
    missing = sorted(c for c in needed if not set(c.split("|")) & set(adapter.capabilities))
    if missing:
        pytest.skip(f"{NOT_APPLICABLE}: {adapter.name} does not claim {', '.join(missing)}")
    _skip_unselected_tier(item)
    rule_id = rule_of(item)
    serves_on = getattr(adapter, "serves_on", None)
    if rule_id in devices() and serves_on and serves_on != run_device():
        pytest.skip(f"{NOT_APPLICABLE}: {rule_id} depends on the device (SPEC.md, Device: {devices()[rule_id]}); "
                    f"it is judged for the device {adapter.name} serves on ({serves_on}), and this run is on {run_device()}")


# Tiers: tests too slow for the quick run (multi-rank jobs under paddle.distributed.launch, many cycles,
# a tensor over 2 GiB).
# They run when the -m expression names their marker (-m multirank, -m "multirank or cycles"); otherwise
# they are reported skipped with the command that runs them, never passed.
TIERS = ("multirank", "cycles", "restart", "huge", "pairs")


def _skip_unselected_tier(item) -> None:
    expression = item.config.getoption("markexpr", "") or ""
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None and tier not in expression:
            pytest.skip(f"tier {tier} not selected: run it with `python -m pytest conformance --impl=NAME -m {tier}` "
                        "(docs/multirank.md)")
    # A test only two hosts can prove (local rank != global rank) runs with --hosts 2 alone.
    if item.get_closest_marker("hosts") is not None and item.config.getoption("--hosts") < 2:
        pytest.skip("runs on two hosts only: `python -m pytest conformance --impl=NAME -m multirank --hosts 2` "
                    "(docs/multirank.md)")


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
        # read by _status_of; a plain attribute, so it survives pytest-xdist's report serialization
        report.conformance_status = "error"
    props = _props(item.user_properties)
    entry = expect.match(item.config.stash.get(EXPECT_KEY, []), props["test_id"], props["rule"]) if props else None
    if entry is not None:
        _apply_expectation(report, entry)
    return report


def _apply_expectation(report, entry) -> None:
    """Show a covered test to pytest as xfail does (strict): an expected failure is reported
    ``xfailed``, an expected failure that passes fails. What the test actually did is kept on the
    report (``conformance_actual``, ``conformance_message``) for the results."""
    status = _status_of(report)
    if status in ("failed", "error"):
        report.conformance_actual = status
        report.conformance_message = _message(report, status)
        report.outcome = "skipped"
        report.wasxfail = f"expected failure ({entry.kind}): {entry.reason}"
    elif status == "passed" and report.when == "call" and entry.kind != "flaky":
        report.conformance_actual = "passed"
        report.conformance_message = ""
        report.outcome = "failed"
        report.longrepr = (f"[XPASS(strict)] {report.nodeid}: an expected failure ({entry.kind}: {entry.reason}; "
                           f"{entry.describe()}) passed; remove the entry from the expectations file")


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


# -- results, from test reports ----------------------------------------------------------------------
def _status_of(report) -> str | None:
    if report.when == "setup":
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, (tuple, list)) else str(report.longrepr)
            return NOT_APPLICABLE if NOT_APPLICABLE in reason else "skipped"
        return "error" if report.failed else None
    if report.when == "call":
        forced = getattr(report, "conformance_status", None)
        if forced:
            return forced
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, (tuple, list)) else str(report.longrepr)
            return NOT_APPLICABLE if NOT_APPLICABLE in reason else "skipped"
        return "passed" if report.passed else "failed"
    return "error" if report.failed else None


def _message(report, status: str) -> str:
    if status in (NOT_APPLICABLE, "skipped"):
        return report.longrepr[2] if isinstance(report.longrepr, (tuple, list)) else str(report.longrepr)
    if status in ("failed", "error"):
        crash = getattr(report.longrepr, "reprcrash", None)
        return crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    return ""


def _record(config, nodeid: str, props: dict) -> dict:
    """The result record of one conformance test, from its rule properties (named by its ``test_id``)."""
    rule_id = props["rule"]
    nodeid = props.get("test_id") or nodeid
    entry = expect.match(config.stash.get(EXPECT_KEY, []), nodeid, rule_id)
    return {
        "nodeid": nodeid,
        "rule": rule_id,
        "area": props["area"],
        "level": props["level"],
        "device": props["device"] or None,
        "title": rules().get(rule_id, ""),
        "requires": [c for c in props["requires"].split(",") if c],
        "status": None,  # the verdict: the actual status read through the expectations
        "actual": None,
        "message": "",
        "expectation": entry.as_json() if entry else None,
        "repro": repro_command(config, nodeid),
        "modes": mode_space.decode(props.get("modes", "")),
        "_entry": entry,
        "_race": bool(props.get("race")),
    }


def _props(user_properties) -> dict | None:
    props = {k: v for k, v in user_properties if k in PROPERTY_KEYS}
    return props if "rule" in props and props.get("rule") in rules() else None


def pytest_collection_finish(session):
    # Serial runs know every selected test up front (one that never reports stays "not run").
    # A pytest-xdist controller collects nothing: its records come from the reports.
    if _adapter(session.config) is not None:
        # The cases draw the same small tensors again and again: kept in a process that runs them (never in a
        # trainer), so not in a pytest-xdist controller, which would only pay for ml_dtypes' import (0.5 s).
        from weightsync.fixtures import models

        models.keep_drawn_values()
    results = session.config.stash[RESULTS_KEY]
    for item in session.items:
        props = _props(item.user_properties) if _is_conformance(item) else None
        if props:
            results[item.nodeid] = _record(session.config, item.nodeid, props)


def pytest_collectreport(report):
    if report.failed:
        _STATE["other_failures"] = _STATE.get("other_failures", 0) + 1


def pytest_runtest_logreport(report):
    config = _STATE.get("config")
    if config is None:
        return
    props = _props(report.user_properties)
    if props is None:
        if report.failed:
            _STATE["other_failures"] = _STATE.get("other_failures", 0) + 1  # a plain test in the same run
        if report.when == "call":
            _STATE["plain_tests_run"] = _STATE.get("plain_tests_run", 0) + 1
        return
    results = config.stash[RESULTS_KEY]
    info = results.get(report.nodeid)
    if info is None:
        info = results[report.nodeid] = _record(config, report.nodeid, props)
    actual = getattr(report, "conformance_actual", None)  # set where an expectation covered the test
    status = actual or _status_of(report)
    # The first non-passing phase decides (a teardown error after a pass is still an error).
    if status is not None and info["actual"] in (None, "passed"):
        info["actual"] = status
        info["message"] = report.conformance_message if actual else _message(report, status)
        info["status"] = expect.verdict(status, info["_entry"])


def repro_command(config, nodeid: str, installed: bool | None = None) -> str:
    """A shell command that reruns one test with the same interpreter, implementation and options,
    from the directory the suite was run in. A test of the installed suite (``installed``, default: whether
    this one is) is named as ``--pyargs conformance.MODULE::TEST``."""
    path, sep, rest = nodeid.partition("::")
    args = [f"--impl={config.getoption('--impl')}"] + [f"--impl-opt={kv}" for kv in config.getoption("--impl-opt")]
    if (INSTALLED if installed is None else installed) and path.startswith("conformance/") and path.endswith(".py"):
        target = ["--pyargs", path.removesuffix(".py").replace("/", ".") + sep + rest]
    else:
        root = str(getattr(config, "rootpath", "") or "")
        invoked = str(getattr(getattr(config, "invocation_params", None), "dir", "") or "")
        if root and invoked:
            path = os.path.relpath(os.path.join(root, path), invoked)
        target = [path + sep + rest]
    return (f"{shlex.quote(sys.executable)} -m pytest " + " ".join(shlex.quote(a) for a in target + args))


def _public(results: dict) -> dict:
    return {k: {f: v for f, v in r.items() if not f.startswith("_")} for k, r in results.items()}


def summarize(results) -> dict:
    """rule id -> its status (the first of error, failed, unexpected_pass, expected_failure, passed,
    not_applicable, skipped among its tests)."""
    return rep.rule_statuses(results)


def run_summary(config, results=None) -> dict:
    """Counts of tests and rules per verdict, failing rules per level, and the reason the run tested
    nothing (or None)."""
    results = config.stash.get(RESULTS_KEY, {}) if results is None else results
    return rep.summary(_public(results), config.getoption("--fail-on"), nothing_tested(config, results))


def nothing_tested(config, results=None) -> str | None:
    """Why this run proves nothing about the implementation, or None when it tested something.

    Nothing was tested when --impl was given and either no conformance test was collected (paths,
    -k, -m or --rule selected none), or none of those selected reached a verdict (passed, failed,
    error): every one was not applicable to the claimed capabilities, or skipped."""
    adapter = _adapter(config)
    if adapter is None or config.getoption("collectonly", False) or config.getoption("--list-rules"):
        return None
    results = config.stash.get(RESULTS_KEY, {}) if results is None else results
    impl = config.getoption("--impl")
    if not results:
        if config.getoption("--project-tests-count") and _STATE.get("plain_tests_run"):
            return None  # the project's own tests ran, and the caller (mutmut) asked that they count
        return (f"no conformance test was collected for {adapter.name} (--impl={impl}): the paths, -k/-m "
                "expressions or --rule selection matched none; nothing was tested")
    counts = Counter(r["actual"] for r in results.values())
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


USAGE_ERROR_OUTPUT = "conformance_usage_error"
USAGE_ERROR_KEY = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """(pytest-xdist, in the controller) a conformance run under the default ``--dist load`` hands out the suite's
    units (``conformance.xdist_units``); any other run, or another ``--dist``, is pytest-xdist's own."""
    if _adapter(config) is None or config.getvalue("dist") != "load":
        return None
    from .xdist_units import Units

    return Units(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(pytest-xdist, in the controller) a worker's usage error (a stale expectations entry) is the run's."""
    message = (getattr(node, "workeroutput", None) or {}).get(USAGE_ERROR_OUTPUT)
    if message:
        node.config.stash[USAGE_ERROR_KEY] = message


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    usage = config.stash.get(USAGE_ERROR_KEY, None)
    if usage is not None:
        session.exitstatus = pytest.ExitCode.USAGE_ERROR  # (pytest_terminal_summary prints it)
        return
    if (_is_worker(config) or _adapter(config) is None or config.getoption("--list-rules")
            or config.getoption("collectonly", False)):
        return
    if session.exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return  # interrupted, internal or usage error: it stands
    results = config.stash.get(RESULTS_KEY, {})
    other = _STATE.get("other_failures", 0)
    if nothing_tested(config) and not other:  # a failed project test or collection fails the run instead
        session.exitstatus = NOTHING_TESTED_EXIT
        return
    # The verdicts decide, not pytest's count: an expected failure passes the gate, an unexpected
    # pass fails it, and under --fail-on=contract a hardening failure is reported but does not fail.
    failing = rep.failing_tests(results, config.getoption("--fail-on"))
    not_run = [r for r in results.values() if r["actual"] is None]
    failed = bool(failing or other or not_run)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED if failed else pytest.ExitCode.OK


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    usage = config.stash.get(USAGE_ERROR_KEY, None)
    if usage is not None:
        terminalreporter.write_line(f"ERROR: {usage}", red=True)
        return
    if config.getoption("--list-rules"):
        _print_listing(terminalreporter, config.stash.get(LISTING_KEY, []))
        return
    results = config.stash.get(RESULTS_KEY, {})
    adapter = _adapter(config)
    if adapter is None or _is_worker(config):
        return
    if exitstatus == pytest.ExitCode.USAGE_ERROR or config.getoption("collectonly", False):
        return  # the collection errors say it all, or nothing was meant to run
    public = _public(results)
    statuses = rep.rule_statuses(public)
    if results:
        _print_table(terminalreporter, adapter, public, statuses)
    _print_verdicts(terminalreporter, config, public, statuses)
    empty = nothing_tested(config, results)
    if empty:
        terminalreporter.write_line("")
        exit_note = f" (exit status {int(NOTHING_TESTED_EXIT)})" if exitstatus in (pytest.ExitCode.OK, NOTHING_TESTED_EXIT) else ""
        terminalreporter.write_line(f"NOTHING TESTED: {empty}{exit_note}", red=True, bold=True)
    path = config.getoption("--conformance-report")
    if path:
        rep.write(path, build_report(config, adapter, public))
        terminalreporter.write_line(f"conformance report written to {path}")
    candidate = config.getoption("--update-expectations")
    if candidate:
        tests = [{**public[k], "race": results[k]["_race"]} for k in public]
        text = expect.candidate(tests, config.stash.get(EXPECT_KEY, []), config.getoption("--expectations"))
        with open(candidate, "w", encoding="utf-8") as f:
            f.write(text)
        terminalreporter.write_line(f"candidate expectations written to {candidate} (review kinds and reasons)")


def _print_verdicts(terminalreporter, config, results, statuses) -> None:
    levels_of = {r["rule"]: r["level"] for r in results.values()}
    for level in rep.LEVELS:
        failing = sorted(r for r, s in statuses.items() if s in ("failed", "error") and levels_of[r] == level)
        if failing:
            note = " (reported; --fail-on=contract does not fail the run on them)" \
                if level == "hardening" and config.getoption("--fail-on") == "contract" else ""
            terminalreporter.write_line(f"failing {level} rules{note}: " + ", ".join(failing))
    expected = sorted(r for r, s in statuses.items() if s == "expected_failure")
    if expected:
        kinds = Counter(t["expectation"]["kind"] for t in results.values() if t["status"] == "expected_failure")
        terminalreporter.write_line(f"expected failures ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))} "
                                    f"tests): " + ", ".join(expected))
    unexpected = sorted(t["nodeid"] for t in results.values() if t["status"] == "unexpected_pass")
    if unexpected:
        terminalreporter.write_line("UNEXPECTED PASS (an expected failure now passes: remove its entry from "
                                    f"{config.getoption('--expectations')}): " + ", ".join(unexpected), red=True)
    causes = rep.root_causes(results)
    if causes:
        terminalreporter.write_line("")
        terminalreporter.write_line("root causes (one failure explaining several rules):")
        for c in causes:
            terminalreporter.write_line(f"  {len(c['rules'])} rules, {c['tests']} tests: {c['example']}")
            terminalreporter.write_line(f"    rules: {', '.join(c['rules'])}")


NATURAL_WIDTH = 130  # the width of output that goes to no terminal and no COLUMNS (a CI log)


def _width(terminalreporter) -> int:
    """Columns to fit: ``COLUMNS`` when set, else the terminal's width, else NATURAL_WIDTH (a log, a pipe)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) >= 40:
        return int(columns)
    tw = terminalreporter._tw
    isatty = getattr(getattr(tw, "_file", None), "isatty", lambda: False)
    return tw.fullwidth if isatty() else NATURAL_WIDTH


def _print_rich(terminalreporter, renderable) -> None:
    """A rich table within the width (``_width``), each line written without the padding after it."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=False, width=_width(terminalreporter), color_system=None)
    console.print(renderable)
    for line in console.file.getvalue().splitlines():
        terminalreporter.write_line(line.rstrip())


def _print_listing(terminalreporter, listing) -> None:
    """One row per rule, its id, level and area on its first line (so that an id greps to them), long
    capability lists and titles wrapped within the terminal's width (``COLUMNS``)."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title=f"{len(listing)} rules (SPEC.md):",
                  title_justify="left")
    for name in ("id", "level", "area"):
        table.add_column(name, no_wrap=True)
    table.add_column("capabilities", ratio=2, overflow="fold")
    table.add_column("title", ratio=3, overflow="fold")
    for rule_id, level, area_name, caps, title, _ in listing:
        table.add_row(rule_id, level, area_name, caps.replace(",", ", "), title)
    terminalreporter.write_line("")
    _print_rich(terminalreporter, table)
    # The mode space of each rule (SPEC.md's Modes: lines, conformance/modes.py) and the pairs of mode values the
    # collected cases cover, uncovered pairs by name.
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title_justify="left",
                  title="modes of each rule (SPEC.md Modes:) and the pairs of values its collected cases cover:")
    table.add_column("id", no_wrap=True)
    table.add_column("modes: declared, covered, uncovered", overflow="fold")
    for rule_id, *_, modes in listing:
        table.add_row(rule_id, modes)
    terminalreporter.write_line("")
    _print_rich(terminalreporter, table)


TABLE_COLUMNS = (("passed", "passed"), ("failed contract", None), ("failed hardening", None), ("error", "error"),
                 ("expected", "expected_failure"), ("unexpected pass", "unexpected_pass"),
                 ("not applicable", NOT_APPLICABLE), ("skipped", "skipped"))


def _print_table(terminalreporter, adapter, results, statuses) -> None:
    levels_of = {r["rule"]: r["level"] for r in results.values()}
    per_area: dict[str, Counter] = defaultdict(Counter)
    for rule_id, status in statuses.items():
        key = f"failed {levels_of[rule_id]}" if status == "failed" else status
        per_area[area(rule_id)][key] += 1
    from rich.table import Table

    table = Table(title=f"Conformance of {adapter.name} {adapter.version}: rules by area")
    table.add_column("area")
    for title, _ in TABLE_COLUMNS:
        table.add_column(title, justify="right")
    total = Counter()
    for name in sorted(per_area):
        c = per_area[name]
        total.update(c)
        table.add_row(name, *(str(c[key or title]) for title, key in TABLE_COLUMNS))
    table.add_row("all", *(str(total[key or title]) for title, key in TABLE_COLUMNS))
    terminalreporter.write_line("")
    _print_rich(terminalreporter, table)


def build_report(config, adapter, results) -> dict:
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    run_info = {
        "implementation": adapter.name,
        "implementation_version": adapter.version,
        "adapter": adapter._conformance_where,
        "capabilities": sorted(adapter.capabilities),
        "serves_on": getattr(adapter, "serves_on", None),
        "notes": list(getattr(adapter, "notes", None) or []),
        "suite_version": SUITE_VERSION,
        "suite_protocol": SUITE_PROTOCOL,
        "fail_on": config.getoption("--fail-on"),
        "expectations": config.getoption("--expectations"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {d: version(d) for d in ("paddlepaddle", "paddlepaddle-gpu", "safetensors", "pyzmq", "numpy")},
    }
    return rep.build(run_info, results, rules(), config.getoption("--fail-on"), nothing_tested(config, results))
