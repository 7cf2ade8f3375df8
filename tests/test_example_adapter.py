"""The worked example of docs/adapters.md and the Paddle recipes of docs/paddle-recipes.md.

* The example adapter (docs/example_adapter.py) passes every rule of the capabilities it claims,
  through the real suite in a subprocess: a broken example fails here.
* The code the walk-through quotes is the example's code.
* Every ``python`` block of docs/paddle-recipes.md runs against the installed Paddle, and the
  pitfalls the page states are pinned, so that a Paddle upgrade that changes one fails this file.
"""
import importlib.util
import math
import os
import re

import numpy as np
import pytest

from tests.conftest import EXAMPLE_ADAPTER as EXAMPLE
from tests.conftest import REPO
CLAIMED = {"snapshot.parts", "snapshot.single", "snapshot.legacy", "trace", "status", "mtp"}
# Rules (of 89) and tests the example passed when this was written; a broken example passes fewer.
MIN_RULES_PASSED = 38
MIN_TESTS_PASSED = 305
DOCS = os.path.join(REPO, "docs")


def _read(name):
    with open(os.path.join(DOCS, name)) as f:
        return f.read()


# -- the example adapter against the suite ---------------------------------------------------------
@pytest.fixture(scope="module")
def example_run(example_report):
    return example_report  # tests/conftest.py: one run per session, started in the background


def test_example_passes_every_rule_it_claims(example_run):
    code, report, output = example_run
    assert report is not None, f"no report (exit {code}):\n{output[-3000:]}"
    assert code == 0, f"exit {code}:\n{output[-3000:]}"
    info = report["run_info"]
    assert info["implementation"] == "mine" and info["adapter"] == EXAMPLE, info
    assert set(info["capabilities"]) == CLAIMED, info["capabilities"]

    statuses = {r["id"]: r["status"] for r in report["rules"]}
    bad = {rule: s for rule, s in statuses.items() if s not in ("passed", "not_applicable")}
    assert not bad, f"rules neither passed nor not applicable: {bad}\n{output[-3000:]}"
    passed = sorted(rule for rule, s in statuses.items() if s == "passed")
    assert len(passed) >= MIN_RULES_PASSED, f"only {len(passed)} rules passed: {passed}"

    # Every test the claims make applicable passed (or was skipped before it ran, as a gpu test is
    # without a GPU); every other one is not applicable: it needs a capability the example lacks.
    for test in report["tests"]:
        applicable = set(test["requires"]) <= CLAIMED
        want = ("passed", "skipped") if applicable else ("not_applicable",)
        assert test["status"] in want, f"{test['nodeid']} (requires {test['requires']}): {test['status']} {test['message']}"
    assert sum(t["status"] == "passed" for t in report["tests"]) >= MIN_TESTS_PASSED


def test_example_claims_only_what_it_implements():
    """The example's MineAdapter claims exactly CLAIMED, and its capabilities are in the vocabulary."""
    from conformance.capabilities import validate

    spec = importlib.util.spec_from_file_location("example_adapter", os.path.join(DOCS, "example_adapter.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.MineAdapter.capabilities == validate(CLAIMED)


def test_walkthrough_quotes_the_example():
    """Every ``python`` block of adapters.md that quotes the example (its first line says so:
    ``# from example_adapter.py``) is a verbatim excerpt of docs/example_adapter.py."""
    source = _read("example_adapter.py")
    marker = "# from example_adapter.py\n"
    quoted = [(h, code) for h, code in _python_blocks(_read("adapters.md")) if code.startswith(marker)]
    assert len(quoted) >= 3, f"adapters.md quotes {len(quoted)} parts of example_adapter.py; expected the adapter, reload, drop"
    for heading, code in quoted:
        excerpt = code.removeprefix(marker)
        assert excerpt in source, f"adapters.md ({heading}) quotes code that is not in example_adapter.py:\n{excerpt}"


# -- Paddle recipes ---------------------------------------------------------------------------------
def _python_blocks(markdown):
    """(nearest heading, code) of every ```python block (other fenced blocks are skipped whole, so
    that a ``#`` line inside them is not taken for a heading)."""
    blocks, heading = [], ""
    for match in re.finditer(r"^(#{1,4} [^\n]*)$|^```(\w*)\n(.*?)^```$", markdown, re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("# ").strip()
        elif match.group(2) == "python":
            blocks.append((heading, match.group(3)))
    return blocks


RECIPES = _python_blocks(_read("paddle-recipes.md"))
SETUP, RECIPE_BLOCKS = RECIPES[0], RECIPES[1:]


def _ids():
    seen = {}
    for heading, _ in RECIPE_BLOCKS:
        slug = re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")[:40]
        seen[slug] = seen.get(slug, 0) + 1
        yield slug if seen[slug] == 1 else f"{slug}-{seen[slug]}"


@pytest.fixture
def cpu_paddle():
    """The recipes are about Paddle's CPU build (the suite's): on a GPU build paddle.load copies to the
    device and tensors are not host memory."""
    import paddle

    if not paddle.get_device().startswith("cpu"):
        pytest.skip(f"Paddle's default device is {paddle.get_device()}; the recipes are for the CPU build")


def _setup():
    namespace = {"__name__": "paddle_recipe"}
    exec(compile(SETUP[1], "docs/paddle-recipes.md (setup)", "exec"), namespace)
    return namespace


def test_recipes_page_has_setup_and_recipes():
    assert SETUP[0].startswith("Setup"), SETUP[0]
    assert len(RECIPE_BLOCKS) >= 10, [h for h, _ in RECIPE_BLOCKS]


@pytest.mark.parametrize("heading,code", RECIPE_BLOCKS, ids=list(_ids()))
def test_paddle_recipe_runs(heading, code, tmp_path, monkeypatch, cpu_paddle):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the recipes' mkdtemp() files land here
    namespace = _setup()
    exec(compile(code, f"docs/paddle-recipes.md ({heading})", "exec"), namespace)


# Pitfalls the recipes page states in prose: each pinned, so that the page is corrected when Paddle
# changes the behaviour.
@pytest.fixture
def make_param(cpu_paddle):
    return _setup()["make_param"]


def test_pitfall_numel_needs_memory(make_param):
    with pytest.raises(NotImplementedError):
        make_param([2, 3], "float32").numel()


def test_pitfall_assign_checks_nothing(make_param):
    import paddle

    param = make_param([2, 3], "float32")
    paddle.assign(paddle.zeros([3, 2], "float16"), output=param)
    assert list(param.shape) == [3, 2] and param.dtype == paddle.float16


def test_pitfall_share_buffer_to_checks_nothing(make_param):
    import paddle

    param = make_param([2, 3], "float32")
    paddle.zeros([3, 2], "float16")._share_buffer_to(param)  # no error: the dtype follows, the shape does not
    assert param.dtype == paddle.float16 and list(param.shape) == [2, 3]


def test_pitfall_set_value_tensor_after_clear(make_param):
    import paddle

    param = make_param([2], "float32")
    param.set_value(paddle.ones([2]))  # never loaded: a tensor is fine
    param._clear_data()
    with pytest.raises(RuntimeError, match="not initialized"):
        param.set_value(paddle.ones([2]))  # cleared: the same call raises
    param.set_value(np.ones(2, np.float32))  # a numpy array still works


def test_pitfall_set_value_checks_with_assertion_error(make_param):
    param = make_param([2], "float32")
    with pytest.raises(AssertionError, match="dtype"):
        param.set_value(np.ones(2, np.float16))
    with pytest.raises(AssertionError, match="Shape"):
        param.set_value(np.ones((1, 2), np.float32))
    with pytest.raises(AssertionError, match="dtype"):  # no numpy fp8: uint8 is refused
        make_param([2], "float8_e4m3fn").set_value(np.ones(2, np.uint8))


def test_pitfall_zero_element_never_initialized(make_param):
    import paddle

    param = make_param([0, 4], "float32")
    paddle.assign(paddle.zeros([0, 4]), output=param)
    assert not param._is_initialized() and math.prod(param.shape) == 0


def test_pitfall_uint16_is_bfloat16(cpu_paddle):
    import paddle

    assert paddle.to_tensor(np.zeros(2, np.uint16)).dtype == paddle.bfloat16
    assert paddle.zeros([2], "uint16").dtype == paddle.bfloat16
    assert str(paddle.uint16) == "paddle.bfloat16" and paddle.uint16 != paddle.bfloat16


def test_pitfall_ml_dtypes_bfloat16_refused(cpu_paddle):
    import ml_dtypes
    import paddle

    with pytest.raises(ValueError):
        paddle.to_tensor(np.array([1.0, 2.0], ml_dtypes.bfloat16))


def test_pitfall_paddle_load_safetensors_refuses_zero_element(tmp_path, cpu_paddle):
    import paddle
    from safetensors.numpy import save_file

    path = str(tmp_path / "model_state.tp0.0.pdparams")
    save_file({"empty": np.zeros((0, 4), np.float32)}, path)
    with pytest.raises(ValueError, match="strides"):
        paddle.load(path, safetensors=True)


def test_pitfall_truncating_a_mapped_file_kills_the_reader(tmp_path, cpu_paddle):
    """A view from paddle.load(safetensors=True), its file truncated by the trainer: SIGBUS on read."""
    import signal

    import paddle
    from safetensors.numpy import save_file

    path = str(tmp_path / "model_state.tp0.0.pdparams")
    save_file({"w": np.zeros(1 << 18, np.float32)}, path)
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            import faulthandler

            faulthandler.disable()  # the SIGBUS is the point: no "Fatal Python error" dump in the run's output
            view = paddle.load(path, safetensors=True)["w"]
            os.truncate(path, 64)
            float(view.sum())
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGBUS, status
