"""Benchmarks run as scripts (``python -m benchmarks.<name>``), not as timed tests."""
