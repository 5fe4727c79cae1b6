"""The engine's own state, as objects that save and restore themselves.

:class:`TrainState` is where training stands (epoch, step, samples, the
non-finite streak, the batch shape it was counted in) and the best metric so
far. Its ``state_dict()`` *is* a checkpoint's ``progress`` entry, so the
engine, the upstream PCDiff importer and ``ckpt inspect`` share one layout
instead of three hand-written copies (compare Lightning's ``loops/progress.py``
and torchtitan's ``TrainState``). The keys are those checkpoints have always
had; files written before this module existed load unchanged.

:class:`MetricWindow` accumulates what happens between two log lines, so
the training step only reports into it and the log line reads out of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch


@dataclass
class BestMetric:
    """The best value of one evaluation metric, and the step it was reached at.

    ``metric`` and ``mode`` are the rule (from the config or the task); only
    ``value`` and ``step`` are state, so a resumed run judges by its own rule.
    """

    metric: str | None = None
    mode: str = "min"
    value: float | None = None
    step: int | None = None

    def better(self, value: float) -> bool:
        """Whether ``value`` beats the best so far (non-finite values never do)."""
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value < self.value if self.mode == "min" else value > self.value

    def offer(self, metrics: Mapping[str, float], step: int, warn: Callable[[str], None] | None = None) -> bool:
        """Record ``metrics[metric]`` if it is a new best; return whether it was.

        Every rank calls this with the same (gathered or broadcast) metrics, so
        every rank carries the same progress; ``warn`` is rank 0's logger.
        """
        if not self.metric or not metrics:
            return False
        value = metrics.get(self.metric)
        if value is None:
            if warn is not None:
                warn(
                    f"best metric '{self.metric}' is not among the evaluation metrics ({', '.join(metrics)}); set ckpt.best_metric"
                )
            return False
        if not self.better(float(value)):
            return False
        self.value, self.step = float(value), step
        return True

    def summary(self) -> dict[str, Any] | None:
        """``{"metric", "value", "step"}`` once there is a best, else ``None``."""
        if self.value is None:
            return None
        return {"metric": self.metric, "value": self.value, "step": self.step}


@dataclass
class TrainState:
    """Where training stands; ``state_dict()`` is a checkpoint's ``progress``."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps completed in the current epoch
    global_step: int = 0
    samples_seen: int = 0
    nonfinite_streak: int = 0
    skipped_steps: int = 0
    world_size: int = 1
    global_batch: int | None = None
    steps_per_epoch: int | None = None
    train_seconds: float = 0.0  # rank 0's training clock, summed over launches (sched.horizon_minutes)
    best: BestMetric = field(default_factory=BestMetric)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "samples_seen": self.samples_seen,
            "nonfinite_streak": self.nonfinite_streak,
            "skipped_steps": self.skipped_steps,
            "best_metric": self.best.metric,
            "best_mode": self.best.mode,
            "best_value": self.best.value,
            "best_step": self.best.step,
            "global_batch": self.global_batch,
            "steps_per_epoch": self.steps_per_epoch,
            "world_size": self.world_size,
            "train_seconds": self.train_seconds,
        }

    def load_state_dict(self, progress: Mapping[str, Any]) -> None:
        """Take the counters and best value of a checkpoint's ``progress`` (missing keys: a fresh start).

        The batch shape it was counted in is loaded too; :meth:`rebatch` then
        moves it to this run's. The best-metric rule stays this state's own.
        """
        self.epoch = int(progress.get("epoch", 0))
        self.step_in_epoch = int(progress.get("step_in_epoch", 0))
        self.global_step = int(progress.get("global_step", 0))
        self.samples_seen = int(progress.get("samples_seen", 0))
        self.nonfinite_streak = int(progress.get("nonfinite_streak", 0))
        self.skipped_steps = int(progress.get("skipped_steps", 0))
        self.train_seconds = float(progress.get("train_seconds", 0.0))
        self.best.value = progress.get("best_value")
        self.best.step = progress.get("best_step")
        self.global_batch = _int_or_none(progress.get("global_batch", self.global_batch))
        self.steps_per_epoch = _int_or_none(progress.get("steps_per_epoch", self.steps_per_epoch))
        self.world_size = int(progress.get("world_size") or self.world_size)

    @classmethod
    def from_progress(cls, progress: Mapping[str, Any] | None) -> "TrainState":
        """The state a checkpoint's ``progress`` describes, best-metric rule included (for readers)."""
        progress = dict(progress or {})
        state = cls(best=BestMetric(progress.get("best_metric"), progress.get("best_mode") or "min"))
        state.load_state_dict(progress)
        return state

    def rebatch(self, global_batch: int, world_size: int, steps_per_epoch: int) -> int | None:
        """Continue in this run's batch shape; return the old global batch if it changed mid-epoch.

        The samples already seen this epoch stay behind us as nearly as whole
        batches allow.
        """
        old = self.global_batch if self.global_batch is not None else global_batch
        changed = None
        if self.step_in_epoch and old != global_batch:
            self.step_in_epoch = (self.step_in_epoch * old) // global_batch
            changed = old
        self.global_batch, self.world_size, self.steps_per_epoch = global_batch, world_size, steps_per_epoch
        return changed

    def count_skip(self) -> int:
        """Count a step skipped for a non-finite loss or gradient; return the streak so far."""
        self.nonfinite_streak += 1
        self.skipped_steps += 1
        return self.nonfinite_streak

    def advance(self, *, skipped: bool) -> None:
        """One optimizer step (taken, or skipped after :meth:`count_skip`) of ``global_batch`` samples."""
        if not skipped:
            self.nonfinite_streak = 0
        self.global_step += 1
        self.samples_seen += self.global_batch or 0

    def epoch_done(self, epoch: int) -> None:
        self.epoch = epoch + 1
        self.step_in_epoch = 0


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


class MetricWindow:
    """What happened between two log lines: steps, loss, time, LR, gradient norm, task metrics.

    Step time is kept apart from wall time, so evaluation and checkpoint
    pauses do not read as a slowdown of training itself.
    """

    def __init__(self, lr: float = float("nan")):
        self.reset(lr)

    def reset(self, lr: float) -> None:
        self.steps = 0
        self.good_steps = 0
        self.loss_sum = 0.0
        self.step_time = 0.0
        self.data_time = 0.0
        self.lr = lr
        self.grad_norm: float | None = None
        self.task_metrics: dict[str, Any] = {}

    def add_task_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Sum one micro-batch's task metrics (kept as tensors: no device sync per step)."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if value.dtype != torch.float32:  # bf16 sums drift
                    value = value.float()
            else:
                value = float(value)
            self.task_metrics[name] = self.task_metrics.get(name, 0.0) + value

    def add_step(
        self, *, loss: float | None, lr: float, grad_norm: float | None, data_time: float, step_time: float
    ) -> None:
        """One optimizer step; ``loss`` is ``None`` for a skipped step (kept out of the mean)."""
        self.steps += 1
        if loss is not None:
            self.loss_sum += loss
            self.good_steps += 1
        self.lr = lr
        if grad_norm is not None:
            self.grad_norm = grad_norm
        self.data_time += data_time
        self.step_time += step_time

    @property
    def it_per_s(self) -> float:
        return self.steps / self.step_time if self.step_time > 0 else float("nan")

    def summary(self, *, global_batch: int, accumulation: int, skipped_steps: int) -> dict[str, float]:
        """The log line's metrics: means over the window's steps (task metrics over its micro-batches)."""
        it_s = self.it_per_s
        metrics: dict[str, float] = {
            "loss": self.loss_sum / self.good_steps if self.good_steps else float("nan"),
            "lr": self.lr,
            "it_per_s": it_s,
            "samples_per_s": it_s * global_batch,
            "data_wait_frac": self.data_time / self.step_time if self.step_time > 0 else 0.0,
            "skipped_steps": float(skipped_steps),
        }
        if self.grad_norm is not None:
            metrics["grad_norm"] = self.grad_norm
        for name, value in self.task_metrics.items():
            metrics[name] = float(value) / max(1, self.steps * accumulation)
        return metrics
