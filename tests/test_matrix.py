"""The compliance matrix page (conformance/matrix.py): rules by implementation from conformance reports.

The page is parsed back (html.parser) and every (rule, implementation) cell, the per-column counts, the
row order, the escaping and the errors on bad input are checked against small synthetic reports: one
in the extended format (level, area, expectation, expected_failure and unexpected_pass) and one in
today's older format, plus a trimmed real report of today's format (tests/data/matrix/).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser

import pytest

from conformance import matrix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data", "matrix")
CHROMIUM = "/usr/bin/chromium"

NASTY = """<script>alert("x")</script> & 'q' </td>"""
NASTY_MESSAGE = 'AssertionError: expected <b>&amp;</b> "quoted" \'single\''
XFAIL_REASON = 'stand-in <never> checks & "quotes"'


def a_test(nodeid, status, message=""):
    return {"nodeid": nodeid, "status": status, "message": message}


def rule(rule_id, status, level=None, title="", expectation=None, area=None, tests=None, old=False):
    r = {"id": rule_id, "title": title or f"title of {rule_id}", "status": status,
         "tests": tests if tests is not None else [a_test(f"conformance/test_x.py::t[{rule_id}]", status)]}
    if not old:
        r.update(level=level, area=area or rule_id.split("-", 1)[0], expectation=expectation)
    return r


def xfail(kind, reason="known", link=None):
    return {"kind": kind, "reason": reason, "link": link}


NEW = {
    "run_info": {"implementation": "fastdeploy",
                 "implementation_version": "source /very/long/path/to/dynamic_weight_manager.py (sha256 3523bac37930ab)",
                 "capabilities": ["snapshot.single", "status"], "suite_version": "0.2.0"},
    "rules": [
        rule("APPLY-OK", "passed", "contract", title="dtype is checked `before` shape"),
        rule("APPLY-BROKEN", "failed", "contract", tests=[
            a_test("conformance/test_apply.py::t[a]", "passed"),
            a_test("conformance/test_apply.py::t[b]", "failed", NASTY_MESSAGE)]),
        rule("APPLY-WEAK", "failed", "hardening"),
        rule("BKT-CRASH", "error", "contract", title=NASTY),
        rule("BKT-XFAIL-NOTIMPL", "expected_failure", "contract",
             expectation=xfail("notimpl", XFAIL_REASON, "https://example.org/issue/1?a=1&b=2")),
        rule("BKT-XFAIL-BUG", "expected_failure", "hardening", expectation=xfail("bug")),
        rule("BKT-XFAIL-NEVER", "expected_failure", "contract", expectation=xfail("never", link="javascript:alert(1)")),
        rule("BKT-XFAIL-FLAKY", "expected_failure", "contract", expectation=xfail("flaky")),
        rule("BKT-XPASS", "unexpected_pass", "contract", expectation=xfail("bug", "was broken in 2.2")),
        rule("IPC-NA", "not_applicable", "contract"),
        rule("IPC-SKIP", "skipped", "hardening"),
        rule("SNAP-ONLY-NEW", "passed", "hardening"),
        # area given explicitly, listed last: shown within the APPLY group
        rule("XTRA-IN-APPLY", "failed", "contract", area="APPLY"),
    ],
    "summary": {},
}

OLD = {  # today's format: no level, area or expectation; only the five old statuses
    "run_info": {"implementation": "reference", "implementation_version": "0.1.0", "capabilities": []},
    "rules": [
        rule("APPLY-OK", "passed", old=True),
        rule("APPLY-BROKEN", "failed", old=True, tests=[a_test("t::x", "failed", NASTY_MESSAGE)]),
        rule("APPLY-WEAK", "passed", old=True),
        rule("BKT-CRASH", "error", old=True),
        rule("BKT-XFAIL-NOTIMPL", "failed", old=True),
        rule("BKT-XFAIL-BUG", "passed", old=True),
        rule("BKT-XFAIL-NEVER", "not_applicable", old=True),
        rule("BKT-XFAIL-FLAKY", "skipped", old=True),
        rule("BKT-XPASS", "passed", old=True),
        rule("IPC-NA", "passed", old=True),
        rule("IPC-SKIP", "passed", old=True),
        # SNAP-ONLY-NEW and XTRA-IN-APPLY absent; a rule no other report has, level unknown everywhere
        rule("OLD-ONLY", "failed", old=True),
    ],
    "summary": {},
}

# (rule, column) -> (cell class, cell text); column 0 = NEW, 1 = OLD
EXPECTED = {
    ("APPLY-OK", 0): ("passed", "passed"),
    ("APPLY-BROKEN", 0): ("failed-contract", "FAILED (contract)"),
    ("APPLY-WEAK", 0): ("failed-hardening", "failed (hardening)"),
    ("BKT-CRASH", 0): ("error", "error"),
    ("BKT-XFAIL-NOTIMPL", 0): ("expected-failure", "expected failure (notimpl)"),
    ("BKT-XFAIL-BUG", 0): ("expected-failure", "expected failure (bug)"),
    ("BKT-XFAIL-NEVER", 0): ("expected-failure", "expected failure (never)"),
    ("BKT-XFAIL-FLAKY", 0): ("expected-failure", "expected failure (flaky)"),
    ("BKT-XPASS", 0): ("unexpected-pass", "UNEXPECTED PASS (bug)"),
    ("IPC-NA", 0): ("not-applicable", "n/a"),
    ("IPC-SKIP", 0): ("skipped", "skipped"),
    ("SNAP-ONLY-NEW", 0): ("passed", "passed"),
    ("XTRA-IN-APPLY", 0): ("failed-contract", "FAILED (contract)"),
    ("OLD-ONLY", 0): ("absent", "absent"),
    ("APPLY-OK", 1): ("passed", "passed"),
    # the old report gives no level; the rule's level from the other report decides
    ("APPLY-BROKEN", 1): ("failed-contract", "FAILED (contract)"),
    ("APPLY-WEAK", 1): ("passed", "passed"),
    ("BKT-CRASH", 1): ("error", "error"),
    ("BKT-XFAIL-NOTIMPL", 1): ("failed-contract", "FAILED (contract)"),
    ("BKT-XFAIL-BUG", 1): ("passed", "passed"),
    ("BKT-XFAIL-NEVER", 1): ("not-applicable", "n/a"),
    ("BKT-XFAIL-FLAKY", 1): ("skipped", "skipped"),
    ("BKT-XPASS", 1): ("passed", "passed"),
    ("IPC-NA", 1): ("passed", "passed"),
    ("IPC-SKIP", 1): ("passed", "passed"),
    ("SNAP-ONLY-NEW", 1): ("absent", "absent"),
    ("XTRA-IN-APPLY", 1): ("absent", "absent"),
    ("OLD-ONLY", 1): ("failed-unknown", "failed (level ?)"),
}


class Page(HTMLParser):
    """The parts of a matrix page the tests read, by the page's data-* attributes."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.cells: dict[tuple[str, int], dict] = {}
        self.heads: dict[int, dict] = {}  # column -> name, version, title
        self.counts: dict[int, dict[str, int]] = {}
        self.rows: list[str] = []  # rule ids in page order
        self.areas: list[str] = []
        self.rule_heads: dict[str, dict] = {}  # rule id -> rid, level, title (text)
        self.links: list[str] = []
        self.tags: set[str] = set()
        self.legend: list[dict] = []  # class, text
        self._row = None  # rule id of the open <tr>
        self._row_kind = None
        self._el = None  # the open capture: (dict, key)
        self._col = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        cls = (a.get("class") or "").split()
        if tag == "a":
            self.links.append(a.get("href"))
        if tag == "tr":
            self._row_kind = cls[0] if cls else None
            self._row = a.get("data-rule")
            if self._row:
                self.rows.append(self._row)
                self.rule_heads[self._row] = {"rid": "", "level": "", "title": ""}
            if "area" in cls:
                self.areas.append(a["data-area"])
        elif tag == "td" and "cell" in cls:
            key = (a["data-rule"], int(a["data-col"]))
            assert key not in self.cells, f"two cells for {key}"
            self.cells[key] = {"class": [c for c in cls if c != "cell"], "text": "", "title": a.get("title")}
            self._el = (self.cells[key], "text")
        elif tag == "td" and "swatch" in cls:
            self.legend.append({"class": " ".join(c for c in cls if c != "swatch"), "text": ""})
            self._el = (self.legend[-1], "text")
        elif tag == "th" and "impl" in cls:
            self._col = int(a["data-col"])
            if self._row_kind == "impls":
                self.heads[self._col] = {"name": "", "version": "", "title": a.get("title")}
            else:
                self.counts[self._col] = {}
        elif tag == "span" and self._row_kind == "impls" and self._col is not None:
            self._el = (self.heads[self._col], cls[0])
        elif tag == "span" and self._row and cls and cls[0] in ("rid", "level", "rtitle"):
            self._el = (self.rule_heads[self._row], {"rtitle": "title"}.get(cls[0], cls[0]))
        elif tag == "dd" and "data-count" in a:
            self._el = (self.counts[self._col], a["data-count"])
            self.counts[self._col][a["data-count"]] = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th", "span", "dd"):
            self._el = None
        if tag == "th":
            self._col = None
        if tag == "tr":
            self._row = None

    def handle_data(self, data):
        if self._el is not None:
            d, k = self._el
            d[k] = d.get(k, "") + data


def write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


@pytest.fixture
def page(tmp_path):
    out = tmp_path / "m.html"
    assert matrix.main([write(tmp_path, "new.json", NEW), write(tmp_path, "old.json", OLD), "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    return text, Page(text)


def test_every_cell_has_the_class_and_text_of_its_status(page):
    _, p = page
    got = {key: (cell["class"], cell["text"].strip()) for key, cell in p.cells.items()}
    assert set(got) == set(EXPECTED), "one cell per (rule, report), absent ones included"
    for key, (cls, text) in EXPECTED.items():
        assert got[key] == ([cls], text), key


def test_contract_and_hardening_failures_look_different():
    css = matrix.CSS
    rule_of = {cls: next(line for line in css.splitlines() if line.startswith(f".{cls} "))
               for cls in ("failed-contract", "failed-hardening", "passed", "expected-failure", "unexpected-pass")}
    assert len({line.split("{", 1)[1] for line in rule_of.values()}) == len(rule_of)
    assert matrix.CELL_KINDS["failed-contract"][0] != matrix.CELL_KINDS["failed-hardening"][0]


def test_rows_follow_the_first_report_grouped_by_area(page):
    _, p = page
    assert p.areas == ["APPLY", "BKT", "IPC", "SNAP", "OLD"]
    assert p.rows == ["APPLY-OK", "APPLY-BROKEN", "APPLY-WEAK", "XTRA-IN-APPLY",
                      "BKT-CRASH", "BKT-XFAIL-NOTIMPL", "BKT-XFAIL-BUG", "BKT-XFAIL-NEVER", "BKT-XFAIL-FLAKY", "BKT-XPASS",
                      "IPC-NA", "IPC-SKIP", "SNAP-ONLY-NEW", "OLD-ONLY"]


def test_rule_heading_shows_id_title_and_level(page):
    _, p = page
    assert p.rule_heads["APPLY-WEAK"] == {"rid": "APPLY-WEAK", "level": "hardening",
                                          "title": "title of APPLY-WEAK"}
    assert p.rule_heads["APPLY-OK"]["level"] == "contract"
    assert p.rule_heads["APPLY-OK"]["title"] == "dtype is checked before shape"  # backticks set as <code>
    assert p.rule_heads["OLD-ONLY"]["level"] == "?"
    assert p.rule_heads["BKT-CRASH"]["title"] == NASTY


def test_header_counts_per_column(page):
    _, p = page
    def count(col):
        return {k: int(v) for k, v in p.counts[col].items()}
    assert count(0) == {"passed": 2, "failed-contract": 2, "failed-hardening": 1, "error": 1, "expected-failure": 4,
                        "unexpected-pass": 1, "not-applicable": 1, "skipped": 1, "absent": 1,
                        "failed-unknown": 0}
    assert count(1) == {"passed": 6, "failed-contract": 2, "failed-hardening": 0, "error": 1, "expected-failure": 0,
                        "unexpected-pass": 0, "not-applicable": 1, "skipped": 1, "absent": 2,
                        "failed-unknown": 1}
    for col in (0, 1):  # the counts agree with the cells
        cells = [c["class"][0] for (r, c2), c in p.cells.items() if c2 == col]
        assert {k: cells.count(k) for k in count(col)} == count(col)


def test_column_headings_name_the_implementation_and_shorten_the_version(page):
    _, p = page
    new, old = p.heads[0], p.heads[1]
    assert new["name"] == "fastdeploy"
    assert new["version"] == "source to/dynamic_weight_manager.py (sha256 3523bac3)"
    assert NEW["run_info"]["implementation_version"] in new["title"]
    assert "snapshot.single, status" in new["title"]
    assert (old["name"], old["version"]) == ("reference", "0.1.0")


def test_expected_failure_reason_and_link_in_the_cell(page):
    _, p = page
    cell = p.cells[("BKT-XFAIL-NOTIMPL", 0)]
    assert XFAIL_REASON in cell["title"]
    assert "https://example.org/issue/1?a=1&b=2" in p.links
    assert "was broken in 2.2" in p.cells[("BKT-XPASS", 0)]["title"]
    assert not any(link and link.startswith("javascript:") for link in p.links), "only http(s) links are made"


def test_failure_messages_in_the_cell_title(page):
    _, p = page
    title = p.cells[("APPLY-BROKEN", 0)]["title"]
    assert NASTY_MESSAGE in title and "1 failed" in title and "1 passed" in title
    assert "has no result" in p.cells[("SNAP-ONLY-NEW", 1)]["title"]


def test_text_is_escaped_and_the_page_is_self_contained(page):
    text, p = page
    assert "<script" not in text.lower()
    assert "</td>" + "'" not in text and '<b>&amp;</b>' not in text
    assert "&lt;script&gt;" in text
    assert not p.tags & {"script", "link", "img", "iframe", "object", "b"}
    assert "url(" not in text and "@import" not in text and "src=" not in text


def test_legend_names_every_kind_shown(page):
    _, p = page
    classes = {entry["class"] for entry in p.legend}
    assert {"passed", "failed-contract", "failed-hardening", "failed-unknown", "error", "unexpected-pass",
            "expected-failure", "not-applicable", "skipped", "absent"} <= classes


def test_unknown_status_is_shown_not_hidden(tmp_path):
    report = {"run_info": {"implementation": "x"}, "rules": [{"id": "A-B", "status": "weird<>", "tests": []}]}
    p = Page(matrix.render([matrix.parse_report(report, "r.json")]))
    assert p.cells[("A-B", 0)]["class"] == ["unknown"]
    assert p.cells[("A-B", 0)]["text"] == "unknown status: weird<>"


def test_every_status_the_plugin_writes_is_known():
    from conformance import plugin

    for status in (*plugin.STATUSES, "expected_failure", "unexpected_pass"):
        r = matrix.Rule("A-B", "", "A", "contract", status, None, [])
        assert matrix.cell_class(r, matrix.Row("A-B", "", "A", "contract")) != "unknown", status


def test_todays_real_report_format(tmp_path):
    """A trimmed report written by today's plugin (no level, area or expectation)."""
    path = os.path.join(DATA, "old_format_fastdeploy.json")
    out = tmp_path / "m.html"
    assert matrix.main([path, "-o", str(out)]) == 0
    p = Page(out.read_text(encoding="utf-8"))
    got = {r: (c["class"][0], c["text"]) for (r, _), c in p.cells.items()}
    assert got == {"APPLY-DTYPE-BEFORE-SHAPE": ("passed", "passed"),
                   "APPLY-MISSING-FAILS": ("failed-unknown", "failed (level ?)"),
                   "BKT-ABORT": ("not-applicable", "n/a"),
                   "LEVEL-CANDIDATE-NOT-FILE": ("failed-unknown", "failed (level ?)")}
    assert p.areas == ["APPLY", "BKT", "LEVEL"]
    assert {h["level"] for h in p.rule_heads.values()} == {"?"}
    assert p.heads[0]["version"] == "source fd_standin/dynamic_weight_manager.py (sha256 3523bac3)"
    assert "does not match" in p.cells[("APPLY-MISSING-FAILS", 0)]["title"]


BAD = {
    "top-level list": ([1, 2], "top level is a JSON list"),
    "no run_info": ({"rules": []}, '"run_info"'),
    "no implementation": ({"run_info": {}, "rules": []}, "run_info.implementation"),
    "rules not a list": ({"run_info": {"implementation": "x"}, "rules": {}}, '"rules" list'),
    "rule without id": ({"run_info": {"implementation": "x"}, "rules": [{"status": "passed"}]}, 'rules[0] has no "id"'),
    "rule without status": ({"run_info": {"implementation": "x"}, "rules": [{"id": "A-B"}]}, 'A-B (rules[0]) has no "status"'),
    "duplicate rule": ({"run_info": {"implementation": "x"},
                        "rules": [{"id": "A-B", "status": "passed"}, {"id": "A-B", "status": "failed"}]}, "A-B appears twice"),
    "expectation a string": ({"run_info": {"implementation": "x"},
                              "rules": [{"id": "A-B", "status": "passed", "expectation": "bug"}]}, '"expectation"'),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_report_is_a_usage_error_naming_the_file(tmp_path, capsys, case):
    data, words = BAD[case]
    good = write(tmp_path, "good.json", NEW)
    bad = write(tmp_path, "bad report.json", data)
    with pytest.raises(SystemExit) as exc:
        matrix.main([good, bad, "-o", str(tmp_path / "m.html")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {bad}: not a conformance report" in err and words in err, err
    assert "usage:" in err and "Traceback" not in err
    assert not (tmp_path / "m.html").exists()


def test_invalid_json_and_missing_file_are_usage_errors(tmp_path, capsys):
    truncated = os.path.join(DATA, "truncated.json")
    with pytest.raises(SystemExit) as exc:
        matrix.main([truncated])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{truncated}: not valid JSON" in err and "line 2" in err
    missing = str(tmp_path / "nope.json")
    with pytest.raises(SystemExit) as exc:
        matrix.main([missing])
    assert exc.value.code == 2
    assert f"{missing}: cannot read" in capsys.readouterr().err


def test_command_line(tmp_path):
    """`python -m conformance.matrix` end to end: a page on success, exit 2 and no traceback on bad input."""
    new, old = write(tmp_path, "new.json", NEW), write(tmp_path, "old.json", OLD)
    out = tmp_path / "matrix.html"
    cmd = [sys.executable, "-m", "conformance.matrix"]
    proc = subprocess.run([*cmd, new, old, "-o", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert len(Page(out.read_text(encoding="utf-8")).cells) == len(EXPECTED)
    proc = subprocess.run([*cmd, old], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("<!DOCTYPE html>")  # no -o: standard output
    bad = write(tmp_path, "bad.json", "{not json")
    proc = subprocess.run([*cmd, new, bad, "-o", str(tmp_path / "x.html")], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{bad}: not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_short_version():
    assert matrix.short_version("0.1.0") == "0.1.0"
    assert matrix.short_version("") == "?"
    assert matrix.short_version("source C:\\a\\b\\x.py (sha256 0123456789abcdef)") == "source b\\x.py (sha256 01234567)"
    assert matrix.short_version("source /a/b/x.py (sha256 6f874b0ac123); DynamicWeightManager(fd_config); "
                                "levels: parts") == "source b/x.py (sha256 6f874b0a)"
    # stand-ins of several generations share a file name: the directory tells them apart
    assert matrix.short_version("source /r/tests/fd_standins/dwm0/dynamic_weight_manager.py (sha256 733f055b1234)") \
        == "source dwm0/dynamic_weight_manager.py (sha256 733f055b)"
    assert matrix.short_version("source /x.py") == "source x.py"
    long = matrix.short_version("x" * 200)
    assert len(long) == matrix.SHORT_VERSION and long.endswith("…")


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent: the browser check is manual only")
def test_a_real_browser_parses_the_page(tmp_path):
    out = tmp_path / "m.html"
    matrix.main([write(tmp_path, "new.json", NEW), write(tmp_path, "old.json", OLD), "-o", str(out)])
    profile = tempfile.mkdtemp(dir=tmp_path)
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", "--dump-dom", out.as_uri()],
                          capture_output=True, text=True, timeout=90)
    shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = Page(proc.stdout)
    assert "table" in dom.tags
    assert {k: (c["class"][0], c["text"].strip()) for k, c in dom.cells.items()} == EXPECTED
