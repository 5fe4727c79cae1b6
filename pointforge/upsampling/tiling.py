"""Upsample a cloud of any size in overlapping tiles, one tile in the network at a time, without seams.

The network sees a point's k-NN graph a few hops deep (``feature_layers``
point-transformer blocks, the node shuffle, the refinement over the parents'
neighbours), so a point's children depend only on the points within that
reach. A large cloud is therefore cut in the XY plane into tiles of at most
``tile_points`` points *including* a margin of neighbours on every side; each
tile is upsampled whole, and only the children of its *core* points (those
whose own cell lies in the tile) are kept. Every input point is the core point
of exactly one tile, so the output has exactly r·N points, no duplicates, and
no seam: a core point near a tile's edge still sees its neighbours across it.

Steps, each a pass over the input in chunks (:mod:`pointforge.data.pointstream`):

1. bounds; then counts on a fine XY grid (at most ``GRID_CELLS`` cells a side);
2. the margin, ``2 × hops × sqrt(k / π) × spacing`` with ``hops =
   feature_layers + 2`` and the spacing from the grid's occupied density (the
   radius that holds k points, twice over for uneven density);
3. tiles by k-d splits of the grid: a block is halved (at the median of its
   points, across its longer side) until it holds at most ``tile_points`` points
   with its margin;
4. every point is written to a temporary file per tile it belongs to (its core
   tile and the margins it falls in), in a folder beside the output;
5. the normalisation scale of the whole cloud, the median nearest-neighbour
   distance (what an untiled run uses), from each tile's core points;
6. tile by tile: the network, the core points' children appended to the output.

Memory: one tile through the network, the grid, a chunk, and 4 bytes per input
point for step 5's distances. Nothing of a tile outlives it but the children
yielded, and after each tile the C heap's free memory is handed back to the
system (:func:`pointforge.devices.release_freed_memory`), so that one tile's
freed arrays do not stay resident through the next. Disk: about 33 bytes per
point and margin copy.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
from scipy.spatial import cKDTree

from pointforge.data.pairs.normalization import PairNormalization
from pointforge.data.pointstream import CloudSource
from pointforge.devices import release_freed_memory
from pointforge.errors import ConfigError, DataError
from pointforge.formats import format_bytes

__all__ = [
    "TILE_POINTS",
    "GRID_CELLS",
    "network_bytes_per_point",
    "choose_tile_points",
    "Tile",
    "TilePlan",
    "plan_tiles",
    "TiledCloud",
    "tile_cloud",
    "iter_tiles",
    "work_folder",
]

TILE_POINTS = 100_000
MIN_TILE_POINTS = 2_000
GRID_CELLS = 1024
_RECORD = np.dtype([("xyz", "<f8", (3,)), ("index", "<i8"), ("core", "?")])
_FIXED_BYTES = 600 * 2**20  # interpreter, torch, the grid and a chunk (measured: ~400 MB after the imports)


def network_bytes_per_point(hidden: int, ratio: int) -> float:
    """Peak bytes per input point of one forward pass, no gradients, with a 25 % margin.

    Measured at ratio 2 on the CPU (peak RSS growth over 20k-60k points): 15.9 kB
    (hidden 16), 31 kB (32), 110 kB (128), which ``2 kB + 0.85 kB × hidden`` fits;
    the child stages' share is assumed to grow in proportion to the ratio.
    """
    return 1.25 * (2048 + 870 * hidden * max(ratio, 2) / 2)


def choose_tile_points(hidden: int, ratio: int, requested: Optional[int], available: int) -> int:
    """``requested`` if a tile that large fits in ``available`` bytes, else ConfigError saying what fits.

    ``None``: :data:`TILE_POINTS`, or fewer when memory is short.
    """
    per_point = network_bytes_per_point(hidden, ratio)
    fits = int((available - _FIXED_BYTES) / per_point)
    if requested is None:
        if fits >= MIN_TILE_POINTS:
            return min(TILE_POINTS, fits)
        requested = MIN_TILE_POINTS
    if requested < 1:
        raise ConfigError(f"--tile-points must be at least 1, got {requested}")
    if requested > fits:
        need = requested * per_point + _FIXED_BYTES
        hint = f"use --tile-points {fits} or less" if fits >= MIN_TILE_POINTS else "free memory or use a smaller model"
        raise ConfigError(
            f"upsampling tiles of {requested} points needs about {format_bytes(need)} of memory, but only "
            f"{format_bytes(available)} is available; {hint}"
        )
    return requested


@dataclass(frozen=True)
class Tile:
    """Grid cells ``[i0, i1) × [j0, j1)`` of the core, the same widened by the margin, and point counts."""

    core: tuple[int, int, int, int]
    halo: tuple[int, int, int, int]
    points: int  # core points
    halo_points: int  # core and margin points


@dataclass
class TilePlan:
    origin: np.ndarray  # float64 [2]: the grid's lower XY corner
    cell: float  # cell side, source units
    shape: tuple[int, int]
    margin: float  # source units
    margin_cells: int
    tiles: list[Tile]

    def cells(self, xy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        index = np.floor((xy - self.origin) / self.cell).astype(np.int64)
        return np.clip(index[:, 0], 0, self.shape[0] - 1), np.clip(index[:, 1], 0, self.shape[1] - 1)


def _grid(source: CloudSource, chunk: int) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """(origin, cell, counts [gx, gy], xyz bounds [2, 3]) from two passes over the input."""
    lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
    for xyz in source.chunks(chunk):
        lo, hi = np.minimum(lo, xyz.min(axis=0)), np.maximum(hi, xyz.max(axis=0))
    extent = float((hi[:2] - lo[:2]).max())
    cell = extent / (GRID_CELLS - 1) if extent > 0 else 1.0
    shape = tuple(int(v) for v in np.floor((hi[:2] - lo[:2]) / cell).astype(int) + 1)
    counts = np.zeros(shape[0] * shape[1], dtype=np.int64)
    for xyz in source.chunks(chunk):
        index = np.floor((xyz[:, :2] - lo[:2]) / cell).astype(np.int64)
        ix, iy = np.clip(index[:, 0], 0, shape[0] - 1), np.clip(index[:, 1], 0, shape[1] - 1)
        counts += np.bincount(ix * shape[1] + iy, minlength=counts.size)
    return lo[:2], cell, counts.reshape(shape), np.stack([lo, hi])


def _margin(counts: np.ndarray, cell: float, k: int, hops: int) -> float:
    """The network's reach (module docs, step 2), from the density of occupied blocks of cells."""
    total, pooled, side = int(counts.sum()), counts, cell
    while total / max(int((pooled > 0).sum()), 1) < 16 and min(pooled.shape) > 1:
        # Cells finer than the point spacing would count every point's own cell as the covered area.
        gx, gy = (pooled.shape[0] + 1) // 2 * 2, (pooled.shape[1] + 1) // 2 * 2
        padded = np.zeros((gx, gy), dtype=np.int64)
        padded[: pooled.shape[0], : pooled.shape[1]] = pooled
        pooled, side = padded.reshape(gx // 2, 2, gy // 2, 2).sum(axis=(1, 3)), side * 2
    density = total / (max(int((pooled > 0).sum()), 1) * side * side)
    return 2 * hops * math.sqrt(k / math.pi) / math.sqrt(density)


def plan_tiles(counts: np.ndarray, tile_points: int, margin_cells: int) -> list[Tile]:
    """k-d split of the grid into tiles of at most ``tile_points`` points with their margin (module docs)."""
    table = np.zeros((counts.shape[0] + 1, counts.shape[1] + 1), dtype=np.int64)
    table[1:, 1:] = counts.cumsum(axis=0).cumsum(axis=1)
    gx, gy = counts.shape

    def total(i0, i1, j0, j1) -> int:
        return int(table[i1, j1] - table[i0, j1] - table[i1, j0] + table[i0, j0])

    def widen(i0, i1, j0, j1) -> tuple[int, int, int, int]:
        m = margin_cells
        return max(i0 - m, 0), min(i1 + m, gx), max(j0 - m, 0), min(j1 + m, gy)

    tiles, stack = [], [(0, gx, 0, gy)]
    while stack:
        block = stack.pop()
        inside, halo = total(*block), widen(*block)
        if inside == 0:
            continue
        if total(*halo) <= tile_points:
            tiles.append(Tile(core=block, halo=halo, points=inside, halo_points=total(*halo)))
            continue
        halves = _split(block, counts, inside)
        if halves is None:
            raise ConfigError(
                f"{total(*halo)} points lie within one grid cell and its margin, more than a tile of {tile_points} "
                "points can hold; raise --tile-points"
            )
        stack.extend(halves)
    return tiles


def _split(block, counts: np.ndarray, inside: int):
    """Two halves of ``block`` at the median of its points, across its longer side first; None if it is one cell."""
    i0, i1, j0, j1 = block
    for axis in sorted((0, 1), key=lambda a: -(i1 - i0 if a == 0 else j1 - j0)):
        lo, hi = (i0, i1) if axis == 0 else (j0, j1)
        if hi - lo < 2:
            continue
        profile = counts[i0:i1, j0:j1].sum(axis=1 - axis).cumsum()
        cut = lo + int(np.clip(np.searchsorted(profile, inside / 2) + 1, 1, hi - lo - 1))
        return ((i0, cut, j0, j1), (cut, i1, j0, j1)) if axis == 0 else ((i0, i1, j0, cut), (i0, i1, cut, j1))
    return None


def _neighbours(tiles: list[Tile]) -> list[np.ndarray]:
    """Per tile, the tiles whose widened block overlaps its core (itself included)."""
    halos = np.array([t.halo for t in tiles]).reshape(-1, 4)
    return [
        np.flatnonzero((halos[:, 0] < i1) & (halos[:, 1] > i0) & (halos[:, 2] < j1) & (halos[:, 3] > j0))
        for i0, i1, j0, j1 in (t.core for t in tiles)
    ]


def _spill(source: CloudSource, plan: TilePlan, folder: Path, chunk: int) -> None:
    """Every point into the file of its core tile and of each tile whose margin it lies in (step 4)."""
    owner = np.full(plan.shape, -1, dtype=np.int64)
    for t, tile in enumerate(plan.tiles):
        i0, i1, j0, j1 = tile.core
        owner[i0:i1, j0:j1] = t
    neighbours, start = _neighbours(plan.tiles), 0
    for xyz in source.chunks(chunk):
        ix, iy = plan.cells(xyz[:, :2])
        core = owner[ix, iy]
        records = np.empty(len(xyz), dtype=_RECORD)
        records["xyz"], records["index"] = xyz, np.arange(start, start + len(xyz))
        start += len(xyz)
        order = np.argsort(core, kind="stable")
        tiles, first = np.unique(core[order], return_index=True)
        out: dict[int, list[np.ndarray]] = {}
        for t, members in zip(tiles.tolist(), np.split(order, first[1:])):
            for u in neighbours[t].tolist():
                i0, i1, j0, j1 = plan.tiles[u].halo
                inside = members[(ix[members] >= i0) & (ix[members] < i1) & (iy[members] >= j0) & (iy[members] < j1)]
                part = records[inside]
                part["core"] = u == t
                out.setdefault(u, []).append(part)
        for u, parts in out.items():
            with open(folder / f"tile_{u:06d}.bin", "ab") as fh:
                np.concatenate(parts).tofile(fh)


def _tile_records(folder: Path, t: int) -> np.ndarray:
    path = folder / f"tile_{t:06d}.bin"
    return np.fromfile(path, dtype=_RECORD) if path.exists() else np.empty(0, dtype=_RECORD)


def _scale(plan: TilePlan, folder: Path, bounds: np.ndarray, normalization: str) -> float:
    """The whole cloud's normalisation scale, as :func:`pointforge.data.pairs.normalization.pair_normalization` computes it."""
    scale = 0.0
    if normalization == "spacing":
        nearest = []
        for t in range(len(plan.tiles)):
            records = _tile_records(folder, t)
            if records["core"].sum() == 0 or len(records) < 2:
                continue
            centre = records["xyz"].mean(axis=0)
            tree = cKDTree(records["xyz"] - centre)
            nearest.append(tree.query(records["xyz"][records["core"]] - centre, k=2)[0][:, 1].astype(np.float32))
        spacing = np.concatenate(nearest) if nearest else np.zeros(0, np.float32)
        spacing = spacing[np.isfinite(spacing)].astype(np.float64)
        if len(spacing):
            scale = float(np.median(spacing))
            if scale <= 0 and (spacing > 0).any():
                scale = float(spacing[spacing > 0].mean())
    if scale <= 0:
        scale = float((bounds[1] - bounds[0]).max()) / 2
    return scale if scale > 0 and math.isfinite(scale) else 1.0


@dataclass
class TiledCloud:
    """A cloud cut into tiles on disk (:func:`tile_cloud`); iterate with :func:`iter_tiles`."""

    plan: TilePlan
    folder: Path
    scale: float
    bounds: np.ndarray  # float64 [2, 3]


def tile_cloud(
    source: CloudSource,
    folder: str | os.PathLike,
    *,
    tile_points: int,
    k: int,
    hops: int,
    normalization: str = "spacing",
    margin: Optional[float] = None,
    chunk: int = 1 << 20,
) -> TiledCloud:
    """Steps 1-5 of the module docs; the tile files go into ``folder`` (which must exist and be empty).

    ``margin`` (source units) replaces the computed reach (tests use 0 to show the seams it prevents).
    """
    origin, cell, counts, bounds = _grid(source, chunk)
    reach = _margin(counts, cell, k, hops) if margin is None else float(margin)
    margin_cells = math.ceil(reach / cell)
    plan = TilePlan(origin, cell, counts.shape, reach, margin_cells, plan_tiles(counts, tile_points, margin_cells))
    folder = Path(folder)
    need = _RECORD.itemsize * sum(t.halo_points for t in plan.tiles)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise DataError(
            f"cutting {source.path} into {len(plan.tiles)} tiles needs about {format_bytes(need)} of disk in "
            f"{folder}, which has {format_bytes(free)} free; free some space there"
        )
    _spill(source, plan, folder, chunk)
    return TiledCloud(plan, folder, _scale(plan, folder, bounds, normalization), bounds)


def iter_tiles(
    tiled: TiledCloud, upsample: Callable[[np.ndarray, PairNormalization], np.ndarray], ratio: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Step 6: per tile, ``(source indices of its core points [n], their children [n·ratio, 3])``.

    ``upsample(xyz, normalization)`` runs the network on a tile's points (core and margin).
    """
    for t in range(len(tiled.plan.tiles)):
        records = _tile_records(tiled.folder, t)
        core = records["core"]
        if not core.any():
            continue
        xyz = records["xyz"]
        centre = (xyz.min(axis=0) + xyz.max(axis=0)) / 2
        children = upsample(xyz, PairNormalization(center=centre, scale=tiled.scale)).reshape(len(xyz), ratio, 3)
        index, kept = records["index"][core], children[core].reshape(-1, 3)
        del records, core, xyz, children  # nothing of this tile but what is yielded outlives it
        release_freed_memory()  # and what it freed goes back to the system (module docs, memory)
        yield index, kept
        (tiled.folder / f"tile_{t:06d}.bin").unlink()


def work_folder(near: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder for tile files beside ``near`` (the output), not in /tmp, which may be memory."""
    return tempfile.TemporaryDirectory(prefix=".pointforge-tiles-", dir=near.parent)
