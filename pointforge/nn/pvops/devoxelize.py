"""Trilinear devoxelisation: a voxel grid interpolated at the points, with the corners and
weights of upstream's kernel. Coordinates are constants; gradients reach the grid."""

from __future__ import annotations

import torch
from torch import Tensor

from pointforge.errors import DataError
from pointforge.nn.pvops.bags import sum_bags, weighted_bags
from pointforge.nn.pvops.common import expect_coords

__all__ = ["devoxelize_weighted", "trilinear_corners", "trilinear_devoxelize", "voxel_rows"]


def trilinear_corners(coords: Tensor, resolution: int) -> tuple[Tensor, Tensor]:
    """The 8 voxel indices and weights of each point -> ``([B, 8, N] int64, [B, 8, N])``.

    Corner k has bits (x, y, z) = (k>>2, k>>1, k)&1. ``coords`` are in voxel units
    (``[0, r-1]``). An upper corner is used only when its fractional part is > 0;
    otherwise it repeats the lower one (with weight 0), as in the kernel.
    """
    expect_coords("trilinear_devoxelize", "coords", coords)
    r = int(resolution)
    c = coords.detach()
    lo = torch.floor(c)
    frac1 = c - lo
    frac0 = 1.0 - frac1
    lo = lo.long()
    base = (lo[:, 0] * r + lo[:, 1]) * r + lo[:, 2]
    step = (frac1 > 0).long() * torch.tensor([r * r, r, 1], device=c.device).view(1, 3, 1)
    weights, indices = [], []
    for k in range(8):
        bits = ((k >> 2) & 1, (k >> 1) & 1, k & 1)
        fx, fy, fz = ((frac1 if bit else frac0)[:, axis] for axis, bit in enumerate(bits))
        weights.append(fx * fy * fz)
        idx = base
        for axis, bit in enumerate(bits):
            if bit:
                idx = idx + step[:, axis]
        indices.append(idx)
    return torch.stack(indices, 1), torch.stack(weights, 1)


def voxel_rows(voxel_features: Tensor) -> Tensor:
    """A grid ``[B, C, r, r, r]`` as rows ``[B*r^3, C]`` (a view when it is channels-last)."""
    c = voxel_features.shape[1]
    return voxel_features.permute(0, 2, 3, 4, 1).reshape(-1, c).contiguous()


def devoxelize_weighted(voxel_features: Tensor, corner_index: Tensor, corner_weight: Tensor) -> Tensor:
    """``sum_k corner_weight[b, k, n] * voxel_features[b, :, corner_index[b, k, n]]`` -> ``[B, C, N]``."""
    bags = weighted_bags(corner_index, corner_weight, voxel_features[0, 0].numel())
    return sum_bags(voxel_rows(voxel_features), *bags, voxel_features.shape[0])


def trilinear_devoxelize(voxel_features: Tensor, coords: Tensor, resolution: int) -> Tensor:
    """Trilinear interpolation of a voxel grid ``[B, C, r, r, r]`` at ``coords [B, 3, N]``
    (voxel units, as returned by :func:`voxel_coordinates`) -> ``[B, C, N]``."""
    r = int(resolution)
    if voxel_features.dim() != 5 or tuple(voxel_features.shape[2:]) != (r, r, r):
        raise DataError(
            f"trilinear_devoxelize: expected voxel features [B, C, {r}, {r}, {r}], got {tuple(voxel_features.shape)}"
        )
    return devoxelize_weighted(voxel_features, *trilinear_corners(coords, r))
