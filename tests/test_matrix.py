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
from types import SimpleNamespace

import pytest

from conformance import matrix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data", "matrix")
CHROMIUM = "/usr/bin/chromium"

NASTY = """<script>alert("x")</script> & 'q' </td>"""
NASTY_MESSAGE = 'AssertionError: expected <b>&amp;</b> "quoted" \'single\''
XFAIL_REASON = 'stand-in <never> checks & "quotes"'
XFAIL_LINK = "https://example.org/issue/1?a=1&b=2"
FLAKY_LINK = "HTTPS://Example.org/flaky"  # the scheme in capitals is still http(s)
XPASS_LINK = "https://example.org/issue/2"


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
             expectation=xfail("notimpl", XFAIL_REASON, XFAIL_LINK)),
        rule("BKT-XFAIL-BUG", "expected_failure", "hardening", expectation=xfail("bug")),
        rule("BKT-XFAIL-NEVER", "expected_failure", "contract", expectation=xfail("never", link="javascript:alert(1)")),
        rule("BKT-XFAIL-FLAKY", "expected_failure", "contract", expectation=xfail("flaky", link=FLAKY_LINK)),
        rule("BKT-XPASS", "unexpected_pass", "contract", expectation=xfail("bug", "was broken in 2.2", XPASS_LINK)),
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

EXPECTED_ORDER = ["APPLY-OK", "APPLY-BROKEN", "APPLY-WEAK", "XTRA-IN-APPLY",
                  "BKT-CRASH", "BKT-XFAIL-NOTIMPL", "BKT-XFAIL-BUG", "BKT-XFAIL-NEVER", "BKT-XFAIL-FLAKY", "BKT-XPASS",
                  "IPC-NA", "IPC-SKIP", "SNAP-ONLY-NEW", "OLD-ONLY"]  # the rows, in page order


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


VOID = {"meta", "col", "wbr", "br", "img", "link", "input", "hr"}
# Elements whose content model has no text: text there is shown stray (a browser moves text out of a table).
NO_TEXT = {None, "html", "head", "body", "table", "colgroup", "thead", "tbody", "tr", "dl", "section"}


class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children = tag, attrs, parent, []

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def all(self, tag=None, cls=None) -> list["Node"]:
        """Descendants in document order, by tag and (one) class."""
        found = []
        for c in self.children:
            if isinstance(c, Node):
                if (tag is None or c.tag == tag) and (cls is None or cls in c.classes):
                    found.append(c)
                found.extend(c.all(tag, cls))
        return found

    def one(self, tag=None, cls=None) -> "Node":
        (node,) = self.all(tag, cls)
        return node


class Dom(HTMLParser):
    """A page (or a fragment) as a tree, with what a browser would show out of place: text outside any
    element that holds text, end tags that close nothing open, declarations."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.root = self._cur = Node(None, {}, None)
        self.stray: list[tuple] = []
        self.unbalanced: list[str] = []
        self.decls: list[str] = []
        self.feed(text)
        self.close()
        self.unclosed = []
        while self._cur is not self.root:
            self.unclosed.append(self._cur.tag)
            self._cur = self._cur.parent

    def all(self, tag=None, cls=None) -> list[Node]:
        return self.root.all(tag, cls)

    def one(self, tag=None, cls=None) -> Node:
        return self.root.one(tag, cls)

    def handle_decl(self, decl):
        self.decls.append(decl)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self._cur)
        self._cur.children.append(node)
        if tag not in VOID:
            self._cur = node

    def handle_endtag(self, tag):
        if self._cur.tag == tag:
            self._cur = self._cur.parent
        else:
            self.unbalanced.append(tag)

    def handle_data(self, data):
        if data.strip() and self._cur.tag in NO_TEXT:
            self.stray.append((self._cur.tag, data))
        self._cur.children.append(data)


def flat(fragment: str) -> str:
    """An HTML fragment as its text, each element shown as <tag>...</tag> (tag names as parsed)."""
    def show(node):
        return "".join(c if isinstance(c, str) else
                       (f"<{c.tag}>" if c.tag in VOID else f"<{c.tag}>{show(c)}</{c.tag}>") for c in node.children)
    return show(Dom(fragment).root)


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


@pytest.fixture
def site(tmp_path):
    """The page of NEW and OLD rendered in process, with the reports' paths."""
    new, old = write(tmp_path, "new.json", NEW), write(tmp_path, "old.json", OLD)
    text = matrix.render([matrix.load_report(new), matrix.load_report(old)])
    return SimpleNamespace(text=text, dom=Dom(text), new=new, old=old)


def report_of(data, path="r.json"):
    return matrix.parse_report(data, path)


def test_the_page_is_well_formed(site):
    dom = site.dom
    assert site.text.lower().startswith("<!doctype html>\n"), f"the page starts with its doctype: {site.text[:30]!r}"
    assert [d.lower() for d in dom.decls] == ["doctype html"], f"one doctype: {dom.decls}"
    assert dom.stray == [], f"text outside the elements that hold text: {dom.stray[:5]}"
    assert dom.unbalanced == [] and dom.unclosed == [], f"end tags: {dom.unbalanced} unclosed: {dom.unclosed}"
    assert [c.tag for c in dom.root.children if isinstance(c, Node)] == ["html"], "one root element"
    assert site.text.lower().endswith("</html>\n"), f"the page ends with </html>: {site.text[-30:]!r}"


def test_title_heading_and_summary_line(site, tmp_path):
    dom = site.dom
    assert dom.one("title").text() == "Conformance matrix", "render's default title"
    assert dom.one("h1").text() == "Conformance matrix", "the heading is the title"
    hover = "Hover a cell for its tests' messages, a heading for the full version."
    assert dom.one("p", "sub").text() == f"14 rules by 2 implementation run(s); suite version 0.2.0. {hover}", \
        "the summary line: rules, runs, the suite version of the report that has one"
    other = {"run_info": {**OLD["run_info"], "suite_version": "0.1.0"}, "rules": OLD["rules"]}
    three = Dom(matrix.render([report_of(NEW), report_of(OLD), report_of(other)], title="T"))
    assert three.one("p", "sub").text() == f"14 rules by 3 implementation run(s); suite version 0.1.0, 0.2.0. {hover}", \
        "several suite versions, sorted, joined by a comma"
    assert (three.one("title").text(), three.one("h1").text()) == ("T", "T"), "the title given to render"
    alone = Dom(matrix.render([report_of(OLD)]))
    assert alone.one("p", "sub").text() == f"12 rules by 1 implementation run(s). {hover}", "no suite version given"


def test_column_headings_tell_version_report_suite_and_capabilities(site):
    impls = site.dom.one("tr", "impls")
    assert impls.one("th", "rule").text() == "rule", "the rule column's heading"
    titles = [th.attrs["title"] for th in impls.all("th", "impl")]
    assert titles == [
        f"fastdeploy {NEW['run_info']['implementation_version']}\nreport: {site.new}\nsuite 0.2.0\n"
        "capabilities: snapshot.single, status",
        f"reference 0.1.0\nreport: {site.old}\ncapabilities: none",
    ], "a heading's title: implementation and full version, report path, suite version, capabilities, one a line"


COUNT_LABELS = ["passed", "failed (contract)", "failed (hardening)", "failed (level ?)", "error", "expected",
                "unexpected pass", "n/a", "skipped", "absent"]


def test_counts_row_labels_and_zeros(site):
    counts = site.dom.one("tr", "counts")
    assert counts.one("th", "rule").text() == "counts (rules)", "the counts row's heading"
    for th in counts.all("th", "impl"):
        dts, dds = th.all("dt"), th.all("dd")
        assert [dt.text() for dt in dts] == COUNT_LABELS, f"column {th.attrs['data-col']}: the counts' labels"
        for dt, dd in zip(dts, dds):
            zero = ["zero"] if dd.text() == "0" else []
            assert (dt.classes, dd.classes) == (zero, zero), f"{dt.text()} = {dd.text()}: class zero only on zero"
    assert [dd.text() for dd in counts.all("dd")][:10] == ["2", "2", "1", "0", "1", "4", "1", "1", "1", "1"]


def test_area_rows_count_each_column(site):
    got = [(tr.attrs["data-area"], tr.one("th").text(), [td.text() for td in tr.all("td")])
           for tr in site.dom.all("tr", "area")]
    assert got == [
        ("APPLY", "APPLY (4 rules)", ["1 passed, 3 failing", "2 passed, 1 failing"]),
        ("BKT", "BKT (6 rules)", ["0 passed, 2 failing, 4 expected", "2 passed, 2 failing, 1 n/a"]),
        ("IPC", "IPC (2 rules)", ["0 passed, 1 n/a", "2 passed"]),
        ("SNAP", "SNAP (1 rule)", ["1 passed", "0 passed"]),
        ("OLD", "OLD (1 rule)", ["0 passed", "0 passed, 1 failing"]),
    ], "an area's heading: name, rule count, and per column passed / failing (failed, error, unexpected pass) / " \
       "expected / n/a"


def test_every_rule_row_is_under_its_area_heading_even_an_empty_area():
    report = report_of({"run_info": X, "rules": [{"id": "-ODD", "status": "passed"}, {"id": "A-B", "status": "passed"}]})
    tbody = Dom(matrix.render([report])).one("tbody")
    rows = [(tr.attrs.get("data-area"), tr.attrs.get("data-rule")) for tr in tbody.all("tr")]
    assert rows == [("", None), (None, "-ODD"), ("A", None), (None, "A-B")], f"area headings before their rules: {rows}"


def test_rule_rows_are_anchors_with_a_level_badge(site):
    rows = [tr for tr in site.dom.one("tbody").all("tr") if "data-rule" in tr.attrs]
    assert [tr.attrs["id"] for tr in rows] == [tr.attrs["data-rule"] for tr in rows] == EXPECTED_ORDER, \
        "each rule's row has the rule id as its id (page#RULE-ID links to it)"
    badges = {tr.attrs["id"]: (tr.one("span", "level").text(), tr.one("span", "level").classes) for tr in rows}
    assert badges["APPLY-OK"] == ("contract", ["level", "lv-contract"])
    assert badges["APPLY-WEAK"] == ("hardening", ["level", "lv-hardening"])
    assert badges["OLD-ONLY"] == ("?", ["level", "lv-unknown"]), "a rule of unknown level"
    odd = report_of({"run_info": X, "rules": [{"id": "A-B", "status": "passed", "level": "advice"}]})
    span = Dom(matrix.render([odd])).one("tbody").one("span", "level")
    assert (span.text(), span.classes) == ("advice", ["level", "lv-unknown"]), "a level this page does not know"
    title = [tr for tr in rows if tr.attrs["id"] == "APPLY-OK"][0].one("span", "rtitle")
    assert [c.text() for c in title.all("code")] == ["before"], "backticks in a SPEC title are set as code"


def test_links_only_on_expectation_cells_and_only_http(site):
    links = {(td.attrs["data-rule"], int(td.attrs["data-col"])): [a.attrs["href"] for a in td.all("a")]
             for td in site.dom.all("td", "cell")}
    assert {k: v for k, v in links.items() if v} == {
        ("BKT-XFAIL-NOTIMPL", 0): [XFAIL_LINK], ("BKT-XFAIL-FLAKY", 0): [FLAKY_LINK], ("BKT-XPASS", 0): [XPASS_LINK],
    }, "expected failures and unexpected passes link their http(s) links (any case), never javascript:"
    assert matrix._safe_link("HTTPS://x") and matrix._safe_link("http://x") and matrix._safe_link("Https://x")
    assert not matrix._safe_link("javascript:alert(1)") and not matrix._safe_link("ftp://x") \
        and not matrix._safe_link(" https://x") and not matrix._safe_link("data:text/html,x")
    passed_with_link = {"run_info": X, "rules": [{"id": "A-B", "status": "passed", "expectation": xfail("flaky", link=XPASS_LINK)}]}
    assert Dom(matrix.render([report_of(passed_with_link)])).all("a") == [], "no link on a cell that is not an expectation's"


def test_cell_tooltips_of_the_page(site):
    titles = {(td.attrs["data-rule"], int(td.attrs["data-col"])): td.attrs["title"] for td in site.dom.all("td", "cell")}
    want = {
        ("BKT-XFAIL-NOTIMPL", 0): f"expected to fail (notimpl): {XFAIL_REASON}\n{XFAIL_LINK}\n1 test(s): 1 expected_failure",
        ("BKT-XFAIL-BUG", 0): "expected to fail (bug): known\n1 test(s): 1 expected_failure",
        ("BKT-XPASS", 0): f"expected to fail (bug): was broken in 2.2\n{XPASS_LINK}\n1 test(s): 1 unexpected_pass",
        ("APPLY-OK", 0): "1 test(s): 1 passed",
        ("APPLY-BROKEN", 0): f"2 test(s): 1 passed, 1 failed\nt[b]: {NASTY_MESSAGE}",
        ("APPLY-BROKEN", 1): f"1 test(s): 1 failed\nx: {NASTY_MESSAGE}",
        ("SNAP-ONLY-NEW", 1): f"{site.old} has no result for this rule",
        ("OLD-ONLY", 0): f"{site.new} has no result for this rule",
    }
    assert {k: titles[k] for k in want} == want, "a cell's title: expectation (kind, reason, link), tests by status, " \
        "failure messages by test name; an absent cell names the report"


def test_tooltip_counts_tests_by_status_and_clips_messages():
    tests = [
        {"nodeid": "a.py::TestK::test_one", "status": "failed", "message": "m1"},
        {"nodeid": "a.py::test_two", "status": "passed", "message": "a passed test's output"},
        {"nodeid": "a.py::test_three", "status": "failed", "message": ""},
        {"status": "error", "message": "  m4 \n"},
        {"nodeid": "a.py::t5", "status": "failed", "message": "y" * (matrix.MAX_MESSAGE + 1)},
        {"nodeid": "a.py::t6", "status": "failed", "message": "z" * matrix.MAX_MESSAGE},
        {"nodeid": "a.py::t7", "status": "failed", "message": "m7"},
        {"nodeid": "a.py::t8"},
    ]
    rule_ = matrix.Rule("A-B", "", "A", "contract", "failed", None, tests)
    report = matrix.Report("r.json", "x", "", {})
    assert matrix.cell_tooltip("failed-contract", rule_, report).split("\n") == [
        "8 test(s): 5 failed, 1 passed, 1 error, 1 not run",
        "test_one: m1",
        ": m4",
        "t5: " + "y" * (matrix.MAX_MESSAGE - 1) + "…",
        "t6: " + "z" * matrix.MAX_MESSAGE,
        "... and 1 more message(s)",
    ], "counts by status (most first), the first 4 non-passed messages by test name, clipped, then how many more"
    four = matrix.Rule("A-B", "", "A", "contract", "failed", None, tests[:6])
    assert matrix.cell_tooltip("failed-contract", four, report).split("\n")[-1] == "t6: " + "z" * matrix.MAX_MESSAGE, \
        "exactly 4 messages: no '... and 0 more'"
    bare = matrix.Rule("A-B", "", "A", "contract", "expected_failure", {"kind": None, "reason": "", "link": ""}, [])
    assert matrix.cell_tooltip("expected-failure", bare, report) == "expected to fail: no reason given", \
        "an expectation without kind, reason or link; no tests"
    assert matrix.cell_tooltip("absent", None, report) == "r.json has no result for this rule"


LEVEL_LEGEND = [
    ("", "level lv-contract", "contract", "a rule of the contract: failing it breaks callers"),
    ("", "level lv-hardening", "hardening", "a robustness rule beyond the contract: failing it is a weakness, not a break"),
    ("", "level lv-unknown", "?", "the report does not say the rule's level (a report from before levels)"),
]
ALWAYS_IN_LEGEND = ["passed", "failed-contract", "failed-hardening", "error", "unexpected-pass", "expected-failure",
                    "not-applicable", "skipped", "absent"]


def legend(dom):
    section = dom.one("section", "legend")
    assert section.one("h2").text() == "Legend", "the legend's heading"
    rows = []
    for tr in section.all("tr"):
        swatch, meaning = tr.all("td")
        span = swatch.all("span")
        rows.append((" ".join(c for c in swatch.classes if c != "swatch"), " ".join(span[0].classes) if span else "",
                     swatch.text(), meaning.text()))
    return rows


def kinds_legend(*classes):
    return [(cls, "", *matrix.CELL_KINDS[cls]) for cls in classes]


def test_legend_names_each_kind_with_its_meaning(site):
    assert legend(site.dom) == kinds_legend(*ALWAYS_IN_LEGEND[:3], "failed-unknown", *ALWAYS_IN_LEGEND[3:]) \
        + LEVEL_LEGEND, "with a failure of unknown level: every kind but 'unknown', in CELL_KINDS order, then levels"
    assert legend(Dom(matrix.render([report_of(NEW)]))) == kinds_legend(*ALWAYS_IN_LEGEND) + LEVEL_LEGEND, \
        "'failed (level ?)' and 'unknown status' only when a cell shows them; the others always"
    weird = report_of({"run_info": X, "rules": [{"id": "A-B", "status": "weird"}]})
    assert legend(Dom(matrix.render([weird]))) == kinds_legend(*ALWAYS_IN_LEGEND, "unknown") + LEVEL_LEGEND


def test_the_table_is_as_wide_as_its_columns(site):
    def px(node):
        style = node.attrs["style"]
        assert style.startswith("width:") and style.endswith("px"), style
        return int(style[len("width:"):-2])
    table = site.dom.one("table", "matrix")
    cols = table.all("col")
    assert [c.classes for c in cols] == [["rule"], ["impl"], ["impl"]], "one column for the rules, one per report"
    assert [px(c) for c in cols] == [matrix.RULE_WIDTH, matrix.IMPL_WIDTH, matrix.IMPL_WIDTH]
    assert px(table) == sum(px(c) for c in cols), "the fixed-layout table is exactly as wide as its columns"


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
    assert p.rows == EXPECTED_ORDER


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


X = {"implementation": "x"}
# case -> (report, the whole message after "PATH: not a conformance report: ")
BAD = {
    "top-level list": ([1, 2], "the top level is a JSON list, not an object"),
    "no run_info": ({"rules": []}, 'missing "run_info" object'),
    "run_info a list": ({"run_info": [], "rules": []}, 'missing "run_info" object'),
    "no implementation": ({"run_info": {}, "rules": []}, 'missing "run_info.implementation"'),
    "empty implementation": ({"run_info": {"implementation": ""}, "rules": []}, 'missing "run_info.implementation"'),
    "implementation a number": ({"run_info": {"implementation": 5}, "rules": []}, 'missing "run_info.implementation"'),
    "rules not a list": ({"run_info": X, "rules": {}}, 'missing "rules" list'),
    "rule not an object": ({"run_info": X, "rules": [{"id": "A-B", "status": "passed"}, "A-C"]},
                           "rules[1] is not an object"),
    "rule without id": ({"run_info": X, "rules": [{"status": "passed"}]}, 'rules[0] has no "id"'),
    "rule with empty id": ({"run_info": X, "rules": [{"id": "", "status": "passed"}]}, 'rules[0] has no "id"'),
    "rule with numeric id": ({"run_info": X, "rules": [{"id": 7, "status": "passed"}]}, 'rules[0] has no "id"'),
    "rule without status": ({"run_info": X, "rules": [{"id": "A-B"}]}, 'rule A-B (rules[0]) has no "status"'),
    "rule with empty status": ({"run_info": X, "rules": [{"id": "A-B", "status": "passed"}, {"id": "A-C", "status": ""}]},
                               'rule A-C (rules[1]) has no "status"'),
    "rule with numeric status": ({"run_info": X, "rules": [{"id": "A-B", "status": 1}]},
                                 'rule A-B (rules[0]) has no "status"'),
    "duplicate rule": ({"run_info": X, "rules": [{"id": "A-B", "status": "passed"}, {"id": "A-B", "status": "failed"}]},
                       "rule A-B appears twice"),
    "expectation a string": ({"run_info": X, "rules": [{"id": "A-B", "status": "passed", "expectation": "bug"}]},
                             'rule A-B: "expectation" is neither null nor an object'),
    "tests a string": ({"run_info": X, "rules": [{"id": "A-B", "status": "passed", "tests": "t.py::a"}]},
                       'rule A-B: "tests" is not a list'),
}
USAGE = "usage: python -m conformance.matrix [-h] [-o HTML] [--title TITLE] REPORT.json [REPORT.json ...]"


def usage_error(exc, capsys, message):
    """The command exited 2 with its usage line, then `python -m conformance.matrix: error: MESSAGE`."""
    assert exc.value.code == 2, f"exit status of a usage error: {exc.value.code}"
    err = capsys.readouterr().err
    usage, sep, rest = err.partition("\npython -m conformance.matrix: error: ")
    assert sep, f"the error line names the command: {err!r}"
    assert " ".join(usage.split()) == USAGE, f"the usage line (program name and metavars): {usage!r}"
    assert rest == message + "\n", f"the error message: {rest!r}"


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_report_is_a_usage_error_naming_the_file(tmp_path, capsys, case):
    data, words = BAD[case]
    good = write(tmp_path, "good.json", NEW)
    bad = write(tmp_path, "bad report.json", data)
    with pytest.raises(SystemExit) as exc:
        matrix.main([good, bad, "-o", str(tmp_path / "m.html")])
    usage_error(exc, capsys, f"{bad}: not a conformance report: {words}")
    assert not (tmp_path / "m.html").exists(), "no page is written"
    with pytest.raises(matrix.ReportError) as e:
        matrix.parse_report(data, "r.json")
    assert str(e.value) == f"r.json: not a conformance report: {words}", "parse_report's message"


def test_unreadable_reports_are_usage_errors_naming_the_file(tmp_path, capsys):
    truncated = os.path.join(DATA, "truncated.json")
    with pytest.raises(SystemExit) as exc:
        matrix.main([truncated])
    usage_error(exc, capsys, f"{truncated}: not valid JSON: Expecting value (line 2, column 1)")
    missing = str(tmp_path / "nope.json")
    with pytest.raises(SystemExit) as exc:
        matrix.main([write(tmp_path, "good.json", NEW), missing])
    usage_error(exc, capsys, f"{missing}: cannot read: No such file or directory")
    with pytest.raises(SystemExit) as exc:
        matrix.main([str(tmp_path)])
    usage_error(exc, capsys, f"{tmp_path}: cannot read: Is a directory")
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"run_info": {"implementation": "caf\xe9"}, "rules": []}')
    with pytest.raises(SystemExit) as exc:
        matrix.main([str(latin1)])
    usage_error(exc, capsys, f"{latin1}: not UTF-8 text: invalid continuation byte at byte 36")


def test_an_unwritable_output_is_a_usage_error(tmp_path, capsys):
    good = write(tmp_path, "good.json", NEW)
    out = tmp_path / "no such dir" / "m.html"
    with pytest.raises(SystemExit) as exc:
        matrix.main([good, "-o", str(out)])
    usage_error(exc, capsys, f"{out}: cannot write: No such file or directory")
    with pytest.raises(SystemExit) as exc:
        matrix.main([good, "-o", str(tmp_path)])
    usage_error(exc, capsys, f"{tmp_path}: cannot write: Is a directory")


def test_without_output_the_page_goes_to_standard_output(tmp_path, capsys, monkeypatch):
    good = write(tmp_path, "good.json", OLD)
    monkeypatch.chdir(tmp_path)
    assert matrix.main([good]) == 0, "exit status"
    out, err = capsys.readouterr()
    assert out == matrix.render([matrix.load_report(good)]), "standard output is the whole page"
    assert out.lower().startswith("<!doctype html>\n"), out[:40]
    assert err == "", f"nothing on standard error: {err!r}"
    assert os.listdir(tmp_path) == ["good.json"], "no file is written"


def test_with_output_the_page_goes_to_the_file_and_a_line_to_stderr(tmp_path, capsys, monkeypatch):
    new, old = write(tmp_path, "new.json", NEW), write(tmp_path, "old.json", OLD)
    monkeypatch.chdir(tmp_path)
    assert matrix.main([new, old, "-o", "m.html", "--title", "Nightly <gate> & co"]) == 0, "exit status"
    out, err = capsys.readouterr()
    assert out == "", f"nothing on standard output: {out[:80]!r}"
    assert err == f"matrix of 2 report(s) written to {tmp_path / 'm.html'}\n", f"the line on standard error: {err!r}"
    dom = Dom((tmp_path / "m.html").read_text(encoding="utf-8"))
    assert (dom.one("title").text(), dom.one("h1").text()) == ("Nightly <gate> & co",) * 2, "--title sets title and h1"
    assert matrix.main([new, "-o", "d.html"]) == 0
    dom = Dom((tmp_path / "d.html").read_text(encoding="utf-8"))
    assert (dom.one("title").text(), dom.one("h1").text()) == ("Conformance matrix",) * 2, "the default title"


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


ASCII_LOCALE = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}  # open() defaults to ASCII here


def test_reports_are_read_and_the_page_written_as_utf8_whatever_the_locale(tmp_path):
    """Non-ASCII text in a report survives into the page, in this process and in a command run under an ASCII
    locale (as on a machine whose default encoding is not UTF-8)."""
    data = {"run_info": {"implementation": "café", "implementation_version": "1.0 – ü"},
            "rules": [{"id": "A-B", "title": "naïve `ß`", "status": "passed"}]}
    report = write(tmp_path, "r.json", json.dumps(data, ensure_ascii=False))  # raw UTF-8, not \u escapes
    out = tmp_path / "here.html"
    assert matrix.main([report, "-o", str(out)]) == 0
    assert "café" in out.read_bytes().decode("utf-8"), "the page is UTF-8"
    out = tmp_path / "ascii.html"
    # (matrix.main imported, not run with -m: under mutmut a module run as __main__ escapes its mutants)
    command = "import sys; from conformance import matrix; sys.exit(matrix.main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", command, report, "-o", str(out)], cwd=REPO,
                          env={**os.environ, **ASCII_LOCALE}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"under an ASCII locale: {proc.stderr[-2000:]}"
    dom = Dom(out.read_bytes().decode("utf-8"))
    assert dom.one("tr", "impls").one("span", "name").text() == "café", "read as UTF-8, written as UTF-8"
    assert dom.one("tbody").one("span", "rtitle").text() == "naïve ß"


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
    assert matrix.short_version("1.0; a; b; c") == "1.0", "only the first of several ';'-separated parts"
    assert matrix.short_version("source /r/Xdir/x.py") == "source Xdir/x.py", "only the path's separators are cut"
    assert matrix.short_version("  1.0 \t (build\n  7)  ") == "1.0 (build 7)", "white space collapsed to one space"
    exact = "v" * matrix.SHORT_VERSION
    assert matrix.short_version(exact) == exact, "a version of exactly the limit is kept whole"


def test_clip_keeps_text_up_to_the_limit():
    assert matrix._clip("abcde", 5) == "abcde", "exactly the limit: whole"
    assert matrix._clip("abcdef", 5) == "abcd…", "one over: the limit, with an ellipsis"
    assert matrix._clip("  abc \n", 3) == "abc", "stripped first"


def test_area_of_is_the_part_before_the_first_dash():
    assert [matrix.area_of(r) for r in ("SNAP-GPU-ID-INVALID", "BKT-ABORT", "LIFE", "-X")] == ["SNAP", "BKT", "LIFE", ""]


def test_breakable_allows_a_break_after_underscore_slash_and_dot_before_a_word_character():
    assert flat(matrix.breakable("fd_standin/dwm.py (x.) a<b")) == \
        "fd_<wbr>standin/<wbr>dwm.<wbr>py (x.) a<b", "a <wbr> after _ / . when a word character follows; text escaped"
    assert flat(matrix.title_html("a `b<c>` d `e`")) == "a <code>b<c></code> d <code>e</code>", "backtick spans as code"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent: .ci/chromium installs it where apt is reachable")
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
