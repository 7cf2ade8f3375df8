#!/usr/bin/env bash
# Mutation testing of the CI-gate code (conformance/expectations.py, conformance/report.py,
# conformance/matrix.py) with its in-process tests (tests/test_gate_units.py, tests/test_matrix.py). mutmut 3 reads one [tool.mutmut] table, and the
# project's own mutates reference/, so this runs in a scratch copy with its own table.
#   mutation/gate.sh [SCRATCH_DIR]     (default /tmp/mutgate; needs mutmut in the active venv)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
scratch="${1:-/tmp/mutgate}"
rm -rf "$scratch" && mkdir -p "$scratch"
git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 tar -c) | tar -x -C "$scratch"
cd "$scratch"
python - <<'PY'
import re
text = open("pyproject.toml").read()
start = text.index("[tool.mutmut]")
end = text.find("\n[", start + 1)
table = '''[tool.mutmut]
source_paths = ["conformance/expectations.py", "conformance/report.py", "conformance/matrix.py"]
also_copy = ["conformance/", "reference/", "fixtures/", "sim/", "wire/", "tests/", "conftest.py", "SPEC.md"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-k", "not real_browser"]
pytest_add_cli_args_test_selection = ["tests/test_gate_units.py", "tests/test_matrix.py"]
'''
open("pyproject.toml", "w").write(text[:start] + table + (text[end:] if end != -1 else ""))
PY
mutmut run >/dev/null 2>&1 || true
mutmut results | grep -v ": killed" || true
echo "killed: $(mutmut results --all true 2>/dev/null | grep -c ': killed' || true)"
