"""Mutants of reading ``version.yaml`` (SPEC.md VER-FILE-SAFE): the reference's reader with one check
taken out, as a loader reading the file the way FastDeploy does (a plain ``open().read()``) gets it.

Each patches ``read_version_bytes`` where the snapshot/meta paths (``reference.commit``) or the streamed
paths (``reference.stream_config``) look it up; none reads ``/dev/zero`` without a bound (the suite's
cases come in an order that kills each before it could).
"""
from __future__ import annotations

import os
import stat

import yaml

from reference import stream_config as _stream_config
from reference import version_file as _vf
from reference.version_file import VERSION_FILE_MAX_BYTES, VersionError

from .base import Mutant

_real_read = _vf.read_version_bytes


def _absent_or_dangling(path: str) -> bool:
    """True when there is no entry (None to return); raises for a dangling symlink."""
    if os.path.lexists(path) and not os.path.exists(path):
        raise VersionError(f"{path}: the version file is a dangling symlink")
    return not os.path.lexists(path)


def _both(read):
    return {"reference.commit.read_version_bytes": read, "reference.stream_config.read_version_bytes": read}


class VersionFileUnbounded(Mutant):
    id = "version_file_unbounded"
    bug = ("the kind is checked (a regular file only) but the file is read whole: a trainer's runaway log "
           "renamed to version.yaml, or a 1 GiB file, is read into memory before the YAML parser refuses it")
    kills = frozenset({"VER-FILE-SAFE"})

    def patches(self):
        def read(path):
            if _absent_or_dangling(path):
                return None
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise VersionError(f"{path}: the version file is not a regular file")
            with open(path, "rb") as f:
                return f.read()

        return _both(read)


class VersionFileOpensFifo(Mutant):
    id = "version_file_opens_fifo"
    bug = ("directories and dangling links are refused and the read is bounded, but the file is opened with a "
           "plain blocking open(): a FIFO left as version.yaml blocks the update forever")
    kills = frozenset({"VER-FILE-SAFE"})

    def patches(self):
        def read(path):
            if _absent_or_dangling(path):
                return None
            if os.path.isdir(path):
                raise VersionError(f"{path}: the version file is a directory")
            with open(path, "rb") as f:
                data = f.read(VERSION_FILE_MAX_BYTES + 1)
            if len(data) > VERSION_FILE_MAX_BYTES:
                raise VersionError(f"{path}: the version file is over the {VERSION_FILE_MAX_BYTES}-byte limit")
            return data

        return _both(read)


class VersionFileTrustsStat(Mutant):
    id = "version_file_trusts_stat"
    bug = ("the kind is checked with os.stat() before the open (every FIFO, directory, device or dangling link already "
           "in place is refused) and the read is bounded, but the file is then opened blocking (no O_NONBLOCK) and its "
           "descriptor never judged again (no fstat): a FIFO the trainer swaps in between the stat and the open blocks "
           "the update forever")
    kills = frozenset({"VER-FILE-SAFE"})

    def patches(self):
        def read(path):
            try:
                before = os.stat(path)
            except FileNotFoundError:
                if os.path.lexists(path):
                    raise VersionError(f"{path}: the version file is a dangling symlink") from None
                return None
            except OSError as e:
                raise VersionError(f"{path}: the version file cannot be examined ({e.strerror})") from None
            if not stat.S_ISREG(before.st_mode):
                raise VersionError(f"{path}: the version file is not a regular file")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # what os.stat saw is trusted: blocking, no fstat
                try:
                    chunks, size = [], 0
                    while size <= VERSION_FILE_MAX_BYTES:
                        chunk = os.read(fd, VERSION_FILE_MAX_BYTES + 1 - size)
                        if not chunk:
                            break
                        chunks.append(chunk)
                        size += len(chunk)
                finally:
                    os.close(fd)
            except OSError as e:
                raise VersionError(f"{path}: the version file cannot be read ({e.strerror})") from None
            if size > VERSION_FILE_MAX_BYTES:
                raise VersionError(f"{path}: the version file is over the {VERSION_FILE_MAX_BYTES}-byte limit")
            return b"".join(chunks)

        return _both(read)


class VersionFileErrorUnnamed(Mutant):
    id = "version_file_error_unnamed"
    bug = "every refusal says 'version.yaml is not a small regular file', never which directory's (snapshot or meta)"
    kills = frozenset({"VER-FILE-SAFE"})

    def patches(self):
        def read(path):
            try:
                return _real_read(path)
            except VersionError as e:
                raise VersionError(str(e).replace(path, os.path.basename(path))) from None

        return _both(read)


class StreamVersionPlainOpen(Mutant):
    id = "stream_version_plain_open"
    bug = ("the streamed paths read version.yaml as FastDeploy's _resolve_weight_update_version does (open() and "
           "yaml.safe_load of the whole file), the snapshot and meta paths safely")
    kills = frozenset({"VER-FILE-SAFE"})

    def patches(self):
        def read_version_file(model_dir):
            path = os.path.join(model_dir or "", _stream_config.VERSION_FILE)
            try:
                with open(path, encoding="utf-8") as f:
                    content = yaml.safe_load(f) or {}
            except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
                return None, f"Failed to read model step from '{path}': {e}"
            if not isinstance(content, dict) or content.get("step") is None:
                return None, f"Failed to read model step from '{path}'"
            return str(content["step"]), ""

        return {"reference.stream_config.read_version_file": read_version_file}
