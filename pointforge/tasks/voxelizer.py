"""The ``voxelizer`` task: completed skull points → the complete skull's indicator grid.

What the engine gets from this task:

* model: :class:`~pointforge.nn.voxelizer.VoxelizerNet` from a preset
  (``tiny``/``small``/``paper``) with optional field overrides (``task.model``).
* data: :class:`~pointforge.data.skulls.datasets.VoxelizationDataset` over a prepared
  dataset (``task.data_root``): defective-skull plus implant surface points
  scaled to [0, 1), and the complete skull's inside grid at the DPSR
  resolution. When ``data_root`` does not exist and ``task.synthetic`` is set,
  synthetic skulls are made and prepared there first
  (:func:`pointforge.data.cache.ensure_synthetic_prepared`), once, safely when
  all ranks start at the same time.
* the frame: the model carries, as buffers saved with its weights, the unit
  cube its training split's volumes gave in millimetres and where their skulls'
  centres sat in it (:func:`~pointforge.data.skulls.grids.training_frame`,
  from the prepared metadata when the model is built for training), so that
  generate can show it a skull from any scanner at its training scale without
  the training data. Training does not use it.
* augmentation (training split only): upstream's ±10° rotation (p 0.8),
  mirror (p 0.5) and implant-point noise (p 0.25), from the dataset's
  (seed, epoch, index) generator. The dataset moves the points; the target
  grid is resampled to match in :meth:`VoxelizerTask.training_step`, on the
  training device, where 512³ costs milliseconds rather than CPU seconds.
* loss: MSE between tanh(prediction) and tanh(target), target +0.5 outside and
  −0.5 inside.
* evaluation (every rank on its shard; per-sample means): ``val_loss``,
  ``val_l2`` (mean squared difference of the predicted and target grids),
  ``val_iou`` (inside = field ≤ 0) and ``val_fill`` (the predicted solid's
  volume over the true one's: near 0 an empty solid, above 1 a swollen one);
  ``best.pt`` is chosen by ``val_iou`` (max). A validation IoU under
  :data:`COLLAPSED_IOU` is logged as a collapse with what to do
  (:meth:`VoxelizerTask.health`): one seed of three of the ``skullfix`` preset
  stayed at an empty solid from its first evaluation to its last.

The epoch reaches the dataset through :meth:`VoxelizerTask.batch_sampler`,
which the engine calls before every epoch: the engine itself does not call
``set_epoch`` (yet), and without it every epoch would repeat epoch 0's
augmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from pointforge.data.cache import SyntheticSection, ensure_synthetic_prepared
from pointforge.data.skulls.datasets import VoxelAugmentation, VoxelizationDataset
from pointforge.data.skulls.grids import training_frame, transform_inside
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import ConfigError
from pointforge.nn.dpsr import dpsr_memory_bytes
from pointforge.nn.voxelizer import VoxelizerConfig, VoxelizerNet, indicator_target, psr_tanh_mse_loss
from pointforge.train.data import global_batches
from pointforge.train.logs import get_logger
from pointforge.train.task import EvalContext, StepContext, Task

PRESET_NAMES = ("tiny", "small", "paper")


@dataclass
class VoxelizerTaskConfig:
    """The ``task:`` section of a voxelizer config."""

    data_root: str = "data/voxelizer/synthetic"
    synthetic: SyntheticSection | None = None  # made in data_root if that does not exist
    preset: Literal["tiny", "small", "paper"] = "tiny"
    model: dict[str, Any] = field(default_factory=dict)  # VoxelizerConfig fields overriding the preset
    n_points: int = 30_720  # input points per example (upstream: 27,648 skull + 3,072 implant)
    implant_fraction: float = 0.1
    train_split: str = "train"
    val_split: str = "val"  # "" or null: no validation
    repeats: int = 1  # augmented copies of each case per epoch (upstream: 10)
    data_seed: int = 0  # per-item randomness: (data_seed, epoch, index)
    augment: bool = True
    rotate_degrees: float = 10.0
    rotate_p: float = 0.8
    flip_p: float = 0.5
    flip_axis: int = 0
    noise_p: float = 0.25
    noise_voxels: float = 1.0  # standard deviation, in voxels of the source volume
    eval_on: Literal["all", "rank0"] = "all"

    def validate(self, prefix: str) -> None:
        if self.n_points < 2:
            raise ConfigError(f"config key '{prefix}.n_points' must be at least 2, got {self.n_points}")
        if not 0.0 < self.implant_fraction < 1.0:
            raise ConfigError(f"config key '{prefix}.implant_fraction' must lie in (0, 1), got {self.implant_fraction}")
        if self.repeats < 1:
            raise ConfigError(f"config key '{prefix}.repeats' must be at least 1, got {self.repeats}")
        if not self.data_root:
            raise ConfigError(f"config key '{prefix}.data_root' is empty; give the prepared dataset's folder")
        if self.synthetic is not None:
            self.synthetic.check(f"{prefix}.synthetic")
        try:
            self.augmentation()
        except ConfigError as err:
            raise ConfigError(f"config section '{prefix}': {err}") from None
        net = self.network()
        if len(set(net.dpsr_res)) != 1:
            raise ConfigError(
                f"config key '{prefix}.model.dpsr_res' must be one size for all axes (the target grid is cubic), got {list(net.dpsr_res)}"
            )

    def network(self):
        """The :class:`~pointforge.nn.voxelizer.VoxelizerConfig` this section describes."""
        overrides = dict(self.model)
        if isinstance(overrides.get("dpsr_res"), list):
            overrides["dpsr_res"] = tuple(overrides["dpsr_res"])
        try:
            return VoxelizerConfig.preset(self.preset, **overrides)
        except (ConfigError, TypeError, ValueError) as err:
            raise ConfigError(f"config key 'task.model': {err}") from None

    def augmentation(self):
        if not self.augment:
            return None
        return VoxelAugmentation(
            rotate_degrees=self.rotate_degrees,
            rotate_p=self.rotate_p,
            flip_p=self.flip_p,
            flip_axis=self.flip_axis,
            noise_p=self.noise_p,
            noise_voxels=self.noise_voxels,
        )


COLLAPSED_IOU = 0.02  # a validation IoU below this: the solid is empty or nowhere near the skull


def iou(inside_a: torch.Tensor, inside_b: torch.Tensor) -> torch.Tensor:
    """Per-item intersection over union of boolean grids [B, ...] (1 when both are empty)."""
    a = inside_a.flatten(1)
    b = inside_b.flatten(1)
    inter = (a & b).sum(1).double()
    union = (a | b).sum(1).double()
    return torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))


class VoxelizerTask(Task):
    name = "voxelizer"
    Config = VoxelizerTaskConfig
    best_metric = "val_iou"
    best_mode = "max"

    def configure(self, cfg: VoxelizerTaskConfig) -> None:
        self.eval_on = cfg.eval_on
        self.cfg = cfg

    def build_model(self, cfg: VoxelizerTaskConfig) -> nn.Module:
        # A training run configures the task first: the model then carries the frame of
        # its training data (module docs). A bare build (loading a checkpoint) reads no
        # data: the frame buffers take the checkpoint's. A meta-device build (a size
        # estimate) holds no values, so it reads no data either.
        net = VoxelizerNet(cfg.network())
        if getattr(self, "cfg", None) is not None and net.frame_cube_mm.device.type != "meta":
            frame = training_frame(PreparedDataset(self.data_root(cfg)), cfg.train_split)
            if frame is not None:
                net.set_frame(frame.cube_mm, frame.centre)
        return net

    def data_root(self, cfg: VoxelizerTaskConfig):
        root = Path(cfg.data_root)
        if cfg.synthetic is not None:
            s = cfg.synthetic
            root = ensure_synthetic_prepared(
                root,
                s.skulls,
                s.size,
                s.seed,
                s.points,
                log=get_logger("voxelizer").info,
                split=s.split,
                family=s.family,
            )
        return root

    def build_datasets(self, cfg: VoxelizerTaskConfig) -> tuple[Dataset, Dataset | None]:
        data = PreparedDataset(self.data_root(cfg))
        res = cfg.network().dpsr_res[0]
        common = dict(
            n_points=cfg.n_points,
            implant_fraction=cfg.implant_fraction,
            resolution=res,
            seed=cfg.data_seed,
            target_format="inside",
        )
        train = VoxelizationDataset(data, cfg.train_split, augment=cfg.augmentation(), repeats=cfg.repeats, **common)
        val = VoxelizationDataset(data, cfg.val_split, **common) if cfg.val_split else None
        return train, val

    def batch_sampler(self, dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch):
        # The engine calls this before every epoch; it is where the dataset learns
        # the epoch its augmentation draws from. The batches are the engine's own.
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return global_batches(
            len(dataset),
            global_batch=micro_batch * accumulation * world_size,
            micro_batch=micro_batch,
            accumulation=accumulation,
            world_size=world_size,
            rank=rank,
            seed=seed,
            epoch=epoch,
        )

    @staticmethod
    def targets(batch: dict) -> torch.Tensor:
        """The batch's inside grids moved by its augmentation (bool [B, R, R, R])."""
        return transform_inside(batch["target"], batch["transform"])

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext):
        inside = self.targets(batch)
        out = model(batch["points"])
        loss = psr_tanh_mse_loss(out.psr.float(), indicator_target(inside))
        with torch.no_grad():
            train_iou = iou(out.psr <= 0, inside).mean()
        return loss, {"iou": train_iou}

    def memory_estimate(self, cfg: VoxelizerTaskConfig, micro_batch: int) -> int:
        """The DPSR solve with gradients (:func:`~pointforge.nn.dpsr.dpsr_memory_bytes`) plus the loss's grids.

        Per sample the loss holds a bool inside grid and four float32 grids for
        the backward pass (the target, tanh of prediction and target, their difference).
        """
        res = cfg.network().dpsr_res
        solve = dpsr_memory_bytes(res, cfg.n_points, batch=micro_batch, requires_grad=True)
        return solve + micro_batch * math.prod(res) * (1 + 4 * 4)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        totals = {"val_loss": 0.0, "val_l2": 0.0, "val_iou": 0.0, "val_fill": 0.0}
        count = 0
        for batch in loader:
            points = batch["points"].to(ctx.device)
            inside = self.targets({k: batch[k].to(ctx.device) for k in ("target", "transform")})
            pred = model(points).psr.float()
            target = indicator_target(inside)
            per_item = pred.flatten(1)
            totals["val_loss"] += (torch.tanh(per_item) - torch.tanh(target.flatten(1))).pow(2).mean(1).sum().item()
            totals["val_l2"] += (per_item - target.flatten(1)).pow(2).mean(1).sum().item()
            totals["val_iou"] += iou(pred <= 0, inside).sum().item()
            filled = (pred <= 0).flatten(1).sum(1).double() / inside.flatten(1).sum(1).double().clamp_min(1)
            totals["val_fill"] += filled.sum().item()
            count += pred.shape[0]
        return {k: v / count for k, v in totals.items()} if count else {}

    def health(self, metrics: Mapping[str, float]) -> list[str]:
        value = metrics.get("val_iou")
        if value is None or value >= COLLAPSED_IOU:
            return []
        return [
            f"the voxelizer has collapsed: validation IoU {value:.3g} with a solid of {metrics.get('val_fill', 0):.2g} "
            "times the true volume; such a run did not recover in the runs measured (its offsets had flung the points "
            "onto the grid's faces): stop it and train again with task.model.max_offset=0.05, which bounds the offsets "
            "and kept every seed measured alive, or with another train.seed"
        ]
