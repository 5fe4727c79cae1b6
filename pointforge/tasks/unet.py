"""The ``unet`` task: a volumetric 3-D U-Net (MONAI's) from the defective skull to the implant, on a coarse cube.

The field's standard peer of PCDiff, trained by the same engine on the same
prepared datasets. What the engine gets from this task:

* model: :class:`monai.networks.nets.UNet` (``spatial_dims=3``, one channel
  in: the defective skull; one out: the implant's logits), channels, strides,
  residual units and normalisation from the config.
* data: every case of a prepared dataset (``task.data_root``), its defective
  skull and implant read from the raw volumes its ``.json`` names and put on
  a cube of ``task.grid``³ cells around the defective skull, sized in
  millimetres (the bone's largest extent plus ``task.margin_mm`` per side),
  as the bone fraction of each cell (:mod:`pointforge.data.skulls.coarse_grids`).
  That is done once per dataset and grid and cached
  (:mod:`pointforge.data.skulls.coarse_cache`; ``task.cache_dir``, default
  under the prepared folder). With ``task.synthetic`` and no dataset at
  ``data_root``, synthetic skulls are made and prepared there first.
* augmentation (training split only): a left-right mirror of input and
  target together with probability ``task.mirror_p``, drawn from
  (data_seed, epoch, index).
* loss: MONAI's ``DiceCELoss`` with a sigmoid: soft Dice plus binary cross
  entropy on the logits, against the implant's bone fraction. An implant is
  about 1 % of the cube, so cross entropy alone is won by predicting
  background everywhere; Dice is blind to that imbalance but gives noisy
  gradients while the prediction is near empty, which the cross entropy
  steadies. It is nnU-Net's default and what the AutoImplant entries used.
  (``DiceFocalLoss`` aims at the same imbalance with one more knob, gamma.)
* evaluation (every rank on its shard, per-case means): ``val_loss`` and
  ``val_dice``, the Dice of prediction ≥ 0.5 against bone fraction ≥ 0.5 on
  the cube; ``best.pt`` is chosen by ``val_dice`` (max).

Running a trained one on a scan of any grid is :mod:`pointforge.implant.unet`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from pointforge.data.cache import SyntheticSection, ensure_synthetic_prepared
from pointforge.data.skulls.coarse_cache import GridRecipe, ensure_case_grids, load_case_grids
from pointforge.data.skulls.datasets import _EpochSeeded
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import ConfigError, DataError
from pointforge.train.logs import get_logger
from pointforge.train.task import EvalContext, StepContext, Task

__all__ = ["UNetTaskConfig", "CubeGridDataset", "UNetTask", "build_unet", "dice_per_case"]

NORMS = ("instance", "batch")


@dataclass
class UNetTaskConfig:
    """The ``task:`` section of a U-Net config."""

    data_root: str = "data/synthetic/pcdiff-tiny"
    synthetic: SyntheticSection | None = None  # made in data_root if that does not exist
    cache_dir: str = ""  # the cases on the cube; "": <data_root>/unet-grids/g<grid>-m<margin_mm>
    grid: int = 64  # cells per side of the cube the network sees
    margin_mm: float = 12.0  # beyond the defective skull's largest extent, on each side
    channels: tuple[int, ...] = (16, 32, 64, 128, 256)
    strides: tuple[int, ...] = (2, 2, 2, 2)
    num_res_units: int = 1
    norm: Literal["instance", "batch"] = "instance"
    dropout: float = 0.0
    lambda_dice: float = 1.0
    lambda_ce: float = 1.0
    train_split: str = "train"
    val_split: str = "val"  # "" or null: no validation
    mirror_p: float = 0.5  # left-right mirror of training cases; 0: off
    data_seed: int = 0  # per-item randomness: (data_seed, epoch, index)
    eval_on: Literal["all", "rank0"] = "all"

    def validate(self, prefix: str) -> None:
        if not self.data_root:
            raise ConfigError(f"config key '{prefix}.data_root' is empty; give the prepared dataset's folder")
        if self.synthetic is not None:
            self.synthetic.check(f"{prefix}.synthetic")
        if len(self.channels) < 2 or any(c < 1 for c in self.channels):
            raise ConfigError(
                f"config key '{prefix}.channels' must list 2 or more positive widths, got {list(self.channels)}"
            )
        if len(self.strides) != len(self.channels) - 1 or any(s < 1 for s in self.strides):
            raise ConfigError(
                f"config key '{prefix}.strides' must give one positive stride per level below the first "
                f"({len(self.channels) - 1} for {len(self.channels)} channels), got {list(self.strides)}"
            )
        reduction = math.prod(self.strides)
        if self.grid < 8 or self.grid % reduction:
            raise ConfigError(
                f"config key '{prefix}.grid' must be at least 8 and a multiple of the strides' product {reduction}, got {self.grid}"
            )
        if self.margin_mm < 0:
            raise ConfigError(f"config key '{prefix}.margin_mm' must be 0 or more, got {self.margin_mm}")
        if self.num_res_units < 0:
            raise ConfigError(f"config key '{prefix}.num_res_units' must be 0 or more, got {self.num_res_units}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"config key '{prefix}.dropout' must lie in [0, 1), got {self.dropout}")
        if not 0.0 <= self.mirror_p <= 1.0:
            raise ConfigError(f"config key '{prefix}.mirror_p' must lie in [0, 1], got {self.mirror_p}")
        if self.lambda_dice < 0 or self.lambda_ce < 0 or self.lambda_dice + self.lambda_ce == 0:
            raise ConfigError(f"config keys '{prefix}.lambda_dice' and '.lambda_ce' must be 0 or more, not both 0")

    @property
    def recipe(self) -> GridRecipe:
        return GridRecipe(self.grid, self.margin_mm)


def build_unet(cfg: UNetTaskConfig) -> nn.Module:
    """MONAI's 3-D U-Net as ``cfg`` describes it: one channel in (defective skull), one out (implant logits)."""
    from monai.networks.nets import UNet

    return UNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=1,
        channels=tuple(cfg.channels),
        strides=tuple(cfg.strides),
        num_res_units=cfg.num_res_units,
        norm=cfg.norm.upper(),
        dropout=cfg.dropout,
    )


class CubeGridDataset(_EpochSeeded):
    """The cases of one split on the cube, held in memory (float16): ``{"image", "label"}``, each ``[1, G, G, G]``.

    ``mirror_p`` > 0 mirrors a case's input and target together along the
    cube's left-right axis with that probability, drawn from (seed, epoch, index).
    """

    def __init__(self, dataset: PreparedDataset, split: str, folder: Path, *, mirror_p: float = 0.0, seed: int = 0):
        super().__init__(seed)
        self.cases = dataset.split(split, require=("defective", "implant"))
        if not self.cases:
            raise DataError(f"{dataset.root}: the {split!r} split has no case with a defective skull and an implant")
        grids = [load_case_grids(folder, case) for case in self.cases]
        self.images = np.stack([g.defective for g in grids])
        self.labels = np.stack([g.implant for g in grids])
        self.mirror_p = float(mirror_p)

    def __len__(self) -> int:
        return len(self.cases)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, label = self.images[index], self.labels[index]
        if self.mirror_p > 0 and self._rng(index).random() < self.mirror_p:
            image, label = image[::-1], label[::-1]
        return {
            "image": torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))[None],
            "label": torch.from_numpy(np.ascontiguousarray(label, dtype=np.float32))[None],
        }


def dice_per_case(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Dice of sigmoid(logits) ≥ 0.5 against label ≥ 0.5, per case ``[B]`` (1 when both are empty)."""
    pred = (logits >= 0).flatten(1)
    true = (label >= 0.5).flatten(1)
    inter = (pred & true).sum(1).double()
    total = (pred.sum(1) + true.sum(1)).double()
    return torch.where(total > 0, 2 * inter / total.clamp_min(1), torch.ones_like(total))


class UNetTask(Task):
    name = "unet"
    Config = UNetTaskConfig
    best_metric = "val_dice"
    best_mode = "max"

    def configure(self, cfg: UNetTaskConfig) -> None:
        self.eval_on = cfg.eval_on
        from monai.losses import DiceCELoss

        self.loss = DiceCELoss(sigmoid=True, lambda_dice=cfg.lambda_dice, lambda_ce=cfg.lambda_ce)

    def build_model(self, cfg: UNetTaskConfig) -> nn.Module:
        return build_unet(cfg)

    def build_datasets(self, cfg: UNetTaskConfig) -> tuple[Dataset, Dataset | None]:
        log = get_logger("unet").info
        root = Path(cfg.data_root)
        if cfg.synthetic is not None:
            s = cfg.synthetic
            root = ensure_synthetic_prepared(
                root, s.skulls, s.size, s.seed, s.points, log=log, split=s.split, family=s.family
            )
        data = PreparedDataset(root)
        splits = [cfg.train_split] + ([cfg.val_split] if cfg.val_split else [])
        cases = [c for name in splits for c in data.split(name, require=("defective", "implant"))]
        folder = ensure_case_grids(data, cases, cfg.recipe, cfg.cache_dir or None, log=log)
        train = CubeGridDataset(data, cfg.train_split, folder, mirror_p=cfg.mirror_p, seed=cfg.data_seed)
        val = CubeGridDataset(data, cfg.val_split, folder) if cfg.val_split else None
        return train, val

    def batch_sampler(self, dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch):
        # The engine calls this before every epoch: where the dataset learns the epoch its mirror draws
        # from. None: the engine's own global batches.
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return None

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext):
        logits = model(batch["image"])
        loss = self.loss(logits.float(), batch["label"])
        with torch.no_grad():
            dice = dice_per_case(logits, batch["label"]).mean()
        return loss, {"dice": dice}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        loss_sum, dice_sum, count = 0.0, 0.0, 0
        for batch in loader:
            image, label = batch["image"].to(ctx.device), batch["label"].to(ctx.device)
            logits = model(image).float()
            for k in range(len(image)):  # the loss per case, so shards of any size average alike
                loss_sum += float(self.loss(logits[k : k + 1], label[k : k + 1]))
            dice_sum += float(dice_per_case(logits, label).sum())
            count += len(image)
        return {"val_loss": loss_sum / count, "val_dice": dice_sum / count} if count else {}
