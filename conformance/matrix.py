"""A compliance matrix of conformance reports, like wpt.fyi: rules (rows) by implementation (columns).

    python -m conformance.matrix REPORT.json [REPORT.json ...] -o matrix.html

Each REPORT.json is written by ``pytest conformance --impl=X --conformance-report=REPORT.json``. The
page is one static, self-contained HTML file (inline CSS, no JavaScript, nothing fetched). Rows are the
union of the reports' rules, in the order of the first report (then rules only later reports have, in
their order), grouped by area; there is one column per report. Older reports without ``level``,
``area`` or ``expectation`` are accepted (level shown as ``?``, area taken from the id's prefix).

Standard library only: it must run wherever a report can be copied to.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

LEVELS = ("contract", "hardening")
EXPECTATION_KINDS = ("notimpl", "bug", "never", "flaky")

# cell class -> (label in the legend, what it means). The order is the legend's.
CELL_KINDS = {
    "passed": ("passed", "every test of the rule passed"),
    "failed-contract": ("FAILED (contract)", "a contract rule failed: the implementation breaks the contract"),
    "failed-hardening": ("failed (hardening)", "a hardening rule failed: weaker than the contract asks of a robust loader"),
    "failed-unknown": ("failed (level ?)", "a rule failed; the report does not say its level"),
    "error": ("error", "a test could not reach a verdict (setup crashed, the test itself broke)"),
    "unexpected-pass": ("UNEXPECTED PASS", "a rule expected to fail passed: the run fails until the expectation is removed"),
    "expected-failure": ("expected failure", "a known failure, recorded with its kind (notimpl, bug, never, flaky) and reason"),
    "not-applicable": ("n/a", "the rule needs a capability the implementation does not claim"),
    "skipped": ("skipped", "the rule was skipped in this run"),
    "absent": ("absent", "the report has no result for this rule (not selected, or an older suite)"),
    "unknown": ("unknown status", "a status this page does not know (a newer report format?)"),
}

STATUS_CLASS = {
    "passed": "passed",
    "error": "error",
    "not_applicable": "not-applicable",
    "skipped": "skipped",
    "expected_failure": "expected-failure",
    "unexpected_pass": "unexpected-pass",
}

# The per-column counts in the header: (key, label). Keys are cell classes, except "failed-unknown",
# shown only when some report lacks levels.
COUNTS = (
    ("passed", "passed"),
    ("failed-contract", "failed (contract)"),
    ("failed-hardening", "failed (hardening)"),
    ("failed-unknown", "failed (level ?)"),
    ("error", "error"),
    ("expected-failure", "expected"),
    ("unexpected-pass", "unexpected pass"),
    ("not-applicable", "n/a"),
    ("skipped", "skipped"),
    ("absent", "absent"),
    ("unknown", "unknown status"),
)
ALWAYS_COUNTED = {"passed", "failed-contract", "failed-hardening", "error", "expected-failure",
                  "unexpected-pass", "not-applicable", "skipped", "absent"}

MAX_MESSAGE = 400  # characters of one test message in a tooltip
MAX_MESSAGES = 4  # test messages in one tooltip
SHORT_VERSION = 72  # characters of a column heading's version
RULE_WIDTH, IMPL_WIDTH = 420, 180  # pixels of the rule column and of each implementation's


class ReportError(ValueError):
    """A report that cannot be read: the message names the file."""


@dataclass
class Rule:
    id: str
    title: str
    area: str
    level: str | None  # "contract", "hardening", another string, or None when the report lacks it
    status: str
    expectation: dict | None
    tests: list[dict]
    modes: dict | None = None  # the rule's mode declaration and the pairs its tests covered (older reports: None)


@dataclass
class Report:
    path: str
    implementation: str
    version: str
    run_info: dict
    rules: dict[str, Rule] = field(default_factory=dict)  # id -> rule, in report order


def area_of(rule_id: str) -> str:
    return rule_id.split("-", 1)[0]


def _text(value) -> str:
    return "" if value is None else str(value)


def parse_report(data, path: str) -> Report:
    """Check the shape of one decoded report and normalise it; ReportError names ``path``."""
    def bad(what: str) -> ReportError:
        return ReportError(f"{path}: not a conformance report: {what}")

    if not isinstance(data, dict):
        raise bad(f"the top level is a JSON {type(data).__name__}, not an object")
    run_info = data.get("run_info")
    if not isinstance(run_info, dict):
        raise bad('missing "run_info" object')
    impl = run_info.get("implementation")
    if not isinstance(impl, str) or not impl:
        raise bad('missing "run_info.implementation"')
    rules = data.get("rules")
    if not isinstance(rules, list):
        raise bad('missing "rules" list')
    report = Report(path=path, implementation=impl, version=_text(run_info.get("implementation_version")),
                    run_info=run_info)
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict):
            raise bad(f"rules[{i}] is not an object")
        rule_id = rule.get("id")
        if not isinstance(rule_id, str) or not rule_id:
            raise bad(f'rules[{i}] has no "id"')
        status = rule.get("status")
        if not isinstance(status, str) or not status:
            raise bad(f'rule {rule_id} (rules[{i}]) has no "status"')
        if rule_id in report.rules:
            raise bad(f"rule {rule_id} appears twice")
        expectation = rule.get("expectation")
        if expectation is not None and not isinstance(expectation, dict):
            raise bad(f'rule {rule_id}: "expectation" is neither null nor an object')
        tests = rule.get("tests") or []
        if not isinstance(tests, list):
            raise bad(f'rule {rule_id}: "tests" is not a list')
        level = rule.get("level")
        modes = rule.get("modes")
        report.rules[rule_id] = Rule(
            id=rule_id, title=_text(rule.get("title")), area=_text(rule.get("area")) or area_of(rule_id),
            level=_text(level) or None, status=status, expectation=expectation,
            tests=[t for t in tests if isinstance(t, dict)], modes=modes if isinstance(modes, dict) else None)
    return report


def load_report(path: str) -> Report:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ReportError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ReportError(f"{path}: not UTF-8 text: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    return parse_report(data, path)


# --- the model of the page ------------------------------------------------------------------------

@dataclass
class Row:
    id: str
    title: str
    area: str
    level: str | None
    modes: dict | None = None  # from the first report that gives them


def modes_text(modes: dict | None) -> tuple[str, str]:
    """(the row's line, its title attribute) for a rule's mode coverage: ``path × staged: 14/16 pairs``, the
    uncovered pairs by name in the title; ("", "") for a report without modes."""
    if not modes or not _text(modes.get("declared")):
        return "", ""
    declared, required = _text(modes["declared"]), modes.get("required") or 0
    if not required:
        return f"modes: {declared}", ""
    uncovered = [_text(u) for u in modes.get("uncovered") or []]
    what = "pairs" if " × " in declared else "values"
    line = f"modes: {modes.get('covered', 0)}/{required} {what} covered"
    tip = f"{declared}" + (f"\nuncovered: {', '.join(uncovered)}" if uncovered else "\nevery pair covered")
    return line, tip


def rows_of(reports: list[Report]) -> list[Row]:
    """The union of the reports' rules: first report's order, then each later report's new rules;
    grouped by area, areas in order of first appearance (stable within an area). Title, area and level
    come from the first report that gives them."""
    rows: dict[str, Row] = {}
    for report in reports:
        for rule in report.rules.values():
            row = rows.get(rule.id)
            if row is None:
                rows[rule.id] = Row(rule.id, rule.title, rule.area, rule.level, rule.modes)
                continue
            row.title = row.title or rule.title
            row.level = row.level or rule.level
            row.modes = row.modes or rule.modes
    area_order: dict[str, int] = {}
    for row in rows.values():
        area_order.setdefault(row.area, len(area_order))
    return sorted(rows.values(), key=lambda r: area_order[r.area])


def cell_class(rule: Rule | None, row: Row) -> str:
    if rule is None:
        return "absent"
    if rule.status == "failed":
        level = rule.level or row.level
        return f"failed-{level}" if level in LEVELS else "failed-unknown"
    return STATUS_CLASS.get(rule.status, "unknown")


def _kind(expectation: dict | None) -> str:
    return _text((expectation or {}).get("kind"))


def cell_text(cls: str, rule: Rule | None) -> str:
    label = CELL_KINDS[cls][0]
    if cls in ("expected-failure", "unexpected-pass") and _kind(rule.expectation):
        return f"{label} ({_kind(rule.expectation)})"
    if cls == "unknown":
        return f"{label}: {rule.status}"
    return label


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit - 1] + "…"


def cell_tooltip(cls: str, rule: Rule | None, report: Report) -> str:
    """The cell's title attribute: what a reader needs to act on it without opening the JSON."""
    if rule is None:
        return f"{report.path} has no result for this rule"
    lines = []
    exp = rule.expectation
    if exp:
        head = "expected to fail"
        if _kind(exp):
            head += f" ({_kind(exp)})"
        lines.append(f"{head}: {_text(exp.get('reason')) or 'no reason given'}")
        if exp.get("link"):
            lines.append(_text(exp["link"]))
    statuses = Counter(_text(t.get("status")) or "not run" for t in rule.tests)
    if rule.tests:
        lines.append(f"{len(rule.tests)} test(s): " + ", ".join(f"{n} {s}" for s, n in statuses.most_common()))
    shown = 0
    for t in rule.tests:
        message = _text(t.get("message"))
        if message and t.get("status") != "passed" and shown < MAX_MESSAGES:
            lines.append(f"{_text(t.get('nodeid')).rsplit('::', 1)[-1]}: {_clip(message, MAX_MESSAGE)}")
            shown += 1
    more = sum(1 for t in rule.tests if _text(t.get("message")) and t.get("status") != "passed") - shown
    if more > 0:
        lines.append(f"... and {more} more message(s)")
    return "\n".join(lines)


# A path, kept to its last directory and file name (stand-ins of several generations share a file name).
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][^\s\\/()\[\]]+)*?((?:[\\/][^\s\\/()\[\]]+)?[\\/][^\s\\/()\[\]]+)(?=[\s()\[\]]|$)")
_HEX = re.compile(r"\b([0-9a-fA-F]{8})[0-9a-fA-F]{4,}\b")


def short_version(version: str, limit: int = SHORT_VERSION) -> str:
    """A version for a column heading: its first ``;``-separated part (the rest describes it), paths cut
    to their last directory and file name, long hashes to 8 digits, the whole to ``limit`` characters. The full one goes
    in the heading's title attribute."""
    s = _PATH.sub(lambda m: m.group(1).lstrip("/\\"), version.split(";", 1)[0].strip())
    s = _HEX.sub(lambda m: m.group(1), s)
    s = re.sub(r"\s+", " ", s)
    return _clip(s, limit) if s else "?"


# --- HTML -----------------------------------------------------------------------------------------

def esc(value) -> str:
    return html.escape(_text(value), quote=True)


def title_html(title: str) -> str:
    """A SPEC title as HTML: escaped, with its `code` spans (Markdown backticks) set as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(title))


def breakable(text: str) -> str:
    """Escaped text that a narrow column may wrap after ``_``, ``/`` or ``.`` rather than mid-word."""
    return re.sub(r"([_/.])(?=\w)", r"\1<wbr>", esc(text))


def _safe_link(url: str) -> bool:
    return bool(re.match(r"https?://", url, re.IGNORECASE))


CSS = """
:root { --line: #d0d7de; --muted: #57606a; --head: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", "DejaVu Sans", sans-serif;
       color: #1f2328; margin: 16px 24px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; }
p.sub { color: var(--muted); margin: 0 0 12px; }
code, .rid { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, "DejaVu Sans Mono", monospace; }
table.matrix { border-collapse: separate; border-spacing: 0; table-layout: fixed; }
table.matrix th, table.matrix td { border-right: 1px solid var(--line); border-bottom: 1px solid var(--line);
       padding: 4px 8px; vertical-align: top; }
table.matrix thead th { background: var(--head); text-align: left; }
table.matrix thead tr.impls th { position: sticky; top: 0; z-index: 2; border-top: 1px solid var(--line);
       border-bottom: 2px solid #8c959f; }
table.matrix th.rule { position: sticky; left: 0; z-index: 1; background: #fff;
       border-left: 1px solid var(--line); text-align: left; font-weight: normal; }
table.matrix thead th.rule { background: var(--head); font-weight: 600; }
table.matrix thead tr.impls th.rule { z-index: 3; }
th.impl .name { font-weight: 600; display: block; }
th.impl .version { font-weight: normal; color: var(--muted); font-size: 12px; display: block;
       overflow-wrap: anywhere; }
tr.counts th { font-weight: normal; font-size: 12px; }
tr.counts dl { display: grid; grid-template-columns: 1fr auto; gap: 0 8px; margin: 0; }
tr.counts dd { margin: 0; text-align: right; font-variant-numeric: tabular-nums; font-weight: 600; }
tr.counts .zero { color: #8c959f; font-weight: normal; }
tr.area th { background: #eaeef2; text-align: left; font-size: 13px; }
tr.area th.rule { background: #eaeef2; font-weight: 700; }
tr.area td { background: #eaeef2; font-size: 12px; color: var(--muted); font-variant-numeric: tabular-nums; }
.rid { font-size: 12.5px; font-weight: 600; display: block; overflow-wrap: anywhere; }
.rtitle { display: block; color: #31363c; font-size: 13px; }
.modes { display: block; color: #57606a; font-size: 11px; }
.modes.gap { color: #9a6700; }
.level { display: inline-block; font-size: 11px; border-radius: 8px; padding: 0 6px; margin-left: 6px;
       border: 1px solid var(--line); color: var(--muted); font-weight: normal; vertical-align: 1px; }
.level.lv-contract { border-color: #0969da; color: #0969da; }
.level.lv-hardening { border-color: #8c959f; color: #57606a; }
.rtitle code { font-size: 12px; background: #eff1f3; border-radius: 3px; padding: 0 3px; }
td.cell { font-size: 13px; overflow-wrap: anywhere; }
td.cell a { color: inherit; }
.passed { background: #dafbe1; color: #116329; }
.failed-contract { background: #cf222e; color: #fff; font-weight: 700; }
.failed-hardening { background: #ffd8b5; color: #7a2e0b; font-weight: 600; }
.failed-unknown { background: #ff8182; color: #5c0a10; font-weight: 700; }
.error { background: #8250df; color: #fff; font-weight: 600; }
.unexpected-pass { background: #ffebe9; color: #a40e26; font-weight: 700; outline: 2px dashed #cf222e;
       outline-offset: -3px; }
.expected-failure { background: #fff8c5; color: #6f5200; }
.not-applicable { background: #f6f8fa; color: #6e7781; }
.skipped { background: #f6f8fa; color: #6e7781; font-style: italic; }
.absent { background: repeating-linear-gradient(135deg, #fff 0 6px, #eaeef2 6px 8px); color: #8c959f; }
.unknown { background: #fff; color: #1f2328; outline: 2px solid #1f2328; outline-offset: -3px; }
.legend { margin: 18px 0; }
.legend h2 { font-size: 16px; margin: 0 0 6px; }
.legend table { border-collapse: collapse; }
.legend td { padding: 3px 8px; border: 1px solid var(--line); font-size: 13px; }
.legend td.swatch { width: 170px; white-space: nowrap; }
"""


def page_head(title: str, css: str) -> list[str]:
    """The opening lines of a standalone page (doctype to the ``<h1>``), the matrix's and the history's."""
    return ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{esc(title)}</title><style>{css}</style></head><body>", f"<h1>{esc(title)}</h1>"]


def render(reports: list[Report], title: str = "Conformance matrix") -> str:
    rows = rows_of(reports)
    # grid[i][j]: (class, rule or None) of row i, report j
    grid = [[(cell_class(rep.rules.get(row.id), row), rep.rules.get(row.id)) for rep in reports] for row in rows]
    per_col = [Counter(grid[i][j][0] for i in range(len(rows))) for j in range(len(reports))]
    shown_counts = [(k, label) for k, label in COUNTS
                    if k in ALWAYS_COUNTED or any(c[k] for c in per_col)]

    out = page_head(title, CSS)
    w = out.append
    suites = sorted({_text(r.run_info.get('suite_version')) for r in reports} - {""})
    w(f'<p class="sub">{len(rows)} rules by {len(reports)} implementation run(s)'
      + (f"; suite version {esc(', '.join(suites))}" if suites else "")
      + ". Hover a cell for its tests' messages, a heading for the full version.</p>")

    ncols = len(reports)
    w(f'<table class="matrix" style="width:{RULE_WIDTH + IMPL_WIDTH * ncols}px">')
    w(f'<colgroup><col class="rule" style="width:{RULE_WIDTH}px">'
      + f'<col class="impl" style="width:{IMPL_WIDTH}px">' * ncols + "</colgroup>")
    w("<thead><tr class=\"impls\"><th class=\"rule\" scope=\"col\">rule</th>")
    for j, rep in enumerate(reports):
        info = rep.run_info
        tip = [f"{rep.implementation} {rep.version}".strip(), f"report: {rep.path}"]
        if info.get("suite_version") is not None:
            tip.append(f"suite {_text(info.get('suite_version'))}")
        caps = info.get("capabilities")
        if isinstance(caps, list):
            tip.append("capabilities: " + (", ".join(_text(c) for c in caps) or "none"))
        w(f'<th class="impl" scope="col" data-col="{j}" title="{esc(chr(10).join(tip))}">'
          f'<span class="name">{esc(rep.implementation)}</span>'
          f'<span class="version">{breakable(short_version(rep.version))}</span></th>')
    w("</tr><tr class=\"counts\"><th class=\"rule\">counts (rules)</th>")
    for j, counts in enumerate(per_col):
        w(f'<th class="impl" data-col="{j}"><dl>')
        for key, label in shown_counts:
            n = counts[key]
            zero = ' class="zero"' if n == 0 else ""
            w(f'<dt{zero}>{esc(label)}</dt><dd{zero} data-count="{key}">{n}</dd>')
        w("</dl></th>")
    w("</tr></thead><tbody>")

    current_area = None
    for i, row in enumerate(rows):
        if row.area != current_area:
            current_area = row.area
            members = [k for k, r in enumerate(rows) if r.area == row.area]
            plural = "rule" if len(members) == 1 else "rules"
            w(f'<tr class="area" data-area="{esc(row.area)}"><th class="rule" scope="rowgroup">'
              f"{esc(row.area)} ({len(members)} {plural})</th>")
            for j in range(ncols):
                c = Counter(grid[k][j][0] for k in members)
                failing = c["failed-contract"] + c["failed-hardening"] + c["failed-unknown"] + c["error"] + c["unexpected-pass"]
                bits = [f"{c['passed']} passed"]
                if failing:
                    bits.append(f"{failing} failing")
                if c["expected-failure"]:
                    bits.append(f"{c['expected-failure']} expected")
                if c["not-applicable"]:
                    bits.append(f"{c['not-applicable']} n/a")
                w(f'<td data-col="{j}">{esc(", ".join(bits))}</td>')
            w("</tr>")
        level = row.level or "?"
        level_cls = f"lv-{row.level}" if row.level in LEVELS else "lv-unknown"
        w(f'<tr id="{esc(row.id)}" data-rule="{esc(row.id)}"><th class="rule" scope="row">'
          f'<span class="rid">{esc(row.id)}<span class="level {level_cls}">{esc(level)}</span></span>'
          f'<span class="rtitle">{title_html(row.title)}</span>'
          + (lambda line, tip: f'<span class="modes{" gap" if "uncovered" in tip else ""}" title="{esc(tip)}">'
             f'{esc(line)}</span>' if line else "")(*modes_text(row.modes)) + "</th>")
        for j, rep in enumerate(reports):
            cls, rule = grid[i][j]
            text = esc(cell_text(cls, rule))
            exp = rule.expectation if rule is not None else None
            link = _text((exp or {}).get("link"))
            if cls in ("expected-failure", "unexpected-pass") and link and _safe_link(link):
                text = f'<a href="{esc(link)}">{text}</a>'
            w(f'<td class="cell {cls}" data-rule="{esc(row.id)}" data-col="{j}" '
              f'title="{esc(cell_tooltip(cls, rule, rep))}">{text}</td>')
        w("</tr>")
    w("</tbody></table>")

    w('<section class="legend"><h2>Legend</h2><table>')
    for cls, (label, meaning) in CELL_KINDS.items():
        if cls in ("failed-unknown", "unknown") and not any(c[cls] for c in per_col):
            continue
        w(f'<tr><td class="swatch {cls}">{esc(label)}</td><td>{esc(meaning)}</td></tr>')
    w('<tr><td class="swatch"><span class="level lv-contract">contract</span></td>'
      "<td>a rule of the contract: failing it breaks callers</td></tr>")
    w('<tr><td class="swatch"><span class="level lv-hardening">hardening</span></td>'
      "<td>a robustness rule beyond the contract: failing it is a weakness, not a break</td></tr>")
    w('<tr><td class="swatch"><span class="level lv-unknown">?</span></td>'
      "<td>the report does not say the rule's level (a report from before levels)</td></tr>")
    w("</table></section>")
    w("</body></html>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.matrix",
        description="Render conformance reports (pytest conformance --conformance-report=R.json) as one "
                    "static HTML page: rules by implementation.")
    parser.add_argument("reports", nargs="+", metavar="REPORT.json", help="conformance reports, one column each")
    parser.add_argument("-o", "--output", default="-", metavar="HTML",
                        help="where to write the page (default: standard output)")
    parser.add_argument("--title", default="Conformance matrix", help="the page's title")
    args = parser.parse_args(argv)
    try:
        reports = [load_report(p) for p in args.reports]
    except ReportError as e:
        parser.error(str(e))
    page = render(reports, title=args.title)
    if args.output == "-":
        sys.stdout.write(page)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        parser.error(f"{args.output}: cannot write: {e.strerror or e}")
    print(f"matrix of {len(reports)} report(s) written to {os.path.abspath(args.output)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
