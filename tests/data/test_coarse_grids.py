"""The U-Net's cube: a skull's bone fraction per cell, in millimetres, and back onto any grid."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pointforge.data.skulls.coarse_grids import CubeFrame, box_around, field_on_volume, frame_around, occupancy
from pointforge.data.volumes import Volume
from pointforge.errors import DataError
from tests.helpers import physical_skull

ANISOTROPIC = (0.7, 0.9, 1.6)


def _rotation(degrees: float) -> np.ndarray:
    """A turn about an oblique axis (a gantry-tilted scan's direction matrix)."""
    axis = np.array([1.0, 2.0, 3.0]) / np.sqrt(14.0)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    a = np.radians(degrees)
    return np.eye(3) + np.sin(a) * k + (1 - np.cos(a)) * (k @ k)


def _reoriented(v: Volume, perm=(2, 0, 1), flip: int = 1) -> Volume:
    """The same voxels at the same physical places, stored with the axes permuted and one axis reversed."""
    spacing = np.asarray(v.spacing)[list(perm)]
    direction = np.asarray(v.direction)[:, list(perm)]
    data = np.transpose(v.data, perm)
    origin = np.asarray(v.origin, dtype=np.float64)
    origin = origin + direction[:, flip] * spacing[flip] * (data.shape[flip] - 1)
    direction[:, flip] *= -1
    return Volume(np.flip(data, flip).copy(), tuple(spacing), tuple(origin), direction)


def _sorted_rows(points: np.ndarray) -> np.ndarray:
    rounded = np.round(points, 6)
    return rounded[np.lexsort(rounded.T[::-1])]


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2 * float((a & b).sum()) / float(a.sum() + b.sum())


def test_the_bone_volume_is_kept_and_the_cube_is_the_same_on_any_grid():
    frame = CubeFrame((0.0, 0.0, 0.0), 80.0, 32)
    fine, _ = physical_skull((0.6, 0.6, 0.6))
    reference = occupancy(fine, frame)
    cases = (((1.0, 1.0, 1.0), None, 0.06), (ANISOTROPIC, None, 0.06), ((1.1, 0.8, 1.3), _rotation(20), 0.06))
    for spacing, direction, tolerance in cases:
        other, _ = physical_skull(spacing, direction=direction)
        cube = occupancy(other, frame)
        # Every voxel's volume lands in the cube, once.
        assert cube.sum() * frame.cell_mm**3 == pytest.approx(other.data.sum() * np.prod(spacing), rel=1e-5)
        # The same physical shell: the cells' bone fractions agree up to the grids' own sampling of it.
        assert np.abs(cube - reference).sum() / reference.sum() < tolerance, spacing
    # 5 mm slices of a 4 mm shell are split into sub-voxels, not left as stripes (the mask itself is crude).
    coarse = occupancy(physical_skull((3.0, 3.0, 5.0))[0], frame)
    assert np.corrcoef(coarse.ravel(), reference.ravel())[0, 1] > 0.9


def test_a_reoriented_copy_and_a_nifti_in_ras_give_the_same_cube():
    v, _ = physical_skull(ANISOTROPIC, direction=_rotation(10))
    w = _reoriented(v)
    placed = [_sorted_rows(x.voxel_to_physical(np.argwhere(x.data))) for x in (v, w)]
    assert np.allclose(*placed)  # the same bone at the same places
    a, b = frame_around(v, 32, 8.0), frame_around(w, 32, 8.0)
    assert np.allclose(a.centre, b.centre) and a.side_mm == pytest.approx(b.side_mm)
    assert np.allclose(occupancy(v, a), occupancy(w, a), atol=1e-5)
    # A NIfTI's affine is in RAS: the same scan stored so has x and y negated, and must land on the same cube.
    ras = np.diag([-1.0, -1.0, 1.0])
    nifti = dataclasses.replace(
        v, direction=ras @ v.direction, origin=tuple(ras @ np.asarray(v.origin)), header={"format": "nifti"}
    )
    c = frame_around(nifti, 32, 8.0)
    assert np.allclose(c.centre, a.centre) and np.allclose(occupancy(nifti, c), occupancy(v, a), atol=1e-5)


def test_the_frame_is_the_largest_extent_plus_the_margin_around_the_bone():
    v, _ = physical_skull(ANISOTROPIC)
    frame = frame_around(v, 16, 10.0)
    # The shell's x extent (60 mm, radius 30) is its largest; the voxels reach half a voxel past their centres.
    extent = (np.ptp(np.flatnonzero(v.data.any(axis=(1, 2)))) + 1) * ANISOTROPIC[0]
    assert frame.side_mm == pytest.approx(extent + 20.0) and frame.cell_mm == pytest.approx(frame.side_mm / 16)
    with pytest.raises(DataError, match="no foreground"):
        frame_around(dataclasses.replace(v, data=np.zeros_like(v.data)), 16, 10.0)


@pytest.mark.parametrize("spacing", [(1.0, 1.0, 1.0), ANISOTROPIC])
def test_a_cube_field_comes_back_onto_the_volumes_own_grid(spacing):
    defective, implant = physical_skull(spacing, direction=_rotation(15))
    frame = frame_around(defective, 64, 4.0)
    cube = occupancy(implant, frame)
    whole = tuple(slice(0, n) for n in implant.shape)
    back = field_on_volume(cube, frame, implant, whole)
    assert back.shape == implant.shape and back.dtype == np.float32
    assert _dice(back >= 0.5, implant.data) > 0.75  # a 4 mm plate through cells of about 1.2 mm
    box = box_around(cube, frame, implant, 0.5)
    assert box is not None
    inside = np.zeros(implant.shape, bool)
    inside[box] = True
    assert not np.any((back >= 0.5) & ~inside)  # the box holds every voxel that reaches the level
    assert np.array_equal(field_on_volume(cube, frame, implant, box), back[box])
    assert inside.sum() < 0.5 * inside.size  # and is the implant's neighbourhood, not the volume
    assert box_around(np.zeros_like(cube), frame, implant, 0.5) is None
