# The conformance plugin is registered here (not in conformance/conftest.py) so that `--impl` is
# known whether pytest is started from the repo root or from conformance/ (pytest issue #9337).
pytest_plugins = ["conformance.plugin"]
