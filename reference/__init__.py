"""Reference implementation of the inference-side dynamic weight update (DynamicWeightManager).

The names below are imported on first use, so that ``reference.digest`` (the digest both ends of an
update compute) can be imported by a trainer process without importing Paddle.
"""
import importlib

_EXPORTS = {
    "DEFAULT_SHARED_DIR": ".manager",
    "GpuIdError": ".errors",
    "LoadEvent": ".manager",
    "SnapshotFormatError": ".errors",
    "Status": ".status",
    "UnsafePickleError": ".errors",
    "WeightManager": ".manager",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
