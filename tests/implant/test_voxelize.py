"""The voxelizer at work: points in voxel indices → field → volume on the reference grid → mesh in mm."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from pointforge.data.volumes import Volume
from pointforge.errors import ConfigError, DataError
from pointforge.implant.voxelize import (
    field_to_mesh,
    points_to_field,
    points_to_volume,
    resample_inside,
    solve_resolution,
    unit_points,
)

SHAPE = (40, 44, 36)  # not cubic: the unit cube is 44 voxels on a side
CENTRE = np.array([20.0, 23.0, 17.0])  # voxel indices
RADIUS = 12.0  # voxels


@dataclass(frozen=True)
class _Cfg:
    dpsr_res: tuple[int, int, int] = (64, 64, 64)
    dpsr_sigma: float = 2.0
    dpsr_memory_limit: float | None = None


class ExactNormals(nn.Module):
    """Stands in for a trained voxelizer: keeps the points, gives each the sphere's outward normal."""

    def __init__(self, centre_unit: np.ndarray):
        super().__init__()
        self.cfg = _Cfg()
        self.register_buffer("centre", torch.tensor(centre_unit, dtype=torch.float32))

    def oriented_points(self, points: torch.Tensor):
        normals = points - self.centre
        return points, normals / normals.norm(dim=-1, keepdim=True)


def sphere_points(n: int = 20000, seed: int = 0) -> np.ndarray:
    u = np.random.default_rng(seed).normal(size=(n, 3))
    return CENTRE + RADIUS * u / np.linalg.norm(u, axis=1, keepdims=True)


def true_ball() -> np.ndarray:
    ijk = np.stack(np.meshgrid(*[np.arange(s) for s in SHAPE], indexing="ij"), axis=-1)
    return ((ijk - CENTRE) ** 2).sum(-1) <= RADIUS**2


def reference(direction=None) -> Volume:
    return Volume(
        data=np.zeros(SHAPE, dtype=bool),
        spacing=(0.8, 0.5, 1.2),
        origin=(-10.0, 5.0, 20.0),
        direction=np.eye(3) if direction is None else np.asarray(direction, dtype=float),
        header={"format": "nrrd", "nrrd": {"space": "left-posterior-superior", "content": "kept"}},
    )


@pytest.fixture(scope="module")
def model():
    return ExactNormals(CENTRE / max(SHAPE))


def iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / (a | b).sum())


def test_sphere_becomes_the_ball_on_the_reference_grid(model):
    ref = reference()
    vol = points_to_volume(model, sphere_points(), ref)
    assert vol.data.dtype == bool and vol.shape == SHAPE
    assert vol.spacing == ref.spacing and vol.origin == ref.origin and np.array_equal(vol.direction, ref.direction)
    assert vol.header == ref.header
    score = iou(vol.data, true_ball())
    assert score >= 0.95, score
    # A finer solve than training (sigma scaled with it) is at least as good.
    finer = points_to_volume(model, torch.tensor(sphere_points()), ref, resolution=96)
    assert iou(finer.data, true_ball()) >= score - 0.01


def test_mesh_is_watertight_outward_and_in_millimetres(model):
    ref = reference()
    vol = points_to_volume(model, sphere_points(), ref)
    spacing = np.asarray(ref.spacing)
    lo_mm = np.asarray(ref.origin) + spacing * (CENTRE - RADIUS)
    hi_mm = np.asarray(ref.origin) + spacing * (CENTRE + RADIUS)
    expected_volume = 4 / 3 * math.pi * RADIUS**3 * spacing.prod()  # an ellipsoid in mm
    for mesh in (field_to_mesh(vol, ref), field_to_mesh(points_to_field(model, sphere_points(), SHAPE), ref)):
        assert mesh.is_watertight
        assert mesh.volume > 0  # outward normals
        assert mesh.volume == pytest.approx(expected_volume, rel=0.08)
        np.testing.assert_allclose(mesh.bounds[0], lo_mm, atol=float(spacing.max()))
        np.testing.assert_allclose(mesh.bounds[1], hi_mm, atol=float(spacing.max()))


def test_mesh_follows_a_rotated_and_mirrored_affine(model):
    # Two axes swapped and a third reversed is a rotation; swapped alone, a mirror (det -1).
    direction = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert np.linalg.det(direction) < 0
    ref = reference(direction)
    vol = points_to_volume(model, sphere_points(), ref)
    mesh = field_to_mesh(vol, ref)
    assert mesh.is_watertight and mesh.volume > 0
    centre_mm = ref.voxel_to_physical(CENTRE)
    np.testing.assert_allclose(mesh.vertices.mean(axis=0), centre_mm, atol=1.0)
    radii_mm = np.abs(direction @ (np.asarray(ref.spacing) * RADIUS))
    np.testing.assert_allclose((mesh.bounds[1] - mesh.bounds[0]) / 2, radii_mm, atol=float(max(ref.spacing)))


def test_resampling_is_trilinear_and_chunking_changes_nothing():
    from scipy.ndimage import map_coordinates

    g = torch.Generator().manual_seed(0)
    field = torch.randn(16, 16, 16, generator=g) * 0.3 + 0.05
    shape = (30, 40, 25)
    whole = resample_inside(field, shape)
    assert np.array_equal(whole, resample_inside(field, shape, chunk_voxels=1))  # one voxel row at a time
    s = max(shape)
    coords = np.stack(np.meshgrid(*[np.arange(n) * 16 / s for n in shape], indexing="ij")).reshape(3, -1)
    expected = map_coordinates(field.double().numpy(), coords, order=1, mode="nearest").reshape(shape) <= 0
    assert (whole != expected).mean() < 1e-4  # float32 against float64 at the threshold


@pytest.mark.parametrize("shape", [(16, 16, 16), (16, 12, 9)])
def test_a_field_at_the_volumes_resolution_is_only_thresholded(shape):
    """The shortcut for a solve at the volume's own resolution gives what interpolating would."""
    from pointforge.implant.voxelize import _interpolate_inside

    field = torch.randn(16, 16, 16, generator=torch.Generator().manual_seed(1))
    fast = resample_inside(field, shape)
    slow = np.zeros(shape, dtype=bool)
    _interpolate_inside(field, shape, 1 << 22, None, tuple(slice(0, n) for n in shape), slow)
    assert fast.shape == shape and np.array_equal(fast, slow)


@pytest.mark.parametrize("cube", [None, (2.5, -1.0, 3.0, 20.0)])
@pytest.mark.parametrize("field_side", [16, 40])
def test_a_region_gives_the_whole_volumes_voxels_inside_it_and_nothing_outside(cube, field_side):
    """The pipeline asks only for the box its clean-up reads: inside it every voxel is the whole volume's
    (interpolated or, at the volume's own resolution, thresholded), outside it none is inside."""
    from pointforge.implant.voxelize import Cube

    field = torch.randn(field_side, field_side, field_side, generator=torch.Generator().manual_seed(2)) * 0.3
    shape = (30, 40, 25) if field_side == 16 else (40, 40, 40)
    placed = None if cube is None else Cube(corner=cube[:3], side=cube[3])
    whole = resample_inside(field, shape, cube=placed)
    for region in [(slice(3, 17), slice(0, 40), slice(9, 10)), (slice(5, 6), slice(7, 30), slice(0, 25))]:
        part = resample_inside(field, shape, cube=placed, region=region, chunk_voxels=64)
        assert np.array_equal(part[region], whole[region]) and part[region].any()
        part[region] = False
        assert not part.any()
    empty = resample_inside(field, shape, region=(slice(4, 4), slice(0, 9), slice(0, 9)))
    assert not empty.any()
    with pytest.raises(DataError, match="region must be three slices"):
        resample_inside(field, shape, region=(slice(0, 9, 2), slice(0, 9), slice(0, 9)))


def test_points_are_scaled_like_the_training_data():
    pts = np.array([[0.0, 0.0, 0.0], [39.0, 43.0, 35.0], [-0.5, 43.4, 10.0]])
    unit = unit_points(pts, SHAPE)
    assert unit.shape == (1, 3, 3) and unit.dtype == torch.float32
    np.testing.assert_allclose(unit[0, 1].numpy(), np.array([39, 43, 35]) / 44, rtol=1e-6)
    assert float(unit.min()) == 0.0 and float(unit.max()) < 1.0


@pytest.mark.parametrize(
    "points, words",
    [
        (np.array([[1.0, 2.0, np.nan]] + [[5.0, 5.0, 5.0]] * 3), "NaN"),
        (np.zeros((0, 3)), "empty"),
        (sphere_points(100) * 0.8 - 60.0, "out of range"),  # millimetres, not voxel indices
        (np.full((10, 3), 50.0), "out of range"),
        (np.zeros((10, 2)), "shape [N, 3]"),
    ],
)
def test_bad_points_are_clear_errors(model, points, words):
    with pytest.raises(DataError, match=words.replace("[", r"\[").replace("]", r"\]")):
        points_to_volume(model, points, reference())


def test_a_grid_beyond_the_memory_limit_is_refused_before_solving(model):
    with pytest.raises(ConfigError, match="needs about .* GiB, more than the memory limit"):
        points_to_field(model, sphere_points(1000), SHAPE, resolution=512, memory_limit=256 << 20)


def test_other_bad_inputs(model):
    with pytest.raises(DataError, match="reference must be a Volume"):
        points_to_volume(model, sphere_points(100), np.zeros(SHAPE))
    with pytest.raises(DataError, match="nothing is inside"):
        field_to_mesh(reference(), reference())
    with pytest.raises(DataError, match="must match"):
        field_to_mesh(np.ones((4, 4, 4), dtype=bool), reference())
    with pytest.raises(ConfigError, match="must be a voxelizer"):
        points_to_field(nn.Linear(3, 3), sphere_points(100), SHAPE)


def test_a_cube_placed_on_the_skull_gives_the_same_solid_in_a_larger_field_of_view():
    """The unit cube placed by ``cube`` (corner, side in voxels) instead of the volume's own: padding the
    volume and moving the cube with the skull gives the same solid, shifted, and nothing outside the cube."""
    from pointforge.implant.voxelize import Cube

    model = ExactNormals(CENTRE / max(SHAPE))
    own = points_to_volume(model, sphere_points(), reference()).data
    shift = np.array([4, 0, 3])
    big = Volume(data=np.zeros(tuple(np.asarray(SHAPE) + [6, 2, 10]), dtype=bool), spacing=(0.8, 0.5, 1.2))
    cube = Cube(corner=(4.0, 0.0, 3.0), side=float(max(SHAPE)))
    placed = points_to_volume(model, sphere_points() + shift, big, cube=cube).data
    assert own.sum() > 1000
    assert np.array_equal(placed[4:44, 0:44, 3:39], own) and placed.sum() == own.sum()
    # A cube smaller than the volume: voxels beyond it are outside whatever the (periodic) field says there.
    field = torch.full((8, 8, 8), -1.0)
    inside = resample_inside(field, (12, 12, 12), cube=Cube(corner=(2.0, 2.0, 2.0), side=8.0))
    assert inside[2:10, 2:10, 2:10].all() and inside.sum() == 8**3  # nodes 0..7 at voxels 2..9


@pytest.mark.parametrize(
    ("trained", "side", "spacing", "expected"),
    [
        (64, 512, 0.45, 128),  # a real CT's 230 mm cube: 3.6 mm nodes at 64, 1.8 mm at 128
        (64, 512, 0.4, 128),  # SkullBreak's 205 mm
        (64, 64, 3.6, 64),  # the demo's 64³ synthetic skulls: no finer than their own voxels
        (64, 120, 3.6, 64),  # 128 nodes would be closer than the volume's voxels
        (64, 2000, 0.5, 256),  # a huge cube stops at the cap
        (128, 512, 0.45, 128),  # already fine enough: never coarser than trained
        (32, 256, 1.0, 128),  # 8 mm → 4 mm → 2 mm
    ],
)
def test_the_default_solve_has_nodes_about_two_mm_apart_where_the_grid_resolves_them(trained, side, spacing, expected):
    assert solve_resolution(trained, side, spacing) == expected


def test_a_solve_cannot_be_sized_for_an_empty_cube():
    with pytest.raises(DataError, match="cannot size the solve"):
        solve_resolution(64, 0, 0.45)
