"""The minimum wall thickness of a closed mesh, measured on the mesh itself, tile by tile.

The mesh is rasterised at a fixed ``pitch`` (never coarsened: the caller ties
it to the thickness it cares about) by crossing it with vertical lines, one per
column of voxels (a voxel is inside where its column has crossed the surface an
odd number of times below it). The crossings are found by projecting each
triangle onto the horizontal plane and testing the columns it covers, so the
cost grows with the surface, not with the box.

The thickness is the local thickness of bone morphometry (Hildebrand and
Rüegsegger, 1997): at each inside point, the diameter of the largest ball that
lies inside the solid and contains the point. The minimum is the largest ``D``
for which the solid equals its morphological opening by a ball of diameter
``D``; erosions and dilations are thresholds of Euclidean distance transforms
(SciPy). It is measured up to a cap ``up_to`` (larger is reported as the cap),
so that every question is local: a tile of ``_CORE``³ voxels is decided from
the tile and a halo of twice the largest radius tried, and only tiles that hold
part of the solid are looked at. Memory is bounded by one tile; time grows with
the surface area over ``pitch``².

It is reported on the low side: a ball of ``k`` voxels' radius that fits
counts as ``2(k - 1)`` voxels across, so the value is at most the true
thickness and at most about two measuring voxels below it. The rim of a plate
counts as thick as the plate (a ball inside the plate covers it), unlike
tangent-ball measures that call every sharp edge thin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from pointforge.errors import DataError

__all__ = ["ColumnCrossings", "min_wall_thickness"]

_CORE = 64
# Columns sit at these fractions of a voxel, so that no line runs exactly along a triangle's edge.
_OFFSET = np.array([0.6180339, 0.4142136])


@dataclass
class ColumnCrossings:
    """Where the vertical lines through the voxel columns cross the mesh: voxel ``(i, j, k)``'s centre is at
    ``origin + (i + 0.618, j + 0.414, k + 0.5) * pitch``; ``shape`` leaves one empty voxel around the mesh."""

    triangles: np.ndarray  # [F, 3, 3] in voxel units: x, y shifted so that column i is at x = i
    origin: np.ndarray
    pitch: float
    shape: tuple[int, int, int]

    @classmethod
    def of(cls, mesh, pitch: float) -> ColumnCrossings:
        lo, hi = np.asarray(mesh.bounds, dtype=np.float64)
        origin = lo - 1.5 * pitch
        shape = tuple(int(n) for n in np.ceil((hi - origin) / pitch) + 2)
        units = (np.asarray(mesh.triangles, dtype=np.float64) - origin) / pitch
        units[..., :2] -= _OFFSET
        return cls(units, origin, float(pitch), shape)  # type: ignore[arg-type]

    def hits(self, i: slice, j: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The crossings of the columns in ``i`` × ``j``: (column i, column j, the first voxel k above each)."""
        tri = self.triangles
        lo, hi = np.ceil(tri[..., :2].min(axis=1)), np.floor(tri[..., :2].max(axis=1))
        lo = np.maximum(lo, [i.start, j.start]).astype(int)
        hi = np.minimum(hi, [i.stop - 1, j.stop - 1]).astype(int)
        span = hi - lo + 1
        keep = np.flatnonzero((span > 0).all(axis=1))
        span, lo = span[keep], lo[keep]
        count = span[:, 0] * span[:, 1]
        owner = np.repeat(np.arange(len(keep)), count)
        rank = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        ci = lo[owner, 0] + rank // span[owner, 1]
        cj = lo[owner, 1] + rank % span[owner, 1]
        a, b, c = (tri[keep[owner], n] for n in range(3))
        wa, wb, wc = _edge(b, c, ci, cj), _edge(c, a, ci, cj), _edge(a, b, ci, cj)
        area = wa + wb + wc
        inside = ((wa > 0) & (wb > 0) & (wc > 0)) | ((wa < 0) & (wb < 0) & (wc < 0))
        z = (wa * a[:, 2] + wb * b[:, 2] + wc * c[:, 2])[inside] / area[inside]
        return ci[inside] - i.start, cj[inside] - j.start, np.ceil(z - 0.5).astype(int)


def _edge(p: np.ndarray, q: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Twice the signed area of (p, q, (x, y)): which side of the edge p→q the column lies on."""
    return (q[:, 0] - p[:, 0]) * (y - p[:, 1]) - (q[:, 1] - p[:, 1]) * (x - p[:, 0])


def _inside(hits: tuple[np.ndarray, np.ndarray, np.ndarray], shape: tuple[int, int], k: slice) -> np.ndarray:
    """The voxels of layers ``k`` inside the mesh, for the columns whose crossings are ``hits``."""
    ci, cj, above = hits
    parity = np.zeros(shape, dtype=np.int32)
    below = above <= k.start
    np.add.at(parity, (ci[below], cj[below]), 1)
    flips = np.zeros((*shape, k.stop - k.start), dtype=np.int32)
    within = ~below & (above < k.stop)
    np.add.at(flips, (ci[within], cj[within], above[within] - k.start), 1)
    return (parity[..., None] + np.cumsum(flips, axis=2)) % 2 == 1


def _largest_radius(solid: np.ndarray, core: tuple[slice, ...], most: int) -> int:
    """The largest radius ``k <= most`` (voxels) such that every voxel of ``solid`` in ``core`` lies within
    ``k + 1`` of a voxel at least ``k`` deep: in a ball of that radius inside the solid, with one voxel's
    leeway for the terraces that rasterising a curved surface leaves (a ledge one voxel high is the grid's)."""
    if not solid[core].any() or solid.all():
        return most
    depth = ndimage.distance_transform_edt(solid)

    def keeps(k: int) -> bool:
        centres = depth >= k
        if not centres.any():
            return False
        return bool(np.all(ndimage.distance_transform_edt(~centres)[core][solid[core]] <= k + 1))

    if keeps(most):
        return most
    low, high = 1, most  # radius 1 (the voxels themselves) always holds; ``most`` does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if keeps(mid) else (low, mid)
    return low


def _tiles(n: int, halo: int):
    for start in range(0, n, _CORE):
        stop = min(start + _CORE, n)
        yield slice(max(start - halo, 0), min(stop + halo, n)), slice(start - max(start - halo, 0), stop - start)


def min_wall_thickness(mesh, pitch: float, up_to: float) -> float:
    """The minimum wall thickness of the closed ``mesh`` in its units, measured at ``pitch`` up to ``up_to``
    (thicker is reported as ``up_to``); at most about two voxels below the truth, never above."""
    if not mesh.is_watertight:
        raise DataError("the mesh is not closed (watertight), so it has no inside to measure")
    grid = ColumnCrossings.of(mesh, pitch)
    most = math.ceil(up_to / (2 * pitch)) + 1  # 2 (most - 1) pitch >= up_to
    halo = 2 * most + 2
    found, any_inside = most, False
    for i, core_i in _tiles(grid.shape[0], halo):
        for j, core_j in _tiles(grid.shape[1], halo):
            hits = grid.hits(i, j)
            if not len(hits[0]):
                continue
            for k, core_k in _tiles(grid.shape[2], halo):
                solid = _inside(hits, (i.stop - i.start, j.stop - j.start), k)
                core = (core_i, core_j, core_k)
                any_inside |= bool(solid[core].any())
                found = min(found, _largest_radius(solid, core, found))
    if not any_inside:
        raise DataError("the mesh encloses no measuring voxel; measure it with a finer pitch")
    # A ball of radius k voxels holds 2k - 1 voxel centres across; the surface may lie up to a voxel
    # inside the outermost ones, hence 2(k - 1) on the low side.
    return min(2 * (found - 1) * pitch, up_to)
