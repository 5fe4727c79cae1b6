"""A scan cut into square tiles, split by area into train / validation / test, written as pairs.

Split by area, never by random tile: neighbouring tiles share buildings,
tree rows and flight lines, so a random split would test on the training
area's twins. Along the scan's longer XY side the scan is cut into columns
one tile wide: the first columns are the training area, then (after a gap)
the validation area, then (after another gap) the test area; ``gap`` metres
between areas are dropped, so no structure is cut in two across areas.
Within each area, columns are cut into square tiles; a tile with fewer than
``min_points`` dense points (an edge, a hole) is skipped.

Layout under ``out``::

    dense/<scan>_<split>_<i>.laz          every point of the tile (all LAS fields kept)
    <protocol>/sparse/<scan>_<split>_<i>.laz
    <protocol>/{train,val,test}.csv       manifests (id,sparse,dense), every scan's tiles
    tiles.json                            each tile's scan, split, box and point counts

The sparse clouds come from the dense tile by each thinning protocol
(:mod:`pointforge.data.lidar.thinning`), or, for a pair of surveys of the same
area (``sparse_surveys``), are the sparse survey's points in the same box
(protocol ``survey``). Files are written atomically; same inputs and seed,
same files.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from pointforge.atomic import atomic_path
from pointforge.data.lidar.thinning import PROTOCOLS, thin
from pointforge.data.pairs.manifest import PairEntry, write_manifest
from pointforge.errors import ConfigError, DataError

__all__ = ["SPLITS", "AreaSplit", "TileBox", "plan_tiles", "build_pairs"]

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class AreaSplit:
    tile: float = 30.0  # tile side, source units (metres)
    gap: float = 5.0  # dropped between areas
    val: float = 0.15  # share of the columns for validation ...
    test: float = 0.25  # ... and for testing; the rest trains
    min_points: int = 200  # dense points a tile needs to be kept

    def __post_init__(self):
        if not (self.tile > 0 and self.gap >= 0 and 0 < self.val and 0 < self.test and self.val + self.test < 1):
            raise ConfigError(
                f"area split needs tile > 0, gap >= 0 and val, test > 0 with val + test < 1, got {asdict(self)}"
            )


@dataclass(frozen=True)
class TileBox:
    split: str
    index: int
    box: tuple[float, float, float, float]  # x0, y0, x1, y1

    def holds(self, xy: np.ndarray) -> np.ndarray:
        x0, y0, x1, y1 = self.box
        return (xy[:, 0] >= x0) & (xy[:, 0] < x1) & (xy[:, 1] >= y0) & (xy[:, 1] < y1)


def plan_tiles(lo: np.ndarray, hi: np.ndarray, split: AreaSplit) -> list[TileBox]:
    """The tiles of every area over the XY bounds ``lo``..``hi`` (module docs)."""
    axis = 0 if hi[0] - lo[0] >= hi[1] - lo[1] else 1
    length, width = float(hi[axis] - lo[axis]), float(hi[1 - axis] - lo[1 - axis])
    columns = math.floor((length - 2 * split.gap) / split.tile)
    rows = max(math.floor(width / split.tile), 1)
    if columns < 3:
        raise DataError(
            f"a scan {length:.0f} × {width:.0f} m is too small for three areas of {split.tile:g} m tiles with "
            f"{split.gap:g} m gaps; lower --tile or --gap"
        )
    n_test = max(1, round(split.test * columns))
    n_val = max(1, round(split.val * columns))
    counts = {"train": columns - n_val - n_test, "val": n_val, "test": n_test}
    if counts["train"] < 1:
        raise DataError(f"{columns} columns of tiles leave none for training; lower --tile")
    tiles, start = [], float(lo[axis])
    for name in SPLITS:
        index = 0
        for c in range(counts[name]):
            a0 = start + c * split.tile
            for r in range(rows):
                b0 = float(lo[1 - axis]) + r * split.tile
                x0, y0 = (a0, b0) if axis == 0 else (b0, a0)
                tiles.append(TileBox(name, index, (x0, y0, x0 + split.tile, y0 + split.tile)))
                index += 1
        start += counts[name] * split.tile + split.gap
    return tiles


def _read(path: Path) -> Any:
    import laspy

    try:
        return laspy.read(path)
    except (OSError, laspy.errors.LaspyException, ValueError) as err:
        raise DataError(f"{path}: cannot read it as LAS/LAZ ({err})") from None


def _write_subset(las: Any, keep: np.ndarray, path: Path) -> Path:
    """The points ``keep`` of ``las`` (every field, scales, offsets, CRS records) as a LAS/LAZ file."""
    import laspy

    out = laspy.LasData(laspy.LasHeader(point_format=las.header.point_format, version=las.header.version))
    out.header.scales, out.header.offsets = las.header.scales, las.header.offsets
    out.header.vlrs.extend(las.header.vlrs)
    out.points = las.points[keep].copy()
    with atomic_path(path, suffix=path.suffix) as tmp:
        out.write(str(tmp))
    return path


def _xyz(las: Any) -> np.ndarray:
    return np.column_stack([np.asarray(las.x), np.asarray(las.y), np.asarray(las.z)])


def _scan_tiles(
    name: str,
    dense_path: Path,
    out: Path,
    protocols: Sequence[str],
    ratio: float,
    split: AreaSplit,
    seed: int,
    sparse_path: Optional[Path],
) -> list[dict]:
    dense = _read(dense_path)
    xyz = _xyz(dense)
    sparse = _read(sparse_path) if sparse_path is not None else None
    sparse_xy = _xyz(sparse)[:, :2] if sparse is not None else None
    rows = []
    for tile in plan_tiles(xyz[:, :2].min(axis=0), xyz[:, :2].max(axis=0), split):
        inside = np.flatnonzero(tile.holds(xyz[:, :2]))
        if len(inside) < split.min_points:
            continue
        stem = f"{name}_{tile.split}_{tile.index:03d}"
        row = {"id": stem, "scan": name, "split": tile.split, "box": tile.box, "dense_points": len(inside)}
        row["dense"] = str(_write_subset(dense, inside, out / "dense" / f"{stem}.laz").relative_to(out))
        tile_seed = zlib.crc32(f"{seed}/{stem}".encode())
        for protocol in protocols:
            if protocol == "survey":
                assert sparse is not None and sparse_xy is not None
                kept_las, kept = sparse, np.flatnonzero(tile.holds(sparse_xy))
            else:
                kept_las, kept = dense, inside[thin(protocol, xyz[inside], ratio, seed=tile_seed)]
            if len(kept) < 16:
                continue
            path = _write_subset(kept_las, kept, out / protocol / "sparse" / f"{stem}.laz")
            row[protocol] = {"sparse": str(path.relative_to(out)), "sparse_points": len(kept)}
        rows.append(row)
    return rows


def build_pairs(
    out: str | os.PathLike,
    scans: dict[str, Path],
    *,
    protocols: Sequence[str] = PROTOCOLS,
    ratio: float = 2.0,
    split: AreaSplit = AreaSplit(),
    seed: int = 0,
    sparse_surveys: Optional[dict[str, Path]] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> dict:
    """Tiles and pairs of every scan (``{name: dense LAS/LAZ}``) under ``out`` (module docs); the summary.

    ``sparse_surveys`` (``{name: sparse LAS/LAZ}`` for some of ``scans``):
    real sparse surveys of the same areas, written under protocol ``survey``.
    """
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise ConfigError(f"unknown thinning protocol(s) {unknown or '(none)'}; choose from {', '.join(PROTOCOLS)}")
    surveys = sparse_surveys or {}
    if set(surveys) - set(scans):
        raise ConfigError("a sparse survey needs the dense scan of the same area")
    out = Path(out).absolute()  # the manifests hold paths relative to their own folder, found from here
    tiles: list[dict] = []
    for done, (name, path) in enumerate(scans.items(), start=1):
        wanted = [*protocols, *(["survey"] if name in surveys else [])]
        tiles += _scan_tiles(name, Path(path), out, wanted, ratio, split, seed, surveys.get(name))
        if progress is not None:
            progress(done, len(scans), name)
    manifests = {}
    for protocol in [*protocols, *(["survey"] if surveys else [])]:
        for part in SPLITS:
            entries = [
                PairEntry(t["id"], out / t[protocol]["sparse"], out / t["dense"])
                for t in tiles
                if t["split"] == part and protocol in t
            ]
            if entries:
                manifests[f"{protocol}/{part}"] = str(write_manifest(out / protocol / f"{part}.csv", entries))
    summary = {"split": asdict(split), "ratio": ratio, "seed": seed, "scans": {k: str(v) for k, v in scans.items()}}
    summary |= {"tiles": tiles, "manifests": manifests}
    with atomic_path(out / "tiles.json", suffix=".json") as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
