"""Every count the docs state that a test can check is checked against what it counts.

* docs/adapters.md: the worked example's score (rules passed, not applicable, nothing else), against the example's
  full run (tests/conftest.py ``example_report``: the background job, not a second run).
* docs/mutation.md: the current figures' table, against the report files it names (mutation/*.md).

Measured figures (times, ratios, a dated run of files outside the repository) are stated with their date and the
command that reproduces them instead (docs/benchmarks.md, docs/suite-run-time.md).
"""
from __future__ import annotations

import os
import re

import pytest

from tests.conftest import REPO

SCORE = re.compile(r"(\d+) rules passed, (\d+) not applicable, 0 in every other column")


def _read(*path: str) -> str:
    with open(os.path.join(REPO, *path), encoding="utf-8") as f:
        return f.read()


def test_the_adapters_page_states_the_examples_score():
    assert len(SCORE.findall(_read("docs", "adapters.md"))) == 1, "docs/adapters.md states the example's score once"


@pytest.mark.timeout(600)
def test_the_examples_score_is_the_one_docs_state(example_report):
    code, report, output = example_report
    assert report is not None, f"the example's run wrote no report (exit {code}):\n{output[-3000:]}"
    (stated,) = SCORE.findall(_read("docs", "adapters.md"))
    rules = report["summary"]["rules"]
    actual = (rules["passed"], rules["not_applicable"])
    others = {k: v for k, v in rules.items() if k not in ("passed", "not_applicable") and v}
    assert tuple(map(int, stated)) == actual and not others, (
        f"docs/adapters.md says the example ends with {stated[0]} rules passed, {stated[1]} not applicable, 0 in every "
        f"other column; its run gives {actual[0]} passed, {actual[1]} not applicable and {others or 'no other'}: "
        "correct the page (its first code block)")


# -- mutation figures ------------------------------------------------------------------------------------------------
def _tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table of a page, each a list of rows (header -> cell, cells stripped of ** and %)."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip().replace("*", "") for c in lines[i].strip().strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _figures_of(report_file: str) -> dict[str, str]:
    """The current row of a mutation report's first table (``now``, or its only row), by the docs' column names."""
    table = _tables(_read("mutation", report_file))[0]
    row = next((r for r in table if r.get("", "") == "now"), table[-1])
    return {
        "mutants": row["mutants"],
        "detected": row.get("detected") or row.get("killed"),
        "equivalent": row.get("equivalent", "-"),
        "out of scope": row.get("out of scope", "-"),
        "unjustified": row.get("unjustified survivors") or row.get("unjustified"),
        "score": (row.get("score") or "-").split(" ")[0],
    }


def test_the_mutation_figures_are_the_reports():
    (table,) = [t for t in _tables(_read("docs", "mutation.md")) if t and "report" in t[0]]
    assert len(table) >= 3, table
    for row in table:
        link = re.search(r"\]\(\.\./mutation/(\w+\.md)\)", row["report"])
        assert link, f"docs/mutation.md: a figures row names no report file: {row}"
        stated = {k: row[k] for k in ("mutants", "detected", "equivalent", "out of scope", "unjustified", "score")}
        actual = _figures_of(link.group(1))
        assert stated == actual, f"docs/mutation.md states {stated} for mutation/{link.group(1)}, which says {actual}"


def test_the_prose_figures_of_the_complete_run_are_the_reports():
    """The sentence under the table repeats REPORT.md's detected-over-all share and its baseline."""
    page, report = _read("docs", "mutation.md"), _read("mutation", "REPORT.md")
    now = next(r for r in _tables(report)[0] if r[""] == "now")
    before = next(r for r in _tables(report)[0] if r[""].startswith("before"))
    assert f"{now['detected / all']} of all mutants were detected" in page, now
    assert f"{before['mutants']} mutants gave {before['score']}" in page, before
