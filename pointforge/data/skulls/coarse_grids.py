"""Skull volumes on a coarse cube of fixed size in millimetres, and back: the volumetric U-Net's grids.

A :class:`CubeFrame` is a cube of ``size``³ cells, axis-aligned in physical
space (patient LPS millimetres: a NIfTI's RAS affine, or an NRRD in a
right-anterior space, is turned to LPS first, so axis 0 always runs from the
patient's right to left and a mirror along it is a left-right mirror). Its
side is the defective skull's largest physical extent plus ``margin_mm`` on
each side, centred on the bone's box (:func:`frame_around`): millimetres, not
voxels, so a scan of any spacing, field of view, origin or orientation gives
the same cube for the same skull.

A volume goes onto the cube as the *fraction of bone around each cell's
centre* (:func:`occupancy`: every foreground voxel's volume shared among the
eight cells around it with trilinear weights, after splitting voxels coarser
than half a cell: average pooling in physical space, with a tent for a box). A cube field comes back onto any
volume's own grid by trilinear interpolation at each voxel's physical
position (:func:`field_on_volume`), anisotropic and oblique grids included,
and only over the box the caller asks for, so a 512³ volume costs what its
implant costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pointforge.data.surface import bounding_box
from pointforge.data.volumes import Volume
from pointforge.errors import DataError

__all__ = ["CubeFrame", "lps_affine", "frame_around", "occupancy", "field_on_volume", "box_around"]

_RAS_SPACES = ("right-anterior-superior", "ras")


@dataclass(frozen=True)
class CubeFrame:
    """``size``³ cells of ``side_mm / size`` mm, centred on ``centre`` (LPS mm), axis-aligned."""

    centre: tuple[float, float, float]
    side_mm: float
    size: int

    @property
    def cell_mm(self) -> float:
        return self.side_mm / self.size

    def index_of(self, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(M, t)`` with cube index ``u = M @ ijk + t`` for voxel index ``ijk`` of a volume with LPS ``affine``.

        Cube index ``k`` is the centre of cell ``k`` (cell 0 starts at ``centre - side/2``).
        """
        low = np.asarray(self.centre, dtype=np.float64) - self.side_mm / 2
        h = self.cell_mm
        return affine[:3, :3] / h, (affine[:3, 3] - low) / h - 0.5

    def as_dict(self) -> dict:
        return {"centre": [float(c) for c in self.centre], "side_mm": float(self.side_mm), "size": int(self.size)}


def lps_affine(volume: Volume) -> np.ndarray:
    """``volume``'s voxel → physical 4×4 affine, in LPS millimetres whatever space its header uses."""
    affine = volume.affine()
    header = volume.header or {}
    space = str((header.get("nrrd") or {}).get("space", "")).lower()
    if header.get("format") == "nifti" or space in _RAS_SPACES:
        affine = np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine
    return affine


def frame_around(volume: Volume, size: int, margin_mm: float) -> CubeFrame:
    """The cube around ``volume``'s foreground: its largest LPS extent plus ``margin_mm`` per side, ``size``³ cells."""
    if size < 2:
        raise DataError(f"the cube needs at least 2 cells per side, got {size}")
    box = bounding_box(np.asarray(volume.data, dtype=bool))
    if box is None:
        raise DataError("the volume has no foreground voxel to place the cube around")
    # The box's corners are voxel centres; the bone reaches half a voxel beyond them.
    lo = np.array([b.start for b in box], dtype=np.float64) - 0.5
    hi = np.array([b.stop - 1 for b in box], dtype=np.float64) + 0.5
    corners = np.array([[(lo, hi)[(k >> a) & 1][a] for a in range(3)] for k in range(8)])
    affine = lps_affine(volume)
    world = corners @ affine[:3, :3].T + affine[:3, 3]
    low, high = world.min(axis=0), world.max(axis=0)
    side = float((high - low).max() + 2 * margin_mm)
    centre = (low + high) / 2
    return CubeFrame((float(centre[0]), float(centre[1]), float(centre[2])), side, int(size))


def occupancy(volume: Volume, frame: CubeFrame) -> np.ndarray:
    """The fraction of bone around each cube cell's centre: float32 ``[size]*3`` in [0, 1].

    Each foreground voxel's volume is shared among the eight cells around its
    centre with trilinear weights (cloud-in-cell), so the total bone volume
    is kept exactly (foreground outside the cube is dropped) and a grid whose
    voxels do not divide the cells evenly leaves no moiré, as counting each
    voxel into one cell would (a 2.5 mm cell holds 8 to 27 centres of 1 mm
    voxels). Voxels much smaller than a cell are first gathered in blocks of
    at most half a cell, each placed at its bone's centroid with its bone's
    volume (a 512 × 512 × Z scan has millions of bone voxels, a few hundred
    thousand blocks); a voxel larger than half a cell along an axis is split
    into equal sub-voxels along it, so a coarse scan leaves no stripes.
    """
    mask = np.asarray(volume.data, dtype=bool)
    n = frame.size
    box = bounding_box(mask)
    if box is None:
        return np.zeros((n,) * 3, dtype=np.float32)
    matrix, offset = frame.index_of(lps_affine(volume))
    spacing = np.asarray(volume.spacing, dtype=np.float64)
    half_cell = frame.cell_mm / 2
    block = np.maximum(1, np.floor(half_cell / spacing)).astype(int)
    splits = np.maximum(1, np.ceil(spacing / half_cell)).astype(int)
    ijk, counts = _block_centroids(mask[box], block)
    ijk += np.array([b.start for b in box], dtype=np.float64)
    centres = [(np.arange(s) + 0.5) / s - 0.5 for s in splits]  # sub-voxel centres, in voxels
    subs = np.stack(np.meshgrid(*centres, indexing="ij"), axis=-1).reshape(-1, 3)
    share = float(np.prod(spacing)) / len(subs) / frame.cell_mm**3  # one voxel's volume (split), in cells
    padded = np.zeros((n + 2) ** 3, dtype=np.float64)  # one cell more each side: no bounds checks per corner
    for sub in subs:
        u = (ijk + sub) @ matrix.T + offset
        inside = np.all((u > -1) & (u < n), axis=1)
        u, weight = u[inside], counts[inside] * share
        base = np.floor(u).astype(np.int64)
        frac = u - base
        base += 1
        for corner in range(8):
            step = [(corner >> a) & 1 for a in range(3)]
            w = weight.copy()
            for a in range(3):
                w *= frac[:, a] if step[a] else 1.0 - frac[:, a]
            index = ((base[:, 0] + step[0]) * (n + 2) + base[:, 1] + step[1]) * (n + 2) + base[:, 2] + step[2]
            padded += np.bincount(index, weights=w, minlength=(n + 2) ** 3)
    cube = padded.reshape((n + 2,) * 3)[1:-1, 1:-1, 1:-1]
    return np.clip(cube, 0.0, 1.0).astype(np.float32)


def _block_centroids(mask: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The foreground of ``mask`` gathered in blocks of ``block`` voxels: each non-empty block's centroid
    (voxel index, float64 ``[K, 3]``) and its voxel count (float64 ``[K]``)."""
    b0, b1, b2 = (int(b) for b in block)
    if b0 == b1 == b2 == 1:
        points = np.argwhere(mask).astype(np.float64)
        return points, np.ones(len(points))
    shape = [-(-s // b) * b for s, b in zip(mask.shape, block)]
    full = np.zeros(shape, dtype=np.uint8)
    full[: mask.shape[0], : mask.shape[1], : mask.shape[2]] = mask
    m = full.reshape(shape[0] // b0, b0, shape[1] // b1, b1, shape[2] // b2, b2)
    along = [m.sum(axis=(3, 5), dtype=np.int32), m.sum(axis=(1, 5), dtype=np.int32), m.sum(axis=(1, 3), dtype=np.int32)]
    counts = along[0].sum(axis=1)
    where = np.nonzero(counts)
    found = counts[where].astype(np.float64)
    moments = [
        (along[0] * np.arange(b0)[None, :, None, None]).sum(axis=1),
        (along[1] * np.arange(b1)[None, None, :, None]).sum(axis=2),
        (along[2] * np.arange(b2)[None, None, None, :]).sum(axis=3),
    ]
    points = np.stack([where[a] * block[a] + moments[a][where] / found for a in range(3)], axis=1)
    return points.astype(np.float64), found


def box_around(field: np.ndarray, frame: CubeFrame, volume: Volume, level: float) -> tuple[slice, ...] | None:
    """The box of ``volume``'s grid holding every voxel where the trilinear ``field`` can reach ``level``.

    Trilinear interpolation never exceeds its eight nodes, so such a voxel lies
    in a cell next to a node at ``level`` or more: the box of those nodes grown
    by one, mapped to the volume's indices (None: no node reaches it).
    """
    nodes = bounding_box(np.asarray(field) >= level, 1)
    if nodes is None:
        return None
    matrix, offset = frame.index_of(lps_affine(volume))
    inverse = np.linalg.inv(matrix)
    corners = np.array(
        [[(s.start, s.stop - 1)[(k >> a) & 1] for a, s in enumerate(nodes)] for k in range(8)], dtype=np.float64
    )
    ijk = (corners - offset) @ inverse.T
    lo = np.maximum(np.floor(ijk.min(axis=0)).astype(int) - 1, 0)
    hi = np.minimum(np.ceil(ijk.max(axis=0)).astype(int) + 2, np.asarray(volume.shape))
    if np.any(hi <= lo):
        return None
    return tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))


def field_on_volume(field: np.ndarray, frame: CubeFrame, volume: Volume, box: tuple[slice, ...]) -> np.ndarray:
    """``field`` (on ``frame``'s cube) read at the physical position of each voxel of ``volume[box]``: float32.

    Trilinear; zero outside the cube.
    """
    from scipy.ndimage import affine_transform

    matrix, offset = frame.index_of(lps_affine(volume))
    start = np.array([s.start for s in box], dtype=np.float64)
    shape = tuple(s.stop - s.start for s in box)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=np.float32)
    return affine_transform(
        np.asarray(field, dtype=np.float32),
        matrix,
        offset=matrix @ start + offset,
        output_shape=shape,
        order=1,
        mode="constant",
        cval=0.0,
    )
