"""PVCNN2: the point-voxel U-Net that PCDiff (and PVD) use as the denoising network.

The network is assembled here from a :class:`~pointforge.nn.pvcnn_config.PVCNN2Config`,
whose set-abstraction (SA) and feature-propagation (FP) levels are plain data, out of the
blocks of :mod:`pointforge.nn.pvcnn_blocks`. The module tree is laid out so that our
``state_dict`` keys are exactly upstream's keys without the ``model.`` prefix of PCDiff's
checkpoints (``sa_layers.1.0.voxel_layers.6.q.weight`` ...), which makes importing
upstream weights a validated prefix strip (:mod:`pointforge.nn.pvcnn_upstream`).

Upstream behaviour that shapes the weights, kept on purpose:

* In SA levels after the first only the first PVConv block is built, whatever the
  number of blocks in upstream's tuple says (its builder appends a block only while its
  block counter is 0). :meth:`~pointforge.nn.pvcnn_config.PVCNN2Config.from_upstream` records what is built.
* Voxel attention (in place of the second Swish) appears only in the first PVConv of
  SA levels 2, 4, ...; upstream's FP attention never fires (a shadowed variable), so FP
  levels have none. Blocks with voxel attention have no squeeze-excitation.
* The timestep embedding is concatenated to the input of every SA level after the
  first and of every FP level; the network returns an output for *all* N points.

``checkpoint_activations=True`` runs each block (PVConv, the SA levels' pooling, the FP
levels' propagation, the global attention, the classifier) as one non-reentrant
``torch.utils.checkpoint`` segment while autograd records: a training step keeps the
blocks' inputs only and recomputes the rest in the backward pass, from the same random
state (dropout draws the same masks), so outputs and gradients do not change. FPS, ball
query, 3-NN and the voxel maps need no gradients and run outside the segments, once.

``eval_chunk_points``: in evaluation (eval mode, no grad) a batch is run in chunks of
as many samples as fit this many points (at least one) and the outputs concatenated.
PVCNN2 couples no samples (GroupNorm, FPS, ball query and 3-NN are per sample), so the
output is the whole batch's up to float rounding, and a chunk's activations may stay in
the CPU's caches (the paper forward at batch 5 took more than 5x batch 1's time whole).
None (the default) runs whole batches, which is what a GPU wants; on 2 CPU cores two paper
samples per pass measured 1.3x faster at batch 5 and 8 (slower on a crowded machine;
docs/experiments/benchmarks.md), and the PCDiff loader sets that budget for CPU.

The network knows nothing about diffusion beyond taking ``t``, nor about devices or
distributed training.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pointforge.errors import ConfigError, DataError
from pointforge.nn.pvcnn_blocks import (
    Attention,
    FeaturePropagation,
    PVConv,
    SetAbstraction,
    SharedMLP,
    VoxelMap,
    dropout,
    pointwise,
)
from pointforge.nn.pvcnn_config import GROUP_NORM_GROUPS, ConvStage, PVCNN2Config, resolve_config

__all__ = ["PVCNN2", "timestep_embedding"]


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

    def __init__(
        self,
        config: PVCNN2Config | str | Mapping = "paper",
        *,
        checkpoint_activations: bool = False,
        eval_chunk_points: int | None = None,
    ):
        super().__init__()
        cfg = resolve_config(config)
        self.config = cfg
        # Not part of the config: these change what a pass keeps or how it is split, not the
        # function or the weights.
        self.checkpoint_activations = checkpoint_activations
        if eval_chunk_points is not None and (isinstance(eval_chunk_points, bool) or int(eval_chunk_points) < 1):
            raise ConfigError(
                f"PVCNN2: eval_chunk_points must be a positive number of points or None, got {eval_chunk_points!r}"
            )
        self.eval_chunk_points = eval_chunk_points
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
        self.global_att = Attention(in_channels, GROUP_NORM_GROUPS, dims=1) if cfg.global_attention else None

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
        # The embedding of the whole batch: a matrix product's rounding depends on its row count.
        temb = self.embedf(timestep_embedding(t, cfg.embed_dim).to(x.dtype))[:, :, None]  # [B, E, 1]
        per_chunk = self._samples_per_chunk(x)
        if per_chunk < x.shape[0]:
            chunks = range(0, x.shape[0], per_chunk)
            return torch.cat([self._forward(x[i : i + per_chunk], temb[i : i + per_chunk]) for i in chunks])
        return self._forward(x, temb)

    def _samples_per_chunk(self, x: Tensor) -> int:
        """Samples per pass: the whole batch, or in evaluation as many as ``eval_chunk_points`` allows."""
        budget = self.eval_chunk_points
        if budget is None or self.training or torch.is_grad_enabled():
            return x.shape[0]
        return max(1, budget // x.shape[2])

    def _forward(self, x: Tensor, temb: Tensor) -> Tensor:
        """One pass over ``x`` with its samples' timestep embeddings ``temb [B, E, 1]``."""
        cfg = self.config
        coords, features = x[:, :3].contiguous(), x
        coords_list, skip_features = [], []
        voxel_maps: list[dict[int, VoxelMap]] = []  # per entry of coords_list
        for level_index, level in enumerate(self.sa_layers):
            skip_features.append(features)
            coords_list.append(coords)
            voxel_maps.append({})
            if level_index > 0:
                features = torch.cat([features, temb.expand(-1, -1, coords.shape[2])], 1)
            blocks = list(level) if isinstance(level, nn.Sequential) else [level]
            features = self._run_blocks(blocks[:-1], features, coords, voxel_maps[-1])
            abstraction = cast(SetAbstraction, blocks[-1])
            centers, neighbors = abstraction.neighborhoods(coords)
            features, coords = self._segment(abstraction.pool, features, coords, centers, neighbors), centers
            # Upstream max-pools the grouped embedding per centre; the embedding is the same
            # at every point, so the pooled value is that same vector, exactly.
        skip_features[0] = x[:, 3:]

        if self.global_att is not None:
            features = self._segment(self.global_att, features)

        temb_points = temb.expand(-1, -1, coords.shape[2])
        for fp_index, level in enumerate(self.fp_layers):
            points_coords = coords_list[-1 - fp_index]
            blocks = list(level) if isinstance(level, nn.Sequential) else [level]
            propagation = cast(FeaturePropagation, blocks[0])
            indices, weights = propagation.nearest(points_coords, coords)
            interpolated, features = self._segment(
                propagation.propagate,
                indices,
                weights,
                torch.cat([features, temb_points], 1),
                skip_features[-1 - fp_index],
            )
            # Upstream interpolates the embedding separately with the same neighbours and
            # weights: those are the embedding channels of the joint interpolation.
            temb_points = interpolated[:, -cfg.embed_dim :]
            features = self._run_blocks(blocks[1:], features, points_coords, voxel_maps[-1 - fp_index])
            coords = points_coords

        return self._segment(self._classify, features)

    def _classify(self, features: Tensor) -> Tensor:
        mlp, drop, out = self.classifier
        return pointwise(out, dropout(cast(nn.Dropout, drop), mlp(features)))

    def _segment(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; with ``checkpoint_activations`` while autograd records, the
        activations inside ``fn`` are dropped after the forward pass and recomputed in the
        backward pass, from the same random state (dropout draws the same masks)."""
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _run_blocks(
        self, blocks: Iterable[nn.Module], features: Tensor, coords: Tensor, maps: dict[int, VoxelMap]
    ) -> Tensor:
        """Run ``blocks`` on points at ``coords``, each one checkpoint segment; ``maps`` holds
        the voxel maps of these coordinates by resolution, shared by the blocks and by the SA
        and FP levels on the same points (the tiny preset builds 4 maps per pass instead of 7),
        and built outside the segments (they need no gradients, so nothing recomputes them)."""
        for block in blocks:
            if isinstance(block, PVConv):
                if block.resolution not in maps:
                    maps[block.resolution] = VoxelMap(coords, block.resolution)
                features = self._segment(block, features, coords, maps[block.resolution])
            else:
                features = self._segment(block, features)
        return features

    def extra_repr(self) -> str:
        checkpointed = ", activation checkpointing" if self.checkpoint_activations else ""
        chunks = f", evaluation in chunks of {self.eval_chunk_points:,} points" if self.eval_chunk_points else ""
        return f"{sum(p.numel() for p in self.parameters()):,} parameters{checkpointed}{chunks}"
