"""The voxelizer's target grids: a complete skull's inside at a chosen resolution, and resampled after augmentation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import DataError


def unit_cube_scale(shape: tuple[int, ...]) -> float:
    """Voxel coordinates → [0, 1): divide by the longest side, so shapes keep their aspect."""
    return float(max(shape))


@dataclass(frozen=True)
class VoxelizerFrame:
    """The voxelizer's unit cube in millimetres, placed on the skull: what it saw in training.

    Training scales each volume's voxel coordinates by its longest side
    (:func:`unit_cube_scale`), so the cube a network learned is that side in
    millimetres, and each skull sits where its scan put it. ``cube_mm`` and
    ``centre`` (where a defective skull's bounding-box centre lies in the cube,
    unit coordinates) are the training split's medians. :meth:`cube` places
    such a cube on any skull, whatever its voxel size, field of view and
    origin: the skull then has the size and place in the cube it had in training.
    """

    cube_mm: float
    centre: tuple[float, float, float]

    def cube(self, bbox_lo: np.ndarray, bbox_hi: np.ndarray, spacing: float) -> tuple[np.ndarray, float]:
        """(corner, side) of the cube in the voxel coordinates of a volume with isotropic ``spacing``
        whose defective skull spans ``bbox_lo``..``bbox_hi`` (voxel coordinates)."""
        side = self.cube_mm / float(spacing)
        middle = (np.asarray(bbox_lo, dtype=np.float64) + np.asarray(bbox_hi, dtype=np.float64)) / 2.0
        return middle - np.asarray(self.centre, dtype=np.float64) * side, side


def training_frame(data: PreparedDataset, split: str = "train") -> VoxelizerFrame | None:
    """The :class:`VoxelizerFrame` of the split's defective skulls, from their metadata alone (None if none)."""
    sides, centres = [], []
    for key in dict.fromkeys(case.defective for case in data.split(split, require=("implant", "complete_mask"))):
        meta = data.meta(key)
        side = unit_cube_scale(tuple(meta["shape"]))
        middle = (np.asarray(meta["bbox_min"], dtype=np.float64) + np.asarray(meta["bbox_max"], dtype=np.float64)) / 2
        sides.append(side * float(np.min(meta["spacing"])))
        centres.append(middle / side)
    if not sides:
        return None
    centre = np.median(np.asarray(centres), axis=0)
    return VoxelizerFrame(
        cube_mm=float(np.median(sides)), centre=(float(centre[0]), float(centre[1]), float(centre[2]))
    )


def inside_grid(mask: np.ndarray, resolution: int) -> np.ndarray:
    """Boolean grid at ``resolution``³: is grid node ``i`` (voxel coordinate ``i * S / resolution``) inside ``mask``?

    Trilinear interpolation of the mask, inside where it is at least 0.5;
    nodes beyond the volume's shorter sides are outside. When ``S`` is a
    multiple of ``resolution`` every node falls on a voxel centre, and the grid
    is the mask taken with a stride (the same values, without interpolating
    134 M nodes at 512³).
    """
    s = int(unit_cube_scale(mask.shape))
    if s % resolution == 0:
        step = s // resolution
        sub = np.asarray(mask[::step, ::step, ::step], dtype=bool)
        out = np.zeros((resolution,) * 3, dtype=bool)
        out[: sub.shape[0], : sub.shape[1], : sub.shape[2]] = sub
        return out
    from scipy.ndimage import map_coordinates

    axis = np.arange(resolution, dtype=np.float64) * s / resolution
    coords = np.stack(np.meshgrid(axis, axis, axis, indexing="ij")).reshape(3, -1)
    inside = map_coordinates(mask.astype(np.float32), coords, order=1, mode="constant", cval=0.0) >= 0.5
    return inside.reshape((resolution,) * 3)


def indicator_grid(mask: np.ndarray, resolution: int) -> np.ndarray:
    """Target grid at ``resolution``³ for a mask in the unit cube: −0.5 inside, +0.5 outside.

    Grid node ``i`` sits at unit coordinate ``i / resolution``, i.e. at voxel
    coordinate ``i * S / resolution`` with ``S`` the longest side (as the points).
    """
    return np.where(inside_grid(mask, resolution), -0.5, 0.5).astype(np.float32)


def transform_inside(inside: torch.Tensor, transform: torch.Tensor, *, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """Resample inside grids to match points moved by ``transform`` (see :class:`VoxelizationDataset`).

    ``inside``: bool [B, R, R, R] (or [R, R, R]), node ``i`` at unit coordinate
    ``i / R``; ``transform``: [B, 3, 4] (or [3, 4]), ``p' = M p + t``. The new
    grid at node ``x`` is the old grid at ``M⁻¹ (x − t)``, trilinearly
    interpolated (outside the cube counts as outside), inside where at least
    0.5 as :func:`inside_grid` decides. Runs on the tensors' device, slab by
    slab along the first axis so the sample coordinates take about
    ``chunk_bytes``; items whose transform is the identity are copied as they are.
    """
    import torch.nn.functional as F

    single = inside.dim() == 3
    if single:
        inside, transform = inside[None], transform[None]
    if inside.dim() != 4 or inside.dtype != torch.bool or len({*inside.shape[1:]}) != 1:
        raise DataError(f"transform_inside expects bool grids [B, R, R, R], got {inside.dtype} {tuple(inside.shape)}")
    if transform.shape != (inside.shape[0], 3, 4):
        raise DataError(
            f"transform_inside expects transforms [B, 3, 4] for {inside.shape[0]} grid(s), got {tuple(transform.shape)}"
        )
    b, res = inside.shape[0], inside.shape[1]
    out = inside.clone()
    identity = torch.eye(3, 4, dtype=transform.dtype, device=transform.device)
    axis = torch.arange(res, device=inside.device, dtype=torch.float32) / res
    slab = max(1, int(chunk_bytes) // (res * res * 3 * 4))
    for item in range(b):
        if torch.equal(transform[item], identity):
            continue
        m = transform[item, :, :3].double()
        t = transform[item, :, 3].double()
        inverse = torch.linalg.inv(m)
        offset = -(inverse @ t)
        # Source node index = res * (M⁻¹ x + offset); grid_sample wants (-1..1) with
        # align_corners=True, i.e. 2 * index / (res - 1) - 1, and its last dimension
        # ordered (axis 2, axis 1, axis 0) for a (D, H, W) = (axis 0, 1, 2) volume.
        to_norm = 2.0 * res / (res - 1)
        lin = (inverse * to_norm).float()
        off = (offset * to_norm - 1.0).float()
        volume = inside[item].to(torch.float32)[None, None]
        for start in range(0, res, slab):
            x0 = axis[start : start + slab]
            coords = (
                lin[:, 0] * x0[:, None, None, None]
                + lin[:, 1] * axis[None, :, None, None]
                + lin[:, 2] * axis[None, None, :, None]
                + off
            )  # [slab, R, R, 3] in (axis 0, 1, 2) order
            sampled = F.grid_sample(
                volume, coords.flip(-1)[None], mode="bilinear", padding_mode="zeros", align_corners=True
            )
            out[item, start : start + x0.shape[0]] = sampled[0, 0] >= 0.5
    return out[0] if single else out
