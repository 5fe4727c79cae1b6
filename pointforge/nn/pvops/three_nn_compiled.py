"""Exact three-nearest-centre search compiled with Numba: a uniform grid searched ring by ring.

It takes points ``[B, 3, N]`` and centres ``[B, 3, M]`` (float32 or float64, finite) and
returns the three smallest squared distances of each point and their centre indices,
``[B, N, 3]`` each, identical to the torch paths of :mod:`.three_nn`: distances are
formed as they are (``(dx*dx + dy*dy) + dz*dz`` in the input dtype, no fused
multiply-add: Numba compiles without ``fastmath``), and a distance enters the three best
only when it is smaller, or equal with a lower index (the kernel's strict-"<" insertion
in index order). Slots no centre fills keep distance infinity.

The centres are sorted into cubic cells (counting sort). A point visits the cells around
its own in rings of growing Chebyshev radius; after each ring, every unvisited centre
lies at least as far as the nearest face of the visited block that has cells beyond it.
That bound is taken in float64, less a margin for the float64 rounding of cell edges,
and shrunk by the same rounding margin as the compiled FPS's leaf test, so the search
stops only when no unvisited centre could be nearer than, or tie with, the third best in
the input dtype: pruning is an optimisation, never a change of result.

The kernel releases the GIL; slices of the points run on a few Python threads. Compiled
code is cached on disk (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np

from pointforge.nn.pvops.compiled_support import rounding_margins, run_threaded

__all__ = ["three_nn_grid"]

# Cells per centre allowed at most (a cloud stretched along one axis would otherwise ask
# for a huge, mostly empty grid); the side grows until the grid fits.
_MAX_CELLS_PER_CENTRE = 8


@numba.njit(cache=True, nogil=True)
def _cell_side(p: np.ndarray, c: np.ndarray) -> float:
    """A cell side near the typical third-nearest distance: from up to 256 evenly spread points."""
    n, m = p.shape[1], c.shape[1]
    k = min(n, 256)
    third = np.empty(k)
    for s in range(k):
        i = (s * n) // k
        b0, b1, b2 = np.inf, np.inf, np.inf
        for j in range(m):
            dx = float(p[0, i]) - float(c[0, j])
            dy = float(p[1, i]) - float(c[1, j])
            dz = float(p[2, i]) - float(c[2, j])
            d = dx * dx + dy * dy + dz * dz
            if d < b2:
                if d < b1:
                    b2 = b1
                    if d < b0:
                        b1, b0 = b0, d
                    else:
                        b1 = d
                else:
                    b2 = d
        third[s] = b2
    third = third[np.isfinite(third)]
    side = np.sqrt(np.quantile(third, 0.75)) * 1.25 if third.shape[0] > 0 else 0.0
    span = 0.0
    for a in range(3):
        span = max(span, float(c[a].max()) - float(c[a].min()))
    side = max(side, span * 1e-4, 1e-30)
    dims = np.empty(3, dtype=np.int64)
    while True:
        cells = 1
        for a in range(3):
            dims[a] = int((float(c[a].max()) - float(c[a].min())) / side) + 1
            cells *= dims[a]
        if cells <= max(_MAX_CELLS_PER_CENTRE * m, 4096):
            return side
        side *= 1.5


@numba.njit(cache=True, nogil=True)
def _build_grid(c: np.ndarray, side: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lower corner [3], cells per axis [3], centre indices sorted by cell, cell starts)."""
    m = c.shape[1]
    lo = np.empty(3)
    dims = np.empty(3, dtype=np.int64)
    for a in range(3):
        lo[a] = float(c[a].min())
        dims[a] = int((float(c[a].max()) - lo[a]) / side) + 1
    cell_of = np.empty(m, dtype=np.int64)
    for j in range(m):
        flat = 0
        for a in range(3):
            k = min(max(int(np.floor((float(c[a, j]) - lo[a]) / side)), 0), dims[a] - 1)
            flat = flat * dims[a] + k
        cell_of[j] = flat
    starts = np.zeros(dims[0] * dims[1] * dims[2] + 1, dtype=np.int64)
    for j in range(m):
        starts[cell_of[j] + 1] += 1
    for g in range(1, starts.shape[0]):
        starts[g] += starts[g - 1]
    fill = starts[:-1].copy()
    order = np.empty(m, dtype=np.int64)
    for j in range(m):
        order[fill[cell_of[j]]] = j
        fill[cell_of[j]] += 1
    return lo, dims, order, starts


@numba.njit(cache=True, nogil=True)
def _search(
    p: np.ndarray,
    c: np.ndarray,
    grid: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    side: float,
    first: int,
    last: int,
    out_d: np.ndarray,
    out_i: np.ndarray,
    shrink: float,
    slack: float,
) -> None:
    lo, dims, order, starts = grid
    # Cell edges lo + k * side are float64 roundings; a centre may sit this far outside its cell.
    edge_error = 64.0 * 2.220446049250313e-16 * (np.abs(lo).max() + side * float(dims.max()) + 1.0)
    home = np.empty(3, dtype=np.int64)
    block_lo = np.empty(3, dtype=np.int64)
    block_hi = np.empty(3, dtype=np.int64)
    inf = np.full(1, np.inf, dtype=out_d.dtype)[0]
    for i in range(first, last):
        px, py, pz = p[0, i], p[1, i], p[2, i]
        q = (float(px), float(py), float(pz))
        for a in range(3):
            home[a] = min(max(int(np.floor((q[a] - lo[a]) / side)), 0), dims[a] - 1)
        b0, b1, b2 = inf, inf, inf
        i0, i1, i2 = c.shape[1], c.shape[1], c.shape[1]
        r = 0
        while True:
            for a in range(3):
                block_lo[a] = max(home[a] - r, 0)
                block_hi[a] = min(home[a] + r, dims[a] - 1)
            for gx in range(block_lo[0], block_hi[0] + 1):
                for gy in range(block_lo[1], block_hi[1] + 1):
                    shell = abs(gx - home[0]) == r or abs(gy - home[1]) == r
                    # Inside the ring's x-y square only its two z faces are new.
                    step = 1 if shell or r == 0 else 2 * r
                    for gz in range(home[2] - r if not shell else block_lo[2], block_hi[2] + 1, step):
                        if gz < block_lo[2]:
                            continue
                        g = (gx * dims[1] + gy) * dims[2] + gz
                        for s in range(starts[g], starts[g + 1]):
                            j = order[s]
                            dx = px - c[0, j]
                            dy = py - c[1, j]
                            dz = pz - c[2, j]
                            d = dx * dx + dy * dy
                            d = d + dz * dz
                            if d < b2 or (d == b2 and j < i2):
                                if d < b1 or (d == b1 and j < i1):
                                    b2, i2 = b1, i1
                                    if d < b0 or (d == b0 and j < i0):
                                        b1, i1 = b0, i0
                                        b0, i0 = d, j
                                    else:
                                        b1, i1 = d, j
                                else:
                                    b2, i2 = d, j
            bound = np.inf
            for a in range(3):
                if block_lo[a] > 0:
                    bound = min(bound, q[a] - (lo[a] + block_lo[a] * side))
                if block_hi[a] < dims[a] - 1:
                    bound = min(bound, lo[a] + (block_hi[a] + 1) * side - q[a])
            if bound == np.inf:
                break  # every cell visited
            bound = max(bound - edge_error, 0.0)
            if float(b2) < bound * bound * shrink - slack:
                break
            r += 1
        out_d[i, 0], out_d[i, 1], out_d[i, 2] = b0, b1, b2
        out_i[i, 0], out_i[i, 1], out_i[i, 2] = i0, i1, i2


def three_nn_grid(
    points: np.ndarray, centers: np.ndarray, threads: int = 1, side: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(d [B, N, 3], idx [B, N, 3])`` (module docs); slices of the points on up to ``threads``
    threads. ``side``: the cells' side (None: near the typical third-nearest distance, as
    long as the grid stays within a few cells per centre); any positive side gives the same result."""
    points = np.ascontiguousarray(points)
    centers = np.ascontiguousarray(centers, dtype=points.dtype)
    b, _, n = points.shape
    shrink, slack = rounding_margins(points.dtype)  # the compiled FPS's margins
    out_d = np.empty((b, n, 3), dtype=points.dtype)
    out_i = np.empty((b, n, 3), dtype=np.int64)
    sides = [_cell_side(points[e], centers[e]) if side is None else float(side) for e in range(b)]
    grids = [_build_grid(centers[e], sides[e]) for e in range(b)]
    parts = max(1, min(threads, n))
    tasks = [(e, (k * n) // parts, ((k + 1) * n) // parts) for e in range(b) for k in range(parts)]

    def run(task: tuple[int, int, int]) -> None:
        e, first, last = task
        _search(points[e], centers[e], grids[e], sides[e], first, last, out_d[e], out_i[e], shrink, slack)

    run_threaded(run, tasks, parts)
    return out_d, out_i
