"""The voxel grid a synthetic skull is drawn on: sizes, spacing, origin, axis convention.

Axis convention (the same as SkullBreak's NRRDs, space ``left-posterior-superior``
with an identity direction matrix): a growing index along

* axis 0 moves towards the patient's **left** (index 0 is the right side),
* axis 1 moves **posterior** (index 0 is the face: the forehead, brow and orbits
  are at the low end of axis 1),
* axis 2 moves **superior** (index 0 is below the skull base; the vertex is at
  the high end).

A SkullBreak-style grid is S³ with isotropic spacing 230/S mm (a 230 mm field
of view). A SkullFix-style grid is S×S×Z with Z ≈ 0.55–0.68·S, in-plane spacing
230/S mm (0.45 mm at S = 512, like SkullFix) and slices 1.25× thicker. Voxel
(0, 0, 0) sits at ``origin = -spacing·(shape-1)/2``, so physical (0, 0, 0) is
the grid's centre.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pointforge.errors import ConfigError

MIN_SIZE, MAX_SIZE = 64, 512

FOV_MM = 230.0
SKULLFIX_SLICE_FACTOR = 1.25
SKULLFIX_DEPTH_RANGE = (0.55, 0.68)


def check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise ConfigError(f"size must be an integer from {MIN_SIZE} to {MAX_SIZE}, got {size!r}")
    if not MIN_SIZE <= int(size) <= MAX_SIZE:
        raise ConfigError(f"size must be from {MIN_SIZE} to {MAX_SIZE} voxels, got {size}")
    return int(size)


def grid_geometry(
    size: int, shape: Sequence[int] | None, spacing: Sequence[float] | None
) -> tuple[tuple[int, int, int], np.ndarray]:
    """The grid's shape (default ``(size,)*3``) and spacing in mm (default: the 230 mm field of view)."""
    dims = tuple(int(s) for s in (shape if shape is not None else (size, size, size)))
    if len(dims) != 3 or min(dims) < 16 or max(dims) > 1024:
        raise ConfigError(f"shape must be 3 sizes from 16 to 1024 voxels, got {dims}")
    if spacing is None:
        inplane = (FOV_MM / dims[0], FOV_MM / dims[1])
        cube = dims[2] == dims[0]
        spacing = (*inplane, FOV_MM / dims[2] if cube else inplane[0] * SKULLFIX_SLICE_FACTOR)
    spacing_mm = np.asarray(spacing, dtype=np.float64)
    if spacing_mm.shape != (3,) or not np.all(np.isfinite(spacing_mm)) or np.any(spacing_mm <= 0):
        raise ConfigError(f"spacing must be 3 positive numbers (mm), got {spacing_mm.tolist()}")
    return (dims[0], dims[1], dims[2]), spacing_mm


def grid_origin(shape: Sequence[int], spacing: np.ndarray) -> np.ndarray:
    return -spacing * (np.asarray(shape, dtype=np.float64) - 1.0) / 2.0


def skullfix_shape(size: int, rng: np.random.Generator) -> tuple[int, int, int]:
    return (size, size, int(round(size * rng.uniform(*SKULLFIX_DEPTH_RANGE))))
