# The conformance plugin: registered here too (not in conformance/conftest.py) so that `--impl` is known whether
# pytest is started from the repo root or from conformance/ (pytest issue #9337) in a checkout that is not
# installed. Installed (pip install -e . included), it is the pytest11 entry point of the same name, and this entry
# finds it registered and does nothing.
# conformance.mutmut_hits: inert unless mutmut records which tests reach which function (mutation/report.py).
pytest_plugins = ["conformance.plugin", "conformance.mutmut_hits"]
