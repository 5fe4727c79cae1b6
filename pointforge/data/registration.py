"""Rigid-plus-scale registration of surface point sets (trimmed ICP), in millimetres.

Used by the atlas baseline (:mod:`pointforge.implant.baseline`) and by PCDiff's
implant-frame estimate (:mod:`pointforge.tasks.pcdiff.frame`); it lives in the data
layer so both can share it. ``register`` needs a target with ``surface``
(``[M, 3]`` points) and ``tree`` (a k-d tree over them), e.g. :class:`SurfaceTarget`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.spatial import cKDTree

__all__ = ["SurfaceTarget", "Registration", "register", "invert"]


@dataclass(frozen=True)
class SurfaceTarget:
    """Surface points in mm and a k-d tree over them: what :func:`register` fits onto."""

    surface: np.ndarray
    tree: cKDTree

    @classmethod
    def of(cls, points: np.ndarray) -> "SurfaceTarget":
        points = np.asarray(points, dtype=np.float64)
        return cls(points, cKDTree(points))


@dataclass(frozen=True)
class Registration:
    """``y = matrix @ x + offset`` maps defective-skull mm to atlas-skull mm."""

    matrix: np.ndarray  # 3×3: rotation @ diag(scale)
    offset: np.ndarray  # [3]
    residual_before_mm: float  # mean distance of the defective-skull points to the atlas surface, after init
    residual_after_mm: float  # the same after ICP
    iterations: int

    def apply(self, points: np.ndarray) -> np.ndarray:
        return points @ self.matrix.T + self.offset


def _fit_scale_shift(p: np.ndarray, q: np.ndarray, rotation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares per-axis scale and shift of ``q ≈ R (s ⊙ p) + t`` for a fixed ``R``."""
    r = q @ rotation  # Rᵀ q, row-wise
    pc = p - p.mean(axis=0)
    rc = r - r.mean(axis=0)
    scale = (pc * rc).sum(axis=0) / np.maximum((pc * pc).sum(axis=0), 1e-12)
    shift = q.mean(axis=0) - rotation @ (scale * p.mean(axis=0))
    return scale, shift


def _fit_rotation(p: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Orthogonal Procrustes: the proper rotation best mapping centred ``s ⊙ p`` onto centred ``q``."""
    a = (p - p.mean(axis=0)) * scale
    b = q - q.mean(axis=0)
    u, _, vt = np.linalg.svd(b.T @ a)
    d = np.sign(np.linalg.det(u @ vt))
    return u @ np.diag([1.0, 1.0, d]) @ vt


def register(
    points_mm: np.ndarray,
    skull,
    *,
    rotation: bool = True,
    trim: float = 1.0,
    iterations: int = 40,
    tolerance_mm: float = 1e-3,
) -> Registration:
    """Trimmed ICP of defective-skull surface points onto an atlas skull's surface.

    Starts from a pure translation matching the points' centroid to the atlas
    surface's centroid. Each iteration pairs every point with its nearest
    atlas surface point, keeps the ``trim`` fraction of closest pairs and
    refits scale + shift (and, with ``rotation``, alternately the rotation) in
    closed form. Stops when no point moves more than ``tolerance_mm`` or after
    ``iterations``.
    """
    p = np.asarray(points_mm, dtype=np.float64)
    rot = np.eye(3)
    scale = np.ones(3)
    shift = skull.surface.mean(axis=0) - p.mean(axis=0)
    n_keep = max(3, int(round(trim * len(p))))
    moved = p * scale @ rot.T + shift
    before = float(skull.tree.query(moved)[0].mean())
    done = 0
    for done in range(1, iterations + 1):
        dist, idx = skull.tree.query(moved)
        keep = np.argpartition(dist, n_keep - 1)[:n_keep] if n_keep < len(p) else slice(None)
        src, dst = p[keep], skull.surface[idx[keep]]
        if rotation:
            for _ in range(2):
                rot = _fit_rotation(src, dst, scale)
                scale, shift = _fit_scale_shift(src, dst, rot)
        else:
            scale, shift = _fit_scale_shift(src, dst, rot)
        new = p * scale @ rot.T + shift
        step = float(np.sqrt(((new - moved) ** 2).sum(axis=1)).max())
        moved = new
        if step < tolerance_mm:
            break
    after = float(skull.tree.query(moved)[0].mean())
    return Registration(rot * scale[None, :], shift, before, after, done)


def invert(reg: Registration, points: np.ndarray) -> np.ndarray:
    """Map points back through ``reg``: atlas mm → defective-skull mm."""
    return (np.asarray(points, dtype=np.float64) - reg.offset) @ np.linalg.inv(reg.matrix).T
