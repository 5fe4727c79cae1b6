"""A toy task for tests and benchmarks: a small point MLP regressing per-cloud statistics.

Each sample is a cloud of ``n_points`` random 3-D points (generated from
``data_seed``, so every rank and every run sees the same data) and a target of
three per-cloud statistics (mean of x·y, of z², of sin 3x). A PointNet-style
MLP with mean+max pooling learns them in seconds on a CPU.

``step_delay_s`` paces a run (a sleep in every training step) so that a
rehearsal of launch, monitor and stop (``pointforge/configs/launch/toy.yaml``) lasts long
enough to watch. The engine's tests inject faults through a subclass of this
task that they register themselves (``tests/faulty_toy.py``); nothing here is
test-only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from pointforge.errors import ConfigError
from pointforge.train.task import EvalContext, StepContext, Task


@dataclass
class ToyConfig:
    n_train: int = 64
    n_val: int = 16
    n_points: int = 32
    hidden: int = 32
    dropout: float = 0.0
    data_seed: int = 1234
    eval_on: Literal["all", "rank0"] = "all"
    step_delay_s: float = 0.0  # sleep in every training step, so a rehearsal run can be watched and stopped

    def validate(self, prefix: str) -> None:
        for name in ("n_train", "n_points", "hidden"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config key '{prefix}.{name}' must be at least 1, got {getattr(self, name)}")
        if self.n_val < 0:
            raise ConfigError(f"config key '{prefix}.n_val' must be 0 or more, got {self.n_val}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"config key '{prefix}.dropout' must lie in [0, 1), got {self.dropout}")


class ToyClouds(Dataset):
    def __init__(self, points: torch.Tensor):
        self.points = points
        x, y, z = points.unbind(-1)
        self.targets = torch.stack([(x * y).mean(-1), (z * z).mean(-1), torch.sin(3 * x).mean(-1)], dim=-1)

    def __len__(self) -> int:
        return self.points.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"points": self.points[index], "target": self.targets[index]}


class PointMLP(nn.Module):
    def __init__(self, hidden: int = 32, dropout: float = 0.0, out_dim: int = 3):
        super().__init__()
        self.point = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Sequential(
            nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out_dim)
        )

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        feats = self.point(points)
        pooled = torch.cat([feats.mean(dim=1), feats.amax(dim=1)], dim=-1)
        return self.head(pooled)


class ToyTask(Task):
    name = "toy"
    Config = ToyConfig
    best_metric = "val_loss"
    best_mode = "min"

    def configure(self, cfg: ToyConfig) -> None:
        self.eval_on = cfg.eval_on
        self._cfg = cfg

    def build_model(self, cfg: ToyConfig) -> nn.Module:
        return PointMLP(cfg.hidden, cfg.dropout)

    def build_datasets(self, cfg: ToyConfig) -> tuple[Dataset, Dataset | None]:
        gen = torch.Generator().manual_seed(cfg.data_seed)
        points = torch.randn(cfg.n_train + cfg.n_val, cfg.n_points, 3, generator=gen)
        train = ToyClouds(points[: cfg.n_train])
        val = ToyClouds(points[cfg.n_train :]) if cfg.n_val else None
        return train, val

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext):
        if self._cfg.step_delay_s > 0:
            time.sleep(self._cfg.step_delay_s)
        pred = model(batch["points"])
        loss = F.mse_loss(pred.float(), batch["target"])
        return loss, {"mae": (pred.detach().float() - batch["target"]).abs().mean()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        total, count = 0.0, 0
        for batch in loader:
            pred = model(batch["points"].to(ctx.device))
            total += F.mse_loss(pred.float(), batch["target"].to(ctx.device), reduction="sum").item() / pred.shape[-1]
            count += pred.shape[0]
        return {"val_loss": total / count} if count else {}
