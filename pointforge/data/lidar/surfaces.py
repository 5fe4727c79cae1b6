"""A surface type for every point of a dense lidar cloud, to score an upsampler per type.

From the LAS classification where the file has one (ASPRS codes: ground 2,
vegetation 3-5, building 6; anything else ``other``). Where it has none
(every point 0 or 1, as in both public scans the project fetches), a
geometric proxy from each point's ``k`` nearest neighbours: the covariance's
eigenvalues λ0 ≤ λ1 ≤ λ2 give the surface variation λ0 / (λ0 + λ1 + λ2) (0 on
a plane, 1/3 for an isotropic scatter). A point below ``planar`` is on a
surface, ``flat`` when its normal is within about 30° of vertical (ground,
roofs, streets), ``steep`` otherwise (walls, slopes, facades); above it the point is
``rough`` (tree crowns, edges, clutter).
"""

from __future__ import annotations

import numpy as np
from scipy.spatial import cKDTree

__all__ = ["CLASSIFIED", "PROXY", "surface_types", "classified_types", "proxy_types"]

CLASSIFIED = ("ground", "vegetation", "building", "other")
PROXY = ("flat", "steep", "rough")


def classified_types(classification: np.ndarray) -> np.ndarray:
    """Names per point from ASPRS codes (module docs)."""
    codes = np.asarray(classification)
    names = np.full(len(codes), "other", dtype=object)
    names[codes == 2] = "ground"
    names[(codes >= 3) & (codes <= 5)] = "vegetation"
    names[codes == 6] = "building"
    return names


def proxy_types(xyz: np.ndarray, *, k: int = 16, planar: float = 0.02, workers: int = 1) -> np.ndarray:
    """Names per point from local geometry (module docs)."""
    xyz = np.asarray(xyz, dtype=np.float64)
    _, index = cKDTree(xyz).query(xyz, k=min(k, len(xyz)), workers=workers)
    neighbours = xyz[index]
    centred = neighbours - neighbours.mean(axis=1, keepdims=True)
    values, vectors = np.linalg.eigh(np.einsum("nki,nkj->nij", centred, centred))
    variation = values[:, 0] / np.maximum(values.sum(axis=1), 1e-12)
    upright = np.abs(vectors[:, 2, 0]) >= np.cos(np.radians(30))
    names = np.full(len(xyz), "rough", dtype=object)
    names[(variation < planar) & upright] = "flat"
    names[(variation < planar) & ~upright] = "steep"
    return names


def surface_types(xyz: np.ndarray, classification: np.ndarray | None = None, **proxy) -> np.ndarray:
    """The classification's types when it names ground, vegetation or building anywhere; else the proxy's."""
    if classification is not None and np.isin(np.asarray(classification), [2, 3, 4, 5, 6]).any():
        return classified_types(classification)
    return proxy_types(xyz, **proxy)
