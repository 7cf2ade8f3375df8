"""Unreadable snapshot files: empty, 0-byte, truncated, corrupt, and a pickle that tries to run code.
Spec: SPEC.md § FILE.

Each bad file is tried where a trainer could leave it: as the single file, as one part among good
ones, and (where the format allows) as the shared-directory pickle. The error must be a ValueError
whose message names the bad file, so an operator knows which file to rewrite.
"""
import os
import re
import shlex

import pytest

from conformance import check
from fixtures import models as M
from fixtures import snapshot as S

pytestmark = pytest.mark.snapshot

SPEC = M.spec(("embed.weight", "float32", (8, 4)), ("layers.0.mlp.weight", "bfloat16", (4, 4)), ("norm.bias", "float16", (4,)))

WHERE = [
    pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="single-file"),
    pytest.param("part", marks=pytest.mark.requires("snapshot.parts"), id="one-bad-part"),
    pytest.param("shared", marks=pytest.mark.requires("snapshot.shared_fallback"), id="shared-fallback"),
]
SAFETENSORS_WHERE = WHERE[:2]


def _bad_file(loader, where, make):
    """Write the good files for ``where``, then let ``make(path)`` produce the bad one."""
    good = M.state(SPEC, version=1)
    if where == "single":
        path = S.single_path(loader.model_dir, 0, 0)
    elif where == "part":
        # parts 0 and 2 are fine; part1 is the bad one.
        first, second = S.split(good, 2)
        S.write_parts(loader.model_dir, 0, 0, {0: first, 2: second})
        path = S.part_path(loader.model_dir, 0, 0, 1)
    else:
        path = os.path.join(loader.shared_dir, S.base_name(0, 0) + S.PDPARAMS)
    make(path, good, where == "shared")
    return path


def _expect_value_error(loader, path, match, what):
    session = loader.open(SPEC)
    with check.raises(ValueError, match=match, names=[path], where=f"{what}: {path}"):
        session.update()


@pytest.mark.rule("FILE-NO-TENSORS")
@pytest.mark.parametrize("where", WHERE)
def test_file_without_tensors_is_value_error(loader, where):
    def make(path, _good, pickled):
        (S.write_pickle_fallback if pickled else S.write_safetensors)(path, {})

    path = _bad_file(loader, where, make)
    _expect_value_error(loader, path, re.escape(path), "file with no tensors")


@pytest.mark.rule("FILE-ZERO-BYTES")
@pytest.mark.parametrize("where", WHERE)
def test_zero_byte_file_is_value_error(loader, where):
    path = _bad_file(loader, where, lambda path, _good, _pickled: S.write_zero_bytes(path))
    _expect_value_error(loader, path, re.escape(path), "0-byte file")


def _truncate_to(fraction):
    def make(path, good, pickled):
        (S.write_pickle_fallback if pickled else S.write_safetensors)(path, good)
        S.truncate(path, max(1, int(os.path.getsize(path) * fraction)))

    return make


@pytest.mark.rule("FILE-TRUNCATED")
@pytest.mark.parametrize(
    "fraction", [0.9, 0.5, 0.05], ids=["tail-missing", "half-missing", "inside-header-length"]
)
@pytest.mark.parametrize("where", WHERE)
def test_truncated_file_is_value_error(loader, where, fraction):
    path = _bad_file(loader, where, _truncate_to(fraction))
    _expect_value_error(loader, path, re.escape(path), f"file truncated to {fraction:.0%}")


@pytest.mark.rule("FILE-CORRUPT-HEADER")
@pytest.mark.parametrize(
    "damage",
    ["garbage-json", "huge-header-length", "offsets-past-end"],
)
@pytest.mark.parametrize("where", SAFETENSORS_WHERE)
def test_corrupt_header_is_value_error(loader, where, damage):
    def make(path, good, _pickled):
        S.write_safetensors(path, good)
        if damage == "garbage-json":
            S.corrupt_header(path)
        elif damage == "huge-header-length":
            with open(path, "r+b") as f:
                f.write((1 << 40).to_bytes(8, "little"))
        else:
            # A header that parses but points one tensor past the end of the data.
            with open(path, "rb") as f:
                raw = f.read()
            n = int.from_bytes(raw[:8], "little")
            header = raw[8 : 8 + n].decode()
            start, end = re.search(r'"data_offsets":\[(\d+),(\d+)\]', header).groups()
            bigger = header.replace(f'"data_offsets":[{start},{end}]', f'"data_offsets":[{start},{int(end) + 4096}]', 1)
            with open(path, "wb") as f:
                f.write(len(bigger.encode()).to_bytes(8, "little") + bigger.encode() + raw[8 + n :])

    path = _bad_file(loader, where, make)
    _expect_value_error(loader, path, re.escape(path), f"corrupt header ({damage})")


@pytest.mark.rule("FILE-PICKLE-NO-EXEC")
@pytest.mark.requires("snapshot.shared_fallback")
@pytest.mark.parametrize("attack", ["builtins.open", "os.system", "builtins.exec"])
def test_fallback_pickle_never_runs_code(loader, tmp_path, attack):
    """The shared fallback's pickle calls a global that would create a marker file."""
    marker = str(tmp_path / "PWNED")
    path = os.path.join(loader.shared_dir, S.base_name(0, 0) + S.PDPARAMS)
    if attack == "builtins.open":
        S.write_pickle_calling(path, "builtins", "open", marker, "w")
    elif attack == "os.system":
        S.write_pickle_calling(path, "os", "system", f"touch {shlex.quote(marker)}")
    else:
        S.write_pickle_calling(path, "builtins", "exec", f"open({marker!r}, 'w').close()")
    session = loader.open(SPEC)
    try:
        with check.raises(Exception, match=re.escape(path), where=f"{attack} pickle at {path}"):
            session.update()
    finally:
        check.that(not os.path.exists(marker), f"{path}: unpickling ran {attack}: marker {marker} was created")


@pytest.mark.rule("FILE-DETACHED")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("single", marks=pytest.mark.requires("snapshot.single"), id="single-file"),
        pytest.param("parts", marks=pytest.mark.requires("snapshot.parts"), id="parts"),
    ],
)
def test_parameters_do_not_alias_the_snapshot_file(loader, tmp_path, layout):
    """Rewrite the loaded files in place (same inode, same size): the model keeps the loaded values."""
    v1, v2 = M.state(SPEC, version=1), M.state(SPEC, version=2)
    if layout == "single":
        paths = [S.write_safetensors(S.single_path(loader.model_dir, 0, 0), v1)]
        fresh = [S.write_safetensors(tmp_path / "v2.safetensors", v2)]
    else:
        paths = S.write_parts(loader.model_dir, 0, 0, dict(enumerate(S.split(v1, 2))))
        fresh = [S.write_safetensors(tmp_path / f"v2.part{i}", part) for i, part in enumerate(S.split(v2, 2))]
    session = loader.open(SPEC)
    session.update()
    for path, new in zip(paths, fresh):
        data = open(new, "rb").read()
        assert os.path.getsize(path) == len(data), f"{path}: v2 layout differs in size; the fixture cannot rewrite in place"
        with open(path, "r+b") as f:  # same inode: a mapping of the old file sees these bytes
            f.write(data)
    check.params_equal(session.observe(), v1, f"{layout}: after rewriting {', '.join(map(os.path.basename, paths))} in place")
