"""Point averaging: points mapped into a voxel grid (upstream's ``Voxelization``, ``avg_voxelize``)
and their features averaged per voxel. Coordinates are constants; gradients reach the features."""

from __future__ import annotations

import torch
from torch import Tensor

from pointforge.errors import DataError
from pointforge.nn.pvops.common import expect_coords

__all__ = ["average_into_voxels", "flat_voxel_index", "voxel_coordinates", "voxel_point_counts", "voxel_means"]


def voxel_coordinates(
    coords: Tensor, resolution: int, normalize: bool = True, eps: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Upstream's ``Voxelization`` coordinate mapping.

    Returns ``(norm_coords, vox_coords)``: the coordinates centred on their mean, scaled so
    the farthest point sits at distance 0.5 (``normalize``) or mapped from [-1, 1], then
    into ``[0, r-1]`` (floats, used by devoxelisation), and their rounded integer voxel
    coordinates (int64).
    """
    expect_coords("voxel_coordinates", "coords", coords)
    r = int(resolution)
    c = coords.detach()
    norm = c - c.mean(2, keepdim=True)
    if normalize:
        norm = norm / (norm.norm(dim=1, keepdim=True).max(dim=2, keepdim=True).values * 2.0 + eps) + 0.5
    else:
        norm = (norm + 1) / 2.0
    norm = torch.clamp(norm * r, 0, r - 1)
    return norm, torch.round(norm).long()


def flat_voxel_index(vox_coords: Tensor, resolution: int) -> Tensor:
    """``x * r^2 + y * r + z`` per point -> ``[B, N]`` (x = coordinate channel 0)."""
    r = int(resolution)
    v = vox_coords.long()
    return (v[:, 0] * r + v[:, 1]) * r + v[:, 2]


def voxel_point_counts(flat_index: Tensor, resolution: int) -> Tensor:
    """Number of points in each voxel -> ``[B, r^3]`` (int64)."""
    b = flat_index.shape[0]
    r3 = int(resolution) ** 3
    offset = torch.arange(b, device=flat_index.device).unsqueeze(1) * r3
    return torch.bincount((flat_index + offset).reshape(-1), minlength=b * r3).view(b, r3)


def voxel_means(features: Tensor, flat_index: Tensor, counts: Tensor, resolution: int) -> Tensor:
    """Mean of ``features [B, C, N]`` per voxel given each point's ``flat_index [B, N]`` and
    the ``counts [B, r^3]`` -> ``[B, C, r, r, r]`` in channels-last memory layout.

    Rows of C channels are summed with ``index_add`` (contiguous row adds) and the grid is
    kept channels-last, the layout the 3D convolutions and the devoxelisation read fastest.
    """
    r = int(resolution)
    b, c, n = features.shape
    voxels = r**3
    rows = features.transpose(1, 2).reshape(b * n, c)
    offset = torch.arange(b, device=features.device).unsqueeze(1) * voxels
    sums = features.new_zeros((b * voxels, c)).index_add_(0, (flat_index + offset).reshape(-1), rows)
    mean = sums / counts.reshape(-1, 1).clamp(min=1).to(features.dtype)
    return mean.view(b, r, r, r, c).permute(0, 4, 1, 2, 3)


def average_into_voxels(features: Tensor, vox_coords: Tensor, resolution: int) -> Tensor:
    """Mean of the point features in each voxel -> ``[B, C, r, r, r]`` (empty voxels 0)."""
    if (
        features.dim() != 3
        or vox_coords.dim() != 3
        or vox_coords.shape[1] != 3
        or vox_coords.shape[0] != features.shape[0]
        or vox_coords.shape[2] != features.shape[2]
    ):
        raise DataError(
            f"average_into_voxels: expected features [B, C, N] and vox_coords [B, 3, N], got {tuple(features.shape)} and {tuple(vox_coords.shape)}"
        )
    r = int(resolution)
    index = flat_voxel_index(vox_coords, r)
    return voxel_means(features, index, voxel_point_counts(index, r), r)
