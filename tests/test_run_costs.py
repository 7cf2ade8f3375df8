"""What the quick run's cheaper parts keep of the contract they replace (docs/suite-run-time.md):
``fixtures.models.weights`` keeps small tensors' values, the suite's ``tmp_path`` skips pytest's link, and the
reference's adapter imports the reference (and Paddle) on its first session."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types

import numpy as np
import pytest

import conformance.conftest as suite_conftest
import reference.adapter as reference_adapter
from conformance.adapter import LoaderConfig
from fixtures import models as M
from tests.conftest import REPO

@pytest.fixture(autouse=True)
def kept():
    """As in the suite's test process (conformance.plugin turns keeping on); as it was afterwards."""
    was = M._KEEP[0]
    M.keep_drawn_values()
    yield
    M.keep_drawn_values(was)


SMALL = M.ParamSpec("layers.0.w", "bfloat16", (3, 5))
LARGE = M.ParamSpec("embed.w", "float32", (512, 513))  # just over 1 MiB: drawn each time


def test_weights_are_the_same_values_each_call_and_a_new_array():
    for p in (SMALL, LARGE):
        first, second = M.weights(p, seed=1, version=2), M.weights(p, seed=1, version=2)
        assert first.tobytes() == second.tobytes(), f"{p.name}: two calls gave different values"
        assert first is not second and not np.shares_memory(first, second), f"{p.name}: two calls share memory"
        assert first.flags.writeable, f"{p.name}: the array is read-only"
        assert first.dtype == M.NUMPY_DTYPES[p.dtype] and first.shape == p.shape, f"{p.name}: {first.dtype} {first.shape}"


def test_a_callers_change_never_reaches_the_next_call():
    for p in (SMALL, LARGE):
        mine = M.weights(p)
        want = mine.tobytes()
        mine[...] = 0
        assert M.weights(p).tobytes() == want, f"{p.name}: a change to one call's array reached the next call"


def test_versions_seeds_and_names_still_differ():
    base = M.weights(SMALL).tobytes()
    for other in (M.weights(SMALL, version=2), M.weights(SMALL, seed=1),
                  M.weights(M.ParamSpec("layers.1.w", SMALL.dtype, SMALL.shape))):
        assert other.tobytes() != base


def test_the_kept_values_are_the_drawn_ones():
    assert LARGE.nbytes > M._MEMO_MAX_BYTES >= SMALL.nbytes
    assert M.weights(SMALL, version=5).tobytes() == M._draw(SMALL, 0, 5).tobytes()


def test_a_process_that_did_not_ask_keeps_nothing():
    """A trainer's process (whose memory across cycles CYCLE-NO-LEAK judges) draws each version anew."""
    code = ("from fixtures import models as M; p = M.ParamSpec('w', 'float32', (4, 4)); "
            "[M.weights(p, version=v) for v in range(1, 21)]; print(M._memo.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0"], out.stdout


def test_a_child_forked_from_a_process_that_keeps_keeps_nothing_new():
    """Every forked child (a trainer, a loop driver, a memory case's child) draws each version anew, whatever
    forked it: the setting is turned off at the fork, not by each child's entry point."""
    M.weights(SMALL)  # the parent keeps at least one
    before = M._memo.cache_info().currsize
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: draw twenty versions of a new tensor, say what is kept
        try:
            p = M.ParamSpec("forked.w", "float32", (4, 4))
            [M.weights(p, version=v) for v in range(1, 21)]
            os.write(write, f"{M._KEEP[0]} {M._memo.cache_info().currsize}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as r:
        said = r.read()
    os.waitpid(pid, 0)
    assert said == f"False {before}", f"forked child: keeping and kept values {said!r}, want 'False {before}'"
    assert M._KEEP[0], "the parent stopped keeping after the fork"


def _suite_tmp_path(node_name: str, base):
    request = types.SimpleNamespace(node=types.SimpleNamespace(name=node_name))
    factory = types.SimpleNamespace(getbasetemp=lambda: base)
    return next(suite_conftest.tmp_path._get_wrapped_function()(request, factory))


def test_suite_tmp_path_is_new_empty_private_and_named_after_the_case(tmp_path):
    name = "test_a_very_long_case_name_that_goes_on[with-params-1]"
    (tmp_path / "test_a_very_long_case_name_tha0").mkdir()  # already there (an earlier case of the same prefix)
    made = [_suite_tmp_path(name, tmp_path) for _ in range(3)]
    assert len(set(made)) == 3, made
    for path in made:
        assert path.parent == tmp_path and path.name.startswith("test_a_very_long_case_name_tha"), path
        assert path.is_dir() and not any(path.iterdir()), path
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, oct(os.stat(path).st_mode)
    assert not [p for p in tmp_path.iterdir() if p.is_symlink()], sorted(tmp_path.iterdir())


def test_resolving_the_reference_adapter_imports_no_paddle():
    code = ("import sys; from conformance.registry import resolve; adapter, _ = resolve('reference', {}); "
            "print(adapter.name, len(adapter.capabilities), sorted(m for m in ('paddle', 'reference.manager') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["reference", "30", "[]"], out.stdout


def test_the_first_session_binds_every_lazy_name_in_the_module_itself():
    """``_load`` (called by ``open()`` and ``control()``) binds each name of ``_LAZY`` in the module's own
    namespace, where the adapter's functions look their globals up (a module ``__getattr__`` serves attribute
    access from outside only): in a fresh process, before anything asked for a name."""
    code = ("import reference.adapter as A; assert not set(A._LAZY) & set(vars(A)), sorted(vars(A)); A._load(); "
            "import reference.manager as M, reference.control as C; "
            "print(sorted(n for n in A._LAZY if n in vars(A)), vars(A)['WeightManager'] is M.WeightManager, "
            "vars(A)['WeightControl'] is C.WeightControl, vars(A)['worker_loop'].__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    bound, rest = out.stdout.rsplit("]", 1)
    assert bound + "]" == str(sorted(reference_adapter._LAZY)), f"names bound by _load: {bound}], want {sorted(reference_adapter._LAZY)}"
    assert rest.split() == ["True", "True", "reference.worker_loop"], f"what they are bound to: {rest.split()}"


def test_an_unknown_name_is_an_attribute_error_naming_it():
    """As a module without ``__getattr__`` would: ``hasattr`` is False, the error names the module and the name."""
    assert not hasattr(reference_adapter, "NoSuchThing")
    with pytest.raises(AttributeError, match=r"^module 'reference\.adapter' has no attribute 'NoSuchThing'$"):
        reference_adapter.NoSuchThing


def test_a_replacement_made_before_the_first_session_stands(monkeypatch, tmp_path):
    """A test (tests/mutants) replaces ``reference.adapter.WeightManager`` and ``Control`` before the adapter
    imported them: the first session is built with the replacements, and the other names are the reference's."""
    made = []

    class Manager:
        def __init__(self, models, **kw):
            made.append(("manager", kw["model_dir"]))

    class Control:
        def __init__(self, manager, options):
            made.append(("control", type(manager).__name__))

    for name in ("WeightManager", "Control", "RoutedControl"):
        monkeypatch.delitem(reference_adapter.__dict__, name, raising=False)  # as if never imported
    monkeypatch.setattr(reference_adapter, "WeightManager", Manager, raising=False)
    monkeypatch.setattr(reference_adapter, "Control", Control, raising=False)
    config = LoaderConfig(load_strategy="ipc_snapshot", model_dir=str(tmp_path), shared_dir=str(tmp_path), options={})
    session = reference_adapter.ReferenceAdapter().open([], config)
    assert made == [("manager", str(tmp_path)), ("control", "Manager")], made
    assert isinstance(session.manager, Manager)
    from reference.control_v1 import RoutedControl

    assert reference_adapter.RoutedControl is RoutedControl


@pytest.mark.parametrize("policy, phases, kept", [
    ("all", {"setup": True, "call": True, "teardown": True}, True),
    ("failed", {"setup": True, "call": True}, False),
    ("failed", {"setup": True, "call": False}, True),
    ("failed", {"setup": False}, True),  # no call: the case never ran, nothing says it passed
    ("none", {"setup": True, "call": False}, False),
])
def test_a_case_directory_goes_as_pytests_retention_policy_says(tmp_path, policy, phases, kept):
    """The suite's ``tmp_path`` keeps or removes the case's directory as it ends, with what it holds, as
    ``tmp_path_retention_policy`` says ("failed": the project's own runs) of the case's phases so far."""
    config = types.SimpleNamespace(getini={"tmp_path_retention_policy": policy}.__getitem__)
    node = types.SimpleNamespace(name="test_case[x]", stash={suite_conftest._PASSED: phases})
    steps = suite_conftest.tmp_path._get_wrapped_function()(types.SimpleNamespace(node=node, config=config),
                                                            types.SimpleNamespace(getbasetemp=lambda: tmp_path))
    path = next(steps)
    (path / "sub").mkdir()
    (path / "sub" / "model.safetensors").write_bytes(b"x" * 100)
    with pytest.raises(StopIteration):
        next(steps)
    assert path.exists() is kept, (policy, phases, sorted(tmp_path.iterdir()))


def test_the_projects_runs_keep_only_the_directories_of_cases_that_did_not_pass():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["tool"]["pytest"]["ini_options"]["tmp_path_retention_policy"] == "failed"


EXIT_PROBE = '''
import atexit, gc, json, os


def pytest_configure(config):
    def report():  # registered before the suite's own handler, so it runs after it (atexit is last in, first out)
        with open(os.environ["EXIT_PROBE_OUT"], "w") as f:
            json.dump({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}, f)
    atexit.register(report)
'''


def test_a_suite_process_ends_without_collecting_its_heap(tmp_path):
    """At exit, once pytest is done, the suite's process no longer collects garbage (``conformance.conftest``:
    a pytest-xdist worker's final collections kept its controller waiting 0.7 s), and the exit handlers registered
    before it still run."""
    (tmp_path / "exit_probe.py").write_text(EXIT_PROBE)
    out = tmp_path / "exit.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO]), "EXIT_PROBE_OUT": str(out)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "conformance/test_counts.py", "--impl=reference", "-q",
                           "-p", "no:cacheprovider", "-p", "exit_probe", "-k", "parts-main"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(out.read_text())
    assert got["enabled"] is False and got["frozen"] > 0, got
