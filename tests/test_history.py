"""conformance.history on a small git repository built here: the FastDeploy stand-ins as the commits of one
dynamic_weight_manager.py, a bug reintroduced and reverted, a version the adapter cannot drive.

Suite runs are real (``pytest conformance --impl=fastdeploy``) but narrowed to one test of PART-ORDER-NUMERIC,
and they share one cache in a fixed order so that each distinct content runs once in the whole file:
the bisection runs 3 of the 4 distinct contents, an interrupted full run is stopped during the 4th, and
its resumption runs it. Everything after reads the cache.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser

import psutil
import pytest

from conformance.history import cli, runs, verdicts
from conformance.history.versions import HistoryError, Version, from_folder, from_git
from tests.conftest import REPO, sigint_at_default
from tests.processes import ended
from tests.test_matrix import Dom

STANDINS = os.path.join(REPO, "tests", "fd_standins")
FILE = "fastdeploy/rl/dynamic_weight_manager.py"
RULE = "PART-ORDER-NUMERIC"
# One test of the rule: parts 2 and 10, judged by the load trace (about a second once the suite is up).
NARROW = ["--rule", RULE, "-k", "2-before-10 and trace"]
NUMERIC_SORT = "parts.sort(key=lambda entry: entry[0])"
LEXICAL_SORT = "parts.sort(key=lambda entry: str(entry[0]))"  # the bug: part 10 before part 2
PARTS_INIT = "def __init__(self, fd_config: FDConfig, models, local_rank: int):"
UNKNOWN_PARAMETER = "def __init__(self, fd_config: FDConfig, models, local_rank: int, engine_queue):"


def standin(generation: str) -> str:
    with open(os.path.join(STANDINS, generation, "dynamic_weight_manager.py"), encoding="utf-8") as f:
        return f.read()


def replaced(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the stand-in no longer has {old!r} exactly once"
    return text.replace(old, new)


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(repo, *args, env=None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV, **(env or {})}).stdout.strip()


def commit(repo, title: str, day: int, files: dict[str, str]) -> str:
    """Commit ``files`` (name -> text) on day ``day`` of January 2026; the short sha."""
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        git(repo, "add", name)
    stamp = f"2026-01-{day:02d}T12:00:00+00:00"
    git(repo, "commit", "-q", "-m", title, env={"GIT_AUTHOR_DATE": stamp, "GIT_COMMITTER_DATE": stamp})
    return git(repo, "rev-parse", "--short", "HEAD")


# label -> (title, content); in commit order. "docs" touches another file only: not a version.
PARTS = standin("parts")
HISTORY = [
    ("dwm0", "DWM-0: the first generation", standin("dwm0")),
    ("parts", "Support chunked part files", PARTS),
    ("docs", "Document the snapshot levels", None),
    ("wip", "WIP: take the engine queue", replaced(PARTS, PARTS_INIT, UNKNOWN_PARAMETER)),
    ("bug", "Sort part files by name", replaced(PARTS, NUMERIC_SORT, LEXICAL_SORT)),
    ("revert", "Revert: sort part files by number", PARTS),
]
VERSIONS = [label for label, _, text in HISTORY if text is not None]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A git repository whose history of FILE is HISTORY (one commit each, a day apart), and an output
    folder whose cache every run of this module shares. ``sha`` maps a label to its short commit id."""
    root = tmp_path_factory.mktemp("history")
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    sha = {}
    for day, (label, title, text) in enumerate(HISTORY, start=1):
        files = {FILE: text} if text is not None else {"README.md": "snapshot levels: parts, single, legacy\n"}
        sha[label] = commit(repo, title, day, files)
    return {"root": root, "repo": repo, "out": root / "out", "sha": sha}


def tool(work, *args, out=None, timeout=300) -> subprocess.CompletedProcess:
    """python -m conformance.history on the repository (unless args give --versions), non-interactive."""
    source = [] if "--versions" in args else ["--repo", str(work["repo"]), "--path", FILE]
    command = [sys.executable, "-m", "conformance.history", *source, "-o", str(out or work["out"]),
               "--cache", str(work["out"] / ".history-cache"), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def cache_entries(work) -> dict[str, dict]:
    """The cache's result entries (not their .meta.json sidecars)."""
    folder = work["out"] / ".history-cache" / "results"
    return {p.name: json.loads(p.read_text()) for p in folder.iterdir()
            if not p.name.endswith(".meta.json")} if folder.exists() else {}


@pytest.fixture(scope="module")
def bisected(work):
    """The first run of the module: --bisect on a cold cache."""
    proc = tool(work, "--bisect", RULE, "-k", "2-before-10 and trace", "--jobs", "2")
    return proc, json.loads((work["out"] / "bisect.json").read_text())


@pytest.fixture(scope="module")
def interrupted(work, bisected):
    """A full run (2 of its 5 contents not cached) sent SIGINT once its first suite run is under way: the
    tool's exit status and output, the processes under it at that moment, the cache before and after."""
    before = cache_entries(work)
    command = [sys.executable, "-m", "conformance.history", "--repo", str(work["repo"]), "--path", FILE,
               "-o", str(work["out"]), "--cache", str(work["out"] / ".history-cache"), "--jobs", "1", *NARROW]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_at_default)
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    tree = []
    while time.monotonic() < deadline and proc.poll() is None:
        tree = [p for p in parent.children(recursive=True) if "pytest" in " ".join(_cmdline(p))]
        if tree:
            break
        time.sleep(0.1)
    assert tree, f"no suite run started within 120 s: {proc.poll()}"
    time.sleep(1.0)  # into the run (Paddle importing), well before it can finish
    tree = parent.children(recursive=True)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    return {"rc": proc.returncode, "stdout": stdout, "stderr": stderr, "tree": tree, "before": before,
            "after": cache_entries(work), "files": [n for n in os.listdir(work["out"] / ".history-cache" / "results")
                                                    if not n.endswith(".meta.json")],
            "scratch": os.listdir(work["out"] / ".history-cache" / "work")}


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(scope="module")
def history(work, interrupted):
    """The same full run again, to the end (resuming the interrupted one), and what it wrote."""
    proc = tool(work, "--jobs", "2", *NARROW)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((work["out"] / "history.json").read_text())
    return {"proc": proc, "data": data, "html": (work["out"] / "history.html").read_text(encoding="utf-8")}


# --- bisect -----------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_bisect_names_the_first_change_and_runs_fewer_suites_than_versions(work, bisected):
    proc, found = bisected
    assert proc.returncode == 0, proc.stdout + proc.stderr
    at = work["sha"]["parts"]
    assert found["change"]["id"] == at and found["change"]["title"] == "Support chunked part files", found
    assert (found["change"]["from"], found["change"]["to"]) == ("not_applicable", "passed"), found
    assert found["change"]["previous"]["id"] == work["sha"]["dwm0"], found
    assert f"first change of {RULE}: not_applicable -> passed" in proc.stdout, proc.stdout
    assert re.search(rf"at +{at}.*2026-01-02.*Support chunked part files", proc.stdout), proc.stdout
    assert re.search(rf"before +{work['sha']['dwm0']}.*DWM-0: the first generation", proc.stdout), proc.stdout
    # 5 versions; the last has the content of "parts" (a revert), so probing "parts" is a cache hit.
    assert found["versions"] == len(VERSIONS) == 5
    assert found["runs"]["executed"] == 3 < found["versions"], found["runs"]
    assert [p["id"] for p in found["probed"]] == [work["sha"][k] for k in ("dwm0", "revert", "wip", "parts")]
    assert [p["verdict"] for p in found["probed"]] == ["not_applicable", "passed", "usage_error", "passed"]
    assert len(cache_entries(work)) == 3, "one cache entry per content run"


# --- interrupt, resume, cache ---------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_an_interrupted_run_ends_its_suite_runs_and_leaves_the_cache_whole(interrupted):
    assert interrupted["rc"] == 130, interrupted["stderr"]
    assert "interrupted" in interrupted["stderr"] and "resumes" in interrupted["stderr"], interrupted["stderr"]
    assert "Traceback" not in interrupted["stderr"], interrupted["stderr"]
    alive = [p.pid for p in interrupted["tree"] if not ended(p)]
    assert not alive, f"processes of the interrupted run still alive: {alive}"
    assert interrupted["after"] == interrupted["before"], "an interrupted suite run left a cache entry"
    assert sorted(interrupted["files"]) == sorted(interrupted["before"]), "a temporary file was left in the cache"
    assert interrupted["scratch"] == [], "the ended run's scratch folder was left behind"
    for name, entry in interrupted["after"].items():
        assert name == f"{entry['key']}.json" and entry["outcome"] in runs.CACHED_OUTCOMES, name


@pytest.mark.timeout(300)
def test_the_interrupted_run_resumes_running_only_what_is_missing(history):
    runs_ = history["data"]["runs"]
    assert runs_ == {"versions": 5, "distinct": 4, "executed": 1, "cached": 3}, runs_
    assert "5 version(s), 4 distinct content(s)" in history["proc"].stdout
    assert "1 suite run(s), 3 from the cache" in history["proc"].stdout, history["proc"].stdout
    # Plain progress lines off a terminal: one per distinct content.
    assert len(re.findall(r"^\[\d/4\] ", history["proc"].stderr, re.M)) == 4, history["proc"].stderr


@pytest.mark.timeout(300)
def test_a_second_run_reads_everything_from_the_cache(work, history):
    proc = tool(work, *NARROW)
    assert proc.returncode == 0, proc.stderr
    assert "0 suite run(s), 4 from the cache" in proc.stdout, proc.stdout
    assert json.loads((work["out"] / "history.json").read_text())["changes"] == history["data"]["changes"]


# --- what a full run writes -----------------------------------------------------------------------

def test_one_suite_report_per_version_in_commit_order(work, history):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(open(runs.ROOT + "/conformance/report.schema.json").read())
    described = history["data"]["versions"]
    assert [v["id"] for v in described] == [work["sha"][k] for k in VERSIONS]
    assert [v["title"] for v in described] == [t for _, t, text in HISTORY if text is not None]
    assert [v["date"][:10] for v in described] == ["2026-01-01", "2026-01-02", "2026-01-04", "2026-01-05",
                                                   "2026-01-06"]
    for v in described:
        if v["outcome"] != "report":
            continue
        report = json.loads((work["out"] / v["report"]).read_text())
        jsonschema.validate(report, schema)
        # The adapter names the file it ran by its sha256: the report is this version's.
        assert f"sha256 {v['sha256'][:12]}" in report["run_info"]["implementation_version"], v["id"]
        assert [r["id"] for r in report["rules"]] == [RULE], v["id"]
    assert described[-1]["report"] != described[1]["report"], "one file per version, even for equal contents"


def test_a_version_the_adapter_cannot_drive_is_recorded_with_its_reason(work, history):
    wip = history["data"]["versions"][VERSIONS.index("wip")]
    assert wip["outcome"] == "usage_error" and wip["exit_status"] == 4 and wip["report"] is None, wip
    assert "cannot supply ['engine_queue']" in wip["message"], wip["message"]
    assert f"{work['sha']['wip']}: usage error: --impl=fastdeploy" in history["proc"].stdout


def test_each_verdict_change_is_at_its_commit_with_its_title(work, history):
    data = history["data"]
    assert [r["id"] for r in data["rules"]] == [RULE]
    assert data["rules"][0]["verdicts"] == ["not_applicable", "passed", None, "failed", "passed"]
    s = work["sha"]
    got = [(c["rule"], c["id"], c["title"], c["from"], c["to"], c["previous"]) for c in data["changes"]]
    assert got == [
        (RULE, s["parts"], "Support chunked part files", "not_applicable", "passed", s["dwm0"]),
        (RULE, s["bug"], "Sort part files by name", "passed", "failed", s["parts"]),  # across the usage error
        (RULE, s["revert"], "Revert: sort part files by number", "failed", "passed", s["bug"]),
    ]
    assert f"{RULE}: passed -> failed at {s['bug']} (2026-01-05T12:00:00+00:00) Sort part files by name" \
        in history["proc"].stdout


class Cells(HTMLParser):
    """Every header and data cell with a data-col: its attributes and its text."""

    def __init__(self, text):
        super().__init__()
        self.cells, self.heads, self._open = {}, {}, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "td" and "data-rule" in a:
            self._open = self.cells.setdefault((a["data-rule"], int(a["data-col"])), {**a, "text": ""})
        elif tag == "th" and "data-col" in a and "impl" in a.get("class", ""):
            self._open = self.heads.setdefault(int(a["data-col"]), {**a, "text": ""})

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._open = None

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data


def test_the_page_has_versions_as_columns_and_marks_each_change(work, history):
    page = Cells(history["html"])
    s = work["sha"]
    assert [page.heads[j]["text"].split("2026")[0] for j in range(5)] == [s[k] for k in VERSIONS]
    classes = [page.cells[(RULE, j)]["class"].split() for j in range(5)]
    assert [c[1] for c in classes] == ["not-applicable", "passed", "norun", "failed-contract", "passed"]
    changed = [j for j in range(5) if "change" in classes[j]]
    assert changed == [1, 3, 4], classes
    bug = page.cells[(RULE, 3)]
    assert f"changed at {s['bug']}: Sort part files by name" in bug["text"], bug["text"]
    assert "passed → failed" in bug["title"] and s["parts"] in bug["title"], bug["title"]
    assert page.cells[(RULE, 2)]["text"] == "usage error"
    assert "cannot supply" in page.heads[2]["title"], page.heads[2]["title"]
    assert "<script" not in history["html"] and "src=" not in history["html"]
    dom = Dom(history["html"])  # well formed, as conformance.matrix's page
    assert dom.stray == [] and dom.unbalanced == [] and dom.unclosed == [], (dom.stray, dom.unbalanced, dom.unclosed)
    assert [d.lower() for d in dom.decls] == ["doctype html"]
    listed = [(r.attrs["data-rule"], int(r.attrs["data-col"])) for r in dom.one("table", "changes").all("tr")
              if "data-rule" in r.attrs]
    assert listed == [(RULE, 1), (RULE, 3), (RULE, 4)], "the changes above the table, in commit order"


# --- the same history from other inputs, from the cache -------------------------------------------

def test_bisect_from_to_within_a_rev_range(work, history):
    s = work["sha"]
    proc = tool(work, "--bisect", RULE, "--from", "passed", "--to", "failed", "--rev-range",
                f"{s['dwm0']}..{s['bug']}", "-k", "2-before-10 and trace")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first change of PART-ORDER-NUMERIC: usage_error -> failed" in proc.stdout, proc.stdout
    assert re.search(rf"at +{s['bug']}.*Sort part files by name", proc.stdout), proc.stdout
    assert "not passed" in proc.stdout, "the version before the change could not be run: said so"
    assert "0 suite run(s)" in proc.stdout, proc.stdout


def test_a_folder_of_versions_in_manifest_order(work, history, tmp_path):
    folder = tmp_path / "copies"
    folder.mkdir()
    texts = {label: text for label, _, text in HISTORY if text is not None}
    for label in ("dwm0", "bug", "parts"):
        (folder / f"{label}.py").write_text(texts[label], encoding="utf-8")
    manifest = tmp_path / "order.json"
    manifest.write_text(json.dumps(["dwm0.py", {"file": "parts.py", "title": "numeric", "date": "2026-02-01"},
                                    {"file": "bug.py", "id": "v3", "title": "by name"}]))
    proc = tool(work, "--versions", str(folder), "--manifest", str(manifest), *NARROW, out=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "0 suite run(s), 3 from the cache" in proc.stdout, proc.stdout
    data = json.loads((tmp_path / "out" / "history.json").read_text())
    assert [(v["id"], v["title"]) for v in data["versions"]] == [("dwm0.py", "dwm0.py"), ("parts.py", "numeric"),
                                                                 ("v3", "by name")]
    assert [(c["id"], c["from"], c["to"]) for c in data["changes"]] == [
        ("parts.py", "not_applicable", "passed"), ("v3", "passed", "failed")]


# --- errors (no suite run) ------------------------------------------------------------------------

def run_main(argv, capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case, argv, message", [
    ("unknown rule", ["--bisect", "PART-ORDER"], "--bisect 'PART-ORDER': no such rule id in SPEC.md"),
    ("an area", ["--bisect", "PART"], "(an area? its rules: PART-ORDER-NUMERIC"),
    ("rule left out", ["--bisect", RULE, "--rule", "LEVEL"], "the --rule selection (LEVEL) leaves it out"),
    ("unknown --rule", ["--rule", "PART-ORDR"], "--rule 'PART-ORDR' matches no rule in SPEC.md"),
    ("path never there", ["--path-override", "fastdeploy/rl/other.py"],
     "fastdeploy/rl/other.py: never in the history of"),
    ("--from alone", ["--from", "passed"], "--from and --to go with --bisect RULE"),
])
def test_clear_errors(work, tmp_path, capsys, case, argv, message):
    path = FILE
    if argv[0] == "--path-override":
        path, argv = argv[1], argv[2:]
    rc, err = run_main(["--repo", str(work["repo"]), "--path", path, "-o", str(tmp_path), *argv], capsys)
    assert rc == 2 and message in err, (rc, err)
    assert not (tmp_path / ".history-cache" / "results").exists() or not os.listdir(
        tmp_path / ".history-cache" / "results"), "an error before any run ran nothing"


def test_not_a_git_repository_and_no_versions_are_clear_errors(tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    rc, err = run_main(["--repo", str(plain), "--path", FILE, "-o", str(tmp_path / "o")], capsys)
    assert rc == 2 and f"{plain}: not a git repository" in err, err
    rc, err = run_main(["--versions", str(plain), "-o", str(tmp_path / "o")], capsys)
    assert rc == 2 and f"{plain}: no versions (the folder has no files)" in err, err
    rc, err = run_main(["--versions", str(tmp_path / "absent"), "-o", str(tmp_path / "o")], capsys)
    assert rc == 2 and "absent: no such directory" in err, err
    rc, err = run_main(["-o", str(tmp_path / "o")], capsys)
    assert rc == 2 and "either --repo PATH --path FILE, or --versions DIR" in err, err


def test_bad_manifests_name_the_manifest_and_entry(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    for data, message in ([{"title": "no file"}], "entry 0 is neither a file name nor an object"), \
                         ({"a.py": 1}, "a JSON list"), (["a.py", "b.py"], "b.py: cannot read this version"), \
                         ([{"file": "a.py", "date": 5}], 'entry 0 (a.py): "date" is not a string'):
        manifest = tmp_path / "m.json"
        manifest.write_text(json.dumps(data))
        with pytest.raises(HistoryError, match=re.escape(message)):
            from_folder(str(tmp_path), str(manifest))


def test_folder_order_is_natural_and_hidden_files_are_left_out(tmp_path):
    for name in ("v10.py", "v2.py", "v1.py", ".hidden.py"):
        (tmp_path / name).write_text(name)
    (tmp_path / "sub").mkdir()
    assert [v.id for v in from_folder(str(tmp_path))] == ["v1.py", "v2.py", "v10.py"]


def test_renames_are_followed_and_deletions_are_not_versions(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    first = commit(repo, "old name", 1, {"old/dwm.py": "one\n"})
    (repo / "new").mkdir()
    git(repo, "mv", "old/dwm.py", "new/dwm.py")
    second = commit(repo, "rename", 2, {"new/dwm.py": "one\n"})
    third = commit(repo, "edit", 3, {"new/dwm.py": "two\n"})
    git(repo, "rm", "-q", "new/dwm.py")
    commit(repo, "delete", 4, {"sub/other.txt": "x\n"})
    found = from_git(str(repo / "sub"), "new/dwm.py", rev_range=None)  # a folder inside the repository works
    assert [(v.id, v.path, v.content) for v in found] == [
        (first, "old/dwm.py", b"one\n"), (second, "new/dwm.py", b"one\n"), (third, "new/dwm.py", b"two\n")]


def test_first_parent_by_default_every_branch_with_all_and_a_rev_range(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    one = commit(repo, "one", 1, {"f.py": "1\n"})
    git(repo, "checkout", "-q", "-b", "side")
    side = commit(repo, "on a side branch", 2, {"f.py": "side\n"})
    git(repo, "checkout", "-q", "main")
    two = commit(repo, "two", 3, {"f.py": "2\n"})
    three = commit(repo, "three", 4, {"f.py": "3\n"})
    assert [v.id for v in from_git(str(repo), "f.py")] == [one, two, three]
    everything = [v.id for v in from_git(str(repo), "f.py", all_branches=True)]
    assert sorted(everything) == sorted([one, side, two, three]) and everything[0] == one, everything
    assert everything.index(two) < everything.index(three), "topological: a parent before its child"
    assert [v.id for v in from_git(str(repo), "f.py", rev_range=f"{one}..{three}")] == [two, three]
    with pytest.raises(HistoryError, match="--all and --rev-range exclude each other"):
        from_git(str(repo), "f.py", rev_range="HEAD", all_branches=True)
    with pytest.raises(HistoryError, match="bad revision 'nosuch..HEAD'"):
        from_git(str(repo), "f.py", rev_range="nosuch..HEAD")


def test_arguments_pytest_refuses_end_the_run():
    refused = runs.Result("k", "s", "usage_error", 4, "pytest: error: unrecognized arguments: --jbos", 1.0, None)
    with pytest.raises(HistoryError, match="pytest refused the arguments passed to it: .*--jbos"):
        cli.abort_on_bad_arguments(refused)
    cli.abort_on_bad_arguments(runs.Result("k", "s", "usage_error", 4, "cannot supply ['x']", 1.0, None))


# --- units ----------------------------------------------------------------------------------------

def fake_versions(n: int) -> list[Version]:
    return [Version(i, f"c{i}", "", f"commit {i}", "f.py", None, b"%d" % i) for i in range(n)]


@pytest.mark.parametrize("n, first_changed", [(2, 1), (9, 1), (9, 5), (9, 8), (16, 11)])
def test_bisect_finds_the_first_change_in_log_probes(n, first_changed):
    asked = []

    def verdict_at(i):
        asked.append(i)
        return "failed" if i >= first_changed else "passed"

    found = verdicts.bisect(fake_versions(n), RULE, verdict_at)
    assert (found.found, found.index, found.before, found.old, found.new) == (
        True, first_changed, first_changed - 1, "passed", "failed"), found
    assert len(asked) == len(set(asked)) <= 2 + (n - 1).bit_length(), asked


def test_bisect_says_when_there_is_nothing_to_find():
    versions = fake_versions(5)
    same = verdicts.bisect(versions, RULE, lambda i: "passed")
    assert not same.found and "passed at the first and passed at the last" in same.message
    wrong_start = verdicts.bisect(versions, RULE, lambda i: "failed", want_from="passed")
    assert not wrong_start.found and "has PART-ORDER-NUMERIC failed, not passed" in wrong_start.message
    already = verdicts.bisect(versions, RULE, lambda i: "failed", want_to="failed")
    assert not already.found and "already has verdict failed" in already.message


def test_the_suite_hash_follows_the_suite_code_and_options_but_not_this_tool(tmp_path, monkeypatch):
    for name in ("conformance/plugin.py", "conformance/history/cli.py", "fixtures/a.py", "SPEC.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("v1\n")
    monkeypatch.setattr(runs, "ROOT", str(tmp_path))
    base = runs.Suite().fingerprint()
    assert runs.Suite().fingerprint() == base
    assert runs.Suite(extra=("--rule", "PART")).fingerprint() != base
    assert runs.Suite(impl="other").fingerprint() != base
    (tmp_path / "conformance/history/cli.py").write_text("v2\n")
    assert runs.Suite().fingerprint() == base, "the history tool is not the suite"
    (tmp_path / "SPEC.md").write_text("v2\n")
    changed = runs.Suite().fingerprint()
    assert changed != base
    (tmp_path / "conformance/plugin.py").write_text("v2\n")
    assert runs.Suite().fingerprint() != changed
    (tmp_path / "exp.toml").write_text("a\n")
    with_file = runs.Suite(extra=("--expectations", "exp.toml")).fingerprint()
    (tmp_path / "exp.toml").write_text("b\n")
    assert runs.Suite(extra=("--expectations", "exp.toml")).fingerprint() != with_file, "a named file's content"


def test_a_usage_error_message_is_pytests_error_lines():
    output = "some header\nERROR: --impl=fastdeploy: cannot supply ['x']\n  more detail\n\nafter\n"
    assert runs.usage_message(output) == "--impl=fastdeploy: cannot supply ['x']\nmore detail"
    assert runs.usage_message("just\nnoise\n") == "just\nnoise"


def test_cache_entries_are_whole_or_absent(tmp_path):
    cache = runs.Cache(str(tmp_path), "suite")
    result = runs.Result(cache.key("abc"), "abc", "report", 0, "", 1.0, {"rules": []})
    cache.put(result)
    assert cache.get("abc").report == {"rules": []} and cache.get("abc").cached
    crashed = runs.Result(cache.key("def"), "def", "crashed", -9, "killed", 1.0, None)
    cache.put(crashed)
    assert cache.get("def") is None, "a crash may be the machine's: not cached"
    (tmp_path / "results" / f"{cache.key('ghi')}.json").write_text('{"key": "tru')
    assert cache.get("ghi") is None, "an unreadable entry is run again"
    (tmp_path / "results" / ".tmp-x.part").write_text("partial")
    runs.Cache(str(tmp_path), "suite")
    assert ".tmp-x.part" not in os.listdir(tmp_path / "results")
    assert runs.Cache(str(tmp_path), "other suite").get("abc") is None, "another suite's results are not reused"


# --- the adapter is in the cache key; an adapter that cannot load stops everything --------------------

ADAPTER = """import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its own folder: the helper beside it
import helper  # noqa: E402
from conformance.impls.fastdeploy import FastDeployAdapter  # noqa: E402

DROP = frozenset()


def make(source=None):
    adapter = FastDeployAdapter(source)
    adapter.capabilities = frozenset(adapter.capabilities) - DROP - helper.DROP
    return adapter
"""
HELPER = "DROP = frozenset()\n"
NO_PARTS = 'frozenset({"snapshot.parts"})'


def _two_versions(root):
    """A repository whose FILE has two versions: chunked parts sorted by number (passes the rule), by name (fails)."""
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "Support chunked part files", 1, {FILE: PARTS})
    commit(repo, "Sort part files by name", 2, {FILE: replaced(PARTS, NUMERIC_SORT, LEXICAL_SORT)})
    return repo


@pytest.mark.timeout(900)
def test_editing_the_adapter_or_a_module_it_imports_reruns_every_version(tmp_path):
    repo = _two_versions(tmp_path)
    wrapper = tmp_path / "adapter"
    wrapper.mkdir()
    (wrapper / "adapter.py").write_text(ADAPTER)
    (wrapper / "helper.py").write_text(HELPER)
    out = tmp_path / "out"

    def run(*extra):
        proc = subprocess.run([sys.executable, "-m", "conformance.history", "--repo", str(repo), "--path", FILE,
                               "-o", str(out), "--impl", str(wrapper / "adapter.py") + ":make", "--jobs", "2",
                               *NARROW, *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        data = json.loads((out / "history.json").read_text())
        return proc.stdout, data["rules"][0]["verdicts"], data

    stdout, verdicts_, data = run()
    assert verdicts_ == ["passed", "failed"] and "2 suite run(s), 0 from the cache" in stdout, stdout
    files = data["suite"]["adapter"]["files"]
    assert {str(wrapper / "adapter.py"), str(wrapper / "helper.py")} <= set(files), files
    trees = tuple(os.path.join(REPO, t) + os.sep for t in runs.SUITE_TREES)
    assert not [f for f in files if f.startswith(trees) or "site-packages" in f], "hashed whole, or a library's"
    # The adapter stops claiming snapshot.parts: every version runs again, with the new verdicts.
    (wrapper / "adapter.py").write_text(ADAPTER.replace("DROP = frozenset()", f"DROP = {NO_PARTS}"))
    stdout, verdicts_, _ = run()
    assert "2 suite run(s), 0 from the cache" in stdout, stdout
    assert verdicts_ == ["not_applicable", "not_applicable"], verdicts_
    # Back as it was: the first run's results are read (the key is the content, not a time stamp).
    (wrapper / "adapter.py").write_text(ADAPTER)
    stdout, verdicts_, _ = run()
    assert "0 suite run(s), 2 from the cache" in stdout and verdicts_ == ["passed", "failed"], stdout
    # --no-cache runs every version though nothing changed.
    stdout, verdicts_, data = run("--no-cache")
    assert "2 suite run(s), 0 from the cache" in stdout and verdicts_ == ["passed", "failed"], stdout
    assert data["suite"]["cache_read"] is False
    # A module the adapter imports changes: every version runs again.
    (wrapper / "helper.py").write_text(f"DROP = {NO_PARTS}\n")
    stdout, verdicts_, _ = run()
    assert "2 suite run(s), 0 from the cache" in stdout, stdout
    assert verdicts_ == ["not_applicable", "not_applicable"], verdicts_


BROKEN = {
    "a missing file": ("{tmp}/nowhere/adapter.py:make", "adapter file {tmp}/nowhere/adapter.py does not exist"),
    "an import error": ("{tmp}/broken.py:make", "ModuleNotFoundError: No module named 'no_such_module'"),
    "no such attribute": ("conformance.impls.fastdeploy:NoSuchAdapter", "has no attribute 'NoSuchAdapter'"),
    "a factory that takes no source": ("reference", "cannot be called with source='FILE'"),
    "an unknown name": ("no-such-impl", "unknown implementation 'no-such-impl'"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_adapter_that_cannot_load_exits_4_before_any_run(work, tmp_path, capsys, case):
    (tmp_path / "broken.py").write_text("import no_such_module\n\ndef make(source=None):\n    pass\n")
    impl, message = (x.format(tmp=tmp_path) for x in BROKEN[case])
    rc, err = run_main(["--repo", str(work["repo"]), "--path", FILE, "-o", str(tmp_path / "out"), "--impl", impl,
                        *NARROW], capsys)
    assert rc == 4 and "the adapter cannot be loaded (exit 4, nothing was run)" in err and message in err, (rc, err)
    assert not (tmp_path / "out" / ".history-cache").exists(), "no suite run, no cache"


def test_a_relative_adapter_path_is_the_callers_not_the_suites(tmp_path, monkeypatch):
    from conformance.history.adapter_probe import absolute_impl

    monkeypatch.chdir(tmp_path)
    assert absolute_impl("adapters/mine.py:make") == f"{tmp_path}/adapters/mine.py:make"
    assert absolute_impl("package.module:make") == "package.module:make"
    assert absolute_impl("fastdeploy") == "fastdeploy"
    (tmp_path / "exp.toml").write_text("")
    assert cli.absolute_options(["--expectations", "exp.toml", "--impl-opt", "cfg=exp.toml", "--impl-opt=k=v",
                                 "-k", "exp.toml"]) == [
        "--expectations", f"{tmp_path}/exp.toml", "--impl-opt", f"cfg={tmp_path}/exp.toml", "--impl-opt=k=v",
        "-k", "exp.toml"]


# --- empty ranges ---------------------------------------------------------------------------------

def test_an_empty_range_says_it_is_empty(tmp_path, capsys):
    repo = _two_versions(tmp_path)
    last = git(repo, "rev-parse", "--short", "HEAD")
    docs = commit(repo, "Document the levels", 3, {"README.md": "levels\n"})
    out = str(tmp_path / "out")
    rc, err = run_main(["--repo", str(repo), "--path", FILE, "-o", out, "--rev-range", f"{last}..{docs}"], capsys)
    assert rc == 2 and f"{last}..{docs}: none of its 1 commit(s) (first-parent line) changed {FILE}" in err, err
    rc, err = run_main(["--repo", str(repo), "--path", FILE, "-o", out, "--rev-range", f"{docs}..{docs}"], capsys)
    assert rc == 2 and f"{docs}..{docs}: the range is empty (no commits)" in err, err
    rc, err = run_main(["--repo", str(repo), "--path", "other.py", "-o", out, "--rev-range", f"{last}..{docs}"], capsys)
    assert rc == 2 and "other.py: never in the history of" in err, err


# --- the pull-request gate ------------------------------------------------------------------------

GATE = ["--rule", "PART", "-k", "2-before-10 and trace"]  # an area: the bisection below reads these results
COMMENTED = replaced(replaced(PARTS, NUMERIC_SORT, LEXICAL_SORT), LEXICAL_SORT,
                     "# parts in the order of their names\n        " + LEXICAL_SORT)


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """A repository: a clean commit, one that breaks PART-ORDER-NUMERIC, one that changes only a comment, one
    that fixes it, one that changes another file; the gate on the whole range (the first run, cold)."""
    root = tmp_path_factory.mktemp("gate")
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    sha = {"clean": commit(repo, "Support chunked part files", 1, {FILE: PARTS}),
           "break": commit(repo, "Sort part files by name", 2, {FILE: replaced(PARTS, NUMERIC_SORT, LEXICAL_SORT)}),
           "comment": commit(repo, "Explain the sort", 3, {FILE: COMMENTED}),
           "fix": commit(repo, "Sort part files by number", 4, {FILE: PARTS}),
           "docs": commit(repo, "Document the levels", 5, {"README.md": "levels\n"})}
    work = {"root": root, "repo": repo, "out": root / "out", "sha": sha}
    proc = gate_tool(work, f"{sha['clean']}..{sha['docs']}")
    return {**work, "proc": proc}


def gate_tool(work, rev_range, *extra, out=None, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "conformance.history", "--repo", str(work["repo"]), "--path", FILE,
                           "--rev-range", rev_range, "--fail-on-regression", "-o", str(out or work["out"]),
                           "--jobs", "2", *GATE, *extra], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)
def test_the_gate_fails_naming_exactly_the_breaking_commit_and_rule(gated):
    proc, s = gated["proc"], gated["sha"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((gated["out"] / "gate.json").read_text())
    assert report["gate"] == "failed" and report["unjudged"] == [], report
    got = [(r["id"], r["rule"], r["from"], r["to"], r["previous"]) for r in report["regressions"]]
    assert got == [(s["break"], RULE, "passed", "failed", s["clean"])], got
    failure = report["regressions"][0]["failures"][0]
    assert "2-before-10" in failure["test"] and failure["message"], failure
    out = proc.stdout
    assert "gate: FAILED: 1 rule verdict(s) got worse in 3 version(s)" in out, out
    assert re.search(rf"^  {s['break']} [0-9a-f]{{40}}  Sort part files by name$", out, re.M), out
    assert f"    {RULE}: passed -> failed (was passed at {s['clean']})" in out, out
    assert failure["test"] in out and failure["message"].splitlines()[0] in out, out
    assert s["comment"] not in out.split("gate:", 1)[1] and s["fix"] not in out.split("gate:", 1)[1], out
    # The base (the merge base) and every commit that changed the file, in order; the docs commit is none.
    data = json.loads((gated["out"] / "history.json").read_text())
    assert [v["id"] for v in data["versions"]] == [s[k] for k in ("clean", "break", "comment", "fix")]
    assert data["source"]["base"]["id"] == s["clean"]
    assert data["rules"][0]["verdicts"] == ["passed", "failed", "failed", "passed"]
    assert data["runs"] == {"versions": 4, "distinct": 3, "executed": 3, "cached": 0}, data["runs"]
    page = Cells((gated["out"] / "history.html").read_text(encoding="utf-8"))
    assert [j for j in range(4) if "regression" in page.cells[(RULE, j)]["class"].split()] == [1]


@pytest.mark.timeout(600)
def test_the_gate_passes_a_range_without_a_regression(gated):
    s = gated["sha"]
    proc = gate_tool(gated, f"{s['break']}..{s['docs']}")  # failed, still failed (a comment), passed
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gate: passed: no rule's verdict got worse in 2 version(s) (base " + s["break"] in proc.stdout, proc.stdout
    assert "0 suite run(s), 3 from the cache" in proc.stdout, proc.stdout
    proc = gate_tool(gated, f"{s['fix']}..{s['docs']}", out=gated["root"] / "empty")  # changes another file only
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"gate: passed: {s['fix']}..{s['docs']}: none of its 1 commit(s)" in proc.stdout, proc.stdout
    assert json.loads((gated["root"] / "empty" / "gate.json").read_text())["gate"] == "passed"


@pytest.mark.timeout(600)
def test_a_failure_the_expectations_pin_is_no_regression(gated, tmp_path):
    (tmp_path / "expect.toml").write_text(f'[[expect]]\nrule = "{RULE}"\nkind = "bug"\nreason = "parts by name"\n')
    s = gated["sha"]
    # From another folder, the expectations named relative to it (the suite itself runs from its own root).
    proc = gate_tool(gated, f"{s['clean']}..{s['docs']}", "--expectations", "expect.toml", out=tmp_path / "out",
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts_ = json.loads((tmp_path / "out" / "history.json").read_text())["rules"][0]["verdicts"]
    assert verdicts_ == ["unexpected_pass", "expected_failure", "expected_failure", "unexpected_pass"], verdicts_


@pytest.mark.timeout(300)
def test_bisect_reads_what_a_wider_run_cached(gated):
    s = gated["sha"]
    proc = tool(gated, "--bisect", RULE, "--from", "failed", "--to", "passed", "--rev-range",
                f"{s['clean']}..{s['docs']}", "-k", "2-before-10 and trace")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf"at +{s['fix']}.*Sort part files by number", proc.stdout), proc.stdout
    assert "0 suite run(s)" in proc.stdout, "the gate's run of the area PART has the rule's verdicts: " + proc.stdout


def test_the_gate_refuses_what_it_cannot_compare(work, tmp_path, capsys):
    for extra, message in ((["--all"], "not with --bisect or --all"), (["--bisect", RULE], "not with --bisect"),
                           (["--impl-opt", "source=x.py"], "--impl-opt source=... is the tool's own"),
                           (["--conformance-report", "r.json"], "--conformance-report is the tool's own")):
        rc, err = run_main(["--repo", str(work["repo"]), "--path", FILE, "-o", str(tmp_path), "--fail-on-regression",
                            *extra], capsys)
        assert rc == 2 and message in err, (extra, rc, err)


def _result(sha, rules, outcome="report"):
    report = {"rules": [{"id": r, "status": st, "title": r.lower(), "tests": [
        {"nodeid": f"t::{r}", "status": st, "message": f"{r} {st}\nsecond line"}]} for r, st in rules.items()]}
    return runs.Result("k", sha, outcome, 0, "why" if outcome != "report" else "", 1.0,
                       report if outcome == "report" else None)


def test_what_counts_as_worse():
    from conformance.history import gate

    vs = fake_versions(6)
    line = {"A": ["passed", "failed", "passed", "error", "error", "failed"],  # two regressions: at 1 and 3
            "B": ["passed", "not_applicable", "skipped", "failed", "passed", "passed"],  # across neutral verdicts: 3
            "C": ["failed", "failed", "passed", "expected_failure", "unexpected_pass", "failed"],  # pinned: none; 5
            "D": ["not_applicable", "failed", "failed", "failed", "failed", "failed"]}  # never passed: none
    results = {i: _result(f"s{i}", {r: v[i] for r, v in line.items()}) for i in range(6)}
    found, unjudged = gate.judge(vs, results, start=1)
    assert [(r.rule, r.index, r.before, r.old, r.new) for r in found] == [
        ("A", 1, 0, "passed", "failed"), ("A", 3, 2, "passed", "error"), ("B", 3, 0, "passed", "failed"),
        ("C", 5, 4, "unexpected_pass", "failed")]
    assert found[0].failures == [("t::A", "A failed\nsecond line")] and unjudged == []
    # A version without a report is stepped over for the comparison, and is itself unjudged (exit 3).
    results[2] = _result("s2", {}, outcome="usage_error")
    found, unjudged = gate.judge(vs, results, start=1)
    assert ("A", 3, 1, "failed", "error") not in [(r.rule, r.index, r.before, r.old, r.new) for r in found]
    assert unjudged == [2] and gate.exit_status(found, unjudged) == 1 and gate.exit_status([], unjudged) == 3
    # The base is never judged itself.
    results = {0: _result("s0", {}, outcome="usage_error"), 1: _result("s1", {"A": "failed"})}
    assert gate.judge(fake_versions(2), results, start=1) == ([], [])
    # --fail-on contract: a hardening rule's regression is listed, and does not fail the gate.
    results = {i: _result(f"s{i}", {"H": v, "K": k}) for i, (v, k) in enumerate((("passed", "passed"),
                                                                                  ("failed", "passed")))}
    for i, level in ((1, "hardening"),):
        results[i].report["summary"] = {"fail_on": "contract"}
        for rule in results[i].report["rules"]:
            rule["level"] = level
    found, unjudged = gate.judge(fake_versions(2), results, start=1)
    assert [(r.rule, r.level, r.fails) for r in found] == [("H", "hardening", False)]
    assert gate.exit_status(found, unjudged) == 0
    assert "[hardening: not failing the gate]" in "\n".join(gate.report_lines(fake_versions(2), results, found, [], 1))
    results[1].report["summary"] = {"fail_on": "all"}
    found, _ = gate.judge(fake_versions(2), results, start=1)
    assert [r.fails for r in found] == [True] and gate.exit_status(found, []) == 1


def test_the_key_follows_the_adapters_files_and_the_folders_options_name(tmp_path, monkeypatch):
    from conformance.history.adapter_probe import AdapterInfo

    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "SPEC.md").write_text("v1\n")
    monkeypatch.setattr(runs, "ROOT", str(tmp_path / "suite"))
    adapter, helper, config = tmp_path / "mine" / "adapter.py", tmp_path / "mine" / "helper.py", tmp_path / "cfg"
    adapter.parent.mkdir()
    config.mkdir()
    for path in (adapter, helper, config / "a.json"):
        path.write_text("v1\n")
    info = AdapterInfo("mine", "mine.py:make", (str(adapter), str(helper)), {"somelib": "1.0"})
    base = runs.Suite(adapter=info).fingerprint()
    assert base != runs.Suite().fingerprint() and runs.Suite(adapter=info).fingerprint() == base
    helper.write_text("v2\n")
    after_helper = runs.Suite(adapter=info).fingerprint()
    assert after_helper != base, "a module the adapter imports"
    newer = AdapterInfo("mine", "mine.py:make", info.files, {"somelib": "1.1"})
    assert runs.Suite(adapter=newer).fingerprint() != after_helper, "a distribution the adapter imports"
    with_dir = runs.Suite(extra=("--impl-opt", f"cfg={config}")).fingerprint()
    (config / "a.json").write_text("v2\n")
    assert runs.Suite(extra=("--impl-opt", f"cfg={config}")).fingerprint() != with_dir, "a file in a folder named"
    narrow, wide = runs.Suite(extra=("--rule", "PART", "-k", "x")), runs.Suite(extra=("-k", "x"))
    assert narrow.fingerprint() != wide.fingerprint()
    assert narrow.fingerprint(rules=False) == wide.fingerprint(rules=False) != runs.Suite().fingerprint(rules=False)


def test_a_bisection_reads_an_entry_whose_selection_has_its_rule(tmp_path):
    report = {"rules": [{"id": RULE, "status": "passed"}]}
    wide = runs.Cache(str(tmp_path), "suite+PART", base_hash="base", rules=["PART"])
    wide.put(runs.Result(wide.key("abc"), "abc", "report", 0, "", 1.0, report))
    for rule, base, hit in ((RULE, "base", True), ("LEVEL-X", "base", False), (RULE, "other base", False),
                            ("PART-OTHER", "base", False)):  # PART-OTHER: selected, but the report lacks it
        narrow = runs.Cache(str(tmp_path), f"suite+{rule}", base_hash=base, rules=[rule])
        assert narrow.get("abc") is None
        found = narrow.find("abc", rule)
        assert (found is not None) == hit, (rule, base)
        assert found is None or (found.report == report and found.cached)
    assert runs.Cache(str(tmp_path), "x", base_hash="base", rules=[RULE], read=False).find("abc", RULE) is None
    everything = runs.Cache(str(tmp_path / "all"), "suite", base_hash="base", rules=[])
    everything.put(runs.Result(everything.key("abc"), "abc", "report", 0, "", 1.0, report))
    assert runs.Cache(str(tmp_path / "all"), "s2", base_hash="base", rules=[RULE]).find("abc", RULE) is not None
