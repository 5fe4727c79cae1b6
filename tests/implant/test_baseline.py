"""The mean-skull baseline: registration, implant quality on a held-out skull, geometry, bad input."""

import numpy as np
import pytest
from scipy import ndimage

from pointforge.data.synthetic.defects import make_defect
from pointforge.data.synthetic.domes import make_skull
from pointforge.data.volumes import Volume
from pointforge.errors import DataError
from pointforge.implant import baseline as B
from pointforge.implant.metrics import dice

SIZE = 48  # 4.8 mm voxels: coarse, but the bone is still two voxels thick and the test stays fast


def _skull(k: int) -> Volume:
    spacing = (230.0 / SIZE,) * 3
    mask, spacing = make_skull(64, np.random.default_rng([7, k]), shape=(SIZE,) * 3, spacing=spacing)
    return Volume(mask, spacing=spacing, origin=tuple(-np.asarray(spacing) * (SIZE - 1) / 2))


@pytest.fixture(scope="module")
def skulls() -> list[Volume]:
    return [_skull(k) for k in range(4)]


@pytest.fixture(scope="module")
def atlas(skulls) -> B.Atlas:
    return B.Atlas.from_volumes(skulls[:3], names=["a", "b", "c"])


@pytest.fixture(scope="module")
def held_out(skulls, atlas):
    """Skull 3 (not in the atlas) with a parietotemporal defect, and the baseline's implant for it."""
    complete = skulls[3]
    implant = make_defect(complete.data, "parietotemporal", np.random.default_rng(0), spacing=complete.spacing)
    defective = complete.with_data(complete.data & ~implant)
    defective.origin = (1.0, -2.0, 3.0)  # a grid placed elsewhere must not matter: all work is in mm
    return defective, implant, B.mean_skull_implant(defective, atlas)


def test_registration_recovers_a_known_scale_and_shift(skulls):
    atlas_skull = skulls[0]
    scale = np.array([1.08, 0.94, 1.03])  # target voxel v ↦ atlas voxel scale * v + shift
    shift = np.array([-2.0, 3.0, 1.5])
    moved = ndimage.affine_transform(atlas_skull.data.astype(np.float32), scale, offset=shift, order=1) >= 0.5
    # Register a *defective* skull: the fit runs from its points onto the complete atlas skull.
    moved &= ~make_defect(moved, "frontoorbital", np.random.default_rng(1), spacing=atlas_skull.spacing)
    target = atlas_skull.with_data(moved)
    points = B.surface_points_mm(target.data, target.affine(), 6000)
    reg = B.register(points, B.Atlas.from_volumes([atlas_skull]).skulls[0])

    origin, voxel = np.asarray(atlas_skull.origin), atlas_skull.spacing[0]
    expected_offset = origin - scale * origin + voxel * shift  # the same map in mm
    assert np.allclose(np.diag(reg.matrix), scale, atol=0.015)
    assert np.abs(reg.matrix - np.diag(np.diag(reg.matrix))).max() < 0.02  # no spurious rotation
    assert np.abs(reg.offset - expected_offset).max() < 0.4 * voxel
    # What is left is the spacing of the sampled surface points, not misalignment.
    assert reg.residual_after_mm < 0.4 * voxel < reg.residual_before_mm


def test_held_out_implant_overlaps_the_true_implant(held_out):
    _, implant, predicted = held_out
    # Measured 0.61 on this case (0.60-0.61 over defect seeds 0-2; 0.6-0.7 on the demo data at 64³).
    assert dice(predicted.data, implant) > 0.5


def test_output_keeps_the_input_geometry(held_out):
    defective, _, predicted = held_out
    assert predicted.data.dtype == bool and predicted.shape == defective.shape
    assert predicted.spacing == defective.spacing and predicted.origin == defective.origin
    assert np.array_equal(predicted.direction, defective.direction)
    # The pipeline's cleaning (median, closing) may put back a few voxels on the remaining bone.
    assert (predicted.data & defective.data).sum() < 0.02 * predicted.data.sum()


def test_deterministic(held_out, atlas):
    defective, _, predicted = held_out
    assert np.array_equal(B.mean_skull_implant(defective, atlas).data, predicted.data)


def test_bad_input_is_one_clear_data_error(skulls, atlas):
    with pytest.raises(DataError, match="atlas has no skulls"):
        B.Atlas.from_volumes([])
    with pytest.raises(DataError, match="atlas has no skulls"):
        B.Atlas([])
    with pytest.raises(DataError, match="must be a 3-D volume, got an array of shape"):
        B.mean_skull_implant(Volume(np.ones((8, 8), bool)), atlas)
    with pytest.raises(DataError, match="atlas skull x must be a 3-D volume"):
        B.Atlas.from_volumes([Volume(np.ones((4, 4, 4, 2), bool))], names=["x"])
    with pytest.raises(DataError, match="the defective skull is empty"):
        B.mean_skull_implant(skulls[3].with_data(np.zeros(skulls[3].shape, bool)), atlas)
    with pytest.raises(DataError, match="atlas must be an Atlas"):
        B.mean_skull_implant(skulls[3], [skulls[0]])


def test_an_atlas_skull_keeps_its_bone_box_packed_and_resamples_as_the_whole_mask(skulls):
    """Sixty full-resolution skulls must fit a worker: each is cropped to its box and packed to bits;
    seen from a grid, the cropped skull gives what the whole mask gives."""
    whole = np.zeros((SIZE + 20,) * 3, dtype=bool)
    whole[5 : 5 + SIZE, 10 : 10 + SIZE, 15 : 15 + SIZE] = skulls[0].data  # the bone well inside a larger grid
    volume = Volume(whole, spacing=skulls[0].spacing, origin=(0.0, 0.0, 0.0))
    skull = B.Atlas.from_volumes([volume]).skulls[0]
    assert skull.bits.nbytes * 8 < whole.size / 2 and skull.mask.sum() == whole.sum()
    lo = np.argwhere(whole).min(axis=0) - 1
    np.testing.assert_allclose(skull.affine[:3, 3], volume.affine()[:3, :3] @ lo + volume.affine()[:3, 3])
    identity = B.Registration(np.eye(3), np.zeros(3), residual_before_mm=0.0, residual_after_mm=0.0, iterations=0)
    box, values = B._resampled(skull, identity, volume.affine(), volume.shape)
    seen = np.zeros(whole.shape, np.float32)
    seen[box] = values
    np.testing.assert_allclose(seen, whole.astype(np.float32), atol=1e-5)
    assert np.count_nonzero(values) == np.count_nonzero(seen) and values.size < whole.size  # only the bone's box


def test_the_mean_skull_is_the_whole_grid_mean_of_the_registered_skulls(skulls, atlas):
    """Each atlas skull is interpolated only inside the box its bone maps to; the mean must be the mean of
    whole-grid interpolations of the uncropped masks (the box only saves time; the box's own offset may
    round differently in the last bit)."""
    target = skulls[3]
    prob, regs = B.mean_skull(target, atlas)
    total = np.zeros(target.shape, np.float32)
    for skull, reg in zip(atlas.skulls, regs):
        to_atlas = np.eye(4)
        to_atlas[:3, :3], to_atlas[:3, 3] = reg.matrix, reg.offset
        m = np.linalg.inv(skull.affine) @ to_atlas @ target.affine()
        whole = skull.mask.astype(np.float32)
        total += ndimage.affine_transform(whole, m[:3, :3], offset=m[:3, 3], output_shape=target.shape, order=1)
    assert 0.0 < prob.max() <= 1.0 and prob.dtype == np.float32
    np.testing.assert_allclose(prob, total / len(atlas.skulls), rtol=0, atol=1e-6)


def test_the_mean_grid_groups_fine_voxels_to_about_a_millimetre():
    assert B.mean_grid((0.45, 0.45, 0.625), 1.0) == 2 and B.mean_grid((0.4,) * 3, 1.0) == 2
    assert B.mean_grid((3.6,) * 3, 1.0) == 1 and B.mean_grid((0.45,) * 3, None) == 1
    assert B.mean_grid((0.25, 0.3, 0.3), 1.0) == 4


def test_a_mean_counted_on_a_coarser_grid_is_the_fine_one_interpolated(skulls, atlas):
    """On a grid twice as fine as its voxels allow (``grid_mm`` of two voxels), the mean counted every
    second voxel and interpolated is the one counted on every voxel, up to interpolation: the thresholded
    skulls agree to DSC 0.97, and the registrations are the same."""
    src = skulls[3]
    fine_spacing = tuple(s / 2 for s in src.spacing)
    shape = tuple(2 * n - 1 for n in src.shape)
    coords = np.indices(shape, dtype=np.float64) / 2.0
    data = ndimage.map_coordinates(src.data.astype(np.float32), coords, order=1) >= 0.5
    fine = Volume(data, spacing=fine_spacing, origin=src.origin)
    whole, regs = B.mean_skull(fine, atlas, grid_mm=None)
    coarse, coarse_regs = B.mean_skull(fine, atlas, grid_mm=2 * fine_spacing[0])
    assert coarse.shape == whole.shape == shape and coarse.dtype == np.float32
    assert all(np.allclose(a.matrix, b.matrix) for a, b in zip(regs, coarse_regs))
    assert dice(coarse >= 0.5, whole >= 0.5) > 0.97 and np.abs(coarse - whole).mean() < 0.02
