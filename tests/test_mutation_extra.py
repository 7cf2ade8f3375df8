"""mutation/extra.py: the pass over what mutmut does not mutate (module-level constants, decorated functions).

Its mutants are made from today's ``reference/``; every justification in ``mutation/extra_justified.toml`` must
match one of them (an entry for code that changed is stale and fails here, as mutmut's do in
test_mutation_report.py); and each kind of change is made, once per site, into source that compiles.
"""
from __future__ import annotations

import ast
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
