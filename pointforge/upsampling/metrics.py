"""How close an upsampled cloud is to the dense truth: the field's metrics, in source units.

``pred`` is the upsampled cloud P (r·N points), ``truth`` the dense cloud Q (M
points), both float64 ``[., 3]`` in the same frame (metres for lidar):

* **Chamfer** (m²): ``mean_p min_q |p-q|² + mean_q min_p |q-p|²``, squared
  distances, each direction averaged over its own points, the two summed; the
  training loss's definition (:mod:`pointforge.nn.losses`), in source units.
* **Hausdorff** (m): ``max(max_p min_q |p-q|, max_q min_p |q-p|)``.
* **Point-to-surface** (m): the mean over p of the distance from p to the plane
  fitted (least squares: through the centroid, normal along the covariance's
  smallest eigenvector) to the ``surface_k`` points of Q nearest to p. The
  dense cloud has no mesh; its local plane stands in for the surface (as the
  point-to-surface "P2F" of PU-Net / PU-GAN measures the distance to the
  reference mesh), so noise along the surface costs nothing here and noise
  across it does.
* **Uniformity** (coefficient of variation, no unit): ``seeds`` points drawn
  from Q (seeded), a ball of radius ``radius_factor`` × Q's median
  nearest-neighbour spacing around each; the standard deviation of the number
  of P's points per ball over its mean. It is the spirit of PU-Net's NUC (the
  spread of points per disk on the surface), with balls in 3-D because there is
  no mesh to draw disks on. Q has structure of its own (tree crowns, walls), so
  :func:`uniformity` of the truth itself is the floor to compare with.

Every neighbour search is a :class:`scipy.spatial.cKDTree` query in chunks of
``chunk`` points, so memory stays linear in the clouds whatever their size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.spatial import cKDTree

from pointforge.errors import DataError

__all__ = [
    "METRICS",
    "CloudMetrics",
    "nearest_distances",
    "chamfer",
    "hausdorff",
    "point_to_surface",
    "median_spacing",
    "uniformity",
    "cloud_metrics",
]

METRICS = ("chamfer", "hausdorff", "p2s", "uniformity")
CHUNK = 1 << 18


def _check(xyz: np.ndarray, what: str, at_least: int = 1) -> np.ndarray:
    xyz = np.asarray(xyz, dtype=np.float64)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or len(xyz) < at_least:
        raise DataError(f"{what} must be an [N, 3] cloud of at least {at_least} point(s), got shape {xyz.shape}")
    if not np.isfinite(xyz).all():
        raise DataError(f"{what} holds NaN or infinite coordinates; clean it first")
    return xyz


def nearest_distances(query: np.ndarray, tree: cKDTree, *, chunk: int = CHUNK, workers: int = 1) -> np.ndarray:
    """Distance from each query point to its nearest point in ``tree`` (float64 ``[len(query)]``)."""
    out = np.empty(len(query))
    for start in range(0, len(query), chunk):
        out[start : start + chunk] = tree.query(query[start : start + chunk], k=1, workers=workers)[0]
    return out


def _both_ways(pred: np.ndarray, truth: np.ndarray, chunk: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    pred, truth = _check(pred, "predicted cloud"), _check(truth, "dense cloud")
    to_truth = nearest_distances(pred, cKDTree(truth), chunk=chunk, workers=workers)
    to_pred = nearest_distances(truth, cKDTree(pred), chunk=chunk, workers=workers)
    return to_truth, to_pred


def chamfer(pred: np.ndarray, truth: np.ndarray, *, chunk: int = CHUNK, workers: int = 1) -> float:
    """Chamfer distance (module docs), squared source units."""
    a, b = _both_ways(pred, truth, chunk, workers)
    return float(np.mean(a**2) + np.mean(b**2))


def hausdorff(pred: np.ndarray, truth: np.ndarray, *, chunk: int = CHUNK, workers: int = 1) -> float:
    """Symmetric Hausdorff distance (module docs), source units."""
    a, b = _both_ways(pred, truth, chunk, workers)
    return float(max(a.max(), b.max()))


def plane_distances(query: np.ndarray, surface: np.ndarray, tree: cKDTree, k: int, chunk: int, workers: int):
    """Distance of each query point to the least-squares plane of its ``k`` nearest ``surface`` points."""
    out = np.empty(len(query))
    for start in range(0, len(query), chunk):
        part = query[start : start + chunk]
        _, index = tree.query(part, k=k, workers=workers)
        neighbours = surface[index]  # [c, k, 3]
        centroid = neighbours.mean(axis=1)
        centred = neighbours - centroid[:, None, :]
        _, vectors = np.linalg.eigh(np.einsum("cki,ckj->cij", centred, centred))
        normal = vectors[:, :, 0]  # eigh sorts ascending: the smallest spread is across the surface
        out[start : start + chunk] = np.abs(np.einsum("ci,ci->c", part - centroid, normal))
    return out


def point_to_surface(
    pred: np.ndarray, truth: np.ndarray, *, surface_k: int = 10, chunk: int = CHUNK, workers: int = 1
) -> float:
    """Mean distance from the predicted points to the dense cloud's local planes (module docs), source units."""
    if surface_k < 3:
        raise DataError(f"point-to-surface needs at least 3 neighbours to fit a plane, got surface_k={surface_k}")
    pred, truth = _check(pred, "predicted cloud"), _check(truth, "dense cloud", at_least=surface_k)
    distances = plane_distances(pred, truth, cKDTree(truth), surface_k, chunk // surface_k, workers)
    return float(distances.mean())


def median_spacing(xyz: np.ndarray, *, chunk: int = CHUNK, workers: int = 1) -> float:
    """Median distance from each point to its nearest other point."""
    xyz = _check(xyz, "cloud", at_least=2)
    tree = cKDTree(xyz)
    out = np.empty(len(xyz))
    for start in range(0, len(xyz), chunk):
        out[start : start + chunk] = tree.query(xyz[start : start + chunk], k=2, workers=workers)[0][:, 1]
    return float(np.median(out))


def uniformity(
    pred: np.ndarray,
    truth: np.ndarray,
    *,
    seeds: int = 1000,
    radius_factor: float = 4.0,
    seed: int = 0,
    spacing: float | None = None,
    workers: int = 1,
) -> float:
    """Coefficient of variation of P's points per ball around seeds drawn from Q (module docs).

    ``spacing``: Q's median spacing when already known. NaN when no ball holds a point.
    """
    pred, truth = _check(pred, "predicted cloud"), _check(truth, "dense cloud", at_least=2)
    rng = np.random.default_rng(seed)
    centres = truth[rng.choice(len(truth), size=min(seeds, len(truth)), replace=False)]
    radius = radius_factor * (median_spacing(truth, workers=workers) if spacing is None else spacing)
    counts = np.asarray(cKDTree(pred).query_ball_point(centres, radius, return_length=True, workers=workers))
    mean = counts.mean()
    return float(counts.std() / mean) if mean > 0 else math.nan


@dataclass(frozen=True)
class CloudMetrics:
    """One predicted cloud against its dense truth (module docs for each value)."""

    chamfer: float
    hausdorff: float
    p2s: float
    uniformity: float
    points: int
    truth_points: int

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def cloud_metrics(
    pred: np.ndarray,
    truth: np.ndarray,
    *,
    surface_k: int = 10,
    seeds: int = 1000,
    radius_factor: float = 4.0,
    chunk: int = CHUNK,
    workers: int = 1,
) -> CloudMetrics:
    """Every metric of the module docs, sharing the KD-trees."""
    pred, truth = _check(pred, "predicted cloud"), _check(truth, "dense cloud", at_least=max(surface_k, 2))
    truth_tree, pred_tree = cKDTree(truth), cKDTree(pred)
    to_truth = nearest_distances(pred, truth_tree, chunk=chunk, workers=workers)
    to_pred = nearest_distances(truth, pred_tree, chunk=chunk, workers=workers)
    p2s = plane_distances(pred, truth, truth_tree, surface_k, max(chunk // surface_k, 1), workers)
    return CloudMetrics(
        chamfer=float(np.mean(to_truth**2) + np.mean(to_pred**2)),
        hausdorff=float(max(to_truth.max(), to_pred.max())),
        p2s=float(p2s.mean()),
        uniformity=uniformity(pred, truth, seeds=seeds, radius_factor=radius_factor, workers=workers),
        points=len(pred),
        truth_points=len(truth),
    )
