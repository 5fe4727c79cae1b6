"""PVCNN2: the point-voxel U-Net that PCDiff (and PVD) use as the denoising network.

The network is built from a :class:`PVCNN2Config`, whose set-abstraction (SA) and
feature-propagation (FP) levels are plain data. The module tree is laid out so that our
``state_dict`` keys are exactly upstream's keys without the ``model.`` prefix of PCDiff's
checkpoints (``sa_layers.1.0.voxel_layers.6.q.weight`` ...), which makes importing
upstream weights a validated prefix strip (:mod:`pointforge.nn.pcdiff_import`).

Upstream behaviour that shapes the weights, kept on purpose:

* In SA levels after the first only the first PVConv block is built, whatever the
  number of blocks in upstream's tuple says (its builder appends a block only while its
  block counter is 0). :meth:`PVCNN2Config.from_upstream` records what is built.
* Voxel attention (in place of the second Swish) appears only in the first PVConv of
  SA levels 2, 4, ...; upstream's FP attention never fires (a shadowed variable), so FP
  levels have none. Blocks with voxel attention have no squeeze-excitation.
* The timestep embedding is concatenated to the input of every SA level after the
  first and of every FP level; the network returns an output for *all* N points.

The network knows nothing about diffusion beyond taking ``t``, nor about devices or
distributed training.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pointforge.errors import ConfigError, DataError
from pointforge.nn import pvops
from pointforge.nn.presets import preset

__all__ = [
    "ConvStage",
    "FPLevel",
    "PRESETS",
    "PVCNN2",
    "PVCNN2Config",
    "SALevel",
    "get_preset",
    "resolve_config",
    "timestep_embedding",
]

_GROUPS = 8  # GroupNorm groups everywhere in upstream's PVCNN2
_SE_REDUCTION = 8


# =========================================================================== configuration


@dataclass(frozen=True)
class ConvStage:
    """``num_blocks`` PVConv blocks to ``out_channels`` on a ``voxel_resolution``³ grid
    (``voxel_resolution=None``: point-wise MLP blocks instead of PVConv)."""

    out_channels: int
    num_blocks: int
    voxel_resolution: int | None


@dataclass(frozen=True)
class SALevel:
    """A set-abstraction level: optional conv stage, then FPS to ``num_centers`` centres,
    ball query (``radius``, ``num_neighbors``) and a shared MLP max-pooled per centre."""

    conv: ConvStage | None
    num_centers: int
    radius: float
    num_neighbors: int
    mlp: tuple[int, ...]
    voxel_attention: bool = False  # attention in the first block of ``conv``


@dataclass(frozen=True)
class FPLevel:
    """A feature-propagation level: 3-NN interpolation + shared MLP, then a conv stage."""

    mlp: tuple[int, ...]
    conv: ConvStage | None


@dataclass(frozen=True)
class PVCNN2Config:
    """Everything that determines a PVCNN2's structure."""

    sa_levels: tuple[SALevel, ...]
    fp_levels: tuple[FPLevel, ...]
    embed_dim: int = 64
    global_attention: bool = True
    dropout: float = 0.1
    extra_feature_channels: int = 0
    num_classes: int = 3
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- upstream translation

    @classmethod
    def from_upstream(
        cls,
        sa_blocks: Sequence,
        fp_blocks: Sequence,
        *,
        embed_dim: int,
        use_att: bool,
        dropout: float = 0.1,
        extra_feature_channels: int = 0,
        num_classes: int = 3,
        width_multiplier: float = 1,
        voxel_resolution_multiplier: float = 1,
        description: str = "",
    ) -> "PVCNN2Config":
        """Translate upstream's class attributes ``sa_blocks`` / ``fp_blocks`` and its
        constructor arguments into the structure upstream actually builds."""
        r, vr = width_multiplier, voxel_resolution_multiplier

        def stage(conv: Sequence | None, first_level: bool) -> ConvStage | None:
            if conv is None:
                return None
            out, blocks, res = conv
            return ConvStage(
                int(r * out),
                int(blocks) if first_level else min(1, int(blocks)),
                None if res is None else int(vr * res),
            )

        sa = []
        for level, (conv, (centers, radius, neighbors, mlp)) in enumerate(sa_blocks):
            mlp = tuple(int(r * c) for c in (mlp if isinstance(mlp, (list, tuple)) else (mlp,)))
            sa.append(
                SALevel(
                    conv=stage(conv, level == 0),
                    num_centers=int(centers),
                    radius=float(radius),
                    num_neighbors=int(neighbors),
                    mlp=mlp,
                    voxel_attention=bool(use_att and level % 2 == 1 and conv is not None and conv[2] is not None),
                )
            )
        fp = []
        for mlp, conv in fp_blocks:
            mlp = tuple(int(r * c) for c in (mlp if isinstance(mlp, (list, tuple)) else (mlp,)))
            fp.append(FPLevel(mlp=mlp, conv=stage(conv, True)))
        return cls(
            sa_levels=tuple(sa),
            fp_levels=tuple(fp),
            embed_dim=int(embed_dim),
            global_attention=bool(use_att),
            dropout=float(dropout),
            extra_feature_channels=int(extra_feature_channels),
            num_classes=int(num_classes),
            description=description,
        )

    # ---- plain-data round trip (YAML, checkpoints)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PVCNN2Config":
        try:

            def conv(d: Mapping | None) -> ConvStage | None:
                return None if d is None else ConvStage(**d)

            sa = tuple(SALevel(**{**d, "conv": conv(d.get("conv")), "mlp": tuple(d["mlp"])}) for d in data["sa_levels"])
            fp = tuple(FPLevel(mlp=tuple(d["mlp"]), conv=conv(d.get("conv"))) for d in data["fp_levels"])
            rest = {k: v for k, v in data.items() if k not in ("sa_levels", "fp_levels")}
            return cls(sa_levels=sa, fp_levels=fp, **rest)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"PVCNN2 config is malformed ({exc}); start from a preset's to_dict() output") from None

    # ---- checks

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"PVCNN2 config: {message}")

        need(len(self.sa_levels) >= 1, "needs at least one SA level")
        need(
            len(self.fp_levels) == len(self.sa_levels),
            f"needs as many FP levels as SA levels, got {len(self.fp_levels)} and {len(self.sa_levels)}",
        )
        need(self.sa_levels[0].conv is not None, "the first SA level needs a conv stage (upstream's layout)")
        need(self.embed_dim >= 2, f"embed_dim must be at least 2, got {self.embed_dim}")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(
            self.extra_feature_channels >= 0 and self.num_classes >= 1,
            "extra_feature_channels must be >= 0 and num_classes >= 1",
        )

        def groups_ok(c: int, where: str) -> None:
            need(
                c >= _GROUPS and c % _GROUPS == 0,
                f"{where} has {c} channels; GroupNorm(8) needs a positive multiple of 8",
            )

        for i, level in enumerate(self.sa_levels):
            need(
                level.num_centers >= 1 and level.num_neighbors >= 1 and level.radius > 0,
                f"SA level {i} needs num_centers, num_neighbors >= 1 and radius > 0",
            )
            need(len(level.mlp) >= 1, f"SA level {i} needs at least one MLP layer")
            for c in level.mlp:
                groups_ok(c, f"SA level {i} MLP")
            if level.conv is not None:
                groups_ok(level.conv.out_channels, f"SA level {i} conv")
                need(level.conv.num_blocks >= 1, f"SA level {i} conv needs at least one block")
                need(
                    i == 0 or level.conv.num_blocks == 1,
                    f"SA level {i} conv: upstream builds one block in SA levels after the first; use num_blocks=1",
                )
            need(
                not level.voxel_attention or (level.conv is not None and level.conv.voxel_resolution is not None),
                f"SA level {i}: voxel_attention needs a PVConv stage",
            )
        for i, fp_level in enumerate(self.fp_levels):
            need(len(fp_level.mlp) >= 1, f"FP level {i} needs at least one MLP layer")
            for c in fp_level.mlp:
                groups_ok(c, f"FP level {i} MLP")
            if fp_level.conv is not None:
                groups_ok(fp_level.conv.out_channels, f"FP level {i} conv")
                need(fp_level.conv.num_blocks >= 1, f"FP level {i} conv needs at least one block")
        if self.global_attention:
            groups_ok(_sa_out_channels(self.sa_levels[-1]), "the global attention (last SA level output)")

    @property
    def min_points(self) -> int:
        """The fewest input points the network accepts (FPS cannot pick more centres than points)."""
        return self.sa_levels[0].num_centers


def _sa_out_channels(level: SALevel) -> int:
    return level.mlp[-1]


# =========================================================================== presets


def _paper() -> PVCNN2Config:
    return PVCNN2Config.from_upstream(
        sa_blocks=[
            ((32, 2, 32), (10240, 0.1, 128, (32, 64))),
            ((64, 3, 16), (2560, 0.2, 128, (64, 128))),
            ((128, 3, 8), (640, 0.4, 128, (128, 256))),
            (None, (160, 0.8, 128, (256, 256, 512))),
        ],
        fp_blocks=[
            ((256, 256), (256, 3, 8)),
            ((256, 256), (256, 3, 8)),
            ((256, 128), (128, 2, 16)),
            ((128, 128, 64), (64, 2, 32)),
        ],
        embed_dim=64,
        use_att=True,
        dropout=0.1,
        extra_feature_channels=0,
        description="PCDiff paper network (27.6 M parameters), for 30,720 points (27,648 skull + 3,072 implant); GPU.",
    )


def _small() -> PVCNN2Config:
    # The paper's layout for 1/8 of the points: centres / 8, radii x sqrt(8) (surface
    # density / 8), channels and voxel resolutions halved, 32 neighbour slots (the paper's
    # balls hold ~5-10 points in 128 slots). 6.9 M parameters.
    return PVCNN2Config.from_upstream(
        sa_blocks=[
            ((16, 2, 16), (1280, 0.3, 32, (16, 32))),
            ((32, 3, 8), (320, 0.6, 32, (32, 64))),
            ((64, 3, 4), (80, 1.2, 32, (64, 128))),
            (None, (20, 2.4, 32, (128, 128, 256))),
        ],
        fp_blocks=[
            ((128, 128), (128, 3, 4)),
            ((128, 128), (128, 3, 4)),
            ((128, 64), (64, 2, 8)),
            ((64, 64, 32), (32, 2, 16)),
        ],
        embed_dim=32,
        use_att=True,
        dropout=0.1,
        extra_feature_channels=0,
        description="CPU training in minutes: 3,840 points (3,456 skull + 384 implant).",
    )


def _tiny() -> PVCNN2Config:
    # Exactly the network of the upstream reference fixture (upstream_pvcnn2_tiny.pt), so
    # the preset itself is checked against upstream's output.
    return PVCNN2Config.from_upstream(
        sa_blocks=[
            ((8, 2, 16), (256, 0.1, 16, (8, 16))),
            ((16, 3, 8), (64, 0.2, 16, (16, 32))),
            ((32, 3, 4), (16, 0.4, 16, (32, 64))),
            (None, (8, 0.8, 16, (64, 64, 128))),
        ],
        fp_blocks=[
            ((32, 32), (32, 3, 4)),
            ((32, 32), (32, 3, 4)),
            ((32, 16), (16, 2, 8)),
            ((16, 16, 8), (8, 2, 16)),
        ],
        embed_dim=32,
        use_att=True,
        dropout=0.1,
        extra_feature_channels=0,
        description="CI and smoke tests in seconds: 1,024 points (896 skull + 128 implant).",
    )


PRESETS: dict[str, Any] = {"paper": _paper, "small": _small, "tiny": _tiny}


def get_preset(name: str) -> PVCNN2Config:
    """The named preset's configuration (``paper``, ``small`` or ``tiny``)."""
    return preset("PVCNN2", PRESETS, name)


def resolve_config(config: PVCNN2Config | str | Mapping) -> PVCNN2Config:
    """A preset name, a config or its ``to_dict()`` form -> :class:`PVCNN2Config`."""
    if isinstance(config, PVCNN2Config):
        return config
    if isinstance(config, str):
        return get_preset(config)
    if isinstance(config, Mapping):
        return PVCNN2Config.from_dict(config)
    raise ConfigError(f"PVCNN2 config must be a preset name, a PVCNN2Config or a dict, got {type(config).__name__}")


# =========================================================================== building blocks


def _pointwise(conv: Any, x: Tensor) -> Tensor:  # a Conv1d or Conv2d with a bias
    """A 1x1 Conv1d/Conv2d as one batched matrix product (faster than the conv on CPU)."""
    b, c = x.shape[:2]
    w = conv.weight.view(conv.out_channels, c)
    y = torch.baddbmm(conv.bias.view(1, -1, 1), w.expand(b, -1, -1), x.reshape(b, c, -1))
    return y.view(b, conv.out_channels, *x.shape[2:])


class SharedMLP(nn.Module):
    """Point-wise (1x1 conv) layers, each followed by GroupNorm(8) and Swish."""

    def __init__(self, in_channels: int, out_channels: Sequence[int], dim: int = 1):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[dim]
        layers: list[nn.Module] = []
        for oc in out_channels:
            layers += [conv(in_channels, oc, 1), nn.GroupNorm(_GROUPS, oc), nn.SiLU()]
            in_channels = oc
        self.layers = nn.Sequential(*layers)
        self.out_channels = in_channels

    def forward(self, x: Tensor) -> Tensor:
        mods = list(self.layers)
        for i in range(0, len(mods), 3):
            conv, norm = mods[i], cast(nn.GroupNorm, mods[i + 1])
            x = _pointwise(conv, x)
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
        gate = self.fc(x.mean(-1).mean(-1).mean(-1))
        return x * gate.view(*gate.shape, 1, 1, 1)


class Attention(nn.Module):
    """Unscaled dot-product self-attention over voxels (``dims=3``) or points (``dims=1``),
    added to its input, then GroupNorm and Swish."""

    def __init__(self, channels: int, num_groups: int = _GROUPS, dims: int = 3):
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
        return F.silu(self.norm((h + flat).reshape(x.shape)))


class _VoxelMap:
    """Where the points of one level fall in a voxel grid; shared by the level's PVConvs."""

    def __init__(self, coords: Tensor, resolution: int):
        self.resolution = resolution
        norm_coords, vox = pvops.voxel_coordinates(coords, resolution)
        self.flat_index = pvops.flat_voxel_index(vox, resolution)
        self.counts = pvops.voxel_point_counts(self.flat_index, resolution)
        self.batch = coords.shape[0]
        self.bags = pvops.weighted_bags(*pvops.trilinear_corners(norm_coords, resolution), resolution**3)

    def voxelize(self, features: Tensor) -> Tensor:
        return pvops.voxelize_mean(features, self.flat_index, self.counts, self.resolution)

    def devoxelize(self, grid: Tensor) -> Tensor:
        return pvops.sum_bags(pvops.voxel_rows(grid), *self.bags, self.batch)


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

    The input goes in channels-last (``CHANNELS_LAST_CONV3D``): oneDNN's backward on
    plain NCDHW grids with few channels is slow (a conv, GroupNorm, conv, GroupNorm block
    of the tiny preset at 16^3, 8 channels: 14 ms forward and backward against 10 ms).
    """
    if _use_mkldnn(x):
        if CHANNELS_LAST_CONV3D:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        pad = list(conv.padding)
        return torch.ops.aten.mkldnn_convolution(
            x, conv.weight, conv.bias, pad, list(conv.stride), list(conv.dilation), conv.groups
        )
    return conv(x)


# False: oneDNN gets the grid in whatever layout it has (the layout before the change,
# kept for bench/pcdiff_step.py's side-by-side timing).
CHANNELS_LAST_CONV3D = True


class PVConv(nn.Module):
    """Point-voxel convolution: voxel branch (avg voxelise, 2x Conv3d-GroupNorm-Swish with
    dropout between, SE or attention, trilinear devoxelise) + point-wise MLP branch."""

    def __init__(self, in_channels: int, out_channels: int, resolution: int, attention: bool, dropout: float):
        super().__init__()
        self.resolution = resolution
        layers: list[nn.Module] = [
            nn.Conv3d(in_channels, out_channels, 3, padding=1),
            nn.GroupNorm(_GROUPS, out_channels),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Conv3d(out_channels, out_channels, 3, padding=1),
            nn.GroupNorm(_GROUPS, out_channels),
            Attention(out_channels) if attention else nn.SiLU(),
        ]
        if not attention:
            layers.append(SqueezeExcite3d(out_channels))
        self.voxel_layers = nn.Sequential(*layers)
        self.point_features = SharedMLP(in_channels, [out_channels])

    def forward(self, features: Tensor, coords: Tensor, voxel_map: _VoxelMap | None = None) -> Tensor:
        if voxel_map is None or voxel_map.resolution != self.resolution:
            voxel_map = _VoxelMap(coords, self.resolution)
        grid = voxel_map.voxelize(features)
        for layer in self.voxel_layers:
            if isinstance(layer, nn.Conv3d):
                grid = _conv3d(layer, grid)
            elif isinstance(layer, nn.GroupNorm):
                # PyTorch's CPU GroupNorm on channels-last grids (what oneDNN returns) loses
                # ~1e-4 relative precision; the contiguous kernel does not.
                grid = layer(grid.contiguous())
            else:
                grid = layer(grid)
        return voxel_map.devoxelize(grid) + self.point_features(features)


def _weighted_group_norm(x: Tensor, weights: Tensor, segments: Sequence[tuple[int, int]], norm: nn.GroupNorm) -> Tensor:
    """GroupNorm of ``x [C, K]`` whose columns stand for ``weights`` identical copies each;
    ``segments`` are the column ranges of the batch elements (normalised separately).

    One batch element at a time: the reference for :func:`_segment_group_norm`."""
    c = x.shape[0]
    g = norm.num_groups
    per_group = c // g
    outs = []
    for start, end in segments:
        xs, ws = x[:, start:end], weights[start:end]
        total = ws.sum() * per_group
        mean = (xs @ ws).view(g, per_group).sum(1) / total
        centred = (xs.view(g, per_group, -1) - mean.view(g, 1, 1)).view(c, -1)
        var = ((centred * centred) @ ws).view(g, per_group).sum(1) / total
        scale = (torch.rsqrt(var + norm.eps).view(g, 1) * norm.weight.view(g, per_group)).view(c, 1)
        outs.append(torch.addcmul(norm.bias.view(c, 1), centred, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def _segment_weights(weights: Tensor, segment: Tensor, num_segments: int) -> Tensor:
    """``[K, S]``: column k's weight in the column of its segment, 0 elsewhere, so that
    ``x @ spread`` sums every segment's weighted columns in one matrix product."""
    spread = weights.new_zeros((weights.shape[0], num_segments))
    spread[torch.arange(weights.shape[0], device=weights.device), segment] = weights
    return spread


def _segment_group_norm(x: Tensor, spread: Tensor, segment: Tensor, norm: nn.GroupNorm) -> Tensor:
    """:func:`_weighted_group_norm` for all batch elements at once: ``spread`` from
    :func:`_segment_weights`, ``segment [K]`` the batch element of each column.

    The same sums (the extra terms are exact zeros), in a fixed number of ops instead of
    ~12 per batch element forward and as many again backward: the tiny network is
    dispatch-bound and runs this in every SA MLP layer."""
    c, k = x.shape
    g = norm.num_groups
    per_group = c // g
    total = spread.sum(0) * per_group  # [S]
    mean = (x @ spread).view(g, per_group, -1).sum(1) / total  # [G, S]
    centred = x.view(g, per_group, k) - mean[:, segment].unsqueeze(1)
    var = (centred * centred).view(c, k).matmul(spread).view(g, per_group, -1).sum(1) / total
    rstd = torch.rsqrt(var + norm.eps)[:, segment].unsqueeze(1)  # [G, 1, K]
    return torch.addcmul(norm.bias.view(g, per_group, 1), centred * rstd, norm.weight.view(g, per_group, 1)).view(c, k)


# The per-batch-element loop above, kept selectable so that benchmarks can time both
# in one process (bench/pcdiff_step.py) and tests can hold them equal.
SEGMENT_GROUP_NORM = True


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
        centers, _ = pvops.furthest_point_sample(coords, self.num_centers)
        neighbors = pvops.ball_query(centers, coords, self.radius, self.num_neighbors)
        if self.distinct_slots:
            return self._pool_distinct(features, coords, centers, neighbors), centers
        grouped_xyz = pvops.grouping(coords, neighbors) - centers.unsqueeze(-1)
        grouped = torch.cat([grouped_xyz, pvops.grouping(features, neighbors)], 1)
        return _max_last(self.mlps[0](grouped)), centers

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

        if SEGMENT_GROUP_NORM:
            spread = _segment_weights(copies, bi, b)

            def normed(x: Tensor, norm: nn.GroupNorm) -> Tensor:
                return _segment_group_norm(x, spread, bi, norm)
        else:
            ends = torch.cumsum(torch.bincount(bi, minlength=b), 0).tolist()
            segments = list(zip([0] + ends[:-1], ends))

            def normed(x: Tensor, norm: nn.GroupNorm) -> Tensor:
                return _weighted_group_norm(x, copies, segments, norm)

        mods = list(cast(SharedMLP, self.mlps[0]).layers)
        for i in range(0, len(mods), 3):
            conv, norm = cast(nn.Conv1d, mods[i]), cast(nn.GroupNorm, mods[i + 1])
            assert conv.bias is not None  # SharedMLP's convs have one
            x = torch.addmm(conv.bias.view(-1, 1), conv.weight.view(conv.out_channels, -1), x)
            x = F.silu(normed(x, norm))

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
        indices, weights = pvops.three_nearest_neighbors(points_coords, centers_coords)
        interpolated = pvops.interpolate_from_neighbors(centers_features, indices, weights)
        return interpolated, self.mlp(torch.cat([interpolated, points_features], 1))


def _conv_stage(stage: ConvStage, in_channels: int, attention_first: bool, dropout: float) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    for p in range(stage.num_blocks):
        if stage.voxel_resolution is None:
            blocks.append(SharedMLP(in_channels, [stage.out_channels]))
        else:
            blocks.append(
                PVConv(in_channels, stage.out_channels, stage.voxel_resolution, attention_first and p == 0, dropout)
            )
        in_channels = stage.out_channels
    return blocks


def _run_blocks(blocks: Iterable[nn.Module], features: Tensor, coords: Tensor) -> Tensor:
    voxel_map = None
    for block in blocks:
        if isinstance(block, PVConv):
            if voxel_map is None or voxel_map.resolution != block.resolution:
                voxel_map = _VoxelMap(coords, block.resolution)
            features = block(features, coords, voxel_map)
        else:
            features = block(features)
    return features


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding ``[sin(t f), cos(t f)]``, f = 10000^(-i/(dim/2-1)), float32.

    The frequencies are computed in float64 and rounded to float32, then multiplied by
    ``t`` in float32, as upstream does.
    """
    half = dim // 2
    scale = math.log(10000) / (half - 1) if half > 1 else 0.0
    freqs = torch.exp(torch.arange(half, dtype=torch.float64, device=t.device) * -scale).float()
    args = t[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)
    if dim % 2 == 1:
        emb = F.pad(emb, (0, 1))
    return emb


# =========================================================================== the network


class PVCNN2(nn.Module):
    """PVCNN2 denoiser.

    ``forward(x, t)``: ``x [B, 3 + extra, N]`` (xyz first; in PCDiff the first N - n
    points are the clean conditioning skull and the last n the noisy implant points, but
    the network treats all points alike), ``t [B]`` integer diffusion steps. Returns
    ``[B, num_classes, N]`` for all N points; a diffusion loss uses the last n.
    """

    def __init__(self, config: PVCNN2Config | str | Mapping = "paper"):
        super().__init__()
        cfg = resolve_config(config)
        self.config = cfg
        e = cfg.embed_dim
        in_channels = 3 + cfg.extra_feature_channels

        sa_layers, sa_in_channels = [], []
        for level_index, level in enumerate(cfg.sa_levels):
            sa_in_channels.append(in_channels)
            blocks: list[nn.Module] = []
            if level.conv is not None:
                first_in = in_channels if level_index == 0 else in_channels + e
                blocks += _conv_stage(level.conv, first_in, level.voxel_attention, cfg.dropout)
                sa_features = level.conv.out_channels
            else:
                sa_features = in_channels + e
            blocks.append(SetAbstraction(level.num_centers, level.radius, level.num_neighbors, sa_features, level.mlp))
            sa_layers.append(blocks[0] if len(blocks) == 1 else nn.Sequential(*blocks))
            in_channels = level.mlp[-1]
        self.sa_layers = nn.ModuleList(sa_layers)
        self.global_att = Attention(in_channels, _GROUPS, dims=1) if cfg.global_attention else None

        # The skip features of the finest level are the extra input channels only (xyz are
        # not fed back), as upstream does.
        sa_in_channels[0] = cfg.extra_feature_channels
        fp_layers = []
        for fp_index, fp_level in enumerate(cfg.fp_levels):
            blocks = [FeaturePropagation(in_channels + e + sa_in_channels[-1 - fp_index], fp_level.mlp)]
            in_channels = fp_level.mlp[-1]
            if fp_level.conv is not None:
                blocks += _conv_stage(fp_level.conv, in_channels, False, cfg.dropout)
                in_channels = fp_level.conv.out_channels
            fp_layers.append(blocks[0] if len(blocks) == 1 else nn.Sequential(*blocks))
        self.fp_layers = nn.ModuleList(fp_layers)

        self.classifier = nn.Sequential(
            SharedMLP(in_channels, [128]), nn.Dropout(0.5), nn.Conv1d(128, cfg.num_classes, 1)
        )
        self.embedf = nn.Sequential(nn.Linear(e, e), nn.LeakyReLU(0.1, inplace=True), nn.Linear(e, e))

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        cfg = self.config
        channels = 3 + cfg.extra_feature_channels
        if x.dim() != 3 or x.shape[1] != channels:
            raise DataError(f"PVCNN2 expects x of shape [B, {channels}, N] (xyz first), got {tuple(x.shape)}")
        if x.shape[2] < cfg.min_points:
            raise DataError(
                f"PVCNN2 needs at least {cfg.min_points} points for this config, got {x.shape[2]}; use a smaller preset or more points"
            )
        if t.dim() != 1 or t.shape[0] != x.shape[0]:
            raise DataError(f"PVCNN2 expects t of shape [{x.shape[0]}] (one step per sample), got {tuple(t.shape)}")

        temb = self.embedf(timestep_embedding(t, cfg.embed_dim).to(x.dtype))[:, :, None]  # [B, E, 1]
        coords, features = x[:, :3].contiguous(), x
        coords_list, skip_features = [], []
        for level_index, level in enumerate(self.sa_layers):
            skip_features.append(features)
            coords_list.append(coords)
            if level_index > 0:
                features = torch.cat([features, temb.expand(-1, -1, coords.shape[2])], 1)
            blocks = list(level) if isinstance(level, nn.Sequential) else [level]
            features = _run_blocks(blocks[:-1], features, coords)
            features, coords = blocks[-1](features, coords)
            # Upstream max-pools the grouped embedding per centre; the embedding is the same
            # at every point, so the pooled value is that same vector, exactly.
        skip_features[0] = x[:, 3:]

        if self.global_att is not None:
            features = self.global_att(features)

        temb_points = temb.expand(-1, -1, coords.shape[2])
        for fp_index, level in enumerate(self.fp_layers):
            points_coords = coords_list[-1 - fp_index]
            blocks = list(level) if isinstance(level, nn.Sequential) else [level]
            interpolated, features = blocks[0](
                points_coords, coords, torch.cat([features, temb_points], 1), skip_features[-1 - fp_index]
            )
            # Upstream interpolates the embedding separately with the same neighbours and
            # weights: those are the embedding channels of the joint interpolation.
            temb_points = interpolated[:, -cfg.embed_dim :]
            features = _run_blocks(blocks[1:], features, points_coords)
            coords = points_coords

        return self.classifier(features)

    def extra_repr(self) -> str:
        return f"{sum(p.numel() for p in self.parameters()):,} parameters"
