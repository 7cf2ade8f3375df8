"""A pytest plugin for ``--collect-only`` runs (tests/test_xdist_units.py): writes, per collected test module, the
fixtures of a scope wider than one case and narrower than the session (class, module, package) that its cases use,
as JSON to the file named by ``PROBE_OUT``."""
from __future__ import annotations

import json
import os

SHARED = ("class", "module", "package")


def pytest_collection_finish(session):
    used: dict[str, set] = {}
    for item in session.items:
        module = os.path.basename(str(item.path))
        shared = used.setdefault(module, set())
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            if defs and defs[-1].scope in SHARED:
                shared.add(name)
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({module: sorted(names) for module, names in used.items()}, f)
