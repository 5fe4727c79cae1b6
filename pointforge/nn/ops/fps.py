"""Iterative furthest point sampling with the tie rule of upstream's CUDA kernel.

The plain loop runs over the samples and is vectorised over points and batch; on CPU a
NumPy loop does the same steps with the same IEEE arithmetic, only faster per step. A blocked
loop (pure PyTorch, any device; chosen only on request) gives the same picks without
scanning every point at every step: it runs the steps on the few points with the largest
distances for as long as one of them provably wins, then lowers the others' distances
only near the picks (a cell grid), in a few large operations per block.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from pointforge.errors import DataError
from pointforge.nn.ops.cell_grid import CellGrid, block_squared_distance, flat_components
from pointforge.nn.ops.common import FAR, expect_coords, squared_distance
from pointforge.nn.ops.grouping import gather

__all__ = ["BACKENDS", "furthest_point_sample", "furthest_point_sample_indices"]

# Upstream's FPS kernel runs 512 threads per batch element; each thread scans the indices
# congruent to its id, and the block reduction prefers lower thread ids, so ties go to the
# smallest index modulo 512 first.
_FPS_THREADS = 512


def _fps_scan_order(n: int, device: torch.device) -> Tensor | None:
    """Point order in which "first maximum wins" reproduces the kernel's tie rule (None = identity)."""
    if n <= _FPS_THREADS:
        return None
    k = torch.arange(n, device=device)
    return torch.argsort((k % _FPS_THREADS) * n + k)


def _fps_torch(pts: Tensor, num_samples: int) -> Tensor:
    b, _, n = pts.shape
    best = torch.full((b, n), FAR, dtype=pts.dtype, device=pts.device)
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
    best = np.full((b, n), FAR, dtype=a.dtype)
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


# The blocked loop steps on this many candidates at a time.
_CANDIDATES = 256
# A grid is rebuilt once the reach of a new sample is below this fraction of its cell.
_REGRID = 0.5
# After a block of fewer picks than this (for some batch element), plain steps: this many,
# doubling while blocks stay short, up to the most.
_SHORT_BLOCK = 8
_PLAIN_BURST = 8
_MAX_BURST = 128


def _plain_update(pts: Tensor, best: Tensor, pick: Tensor) -> None:
    """``best`` lowered by one pick ``[B]`` per batch element, every point scanned."""
    p = torch.gather(pts, 2, pick.view(-1, 1, 1).expand(-1, 3, 1))
    torch.minimum(best, squared_distance(pts[:, 0], pts[:, 1], pts[:, 2], p[:, 0], p[:, 1], p[:, 2]), out=best)


def _plain_step(pts: Tensor, best: Tensor, picked: Tensor, count: Tensor) -> None:
    """One step of the plain loop for every batch element, appended at ``count``."""
    pick = torch.argmax(best, dim=1)
    picked.scatter_(1, count.unsqueeze(1), pick.unsqueeze(1))
    count.add_(1)
    _plain_update(pts, best, pick)


def _candidate_steps(slot_best: Tensor, slot_dist: Tensor, max_steps: int) -> Tensor:
    """Slots picked ``[S, B]`` by plain steps on the candidates alone. Slot 0 stands for all
    other points (its distance: their largest; never lowered): once it wins, a candidate
    is no longer provably the furthest point, and it keeps winning."""
    b, k1 = slot_best.shape
    rows = slot_dist.view(b * k1, k1)
    base = torch.arange(b, device=slot_best.device) * k1
    slots = torch.zeros((max_steps, b), dtype=torch.long, device=slot_best.device)
    for s in range(max_steps):
        torch.argmax(slot_best, dim=1, out=slots[s])
        if s % 8 == 7 and not bool(slots[s].any()):
            return slots[: s + 1]
        torch.minimum(slot_best, rows.index_select(0, slots[s] + base if b > 1 else slots[s]), out=slot_best)
    return slots


def _candidate_block(pts: Tensor, best: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Picks ``[B, S]`` (scan positions; -1 past each element's last) of one block, and their reach²."""
    b = pts.shape[0]
    top, cand = best.topk(k + 1, dim=1)
    cand = cand[:, :k].sort(dim=1).values  # scan order: argmax's first maximum is the kernel's tie rule
    # Every other point's distance is at most top[:, k] and only falls: a candidate whose
    # distance exceeds it is the furthest point; at equality slot 0 (first) wins and stops.
    slot_best = torch.cat([top[:, k : k + 1], best.gather(1, cand)], 1)
    c = torch.gather(pts, 2, cand.unsqueeze(1).expand(-1, 3, -1))
    cx, cy, cz = c[:, 0], c[:, 1], c[:, 2]
    slot_dist = pts.new_full((b, k + 1, k + 1), math.inf)
    slot_dist[:, 1:, 1:] = squared_distance(
        cx.unsqueeze(1), cy.unsqueeze(1), cz.unsqueeze(1), cx.unsqueeze(2), cy.unsqueeze(2), cz.unsqueeze(2)
    )
    slots = _candidate_steps(slot_best, slot_dist, k).t()  # [B, S]
    picks = torch.where(slots > 0, cand.gather(1, (slots - 1).clamp_(min=0)), -1)
    return picks, top[:, 0]


def _lower_near_picks(xyz: tuple[Tensor, Tensor, Tensor], grid: CellGrid, best: Tensor, flat_picks: Tensor) -> None:
    """``best`` lowered by the picks, for the grid's candidates of each pick: every point
    a pick can lower lies within the reach the grid was built for."""
    flat_best = best.view(-1)
    for chunk, refs in grid.candidate_blocks(flat_picks):
        d2 = block_squared_distance(xyz, xyz, chunk, refs)
        flat_best.scatter_reduce_(0, refs.clamp(min=0).view(-1), d2.view(-1), "amin")


def _fps_blocked(pts: Tensor, num_samples: int) -> Tensor:
    b, _, n = pts.shape
    k = min(_CANDIDATES, n - 1)
    xyz = flat_components(pts)
    first = pts[:, :, :1]
    best = torch.minimum(
        squared_distance(pts[:, 0], pts[:, 1], pts[:, 2], first[:, 0], first[:, 1], first[:, 2]),
        torch.tensor(FAR, dtype=pts.dtype, device=pts.device),
    )
    # Room for a whole block past the last sample, and one column for the picks dropped.
    picked = torch.zeros((b, num_samples + k + 2), dtype=torch.long, device=pts.device)
    count = torch.ones(b, dtype=torch.long, device=pts.device)
    offsets = torch.arange(b, device=pts.device).unsqueeze(1) * n
    columns = torch.arange(k, device=pts.device)
    grid: CellGrid | None = None
    cell, burst = math.inf, 0
    while int(count.min()) < num_samples:
        picks, reach2 = _candidate_block(pts, best, k)
        valid = picks >= 0
        dump = picked.shape[1] - 1
        target = torch.where(valid, count.unsqueeze(1) + columns[: picks.shape[1]], dump).clamp_(max=dump)
        picked.scatter_(1, target, picks.clamp(min=0))
        made = valid.sum(1)
        count.add_(made).clamp_(max=dump)  # an element done early keeps picking into the dump column
        # The reach with room for the rounding of a squared distance (a few ulps).
        reach = math.sqrt(float(reach2.max())) * (1 + 16 * torch.finfo(pts.dtype).eps)
        if reach > 0 and bool(valid.any()):
            if grid is None or reach < _REGRID * cell:
                grid, cell = CellGrid(pts, pts, reach), reach
            if grid.usable:
                _lower_near_picks(xyz, grid, best, (picks + offsets)[valid])
            else:  # cells too fine for the grid's keys: scan every point for each pick
                for column in picks.clamp(min=0).t():  # index 0, picked first, lowers nothing
                    _plain_update(pts, best, column)
        # Plain steps where blocks are short: early on, when a sample's reach is most of the
        # cloud, and when a candidate ties the others (that block made no progress).
        burst = min(max(2 * burst, _PLAIN_BURST), _MAX_BURST) if int(made.min()) < _SHORT_BLOCK else 0
        for _ in range(burst):
            _plain_step(pts, best, picked, count)
            count.clamp_(max=dump)
    return picked[:, :num_samples]


_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
BACKENDS = ("auto", "torch", "numpy", "blocked")


def furthest_point_sample_indices(coords: Tensor, num_samples: int, backend: str = "auto") -> Tensor:
    """Indices ``[B, num_samples]`` of iterative furthest point sampling.

    Starts at index 0; each step takes the point whose squared distance to the chosen set
    is largest (distances start at 1e10); ties go to the smallest index modulo 512, then
    to the smallest index. Once every point is chosen the remaining picks are index 0, as
    in the kernel.

    ``backend`` (every one gives the same indices): ``"torch"``, the plain loop (any
    device); ``"numpy"``, the plain loop on CPU tensors, cheaper steps; ``"blocked"``, the
    blocked loop (any device; module docs; on 2 CPU cores slower than NumPy's plain loop at
    the paper's sizes, docs/benchmarks.md); ``"auto"``: NumPy for CPU tensors it can hold,
    else torch.
    """
    expect_coords("furthest_point_sample", "coords", coords)
    if backend not in BACKENDS:
        raise DataError(f"furthest_point_sample: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
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
    if backend == "auto":
        backend = "numpy" if numpy_ok else "torch"
    if backend == "blocked" and (n < 2 or not bool(torch.isfinite(pts).all())):
        # The grid needs finite coordinates; nothing to block below 2 points.
        backend = "numpy" if numpy_ok else "torch"
    if backend == "blocked":
        picked = _fps_blocked(pts, num_samples)
    elif backend == "numpy":
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
