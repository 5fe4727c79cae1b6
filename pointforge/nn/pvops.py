"""Point-voxel operations of PVCNN2, in pure PyTorch.

Each function computes what upstream's CUDA kernels (the ``_pvcnn_backend`` of PVD and
PCDiff) compute, including their tie rules and edge cases, so weights trained with those
kernels behave the same here, on CPU or on CUDA, with the same code.

Layouts follow upstream: coordinates ``[B, 3, N]`` with channel 0 = x, features
``[B, C, N]``. Indices are returned as int64.

Squared distances are always formed as ``(dx*dx + dy*dy) + dz*dz`` from coordinate
differences, in the dtype of the input, because that is the kernels' arithmetic: the
discrete decisions (who is inside a ball, who is nearest, which point is furthest) and
the 3-NN and trilinear weights then agree bit for bit with the kernels instead of
merely being close. The faster paths (a cell grid for ball query and 3-NN, a NumPy loop
for FPS on CPU) only change *which* pairs are evaluated or by whom, never the
arithmetic. Weighted sums of features (interpolation, voxel means) equal the kernels'
up to float rounding of the summation order, as the kernels' own atomics do.

Gradients flow where upstream's ops have them: into features (gather, grouping, 3-NN
interpolation, voxelisation, devoxelisation) and, through gather and grouping, into
coordinates. Voxelisation, devoxelisation and 3-NN treat coordinates as constants, as
upstream does.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pointforge.errors import DataError

__all__ = [
    "avg_voxelize",
    "ball_query",
    "flat_voxel_index",
    "furthest_point_sample",
    "furthest_point_sample_indices",
    "gather",
    "grouping",
    "interpolate_from_neighbors",
    "three_nearest_neighbors",
    "three_nn_interpolate",
    "trilinear_corners",
    "trilinear_devoxelize",
    "voxel_coordinates",
    "voxel_point_counts",
    "voxelize_mean",
    "devoxelize_weighted",
    "sum_bags",
    "voxel_rows",
    "weighted_bags",
]

# FPS starts every point's distance to the chosen set at this value; 3-NN clamps its
# squared distances to at most this (so an unfilled slot ends up here).
_FAR = 1e10
# Upstream's FPS kernel runs 512 threads per batch element; each thread scans the indices
# congruent to its id, and the block reduction prefers lower thread ids, so ties go to the
# smallest index modulo 512 first.
_FPS_THREADS = 512
# Pairs evaluated at once by the chunked paths (bounds temporary memory to ~100 MB).
_PAIR_BUDGET = 1 << 22
_METHODS = ("auto", "dense", "grid")


# --------------------------------------------------------------------------- checks


def _expect_coords(op: str, name: str, coords: Tensor, batch: int | None = None) -> None:
    if not isinstance(coords, Tensor) or coords.dim() != 3 or coords.shape[1] != 3:
        shape = tuple(coords.shape) if isinstance(coords, Tensor) else type(coords).__name__
        raise DataError(f"{op}: {name} must be a [B, 3, N] tensor (channel-first xyz), got {shape}")
    if not coords.is_floating_point():
        raise DataError(f"{op}: {name} must be floating point, got {coords.dtype}; convert it with .float()")
    if batch is not None and coords.shape[0] != batch:
        raise DataError(f"{op}: {name} has batch size {coords.shape[0]}, expected {batch} like the other inputs")


def _expect_method(op: str, method: str) -> None:
    if method not in _METHODS:
        raise DataError(f"{op}: method must be one of {', '.join(_METHODS)}, got {method!r}")


def _sqdist(ax: Tensor, ay: Tensor, az: Tensor, bx: Tensor, by: Tensor, bz: Tensor) -> Tensor:
    """``(ax-bx)^2 + (ay-by)^2 + (az-bz)^2`` in the kernels' order, broadcasting, in place where possible."""
    d = ax - bx
    d.mul_(d)
    t = ay - by
    t.mul_(t)
    d.add_(t)
    t = az - bz
    t.mul_(t)
    return d.add_(t)


# --------------------------------------------------------------------------- gather / grouping


def gather(features: Tensor, indices: Tensor) -> Tensor:
    """``features[b, :, indices[b, m]]`` -> ``[B, C, M]`` (upstream ``gather_features``)."""
    if features.dim() != 3 or indices.dim() != 2 or indices.shape[0] != features.shape[0]:
        raise DataError(
            f"gather: expected features [B, C, N] and indices [B, M], got {tuple(features.shape)} and {tuple(indices.shape)}"
        )
    b, c, _ = features.shape
    index = indices.long().unsqueeze(1).expand(b, c, indices.shape[1])
    return torch.gather(features, 2, index)


def grouping(features: Tensor, indices: Tensor) -> Tensor:
    """``features[b, :, indices[b, m, u]]`` -> ``[B, C, M, U]``; indices outside ``[0, N)`` give 0.

    The zero for invalid indices follows the bounds check of PCDiff's grouping kernel.
    """
    if features.dim() != 3 or indices.dim() != 3 or indices.shape[0] != features.shape[0]:
        raise DataError(
            f"grouping: expected features [B, C, N] and indices [B, M, U], got {tuple(features.shape)} and {tuple(indices.shape)}"
        )
    b, c, n = features.shape
    _, m, u = indices.shape
    idx = indices.long()
    valid = (idx >= 0) & (idx < n)
    all_valid = bool(valid.all())
    if not all_valid:
        idx = torch.where(valid, idx, torch.zeros_like(idx))
    out = torch.gather(features, 2, idx.view(b, 1, m * u).expand(b, c, m * u)).view(b, c, m, u)
    if not all_valid:
        out = torch.where(valid.unsqueeze(1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


# --------------------------------------------------------------------------- furthest point sampling


def _fps_scan_order(n: int, device: torch.device) -> Tensor | None:
    """Point order in which "first maximum wins" reproduces the kernel's tie rule (None = identity)."""
    if n <= _FPS_THREADS:
        return None
    k = torch.arange(n, device=device)
    return torch.argsort((k % _FPS_THREADS) * n + k)


def _fps_torch(pts: Tensor, num_samples: int) -> Tensor:
    b, _, n = pts.shape
    best = torch.full((b, n), _FAR, dtype=pts.dtype, device=pts.device)
    diff = torch.empty_like(pts)
    dist = torch.empty((b, n), dtype=pts.dtype, device=pts.device)
    # Samples-major so that each step writes one contiguous row through ``out=``.
    picked = torch.zeros((num_samples, b), dtype=torch.long, device=pts.device)
    for j in range(1, num_samples):
        last = picked[j - 1].view(b, 1, 1).expand(b, 3, 1)
        torch.sub(pts, torch.gather(pts, 2, last), out=diff)
        diff.mul_(diff)
        torch.add(diff[:, 0], diff[:, 1], out=dist)
        dist.add_(diff[:, 2])
        torch.minimum(best, dist, out=best)
        torch.argmax(best, dim=1, out=picked[j])
    return picked.t()


def _fps_numpy(pts: Tensor, num_samples: int) -> Tensor:
    # The same steps as _fps_torch. On CPU the per-step cost is dispatch overhead plus a
    # slow torch.argmax; NumPy's ufuncs and SIMD argmax make a step ~4x cheaper, and the
    # IEEE float arithmetic (separate subtract, multiply, add; no fused multiply-add) is
    # the same, so the result is identical.
    a = pts.numpy()
    b, _, n = a.shape
    best = np.full((b, n), _FAR, dtype=a.dtype)
    diff = np.empty_like(a)
    dist = np.empty((b, n), dtype=a.dtype)
    picked = np.zeros((num_samples, b), dtype=np.int64)
    rows = np.arange(b)
    for j in range(1, num_samples):
        np.subtract(a, a[rows, :, picked[j - 1]][:, :, None], out=diff)
        np.multiply(diff, diff, out=diff)
        np.add(diff[:, 0], diff[:, 1], out=dist)
        np.add(dist, diff[:, 2], out=dist)
        np.minimum(best, dist, out=best)
        picked[j] = best.argmax(axis=1)
    return torch.from_numpy(np.ascontiguousarray(picked.T))


_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def furthest_point_sample_indices(coords: Tensor, num_samples: int, backend: str = "auto") -> Tensor:
    """Indices ``[B, num_samples]`` of iterative furthest point sampling.

    Starts at index 0; each step takes the point whose squared distance to the chosen set
    is largest (distances start at 1e10); ties go to the smallest index modulo 512, then
    to the smallest index. Once every point is chosen the remaining picks are index 0, as
    in the kernel. The loop runs over the samples and is vectorised over points and batch.

    ``backend``: ``"torch"`` (any device), ``"numpy"`` (CPU tensors; same result, faster
    steps) or ``"auto"`` (NumPy for CPU tensors it can hold, else torch).
    """
    _expect_coords("furthest_point_sample", "coords", coords)
    if backend not in ("auto", "torch", "numpy"):
        raise DataError(f"furthest_point_sample: backend must be auto, torch or numpy, got {backend!r}")
    num_samples = int(num_samples)
    b, _, n = coords.shape
    if num_samples < 1 or n < 1:
        raise DataError(
            f"furthest_point_sample: need at least one point and one sample, got {n} points, {num_samples} samples"
        )
    pts = coords.detach()
    order = _fps_scan_order(n, pts.device)
    if order is not None:
        pts = pts.index_select(2, order)
    pts = pts.contiguous()
    numpy_ok = pts.device.type == "cpu" and pts.dtype in _NUMPY_DTYPES
    if backend == "numpy" and not numpy_ok:
        raise DataError(
            f"furthest_point_sample: the numpy backend needs a CPU float16/32/64 tensor, got {pts.dtype} on {pts.device}"
        )
    if backend == "numpy" or (backend == "auto" and numpy_ok):
        picked = _fps_numpy(pts, num_samples)
    else:
        picked = _fps_torch(pts, num_samples)
    if order is not None:
        picked = order[picked]
    return picked.contiguous()


def furthest_point_sample(coords: Tensor, num_samples: int) -> tuple[Tensor, Tensor]:
    """``(centers_coords [B, 3, M], indices [B, M])``; the coordinates keep their gradient path."""
    indices = furthest_point_sample_indices(coords, num_samples)
    return gather(coords, indices), indices


# --------------------------------------------------------------------------- cell grid


class _CellGrid:
    """Reference points bucketed into cubic cells, to list the candidates near each query.

    A query's candidates are the reference points in the 3x3x3 block of cells around the
    query's cell, so every reference point closer than ``cell`` to the query is among
    them. Cells are computed in float64 from the coordinates, so rounding cannot move a
    point by more than a hair across the boundary it lies on. Within a cell, references
    keep their index order.
    """

    # Cell tables up to this many entries are dense arrays (O(1) lookups); larger grids
    # fall back to binary search over the sorted cell keys.
    _DENSE_TABLE = 1 << 22

    def __init__(self, refs: Tensor, queries: Tensor, cell: float):
        self.cell = float(cell)
        self.batch, _, self.num_refs = refs.shape
        self.num_queries = queries.shape[2]
        device = refs.device
        refs64 = refs.detach().double()
        qry64 = queries.detach().double()
        lo = torch.minimum(refs64.amin(2), qry64.amin(2))  # [B, 3]
        hi = torch.maximum(refs64.amax(2), qry64.amax(2))
        spans = ((hi - lo).amax(0) / self.cell).tolist()
        # +1 offset and +2 margin: the 3x3x3 block of any occupied cell lies in the grid.
        dims = [int(math.floor(s)) + 3 if math.isfinite(s) else 0 for s in spans]
        self.usable = all(d > 0 for d in dims) and self.batch * dims[0] * dims[1] * dims[2] < 2**62
        if not self.usable:
            return
        gx, gy, gz = dims
        bidx = torch.arange(self.batch, device=device).view(-1, 1)

        def keys(points64: Tensor) -> Tensor:
            c = torch.floor((points64 - lo.unsqueeze(2)) / self.cell).long() + 1  # [B, 3, K]
            return (((bidx * gx + c[:, 0]) * gy + c[:, 1]) * gz + c[:, 2]).reshape(-1)

        sorted_keys, self.order = torch.sort(keys(refs64), stable=True)
        # The 3 cells of a z-column are consecutive keys: 9 key ranges cover the block.
        qcell = keys(qry64)
        column = torch.tensor([dx * gy * gz + dy * gz for dx in (-1, 0, 1) for dy in (-1, 0, 1)], device=device)
        first_key = qcell.unsqueeze(1) + column - 1  # [B*M, 9]
        last_key = first_key + 2
        table = self.batch * gx * gy * gz
        if table <= self._DENSE_TABLE:
            per_cell = torch.bincount(sorted_keys, minlength=table)
            cell_end = torch.cumsum(per_cell, 0)
            cell_begin = cell_end - per_cell
            self.starts = cell_begin[first_key]
            self.counts = cell_end[last_key] - self.starts
        else:
            self.starts = torch.searchsorted(sorted_keys, first_key)
            self.counts = torch.searchsorted(sorted_keys, last_key, right=True) - self.starts

    def candidate_count(self) -> int:
        return int(self.counts.sum())

    def candidate_blocks(
        self, queries: Tensor | None = None, budget: int = _PAIR_BUDGET
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield ``(chunk, refs)``: flat query ids (b*M + m) of a chunk of queries and their
        candidates ``refs [len(chunk), W]`` as flat reference ids (b*N + n), padded with -1."""
        if queries is None:
            queries = torch.arange(self.batch * self.num_queries, device=self.starts.device)
        if queries.numel() == 0:
            return
        counts = self.counts.index_select(0, queries)
        starts = self.starts.index_select(0, queries)
        per_query = counts.sum(1)
        width = max(1, int(per_query.max()))
        step = max(1, budget // width)
        for lo in range(0, queries.numel(), step):
            c = counts[lo : lo + step]
            n_q = c.shape[0]
            total = int(c.sum())
            refs = torch.full((n_q, width), -1, dtype=torch.long, device=c.device)
            if total:
                flat_c = c.reshape(-1)
                slot = torch.repeat_interleave(torch.arange(flat_c.numel(), device=c.device), flat_c, output_size=total)
                run = torch.arange(total, device=c.device)
                slot_first = torch.cumsum(flat_c, 0) - flat_c
                pq = per_query[lo : lo + step]
                query_first = torch.cumsum(pq, 0) - pq
                q_local = torch.div(slot, 9, rounding_mode="floor")
                pos = starts[lo : lo + step].reshape(-1).index_select(0, slot) + run - slot_first.index_select(0, slot)
                refs[q_local, run - query_first.index_select(0, q_local)] = self.order.index_select(0, pos)
            yield queries[lo : lo + step], refs


def _flat_components(coords: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    flat = coords.detach().transpose(0, 1).reshape(3, -1)
    return flat[0], flat[1], flat[2]


def _block_sqdist(
    qxyz: tuple[Tensor, Tensor, Tensor], rxyz: tuple[Tensor, Tensor, Tensor], chunk: Tensor, refs: Tensor
) -> Tensor:
    """Squared distances ``[Q, W]`` from the chunk's queries to their candidates (pads: inf)."""
    valid = refs >= 0
    r = refs.clamp(min=0)
    q = chunk.unsqueeze(1)
    d2 = _sqdist(qxyz[0][q], qxyz[1][q], qxyz[2][q], rxyz[0][r], rxyz[1][r], rxyz[2][r])
    return d2.masked_fill_(~valid, math.inf)


# --------------------------------------------------------------------------- ball query


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
    step = max(1, _PAIR_BUDGET // max(1, b * n))
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        d2 = _sqdist(
            c[:, 0, lo:hi, None],
            c[:, 1, lo:hi, None],
            c[:, 2, lo:hi, None],
            p[:, 0, None, :],
            p[:, 1, None, :],
            p[:, 2, None, :],
        )
        out[:, lo:hi] = _first_hits(d2.view(-1, n), ids, r2, u, n).view(b, hi - lo, u)
    return _pad_balls(out, n)


def _ball_query_grid(grid: _CellGrid, centers: Tensor, points: Tensor, r2: float, u: int) -> Tensor:
    b, _, m = centers.shape
    n = points.shape[2]
    cxyz = _flat_components(centers)
    pxyz = _flat_components(points)
    out = torch.empty((b * m, u), dtype=torch.long, device=centers.device)
    for chunk, refs in grid.candidate_blocks():
        d2 = _block_sqdist(cxyz, pxyz, chunk, refs)
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
    _expect_coords("ball_query", "centers_coords", centers_coords)
    _expect_coords("ball_query", "points_coords", points_coords, centers_coords.shape[0])
    _expect_method("ball_query", method)
    u = int(num_neighbors)
    if u < 1 or not radius > 0:
        raise DataError(f"ball_query: need num_neighbors >= 1 and radius > 0, got {num_neighbors} and {radius}")
    r2 = _radius_squared(radius)
    b, _, m = centers_coords.shape
    n = points_coords.shape[2]
    if method != "dense" and b * m * n > 0:
        # The cell is a little wider than the radius so that float rounding of a distance
        # just under the radius can never put a hit outside the 3x3x3 block.
        grid = _CellGrid(points_coords, centers_coords, float(radius) * (1 + 1e-4))
        if grid.usable and (method == "grid" or grid.candidate_count() * 4 < b * m * n):
            return _ball_query_grid(grid, centers_coords, points_coords, r2, u)
    return _ball_query_dense(centers_coords, points_coords, r2, u)


# --------------------------------------------------------------------------- three nearest neighbours


def _finish_three_nn(d: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Kernel epilogue on ``d, idx [Q, 3]``: slots left empty (d = inf, fewer than three
    centres) point at index 0; distances are clamped to [1e-10, 1e10] and the weights
    formed as the kernel forms them, ``w0 = d1*d2 / (d0*d1 + d0*d2 + d1*d2)`` etc., which
    is the normalised inverse distance up to rounding, but rounded the kernel's way.
    """
    idx = idx.masked_fill(torch.isinf(d), 0)
    lo = float(torch.tensor(1e-10, dtype=torch.float32))  # the kernel's 1e-10f
    d = torch.clamp(torch.clamp(d, max=_FAR), min=lo)
    d0, d1, d2 = d.unbind(-1)
    d0d1, d0d2, d1d2 = d0 * d1, d0 * d2, d1 * d2
    inv = 1.0 / ((d0d1 + d0d2) + d1d2)
    return idx, torch.stack([d1d2 * inv, d0d2 * inv, d0d1 * inv], -1)


def _lexsort_rows(d2: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Rows sorted by (distance, id)."""
    ids, order = torch.sort(ids, dim=1)
    d2, order2 = torch.sort(torch.gather(d2, 1, order), dim=1, stable=True)
    return d2, torch.gather(ids, 1, order2)


def _three_smallest(d2: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """The 3 smallest of each row of ``d2 [R, W]`` (W >= 3) ordered by (distance, id).

    This is the order the kernel's strict-"<" insertion produces: among equal distances
    the lower index comes first. ``ids`` are distinct within a row.
    """
    vals, col = torch.topk(d2, 3, dim=1, largest=False, sorted=True)
    vals, top = _lexsort_rows(vals, torch.gather(ids, 1, col))
    # topk may cut a tie at the third distance anywhere: such rows are sorted in full.
    tied = (d2 <= vals[:, 2:3]).sum(1) > 3
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        v, i = _lexsort_rows(d2.index_select(0, rows), ids.index_select(0, rows))
        vals[rows] = v[:, :3]
        top[rows] = i[:, :3]
    return vals, top


def _three_nn_dense(points: Tensor, centers: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(d [Q, 3], idx [Q, 3]) for flat query ids ``rows`` (all queries when None)."""
    b, _, n = points.shape
    m = centers.shape[2]
    px, py, pz = _flat_components(points)
    c = centers.detach()
    if rows is None:
        rows = torch.arange(b * n, device=points.device)
    out_d = torch.empty((rows.numel(), 3), dtype=points.dtype, device=points.device)
    out_i = torch.empty((rows.numel(), 3), dtype=torch.long, device=points.device)
    ids = torch.arange(max(m, 3), device=points.device)
    step = max(1, _PAIR_BUDGET // max(1, m))
    for lo in range(0, rows.numel(), step):
        r = rows[lo : lo + step]
        bi = torch.div(r, n, rounding_mode="floor")
        d2 = _sqdist(px[r, None], py[r, None], pz[r, None], c[bi, 0], c[bi, 1], c[bi, 2])
        if m < 3:
            d2 = torch.cat([d2, d2.new_full((d2.shape[0], 3 - m), math.inf)], 1)
        out_d[lo : lo + step], out_i[lo : lo + step] = _three_smallest(d2, ids.expand(d2.shape[0], -1))
    return out_d, out_i


def _three_nn_grid(points: Tensor, centers: Tensor, cell: float, attempts: int = 3) -> tuple[Tensor, Tensor]:
    b, _, n = points.shape
    m = centers.shape[2]
    pxyz = _flat_components(points)
    cxyz = _flat_components(centers)
    out_d = torch.empty((b * n, 3), dtype=points.dtype, device=points.device)
    out_i = torch.empty((b * n, 3), dtype=torch.long, device=points.device)
    pending = torch.arange(b * n, device=points.device)
    for _ in range(attempts):
        grid = _CellGrid(centers, points, cell)
        if not grid.usable:
            break
        # A centre outside the 3x3x3 block is at least ``cell`` away; a third distance
        # safely below cell^2 therefore cannot be beaten or tied from outside.
        safe = cell * cell * (1 - 1e-5)
        failed = []
        for chunk, refs in grid.candidate_blocks(pending):
            if refs.shape[1] < 3:
                failed.append(chunk)
                continue
            d2 = _block_sqdist(pxyz, cxyz, chunk, refs)
            local = refs - torch.div(chunk, n, rounding_mode="floor").unsqueeze(1) * m
            # Pads get distinct ids beyond every centre so the tie rule never prefers them.
            local = torch.where(refs >= 0, local, m + torch.arange(refs.shape[1], device=refs.device))
            vals, top = _three_smallest(d2, local)
            ok = vals[:, 2] < safe
            out_d[chunk[ok]] = vals[ok]
            out_i[chunk[ok]] = top[ok]
            failed.append(chunk[~ok])
        pending = torch.cat(failed) if failed else pending[:0]
        if pending.numel() == 0:
            return out_d, out_i
        cell *= 2.0
    if pending.numel():
        out_d[pending], out_i[pending] = _three_nn_dense(points, centers, pending)
    return out_d, out_i


def _three_nn_cell(points: Tensor, centers: Tensor) -> float:
    """A cell side at which most points find their three nearest centres in the block:
    a high quantile of the third-neighbour distance of a small, evenly spread sample."""
    b, _, n = points.shape
    sample = torch.linspace(0, b * n - 1, min(b * n, 256), device=points.device).long()
    d, _ = _three_nn_dense(points, centers, sample)
    d3 = d[:, 2].double()
    d3 = d3[torch.isfinite(d3)]
    if d3.numel() == 0:
        return 1.0
    cell = math.sqrt(float(torch.quantile(d3, 0.9))) * 1.1
    span = float((centers.detach().amax(2) - centers.detach().amin(2)).max())
    return max(cell, span * 1e-4, 1e-12)


def three_nearest_neighbors(
    points_coords: Tensor, centers_coords: Tensor, method: str = "auto"
) -> tuple[Tensor, Tensor]:
    """For each point, its three nearest centres: ``(indices [B, 3, N], weights [B, 3, N])``.

    Nearest by squared distance, ties to the lower index; with fewer than three centres the
    missing slots point at index 0 with distance 1e10. Weights are the inverse squared
    distances (distances clamped to [1e-10, 1e10]) normalised to sum 1, rounded as
    upstream's kernel rounds them. ``method`` as in :func:`ball_query`; the grid path uses
    cells sized from a sample of third-neighbour distances and falls back to the dense
    path for the points it cannot settle.
    """
    _expect_coords("three_nearest_neighbors", "points_coords", points_coords)
    _expect_coords("three_nearest_neighbors", "centers_coords", centers_coords, points_coords.shape[0])
    _expect_method("three_nearest_neighbors", method)
    b, _, n = points_coords.shape
    m = centers_coords.shape[2]
    if m < 1:
        raise DataError("three_nearest_neighbors: centers_coords has no points; pass at least one centre")
    if m >= 3 and (method == "grid" or (method == "auto" and b * n * m >= (1 << 20))):
        d, idx = _three_nn_grid(points_coords, centers_coords, _three_nn_cell(points_coords, centers_coords))
    else:
        d, idx = _three_nn_dense(points_coords, centers_coords)
    idx, w = _finish_three_nn(d, idx)
    return idx.view(b, n, 3).transpose(1, 2).contiguous(), w.view(b, n, 3).transpose(1, 2).contiguous()


def interpolate_from_neighbors(centers_features: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
    """``sum_k weights[b, k, n] * centers_features[b, :, indices[b, k, n]]`` -> ``[B, C, N]``.

    Gradients reach ``centers_features`` only, as in upstream's kernel.
    """
    b, c, m = centers_features.shape
    rows = centers_features.transpose(1, 2).reshape(b * m, c).contiguous()
    return sum_bags(rows, *weighted_bags(indices, weights, m), b)


def three_nn_interpolate(points_coords: Tensor, centers_coords: Tensor, centers_features: Tensor) -> Tensor:
    """Features of the centres interpolated at the points (upstream ``nearest_neighbor_interpolate``)."""
    indices, weights = three_nearest_neighbors(points_coords, centers_coords)
    return interpolate_from_neighbors(centers_features, indices, weights)


# --------------------------------------------------------------------------- voxel ops


def voxel_coordinates(
    coords: Tensor, resolution: int, normalize: bool = True, eps: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Upstream's ``Voxelization`` coordinate mapping.

    Returns ``(norm_coords, vox_coords)``: the coordinates centred on their mean, scaled so
    the farthest point sits at distance 0.5 (``normalize``) or mapped from [-1, 1], then
    into ``[0, r-1]`` (floats, used by devoxelisation), and their rounded integer voxel
    coordinates (int64).
    """
    _expect_coords("voxel_coordinates", "coords", coords)
    r = int(resolution)
    c = coords.detach()
    norm = c - c.mean(2, keepdim=True)
    if normalize:
        norm = norm / (norm.norm(dim=1, keepdim=True).max(dim=2, keepdim=True).values * 2.0 + eps) + 0.5
    else:
        norm = (norm + 1) / 2.0
    norm = torch.clamp(norm * r, 0, r - 1)
    return norm, torch.round(norm).long()


def flat_voxel_index(vox_coords: Tensor, resolution: int) -> Tensor:
    """``x * r^2 + y * r + z`` per point -> ``[B, N]`` (x = coordinate channel 0)."""
    r = int(resolution)
    v = vox_coords.long()
    return (v[:, 0] * r + v[:, 1]) * r + v[:, 2]


def voxel_point_counts(flat_index: Tensor, resolution: int) -> Tensor:
    """Number of points in each voxel -> ``[B, r^3]`` (int64)."""
    b = flat_index.shape[0]
    r3 = int(resolution) ** 3
    offset = torch.arange(b, device=flat_index.device).unsqueeze(1) * r3
    return torch.bincount((flat_index + offset).reshape(-1), minlength=b * r3).view(b, r3)


def voxelize_mean(features: Tensor, flat_index: Tensor, counts: Tensor, resolution: int) -> Tensor:
    """Mean of ``features [B, C, N]`` per voxel given each point's ``flat_index [B, N]`` and
    the ``counts [B, r^3]`` -> ``[B, C, r, r, r]`` in channels-last memory layout.

    Rows of C channels are summed with ``index_add`` (contiguous row adds) and the grid is
    kept channels-last, the layout the 3D convolutions and the devoxelisation read fastest.
    """
    r = int(resolution)
    b, c, n = features.shape
    voxels = r**3
    rows = features.transpose(1, 2).reshape(b * n, c)
    offset = torch.arange(b, device=features.device).unsqueeze(1) * voxels
    sums = features.new_zeros((b * voxels, c)).index_add_(0, (flat_index + offset).reshape(-1), rows)
    mean = sums / counts.reshape(-1, 1).clamp(min=1).to(features.dtype)
    return mean.view(b, r, r, r, c).permute(0, 4, 1, 2, 3)


def avg_voxelize(features: Tensor, vox_coords: Tensor, resolution: int) -> Tensor:
    """Mean of the point features in each voxel -> ``[B, C, r, r, r]`` (empty voxels 0)."""
    if (
        features.dim() != 3
        or vox_coords.dim() != 3
        or vox_coords.shape[1] != 3
        or vox_coords.shape[0] != features.shape[0]
        or vox_coords.shape[2] != features.shape[2]
    ):
        raise DataError(
            f"avg_voxelize: expected features [B, C, N] and vox_coords [B, 3, N], got {tuple(features.shape)} and {tuple(vox_coords.shape)}"
        )
    r = int(resolution)
    index = flat_voxel_index(vox_coords, r)
    return voxelize_mean(features, index, voxel_point_counts(index, r), r)


def trilinear_corners(coords: Tensor, resolution: int) -> tuple[Tensor, Tensor]:
    """The 8 voxel indices and weights of each point -> ``([B, 8, N] int64, [B, 8, N])``.

    Corner k has bits (x, y, z) = (k>>2, k>>1, k)&1. ``coords`` are in voxel units
    (``[0, r-1]``). An upper corner is used only when its fractional part is > 0;
    otherwise it repeats the lower one (with weight 0), as in the kernel.
    """
    _expect_coords("trilinear_devoxelize", "coords", coords)
    r = int(resolution)
    c = coords.detach()
    lo = torch.floor(c)
    frac1 = c - lo
    frac0 = 1.0 - frac1
    lo = lo.long()
    base = (lo[:, 0] * r + lo[:, 1]) * r + lo[:, 2]
    step = (frac1 > 0).long() * torch.tensor([r * r, r, 1], device=c.device).view(1, 3, 1)
    weights, indices = [], []
    for k in range(8):
        bits = ((k >> 2) & 1, (k >> 1) & 1, k & 1)
        fx, fy, fz = ((frac1 if bit else frac0)[:, axis] for axis, bit in enumerate(bits))
        weights.append(fx * fy * fz)
        idx = base
        for axis, bit in enumerate(bits):
            if bit:
                idx = idx + step[:, axis]
        indices.append(idx)
    return torch.stack(indices, 1), torch.stack(weights, 1)


def weighted_bags(index: Tensor, weight: Tensor, rows_per_batch: int) -> tuple[Tensor, Tensor]:
    """Turn per-point neighbour ``index, weight [B, K, N]`` into flat bags ``[B*N, K]`` over
    the rows of all batch elements (row = b * rows_per_batch + index), for :func:`sum_bags`."""
    b, k, n = index.shape
    offset = torch.arange(b, device=index.device).view(b, 1, 1) * rows_per_batch
    # contiguous(): for B = 1 the reshape is a column-major view, which embedding_bag
    # reads an order of magnitude slower.
    bag_index = (index + offset).transpose(1, 2).reshape(b * n, k).contiguous()
    return bag_index, weight.transpose(1, 2).reshape(b * n, k).contiguous()


def sum_bags(rows: Tensor, bag_index: Tensor, bag_weight: Tensor, batch: int) -> Tensor:
    """``out[b, :, n] = sum_k bag_weight[b*N+n, k] * rows[bag_index[b*N+n, k]]`` -> ``[B, C, N]``.

    One ``embedding_bag`` does the gathers, the weighting and the sum in a single pass;
    gradients reach ``rows`` only (the weights are constants, as in upstream's kernels).
    """
    weight = bag_weight.to(rows.dtype)
    if (
        SCATTER_BAG_BACKWARD
        and rows.device.type == "cpu"
        and torch.is_grad_enabled()
        and rows.requires_grad
        and not weight.requires_grad
    ):
        out = _SumBags.apply(rows, bag_index, weight)
    else:
        out = F.embedding_bag(bag_index, rows, per_sample_weights=weight, mode="sum")
    return out.view(batch, -1, rows.shape[1]).transpose(1, 2)


# embedding_bag's own backward (``_embedding_bag_dense_backward``) sorts and counts the
# indices on every call; in the tiny PCDiff network's training step it was ~10% of the
# time. The gradient of a weighted bag sum is a weighted scatter-add of the output
# gradient, which ``index_add_`` does in one pass. False: embedding_bag's backward
# (the reference; equal up to float rounding of the summation order). CPU only: on CUDA
# index_add_ is atomic, hence not deterministic, and the slow backward was measured on CPU.
SCATTER_BAG_BACKWARD = True


class _SumBags(torch.autograd.Function):
    """``embedding_bag(bag_index, rows, per_sample_weights=weight, mode="sum")`` with a
    scatter-add backward into ``rows`` (the weights and indices get no gradient)."""

    @staticmethod
    def forward(ctx, rows: Tensor, bag_index: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(bag_index, weight)
        ctx.num_rows = rows.shape[0]
        return F.embedding_bag(bag_index, rows, per_sample_weights=weight, mode="sum")

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None, None]:
        bag_index, weight = ctx.saved_tensors
        c = grad_out.shape[1]
        spread = (grad_out.unsqueeze(1) * weight.unsqueeze(2)).reshape(-1, c)  # [bags * K, C]
        grad_rows = grad_out.new_zeros((ctx.num_rows, c)).index_add_(0, bag_index.reshape(-1), spread)
        return grad_rows, None, None


def voxel_rows(voxel_features: Tensor) -> Tensor:
    """A grid ``[B, C, r, r, r]`` as rows ``[B*r^3, C]`` (a view when it is channels-last)."""
    c = voxel_features.shape[1]
    return voxel_features.permute(0, 2, 3, 4, 1).reshape(-1, c).contiguous()


def devoxelize_weighted(voxel_features: Tensor, corner_index: Tensor, corner_weight: Tensor) -> Tensor:
    """``sum_k corner_weight[b, k, n] * voxel_features[b, :, corner_index[b, k, n]]`` -> ``[B, C, N]``."""
    bags = weighted_bags(corner_index, corner_weight, voxel_features[0, 0].numel())
    return sum_bags(voxel_rows(voxel_features), *bags, voxel_features.shape[0])


def trilinear_devoxelize(voxel_features: Tensor, coords: Tensor, resolution: int) -> Tensor:
    """Trilinear interpolation of a voxel grid ``[B, C, r, r, r]`` at ``coords [B, 3, N]``
    (voxel units, as returned by :func:`voxel_coordinates`) -> ``[B, C, N]``."""
    r = int(resolution)
    if voxel_features.dim() != 5 or tuple(voxel_features.shape[2:]) != (r, r, r):
        raise DataError(
            f"trilinear_devoxelize: expected voxel features [B, C, {r}, {r}, {r}], got {tuple(voxel_features.shape)}"
        )
    return devoxelize_weighted(voxel_features, *trilinear_corners(coords, r))
