"""Adapters for implementations other than the reference (``--impl=fastdeploy``)."""
