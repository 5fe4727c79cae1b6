"""The toy task with fault injectors, registered as ``faulty_toy`` by the tests only.

The engine's tests need runs that go wrong on purpose: a rank with one
optimizer step fewer per epoch, a rank that stalls, NaN losses, a process that
sends itself SIGTERM mid-epoch. Those switches live here, outside the package,
so that nothing shipped carries them. With every switch off the task trains
exactly as ``toy`` does (same model, data and loss).

Worker processes started by torchrun find the task through the
``pointforge.tasks`` entry-point group (see :func:`tests.helpers.subprocess_env`),
the same way a third-party task package is found; this module must therefore
import nothing test-only (no pytest).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from pointforge.errors import DataError
from pointforge.tasks.toy import ToyConfig, ToyTask
from pointforge.train.data import global_batches
from pointforge.train.task import StepContext


@dataclass
class FaultyToyConfig(ToyConfig):
    # All off by default.
    drop_batches_on_rank: int = -1  # this rank gets one optimizer step fewer per epoch ...
    drop_from_epoch: int = 0  # ... from this epoch on
    nan_steps: list[int] = field(default_factory=list)  # global steps whose loss is NaN
    nan_rank: int = -1  # ... on this rank only (-1: all ranks)
    stall_rank: int = -1  # this rank sleeps stall_s at global step stall_step
    stall_step: int = 0
    stall_s: float = 120.0
    sigterm_at_step: int = -1  # this process sends itself SIGTERM during that global step
    sigterm_rank: int = 0
    broken_index: int = -1  # reading this training sample raises a DataError (in a loader worker, with workers)
    weights_log: str = ""  # a folder: each rank appends "step sum-of-weights" at every step, to compare replicas


class BrokenSample(Dataset):
    """A dataset whose sample ``index`` cannot be read, as a file deleted mid-run would make it."""

    def __init__(self, inner: Dataset, index: int):
        self.inner, self.index = inner, index

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        if index == self.index:
            raise DataError(f"sample {index}: its file is gone; re-run `pointforge data prepare`")
        return self.inner[index]


class FaultyToyTask(ToyTask):
    name = "faulty_toy"
    Config = FaultyToyConfig

    def build_datasets(self, cfg):
        train, val = super().build_datasets(cfg)
        return (BrokenSample(train, cfg.broken_index) if cfg.broken_index >= 0 else train), val

    def batch_sampler(self, dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch):
        cfg = self._cfg
        if cfg.drop_batches_on_rank < 0:
            return None
        batches = global_batches(
            len(dataset),
            global_batch=micro_batch * accumulation * world_size,
            micro_batch=micro_batch,
            accumulation=accumulation,
            world_size=world_size,
            rank=rank,
            seed=seed,
            epoch=epoch,
        )
        if rank == cfg.drop_batches_on_rank and epoch >= cfg.drop_from_epoch:
            batches = batches[:-accumulation]
        return batches

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext):
        cfg = self._cfg
        first_micro_step = ctx.micro_step == 0
        if ctx.rank == cfg.stall_rank and ctx.global_step == cfg.stall_step and first_micro_step:
            time.sleep(cfg.stall_s)
        if ctx.global_step == cfg.sigterm_at_step and ctx.rank == cfg.sigterm_rank and first_micro_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if cfg.weights_log and first_micro_step:
            total = sum(float(p.detach().double().sum()) for p in model.parameters())
            with open(os.path.join(cfg.weights_log, f"rank{ctx.rank}.txt"), "a") as f:
                f.write(f"{ctx.global_step} {total!r}\n")
        loss, metrics = super().training_step(model, batch, ctx)
        if ctx.global_step in cfg.nan_steps and cfg.nan_rank in (-1, ctx.rank):
            loss = loss * float("nan")
        return loss, metrics
