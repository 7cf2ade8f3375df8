"""A pytest plugin for ``--collect-only`` runs (tests/test_modes_coverage.py): writes, per rule that declares its
modes in SPEC.md, the modes of every collected case (``conformance.modes.item_modes``) and its tier markers as JSON to the file named by
``PROBE_OUT``."""
from __future__ import annotations

import json
import os


def pytest_collection_finish(session):
    from conformance import modes
    from conformance.plugin import TIERS

    declared = {rule for rule, decl in modes.declarations().items() if decl is not None}
    cases: dict[str, list] = {rule: [] for rule in declared}
    for item in session.items:
        for mark in item.iter_markers("rule"):
            if mark.args and mark.args[0] in declared:
                cases[mark.args[0]].append({"nodeid": item.nodeid, "modes": modes.item_modes(item),
                                            "tiers": [t for t in TIERS if item.get_closest_marker(t) is not None]})
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(cases, f)
