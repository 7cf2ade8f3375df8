"""A candidate expectations file gates the code that wrote it (issue 19): ``--update-expectations``, then
``--expectations`` with that file on the same implementation exits 0, whichever way the race-dependent
cases (FILE-CHANGED-DURING-LOAD: a file changed while the loader reads it) went in either run; the
file holds no path of the run that wrote it.

Implementations that fail the race cases: the FastDeploy stand-in of the parts generation (it reads
through safetensors' mapping: SIGBUS on a truncation, a mix on a rewrite) and the zoo's
``reads_through_mmap``, whose verdicts on the reading cases depend on whether the change lands in
time. Each pair of runs is one subprocess pair; both implementations run at once.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance import expectations as expect
from conformance.spec import rules
from tests import pytest_server

pytestmark = pytest.mark.timeout(900)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = ["FILE-CHANGED-DURING-LOAD", "FILE-DETACHED", "LEVEL-CANDIDATE-NOT-FILE"]
IMPLS = {
    "fastdeploy-parts": ["--impl=fastdeploy", "--impl-opt=source=tests/fd_standins/parts/dynamic_weight_manager.py"],
    "reads_through_mmap": ["--impl=tests.mutants:mutant", "--impl-opt=name=reads_through_mmap"],
}


def _run(impl, *args):
    args = ["conformance", "-p", "no:cacheprovider", "-q", "--tb=native", *IMPLS[impl], *(f"--rule={r}" for r in RULES),
            *args]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    return pytest_server.run(args, REPO, timeout=400, env=env)


def _update_then_gate(impl, directory):
    path = os.path.join(directory, f"{impl}.toml")
    first = _run(impl, f"--update-expectations={path}")
    second = _run(impl, f"--expectations={path}")
    with open(path, encoding="utf-8") as f:
        return first, second, f.read()


def test_a_candidate_file_gates_the_code_that_wrote_it(tmp_path):
    with ThreadPoolExecutor(len(IMPLS)) as pool:
        runs = dict(zip(IMPLS, pool.map(lambda impl: _update_then_gate(impl, str(tmp_path)), IMPLS)))
    for impl, (first, second, text) in runs.items():
        assert first.returncode == 1, f"{impl}: the update run exited {first.returncode}\n{first.stdout[-3000:]}"
        entries = expect.parse(text, f"{impl}.toml", rules())
        race = [e for e in entries if e.selector == "rule" and e.pattern == "FILE-CHANGED-DURING-LOAD"]
        assert race and race[0].kind == "flaky", f"{impl}: the race cases must be one flaky rule entry:\n{text}"
        assert not [e for e in entries if "file_changed_while_loading" in e.pattern and e.selector != "rule"], text
        leaked = re.findall(r"pytest-of-|/tmp/|/dev/shm/", text)
        assert not leaked, f"{impl}: the candidate holds paths of the run that wrote it:\n{text}"
        assert second.returncode == 0, (f"{impl}: gating the same code with its own candidate exited "
                                        f"{second.returncode}\n{text}\n{second.stdout[-3000:]}")
