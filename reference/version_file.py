"""Reading a trainer's ``version.yaml`` safely (SPEC VER-FILE-SAFE): the bytes of a small regular file,
or a clear error naming it, never a hang or an unbounded read. Every reader of a version file goes
through :func:`read_version_bytes` (``reference.commit`` for snapshots and metas, ``reference.stream_config``
for rsync and GDR), with the same checks a snapshot candidate gets (LEVEL-CANDIDATE-NOT-FILE).
No Paddle here: the streamed paths' planning imports it.
"""
from __future__ import annotations

import os
import stat


class VersionError(ValueError):
    """An update's version is unreadable, older than the one reported, or announced twice differently."""


# A version file holds one small mapping (``step: 12345``); anything larger is not one (SPEC VER-FILE-SAFE).
VERSION_FILE_MAX_BYTES = 64 * 1024
# What an entry is when it is not a regular file, by stat.S_IFMT (a symlink is followed first).
_KINDS = {stat.S_IFDIR: "directory", stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device",
          stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket"}


def _kind(mode: int) -> str | None:
    """None for a regular file, else what the entry is."""
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "special file")


def read_version_bytes(path: str) -> bytes | None:
    """The bytes of the version file ``path``; None when there is no such entry. Anything else that is
    not a regular file of at most ``VERSION_FILE_MAX_BYTES`` is a VersionError naming it, raised without
    blocking: the kind is checked before the open (so no device is opened) and again on the descriptor
    (opened non-blocking, so a FIFO swapped in meanwhile cannot block), and the read stops one byte past
    the limit (a link to /dev/zero, a file still growing)."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise VersionError(f"{path}: the version file is a dangling symlink, not a regular file") from None
        return None
    except OSError as e:
        raise VersionError(f"{path}: the version file cannot be examined ({e.strerror})") from None
    fd = None
    try:
        kind = _kind(before.st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            kind = _kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise VersionError(f"{path}: the version file is a {kind}, not a regular file")
        chunks, size = [], 0
        while size <= VERSION_FILE_MAX_BYTES:
            chunk = os.read(fd, VERSION_FILE_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > VERSION_FILE_MAX_BYTES:
            raise VersionError(f"{path}: the version file is over the {VERSION_FILE_MAX_BYTES}-byte limit "
                               f"({os.fstat(fd).st_size} bytes); it holds one small mapping (step: N)")
        return b"".join(chunks)
    except OSError as e:
        raise VersionError(f"{path}: the version file cannot be read ({e.strerror})") from None
    finally:
        if fd is not None:
            os.close(fd)


# A version file holds one small mapping (``step: N``): its mappings and sequences nest at most this deep, the
# file's own mapping counting as one (SPEC VER-FILE-SAFE). PyYAML composes a document recursively, so a 6 KB file
# of 3000 "[" would otherwise end in a RecursionError (after seconds of scanning) instead of an error naming it.
VERSION_FILE_MAX_DEPTH = 64


class _TooDeep(Exception):
    pass


def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """``yaml.SafeLoader`` counting how deep its mappings and sequences nest while it composes them."""

        depth = 0

        def fetch_flow_collection_start(self, TokenClass):
            # The scanner keeps a possible simple key per open "[" or "{" and rescans them all at every token:
            # 3000 of them take seconds before the composer sees the first. Flow nesting is part of the depth.
            if self.flow_level >= VERSION_FILE_MAX_DEPTH:
                raise _TooDeep()
            super().fetch_flow_collection_start(TokenClass)

        def compose_node(self, parent, index):
            opens = self.check_event(yaml.MappingStartEvent, yaml.SequenceStartEvent)
            self.depth += opens
            try:
                if self.depth > VERSION_FILE_MAX_DEPTH:
                    raise _TooDeep()
                return super().compose_node(parent, index)
            finally:
                self.depth -= opens

    return Loader


def load_version_yaml(data, path: str):
    """The YAML document of a version file's bytes (or text); VersionError naming ``path`` when it is not YAML or
    nests deeper than VERSION_FILE_MAX_DEPTH (aliases are composed once, never expanded: a billion laughs stays
    small; its consumers show what they refuse through ``errors.brief``)."""
    import yaml

    loader = _loader()(data)
    try:
        return loader.get_single_data()
    except _TooDeep:
        raise VersionError(f"{path}: the version file nests its mappings and sequences deeper than "
                           f"{VERSION_FILE_MAX_DEPTH} levels; it holds one small mapping (step: N)") from None
    except yaml.YAMLError as e:
        raise VersionError(f"{path}: not valid YAML ({e.__class__.__name__})") from None
    finally:
        loader.dispose()


def is_scalar(value) -> bool:
    """A YAML scalar a version can be (FastDeploy's ``str(step)``): never a mapping or a sequence, whose text an
    alias could make exponentially long."""
    return value is None or isinstance(value, (str, int, float, bool))
