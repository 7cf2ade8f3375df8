"""Conformance suite for inference-side dynamic weight updates. Run: pytest conformance --impl=NAME."""
SUITE_VERSION = "0.1.0"
# Bumped whenever the adapter protocol or runner semantics change.
SUITE_PROTOCOL = 1
