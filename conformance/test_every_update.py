"""Every update lands, not only the first: a sequence of updates with different weights, each complete and
bit-exact, on every path (checkpoint-engine #106: a barrier that held for the first update only). Spec:
SPEC.md § LIFE (LIFE-EVERY-UPDATE). Two ranks: the multi-rank job's five healthy updates (MR-OWN-SHARD).
"""
import pytest

from conformance import check
from conformance import mode_run as R
from conformance import modes
from conformance.paths import ALL_PATHS, cases, route  # noqa: F401 (the fixture)
from weightsync.fixtures import models as M

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)),
              ("norm.bias", "float16", (4,)))
# (version, whose weights): the first load, three updates with new weights, then version 2's weights again
# under a new version (a rollback): a loader that keys anything on what it saw before must still land it.
SEQUENCE = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 2))
PARTS_LAYOUTS = {1: None, 2: [["embed.weight"], ["layers.0.mlp.weight"], ["norm.bias"]], 3: None,
                 4: [["norm.bias", "embed.weight", "layers.0.mlp.weight"]], 5: None}  # 2, 3, 2, 1, 2 parts


@pytest.mark.rule("LIFE-EVERY-UPDATE")
@pytest.mark.parametrize("path", cases())
def test_every_update_lands_not_only_the_first(route, loader, path):
    rt = route(path)
    session = rt.open(SPEC)
    claims_status = "status" in loader.adapter.capabilities
    for i, (version, weights) in enumerate(SEQUENCE):
        st = M.state(SPEC, version=weights)
        layout = PARTS_LAYOUTS[version] if path == "parts" else None
        where = rt.publish(0, st, version, layout)
        step = "the first load" if i == 0 else f"update {i} of {len(SEQUENCE) - 1}"
        at = f"{path}: {step} (version {version}, the weights of version {weights}; {where})"
        if i:
            rt.clear(0)
        rt.update(0)
        check.params_equal(session.observe(), st, at)
        if claims_status:
            check.equal(session.status(), "NORMAL", f"{at}: status() after the update returned")


@pytest.mark.rule("LIFE-EVERY-UPDATE")
@pytest.mark.parametrize("combo", modes.params("LIFE-EVERY-UPDATE", requires=lambda combo: [
    *ALL_PATHS[combo["path"]].capabilities, *(["staged"] if combo["staged"] == "staged" else []),
    *(["mtp"] if combo["model"] == "draft" else [])]))
def test_every_update_lands_in_every_mode(route, loader, combo):
    """The same sequence in every pair of the rule's modes: staged, a draft model beside the main one."""
    rt = route(combo["path"])
    spec = R.with_draft(SPEC, combo)
    session = rt.open(spec, options=R.options(combo))
    for i, (version, weights) in enumerate(SEQUENCE):
        st = M.state(spec, version=weights)
        where = rt.publish(0, st, version)
        if i:
            rt.clear(0)
        rt.update(0)
        check.params_equal(session.observe(), st, f"{combo['path']}: update {i} (version {version}, the weights of "
                           f"version {weights}; {where}; {R.label(combo)})")
