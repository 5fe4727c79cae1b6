"""The engine's training data, epoch by epoch: one loader for the run, each epoch's batches handed to it.

:class:`EpochFeed` owns the training loader (opened once, its workers kept
for the whole run) and, before each epoch, hands its sampler that epoch's
batches from the resume point on: the task's own ``batch_sampler`` or the
engine's global batches. The ranks compare their step counts first, so an
uneven split fails at once, naming ranks and counts.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from pointforge.config import TrainConfig
from pointforge.train.data import EpochBatches, build_loader, derive_seed, global_batches, shutdown_loader
from pointforge.train.dist import DistEnv, check_equal, report
from pointforge.train.schedule import BatchPlan
from pointforge.train.state import TrainState
from pointforge.train.task import Task


class EpochFeed:
    """The training loader and the batches of the current epoch."""

    def __init__(self, task: Task, cfg: TrainConfig, env: DistEnv, train_ds: Any, batch: BatchPlan, *, pinned: bool):
        self.task = task
        self.cfg = cfg
        self.env = env
        self.train_ds = train_ds
        self.batch = batch
        self.sampler = EpochBatches()
        self.generator = torch.Generator()
        self.loader: Any = None
        self.iterator: Iterator[Any] | None = None
        self.pinned = pinned

    def open(self) -> None:
        """One loader for the whole run; each epoch hands its sampler that epoch's batches."""
        self.loader = build_loader(
            self.train_ds,
            self.sampler,
            collate_fn=self.task.collate,
            data_cfg=self.cfg.data,
            pin_memory=self.pinned,
            generator=self.generator,
        )

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of ``epoch``: the task's sampler's, or the engine's global batches."""
        b, seed = self.batch, self.cfg.train.seed
        custom = self.task.batch_sampler(
            self.train_ds,
            rank=self.env.rank,
            world_size=b.world_size,
            micro_batch=b.micro_batch,
            accumulation=b.accumulation,
            seed=seed,
            epoch=epoch,
        )
        if custom is not None:
            return [list(x) for x in custom]
        return global_batches(
            len(self.train_ds),
            global_batch=b.global_batch,
            micro_batch=b.micro_batch,
            accumulation=b.accumulation,
            world_size=b.world_size,
            rank=self.env.rank,
            seed=seed,
            epoch=epoch,
        )

    def start(self, epoch: int, state: TrainState) -> tuple[int, int]:
        """Hand the loader ``epoch``'s batches (from the resume point); return (first step, steps)."""
        env, accum = self.env, self.batch.accumulation
        batches = self.epoch_batches(epoch)
        n_steps = len(batches) // accum
        report(env, "comparing step counts", epoch=epoch, step=state.global_step)
        check_equal(
            env,
            n_steps,
            f"the number of optimizer steps in epoch {epoch}",
            "every rank must get the same number of batches: use the engine's sampler (drop_last by construction) "
            "or make Task.batch_sampler return equal counts",
        )
        start = state.step_in_epoch if epoch == state.epoch else 0
        self.sampler.set(batches[start * accum : n_steps * accum])
        self.generator.manual_seed(derive_seed(self.cfg.train.seed, "loader", env.rank, epoch))
        set_epoch = getattr(self.train_ds, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)  # per-epoch augmentation from (seed, epoch, index): exact on resume
        self.iterator = iter(self.loader)
        return start, n_steps

    def batches(self) -> Iterator[Any]:
        """The current epoch's iterator (after :meth:`start`)."""
        if self.iterator is None:
            raise RuntimeError("EpochFeed.start() must come before the epoch's batches")
        return self.iterator

    def end_epoch(self) -> None:
        self.iterator = None

    def close(self) -> None:
        shutdown_loader(self.loader, self.iterator)
        self.iterator = None
