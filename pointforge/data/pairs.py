"""Sparse/dense point cloud pairs of any size, for training the upsampler.

A *manifest* lists the pairs, one per row, paths relative to the manifest's
folder (absolute paths also work):

* CSV with a header naming ``sparse`` and ``dense`` columns, optionally ``id``;
* JSON: a list of ``{"sparse": ..., "dense": ..., "id": ...}`` objects, or an
  object with such a list under ``"pairs"``.

Each cloud is ``.npy``, ``.ply``, ``.las`` or ``.laz`` (:mod:`pointforge.data.pointio`).
Without an ``id`` a pair is named after its sparse file's stem.

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

The k-NN graph of each sparse cloud is computed once (``pointforge.nn.knn``,
k nearest, symmetrised) and cached in memory for the life of the dataset
object (per DataLoader worker), and with ``graph_cache="disk"`` also beside
the data as ``<sparse file>.knn<k>.npy``, reused while it is newer than the
cloud it was computed from.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from pointforge.data.pointio import LasGeometry, atomic_write, count_points, point_format, read_points, write_points
from pointforge.errors import ConfigError, DataError
from pointforge.nn.knn import knn_graph

__all__ = [
    "NORMALIZATIONS",
    "GRAPH_CACHES",
    "PairEntry",
    "read_manifest",
    "write_manifest",
    "PairNormalization",
    "pair_normalization",
    "CloudPair",
    "UpsamplingPairs",
    "graph_cache_path",
    "SyntheticScene",
    "synthetic_pair",
    "spread_sizes",
    "write_synthetic_pairs",
]

NORMALIZATIONS = ("spacing", "extent")
GRAPH_CACHES = ("memory", "disk")


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class PairEntry:
    pair_id: str
    sparse: Path
    dense: Path


def _resolve(base: Path, value: str, manifest: Path, row: int, column: str) -> Path:
    value = (value or "").strip()
    if not value:
        raise DataError(f"{manifest}: pair {row} has an empty '{column}' path; fill it in or remove the row")
    path = Path(value)
    return path if path.is_absolute() else base / path


def read_manifest(path: str | os.PathLike) -> list[PairEntry]:
    """The pairs a CSV or JSON manifest lists (module docs), checked to exist and be readable formats."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such manifest; give a CSV or JSON file listing sparse,dense pairs")
    base = path.parent
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read manifest ({err})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not valid JSON ({err}); fix the manifest") from None
        rows = data.get("pairs") if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise DataError(
                f"{path}: JSON manifest must be a list of {{sparse, dense, id}} objects (or hold one under 'pairs')"
            )
    elif path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        fields = [f.strip() for f in (reader.fieldnames or [])]
        if "sparse" not in fields or "dense" not in fields:
            raise DataError(f"{path}: CSV manifest needs a header with 'sparse' and 'dense' columns (found {fields})")
        rows = [{(k or "").strip(): v for k, v in r.items()} for r in reader]
    else:
        raise DataError(f"{path}: manifest must be a .csv or .json file")
    entries: list[PairEntry] = []
    seen: dict[str, int] = {}
    for n, row in enumerate(rows, start=1):
        sparse = _resolve(base, str(row.get("sparse") or ""), path, n, "sparse")
        dense = _resolve(base, str(row.get("dense") or ""), path, n, "dense")
        for p in (sparse, dense):
            point_format(p)
            if not p.is_file():
                raise DataError(f"{path}: pair {n} lists {p}, which does not exist; fix the path or remove the row")
        pair_id = str(row.get("id") or "").strip() or sparse.stem
        if pair_id in seen:
            raise DataError(f"{path}: pairs {seen[pair_id]} and {n} share the id {pair_id!r}; ids must be unique")
        seen[pair_id] = n
        entries.append(PairEntry(pair_id=pair_id, sparse=sparse, dense=dense))
    if not entries:
        raise DataError(f"{path}: manifest lists no pairs")
    return entries


def write_manifest(path: str | os.PathLike, entries: Sequence[PairEntry]) -> Path:
    """A CSV manifest (id,sparse,dense), paths relative to its folder where possible; atomic."""
    path = Path(path)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["id", "sparse", "dense"])
    folder = path.parent.resolve()

    def relative(p: str | Path) -> str:
        return os.path.relpath(Path(p).resolve(), folder) if Path(p).is_absolute() else str(p)

    for e in entries:
        writer.writerow([e.pair_id, relative(e.sparse), relative(e.dense)])
    payload = buffer.getvalue().encode()

    def write(tmp):
        with open(tmp, "wb") as fh:
            fh.write(payload)

    return atomic_write(path, write)


# --------------------------------------------------------------------------- normalisation


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


# --------------------------------------------------------------------------- dataset


@dataclass
class CloudPair:
    """One normalised pair, as a dataset returns it and :func:`collate_pairs` takes it."""

    sparse: Tensor  # float32 [N, 3]
    dense: Tensor  # float32 [M, 3]
    edge_index: Tensor  # int64 [2, E], the sparse cloud's symmetric kNN graph, local indices
    center: np.ndarray  # float64 [3]
    scale: float
    pair_id: str
    index: int

    @property
    def normalization(self) -> PairNormalization:
        return PairNormalization(center=self.center, scale=self.scale)


def graph_cache_path(sparse_path: str | os.PathLike, k: int) -> Path:
    """Where the on-disk graph cache of ``sparse_path`` lives: beside it, keyed by file name and k."""
    p = Path(sparse_path)
    return p.with_name(f"{p.name}.knn{k}.npy")


def _valid_cached_graph(edges: np.ndarray, n: int) -> bool:
    return (
        edges.ndim == 2 and edges.shape[0] == 2 and np.issubdtype(edges.dtype, np.integer)
        and (edges.size == 0 or (int(edges.min()) >= 0 and int(edges.max()) < n))
    )  # fmt: skip


class UpsamplingPairs(Dataset):
    """Pairs from a manifest (or a list of :class:`PairEntry`), normalised, with the sparse kNN graph.

    ``sparse_sizes`` / ``dense_sizes`` hold every pair's point counts, read from
    file headers at construction, for batch planning before any cloud is loaded.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[PairEntry],
        *,
        k: int = 10,
        normalization: str = "spacing",
        graph_cache: str = "memory",
        knn_workers: int = 1,
    ):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be a positive integer, got {k!r}")
        if normalization not in NORMALIZATIONS:
            raise ConfigError(f"unknown normalization {normalization!r}; choose one of {', '.join(NORMALIZATIONS)}")
        if graph_cache not in GRAPH_CACHES:
            raise ConfigError(f"unknown graph_cache {graph_cache!r}; choose one of {', '.join(GRAPH_CACHES)}")
        self.entries = list(source) if isinstance(source, (list, tuple)) else read_manifest(source)  # type: ignore[arg-type]  # otherwise a path
        if not self.entries:
            raise DataError("no pairs given; list at least one sparse/dense pair")
        self.k = k
        self.normalization = normalization
        self.graph_cache = graph_cache
        self.knn_workers = knn_workers
        self.sparse_sizes = np.array([count_points(e.sparse) for e in self.entries], dtype=np.int64)
        self.dense_sizes = np.array([count_points(e.dense) for e in self.entries], dtype=np.int64)
        self._graphs: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def graph(self, index: int, sparse_xyz: Optional[np.ndarray] = None) -> np.ndarray:
        """The sparse cloud's symmetric kNN graph ``[2, E]`` (int32 or int64), computed once."""
        cached = self._graphs.get(index)
        if cached is not None:
            return cached
        entry = self.entries[index]
        if sparse_xyz is None:
            sparse_xyz = read_points(entry.sparse).xyz
        n = len(sparse_xyz)
        edges = None
        disk = graph_cache_path(entry.sparse, self.k) if self.graph_cache == "disk" else None
        if disk is not None and disk.is_file() and disk.stat().st_mtime_ns >= entry.sparse.stat().st_mtime_ns:
            try:
                loaded = np.load(disk, allow_pickle=False)
                edges = loaded if _valid_cached_graph(loaded, n) else None
            except (OSError, ValueError):
                edges = None  # a damaged cache is recomputed, never trusted
        if edges is None:
            centred = torch.from_numpy(sparse_xyz - sparse_xyz.min(axis=0))
            edges = knn_graph(centred, self.k, workers=self.knn_workers).numpy()
            edges = edges.astype(np.int32) if n < 2**31 else edges
            if disk is not None:
                try:
                    _save_graph(disk, edges)
                except OSError as err:
                    raise DataError(
                        f"cannot write the graph cache {disk} ({err.strerror or err}); "
                        "make the data folder writable or use graph_cache='memory'"
                    ) from None
        self._graphs[index] = edges
        return edges

    def __getitem__(self, index: int) -> CloudPair:
        if not 0 <= index < len(self.entries):
            raise IndexError(f"pair index {index} out of range for {len(self.entries)} pairs")
        entry = self.entries[index]
        sparse = read_points(entry.sparse).xyz
        dense = read_points(entry.dense).xyz
        for cloud, path in ((sparse, entry.sparse), (dense, entry.dense)):
            if len(cloud) == 0:
                raise DataError(f"{path}: point cloud is empty; remove pair {entry.pair_id!r} from the manifest")
        edges = self.graph(index, sparse)
        norm = pair_normalization(sparse, self.normalization, edges)
        return CloudPair(
            sparse=torch.from_numpy(norm.apply(sparse)),
            dense=torch.from_numpy(norm.apply(dense)),
            edge_index=torch.from_numpy(edges.astype(np.int64)),
            center=norm.center,
            scale=norm.scale,
            pair_id=entry.pair_id,
            index=index,
        )


def _save_graph(path: Path, edges: np.ndarray) -> None:
    def write(tmp):
        with open(tmp, "wb") as fh:
            np.save(fh, edges)

    atomic_write(path, write)


# --------------------------------------------------------------------------- synthetic pairs


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
