"""A toy task for tests and benchmarks: a small point MLP regressing per-cloud statistics.

Each sample is a cloud of ``n_points`` random 3-D points (generated from
``data_seed``, so every rank and every run sees the same data) and a target of
three per-cloud statistics (mean of x·y, of z², of sin 3x). A PointNet-style
MLP with mean+max pooling learns them in seconds on a CPU.

Fields named ``test_*`` are fault injectors used by the engine's tests (a rank
with fewer batches, a slow or stalled rank, NaN losses). They default to off.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from pointforge.errors import ConfigError
from pointforge.tasks.base import EvalContext, StepContext, Task
from pointforge.train.data import global_batches


@dataclass
class ToyConfig:
    n_train: int = 64
    n_val: int = 16
    n_points: int = 32
    hidden: int = 32
    dropout: float = 0.0
    data_seed: int = 1234
    eval_on: Literal["all", "rank0"] = "all"
    # Fault injection for tests; all off by default.
    test_drop_batches_on_rank: int = -1  # this rank gets one optimizer step fewer per epoch ...
    test_drop_from_epoch: int = 0  # ... from this epoch on
    test_step_delay_s: float = 0.0  # sleep in every training step (to catch a run mid-epoch)
    test_nan_steps: list[int] = field(default_factory=list)  # global steps whose loss is NaN
    test_nan_rank: int = -1  # ... on this rank only (-1: all ranks)
    test_stall_rank: int = -1  # this rank sleeps test_stall_s at global step test_stall_step
    test_stall_step: int = 0
    test_stall_s: float = 120.0
    test_sigterm_at_step: int = -1  # this process sends itself SIGTERM during that global step
    test_sigterm_rank: int = 0

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
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out_dim))

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

    def batch_sampler(self, dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch):
        cfg = getattr(self, "_cfg", None)
        if cfg is None or cfg.test_drop_batches_on_rank < 0:
            return None
        batches = global_batches(
            len(dataset), global_batch=micro_batch * accumulation * world_size, micro_batch=micro_batch,
            accumulation=accumulation, world_size=world_size, rank=rank, seed=seed, epoch=epoch,
        )
        if rank == cfg.test_drop_batches_on_rank and epoch >= cfg.test_drop_from_epoch:
            batches = batches[:-accumulation]
        return batches

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext):
        cfg = self._cfg
        if cfg.test_step_delay_s > 0:
            time.sleep(cfg.test_step_delay_s)
        if ctx.rank == cfg.test_stall_rank and ctx.global_step == cfg.test_stall_step and ctx.micro_step == 0:
            time.sleep(cfg.test_stall_s)
        if ctx.global_step == cfg.test_sigterm_at_step and ctx.rank == cfg.test_sigterm_rank and ctx.micro_step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        pred = model(batch["points"])
        loss = F.mse_loss(pred.float(), batch["target"])
        if ctx.global_step in cfg.test_nan_steps and cfg.test_nan_rank in (-1, ctx.rank):
            loss = loss * float("nan")
        return loss, {"mae": (pred.detach().float() - batch["target"]).abs().mean()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        total, count = 0.0, 0
        for batch in loader:
            pred = model(batch["points"].to(ctx.device))
            total += F.mse_loss(pred.float(), batch["target"].to(ctx.device), reduction="sum").item() / pred.shape[-1]
            count += pred.shape[0]
        return {"val_loss": total / count} if count else {}
