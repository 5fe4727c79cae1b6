"""An exact furthest point sampling that skips cells the new sample cannot change, against the plain loop.

The candidate (QuickFPS's idea, in pure PyTorch, vectorised over the batch): the points,
in the plain loop's scan order, are sorted into spatial buckets of ``bucket`` points
(by a coarse grid's cell), each with its bounding box and the largest of its points'
distances to the chosen set. A new sample can only lower a point's distance if it lies
closer than that point's distance; the squared distance from the sample to a bucket's
box bounds every one of its points' from below, so a bucket whose bound is at least its
largest distance is skipped. The bound is computed with the same float operations in
the same order as the distances (a difference, its square, x² + y², then + z²), and
float rounding is monotone, so it never exceeds a distance it stands for: the skipped
buckets' distances are exactly those the plain loop would keep, and the picks are
identical, ties included (the largest distance, then the smallest scan position).

The candidate is checked equal to ``furthest_point_sample_indices`` on random,
lattice (ties) and duplicated points before it is timed. Both run side by side in one
process, interleaved, median of several runs. The machine may be shared: the ratio is
the point, the absolute times are context.

    python bench/fps_pruned.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import date

import numpy as np
import torch
from torch import Tensor

from _common import machine, print_table, write_json
from pointforge.nn.pvops.common import FAR
from pointforge.nn.pvops.fps import _fps_scan_order, furthest_point_sample_indices


def pruned_fps_indices(coords: Tensor, num_samples: int, bucket: int = 64) -> Tensor:
    """Indices ``[B, num_samples]``, identical to ``furthest_point_sample_indices`` (module docs)."""
    b, _, n = coords.shape
    pts = coords.detach()
    order = _fps_scan_order(n, pts.device)
    scan = torch.arange(n, device=pts.device) if order is None else order
    pts = pts.index_select(2, scan).transpose(1, 2)  # [B, N, 3] in scan order
    # Spatial buckets: sort by a coarse grid cell, ties by scan position; pad to whole buckets.
    lo, hi = pts.amin(1, keepdim=True), pts.amax(1, keepdim=True)
    side = max(1, round((n / bucket) ** (1 / 3)))
    cell = ((pts - lo) / (hi - lo).clamp_min(1e-12) * side).long().clamp_(0, side - 1)
    key = (cell[..., 0] * side + cell[..., 1]) * side + cell[..., 2]
    position = torch.arange(n, device=pts.device).expand(b, n)
    sort = torch.argsort(key * n + position, dim=1)
    g = -(-n // bucket)
    pad = g * bucket - n
    sort = torch.cat([sort, sort[:, :1].expand(b, pad)], 1)
    bp = torch.gather(pts, 1, sort.unsqueeze(-1).expand(-1, -1, 3)).view(b, g, bucket, 3)
    bpos = sort.view(b, g, bucket)  # scan position of every slot
    best = torch.full((b, g, bucket), FAR, dtype=pts.dtype, device=pts.device)
    best.view(b, -1)[:, n:] = -1.0  # padding never wins and never matters
    box_lo, box_hi = bp.amin(2), bp.amax(2)  # [B, G, 3]
    cell_max = best.amax(2)
    rows = torch.arange(b, device=pts.device)
    picked = torch.zeros((num_samples, b), dtype=torch.long, device=pts.device)
    last = torch.zeros(b, dtype=torch.long, device=pts.device)  # scan position 0 first
    last_xyz = pts[:, 0]
    for j in range(1, num_samples):
        q = last_xyz.unsqueeze(1)  # [B, 1, 3]
        gap = torch.maximum(torch.maximum(box_lo - q, q - box_hi), torch.zeros((), dtype=pts.dtype))
        gap = gap * gap
        bound = gap[..., 0] + gap[..., 1] + gap[..., 2]
        bi, gi = torch.nonzero(bound < cell_max, as_tuple=True)
        diff = bp[bi, gi] - q[bi]
        diff = diff * diff
        dist = diff[..., 0] + diff[..., 1] + diff[..., 2]
        updated = torch.minimum(best[bi, gi], dist)
        best[bi, gi] = updated
        cell_max[bi, gi] = updated.amax(1)
        top = cell_max.amax(1)
        ci, cg = torch.nonzero(cell_max == top[:, None], as_tuple=True)
        candidates = torch.where(best[ci, cg] == top[ci, None], bpos[ci, cg], n)
        last = torch.full((b,), n, dtype=torch.long, device=pts.device).scatter_reduce(
            0, ci, candidates.amin(1), reduce="amin"
        )
        picked[j] = last
        last_xyz = pts[rows, last]
    picked = picked.t()
    return picked if order is None else order[picked]


def pruned_fps_indices_numpy(coords: Tensor, num_samples: int, bucket: int = 64) -> Tensor:
    """The same algorithm in NumPy (CPU tensors): fewer microseconds per step than torch's dispatch."""
    b, _, n = coords.shape
    order = _fps_scan_order(n, coords.device)
    scan = np.arange(n) if order is None else order.numpy()
    pts = np.ascontiguousarray(coords.numpy()[:, :, scan].transpose(0, 2, 1))  # [B,N,3]
    lo, hi = pts.min(1, keepdims=True), pts.max(1, keepdims=True)
    side = max(1, round((n / bucket) ** (1 / 3)))
    cell = np.clip(((pts - lo) / np.maximum(hi - lo, 1e-12) * side).astype(np.int64), 0, side - 1)
    key = (cell[..., 0] * side + cell[..., 1]) * side + cell[..., 2]
    sort = np.argsort(key * n + np.arange(n), axis=1, kind="stable")
    g = -(-n // bucket)
    pad = g * bucket - n
    sort = np.concatenate([sort, np.repeat(sort[:, :1], pad, 1)], 1)
    bp = np.take_along_axis(pts, sort[..., None], 1).reshape(b, g, bucket, 3)
    bpos = sort.reshape(b, g, bucket)
    best = np.full((b, g, bucket), FAR, dtype=pts.dtype)
    best.reshape(b, -1)[:, n:] = -1.0
    box_lo, box_hi = bp.min(2), bp.max(2)
    cell_max = best.max(2)
    picked = np.zeros((num_samples, b), dtype=np.int64)
    rows = np.arange(b)
    q = pts[:, 0].copy()
    zero = pts.dtype.type(0)
    for j in range(1, num_samples):
        qq = q[:, None, :]
        gap = np.maximum(np.maximum(box_lo - qq, qq - box_hi), zero)
        gap *= gap
        bound = gap[..., 0] + gap[..., 1]
        bound += gap[..., 2]
        bi, gi = np.nonzero(bound < cell_max)
        diff = bp[bi, gi] - q[bi][:, None, :]
        diff *= diff
        dist = diff[..., 0] + diff[..., 1]
        dist += diff[..., 2]
        upd = np.minimum(best[bi, gi], dist)
        best[bi, gi] = upd
        cell_max[bi, gi] = upd.max(1)
        if b == 1:
            top = cell_max[0].max()
            cg = np.flatnonzero(cell_max[0] == top)
            if len(cg) == 1:
                cand = bpos[0, cg[0]][best[0, cg[0]] == top].min()
            else:
                cand = np.where(best[0, cg] == top, bpos[0, cg], n).min()
            last = np.array([cand])
        else:
            top = cell_max.max(1)
            ci, cg = np.nonzero(cell_max == top[:, None])
            cands = np.where(best[ci, cg] == top[ci, None], bpos[ci, cg], n).min(1)
            last = np.full(b, n)
            np.minimum.at(last, ci, cands)
        picked[j] = last
        q = pts[rows, last]
    picked = torch.from_numpy(np.ascontiguousarray(picked.T))
    return picked if order is None else order[picked]


def _cases() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    lattice = torch.stack(torch.meshgrid(*[torch.arange(12.0)] * 3, indexing="ij")).view(1, 3, -1)
    dup = torch.rand(2, 3, 700, generator=g)
    return {
        "random": torch.rand(3, 3, 3000, generator=g) * 4 - 2,
        "lattice (ties)": lattice.expand(2, -1, -1).contiguous(),
        "duplicates": torch.cat([dup, dup, dup[:, :, :300]], 2),
        "one cluster far away": torch.cat([torch.rand(1, 3, 900, generator=g), 50 + torch.rand(1, 3, 5)], 2),
    }


def check_equal() -> None:
    for name, coords in _cases().items():
        for samples in (1, 17, coords.shape[2] // 3, coords.shape[2]):
            plain = furthest_point_sample_indices(coords, samples, method="torch")
            for candidate in (pruned_fps_indices, pruned_fps_indices_numpy):
                if not torch.equal(candidate(coords, samples), plain):
                    raise SystemExit(f"{candidate.__name__} differs from the plain FPS on {name}, {samples} samples")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--points", type=int, default=30720)
    parser.add_argument("--samples", type=int, default=10240)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    check_equal()
    g = torch.Generator().manual_seed(1)
    rows, record = [], []
    for batch in (1, 5):
        v = torch.randn(batch, 3, args.points, generator=g)
        coords = (3 * v / v.norm(dim=1, keepdim=True)).contiguous()  # points on a sphere, as on a skull
        paths = {
            "plain, numpy (CPU default)": lambda: furthest_point_sample_indices(coords, args.samples, method="numpy"),
            "plain, torch": lambda: furthest_point_sample_indices(coords, args.samples, method="torch"),
            "pruned, torch": lambda: pruned_fps_indices(coords, args.samples),
            "pruned, numpy": lambda: pruned_fps_indices_numpy(coords, args.samples),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        results = {}
        for _ in range(args.repeats):
            for name, run in paths.items():
                start = time.perf_counter()
                results[name] = run()
                times[name].append(time.perf_counter() - start)
        first = next(iter(results.values()))
        assert all(torch.equal(first, r) for r in results.values()), "the paths disagree"
        base = statistics.median(times["plain, numpy (CPU default)"])
        for name, spent in times.items():
            rows.append([batch, name, statistics.median(spent), base / statistics.median(spent)])
            record.append({"batch": batch, "path": name, "times_s": spent})
    print(f"FPS of {args.samples:,} of {args.points:,} points, {args.threads} threads, {date.today()}; {machine()}")
    print(f"load average {os.getloadavg()[0]:.1f} (the machine is shared: ratios, not absolute times)")
    print_table(["batch", "path", "median s", "speed vs plain numpy"], rows)
    path = write_json("fps_pruned", {"machine": machine(), "threads": args.threads, "runs": record})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
