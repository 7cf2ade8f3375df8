"""The pull-request gate (``--fail-on-regression``): each version against the one before it, and the rules
whose verdict got worse.

A rule *regresses* at a version when its verdict there is ``failed`` or ``error`` and its last judged
verdict before it was ``passed``, ``expected_failure`` or ``unexpected_pass`` (it passed, or failed only as
the ``--expectations`` file pins it: a pinned failure is ``expected_failure``, never a regression).
Versions without a report, and verdicts that judge nothing (``not_applicable``, ``skipped``, ``absent``),
are stepped over: a rule that passed, stopped being claimed and came back failing has regressed. Only the
versions from ``start`` on are judged (the range's commits; the first version is the base). Like the
suite's own run, the gate honours ``--fail-on contract``: a hardening rule's regression is listed but does
not fail it. A version of the range the suite could not judge (a usage error, a crash, a timeout) fails
the gate too, apart (``unjudged``): a commit the adapter cannot drive proves nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

GOOD = ("passed", "expected_failure", "unexpected_pass")
BAD = ("failed", "error")
NEUTRAL = ("not_applicable", "skipped", "absent")
MESSAGE_LINES = 3
EXIT_REGRESSION = 1
EXIT_UNJUDGED = 3


@dataclass
class Regression:
    rule: str
    index: int  # the version where the verdict got worse
    before: int  # the last version where the rule was judged
    old: str
    new: str
    title: str  # the rule's title
    failures: list  # [(nodeid, message)] of the rule's failing tests at ``index``
    level: str | None = None  # contract | hardening
    fails: bool = True  # False: a hardening rule under --fail-on contract (listed, not failing the gate)

    def to_json(self, versions) -> dict:
        v, b = versions[self.index], versions[self.before]
        return {"rule": self.rule, "title": self.title, "version": v.index, "id": v.id, "commit": v.commit,
                "date": v.date, "commit_title": v.title, "from": self.old, "to": self.new, "previous": b.id,
                "previous_commit": b.commit, "level": self.level, "fails_the_gate": self.fails,
                "failures": [{"test": t, "message": m} for t, m in self.failures]}


def _rules(result) -> dict[str, dict]:
    return {r.get("id"): r for r in (result.report or {}).get("rules", [])} if result.outcome == "report" else {}


def _failures(rule: dict) -> list[tuple[str, str]]:
    found = []
    for test in rule.get("tests", []):
        if test.get("status") in BAD:
            lines = [line for line in (test.get("message") or "").strip().splitlines() if line.strip()]
            found.append((test.get("nodeid", "?"), "\n".join(lines[:MESSAGE_LINES])))
    return found


def judge(versions, results: dict, start: int = 1) -> tuple[list[Regression], list[int]]:
    """(regressions in version order then rule order, indices of the versions from ``start`` without a report)."""
    rules = [_rules(results[v.index]) for v in versions]
    order: list[str] = []
    for by_id in rules:
        order += [r for r in by_id if r not in order]
    found = []
    for rule_id in order:
        last: tuple[int, str] | None = None
        for i, by_id in enumerate(rules):
            if results[versions[i].index].outcome != "report":
                continue
            rule = by_id.get(rule_id)
            verdict = (rule or {}).get("status") or "absent"
            if verdict in NEUTRAL:
                continue
            if i >= start and verdict in BAD and last is not None and last[1] in GOOD:
                fail_on = ((results[versions[i].index].report or {}).get("summary") or {}).get("fail_on", "all")
                level = rule.get("level")
                found.append(Regression(rule_id, i, last[0], last[1], verdict, rule.get("title", ""), _failures(rule),
                                        level, fail_on != "contract" or level != "hardening"))
            last = (i, verdict)
    found.sort(key=lambda r: (r.index, order.index(r.rule)))
    unjudged = [i for i, v in enumerate(versions) if i >= start and results[v.index].outcome != "report"]
    return found, unjudged


def describe(v) -> str:
    return f"{v.id} ({v.date[:10]}) {v.title!r}" if v.date else f"{v.id} {v.title!r}"


def report_lines(versions, results, regressions, unjudged, start: int) -> list[str]:
    """What the gate prints: each regression with its commit, rule, both verdicts and its tests' messages."""
    judged = len(versions) - start
    base = f"base {describe(versions[0])}" if start else "no base (the first version is judged against nothing)"
    lines = []
    failing = [r for r in regressions if r.fails]
    if regressions:
        lines.append(f"gate: {'FAILED' if failing else 'passed'}: {len(regressions)} rule verdict(s) got worse in "
                     f"{judged} version(s) ({base})" + ("" if len(failing) == len(regressions) else
                                                        f"; {len(regressions) - len(failing)} of them hardening "
                                                        "rules, which --fail-on contract lets pass") + ":")
        for r in regressions:
            v, b = versions[r.index], versions[r.before]
            lines.append(f"  {v.id}{f' {v.commit}' if v.commit else ''}  {v.title}")
            lines.append(f"    {r.rule}: {r.old} -> {r.new} (was {r.old} at {b.id}){f': {r.title}' if r.title else ''}"
                         + ("" if r.fails else " [hardening: not failing the gate]"))
            for test, message in r.failures[:3]:
                lines.append(f"      {test}")
                lines += [f"        {m}" for m in message.splitlines()]
            if len(r.failures) > 3:
                lines.append(f"      ... and {len(r.failures) - 3} more failing test(s) of {r.rule}")
    for i in unjudged:
        v, r = versions[i], results[versions[i].index]
        first = (r.message or "").strip().splitlines()
        lines.append(f"gate: {'FAILED' if not failing else 'also'}: no verdict for {v.id} {v.title!r}: "
                     f"{r.outcome.replace('_', ' ')}{f': {first[0]}' if first else ''}")
    if not regressions and not unjudged:
        lines.append(f"gate: passed: no rule's verdict got worse in {judged} version(s) ({base})")
    return lines


def exit_status(regressions, unjudged) -> int:
    return EXIT_REGRESSION if any(r.fails for r in regressions) else EXIT_UNJUDGED if unjudged else 0
