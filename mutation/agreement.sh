#!/usr/bin/env bash
# Mutation testing of reference/agreement.py with tests/test_agreement.py (a real two-rank gloo group in
# forked processes). The conformance suite drives the agreement only on one rank in the quick run (its
# collectives run in the multirank tier, one job per session), so the project's [tool.mutmut] table, which
# runs `pytest conformance --impl=reference`, cannot reach them; this runs in a scratch copy with its own
# table, as mutation/gate.sh does.
#   mutation/agreement.sh [SCRATCH_DIR]     (default /tmp/mutagreement; needs mutmut in the active venv)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
scratch="${1:-/tmp/mutagreement}"
rm -rf "$scratch" && mkdir -p "$scratch"
git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 tar -c) | tar -x -C "$scratch"
cd "$scratch"
python - <<'PY'
text = open("pyproject.toml").read()
start = text.index("[tool.mutmut]")
end = text.find("\n[", start + 1)
table = '''[tool.mutmut]
source_paths = ["reference/agreement.py"]
also_copy = ["conformance/", "fixtures/", "sim/", "wire/", "tests/", "conftest.py", "SPEC.md"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]
pytest_add_cli_args_test_selection = ["tests/test_agreement.py"]
'''
open("pyproject.toml", "w").write(text[:start] + table + (text[end:] if end != -1 else ""))
PY
mutmut run --max-children 2 >/dev/null 2>&1 || true
mutmut results | grep -v ": killed" || true
echo "killed: $(mutmut results --all true 2>/dev/null | grep -c ': killed' || true)"
echo "total: $(mutmut results --all true 2>/dev/null | grep -c ': ' || true)"
