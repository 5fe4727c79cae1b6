"""Sparse clouds from a dense one, by protocol: which dense points a sparser survey would have kept.

Every protocol returns the sorted indices of the kept points (the sparse cloud
is a subset of the dense one, so the truth holds every input point, as it does
when a dense survey is thinned), about ``len(xyz) / ratio`` of them, seeded:

* ``random``: a uniform draw of exactly ``round(N / ratio)`` points (returns
  lost at random: a lower pulse rate);
* ``lines``: the points of every ``ratio``-th band across a seeded direction
  in the XY plane, bands one dense spacing wide: scan lines dropped, as a
  scanner with ``ratio`` times fewer lines (or a faster flight) leaves them;
  the sparse cloud is line-structured and its gaps are anisotropic;
* ``voxel``: one seeded point per cell of a 3-D voxel grid whose side is
  chosen (by bisection) so that about ``N / ratio`` cells are occupied: a
  density target, as when a survey is delivered at so many points per m²
  (the dense density halved for ``ratio`` 2); the sparse cloud is evenly spread
  where the dense one clumps (tree crowns, overlapping flight lines).
"""

from __future__ import annotations

import numpy as np
from scipy.spatial import cKDTree

from pointforge.errors import ConfigError, DataError

__all__ = ["PROTOCOLS", "thin", "random_thinning", "line_thinning", "voxel_thinning"]

PROTOCOLS = ("random", "lines", "voxel")


def _check(xyz: np.ndarray, ratio: float) -> np.ndarray:
    xyz = np.asarray(xyz, dtype=np.float64)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or len(xyz) < 4:
        raise DataError(f"a cloud to thin must be [N, 3] with at least 4 points, got shape {xyz.shape}")
    if not ratio > 1:
        raise ConfigError(f"thinning ratio must be above 1, got {ratio}")
    return xyz


def random_thinning(xyz: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    xyz = _check(xyz, ratio)
    return np.sort(rng.choice(len(xyz), size=max(1, int(round(len(xyz) / ratio))), replace=False))


def line_thinning(xyz: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    xyz = _check(xyz, ratio)
    period = int(round(ratio))
    spacing = float(np.median(cKDTree(xyz[:, :2]).query(xyz[:, :2], k=2)[0][:, 1]))
    width = spacing if spacing > 0 else 1.0
    angle = rng.uniform(0, np.pi)
    across = xyz[:, 0] * np.cos(angle) + xyz[:, 1] * np.sin(angle)
    band = np.floor((across - across.min()) / width).astype(np.int64)
    return np.flatnonzero(band % period == rng.integers(period))


def _voxel_pick(xyz: np.ndarray, side: float, order: np.ndarray) -> np.ndarray:
    cells = np.floor((xyz[order] - xyz.min(axis=0)) / side).astype(np.int64)
    _, first = np.unique(cells, axis=0, return_index=True)
    return order[first]


def voxel_thinning(xyz: np.ndarray, ratio: float, rng: np.random.Generator, *, steps: int = 30) -> np.ndarray:
    xyz = _check(xyz, ratio)
    target = len(xyz) / ratio
    order = rng.permutation(len(xyz))  # which point of a cell survives: the first in a seeded order
    lo, hi = 1e-6, float((xyz.max(axis=0) - xyz.min(axis=0)).max()) + 1e-6
    best = _voxel_pick(xyz, hi, order)
    for _ in range(steps):  # geometric bisection: the count falls as the side grows
        side = float(np.sqrt(lo * hi))
        kept = _voxel_pick(xyz, side, order)
        if abs(len(kept) - target) < abs(len(best) - target):
            best = kept
        if len(kept) > target:
            lo = side
        else:
            hi = side
        if abs(len(kept) - target) <= 0.005 * target:
            break
    return np.sort(best)


def thin(protocol: str, xyz: np.ndarray, ratio: float, *, seed: int) -> np.ndarray:
    """Indices of the points ``protocol`` keeps (module docs)."""
    rng = np.random.default_rng(
        np.random.SeedSequence([int(seed), PROTOCOLS.index(protocol) if protocol in PROTOCOLS else 0])
    )
    if protocol == "random":
        return random_thinning(xyz, ratio, rng)
    if protocol == "lines":
        return line_thinning(xyz, ratio, rng)
    if protocol == "voxel":
        return voxel_thinning(xyz, ratio, rng)
    raise ConfigError(f"unknown thinning protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
