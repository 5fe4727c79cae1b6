"""How much memory a PVCNN2 training step (or a sampling pass) holds, from its config alone.

A training step keeps, per sample, the tensors its backward pass needs. They come
in three kinds, each counted here from the :class:`~pointforge.nn.pvcnn_config.PVCNN2Config`:

* **point** elements: channels × points of every block that runs on points (the
  PVConv point branch and its devoxelised sum, the FP levels' interpolation and
  MLPs, the classifier), at the point count of its level;
* **voxel** elements: channels × resolution³ of every PVConv's grid (a voxel
  attention counts once more: its queries, keys and values are grids too);
* **pair** elements: the set-abstraction MLP's channels × the distinct
  (centre, point) pairs it runs on (see :class:`~pointforge.nn.pvcnn_blocks.SetAbstraction`),
  plus the ball query's index slots (centres × neighbour slots).

The number of distinct pairs depends on the data: a ball holds as many points as
fall inside it. ``hits_per_ball`` says how many; :data:`SURFACE_HITS_PER_BALL` is
what skull surfaces at the presets' densities give (measured by ``bench/pvcnn_memory.py``).

How many bytes each element costs (how many tensors of that size autograd
keeps) is not guessed: :data:`BYTES_PER_ELEMENT` is fitted by
``bench/pvcnn_memory.py`` to the peak memory of real training steps (forward,
backward, Adam step) on the CPU, and the table there (docs/experiments/benchmarks.md,
"Training memory") shows how close the model comes.

With activation checkpointing (:class:`~pointforge.nn.pvcnn.PVCNN2`'s
``checkpoint_activations``) a step keeps only its blocks' inputs and recomputes
the rest block by block in the backward pass; the same counts then cost other
bytes per element, :data:`BYTES_PER_ELEMENT_CHECKPOINTED`, fitted the same way
(``bench/pvcnn_memory.py --checkpoint``).

A sampling pass (no gradients) is bounded by the same count at the same bytes
per element, :func:`sampling_bytes`: it keeps no more than a training step does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pointforge.nn.pvcnn_config import PVCNN2Config, resolve_config

__all__ = [
    "BYTES_PER_ELEMENT",
    "BYTES_PER_ELEMENT_CHECKPOINTED",
    "SURFACE_HITS_PER_BALL",
    "ActivationCounts",
    "activation_counts",
    "training_step_bytes",
    "sampling_bytes",
]

# Mean distinct points per ball on skull-like surfaces (capped by a level's neighbour
# slots): bench/pvcnn_memory.py measures 4.8-10.0 at the paper preset's four levels and
# 8.5-15.2 at the small preset's; 16 errs high for both.
SURFACE_HITS_PER_BALL = 16

# Bytes per counted element of each kind, fitted by bench/pvcnn_memory.py (float32 training
# steps on the CPU; docs/experiments/benchmarks.md, "Training memory").
# The index slots fit to 0: they are freed before the step's peak.
BYTES_PER_ELEMENT = {"point": 4.7, "voxel": 33.2, "pair": 3.2, "slot": 0.0}

# The same with activation checkpointing on (bench/pvcnn_memory.py --checkpoint), fitted never
# to fall below a measured per-sample slope (least squares left tiny's half below); pairs and
# slots fit to 0. It errs high by up to 2.6x per sample on the paper preset (docs/experiments/benchmarks.md,
# "Activation checkpointing").
BYTES_PER_ELEMENT_CHECKPOINTED = {"point": 2.3, "voxel": 24.0, "pair": 0.0, "slot": 0.0}

# Adam keeps two moments and the step needs the gradients: three copies of the weights
# beyond the weights themselves.
_ADAM_COPIES = 3


@dataclass(frozen=True)
class ActivationCounts:
    """Elements of each kind one sample's training step keeps for its backward pass."""

    point: int
    voxel: int
    pair: int
    slot: int

    def bytes(self, per_element: dict[str, float] | None = None) -> float:
        w = per_element or BYTES_PER_ELEMENT
        return w["point"] * self.point + w["voxel"] * self.voxel + w["pair"] * self.pair + w["slot"] * self.slot


def activation_counts(
    config: PVCNN2Config | str, n_points: int, *, hits_per_ball: float | Sequence[float] = SURFACE_HITS_PER_BALL
) -> ActivationCounts:
    """One sample's point, voxel, pair and slot elements for ``n_points`` input points
    (``hits_per_ball``: one mean for every SA level, or one per level)."""
    cfg = resolve_config(config)
    hits_per_level = (
        [float(hits_per_ball)] * len(cfg.sa_levels) if isinstance(hits_per_ball, (int, float)) else list(hits_per_ball)
    )
    e = cfg.embed_dim
    point = voxel = pair = slot = 0
    points, channels = n_points, 3 + cfg.extra_feature_channels
    level_points, level_channels = [], []
    for index, level in enumerate(cfg.sa_levels):
        level_points.append(points)
        level_channels.append(channels)
        if index > 0:
            channels += e
        if level.conv is not None:
            p, v = _stage(level.conv.out_channels, level.conv.num_blocks, level.conv.voxel_resolution, points)
            point, voxel = point + p, voxel + v
            if level.voxel_attention and level.conv.voxel_resolution is not None:
                voxel += 3 * level.conv.out_channels * level.conv.voxel_resolution**3
            channels = level.conv.out_channels
        hits = min(float(level.num_neighbors), hits_per_level[index])
        pairs = level.num_centers * hits
        pair += int(pairs * (3 + channels + sum(3 * c for c in level.mlp)))
        slot += level.num_centers * level.num_neighbors
        points, channels = level.num_centers, level.mlp[-1]
    point += 4 * channels * points if cfg.global_attention else 0
    for index, fp in enumerate(cfg.fp_levels):
        target = level_points[-1 - index]
        skip = cfg.extra_feature_channels if index == len(cfg.fp_levels) - 1 else level_channels[-1 - index]
        point += target * (channels + e + skip + 3 * sum(fp.mlp))
        channels = fp.mlp[-1]
        if fp.conv is not None:
            p, v = _stage(fp.conv.out_channels, fp.conv.num_blocks, fp.conv.voxel_resolution, target)
            point, voxel = point + p, voxel + v
            channels = fp.conv.out_channels
    point += n_points * (3 * 128 + 128 + cfg.num_classes)  # the classifier head
    return ActivationCounts(point=point, voxel=voxel, pair=pair, slot=slot)


def _stage(out_channels: int, blocks: int, resolution: int | None, points: int) -> tuple[int, int]:
    """(point, voxel) elements of a conv stage: per block a point MLP and, for PVConv, a grid."""
    point = blocks * out_channels * points * (3 if resolution is None else 5)
    voxel = 0 if resolution is None else blocks * out_channels * resolution**3
    return point, voxel


def training_step_bytes(
    config: PVCNN2Config | str,
    n_points: int,
    micro_batch: int,
    *,
    parameters: int,
    hits_per_ball: float | Sequence[float] = SURFACE_HITS_PER_BALL,
    checkpointed: bool = False,
) -> int:
    """Bytes a float32 training step on ``micro_batch`` samples needs beyond the weights:
    the activations kept for backward (``checkpointed``: with activation checkpointing)
    plus gradients and Adam's two moments."""
    per_element = BYTES_PER_ELEMENT_CHECKPOINTED if checkpointed else BYTES_PER_ELEMENT
    per_sample = activation_counts(config, n_points, hits_per_ball=hits_per_ball).bytes(per_element)
    return int(micro_batch * per_sample + _ADAM_COPIES * 4 * parameters)


def sampling_bytes(
    config: PVCNN2Config | str,
    n_points: int,
    batch: int,
    *,
    hits_per_ball: float | Sequence[float] = SURFACE_HITS_PER_BALL,
) -> int:
    """Bytes a float32 forward pass on ``batch`` clouds of ``n_points`` needs at most (sampling, no gradients):
    what a training step keeps of its activations, the fitted :data:`BYTES_PER_ELEMENT`; no optimizer state."""
    return int(batch * activation_counts(config, n_points, hits_per_ball=hits_per_ball).bytes(BYTES_PER_ELEMENT))
