"""Unit and property tests of the pure ipc_snapshot planner (reference/snapshot_plan.py).

The planner sees only directory listings, so every ordering and priority rule of SPEC.md § SNAP,
PART and LEVEL can be checked here over arbitrary listings, without writing a file.
"""
import fnmatch
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.errors import SnapshotNotAFileError
from reference.snapshot_plan import FILE, base_names, is_part_glob_hit, list_dir, part_index, plan_snapshot

MODEL_DIR = "/ckpt/model"
SHARED = "/shared_ipc_meta"
PROPS = settings(max_examples=150, deadline=None)


def part(rank, gpu, index) -> str:
    return f"model_state.tp{rank}.{gpu}.part{index}.pdparams"


def plan(names, fallback_names=(), rank=0, gpu=0, model_dir=MODEL_DIR):
    listing = lambda x: x if isinstance(x, dict) else list(x)  # noqa: E731  (a dict carries entry kinds)
    return plan_snapshot(model_dir, listing(names), SHARED, listing(fallback_names), rank, gpu)


# -- naming ---------------------------------------------------------------------------------------
def test_base_names_separate_rank_and_id():
    assert base_names(1, 234) == ("model_state.tp1.234", "model_state.tp0234")
    assert base_names(12, 34)[0] == "model_state.tp12.34"
    assert base_names(1, 234)[0] != base_names(12, 34)[0]


@PROPS
@given(r1=st.integers(0, 999), g1=st.integers(0, 999), r2=st.integers(0, 999), g2=st.integers(0, 999))
def test_base_names_are_injective(r1, g1, r2, g2):
    if (r1, g1) != (r2, g2):
        assert base_names(r1, g1)[0] != base_names(r2, g2)[0]


# -- part index grammar ---------------------------------------------------------------------------
@PROPS
@given(index=st.integers(0, 10**9), width=st.integers(0, 4), rank=st.integers(0, 99), gpu=st.integers(0, 99))
def test_part_index_round_trips(index, width, rank, gpu):
    base = base_names(rank, gpu)[0]
    assert part_index(f"{base}.part{str(index).zfill(width)}.pdparams", base) == index


@PROPS
@given(suffix=st.text(min_size=0, max_size=8).filter(lambda s: not (s.isascii() and s.isdigit())))
def test_part_index_rejects_non_digits(suffix):
    base = "model_state.tp0.0"
    assert part_index(f"{base}.part{suffix}.pdparams", base) is None


@pytest.mark.parametrize("suffix", ["abc", "", "1x", "x1", "1.2", " 1", "١"])  # last: Arabic-Indic digit
def test_part_index_rejects_named_cases(suffix):
    assert part_index(f"model_state.tp0.0.part{suffix}.pdparams", "model_state.tp0.0") is None


def test_part_index_needs_the_full_base_prefix():
    assert part_index("model_state.tp1.23.part1.pdparams", "model_state.tp1.2") is None
    assert not is_part_glob_hit("model_state.tp1.23.part1.pdparams", "model_state.tp1.2")


@PROPS
@given(name=st.text(alphabet="model_stae.tp0123.rx*", max_size=40))
def test_glob_hit_matches_fnmatch(name):
    base = "model_state.tp1.2"
    assert is_part_glob_hit(name, base) == fnmatch.fnmatchcase(name, f"{base}.part*.pdparams")


# -- level 1 ordering -----------------------------------------------------------------------------
@PROPS
@given(
    indices=st.sets(st.integers(0, 10_000), min_size=1, max_size=20),
    junk=st.lists(st.sampled_from(["README", "model_state.tp1.0.pdparams", "model_state.tp0.01.part3.pdparams",
                                   "model_state.tp00.pdparams", "model_state.tp0.0.pdparams"]), max_size=5),
    data=st.data(),
)
def test_parts_are_numeric_whatever_the_listing(indices, junk, data):
    names = [part(0, 0, i) for i in indices] + junk
    listing = data.draw(st.permutations(names))
    p = plan(listing)
    assert [s.label for s in p.sources] == [f"snapshot-part{i}" for i in sorted(indices)]
    assert [s.path for s in p.sources] == [os.path.join(MODEL_DIR, part(0, 0, i)) for i in sorted(indices)]
    assert {s.level for s in p.sources} == {1} and {s.fmt for s in p.sources} == {"safetensors"}


def test_part2_before_part10_and_part9_before_part10():
    assert [s.label for s in plan([part(0, 0, 10), part(0, 0, 2), part(0, 0, 9)]).sources] == [
        "snapshot-part2", "snapshot-part9", "snapshot-part10"]


@PROPS
@given(data=st.data())
def test_equal_indices_do_not_depend_on_listing_order(data):
    names = ["model_state.tp0.0.part1.pdparams", "model_state.tp0.0.part01.pdparams", "model_state.tp0.0.part001.pdparams",
             part(0, 0, 0)]
    listing = data.draw(st.permutations(names))
    assert plan(listing) == plan(sorted(names))


@pytest.mark.parametrize("model_dir", ["/x/ckpt.part7.run", "/x/model_state.tp0.0.part3.pdparams.d", "/a.part1./b.part99."])
def test_index_comes_from_the_basename(model_dir):
    p = plan([part(0, 0, 10), part(0, 0, 2)], model_dir=model_dir)
    assert [s.label for s in p.sources] == ["snapshot-part2", "snapshot-part10"]


def test_invalid_parts_are_reported_and_skipped():
    invalid = ["model_state.tp0.0.partabc.pdparams", "model_state.tp0.0.part.pdparams", "model_state.tp0.0.part1x.pdparams"]
    p = plan([*invalid, part(0, 0, 0)])
    assert sorted(p.invalid_parts) == sorted(invalid)
    assert [s.label for s in p.sources] == ["snapshot-part0"]


def test_all_invalid_parts_fall_through_to_single():
    p = plan(["model_state.tp0.0.partabc.pdparams", "model_state.tp0.0.pdparams"])
    assert [(s.level, s.label) for s in p.sources] == [(2, "snapshot")]
    assert p.invalid_parts == ("model_state.tp0.0.partabc.pdparams",)


# -- priority -------------------------------------------------------------------------------------
@PROPS
@given(
    present=st.sets(st.sampled_from(["parts", "single", "legacy", "shared"]), min_size=1),
    rank=st.integers(0, 20),
    gpu=st.integers(0, 20),
)
def test_first_present_level_wins(present, rank, gpu):
    base, legacy = base_names(rank, gpu)
    names, shared = [], []
    if "parts" in present:
        names += [part(rank, gpu, 0), part(rank, gpu, 1)]
    if "single" in present:
        names.append(base + ".pdparams")
    if "legacy" in present:
        names.append(legacy + ".pdparams")
    if "shared" in present:
        shared.append(base + ".pdparams")
    p = plan(names, shared, rank, gpu)
    want = min({"parts": 1, "single": 2, "legacy": 3, "shared": 4}[lvl] for lvl in present)
    assert {s.level for s in p.sources} == {want}
    expected_path = {
        2: os.path.join(MODEL_DIR, base + ".pdparams"),
        3: os.path.join(MODEL_DIR, legacy + ".pdparams"),
        4: os.path.join(SHARED, base + ".pdparams"),
    }
    if want != 1:
        assert [s.path for s in p.sources] == [expected_path[want]]
        assert p.sources[0].fmt == ("pickle" if want == 4 else "safetensors")


def test_fallback_under_another_name_is_not_used():
    with pytest.raises(FileNotFoundError):
        plan([], ["model_state.tp00.pdparams", "model_state.tp1.0.pdparams"], rank=0, gpu=0)


@PROPS
@given(rank=st.integers(0, 99), gpu=st.integers(0, 99))
def test_nothing_found_names_base_dir_and_fallback(rank, gpu):
    base = base_names(rank, gpu)[0]
    other = [part(rank + 1, gpu, 0), f"model_state.tp{rank}.{gpu}.partx.pdparams"]
    with pytest.raises(FileNotFoundError) as info:
        plan(other, [f"model_state.tp{rank + 1}.{gpu}.pdparams"], rank, gpu)
    message = str(info.value)
    assert f"No snapshot found for {base}" in message
    assert MODEL_DIR in message and os.path.join(SHARED, base + ".pdparams") in message


def test_list_dir_of_missing_directory_is_empty(tmp_path):
    assert list_dir(str(tmp_path / "absent")) == {}
    (tmp_path / "f.pdparams").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    os.symlink(tmp_path / "f.pdparams", tmp_path / "link.pdparams")
    os.symlink(tmp_path / "gone", tmp_path / "dangling.pdparams")
    os.symlink("/dev/null", tmp_path / "null.pdparams")
    os.mkfifo(tmp_path / "fifo.pdparams")
    assert list_dir(str(tmp_path)) == {
        "f.pdparams": FILE,
        "sub": "directory",
        "link.pdparams": FILE,
        "dangling.pdparams": "dangling symlink",
        "null.pdparams": "character device",
        "fifo.pdparams": "FIFO",
    }


@pytest.mark.parametrize(
    "listing,shared,culprit",
    [
        ({part(0, 0, 0): FILE, part(0, 0, 1): "directory", "model_state.tp0.0.pdparams": FILE}, {}, part(0, 0, 1)),
        ({"model_state.tp0.0.pdparams": "FIFO", "model_state.tp00.pdparams": FILE}, {}, "model_state.tp0.0.pdparams"),
        ({"model_state.tp00.pdparams": "dangling symlink"}, {"model_state.tp0.0.pdparams": FILE}, "model_state.tp00.pdparams"),
        ({}, {"model_state.tp0.0.pdparams": "directory"}, "model_state.tp0.0.pdparams"),
    ],
)
def test_candidate_that_is_not_a_file_never_falls_through(listing, shared, culprit):
    with pytest.raises(SnapshotNotAFileError, match=culprit.replace(".", r"\.")):
        plan(listing, shared)


def test_kinds_of_non_candidates_do_not_matter():
    p = plan({part(0, 0, 0): FILE, "model_state.tp0.0.partx.pdparams": "directory", "model_state.tp0.0.pdparams": "FIFO"})
    assert [s.label for s in p.sources] == ["snapshot-part0"]
