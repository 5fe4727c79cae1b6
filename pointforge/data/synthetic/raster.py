"""Turning a skull family's bone shell into a voxel volume: block-sparse, one piece, well composed.

A family describes its bone as a :class:`Shell` in the grid's physical
coordinates; :func:`rasterize` evaluates it only in the 8³ blocks that can
touch the shell (a seventh of the grid at 512³) and :func:`rasterize_dense`,
every voxel, is the reference the tests hold it to. Both end in
:func:`finish_bone`, which makes the volume one well-composed piece.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
from scipy import ndimage

from pointforge.data.surface import make_well_composed
from pointforge.data.synthetic.grid import check_size, grid_geometry, grid_origin
from pointforge.data.volumes import as_triple

BLOCK = 8
_CHUNK_POINTS = 1 << 21


class Shell(Protocol):
    """Bone between an inner and an outer radius about a centre; points are (3, N) float32 grid mm."""

    def radii(self, grid_mm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distance from the centre, outer radius, inner radius) along each point's direction."""
        ...

    def bone(self, grid_mm: np.ndarray) -> np.ndarray:
        """Whether each point is bone (inside the shell and not cut away)."""
        ...


def rasterize(shell: Shell, shape: Sequence[int], spacing: np.ndarray, *, block: int = BLOCK) -> np.ndarray:
    """Evaluate the bone only in blocks that can touch the shell; equal to :func:`rasterize_dense`."""
    origin = grid_origin(shape, spacing)
    nblocks = [-(-s // block) for s in shape]
    padded = np.zeros([n * block for n in nblocks], dtype=bool)
    bi = np.stack(np.meshgrid(*[np.arange(n) for n in nblocks], indexing="ij"), axis=-1).reshape(-1, 3)
    centres = (origin + (bi * block + (block - 1) / 2.0) * spacing).T.astype(np.float32)
    r, outer, inner = shell.radii(centres)
    half_diag = 0.5 * block * float(np.linalg.norm(spacing))
    # Radial distance overstates the true distance where the surface is oblique;
    # a factor 2 covers obliquity up to 60°, beyond anything the shapes reach.
    reach = 2.0 * half_diag + float(spacing.max())
    near = (r <= outer + reach) & (r >= inner - reach)
    chosen = bi[near]
    offsets = np.stack(np.meshgrid(*[np.arange(block)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    view = padded.reshape(nblocks[0], block, nblocks[1], block, nblocks[2], block).transpose(0, 2, 4, 1, 3, 5)
    per_chunk = max(1, _CHUNK_POINTS // len(offsets))
    for start in range(0, len(chosen), per_chunk):
        blocks = chosen[start : start + per_chunk]
        grid_mm = np.stack(
            [
                (origin[a] + (blocks[:, a, None] * block + offsets[None, :, a]) * spacing[a]).astype(np.float32).ravel()
                for a in range(3)
            ]
        )
        bone = shell.bone(grid_mm).reshape(len(blocks), block, block, block)
        view[blocks[:, 0], blocks[:, 1], blocks[:, 2]] = bone
    return finish_bone(np.ascontiguousarray(padded[: shape[0], : shape[1], : shape[2]]))


def skull_on_grid(
    draw: Callable[[np.random.Generator, np.ndarray, np.ndarray], Shell],
    size: int,
    rng: np.random.Generator,
    shape: tuple[int, int, int] | None,
    spacing: tuple[float, float, float] | None,
) -> tuple[np.ndarray, tuple[float, float, float]]:
    """One family's skull on its grid: ``draw(rng, spacing, extent)`` gives the shell, rasterised here."""
    size = check_size(size)
    grid_shape, grid_spacing = grid_geometry(size, shape, spacing)
    extent = grid_spacing * np.asarray(grid_shape)
    return rasterize(draw(rng, grid_spacing, extent), grid_shape, grid_spacing), as_triple(grid_spacing)


def rasterize_dense(shell: Shell, shape: Sequence[int], spacing: np.ndarray) -> np.ndarray:
    """Reference for :func:`rasterize` (every voxel evaluated); tests compare the two."""
    origin = grid_origin(shape, spacing)
    axes = np.meshgrid(*[origin[a] + np.arange(shape[a]) * spacing[a] for a in range(3)], indexing="ij")
    grid_mm = np.stack([g.ravel() for g in axes]).astype(np.float32)
    return finish_bone(shell.bone(grid_mm).reshape(tuple(shape)))


def finish_bone(skull: np.ndarray) -> np.ndarray:
    """Well composed (6- and 26-connectivity agree) and one piece: the largest one."""
    skull = make_well_composed(skull)
    labels, n = ndimage.label(skull)
    if n > 1:
        # Specks cut off at the rim are not bone a CT segmentation would keep.
        sizes = np.bincount(labels.ravel())
        sizes[0] = 0
        skull = labels == int(np.argmax(sizes))
    return skull
