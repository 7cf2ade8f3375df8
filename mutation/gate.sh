#!/usr/bin/env bash
# Mutation testing of the CI-gate code (conformance/expectations.py, conformance/report.py,
# conformance/matrix.py) with its in-process tests (tests/test_gate_units.py, tests/test_matrix.py), in a
# scratch copy with its own [tool.mutmut] table (mutation/scratch.py).
#   mutation/gate.sh [SCRATCH_DIR]     (default /tmp/mutgate; needs mutmut in the active venv)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python "$repo/mutation/scratch.py" "${1:-/tmp/mutgate}" \
    --source conformance/expectations.py conformance/report.py conformance/matrix.py \
    --tests tests/test_gate_units.py tests/test_matrix.py \
    --also weightsync/ conformance/ reference/ fixtures/ sim/ wire/ tests/ conftest.py SPEC.md \
    --pytest-arg=-k --pytest-arg="not real_browser"
