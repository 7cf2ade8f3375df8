"""history.html: rules (rows) by versions (columns, in commit order), each verdict change marked.

The cells, their colours, tooltips and the rule headings are conformance.matrix's; this page adds the
version headings (id, date, title), a cell mark at every change naming the commit and its title, a
list of the changes above the table, and columns for versions the suite could not run.
"""
from __future__ import annotations

from collections import Counter

from .. import matrix
from ..matrix import CELL_KINDS, LEVELS, RULE_WIDTH, cell_class, cell_text, cell_tooltip, esc, page_head, title_html

COLUMN_WIDTH = 150
TITLE_IN_CELL = 60  # characters of a commit title shown in a changed cell (the tooltip has it whole)
NO_REPORT = {"usage_error": "usage error", "crashed": "crashed", "timed_out": "timed out", None: "not run"}

CSS = matrix.CSS + """
td.cell.change { box-shadow: inset 4px 0 0 #0969da; }
td.cell.regression { outline: 3px solid #cf222e; outline-offset: -3px; }
td.cell .chg { display: block; font-size: 11px; font-weight: normal; margin-top: 2px; }
td.cell .chg code { font-size: 11px; }
td.norun { background: #eaeef2; color: #57606a; font-style: italic; font-size: 12px; }
th.impl .date { font-weight: normal; color: var(--muted); font-size: 11px; display: block; }
th.impl.norun { background: #eaeef2; }
table.changes { border-collapse: collapse; margin: 8px 0 18px; }
table.changes td, table.changes th { border: 1px solid var(--line); padding: 3px 8px; font-size: 13px;
       text-align: left; vertical-align: top; }
"""


def _arrow(old: str, new: str) -> str:
    return f"{old} → {new}"


def render(title: str, versions, results: dict, rows, reports, verdicts, changes, source: str,
           regressions=None) -> str:
    """The page. ``results`` maps a version's index to its runs.Result (absent: not run); ``regressions``
    (the gate's, gate.judge), when given, are listed first and their cells outlined in red."""
    at = {(c.rule, c.index): c for c in changes}
    worse = {(r.rule, r.index): r for r in regressions or []}
    out = page_head(title, CSS)
    w = out.append
    runs = sum(1 for r in reports if r is not None)
    w(f'<p class="sub">{len(rows)} rules by {len(versions)} versions of {esc(source)} (oldest first), '
      f"{runs} with a report; {len(changes)} verdict change(s). A blue bar marks a cell whose verdict differs "
      "from the previous version with a report. Hover a cell for its tests' messages.</p>")

    if regressions is not None:
        w('<h2 style="font-size:16px">Regressions (the gate)</h2>')
        if regressions:
            w('<table class="changes regressions"><thead><tr><th>at</th><th>title</th><th>rule</th><th>verdict</th>'
              "<th>was, at</th><th>failing tests</th></tr></thead><tbody>")
            for r in regressions:
                v = versions[r.index]
                tests = "<br>".join(f"<code>{esc(t)}</code>: {esc(m.splitlines()[0] if m else '')}"
                                    for t, m in r.failures[:3])
                w(f'<tr data-rule="{esc(r.rule)}" data-col="{r.index}"><td><code>{esc(v.id)}</code></td>'
                  f'<td>{esc(v.title)}</td><td><a href="#{esc(r.rule)}"><code>{esc(r.rule)}</code></a></td>'
                  f"<td>{esc(_arrow(r.old, r.new))}</td><td><code>{esc(versions[r.before].id)}</code></td>"
                  f"<td>{tests}</td></tr>")
            w("</tbody></table>")
        else:
            w("<p>No rule's verdict got worse from one version to the next.</p>")

    w('<h2 style="font-size:16px">Verdict changes</h2>')
    if changes:
        w('<table class="changes"><thead><tr><th>rule</th><th>verdict</th><th>at</th><th>date</th>'
          "<th>title</th><th>previous</th></tr></thead><tbody>")
        for c in changes:
            v = versions[c.index]
            w(f'<tr data-rule="{esc(c.rule)}" data-col="{c.index}"><td><a href="#{esc(c.rule)}"><code>'
              f"{esc(c.rule)}</code></a></td><td>{esc(_arrow(c.old, c.new))}</td><td><code>{esc(v.id)}</code></td>"
              f"<td>{esc(v.date)}</td><td>{esc(v.title)}</td><td><code>{esc(versions[c.before].id)}</code></td></tr>")
        w("</tbody></table>")
    else:
        w("<p>No rule's verdict changes between the versions with a report.</p>")

    ncols = len(versions)
    w(f'<table class="matrix" style="width:{RULE_WIDTH + COLUMN_WIDTH * ncols}px">')
    w(f'<colgroup><col class="rule" style="width:{RULE_WIDTH}px">'
      + f'<col class="impl" style="width:{COLUMN_WIDTH}px">' * ncols + "</colgroup>")
    w('<thead><tr class="impls"><th class="rule" scope="col">rule</th>')
    for v, report in zip(versions, reports):
        result = results.get(v.index)
        tip = [v.id + (f" ({v.commit})" if v.commit else ""), v.date, v.title, v.path, f"sha256 {v.sha256}"]
        norun = ""
        if report is None:
            norun = " norun"
            outcome = getattr(result, "outcome", None)
            tip.append(f"{NO_REPORT.get(outcome, outcome)}: {getattr(result, 'message', '')}".strip())
        w(f'<th class="impl{norun}" scope="col" data-col="{v.index}" title="{esc(chr(10).join(tip))}">'
          f'<span class="name">{esc(v.id)}</span><span class="date">{esc(v.date[:10])}</span>'
          f'<span class="version">{esc(matrix._clip(v.title, TITLE_IN_CELL))}</span></th>')
    w("</tr></thead><tbody>")

    current_area = None
    for i, row in enumerate(rows):
        if row.area != current_area:
            current_area = row.area
            members = sum(1 for r in rows if r.area == row.area)
            w(f'<tr class="area" data-area="{esc(row.area)}"><th class="rule" scope="rowgroup">'
              f'{esc(row.area)} ({members} {"rule" if members == 1 else "rules"})</th>'
              + "".join(f'<td data-col="{j}"></td>' for j in range(ncols)) + "</tr>")
        level = row.level or "?"
        level_cls = f"lv-{row.level}" if row.level in LEVELS else "lv-unknown"
        w(f'<tr id="{esc(row.id)}" data-rule="{esc(row.id)}"><th class="rule" scope="row">'
          f'<span class="rid">{esc(row.id)}<span class="level {level_cls}">{esc(level)}</span></span>'
          f'<span class="rtitle">{title_html(row.title)}</span></th>')
        for v, report in zip(versions, reports):
            if report is None:
                outcome = getattr(results.get(v.index), "outcome", None)
                w(f'<td class="cell norun" data-rule="{esc(row.id)}" data-col="{v.index}">'
                  f"{esc(NO_REPORT.get(outcome, outcome))}</td>")
                continue
            rule = report.rules.get(row.id)
            cls = cell_class(rule, row)
            tip = cell_tooltip(cls, rule, report)
            mark = ""
            change = at.get((row.id, v.index))
            if (row.id, v.index) in worse:
                cls += " regression"
            if change is not None:
                cls += " change"
                tip = f"changed at {v.id}: {v.title} ({_arrow(change.old, change.new)} since " \
                      f"{versions[change.before].id})\n" + tip
                mark = (f'<span class="chg" data-change="{esc(v.id)}">changed at <code>{esc(v.id)}</code>: '
                        f"{esc(matrix._clip(v.title, TITLE_IN_CELL))}</span>")
            w(f'<td class="cell {cls}" data-rule="{esc(row.id)}" data-col="{v.index}" '
              f'title="{esc(tip)}">{esc(cell_text(cls.split()[0], rule))}{mark}</td>')
        w("</tr>")
    w("</tbody></table>")

    shown = Counter(cell_class(r.rules.get(row.id), row) for r in reports if r is not None for row in rows)
    w('<section class="legend"><h2>Legend</h2><table>')
    for cls, (label, meaning) in CELL_KINDS.items():
        if cls in ("failed-unknown", "unknown") and not shown[cls]:
            continue
        w(f'<tr><td class="swatch {cls}">{esc(label)}</td><td>{esc(meaning)}</td></tr>')
    w('<tr><td class="swatch cell change">changed at …</td><td>the verdict differs from the previous version '
      "with a report: the commit and its title</td></tr>")
    w('<tr><td class="swatch norun">usage error</td><td>the suite could not drive this version (the adapter '
      "said why: the column's tooltip); crashed / timed out: the run ended without a report</td></tr>")
    w("</table></section>")
    w("</body></html>")
    return "\n".join(out) + "\n"
