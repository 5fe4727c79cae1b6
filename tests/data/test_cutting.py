"""`data cut-defects`: the five SkullBreak classes cut from a folder's complete skulls (synthetic skulls only)."""

import numpy as np
import pytest

from pointforge.data.orientation import canonical_axes
from pointforge.data.prepare import prepare_dataset
from pointforge.data.skulls.cutting import cut_dataset, cut_defect, defect_rng
from pointforge.data.skulls.layouts import list_cases
from pointforge.data.skulls.splits import missing_skulls
from pointforge.data.synthetic.defects import DEFECT_CLASSES
from pointforge.data.synthetic.domes import make_skull
from pointforge.data.volumes import Volume, read_binary_volume, write_volume
from pointforge.errors import ConfigError, DataError
from tests.helpers import run_cli_process

SHAPE = (64, 64, 40)  # SkullFix-style: anisotropic slices


def _skull(k: int) -> Volume:
    data, spacing = make_skull(64, np.random.default_rng(k), shape=SHAPE)
    return Volume(data=data, spacing=spacing, origin=(-110.0, -120.0, 5.0))


@pytest.fixture(scope="module")
def skullfix(tmp_path_factory):
    """A SkullFix-style folder: three complete skulls and a challenge defect that must stay behind."""
    root = tmp_path_factory.mktemp("skullfix")
    for k in range(3):
        skull = _skull(k)
        write_volume(root / "complete_skull" / f"{k:03d}.nrrd", skull)
        write_volume(root / "defective_skull" / f"{k:03d}.nrrd", skull)
    return root


def _files(out):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*.nrrd"))


def test_the_skullbreak_layout_is_written_deterministically(skullfix, tmp_path):
    out = cut_dataset(skullfix, tmp_path / "all", split="train=000-002", seed=3, workers=2).out
    expected = [f"complete_skull/{k:03d}.nrrd" for k in range(3)]
    expected += [
        f"{part}/{c}/{k:03d}.nrrd" for part in ("defective_skull", "implant") for c in DEFECT_CLASSES for k in range(3)
    ]
    assert _files(out) == sorted(expected)  # the challenge defect is not copied
    layout, cases = list_cases(out)
    assert layout == "skullbreak" and len(cases) == 15
    for case in cases:
        complete = read_binary_volume(case.complete)
        implant, defective = read_binary_volume(case.implant), read_binary_volume(case.defective)
        assert implant.spacing == complete.spacing and implant.origin == complete.origin
        assert not (implant.data & ~complete.data).any() and np.array_equal(
            defective.data, complete.data & ~implant.data
        )
    # One skull named alone gets the same defects: its seed is its own.
    alone = cut_dataset(skullfix, tmp_path / "one", split="train=001", seed=3, workers=1).out
    assert _files(alone) == [f for f in expected if "001" in f]
    for name in _files(alone):
        assert np.array_equal(read_binary_volume(alone / name).data, read_binary_volume(out / name).data), name
    other = cut_dataset(skullfix, tmp_path / "seed4", split="train=001", seed=4, workers=1).out
    assert not np.array_equal(
        read_binary_volume(other / "implant/random_1/001.nrrd").data,
        read_binary_volume(out / "implant/random_1/001.nrrd").data,
    )


def test_a_rerun_skips_written_files_and_redoes_only_what_is_missing(skullfix, tmp_path):
    out = tmp_path / "cut"
    first = cut_dataset(skullfix, out, split="train=000-001", seed=0, workers=1)
    assert first.done == 2 and first.skipped == 0 and set(first.skulls) == {"000", "001"}
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.nrrd")}
    lost = out / "implant/frontoorbital/001.nrrd"
    before = read_binary_volume(lost).data
    lost.unlink()
    again = cut_dataset(skullfix, out, split="train=000-001", seed=0, workers=1)
    assert again.done == 1 and again.skipped == 1 and not again.failures
    assert np.array_equal(read_binary_volume(lost).data, before)
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items() if p != lost)  # nothing else rewritten
    assert set(again.skulls["001"]["classes"]) == set(DEFECT_CLASSES)  # the record keeps the earlier classes
    assert not list(out.rglob("*.tmp*"))
    with pytest.raises(ConfigError, match="--seed 0"):
        cut_dataset(skullfix, out, split="train=000-001", seed=1)


def test_only_the_named_skulls_are_read_and_bad_input_is_one_line(skullfix, tmp_path):
    root = tmp_path / "raw"
    for k in range(3):
        write_volume(root / "complete_skull" / f"{k:03d}.nrrd", _skull(k))
    bad = root / "complete_skull/002.nrrd"
    bad.write_bytes(bad.read_bytes()[:300])
    ok = cut_dataset(root, tmp_path / "a", split="train=000,val=001", seed=0, workers=1)
    assert ok.done == 2 and not ok.failures  # 002 is corrupt but never read
    hurt = cut_dataset(root, tmp_path / "b", split="train=000-002", seed=0, workers=1)
    assert hurt.done == 2 and len(hurt.failures) == 1
    assert str(bad) in hurt.failures[0] and "\n" not in hurt.failures[0]
    with pytest.raises(DataError, match="not there: 003, 004"):
        cut_dataset(root, tmp_path / "c", split="train=000-004", seed=0)
    with pytest.raises(DataError, match="complete_skull"):
        cut_dataset(root / "complete_skull", tmp_path / "d", split="train=000", seed=0)
    with pytest.raises(ConfigError, match="source folder"):
        cut_dataset(root, root, split="train=000", seed=0)
    assert missing_skulls(["000", "001"], "train=000,test=001") == []
    assert missing_skulls(["000"], "skullfix")[:2] == ["001", "002"]


def _regridded(volume: Volume, perm: tuple[int, int, int], flips: tuple[bool, bool, bool], tilt_deg: float) -> Volume:
    """The same voxels stored with axes permuted and flipped, and the header rotated by ``tilt_deg`` about x."""
    data = np.transpose(volume.data, perm)
    data = np.flip(data, [a for a in range(3) if flips[a]])
    corner = np.zeros(3)
    direction = np.zeros((3, 3))
    for a, old in enumerate(perm):
        direction[:, a] = np.eye(3)[:, old] * (-1.0 if flips[a] else 1.0)
        corner[old] = volume.shape[old] - 1 if flips[a] else 0
    t = np.deg2rad(tilt_deg)
    tilt = np.array([[1, 0, 0], [0, np.cos(t), -np.sin(t)], [0, np.sin(t), np.cos(t)]])
    spacing = tuple(volume.spacing[old] for old in perm)
    origin = tilt @ volume.voxel_to_physical(corner)
    return Volume(data=np.ascontiguousarray(data), spacing=spacing, origin=tuple(origin), direction=tilt @ direction)  # type: ignore[arg-type]


@pytest.mark.parametrize("tilt_deg", [0.0, 9.0])
def test_defects_land_at_the_same_anatomical_place_whatever_the_header(tilt_deg):
    canonical = _skull(0)
    stored = _regridded(canonical, (2, 0, 1), (True, False, True), tilt_deg)
    assert canonical_axes(stored)[1].perm == (1, 2, 0)  # the voxels really are stored turned
    skull_centre = canonical.voxel_to_physical(np.argwhere(canonical.data).mean(axis=0))
    for defect_class in DEFECT_CLASSES:
        expected = cut_defect(canonical, defect_class, defect_rng(0, "000", defect_class))
        implant = cut_defect(stored, defect_class, defect_rng(0, "000", defect_class))
        assert np.array_equal(canonical_axes(stored.with_data(implant))[0].data, expected), defect_class
        offset = canonical.voxel_to_physical(np.argwhere(expected).mean(axis=0)) - skull_centre  # LPS, mm
        if defect_class == "frontoorbital":
            assert offset[1] < -40 and abs(offset[0]) < 15  # anterior, on the midline
        if defect_class == "parietotemporal":
            assert abs(offset[0]) > 40 and abs(offset[0]) > abs(offset[1])  # on one side


def test_the_cut_folder_prepares_with_a_named_split(skullfix, tmp_path):
    out = cut_dataset(skullfix, tmp_path / "cut", split="train=000-002", seed=0, workers=1).out
    prepared = prepare_dataset(out, tmp_path / "prep", n_points=1000, split="train=000-001,test=002", workers=1)
    assert (
        prepared.ok and prepared.layout == "skullbreak" and prepared.split_counts == {"train": 10, "val": 0, "test": 5}
    )
    assert {c.defect for c in prepared.cases} == set(DEFECT_CLASSES)


def test_the_command_and_a_bad_folder(skullfix, tmp_path):
    code, out, err = run_cli_process(
        "data", "cut-defects", skullfix, "--out", tmp_path / "cut", "--split", "train=000", "--workers", 1
    )
    assert code == 0, err
    assert "1 skulls cut, 0 already done, 0 failed" in out and (tmp_path / "cut/implant/bilateral/000.nrrd").exists()
    code, _, err = run_cli_process(
        "data", "cut-defects", tmp_path / "nowhere", "--out", tmp_path / "x", "--split", "skullfix"
    )
    assert code == 2 and err.strip().count("\n") == 0 and "no such folder" in err
