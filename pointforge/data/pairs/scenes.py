"""Synthetic airborne-lidar scenes as sparse/dense pairs of any size, seeded, and folders of them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pointforge.data.pairs.manifest import PairEntry, write_manifest
from pointforge.data.pointio import LasGeometry, write_points
from pointforge.errors import ConfigError


@dataclass(frozen=True)
class SyntheticScene:
    """What a synthetic airborne-lidar tile looks like (lengths in metres).

    The dense cloud samples a smooth terrain, tree crowns (clustered vertical
    blobs on stems) and, on tiles large enough, one or two box buildings (roofs
    fully, walls thinly, as a nadir scanner sees them). The sparse cloud is a
    subsample with occlusion holes (``dropout``: the fraction of the tile's area
    lost in a few discs) and Gaussian noise.
    """

    density: float = 20.0  # dense points per square metre of tile
    ratio: float = 2.0  # dense points per sparse point
    noise: float = 0.05  # sparse noise, metres (standard deviation per axis)
    dense_noise: float = 0.01
    dropout: float = 0.1
    trees_per_100m2: float = 0.8
    origin: tuple[float, float, float] = (500_000.0, 4_100_000.0, 150.0)  # UTM-like, exercises float64 paths

    def __post_init__(self):
        if self.density <= 0 or self.noise < 0 or self.dense_noise < 0 or self.trees_per_100m2 < 0:
            raise ConfigError("synthetic scene: density must be positive and noise / tree rate non-negative")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"synthetic scene: dropout must be in [0, 1), got {self.dropout}")
        if self.ratio * (1 - self.dropout) < 1:
            raise ConfigError(
                f"synthetic scene: ratio {self.ratio} with dropout {self.dropout} leaves fewer dense points "
                "than sparse ones; raise ratio or lower dropout"
            )


def _terrain(rng: np.random.Generator, side: float):
    amplitude = 1.0 + 0.04 * side
    waves = [
        (rng.uniform(0.3, 1.5), rng.uniform(0.3, 1.5), rng.uniform(0, 2 * np.pi), rng.uniform(0.3, 1.0))
        for _ in range(3)
    ]

    def height(x, y):
        z = np.zeros_like(x)
        for fx, fy, phase, weight in waves:
            z += weight * np.sin(2 * np.pi * (fx * x + fy * y) / side + phase)
        return amplitude * z / 3

    return height


def _in_buildings(buildings: list[tuple], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    inside = np.zeros(x.shape, bool)
    for x0, y0, w, d, _ in buildings:
        inside |= (x >= x0) & (x <= x0 + w) & (y >= y0) & (y <= y0 + d)
    return inside


def _buildings(rng: np.random.Generator, side: float, height) -> list[tuple]:
    """(x0, y0, width, depth, top z) of none, one or two buildings, by tile size."""
    buildings = []
    for _ in range(int(side > 25) + int(side > 60)):
        w, d = (float(np.clip(rng.uniform(0.15, 0.3) * side, 5, 25)) for _ in range(2))
        x0, y0 = rng.uniform(0, side - w), rng.uniform(0, side - d)
        base = float(height(np.array([x0 + w / 2]), np.array([y0 + d / 2]))[0])
        buildings.append((x0, y0, w, d, base + rng.uniform(4, 12)))
    return buildings


def _trees(rng: np.random.Generator, side: float, scene: SyntheticScene, buildings: list[tuple], height):
    """Tree positions (off the buildings), crown radii and crown heights."""
    n_trees = int(rng.poisson(scene.trees_per_100m2 * side * side / 100)) + 1
    tx, ty = rng.uniform(0, side, n_trees), rng.uniform(0, side, n_trees)
    keep = ~_in_buildings(buildings, tx, ty)
    tx, ty = tx[keep], ty[keep]
    crown_r = rng.uniform(1.0, 3.5, len(tx))
    crown_z = height(tx, ty) + rng.uniform(4, 16, len(tx))
    return tx, ty, crown_r, crown_z


def _component_counts(
    rng, n_dense: int, side: float, buildings: list[tuple], crown_r: np.ndarray, height
) -> np.ndarray:
    """Points of ground, roofs, walls and crowns, in proportion to the surface a nadir scanner sees."""
    ground_area = side * side - sum(w * d for _, _, w, d, _ in buildings)
    roof_area = sum(w * d for _, _, w, d, _ in buildings)
    wall_area = 0.15 * sum(
        2 * (w + d) * (top - float(height(np.array([x0]), np.array([y0]))[0])) for x0, y0, w, d, top in buildings
    )
    crown_area = float((np.pi * crown_r**2 * 1.5).sum())
    weights = np.array([ground_area, roof_area, max(wall_area, 0.0), crown_area])
    return rng.multinomial(n_dense, weights / weights.sum())


def _ground_points(rng, count: int, side: float, buildings: list[tuple], height) -> np.ndarray:
    """Rejection-sampled outside the buildings."""
    ground = np.empty((0, 2))
    while len(ground) < count:
        xy = rng.uniform(0, side, (2 * (count - len(ground)) + 16, 2))
        ground = np.concatenate([ground, xy[~_in_buildings(buildings, xy[:, 0], xy[:, 1])]])
    ground = ground[:count]
    return np.column_stack([ground, height(ground[:, 0], ground[:, 1])])


def _building_points(rng, buildings: list[tuple], n_roof: int, n_wall: int, height) -> list[np.ndarray]:
    areas = np.array([w * d for _, _, w, d, _ in buildings])
    pick = rng.choice(len(buildings), size=n_roof, p=areas / areas.sum())
    b = np.array(buildings)[pick]
    u, v = rng.uniform(size=(2, n_roof))
    roofs = np.column_stack([b[:, 0] + u * b[:, 2], b[:, 1] + v * b[:, 3], b[:, 4]])
    pick = rng.choice(len(buildings), size=n_wall)
    b = np.array(buildings)[pick]
    # A wall point lies on an x-parallel or a y-parallel face, in proportion to their lengths.
    along_x = rng.uniform(size=n_wall) < b[:, 2] / (b[:, 2] + b[:, 3])
    far_face = rng.integers(0, 2, n_wall)
    u, s = rng.uniform(size=(2, n_wall))
    x = np.where(along_x, b[:, 0] + u * b[:, 2], b[:, 0] + far_face * b[:, 2])
    y = np.where(along_x, b[:, 1] + far_face * b[:, 3], b[:, 1] + u * b[:, 3])
    bottom = height(x, y)
    return [roofs, np.column_stack([x, y, bottom + s * (b[:, 4] - bottom)])]


def _crown_points(rng, tx, ty, crown_r, crown_z, count: int) -> np.ndarray:
    """Points in a shell of an upright ellipsoid, denser near the top where the beam hits first."""
    pick = rng.choice(len(tx), size=count, p=crown_r**2 / (crown_r**2).sum()) if len(tx) else np.zeros(0, int)
    if len(tx) == 0 and count:
        raise ConfigError("synthetic scene: buildings cover the whole tile; enlarge the tile")
    direction = rng.normal(size=(count, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    direction[:, 2] = np.abs(direction[:, 2]) * np.where(rng.uniform(size=count) < 0.8, 1, -1)
    radius = crown_r[pick] * rng.uniform(0.75, 1.0, count)
    return np.column_stack([
        tx[pick] + radius * direction[:, 0],
        ty[pick] + radius * direction[:, 1],
        crown_z[pick] + 1.3 * radius * direction[:, 2],
    ])  # fmt: skip


def _sparse_from_dense(rng, dense: np.ndarray, n_sparse: int, side: float, scene: SyntheticScene) -> np.ndarray:
    """Lose a few disc-shaped patches (occlusion, absorbed returns), subsample, add noise."""
    alive = np.ones(len(dense), bool)
    if scene.dropout > 0:
        holes = 3
        r = side * math.sqrt(scene.dropout / (holes * np.pi))
        for cx, cy in rng.uniform(0, side, (holes, 2)):
            alive &= (dense[:, 0] - cx) ** 2 + (dense[:, 1] - cy) ** 2 > r * r
    candidates = np.flatnonzero(alive)
    if len(candidates) < n_sparse:  # overlapping holes at the tile's corner can still eat too much
        candidates = np.concatenate([candidates, rng.permutation(np.flatnonzero(~alive))[: n_sparse - len(candidates)]])
    sparse = dense[np.sort(rng.choice(candidates, size=n_sparse, replace=False))]
    return sparse + rng.normal(scale=scene.noise, size=sparse.shape)


def synthetic_pair(
    n_sparse: int, *, seed: int, scene: SyntheticScene = SyntheticScene()
) -> tuple[np.ndarray, np.ndarray]:
    """``(sparse [n_sparse, 3], dense [round(n_sparse * ratio), 3])`` float64, seeded.

    The parts draw from one generator in a fixed order, so a seed gives the same pair every time.
    """
    if isinstance(n_sparse, bool) or not isinstance(n_sparse, (int, np.integer)) or n_sparse < 1:
        raise ConfigError(f"n_sparse must be a positive integer, got {n_sparse!r}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(n_sparse), 0x5A17]))
    n_dense = int(round(n_sparse * scene.ratio))
    side = math.sqrt(n_dense / scene.density)
    height = _terrain(rng, side)
    buildings = _buildings(rng, side, height)
    tx, ty, crown_r, crown_z = _trees(rng, side, scene, buildings, height)
    counts = _component_counts(rng, n_dense, side, buildings, crown_r, height)
    parts = [_ground_points(rng, counts[0], side, buildings, height)]
    if buildings:
        parts += _building_points(rng, buildings, counts[1], counts[2], height)
    else:
        counts[3] += counts[1] + counts[2]
    parts.append(_crown_points(rng, tx, ty, crown_r, crown_z, counts[3]))
    dense = np.concatenate(parts)
    dense = dense[rng.permutation(len(dense))]
    dense += rng.normal(scale=scene.dense_noise, size=dense.shape)
    sparse = _sparse_from_dense(rng, dense, n_sparse, side, scene)
    origin = np.asarray(scene.origin, dtype=np.float64)
    return sparse + origin, dense + origin


def spread_sizes(n_pairs: int, low: int = 1_000, high: int = 50_000, *, seed: int = 0) -> list[int]:
    """``n_pairs`` sizes log-uniform between ``low`` and ``high``, both ends included, seeded."""
    if n_pairs < 1 or low < 1 or high < low:
        raise ConfigError(f"need n_pairs >= 1 and 1 <= low <= high, got {n_pairs}, {low}, {high}")
    if n_pairs == 1:
        return [low]
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x512E]))
    inner = np.exp(rng.uniform(np.log(low), np.log(high), n_pairs - 2))
    return [low, *(int(round(v)) for v in inner), high]


def write_synthetic_pairs(
    root: str | os.PathLike,
    sizes: Sequence[int],
    *,
    seed: int = 0,
    fmt: str = "npy",
    scene: SyntheticScene = SyntheticScene(),
) -> Path:
    """Write one synthetic pair per entry of ``sizes`` (sparse point counts) and a manifest.

    Layout: ``root/sparse/pair_NNN.<fmt>``, ``root/dense/pair_NNN.<fmt>``,
    ``root/pairs.csv``. Returns the manifest's path. Same seed, same files.
    LAS/LAZ store millimetres (scale 0.001), npy and ply float64.
    """
    if fmt not in ("npy", "ply", "las", "laz"):
        raise ConfigError(f"unknown point format {fmt!r}; choose npy, ply, las or laz")
    root = Path(root)
    entries = []
    for i, n in enumerate(sizes):
        sparse, dense = synthetic_pair(
            int(n), seed=np.random.SeedSequence([int(seed), i]).generate_state(1)[0], scene=scene
        )
        geometry = LasGeometry(scales=(0.001,) * 3, offsets=tuple(float(v) for v in np.floor(scene.origin)))
        pair_id = f"pair_{i:03d}"
        paths = []
        for kind, xyz in (("sparse", sparse), ("dense", dense)):
            target = root / kind / f"{pair_id}.{fmt}"
            write_points(target, xyz, dtype=np.float64, las=geometry if fmt in ("las", "laz") else None)
            paths.append(target)
        entries.append(PairEntry(pair_id=pair_id, sparse=paths[0], dense=paths[1]))
    return write_manifest(
        root / "pairs.csv", [PairEntry(e.pair_id, e.sparse.resolve(), e.dense.resolve()) for e in entries]
    )
