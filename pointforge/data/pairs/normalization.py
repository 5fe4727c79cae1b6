"""The shared centre and scale of a sparse/dense pair, from the sparse cloud alone.

Normalisation: both clouds of a pair get the *same* centre and scale, computed
from the sparse cloud alone, because at inference time the sparse cloud is all
there is (computing it from both in training and from one at test time is the
mismatch upstream PCDiff has: its training box covers skull and implant, its
test box the defective skull alone). Centre: the middle of the sparse
cloud's bounding box. Scale, by ``normalization``:

* ``"spacing"`` (default): the median nearest-neighbour distance of the sparse
  cloud, so neighbouring input points are about 1 apart whatever the tile's
  extent. Lidar tiles differ in area by orders of magnitude; with an extent-based
  scale the same ground would look 100× finer in a big tile than in a small one
  and the network's relative-position encodings and the Chamfer loss would mean
  different things per tile.
* ``"extent"``: half the longest side of the bounding box (points within ±1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from pointforge.errors import ConfigError
from pointforge.nn.knn import knn_graph

NORMALIZATIONS = ("spacing", "extent")


@dataclass(frozen=True)
class PairNormalization:
    """``normalised = (points - center) / scale``, shared by both clouds of a pair.

    ``inverse`` works in float64: georeferenced coordinates (UTM metres in the
    millions) would lose centimetres in float32.
    """

    center: np.ndarray  # float64 [3]
    scale: float

    def apply(self, points: np.ndarray) -> np.ndarray:
        return ((np.asarray(points, dtype=np.float64) - self.center) / self.scale).astype(np.float32)

    def inverse(self, points: np.ndarray | Tensor) -> np.ndarray:
        pts = points.detach().cpu().numpy() if isinstance(points, Tensor) else np.asarray(points)
        return pts.astype(np.float64) * self.scale + self.center


def _nearest_neighbour_distances(xyz: np.ndarray, edge_index: np.ndarray) -> np.ndarray:
    src, dst = edge_index
    d = np.sqrt(((xyz[src] - xyz[dst]) ** 2).sum(axis=1))
    nearest = np.full(len(xyz), np.inf)
    np.minimum.at(nearest, dst, d)
    return nearest[np.isfinite(nearest)]


def pair_normalization(
    sparse_xyz: np.ndarray, mode: str = "spacing", edge_index: Optional[np.ndarray] = None
) -> PairNormalization:
    """Centre and scale from the sparse cloud (module docs).

    ``"spacing"`` uses ``edge_index`` (the cloud's symmetric kNN graph, which
    contains every point's nearest neighbour); it falls back to the mean of the
    non-zero spacings when most points are duplicates, then to ``"extent"``.
    A cloud with no extent at all (one point, or all points equal) gets scale 1.
    """
    if mode not in NORMALIZATIONS:
        raise ConfigError(f"unknown normalization {mode!r}; choose one of {', '.join(NORMALIZATIONS)}")
    xyz = np.asarray(sparse_xyz, dtype=np.float64)
    lo, hi = xyz.min(axis=0), xyz.max(axis=0)
    center = (lo + hi) / 2
    scale = 0.0
    if mode == "spacing":
        if edge_index is None:
            edge_index = knn_graph(torch.from_numpy(xyz - center), 1).numpy()
        spacing = _nearest_neighbour_distances(xyz - center, np.asarray(edge_index))
        if len(spacing):
            scale = float(np.median(spacing))
            if scale <= 0 and (spacing > 0).any():
                scale = float(spacing[spacing > 0].mean())
    if scale <= 0:
        scale = float((hi - lo).max()) / 2
    if scale <= 0 or not math.isfinite(scale):
        scale = 1.0
    return PairNormalization(center=center, scale=scale)
