# The conformance plugin is registered here (not in conformance/conftest.py) so that `--impl` is
# known whether pytest is started from the repo root or from conformance/ (pytest issue #9337).
# conformance.mutmut_hits: inert unless mutmut records which tests reach which function (mutation/report.py).
pytest_plugins = ["conformance.plugin", "conformance.mutmut_hits"]
