"""Reference implementation of the inference-side dynamic weight update (DynamicWeightManager)."""
from .errors import GpuIdError, SnapshotFormatError, UnsafePickleError
from .manager import DEFAULT_SHARED_DIR, LoadEvent, WeightManager
from .status import Status

__all__ = [
    "DEFAULT_SHARED_DIR",
    "GpuIdError",
    "LoadEvent",
    "SnapshotFormatError",
    "Status",
    "UnsafePickleError",
    "WeightManager",
]
__version__ = "0.1.0"
