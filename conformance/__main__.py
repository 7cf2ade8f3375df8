"""``weightsync-conformance --impl=NAME [pytest options]`` (or ``python -m conformance ...``): the installed suite,
as ``python -m pytest --pyargs conformance --impl=NAME ...`` runs it, from any directory (docs/adapters.md,
"Running from your own repository"). Exit status: pytest's, as the conformance plugin sets it."""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    import pytest

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m pytest` has it: an --impl module:attr in this directory
    return int(pytest.main(["--pyargs", "conformance", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
