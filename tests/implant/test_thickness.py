"""The minimum wall thickness measured on a mesh: at the pitch asked whatever the mesh's size, on the low side."""

from __future__ import annotations

import pytest
import trimesh

from pointforge.errors import DataError
from pointforge.implant.thickness import min_wall_thickness


def shell(radius: float, thickness: float) -> trimesh.Trimesh:
    """A hollow ball: a wall ``thickness`` thick everywhere, with no edge (a square edge reads thin by design)."""
    outer = trimesh.creation.icosphere(subdivisions=4, radius=radius)
    inner = trimesh.creation.icosphere(subdivisions=4, radius=radius - thickness)
    inner.invert()
    return trimesh.util.concatenate([outer, inner])


@pytest.mark.parametrize("radius_mm", [15.0, 50.0])  # 100 mm across: the former measure coarsened it to 0.55 mm
def test_a_wall_measures_its_thickness_within_two_voxels_below_at_any_size_and_pitch(radius_mm):
    readings = [min_wall_thickness(shell(radius_mm, 4.0), pitch, 6.0) for pitch in (0.5, 0.5001)]
    assert all(4.0 - 2 * 0.5001 <= r <= 4.0 for r in readings), readings


def test_a_thick_solid_reads_as_the_cap_and_a_thin_wall_beside_it_is_found():
    ball = trimesh.creation.icosphere(subdivisions=4, radius=12.0)
    assert min_wall_thickness(ball, 0.5, 5.0) == 5.0
    thin = shell(8.0, 1.0)
    thin.apply_translation((25.0, 0.0, 0.0))  # one mesh, two bodies
    assert min_wall_thickness(trimesh.util.concatenate([ball, thin]), 0.25, 5.0) <= 1.0


def test_an_open_mesh_is_refused():
    box = trimesh.creation.box(extents=(5.0, 5.0, 5.0))
    box.update_faces(list(range(len(box.faces) - 1)))
    with pytest.raises(DataError, match="not closed"):
        min_wall_thickness(box, 0.5, 5.0)
