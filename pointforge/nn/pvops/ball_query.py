"""Ball query: the first neighbours of each centre within a radius, in index order (upstream's kernel)."""

from __future__ import annotations

import torch
from torch import Tensor

from pointforge.errors import DataError
from pointforge.nn.pvops.cell_grid import CellGrid, block_squared_distance, flat_components
from pointforge.nn.pvops.common import PAIR_BUDGET, expect_coords, expect_method, squared_distance

__all__ = ["ball_query"]


def _radius_squared(radius: float) -> float:
    r = torch.tensor(float(radius), dtype=torch.float32)
    return float(r * r)


def _first_hits(d2: Tensor, ids: Tensor, r2: float, u: int, missing: int) -> Tensor:
    """Per row, the ``u`` smallest ``ids`` whose ``d2 < r2`` -> ``[R, u]`` (``missing`` where none)."""
    key = torch.where(d2 < r2, ids, missing)
    k = min(u, key.shape[1])
    first = torch.topk(key, k, dim=1, largest=False, sorted=True).values
    if k < u:
        first = torch.cat([first, first.new_full((first.shape[0], u - k), missing)], 1)
    return first


def _pad_balls(first: Tensor, missing: int) -> Tensor:
    """Kernel convention: unfilled slots repeat the first hit; an empty ball is all zeros."""
    out = torch.where(first == missing, first[..., :1], first)
    return out.masked_fill_(out == missing, 0)


def _ball_query_dense(centers: Tensor, points: Tensor, r2: float, u: int) -> Tensor:
    b, _, m = centers.shape
    n = points.shape[2]
    c = centers.detach()
    p = points.detach()
    out = torch.empty((b, m, u), dtype=torch.long, device=centers.device)
    ids = torch.arange(n, device=centers.device)
    step = max(1, PAIR_BUDGET // max(1, b * n))
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        d2 = squared_distance(
            c[:, 0, lo:hi, None],
            c[:, 1, lo:hi, None],
            c[:, 2, lo:hi, None],
            p[:, 0, None, :],
            p[:, 1, None, :],
            p[:, 2, None, :],
        )
        out[:, lo:hi] = _first_hits(d2.view(-1, n), ids, r2, u, n).view(b, hi - lo, u)
    return _pad_balls(out, n)


def _ball_query_grid(grid: CellGrid, centers: Tensor, points: Tensor, r2: float, u: int) -> Tensor:
    b, _, m = centers.shape
    n = points.shape[2]
    cxyz = flat_components(centers)
    pxyz = flat_components(points)
    out = torch.empty((b * m, u), dtype=torch.long, device=centers.device)
    for chunk, refs in grid.candidate_blocks():
        d2 = block_squared_distance(cxyz, pxyz, chunk, refs)
        # Index within the batch element; pads were given d2 = inf and never hit.
        local = refs - torch.div(chunk, m, rounding_mode="floor").unsqueeze(1) * n
        out[chunk] = _first_hits(d2, local, r2, u, n)
    return _pad_balls(out, n).view(b, m, u)


def ball_query(
    centers_coords: Tensor,
    points_coords: Tensor,
    radius: float,
    num_neighbors: int,
    method: str = "auto",
) -> Tensor:
    """Neighbour indices ``[B, M, num_neighbors]`` of each centre among the points.

    Keeps the first ``num_neighbors`` points in index order whose squared distance is
    strictly below ``r2 = float32(radius) * float32(radius)``; unfilled slots repeat the
    first hit and an empty ball gives all zeros (upstream's kernel semantics).

    ``method``: ``"dense"`` evaluates all pairs in chunks (the reference), ``"grid"``
    evaluates only pairs in neighbouring cells of side ``radius`` (same result, much
    faster for small radii), ``"auto"`` picks the grid when it saves most of the work.
    """
    expect_coords("ball_query", "centers_coords", centers_coords)
    expect_coords("ball_query", "points_coords", points_coords, centers_coords.shape[0])
    expect_method("ball_query", method)
    u = int(num_neighbors)
    if u < 1 or not radius > 0:
        raise DataError(f"ball_query: need num_neighbors >= 1 and radius > 0, got {num_neighbors} and {radius}")
    r2 = _radius_squared(radius)
    b, _, m = centers_coords.shape
    n = points_coords.shape[2]
    if method != "dense" and b * m * n > 0:
        # The cell is a little wider than the radius so that float rounding of a distance
        # just under the radius can never put a hit outside the 3x3x3 block.
        grid = CellGrid(points_coords, centers_coords, float(radius) * (1 + 1e-4))
        if grid.usable and (method == "grid" or grid.candidate_count() * 4 < b * m * n):
            return _ball_query_grid(grid, centers_coords, points_coords, r2, u)
    return _ball_query_dense(centers_coords, points_coords, r2, u)
