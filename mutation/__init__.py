"""Mutation testing of ``reference/`` with the conformance suite as its tests (mutmut 3).

``python -m mutation.report --run`` runs mutmut and writes ``mutation/REPORT.md``; survivors that no test
can kill are listed, each with its reason, in ``mutation/justified.toml``.
"""
