"""What the quick run's cheaper fixtures keep of the contract they replace (docs/suite-run-time.md):
``fixtures.models.weights`` keeps small tensors' values, and the suite's ``tmp_path`` skips pytest's link."""
from __future__ import annotations

import os
import stat
import types

import numpy as np

import conformance.conftest as suite_conftest
from fixtures import models as M

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


def _suite_tmp_path(node_name: str, base):
    request = types.SimpleNamespace(node=types.SimpleNamespace(name=node_name))
    factory = types.SimpleNamespace(getbasetemp=lambda: base)
    return suite_conftest.tmp_path._get_wrapped_function()(request, factory)


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
