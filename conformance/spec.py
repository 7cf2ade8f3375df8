"""Rule ids come from SPEC.md: a rule is a level-3 heading ``### `AREA-...` title``."""
from __future__ import annotations

import functools
import os
import re

SPEC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "SPEC.md")
RULE_HEADING = re.compile(r"^###\s+`([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+)`\s+(.*)$")


@functools.lru_cache(maxsize=None)
def rules(path: str = SPEC_PATH) -> dict[str, str]:
    """rule id -> title, in document order; duplicate ids are an error."""
    found: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = RULE_HEADING.match(line.rstrip())
            if m:
                if m.group(1) in found:
                    raise ValueError(f"{path}: rule {m.group(1)} is defined twice")
                found[m.group(1)] = m.group(2)
    return found


def area(rule_id: str) -> str:
    return rule_id.split("-", 1)[0]
