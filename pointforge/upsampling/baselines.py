"""Upsampling without learning: what a trained upsampler has to beat.

Each baseline turns a sparse cloud of N points into exactly ``ratio`` · N
points, like the network, so every metric compares like with like:

* ``input``: every sparse point repeated ``ratio`` times. Repeating every point
  the same number of times changes none of the metrics of
  :mod:`pointforge.upsampling.metrics` (nearest distances and ball
  counts scale alike), so this *is* the sparse input scored as it is.
* ``midpoint``: the input points plus, for each point, the midpoints of the
  edges to its ``ratio - 1`` nearest neighbours (k-NN edge midpoints). An edge
  already used from its other end would put the same midpoint in twice, so the
  point takes its next nearest neighbour instead.
* ``plane``: a local-surface fit. Each point is projected onto the
  least-squares plane of its ``k`` nearest input points (which removes the
  noise across the surface), and its ``ratio - 1`` children are put on that
  plane around it, at half its mean neighbour distance, evenly spread in angle
  from a seeded random start.
"""

from __future__ import annotations

import numpy as np
from scipy.spatial import cKDTree

from pointforge.errors import ConfigError, DataError

__all__ = ["BASELINES", "upsample_baseline", "repeat_input", "knn_midpoints", "plane_fit"]

BASELINES = ("input", "midpoint", "plane")


def _check(xyz: np.ndarray, ratio: int, at_least: int) -> np.ndarray:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, np.integer)) or ratio < 1:
        raise ConfigError(f"upsampling ratio must be a positive integer, got {ratio!r}")
    xyz = np.asarray(xyz, dtype=np.float64)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or len(xyz) < at_least:
        raise DataError(f"the sparse cloud must be [N, 3] with at least {at_least} points, got shape {xyz.shape}")
    return xyz


def repeat_input(xyz: np.ndarray, ratio: int) -> np.ndarray:
    """Each point ``ratio`` times in a row: ``[ratio·N, 3]``."""
    return np.repeat(_check(xyz, ratio, 1), ratio, axis=0)


def knn_midpoints(xyz: np.ndarray, ratio: int, *, workers: int = 1) -> np.ndarray:
    """The points, then the midpoints to each point's ``ratio - 1`` nearest neighbours (module docs)."""
    xyz = _check(xyz, ratio, 1)
    extra = ratio - 1
    if extra == 0:
        return xyz.copy()
    if len(xyz) <= extra:
        raise DataError(f"k-NN midpoints at ratio {ratio} need more than {extra} points, got {len(xyz)}")
    k = min(len(xyz) - 1, 4 * extra + 4)
    _, index = cKDTree(xyz).query(xyz, k=k + 1, workers=workers)
    chosen = np.empty((len(xyz), extra), dtype=np.int64)
    used: set[tuple[int, int]] = set()
    for p, row in enumerate(index[:, 1:].tolist()):
        # An edge already taken from its other end would give the same midpoint twice: skip it.
        fresh = [q for q in row if (min(p, q), max(p, q)) not in used][:extra]
        fresh += row[: extra - len(fresh)]  # a point all of whose neighbours took it: accept a repeat
        chosen[p] = fresh
        used.update((min(p, q), max(p, q)) for q in fresh)
    mids = (xyz[:, None, :] + xyz[chosen]) / 2
    return np.concatenate([xyz, mids.reshape(-1, 3)])


def plane_fit(xyz: np.ndarray, ratio: int, *, k: int = 10, seed: int = 0, workers: int = 1) -> np.ndarray:
    """Projected points and their children on the local planes (module docs): ``[ratio·N, 3]``."""
    xyz = _check(xyz, ratio, max(k, 3))
    _, index = cKDTree(xyz).query(xyz, k=k, workers=workers)
    neighbours = xyz[index]
    centroid = neighbours.mean(axis=1)
    centred = neighbours - centroid[:, None, :]
    _, vectors = np.linalg.eigh(np.einsum("nki,nkj->nij", centred, centred))
    normal, u, v = vectors[:, :, 0], vectors[:, :, 2], vectors[:, :, 1]
    projected = xyz - np.einsum("ni,ni->n", xyz - centroid, normal)[:, None] * normal
    step = 0.5 * np.linalg.norm(neighbours[:, 1:] - xyz[:, None, :], axis=2).mean(axis=1)
    extra = ratio - 1
    if extra == 0:
        return projected
    start = np.random.default_rng(seed).uniform(0, 2 * np.pi, len(xyz))
    angles = start[:, None] + 2 * np.pi * np.arange(extra)[None, :] / extra
    children = projected[:, None, :] + step[:, None, None] * (
        np.cos(angles)[:, :, None] * u[:, None, :] + np.sin(angles)[:, :, None] * v[:, None, :]
    )
    return np.concatenate([projected, children.reshape(-1, 3)])


def upsample_baseline(name: str, xyz: np.ndarray, ratio: int, *, workers: int = 1) -> np.ndarray:
    """The baseline called ``name`` (one of :data:`BASELINES`) on ``xyz``."""
    if name == "input":
        return repeat_input(xyz, ratio)
    if name == "midpoint":
        return knn_midpoints(xyz, ratio, workers=workers)
    if name == "plane":
        return plane_fit(xyz, ratio, workers=workers)
    raise ConfigError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
