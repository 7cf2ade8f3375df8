"""mutation/extra.py: the pass over what mutmut does not mutate (module-level constants, decorated functions).

Its mutants are made from today's ``reference/``; every justification in ``mutation/extra_justified.toml`` must
match one of them (an entry for code that changed is stale and fails here, as mutmut's do in
test_mutation_report.py); and each kind of change is made, once per site, into source that compiles.
"""
from __future__ import annotations

import ast
import os
import textwrap

from mutation import extra

SAMPLE = textwrap.dedent('''
    import contextlib
    import re

    LIMIT = 64 * 1024
    TIMEOUT_S = 0.5
    NAME = re.compile(r"^[a-z]+$")
    MESSAGE = "refused"
    KINDS = ("a", "b")
    __version__ = "1.0"


    class Box:
        @property
        def full(self):
            return self.n >= LIMIT and not self.closed

        def plain(self):
            return self.n == 0  # undecorated: mutmut's


    @contextlib.contextmanager
    def held(lock):
        lock.acquire()
        try:
            yield
        finally:
            lock.release()
''')


def _changes(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    made = extra.mutants_of(str(path), "sample")
    for _, source in made:
        compile(source, "sample.py", "exec")
    return {(m.target, m.change) for m, _ in made}


def test_every_kind_of_site_is_mutated_once(tmp_path):
    changes = _changes(tmp_path)
    targets = {t for t, _ in changes}
    assert targets == {"LIMIT", "TIMEOUT_S", "NAME", "MESSAGE", "KINDS", "Box.full", "held"}, targets
    want = {
        ("LIMIT", "-LIMIT = 64 * 1024\n+LIMIT = 64 * 1024 + 1"),
        ("TIMEOUT_S", "-TIMEOUT_S = 0.5\n+TIMEOUT_S = 1.0"),
        ("TIMEOUT_S", "-TIMEOUT_S = 0.5\n+TIMEOUT_S = 0.25"),
        ("NAME", "-NAME = re.compile('^[a-z]+$')\n+NAME = re.compile('XX^[a-z]+$XX')"),
        ("MESSAGE", "-MESSAGE = 'refused'\n+MESSAGE = ''"),
        ("KINDS", "-KINDS = ('a', 'b')\n+KINDS = ('b',)"),
        ("Box.full", "-return self.n >= LIMIT and (not self.closed)\n+return self.n > LIMIT and (not self.closed)"),
        ("Box.full", "-return self.n >= LIMIT and (not self.closed)\n+return self.n >= LIMIT or not self.closed"),
        ("Box.full", "-return self.n >= LIMIT and (not self.closed)\n+return self.n >= LIMIT and self.closed"),
        ("Box.full", "-return self.n >= LIMIT and (not self.closed)\n+return None"),
        ("held", "-lock.acquire()\n+pass"),
        ("held", "-lock.release()\n+pass"),
    }
    assert want <= changes, sorted(want - changes)
    assert not any(t == "__version__" for t in targets)
    assert not any("plain" in t for t in targets), "an undecorated function is mutmut's"


def test_the_command_line_lists_and_checks():
    """``python -m mutation.extra --list`` prints one line per mutant of today's code, and ``--check`` passes (exit 0,
    no stale entry), as docs/mutation.md shows them."""
    import subprocess
    import sys

    listed = subprocess.run([sys.executable, "-m", "mutation.extra", "--list"], cwd=extra.REPO, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    names = [line.split("\t", 1)[0] for line in listed.stdout.splitlines()]
    assert names == [m.name for m, _, _ in extra.generate()] and len(names) > 100, listed.stdout[-2000:]
    checked = subprocess.run([sys.executable, "-m", "mutation.extra", "--check"], cwd=extra.REPO, capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 0 and "stale:" not in checked.stdout, checked.stdout + checked.stderr


def test_the_justifications_match_todays_mutants():
    entries = extra.load_justified()
    gone = extra.stale(entries, [m for m, _, _ in extra.generate()])
    assert not gone, "stale entries in mutation/extra_justified.toml (their code changed): " + "; ".join(
        f"{e['target']}: {e['change'].strip()!r}" for e in gone)


def test_every_mutant_of_the_reference_compiles_and_changes_its_module():
    made = extra.generate()
    assert len(made) > 100
    originals: dict[str, str] = {}
    for mutant, rel, source in made:
        if rel not in originals:
            originals[rel] = ast.unparse(ast.parse(open(f"{extra.REPO}/{rel}", encoding="utf-8").read()))
        assert source != originals[rel], mutant.name
        compile(source, rel, "exec")


def test_a_run_on_xdist_workers_is_read_as_pytest_ended_it(tmp_path):
    """``--workers``: pytest-xdist ends a ``-x`` run whose test failed with exit 2 (an interruption), which is a kill;
    a run that passes is a survivor, and one that collects nothing a test can run is an error, as serially."""
    import subprocess
    import sys

    (tmp_path / "test_one.py").write_text("import os\n\ndef test_it():\n    assert os.environ['MUTANT'] == 'none'\n")

    def judged(mutant, target="test_one.py"):
        proc = subprocess.run([sys.executable, "-m", "pytest", target, "-q", "-x", "-n", "2", "-p", "no:cacheprovider"],
                              cwd=tmp_path, env={**os.environ, "MUTANT": mutant}, capture_output=True, text=True,
                              timeout=120)
        return extra.outcome(proc.returncode, proc.stdout), proc.returncode

    assert judged("none") == ("survived", 0)
    assert judged("constant") == ("killed", 2)
    (tmp_path / "test_broken.py").write_text("import no_such_module\n")
    status, code = judged("none", "test_broken.py")
    assert status == f"error (exit {code})" and code not in (0, 1), (status, code)


def test_a_justification_is_written_for_a_mutant_of_todays_code_only(tmp_path):
    """``--justify``: each line names a mutant of today's code by its ``--list`` name; its entry matches that mutant
    (and no other), a second time adds nothing, and an unknown name or kind is refused without writing."""
    mutants = [m for m, _, _ in extra.generate()]
    first, other = mutants[0], next(m for m in mutants if m.key != mutants[0].key)
    lines, path = tmp_path / "lines.txt", str(tmp_path / "justified.toml")
    lines.write_text(f"{first.name}\tequivalent\tthe reason\n")
    assert extra.justify(str(lines), path) == 0
    assert extra.justify(str(lines), path) == 0  # already there: nothing added
    entries = extra.load_justified(path)
    assert len(entries) == 1 and extra.justification(entries, first) == entries[0], entries
    assert extra.justification(entries, other) is None
    before = open(path).read()
    lines.write_text(f"{first.name}\tequivalent\tok\nreference.nowhere:X:1\tequivalent\tno such mutant\n"
                     f"{other.name}\tharmless\ta kind that is not one\n")
    assert extra.justify(str(lines), path) == 2
    assert open(path).read() == before, "a refused file wrote entries"
