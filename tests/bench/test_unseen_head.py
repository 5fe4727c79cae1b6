"""bench/unseen_head.py: a skull built around a brain, on an ellipsoid brain (the real template needs the network)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from pointforge.data.skulls.layouts import detect_layout
from pointforge.data.volumes import read_volume

# An MNI-like 1 mm RAS grid, smaller than the template's: x -80..79, y -110..89, z -60..99 mm.
_ORIGIN = np.array([-80.0, -110.0, -60.0])
_SHAPE = (160, 200, 160)


@pytest.fixture(scope="module")
def unseen(bench_module):
    return bench_module("unseen_head")


@pytest.fixture(scope="module")
def template(unseen, tmp_path_factory):
    import nibabel

    folder = tmp_path_factory.mktemp("ellipsoid")
    axes = np.meshgrid(*[_ORIGIN[a] + np.arange(_SHAPE[a]) for a in range(3)], indexing="ij")
    brain = ((axes[0] / 66.0) ** 2 + ((axes[1] + 15.0) / 85.0) ** 2 + ((axes[2] - 10.0) / 62.0) ** 2) <= 1.0
    affine = np.eye(4)
    affine[:3, 3] = _ORIGIN
    paths = {}
    for name, data in (("t1", brain * 200), ("gm", brain * 130), ("wm", brain * 125)):
        paths[name] = folder / f"{name}.nii"  # uncompressed: faster to write
        nibabel.save(nibabel.Nifti1Image(data.astype(np.uint8), affine), str(paths[name]))
    return unseen.build_template(paths)


def test_the_bone_is_a_layer_around_the_brain_with_an_open_base(unseen, template):
    skull, spacing = unseen.make_skull(template, 64, np.random.default_rng(0))
    assert spacing == pytest.approx((230 / 64,) * 3)
    assert ndimage.label(skull)[1] == 1
    where = np.argwhere(skull)
    # Centred in the field of view (within the 4 mm shift and a voxel).
    middle = (where.min(axis=0) + where.max(axis=0)) / 2.0
    assert np.all(np.abs(middle - 31.5) <= 4.0 / spacing[0] + 1.0)
    # Hollow and open below: straight down from the middle of the head there is no
    # bone (no floor); straight up, the vault, at least two voxels thick.
    column = skull[32, 32]
    assert not column[:40].any()
    assert column[40:].sum() >= 2


def test_skulls_differ_and_the_same_seed_gives_the_same_skull(unseen, template):
    a, _ = unseen.make_skull(template, 64, np.random.default_rng(1))
    b, _ = unseen.make_skull(template, 64, np.random.default_rng(1))
    c, _ = unseen.make_skull(template, 64, np.random.default_rng(2))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_the_folder_is_a_skullbreak_layout_with_every_defect_inside_its_skull(unseen, template, tmp_path):
    cases = unseen.write_dataset(tmp_path, template, 1, 64, 0)
    assert [c["id"] for c in cases] == ["000"]
    assert detect_layout(tmp_path) == "skullbreak"
    complete = np.asarray(read_volume(tmp_path / "complete_skull" / "000.nrrd").data) != 0
    for defect_class in ("bilateral", "frontoorbital", "parietotemporal", "random_1", "random_2"):
        implant = np.asarray(read_volume(tmp_path / "implant" / defect_class / "000.nrrd").data) != 0
        defective = np.asarray(read_volume(tmp_path / "defective_skull" / defect_class / "000.nrrd").data) != 0
        assert implant.any() and not (implant & ~complete).any()
        assert np.array_equal(defective, complete & ~implant)


def test_a_cached_template_is_not_fetched_again(unseen, tmp_path):
    folder = tmp_path / "mni152"
    folder.mkdir()
    for member in unseen.MEMBERS.values():
        (folder / member.rsplit("/", 1)[-1]).write_bytes(b"")
    paths = unseen.fetch_template(tmp_path)
    assert sorted(paths) == ["gm", "t1", "wm"] and all(p.parent == folder for p in paths.values())
