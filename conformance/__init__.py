"""Conformance suite for inference-side dynamic weight updates. Run: pytest conformance --impl=NAME.

PYTEST_DONT_REWRITE (this module only; it has no asserts): ``weightsync-conformance`` imports it before pytest
starts, and pytest warns about an imported module of a plugin's distribution it can no longer rewrite."""
SUITE_VERSION = "0.1.0"
# Bumped whenever the adapter protocol or runner semantics change.
SUITE_PROTOCOL = 1
