"""Conformance history: the suite run on every version of an implementation's file (regression reproduction).

    python -m conformance.history --repo REPO --path fastdeploy/rl/dynamic_weight_manager.py -o OUT [--rule ID]
    python -m conformance.history --versions DIR [--manifest M.json] -o OUT [--rule ID]
    python -m conformance.history ... --bisect RULE [--from VERDICT] [--to VERDICT]

versions.py reads the versions (git or a folder), runs.py runs the suite once per distinct content in
child processes (parallel, cached by content and suite hash, resumable), verdicts.py finds the changes
and bisects, page.py renders history.html, cli.py is the command line.
"""
