"""PVCNN2's building blocks: shared MLPs, voxel convolutions (PVConv) with squeeze-excitation or
attention, set abstraction and feature propagation, on the point-voxel operators of
:mod:`pointforge.nn.pvops`."""

from __future__ import annotations

import math
from typing import Any, Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pointforge.nn import fused_norm
from pointforge.nn.pvcnn_config import GROUP_NORM_GROUPS
from pointforge.nn.pvops import averaging, bags, ball_query, devoxelize, fps, grouping, three_nn

__all__ = [
    "Attention",
    "FeaturePropagation",
    "PVConv",
    "SetAbstraction",
    "SharedMLP",
    "SqueezeExcite3d",
    "VoxelMap",
    "dropout",
    "pointwise",
]

_SE_REDUCTION = 8


def pointwise(conv: Any, x: Tensor) -> Tensor:  # a Conv1d or Conv2d with a bias
    """A 1x1 Conv1d/Conv2d as one batched matrix product (faster than the conv on CPU)."""
    b, c = x.shape[:2]
    w = conv.weight.view(conv.out_channels, c)
    y = torch.baddbmm(conv.bias.view(1, -1, 1), w.expand(b, -1, -1), x.reshape(b, c, -1))
    return y.view(b, conv.out_channels, *x.shape[2:])


def dropout(module: nn.Dropout, x: Tensor) -> Tensor:
    """``module(x)``: the same mask from the same random numbers, drawn faster on CPU.

    PyTorch's CPU dropout draws its mask with ``bernoulli_(1 - p)``, one double uniform
    per element compared with ``1 - p``; drawing the uniforms with ``uniform_`` and
    comparing gives the same mask bit for bit and leaves the generator in the same state,
    in about half the time on large tensors (the classifier's dropout of the tiny PCDiff
    step; docs/experiments/benchmarks.md). The scaling and product are dropout's own.
    """
    if not module.training or module.p == 0 or module.inplace or x.device.type != "cpu" or not 0 < module.p < 1:
        return module(x)
    keep = 1.0 - module.p
    noise = (torch.empty_like(x, dtype=torch.float64).uniform_() < keep).to(x.dtype)
    return x * noise.div_(keep)


class SharedMLP(nn.Module):
    """Point-wise (1x1 conv) layers, each followed by GroupNorm(8) and Swish."""

    def __init__(self, in_channels: int, out_channels: Sequence[int], dim: int = 1):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[dim]
        layers: list[nn.Module] = []
        for oc in out_channels:
            layers += [conv(in_channels, oc, 1), nn.GroupNorm(GROUP_NORM_GROUPS, oc), nn.SiLU()]
            in_channels = oc
        self.layers = nn.Sequential(*layers)
        self.out_channels = in_channels

    def forward(self, x: Tensor) -> Tensor:
        mods = list(self.layers)
        for i in range(0, len(mods), 3):
            conv, norm = mods[i], cast(nn.GroupNorm, mods[i + 1])
            x = pointwise(conv, x)
            if fused_norm.applies(x, norm):
                x = fused_norm.group_norm_act_(x, norm, silu=True)
                continue
            x = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
            x = F.silu(x)
        return x


class SqueezeExcite3d(nn.Module):
    """Channel gating from the voxel grid's mean (reduction 8, ReLU inside)."""

    def __init__(self, channels: int):
        super().__init__()
        self.fc = nn.Sequential(
            nn.Linear(channels, channels // _SE_REDUCTION, bias=False),
            nn.ReLU(inplace=True),
            nn.Linear(channels // _SE_REDUCTION, channels, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x: Tensor) -> Tensor:
        # One reduction over the grid: nested means over the last axis are 3x slower on
        # contiguous grids and 15x slower on channels-last ones (what the fused norm leaves).
        gate = self.fc(x.mean((2, 3, 4)))
        return x * gate.view(*gate.shape, 1, 1, 1)


class Attention(nn.Module):
    """Unscaled dot-product self-attention over voxels (``dims=3``) or points (``dims=1``),
    added to its input, then GroupNorm and Swish."""

    def __init__(self, channels: int, num_groups: int = GROUP_NORM_GROUPS, dims: int = 3):
        super().__init__()
        conv = {1: nn.Conv1d, 3: nn.Conv3d}[dims]
        self.q = conv(channels, channels, 1)
        self.k = conv(channels, channels, 1)
        self.v = conv(channels, channels, 1)
        self.out = conv(channels, channels, 1)
        self.norm = nn.GroupNorm(num_groups, channels)

    def forward(self, x: Tensor) -> Tensor:
        b, c = x.shape[:2]
        flat = x.reshape(b, c, -1)
        tokens = flat.transpose(1, 2)  # [B, L, C]
        # Contiguous [B, 1, L, C] inputs let PyTorch use its fused attention kernel.
        q, k, v = (F.linear(tokens, m.weight.view(c, c), m.bias).unsqueeze(1) for m in (self.q, self.k, self.v))
        # softmax_j(q_i . k_j) weighting v_j, without 1/sqrt(C) (upstream has none).
        h = F.scaled_dot_product_attention(q, k, v, scale=1.0).squeeze(1)
        h = F.linear(h, self.out.weight.view(c, c), self.out.bias).transpose(1, 2)
        y = (h + flat).reshape(x.shape)
        if fused_norm.applies(y, self.norm):
            return fused_norm.group_norm_act_(y, self.norm, silu=True)
        return F.silu(self.norm(y))


class VoxelMap:
    """Where the points of one level fall in a voxel grid; shared by the level's PVConvs."""

    def __init__(self, coords: Tensor, resolution: int):
        self.resolution = resolution
        norm_coords, vox = averaging.voxel_coordinates(coords, resolution)
        self.flat_index = averaging.flat_voxel_index(vox, resolution)
        self.counts = averaging.voxel_point_counts(self.flat_index, resolution)
        self.batch = coords.shape[0]
        self.corner_bags = bags.weighted_bags(*devoxelize.trilinear_corners(norm_coords, resolution), resolution**3)

    def average(self, features: Tensor) -> Tensor:
        return averaging.voxel_means(features, self.flat_index, self.counts, self.resolution)

    def devoxelize(self, grid: Tensor) -> Tensor:
        return bags.sum_bags(devoxelize.voxel_rows(grid), *self.corner_bags, self.batch)


def _use_mkldnn(x: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and bool(torch.backends.mkldnn.enabled)
    )


def _conv3d(conv: nn.Conv3d, x: Tensor) -> Tensor:
    """3x3x3 convolution, calling oneDNN directly on CPU.

    PyTorch's dispatcher sends several of PVCNN2's shapes (e.g. 256 channels at 8^3) to
    its slow reference 3D convolution; oneDNN is 3-10x faster there and differs only by
    float rounding. Elsewhere (CUDA, float64) the ordinary path runs.

    The input goes in channels-last: oneDNN's backward on
    plain NCDHW grids with few channels is slow (a conv, GroupNorm, conv, GroupNorm block
    of the tiny preset at 16^3, 8 channels: about 1.4x slower forward and backward).
    Under ``torch.compile`` the ordinary path runs: Dynamo cannot trace the direct call.
    """
    if not torch.compiler.is_compiling() and _use_mkldnn(x):
        x = x.contiguous(memory_format=torch.channels_last_3d)
        pad = list(conv.padding)
        return torch.ops.aten.mkldnn_convolution(
            x, conv.weight, conv.bias, pad, list(conv.stride), list(conv.dilation), conv.groups
        )
    return conv(x)


class PVConv(nn.Module):
    """Point-voxel convolution: voxel branch (avg voxelise, 2x Conv3d-GroupNorm-Swish with
    dropout between, SE or attention, trilinear devoxelise) + point-wise MLP branch."""

    def __init__(self, in_channels: int, out_channels: int, resolution: int, attention: bool, dropout: float):
        super().__init__()
        self.resolution = resolution
        layers: list[nn.Module] = [
            nn.Conv3d(in_channels, out_channels, 3, padding=1),
            nn.GroupNorm(GROUP_NORM_GROUPS, out_channels),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Conv3d(out_channels, out_channels, 3, padding=1),
            nn.GroupNorm(GROUP_NORM_GROUPS, out_channels),
            Attention(out_channels) if attention else nn.SiLU(),
        ]
        if not attention:
            layers.append(SqueezeExcite3d(out_channels))
        self.voxel_layers = nn.Sequential(*layers)
        self.point_features = SharedMLP(in_channels, [out_channels])

    def forward(self, features: Tensor, coords: Tensor, voxel_map: VoxelMap | None = None) -> Tensor:
        if voxel_map is None or voxel_map.resolution != self.resolution:
            voxel_map = VoxelMap(coords, self.resolution)
        grid = voxel_map.average(features)
        layers = list(self.voxel_layers)
        fused_silu = False  # the SiLU after a GroupNorm already applied with it
        for i, layer in enumerate(layers):
            if fused_silu:
                fused_silu = False
            elif isinstance(layer, nn.Conv3d):
                grid = _conv3d(layer, grid)
            elif isinstance(layer, nn.GroupNorm) and fused_norm.applies(grid, layer):
                # On the channels-last grid oneDNN returned, which the next convolution
                # and the devoxelisation read as they are.
                fused_silu = i + 1 < len(layers) and isinstance(layers[i + 1], nn.SiLU)
                grid = fused_norm.group_norm_act_(grid, layer, silu=fused_silu)
            elif isinstance(layer, nn.GroupNorm):
                # PyTorch's CPU GroupNorm on channels-last grids (what oneDNN returns) loses
                # ~1e-4 relative precision; the contiguous kernel does not.
                grid = layer(grid.contiguous())
            else:
                grid = layer(grid)
        return voxel_map.devoxelize(grid) + self.point_features(features)


def _segment_weights(weights: Tensor, segment: Tensor, num_segments: int) -> Tensor:
    """``[K, S]``: column k's weight in the column of its segment, 0 elsewhere, so that
    ``x @ spread`` sums every segment's weighted columns in one matrix product."""
    spread = weights.new_zeros((weights.shape[0], num_segments))
    spread[torch.arange(weights.shape[0], device=weights.device), segment] = weights
    return spread


def _segment_group_norm(x: Tensor, spread: Tensor, segment: Tensor, norm: nn.GroupNorm) -> Tensor:
    """GroupNorm of ``x [C, K]`` whose columns stand for ``weights`` identical copies each,
    each batch element normalised on its own: ``spread`` from :func:`_segment_weights`,
    ``segment [K]`` the batch element of each column.

    All batch elements at once (the extra terms of the sums are exact zeros), in a fixed
    number of ops instead of ~12 per batch element forward and as many again backward: the
    tiny network is dispatch-bound and runs this in every SA MLP layer."""
    c, k = x.shape
    g = norm.num_groups
    per_group = c // g
    total = spread.sum(0) * per_group  # [S]
    mean = (x @ spread).view(g, per_group, -1).sum(1) / total  # [G, S]
    centred = x.view(g, per_group, k) - mean[:, segment].unsqueeze(1)
    var = (centred * centred).view(c, k).matmul(spread).view(g, per_group, -1).sum(1) / total
    rstd = torch.rsqrt(var + norm.eps)[:, segment].unsqueeze(1)  # [G, 1, K]
    return torch.addcmul(norm.bias.view(g, per_group, 1), centred * rstd, norm.weight.view(g, per_group, 1)).view(c, k)


class SetAbstraction(nn.Module):
    """FPS centres, ball-query neighbourhoods, shared MLP on [offset xyz, features], max-pool.

    Upstream runs the MLP on all ``num_neighbors`` slots of every ball, most of which are
    copies of the first hit (a ball of radius 0.1 in the paper holds ~5 of 128 slots).
    Copies give identical MLP values, do not change the max, and enter the GroupNorm
    statistics only through their number, so by default the MLP runs once per distinct
    (centre, point) pair with the copies counted as weights: the same function and
    gradients, up to float rounding, for a fraction of the work. ``distinct_slots=False``
    runs upstream's dense computation (kept as the reference the fast path is tested against).
    """

    def __init__(self, num_centers: int, radius: float, num_neighbors: int, in_channels: int, mlp: Sequence[int]):
        super().__init__()
        self.num_centers = num_centers
        self.radius = radius
        self.num_neighbors = num_neighbors
        self.mlps = nn.ModuleList([SharedMLP(in_channels + 3, mlp, dim=2)])
        self.out_channels = mlp[-1]
        self.distinct_slots = True

    def forward(self, features: Tensor, coords: Tensor) -> tuple[Tensor, Tensor]:
        centers, neighbors = self.neighborhoods(coords)
        return self.pool(features, coords, centers, neighbors), centers

    def neighborhoods(self, coords: Tensor) -> tuple[Tensor, Tensor]:
        """``(centers [B, 3, M], neighbors [B, M, num_neighbors])``: FPS, then ball query;
        no gradients flow here, so activation checkpointing leaves it out of the recomputation."""
        centers, _ = fps.furthest_point_sample(coords, self.num_centers)
        return centers, ball_query.ball_query(centers, coords, self.radius, self.num_neighbors)

    def pool(self, features: Tensor, coords: Tensor, centers: Tensor, neighbors: Tensor) -> Tensor:
        """The MLP on each neighbourhood's [offset xyz, features], max-pooled per centre."""
        if self.distinct_slots:
            return self._pool_distinct(features, coords, centers, neighbors)
        grouped_xyz = grouping.grouping(coords, neighbors) - centers.unsqueeze(-1)
        grouped = torch.cat([grouped_xyz, grouping.grouping(features, neighbors)], 1)
        return _max_last(self.mlps[0](grouped))

    def _pool_distinct(self, features: Tensor, coords: Tensor, centers: Tensor, neighbors: Tensor) -> Tensor:
        b, c, n = features.shape
        _, m, u = neighbors.shape
        # Ball query lists its hits in increasing index order, then repeats the first hit:
        # a slot holds a new point exactly when its index exceeds the previous slot's.
        distinct = torch.ones_like(neighbors, dtype=torch.bool)
        distinct[..., 1:] = neighbors[..., 1:] > neighbors[..., :-1]
        hits = distinct.sum(-1)  # [B, M], >= 1
        bi, mi, si = distinct.nonzero(as_tuple=True)  # batch-major, then centre, then slot
        ball = bi * m + mi
        point = bi * n + neighbors[bi, mi, si]
        copies = torch.where(si == 0, u - hits.view(-1)[ball] + 1, torch.ones_like(si)).to(features.dtype)
        xyz = coords.transpose(0, 1).reshape(3, b * n)[:, point] - centers.transpose(0, 1).reshape(3, b * m)[:, ball]
        x = torch.cat([xyz, features.transpose(0, 1).reshape(c, b * n)[:, point]], 0)  # [3 + C, K]

        spread = _segment_weights(copies, bi, b)
        mods = list(cast(SharedMLP, self.mlps[0]).layers)
        for i in range(0, len(mods), 3):
            conv, norm = cast(nn.Conv1d, mods[i]), cast(nn.GroupNorm, mods[i + 1])
            assert conv.bias is not None  # SharedMLP's convs have one
            x = torch.addmm(conv.bias.view(-1, 1), conv.weight.view(conv.out_channels, -1), x)
            x = F.silu(_segment_group_norm(x, spread, bi, norm))

        width = int(hits.max())
        pooled = x.new_full((x.shape[0], b * m, width), -math.inf)
        pooled[:, ball, si] = x
        return _max_last(pooled).view(-1, b, m).transpose(0, 1)


def _max_last(x: Tensor) -> Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        # max(...).values routes the gradient to one maximum, as upstream does.
        return x.max(dim=-1).values
    return x.amax(dim=-1)


class FeaturePropagation(nn.Module):
    """3-NN interpolation of the coarse features onto the finer points, skip concat, MLP."""

    def __init__(self, in_channels: int, mlp: Sequence[int]):
        super().__init__()
        self.mlp = SharedMLP(in_channels, mlp)
        self.out_channels = mlp[-1]

    def forward(
        self, points_coords: Tensor, centers_coords: Tensor, centers_features: Tensor, points_features: Tensor
    ) -> tuple[Tensor, Tensor]:
        indices, weights = self.nearest(points_coords, centers_coords)
        return self.propagate(indices, weights, centers_features, points_features)

    def nearest(self, points_coords: Tensor, centers_coords: Tensor) -> tuple[Tensor, Tensor]:
        """The three nearest centres of every point and their interpolation weights."""
        return three_nn.three_nearest_neighbors(points_coords, centers_coords)

    def propagate(
        self, indices: Tensor, weights: Tensor, centers_features: Tensor, points_features: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(interpolated, MLP output)`` from the 3-NN ``indices`` and ``weights`` (which
        need no gradients, so activation checkpointing leaves them out of the recomputation)."""
        interpolated = three_nn.interpolate_from_neighbors(centers_features, indices, weights)
        if points_features.shape[1] == 0:  # the finest level without extra input channels
            return interpolated, self.mlp(interpolated)
        return interpolated, self.mlp(torch.cat([interpolated, points_features], 1))
