"""One optimizer step, on every rank in lockstep: micro-batches, the ranks' vote, the update.

1. ``accumulation`` micro-batches: forward under autocast, ``loss / accumulation``
   backward; DDP's ``no_sync`` on all but the last, so gradients are reduced once.
2. One small all-reduce of ``[loss, stop requested?, checkpoint due?, out of
   time?, rank 0's training clock]``. Every decision that could otherwise
   differ between ranks (skip this step, stop, save) is taken from that shared
   vector, so no rank can take a path the others do not.
3. Unless the loss was non-finite somewhere: unscale, clip, optimizer step,
   EMA update. The scheduler advances either way.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch import nn

from pointforge.config.training import TrainConfig
from pointforge.train.checkpoint.manager import Trainables
from pointforge.train.data import move_to_device, worker_errors
from pointforge.train.dist import DistEnv, all_reduce_sum, report
from pointforge.train.logs import get_logger
from pointforge.train.schedule import BatchPlan
from pointforge.train.state import MetricWindow, TrainState
from pointforge.train.task import StepContext, Task, split_step_output

log = get_logger("train")


class TrainingDiverged(RuntimeError):
    """The loss was non-finite for ``train.max_nonfinite`` steps in a row."""


@dataclass
class Vote:
    """What the ranks agreed in a step's all-reduce."""

    mean_loss: float  # over all ranks and micro-batches; non-finite if any rank's was
    stop: bool  # a stop signal reached some rank
    ckpt_due: bool  # rank 0's ckpt.every_minutes clock
    time_up: bool  # rank 0's train.max_minutes clock


@dataclass
class LocalFlags:
    """What this rank alone would decide; the step's vote turns them into decisions every rank shares."""

    stop: bool
    ckpt_due: bool
    time_up: bool
    train_seconds: float  # rank 0's training clock (0 elsewhere): a time-based schedule's progress


class TrainStep:
    """Runs optimizer steps for the trainer; holds what every step shares (the parts, the batch shape, precision)."""

    def __init__(
        self,
        task: Task,
        cfg: TrainConfig,
        env: DistEnv,
        *,
        parts: Trainables,
        train_model: nn.Module,
        batch: BatchPlan,
        state: TrainState,
        window: MetricWindow,
        dtype: torch.dtype | None,
        where: dict[str, int],
        last_checkpoint: Callable[[], Any],
    ):
        self.task = task
        self.cfg = cfg
        self.env = env
        self.device = env.device
        self.parts = parts
        self.train_model = train_model
        self.batch = batch
        self.state = state
        self.window = window
        self.amp_dtype = dtype
        self.where = where  # read by the DDP forward hook that reports a rank's position
        self.last_checkpoint = last_checkpoint
        self.pinned = bool(cfg.data.pin_memory and self.device.type == "cuda")

    def autocast(self) -> ContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def lr(self) -> float:
        return self.parts.optimizer.param_groups[0]["lr"]

    def run(self, epoch: int, batches: Iterator[Any], local: Callable[[], LocalFlags]) -> Vote:
        """Forward/backward over the micro-batches, the ranks' vote, then the optimizer step.

        ``local`` is asked for this rank's flags after the backward pass, so a
        signal that arrives during the step stops the run at this step.
        """
        t0 = time.perf_counter()
        self.where.clear()
        self.where.update(epoch=epoch, step=self.state.global_step)
        report(self.env, "in training_step (forward)", **self.where)
        loss_sum, data_time = self._forward_backward(epoch, batches)
        vote = self._vote(loss_sum, epoch, local())
        lr_used = self.lr()
        skipped, grad_norm = self._optimizer_step(vote.mean_loss, epoch)
        self.window.add_step(
            loss=None if skipped else vote.mean_loss,
            lr=lr_used,
            grad_norm=float(grad_norm) if grad_norm is not None and self.env.is_main else None,
            data_time=data_time,
            step_time=time.perf_counter() - t0,
        )
        return vote

    def _forward_backward(self, epoch: int, batches: Iterator[Any]) -> tuple[torch.Tensor, float]:
        """``accumulation`` micro-batches; gradients reduced once (``no_sync`` on all but the last).

        Returns the summed (unscaled) loss, left on the device, and the time spent waiting for data.
        """
        env, accum, scaler = self.env, self.batch.accumulation, self.parts.scaler
        losses = []
        data_time = 0.0
        for micro in range(accum):
            waited = time.perf_counter()
            batch = self._next_batch(batches, epoch, micro)
            data_time += time.perf_counter() - waited
            ctx = StepContext(
                epoch=epoch,
                global_step=self.state.global_step,
                micro_step=micro,
                accumulation=accum,
                device=self.device,
                rank=env.rank,
                world_size=env.world_size,
                amp_dtype=self.amp_dtype,
            )
            no_sync = env.distributed and micro < accum - 1
            sync: ContextManager[Any] = self.train_model.no_sync() if no_sync else contextlib.nullcontext()  # type: ignore[operator]
            with sync:
                with self.autocast():
                    out = self.task.training_step(self.train_model, batch, ctx)
                loss, metrics = split_step_output(out)
                if loss.dtype != torch.float32:
                    loss = loss.float()
                scaled = loss / accum if accum > 1 else loss
                if scaler is not None:
                    scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            losses.append(loss.detach())
            if metrics and env.is_main:
                self.window.add_task_metrics(metrics)
        return (losses[0] if accum == 1 else torch.stack(losses).sum()), data_time

    def _next_batch(self, batches: Iterator[Any], epoch: int, micro: int) -> Any:
        try:
            with worker_errors():
                batch = next(batches)
        except StopIteration:
            raise RuntimeError(
                f"the data loader on rank {self.env.rank} ran out after {micro} of {self.batch.accumulation} micro-batches in epoch {epoch}"
            ) from None
        if self.device.type != "cpu":  # loader output is on the CPU already
            batch = move_to_device(batch, self.device, non_blocking=self.pinned)
        return batch

    def _vote(self, loss_sum: torch.Tensor, epoch: int, local: LocalFlags) -> Vote:
        """The step's one all-reduce: the loss and every flag a rank could otherwise decide alone."""
        env, accum = self.env, self.batch.accumulation
        flags: Sequence[float] = [
            1.0 if local.stop else 0.0,
            1.0 if local.ckpt_due else 0.0,
            1.0 if local.time_up else 0.0,
            local.train_seconds,
        ]
        if env.distributed:
            report(env, "in the step's all-reduce", epoch=epoch, step=self.state.global_step)
            # Every rank-dependent decision rides on this one reduction, so all
            # ranks skip, stop and save at the same step. A NaN or inf on any
            # rank makes the summed loss non-finite on every rank.
            vector = torch.cat([loss_sum.reshape(1), torch.tensor(flags, device=self.device)])
            total, n_stop, n_due, n_time, seconds = all_reduce_sum(env, vector).tolist()
            mean_loss = total / (accum * env.world_size)
        else:
            mean_loss = loss_sum.item() / accum
            n_stop, n_due, n_time, seconds = flags
        self.state.train_seconds = seconds
        return Vote(mean_loss=mean_loss, stop=n_stop > 0, ckpt_due=n_due > 0, time_up=n_time > 0)

    def _optimizer_step(self, mean_loss: float, epoch: int) -> tuple[bool, torch.Tensor | None]:
        """Unscale, clip and step, or skip a non-finite step; the schedule advances either way.

        Returns (skipped, gradient norm when clipping).
        """
        parts, clip = self.parts, self.cfg.train.grad_clip
        loss_bad = not math.isfinite(mean_loss)
        skip = loss_bad
        grad_norm = None
        if not skip:
            if parts.scaler is not None:
                parts.scaler.unscale_(parts.optimizer)
            if clip:
                grad_norm = torch.nn.utils.clip_grad_norm_(parts.model.parameters(), clip)
                # Gradients are identical on every rank after DDP's all-reduce, so
                # this check agrees everywhere without another collective.
                if parts.scaler is None and not bool(torch.isfinite(grad_norm)):
                    skip = True
        if skip:
            parts.optimizer.zero_grad(set_to_none=True)
            self._count_skip("loss" if loss_bad else "gradient norm", epoch)
        else:
            if parts.scaler is not None:
                parts.scaler.step(parts.optimizer)
                parts.scaler.update()
            else:
                parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
            if parts.ema is not None:
                parts.ema.update(parts.model)
        parts.scheduler.step()
        self.state.advance(skipped=skip)
        return skip, grad_norm

    def _count_skip(self, what: str, epoch: int) -> None:
        """Warn about a skipped step; stop the run once ``train.max_nonfinite`` come in a row."""
        streak = self.state.count_skip()
        step, limit = self.state.global_step, self.cfg.train.max_nonfinite
        if self.env.is_main:
            log.warning(
                f"non-finite {what} at step {step} (epoch {epoch}); step skipped ({streak} in a row, limit {limit})"
            )
        if streak >= limit:
            raise TrainingDiverged(
                f"training diverged: non-finite loss for {streak} steps in a row "
                f"(train.max_nonfinite={limit}) at epoch {epoch}, step {step}; "
                "lower optim.lr, add train.grad_clip, or check the data; the last good checkpoint is "
                f"{self.last_checkpoint() or 'not written yet'}"
            )
