"""Shape-as-Points style voxelizer: unoriented points -> oriented points -> indicator grid.

The network (as PCDiff's voxelization stage configures Shape-as-Points):

* encoder: a local-pool PointNet. Each point's local coordinate inside its
  feature-grid cell goes through ResNet blocks; between blocks the point
  features are max-pooled (or mean-pooled) over the points sharing a cell and
  concatenated back. The final per-point features are averaged into a 3-D
  feature grid, refined by a 3-D U-Net (GroupNorm-conv-ReLU double convolutions,
  max-pool down, nearest-neighbour up, skip concatenation).
* decoders: two small ResNet MLPs fed the trilinearly sampled grid features.
  One predicts ``num_offset`` offsets per input point (times ``offset_scale``),
  giving ``num_offset * N`` points; the other predicts a normal at each of them.
  With ``max_offset`` set, each offset component is bounded smoothly,
  ``max_offset * tanh(offset / max_offset)`` (not upstream; see the config).
  The points are then clamped to ``[0, clamp_max]`` (0.99 upstream), which
  keeps them inside DPSR's domain.
* DPSR (:mod:`pointforge.nn.dpsr`) turns the oriented points into the indicator
  grid: about +0.5 outside, -0.5 inside.

Layout facts kept from upstream, so that its trained weights could be imported:
module and parameter names follow its state_dict (``encoder.fc_pos``,
``encoder.unet3d.encoders.0.basic_module.SingleConv1.conv`` ...), the feature
grid is indexed ``x + R * (y + R * z)`` (tensor axes z, y, x, as
``grid_sample`` expects), features are sampled with ``align_corners=True`` and
border padding, and the second linear layer of every ResNet block starts at
zero (each block starts as the identity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pointforge.errors import ConfigError, DataError
from pointforge.nn.dpsr import DPSR, psr_tanh_mse_loss
from pointforge.nn.dpsr_grid import check_oriented_points, normalize_resolution
from pointforge.nn.presets import preset

__all__ = [
    "VoxelizerConfig",
    "VoxelizerNet",
    "VoxelizerOutput",
    "PRESETS",
    "indicator_target",
    "psr_tanh_mse_loss",
]


def _groups(channels: int, num_groups: int) -> int:
    # Fewer channels than groups falls back to one group, as upstream does.
    return num_groups if channels >= num_groups else 1


def _unet_channels(cfg: VoxelizerConfig) -> list[int]:
    return [cfg.unet_f_maps * 2**k for k in range(cfg.unet_levels)]


def _unet_groupnorm_channels(cfg: VoxelizerConfig):
    """(where, channels) of every GroupNorm in the U-Net, each normalising a conv's input."""
    maps = _unet_channels(cfg)
    previous = cfg.c_dim
    for level, out in enumerate(maps):
        first = max(out // 2, previous)
        yield f"encoder {level} conv 1", previous
        yield f"encoder {level} conv 2", first
        previous = out
    for level in range(len(maps) - 1, 0, -1):
        yield f"decoder {level} conv 1", maps[level] + maps[level - 1]
        yield f"decoder {level} conv 2", maps[level - 1]


@dataclass(frozen=True)
class VoxelizerConfig:
    """Every size and switch of the voxelizer; the presets below are instances."""

    dpsr_res: int | tuple[int, int, int] = 512
    dpsr_sigma: float = 2.0
    dpsr_memory_limit: float | None = None  # bytes; None: what the device has free
    grid_resolution: int = 32  # encoder feature grid, per axis
    hidden_dim: int = 32  # encoder PointNet width
    c_dim: int = 32  # feature channels
    encoder_blocks: int = 5
    pooling: str = "max"  # local pooling between encoder blocks: "max" or "mean"
    local_coord: bool = True  # feed points as coordinates inside their feature cell
    unet_levels: int = 3
    unet_f_maps: int = 32  # feature maps of the first U-Net level, doubled per level
    unet_num_groups: int = 8
    decoder_hidden: int = 32
    decoder_blocks: int = 5
    num_offset: int = 7
    offset_scale: float = 0.001
    # A smooth bound on each offset component, in the unit cube; None: unbounded, as upstream. Unbounded, a
    # voxelizer can fling its points onto the clamp's faces, where the clamp passes no gradient back: every
    # collapsed run measured had done so (docs/experiments/realskulls.md).
    max_offset: float | None = None
    normal_normalize: bool = False
    clamp_max: float = 0.99

    def __post_init__(self):
        try:
            object.__setattr__(self, "dpsr_res", normalize_resolution(self.dpsr_res))
        except ConfigError as err:
            raise ConfigError(f"voxelizer config dpsr_res: {err}") from None
        positive = (
            "grid_resolution",
            "hidden_dim",
            "c_dim",
            "encoder_blocks",
            "unet_levels",
            "unet_f_maps",
            "unet_num_groups",
            "decoder_hidden",
            "decoder_blocks",
            "num_offset",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"voxelizer config {name} must be a positive integer, got {value!r}")
        for name in ("dpsr_sigma", "offset_scale", "clamp_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"voxelizer config {name} must be a finite number, got {value!r}")
        limit = self.dpsr_memory_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
            raise ConfigError(
                f"voxelizer config dpsr_memory_limit must be a positive number of bytes or None, got {limit!r}"
            )
        if self.pooling not in ("max", "mean"):
            raise ConfigError(f"voxelizer config pooling must be 'max' or 'mean', got {self.pooling!r}")
        if self.grid_resolution < 2 ** (self.unet_levels - 1):
            raise ConfigError(
                f"voxelizer config grid_resolution {self.grid_resolution} is too small for "
                f"{self.unet_levels} U-Net levels; use at least {2 ** (self.unet_levels - 1)}"
            )
        if not (0.0 < self.clamp_max < 1.0):
            raise ConfigError(f"voxelizer config clamp_max must lie in (0, 1), got {self.clamp_max}")
        if self.offset_scale <= 0:
            raise ConfigError(f"voxelizer config offset_scale must be positive, got {self.offset_scale}")
        bound = self.max_offset
        if bound is not None and (
            isinstance(bound, bool)
            or not isinstance(bound, (int, float))
            or not 0 < bound < 1
            or not math.isfinite(bound)
        ):
            raise ConfigError(
                f"voxelizer config max_offset must be a number in (0, 1) (a fraction of the unit cube) or None, got {bound!r}"
            )
        if self.dpsr_sigma < 0:
            raise ConfigError(f"voxelizer config dpsr_sigma must be >= 0, got {self.dpsr_sigma}")
        for where, channels in _unet_groupnorm_channels(self):
            groups = _groups(channels, self.unet_num_groups)
            if channels % groups:
                raise ConfigError(
                    f"voxelizer config: U-Net {where} has {channels} channels, not divisible into "
                    f"{groups} GroupNorm groups; change unet_f_maps, c_dim or unet_num_groups"
                )

    @classmethod
    def preset(cls, name: str, **overrides) -> VoxelizerConfig:
        """A named preset (``tiny``, ``small``, ``paper``), optionally with fields overridden."""
        return preset("voxelizer", PRESETS, name, **overrides)


PRESETS: dict[str, VoxelizerConfig] = {
    # CI and unit tests: seconds on a CPU. 32^3 DPSR, 8^3 features, 2-level U-Net.
    "tiny": VoxelizerConfig(
        dpsr_res=32,
        grid_resolution=8,
        hidden_dim=16,
        c_dim=16,
        encoder_blocks=2,
        unet_levels=2,
        unet_f_maps=8,
        decoder_hidden=16,
        decoder_blocks=2,
    ),
    # CPU training in minutes: 64^3 DPSR, 16^3 features, 3-level U-Net with 16 maps.
    "small": VoxelizerConfig(
        dpsr_res=64,
        grid_resolution=16,
        hidden_dim=32,
        c_dim=32,
        encoder_blocks=3,
        unet_levels=3,
        unet_f_maps=16,
        decoder_hidden=32,
        decoder_blocks=3,
    ),
    # PCDiff's voxelization network (Friedrich et al., MICCAI 2023): 512^3 DPSR with sigma 2,
    # 32^3 features, 3-level U-Net with 32 maps, 7 offsets of scale 0.001.
    "paper": VoxelizerConfig(),
}


# ----------------------------------------------------------------------------
# Building blocks.


class ResnetBlockFC(nn.Module):
    """x + fc_1(relu(fc_0(relu(x)))), with a linear shortcut when the width changes."""

    def __init__(self, size_in: int, size_out: int | None = None):
        super().__init__()
        size_out = size_in if size_out is None else size_out
        hidden = min(size_in, size_out)
        self.fc_0 = nn.Linear(size_in, hidden)
        self.fc_1 = nn.Linear(hidden, size_out)
        self.shortcut = None if size_in == size_out else nn.Linear(size_in, size_out, bias=False)
        nn.init.zeros_(self.fc_1.weight)

    def forward(self, x: Tensor) -> Tensor:
        dx = self.fc_1(F.relu(self.fc_0(F.relu(x))))
        return (x if self.shortcut is None else self.shortcut(x)) + dx


class _SingleConv(nn.Sequential):
    """GroupNorm -> 3x3x3 conv (no bias, the norm precedes it) -> ReLU."""

    def __init__(self, cin: int, cout: int, num_groups: int):
        super().__init__()
        self.add_module("groupnorm", nn.GroupNorm(_groups(cin, num_groups), cin))
        self.add_module("conv", nn.Conv3d(cin, cout, 3, padding=1, bias=False))
        self.add_module("ReLU", nn.ReLU(inplace=True))


class _DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cmid: int, cout: int, num_groups: int):
        super().__init__()
        self.add_module("SingleConv1", _SingleConv(cin, cmid, num_groups))
        self.add_module("SingleConv2", _SingleConv(cmid, cout, num_groups))


class _UNetEncoder(nn.Module):
    def __init__(self, cin: int, cout: int, num_groups: int, pool: bool):
        super().__init__()
        self.pooling = nn.MaxPool3d(2) if pool else None
        # The encoder's first conv widens to half the output, but never narrows.
        self.basic_module = _DoubleConv(cin, max(cout // 2, cin), cout, num_groups)

    def forward(self, x: Tensor) -> Tensor:
        if self.pooling is not None:
            x = self.pooling(x)
        return self.basic_module(x)


class _UNetDecoder(nn.Module):
    def __init__(self, cin: int, cout: int, num_groups: int):
        super().__init__()
        self.basic_module = _DoubleConv(cin, cout, cout, num_groups)

    def forward(self, skip: Tensor, x: Tensor) -> Tensor:
        x = F.interpolate(x, size=skip.shape[2:], mode="nearest")
        return self.basic_module(torch.cat((skip, x), 1))


class UNet3D(nn.Module):
    """3-D U-Net over the feature grid: ``levels`` resolutions, ``f_maps * 2^k`` maps at level k."""

    def __init__(self, channels: int, f_maps: int, levels: int, num_groups: int):
        super().__init__()
        maps = [f_maps * 2**k for k in range(levels)]
        self.encoders = nn.ModuleList(
            _UNetEncoder(channels if k == 0 else maps[k - 1], maps[k], num_groups, pool=k > 0) for k in range(levels)
        )
        self.decoders = nn.ModuleList(
            _UNetDecoder(maps[k] + maps[k - 1], maps[k - 1], num_groups) for k in range(levels - 1, 0, -1)
        )
        self.final_conv = nn.Conv3d(maps[0], channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
        for decoder, skip in zip(self.decoders, reversed(skips[:-1])):
            x = decoder(skip, x)
        return self.final_conv(x)


def _cell_index(points: Tensor, resolution: int) -> Tensor:
    """(B, N) flat index x + R * (y + R * z) of each point's feature-grid cell."""
    cell = (points * resolution).long().clamp_(0, resolution - 1)
    return cell[..., 0] + resolution * (cell[..., 1] + resolution * cell[..., 2])


def _local_coordinates(points: Tensor, resolution: int) -> Tensor:
    """Position inside the point's feature-grid cell, in [0, 1)."""
    unit = 1.0 / resolution
    return torch.remainder(points, unit) / unit


def _sample_grid(features: Tensor, points: Tensor) -> Tensor:
    """Trilinear features (B, N, C) at points, clamped into the unit cube (grid axes z, y, x)."""
    p = points.clamp(0.0, 1.0 - 1e-5)
    grid = (2.0 * p - 1.0)[:, :, None, None, :]
    sampled = F.grid_sample(features, grid, mode="bilinear", padding_mode="border", align_corners=True)
    return sampled[:, :, :, 0, 0].transpose(1, 2)


class LocalPoolPointnet(nn.Module):
    """Per-point ResNet MLP with local pooling in a grid, averaged into a U-Net-refined feature grid."""

    def __init__(self, cfg: VoxelizerConfig):
        super().__init__()
        h = cfg.hidden_dim
        self.resolution = cfg.grid_resolution
        self.c_dim = cfg.c_dim
        self.local_coord = cfg.local_coord
        self.pooling = cfg.pooling
        self.fc_pos = nn.Linear(3, 2 * h)
        self.blocks = nn.ModuleList(ResnetBlockFC(2 * h, h) for _ in range(cfg.encoder_blocks))
        self.fc_c = nn.Linear(h, cfg.c_dim)
        self.unet3d = UNet3D(cfg.c_dim, cfg.unet_f_maps, cfg.unet_levels, cfg.unet_num_groups)

    def _pool(self, features: Tensor, index: Tensor) -> Tensor:
        """Pool (B, N, C) point features over each cell and hand each point its cell's value."""
        b, n, c = features.shape
        expanded = index[:, None, :].expand(b, c, n)
        reduce = "amax" if self.pooling == "max" else "mean"
        cells = features.new_zeros(b, c, self.resolution**3)
        cells = cells.scatter_reduce(2, expanded, features.transpose(1, 2), reduce=reduce, include_self=False)
        return cells.gather(2, expanded).transpose(1, 2)

    def forward(self, points: Tensor) -> Tensor:
        index = _cell_index(points, self.resolution)
        coords = _local_coordinates(points, self.resolution) if self.local_coord else points
        net = self.blocks[0](self.fc_pos(coords))
        for block in self.blocks[1:]:
            net = block(torch.cat((net, self._pool(net, index)), 2))
        c = self.fc_c(net)  # (B, N, C)

        b, n, _ = c.shape
        grid = c.new_zeros(b, self.c_dim, self.resolution**3)
        grid = grid.scatter_reduce(
            2, index[:, None, :].expand(b, self.c_dim, n), c.transpose(1, 2), reduce="mean", include_self=False
        )
        r = self.resolution
        return self.unet3d(grid.view(b, self.c_dim, r, r, r))


class LocalDecoder(nn.Module):
    """ResNet MLP on a point's coordinates, with the sampled grid feature added before every block."""

    def __init__(self, c_dim: int, hidden: int, blocks: int, out_dim: int, local_resolution: int | None):
        super().__init__()
        self.local_resolution = local_resolution
        self.fc_p = nn.Linear(3, hidden)
        self.fc_c = nn.ModuleList(nn.Linear(c_dim, hidden) for _ in range(blocks))
        self.blocks = nn.ModuleList(ResnetBlockFC(hidden) for _ in range(blocks))
        self.fc_out = nn.Linear(hidden, out_dim)

    def forward(self, points: Tensor, features: Tensor) -> Tensor:
        c = _sample_grid(features, points)
        coords = points if self.local_resolution is None else _local_coordinates(points, self.local_resolution)
        net = self.fc_p(coords)
        for fc_c, block in zip(self.fc_c, self.blocks):
            net = block(net + fc_c(c))
        return self.fc_out(F.relu(net))


class VoxelizerOutput(NamedTuple):
    points: Tensor  # (B, num_offset * N, 3) in [0, clamp_max]
    normals: Tensor  # (B, num_offset * N, 3)
    psr: Tensor | None  # (B, *dpsr_res) indicator grid, inside negative; None if not computed


class VoxelizerNet(nn.Module):
    """Unoriented points (B, N, 3) in [0, 1) -> oriented points -> DPSR indicator grid.

    The frame (two buffers, saved with the weights, unused by the network): the
    unit cube the training volumes gave, ``frame_cube_mm`` (its side in
    millimetres) and ``frame_centre`` (where a skull's bounding-box centre sat
    in it, unit coordinates), which :meth:`set_frame` stores and :meth:`frame`
    returns; a cube of 0 is no frame (a model built without data). Checkpoints
    written before the frame existed lack both: they are ``optional_state``,
    and such a model keeps no frame.
    """

    optional_state = ("frame_cube_mm", "frame_centre")
    frame_cube_mm: Tensor
    frame_centre: Tensor

    def __init__(self, cfg: VoxelizerConfig | str = "paper"):
        super().__init__()
        if isinstance(cfg, str):
            cfg = VoxelizerConfig.preset(cfg)
        if not isinstance(cfg, VoxelizerConfig):
            raise ConfigError(f"VoxelizerNet needs a VoxelizerConfig or a preset name, got {type(cfg).__name__}")
        self.cfg = cfg
        local = cfg.grid_resolution if cfg.local_coord else None
        self.encoder = LocalPoolPointnet(cfg)
        self.decoder_offset = LocalDecoder(cfg.c_dim, cfg.decoder_hidden, cfg.decoder_blocks, 3 * cfg.num_offset, local)
        self.decoder_normal = LocalDecoder(cfg.c_dim, cfg.decoder_hidden, cfg.decoder_blocks, 3, None)
        self.dpsr = DPSR(cfg.dpsr_res, cfg.dpsr_sigma, memory_limit=cfg.dpsr_memory_limit)
        self.register_buffer("frame_cube_mm", torch.zeros((), dtype=torch.float64))
        self.register_buffer("frame_centre", torch.zeros(3, dtype=torch.float64))

    def set_frame(self, cube_mm: float, centre: tuple[float, float, float]) -> None:
        """Store the training cube's side (mm, > 0) and the skulls' centre in it (class docs)."""
        if not (math.isfinite(cube_mm) and cube_mm > 0) or len(centre) != 3:
            raise ConfigError(f"a voxelizer frame needs a positive cube side and a 3-D centre, got {cube_mm}, {centre}")
        self.frame_cube_mm.fill_(float(cube_mm))
        self.frame_centre.copy_(torch.tensor([float(c) for c in centre], dtype=torch.float64))

    def frame(self) -> tuple[float, tuple[float, float, float]] | None:
        """(cube side in mm, centre) as :meth:`set_frame` stored them; None: no frame."""
        cube_mm = float(self.frame_cube_mm)
        if cube_mm <= 0:
            return None
        c = [float(x) for x in self.frame_centre.tolist()]
        return cube_mm, (c[0], c[1], c[2])

    def oriented_points(self, points: Tensor) -> tuple[Tensor, Tensor]:
        """The ``num_offset * N`` displaced points (B, K*N, 3) and their normals (B, K*N, 3)."""
        check_oriented_points(points)
        if points.dtype != self.fc_dtype:
            raise DataError(f"voxelizer input must be {self.fc_dtype} like the network, got {points.dtype}")
        b, n, _ = points.shape
        k = self.cfg.num_offset
        features = self.encoder(points)
        offsets = self.cfg.offset_scale * self.decoder_offset(points, features).reshape(b, n * k, 3)
        bound = self.cfg.max_offset
        if bound is not None:
            offsets = bound * torch.tanh(offsets / bound)
        # Each input point's k copies are consecutive, matching the offsets' layout.
        moved = points[:, :, None, :].expand(b, n, k, 3).reshape(b, n * k, 3) + offsets
        normals = self.decoder_normal(moved, features)
        moved = moved.clamp(0.0, self.cfg.clamp_max)
        if self.cfg.normal_normalize:
            normals = normals / (normals.norm(dim=-1, keepdim=True) + 1e-8)
        return moved, normals

    def forward(self, points: Tensor, with_psr: bool = True) -> VoxelizerOutput:
        moved, normals = self.oriented_points(points)
        psr = self.dpsr(moved, normals) if with_psr else None
        return VoxelizerOutput(moved, normals, psr)

    @property
    def fc_dtype(self) -> torch.dtype:
        return self.encoder.fc_pos.weight.dtype


def indicator_target(inside: Tensor) -> Tensor:
    """Training target from a boolean inside mask on the DPSR grid: +0.5 outside, -0.5 inside."""
    if inside.dtype != torch.bool:
        raise DataError(f"indicator_target expects a boolean inside mask, got {inside.dtype}")
    return 0.5 - inside.to(torch.float32)
