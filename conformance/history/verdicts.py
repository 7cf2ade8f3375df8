"""Verdicts per rule per version, the changes between versions, and the search for a rule's first change.

Pure functions over the versions and their suite results (``runs.Result``), apart from ``bisect``,
which asks for results one at a time through a callable so that only the versions it needs are run.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..matrix import Report, ReportError, parse_report, rows_of
from .versions import HistoryError, Version

ABSENT = "absent"  # the version's report has no result for the rule (a selection or generation without it)


def report_of(version: Version, result) -> Report | None:
    """The suite's report of a version as conformance.matrix reads it, or None when the run wrote none."""
    if result is None or result.outcome != "report":
        return None
    try:
        return parse_report(result.report, f"{version.id}")
    except ReportError as e:
        raise HistoryError(f"version {version.id}: the suite's report is malformed: {e}") from None


def verdict_of(result, rule_id: str) -> str:
    """A rule's verdict in one run: the rule's status in the report, ``absent``, or the outcome of a run
    without a report (``usage_error``, ``crashed``, ``timed_out``)."""
    if result.outcome != "report":
        return result.outcome
    for rule in result.report.get("rules", []):
        if rule.get("id") == rule_id:
            return rule.get("status") or ABSENT
    return ABSENT


@dataclass
class Change:
    rule: str
    index: int  # the version whose verdict differs from the version before it that has a report
    before: int
    old: str
    new: str

    def to_json(self, versions: list[Version]) -> dict:
        v, b = versions[self.index], versions[self.before]
        return {"rule": self.rule, "version": v.index, "id": v.id, "commit": v.commit, "date": v.date,
                "title": v.title, "from": self.old, "to": self.new, "previous": b.id}


def table(versions: list[Version], results: dict[int, object]):
    """(rows, reports, verdicts, changes): the rules (matrix rows, in the first report's order grouped by
    area), each version's Report or None, verdicts[rule][i] (None where version i has no report), and the
    changes: a rule's verdict at a version that differs from the last earlier version with a report."""
    reports = [report_of(v, results.get(v.index)) for v in versions]
    rows = rows_of([r for r in reports if r is not None])
    verdicts: dict[str, list[str | None]] = {}
    changes: list[Change] = []
    for row in rows:
        line: list[str | None] = []
        last: tuple[int, str] | None = None
        for i, report in enumerate(reports):
            if report is None:
                line.append(None)
                continue
            rule = report.rules.get(row.id)
            verdict = rule.status if rule is not None else ABSENT
            line.append(verdict)
            if last is not None and last[1] != verdict:
                changes.append(Change(row.id, i, last[0], last[1], verdict))
            last = (i, verdict)
        verdicts[row.id] = line
    changes.sort(key=lambda c: (c.index, [r.id for r in rows].index(c.rule)))
    return rows, reports, verdicts, changes


@dataclass
class Bisection:
    rule: str
    found: bool
    index: int | None  # the first version whose verdict is "changed"
    before: int | None  # the version just before it
    old: str | None
    new: str | None
    probed: list[tuple[int, str]]  # (version, verdict), in the order asked
    message: str


def bisect(versions: list[Version], rule: str, verdict_at, want_from: str | None = None,
           want_to: str | None = None, prefetch=None) -> Bisection:
    """The first version whose verdict of ``rule`` has changed, by binary search: "changed" is a verdict
    equal to ``want_to`` when given, else one different from ``want_from`` when given, else one different
    from the first version's. Like ``git bisect`` it assumes one change between the first and the last
    version (a verdict that changes and changes back in between may be missed: the full run shows all).
    ``verdict_at(i)`` runs (or reads from the cache) version i and returns the rule's verdict there;
    ``prefetch(indices)``, when given, may run the first and the last version at once beforehand."""
    probed: list[tuple[int, str]] = []
    seen: dict[int, str] = {}

    def at(i: int) -> str:
        if i not in seen:
            seen[i] = verdict_at(i)
            probed.append((i, seen[i]))
        return seen[i]

    first, last = 0, len(versions) - 1
    if prefetch is not None:
        prefetch(sorted({first, last}))
    start = at(first)
    if want_to is not None:
        changed = lambda v: v == want_to  # noqa: E731
        goal = f"verdict {want_to}"
    else:
        reference = want_from if want_from is not None else start
        changed = lambda v: v != reference  # noqa: E731
        goal = f"a verdict other than {reference}"
    if want_from is not None and start != want_from:
        return Bisection(rule, False, None, None, None, None, probed,
                         f"the first version, {versions[first].id}, has {rule} {start}, not {want_from}: "
                         "start the range where the verdict is --from")
    if changed(start):
        return Bisection(rule, False, None, None, None, None, probed,
                         f"the first version, {versions[first].id}, already has {goal} ({rule}: {start}): "
                         "nothing to search; start the range earlier")
    end = at(last) if last != first else start
    if not changed(end):
        return Bisection(rule, False, None, None, None, None, probed,
                         f"no version from {versions[first].id} to {versions[last].id} was found with {goal}: "
                         f"{rule} is {start} at the first and {end} at the last (a change that is undone in "
                         "between is in the full run's history.html)")
    good, bad = first, last
    while bad - good > 1:
        mid = (good + bad) // 2
        if changed(at(mid)):
            bad = mid
        else:
            good = mid
    old, new = at(good), at(bad)
    message = f"{rule}: {old} -> {new} at {versions[bad].id}"
    if want_from is not None and old != want_from:
        message += f" (the version before it has {old}, not {want_from})"
    return Bisection(rule, True, bad, good, old, new, probed, message)
