"""Mapping skull points to the networks' frame and back: bounding-box normalisation, random rotations."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pointforge.errors import DataError


@dataclass(frozen=True)
class Normalization:
    """points_normalised = (points - center) / scale; ``inverse`` maps back."""

    center: np.ndarray  # [3]
    scale: float

    def apply(self, points: np.ndarray) -> np.ndarray:
        return ((points - self.center) / self.scale).astype(np.float32)

    def inverse(self, points: np.ndarray | torch.Tensor) -> np.ndarray:
        pts = points.detach().cpu().numpy() if isinstance(points, torch.Tensor) else np.asarray(points)
        return (pts * self.scale + self.center).astype(np.float32)


def bbox_normalization(points: np.ndarray, half_extent: float = 3.0) -> Normalization:
    """Centre of the bounding box; scale so the box's longest half-side maps to ``half_extent``.

    Computed from the defective skull alone in training and at test time, so the
    two agree (upstream used skull+implant in training, defective-only at test).
    """
    lo = points.min(axis=0).astype(np.float64)
    hi = points.max(axis=0).astype(np.float64)
    center = (lo + hi) / 2
    half = float((hi - lo).max()) / 2
    if half <= 0:
        raise DataError("cannot normalise a degenerate point cloud (all points equal)")
    return Normalization(center=center, scale=half / half_extent)


def random_rotation(rng: np.random.Generator, max_degrees: float) -> np.ndarray:
    """A rotation by independent angles within ±max_degrees about each axis."""
    ax, ay, az = np.deg2rad(rng.uniform(-max_degrees, max_degrees, size=3))
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    return rz @ ry @ rx
