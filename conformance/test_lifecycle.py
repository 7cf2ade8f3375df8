"""Lifecycle: clear releases every parameter, clear + update leaves exactly the new version, and a
failed update never reads as success. Spec: SPEC.md § LIFE.

Flow of every test: ``update()`` (first load, v1) -> the trainer writes v2 -> ``clear()`` ->
``update()``. The models include an MTP draft model where the implementation claims ``mtp``.
"""
import os

import pytest

from conformance import check
from fixtures import models as M
from fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

MAIN = (("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))
MTP = (("mtp.0.proj.weight", "bfloat16", (4, 4)), ("mtp.0.norm.weight", "float32", (4,)))
SPEC = M.spec(*MAIN)
SPEC_MTP = M.spec(*MAIN, mtp=[MTP])

MODELS = [
    pytest.param(SPEC, id="main"),
    pytest.param(SPEC_MTP, marks=pytest.mark.requires("mtp"), id="main+mtp"),
]


def _write(loader, layout, st):
    if layout == "single":
        S.write_safetensors(S.single_path(loader.model_dir, 0, 0), st)
    elif layout == "parts":
        S.write_parts(loader.model_dir, 0, 0, dict(enumerate(S.split(st, 2))))
    else:
        S.write_pickle_fallback(os.path.join(loader.shared_dir, S.base_name(0, 0) + S.PDPARAMS), st)


def _first_load(loader, spec, layout="single"):
    v1 = M.state(spec, version=1)
    _write(loader, layout, v1)
    session = loader.open(spec)
    session.update()
    check.params_equal(session.observe(), v1, f"first load from {loader.model_dir}")
    return session


@pytest.mark.rule("LIFE-CLEAR-RELEASES")
@pytest.mark.requires("snapshot.single")
@pytest.mark.parametrize("spec", MODELS)
def test_clear_releases_every_parameter(loader, spec):
    session = _first_load(loader, spec)
    session.clear()
    observed = session.observe()
    names = [p.name for p in spec.all_params]
    absent = [n for n in names if n not in observed]
    check.that(not absent, f"after clear(): parameters {absent} are not observed at all (expected present, unloaded)")
    still = {n: f"{observed[n].dtype}{list(observed[n].shape)}" for n in names if n in observed and observed[n].data is not None}
    check.that(not still, f"after clear(): parameters still hold data: {still}; expected none loaded")


LAYOUTS = [
    pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="single-file"),
    pytest.param("parts", marks=pytest.mark.requires("snapshot.parts"), id="parts"),
    pytest.param("shared", marks=pytest.mark.requires("snapshot.shared_fallback"), id="shared-fallback"),
]


@pytest.mark.rule("LIFE-RELOAD-LATEST")
@pytest.mark.parametrize("spec", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_clear_then_update_leaves_new_version(loader, layout, spec):
    session = _first_load(loader, spec, layout)
    v2 = M.state(spec, version=2)
    _write(loader, layout, v2)  # the trainer overwrites the same files in place
    session.clear()
    session.update()
    observed = session.observe()
    check.params_equal(observed, v2, f"{layout}: clear() then update() after v2 was written")
    check.equal(sorted(observed), sorted(v2), f"{layout}: parameter names after reload")


def _bad_dtype(loader, spec):
    v2 = M.state(spec, version=2)
    v2["norm.bias"] = v2["norm.bias"].astype("float32")
    S.write_safetensors(S.single_path(loader.model_dir, 0, 0), v2)


def _missing(loader, spec):
    v2 = M.state(spec, version=2)
    del v2["embed.weight"]
    S.write_safetensors(S.single_path(loader.model_dir, 0, 0), v2)


def _corrupt(loader, spec):
    path = S.write_safetensors(S.single_path(loader.model_dir, 0, 0), M.state(spec, version=2))
    S.corrupt_header(path)


@pytest.mark.rule("LIFE-FAILED-NOT-NORMAL")
@pytest.mark.requires("snapshot.single", "status")
@pytest.mark.parametrize("spec", MODELS)
@pytest.mark.parametrize("breakage", [_bad_dtype, _missing, _corrupt], ids=["bad-dtype", "missing-tensor", "corrupt-file"])
def test_failed_update_is_never_normal(loader, breakage, spec):
    session = _first_load(loader, spec)
    check.status_is(session, "NORMAL", "after the first successful load")
    breakage(loader, spec)
    session.clear()
    # The exception's type and message are other rules' business (APPLY-*, FILE-*); here it only
    # has to be raised, and the status must not claim success afterwards.
    with check.raises(Exception, match=r"\S", where=f"{breakage.__name__} snapshot in {loader.model_dir}"):
        session.update()
    check.status_not(session, "NORMAL", f"after an update that raised ({breakage.__name__})")
