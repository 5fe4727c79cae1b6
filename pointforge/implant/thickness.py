"""The minimum wall thickness of a closed mesh, measured on the mesh itself.

The mesh is rasterised by casting rays along one axis through it (trimesh's
ray queries; a point is inside where a column has crossed the surface an odd
number of times), then the thickness is the local thickness of bone
morphometry (Hildebrand and Rüegsegger, 1997): at each inside point, the
diameter of the largest ball that lies inside the solid and contains the point.
The minimum over the solid is the largest ``D`` for which the solid equals its
morphological opening by a ball of diameter ``D``; erosions and dilations are
thresholds of Euclidean distance transforms (SciPy).

It is reported on the low side: a ball of ``k`` voxels' radius that fits
counts as ``2(k - 1)`` voxels across, so the value is at most the true
thickness and at most about two measuring voxels below it. The rim of a plate counts as thick
as the plate (a ball inside the plate covers it), unlike tangent-ball measures
that call every sharp edge thin.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from pointforge.errors import DataError

__all__ = ["min_wall_thickness", "rasterise"]

_MAX_VOXELS = 6_000_000
# Columns sit at these fractions of a voxel, so that no ray runs exactly along a triangle's edge.
_OFFSET = np.array([0.6180339, 0.4142136])


def rasterise(mesh, pitch: float) -> tuple[np.ndarray, float]:
    """The voxels (centres ``pitch`` apart) inside the closed ``mesh``, one voxel of empty border; and the pitch,
    coarsened when the mesh's box would hold more than a few million voxels."""
    lo, hi = np.asarray(mesh.bounds, dtype=np.float64)
    extent = hi - lo
    pitch = max(float(pitch), float(np.prod(extent + 2 * pitch) / _MAX_VOXELS) ** (1 / 3))
    n = np.ceil(extent / pitch).astype(int) + 1
    xs = lo[0] + (np.arange(n[0]) + _OFFSET[0] - 0.5) * pitch
    ys = lo[1] + (np.arange(n[1]) + _OFFSET[1] - 0.5) * pitch
    gx, gy = np.meshgrid(xs, ys, indexing="ij")
    origins = np.stack([gx.ravel(), gy.ravel(), np.full(gx.size, lo[2] - pitch)], axis=1)
    directions = np.tile([0.0, 0.0, 1.0], (len(origins), 1))
    _, rays, hits = mesh.ray.intersects_id(origins, directions, multiple_hits=True, return_locations=True)
    # Each crossing flips inside/outside for the voxel centres above it: count the flips, keep the odd sums.
    first_above = np.clip(np.ceil((hits[:, 2] - lo[2]) / pitch - 0.5).astype(int), 0, n[2])
    flips = np.zeros((n[0] * n[1], n[2] + 1), dtype=np.int32)
    np.add.at(flips, (rays, first_above), 1)
    inside = (np.cumsum(flips, axis=1)[:, : n[2]] % 2 == 1).reshape(n[0], n[1], n[2])
    return np.pad(inside, 1), pitch


def _opening_keeps(solid: np.ndarray, inside_depth: np.ndarray, radius: int) -> bool:
    """Whether every voxel of ``solid`` is within ``radius`` voxels of a voxel at least ``radius`` deep: whether it
    lies in a ball of that radius inside the solid, with one voxel's leeway for the terraces that rasterising a
    curved surface leaves (a ledge one voxel high is the grid's, not the mesh's)."""
    centres = inside_depth >= radius
    if not centres.any():
        return False
    reach = ndimage.distance_transform_edt(~centres)
    return bool(np.all(reach[solid] <= radius + 1))


def min_wall_thickness(mesh, pitch: float) -> tuple[float, float]:
    """(the minimum wall thickness of the closed ``mesh`` in its units, the measuring voxel), measured at
    ``pitch`` (coarsened for a large mesh; the value is at most about two voxels below the truth, never above)."""
    if not mesh.is_watertight:
        raise DataError("the mesh is not closed (watertight), so it has no inside to measure")
    solid, pitch = rasterise(mesh, pitch)
    if not solid.any():
        raise DataError("the mesh encloses no measuring voxel; measure it with a finer pitch")
    depth = ndimage.distance_transform_edt(solid)
    low, high = 1, int(depth.max()) + 1  # radius 1 (the voxels themselves) always holds; high never does
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if _opening_keeps(solid, depth, mid) else (low, mid)
    # A ball of radius k voxels holds 2k - 1 voxel centres across; the surface may lie up to a voxel
    # inside the outermost ones, hence 2(k - 1) on the low side.
    return 2 * (low - 1) * pitch, pitch
