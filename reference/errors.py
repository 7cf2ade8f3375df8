"""Errors that the reference raises beyond the builtin types the contract names.

Each subclasses the builtin type a caller of the contract already catches, so code written
against FastDeploy (``except ValueError``) keeps working, while tests can pin the exact class.
"""


class SnapshotFormatError(ValueError):
    """A snapshot file is not a readable safetensors/pickle file (truncated, corrupt, empty)."""


class UnsafePickleError(ValueError):
    """A pickle names a global outside the array-reconstruction allow-list; nothing was executed."""


class GpuIdError(ValueError):
    """CUDA_VISIBLE_DEVICES / FLAGS_selected_gpus do not name a physical GPU index."""


class SnapshotPermissionError(PermissionError):
    """A snapshot file exists but this process may not read it (EACCES): not a corrupt file."""


class SnapshotNotAFileError(ValueError):
    """A snapshot candidate exists at a priority level but is not a regular file (a directory, a
    dangling symlink, a FIFO, a device): the loader refuses to fall through to a lower level."""


class MetaError(ValueError):
    """A stored IPC meta that is malformed; the message names the tensor and the field."""


class OperationInProgressError(RuntimeError):
    """``clear()`` or ``update()`` called while another clear or update of the same session runs (from another
    thread, or from a hook inside it): refused at once, before it changed anything (SPEC LIFE-CONCURRENT)."""


def brief(value, limit: int = 80) -> str:
    """A short repr of an input value for an error message, whatever the value: a structure nested thousands of
    levels deep (a crafted header, pickle or manifest) or aliased exponentially (YAML anchors) is cut at a few
    levels and items (``reprlib``), never walked whole; the builtin ``repr`` would raise RecursionError or run
    without end."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict, short.maxset = 3, 4, 4, 4, 4
    short.maxstring, short.maxother, short.maxlong = limit, limit, limit
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
