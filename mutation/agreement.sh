#!/usr/bin/env bash
# Mutation testing of reference/agreement.py with tests/test_agreement.py (a real two-rank gloo group in
# forked processes). The conformance suite drives the agreement only on one rank in the quick run (its
# collectives run in the multirank tier, one job per session), so the project's [tool.mutmut] table, which
# runs `pytest conformance --impl=reference`, cannot reach them; this runs in a scratch copy with its own
# table (mutation/scratch.py), as mutation/gate.sh does.
#   mutation/agreement.sh [SCRATCH_DIR]     (default /tmp/mutagreement; needs mutmut in the active venv)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python "$repo/mutation/scratch.py" "${1:-/tmp/mutagreement}" \
    --source reference/agreement.py --tests tests/test_agreement.py --max-children 2
