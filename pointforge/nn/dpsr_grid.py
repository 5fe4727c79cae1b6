"""The grid DPSR works on: resolutions, oriented points in the periodic unit cube, and the
trilinear corners that splat points onto the grid (:func:`rasterize`) and read it back at
the points (:func:`interpolate`).

Grid node ``(i, j, k)`` sits at ``(i/r0, j/r1, k/r2)`` and the unit cube is one period of
a periodic domain, so the upper neighbour of the last node is node 0. Axis 0 of the grid
is the first coordinate. Coordinates outside ``[0, 1)`` are rejected rather than
silently wrapped into a neighbouring row of the grid.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError

__all__ = [
    "DEFAULT_POINT_CHUNK",
    "KEEP_CORNERS_UP_TO",
    "PointCorners",
    "check_oriented_points",
    "interpolate",
    "normalize_resolution",
    "rasterize",
]

# Points per chunk when splatting or gathering: 8 corners x 2^18 points keeps the
# index and weight temporaries near 30 MB whatever the cloud size.
DEFAULT_POINT_CHUNK = 1 << 18

# Clouds up to this size keep their corner indices and weights (about 120 bytes
# a point, 250 once the backward pass has added the weight derivatives) from the
# forward pass to the backward pass instead of rebuilding them for every use.
KEEP_CORNERS_UP_TO = 1 << 20


def normalize_resolution(res: int | Sequence[int]) -> tuple[int, int, int]:
    """Return ``res`` as a 3-tuple of ints, each at least 2."""
    if isinstance(res, bool):
        raise ConfigError(f"DPSR resolution must be an int or three ints, got {res!r}")
    dims: tuple[Any, ...]
    if isinstance(res, numbers.Integral):
        dims = (res, res, res)
    else:
        seq = cast(Sequence[int], res)  # numbers.Integral covers the ints, which mypy cannot see
        try:
            dims = tuple(int(r) for r in seq)
        except TypeError:
            raise ConfigError(f"DPSR resolution must be an int or three ints, got {res!r}") from None
        if len(dims) != 3 or any(d != r for d, r in zip(dims, seq)):
            raise ConfigError(f"DPSR resolution must be an int or three ints, got {res!r}")
    if any(d < 2 for d in dims):
        raise ConfigError(f"DPSR resolution must be at least 2 along every axis, got {dims}")
    return dims  # type: ignore[return-value]


def check_oriented_points(points: Tensor, normals: Tensor | None = None) -> None:
    """Raise :class:`DataError` unless ``points`` is a valid ``(batch, n, 3)`` cloud in ``[0, 1)``."""
    if not isinstance(points, Tensor) or points.dim() != 3 or points.shape[-1] != 3:
        shape = tuple(points.shape) if isinstance(points, Tensor) else type(points).__name__
        raise DataError(f"DPSR points must have shape (batch, n, 3), got {shape}")
    if not points.is_floating_point():
        raise DataError(f"DPSR points must be floating point, got {points.dtype}")
    if points.shape[0] == 0 or points.shape[1] == 0:
        raise DataError(
            f"DPSR got an empty point cloud (shape {tuple(points.shape)}); give it at least one point per item"
        )
    if normals is not None:
        if not isinstance(normals, Tensor) or normals.shape != points.shape:
            shape = tuple(normals.shape) if isinstance(normals, Tensor) else type(normals).__name__
            raise DataError(f"DPSR normals must have the points' shape {tuple(points.shape)}, got {shape}")
        if normals.dtype != points.dtype or normals.device != points.device:
            raise DataError(
                f"DPSR points and normals must share dtype and device, got {points.dtype}/{points.device} "
                f"and {normals.dtype}/{normals.device}"
            )
        if not bool(torch.isfinite(normals).all()):
            raise DataError("DPSR normals contain NaN or infinite values; check the network output or the data")
    with torch.no_grad():
        if not bool(torch.isfinite(points).all()):
            raise DataError("DPSR points contain NaN or infinite values; check the network output or the data")
        lo, hi = float(points.min()), float(points.max())
    if lo < 0.0 or hi >= 1.0:
        raise DataError(
            f"DPSR points must lie in [0, 1) (the unit cube is the periodic domain), got values in "
            f"[{lo:.6g}, {hi:.6g}]; rescale the cloud into the unit cube first"
        )


# ----------------------------------------------------------------------------
# Trilinear corners: shared by splatting, interpolation and their gradients.


@dataclass
class _Corners:
    """The 8 grid nodes around each point of a chunk and their trilinear weights."""

    index: Tensor  # (n, 8) int64 flat node index; corner 4*bx + 2*by + bz, b = 0 lower, 1 upper
    weight: Tensor  # (n, 8)
    axis_weights: Tensor  # (n, 2, 3): weight of the lower / upper node along each axis
    cell: Tensor  # (3,) cell size along each axis
    _with_derivatives: Tensor | None = None

    def with_derivatives(self) -> Tensor:
        """(n, 8, 4): the weight and its derivatives along x, y, z, for one batched product.

        Along each axis the lower weight falls and the upper one rises at 1/cell
        (one-sided from above on a grid plane, so the 8 derivatives sum to zero).
        """
        if self._with_derivatives is None:
            w = self.axis_weights
            slope = torch.stack((-1.0 / self.cell, 1.0 / self.cell), 0).to(w.dtype)  # (2, 3)
            wx, wy, wz = w[:, :, None, None, 0], w[:, None, :, None, 1], w[:, None, None, :, 2]
            sx, sy, sz = slope[None, :, None, None, 0], slope[None, None, :, None, 1], slope[None, None, None, :, 2]
            self._with_derivatives = torch.stack(
                (
                    self.weight,
                    (sx * wy * wz).reshape(-1, 8),
                    (wx * sy * wz).reshape(-1, 8),
                    (wx * wy * sz).reshape(-1, 8),
                ),
                2,
            )
        return self._with_derivatives


def _lower_nodes(points: Tensor, res: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """(lower node along each axis (n, 3), as floats; the grid size; the cell size), in the points' dtype."""
    # Weights as |x - node| / cell with the cell size 1/r rounded to the points'
    # dtype, the way the reference forms them, so the roundings agree closely.
    size = torch.tensor(res, dtype=points.dtype, device=points.device)
    cell = 1.0 / size
    # x/cell can round up to r for x just below 1 on grids that are not powers of
    # two; such a point sits on the periodic image of node 0.
    return torch.minimum(torch.floor(points / cell), size - 1), size, cell


def _corners(points: Tensor, res: tuple[int, int, int]) -> _Corners:
    low, size, cell = _lower_nodes(points, res)
    w_upper = (points - low * cell).abs_().div_(cell)
    w_lower = (points - (low + 1) * cell).abs_().div_(cell)
    i0 = low.long()
    i1 = i0 + 1
    i1 = torch.where(i1 == size.long(), 0, i1)
    stride = torch.tensor((res[1] * res[2], res[2], 1), device=points.device)
    offsets = torch.stack((i0 * stride, i1 * stride), 1)  # (n, 2, 3)
    index = (offsets[:, :, None, None, 0] + offsets[:, None, :, None, 1] + offsets[:, None, None, :, 2]).reshape(-1, 8)
    w = torch.stack((w_lower, w_upper), 1)  # (n, 2, 3)
    weight = (w[:, :, None, None, 0] * w[:, None, :, None, 1] * w[:, None, None, :, 2]).reshape(-1, 8)
    return _Corners(index=index, weight=weight, axis_weights=w, cell=cell)


def _chunks(n: int, chunk: int) -> Iterator[slice]:
    for start in range(0, n, chunk):
        yield slice(start, min(start + chunk, n))


class PointCorners:
    """Corners of one cloud, chunk by chunk: kept after the first use when the
    cloud is small enough (DPSR visits them up to nine times per step), rebuilt
    per use for very large clouds so that memory stays bounded."""

    def __init__(self, points: Tensor, res: tuple[int, int, int], chunk: int):
        self.points, self.res = points, res
        self.slices = list(_chunks(points.shape[0], chunk))
        self._kept: list[Any] | None = [] if points.shape[0] <= KEEP_CORNERS_UP_TO else None

    def __iter__(self) -> Iterator[tuple[slice, _Corners]]:
        if self._kept is not None and len(self._kept) == len(self.slices):
            yield from zip(self.slices, self._kept)
            return
        for s in self.slices:
            c = _corners(self.points[s], self.res)
            if self._kept is not None:
                self._kept.append(c)
            yield s, c

    def node_box(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Per axis, the range ``[start, stop)`` of the grid nodes the cloud's corners use.

        A splat is zero outside it. A cloud with a lower node on the last node of an axis
        also uses node 0 there (the periodic wrap), and then covers the whole axis.
        """
        low = torch.stack([torch.stack(_lower_nodes(self.points[s], self.res)[0].aminmax(dim=0)) for s in self.slices])
        first, last = low[:, 0].amin(0).tolist(), low[:, 1].amax(0).tolist()
        box = [(0, r) if top + 1 >= r else (int(start), int(top) + 2) for start, top, r in zip(first, last, self.res)]
        return box[0], box[1], box[2]

    def splat(self, flat: Tensor, values: Tensor) -> None:
        """Add the trilinear splat of per-point ``values`` (n,) into the flat grid."""
        for s, c in self:
            flat.index_add_(0, c.index.view(-1), (c.weight * values[s, None]).view(-1))

    def gather(self, flat: Tensor, with_gradient: bool) -> tuple[Tensor, Tensor | None]:
        """Trilinear value (n,) of the flat grid at the points and, if asked, its spatial gradient (n, 3)."""
        n = self.points.shape[0]
        values = flat.new_empty(n)
        gradient = flat.new_empty(n, 3) if with_gradient else None
        for s, c in self:
            nodes = flat.index_select(0, c.index.view(-1)).view(-1, 1, 8)
            if gradient is None:
                values[s] = (nodes.view(-1, 8) * c.weight).sum(1)
            else:
                both = torch.bmm(nodes, c.with_derivatives()).view(-1, 4)
                values[s] = both[:, 0]
                gradient[s] = both[:, 1:]
        return values, gradient


def rasterize(points: Tensor, values: Tensor, res: int | Sequence[int], chunk: int = DEFAULT_POINT_CHUNK) -> Tensor:
    """Trilinear periodic splat of per-point ``values`` (batch, n, f) into a (batch, f, *res) grid.

    Not differentiable; DPSR's own backward pass handles gradients.
    """
    res = normalize_resolution(res)
    check_oriented_points(points)
    if values.shape[:2] != points.shape[:2] or values.dim() != 3:
        raise DataError(f"rasterize values must have shape (batch, n, f) matching points, got {tuple(values.shape)}")
    b, _, f = values.shape
    out = points.new_zeros(b, f, math.prod(res))
    with torch.no_grad():
        for i in range(b):
            corners = PointCorners(points[i], res, chunk)
            for ch in range(f):
                corners.splat(out[i, ch], values[i, :, ch].to(points.dtype))
    return out.view(b, f, *res)


def interpolate(grid: Tensor, points: Tensor, chunk: int = DEFAULT_POINT_CHUNK) -> Tensor:
    """Trilinear periodic interpolation of a (batch, *res) grid at (batch, n, 3) points -> (batch, n).

    Not differentiable (used for evaluation and the DPSR shift).
    """
    check_oriented_points(points)
    if grid.dim() != 4 or grid.shape[0] != points.shape[0]:
        raise DataError(
            f"interpolate expects a (batch, r0, r1, r2) grid matching the points' batch, got {tuple(grid.shape)}"
        )
    res = normalize_resolution(tuple(grid.shape[1:]))
    with torch.no_grad():
        out = [
            PointCorners(points[i].to(grid.dtype), res, chunk).gather(grid[i].reshape(-1), False)[0]
            for i in range(grid.shape[0])
        ]
    return torch.stack(out)
