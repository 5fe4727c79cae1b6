"""The engine's evaluator: a task's ``evaluate`` hook, run where the task asks, combined across ranks.

``Task.eval_on == "all"``: every rank evaluates its shard of the validation
set and the results are combined as means weighted by shard size.
``"rank0"``: rank 0 evaluates the whole set inside ``rank0_section`` (the
other ranks wait outside any collective) and the result is shared. Either
way every rank returns the same metrics, so every rank records the same best.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from pointforge.config import TrainConfig
from pointforge.train.data import build_loader, derive_seed, eval_shard, shutdown_loader, worker_errors
from pointforge.train.dist import DistEnv, all_gather_objects, rank0_section, report
from pointforge.train.task import EvalContext, Task


class Evaluator:
    """Evaluates a model on the validation set after an epoch; holds what does not change between epochs."""

    def __init__(
        self,
        task: Task,
        cfg: TrainConfig,
        env: DistEnv,
        val_ds: Any,
        *,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        micro_batch: int,
        run_dir: Path,
    ):
        self.task = task
        self.cfg = cfg
        self.env = env
        self.val_ds = val_ds
        self.device = device
        self.amp_dtype = amp_dtype
        self.micro_batch = micro_batch
        self.run_dir = run_dir

    def due(self, epoch: int) -> bool:
        """Whether ``epoch`` ends with an evaluation (``train.eval_every``, and always the last epoch)."""
        every, epochs = self.cfg.train.eval_every, self.cfg.train.epochs
        return self.val_ds is not None and bool(every) and ((epoch + 1) % every == 0 or epoch + 1 == epochs)

    def evaluate(self, model: nn.Module, epoch: int, global_step: int) -> dict[str, float]:
        """The task's metrics for ``model`` after ``epoch``: the same dict on every rank."""
        env, micro = self.env, self.micro_batch
        out_dir = self.run_dir / "eval" / f"epoch-{epoch:04d}"
        report(env, "evaluating", epoch=epoch)
        if getattr(self.task, "eval_on", "all") == "rank0":

            def work() -> dict[str, float]:
                shard = eval_shard(len(self.val_ds), rank=0, world_size=1, batch=micro)
                metrics, _ = self._run(model, shard, out_dir, epoch, global_step)
                return metrics

            timeout = self.cfg.dist.rank0_timeout_s
            metrics = rank0_section(env, f"evaluating epoch {epoch}", work, timeout_s=timeout) or {}
        else:
            mine = eval_shard(len(self.val_ds), rank=env.rank, world_size=env.world_size, batch=micro)
            rank_dir = out_dir if env.rank == 0 else out_dir / f"rank-{env.rank}"
            local = self._run(model, mine, rank_dir, epoch, global_step)
            metrics = weighted_mean(all_gather_objects(env, local))
        return {k: float(v) for k, v in metrics.items()}

    def _run(
        self, model: nn.Module, batches: list[list[int]], out_dir: Path, epoch: int, global_step: int
    ) -> tuple[dict[str, float], int]:
        """This rank's evaluation of ``batches`` of the validation set: (metrics, samples)."""
        cfg, env = self.cfg, self.env
        n = sum(len(b) for b in batches)
        gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "eval", env.rank, epoch))
        loader = build_loader(
            self.val_ds,
            batches,
            collate_fn=self.task.collate,
            data_cfg=cfg.data,
            pin_memory=bool(cfg.data.pin_memory and self.device.type == "cuda"),
            generator=gen,
            persistent=False,
        )
        ctx = EvalContext(
            epoch=epoch,
            global_step=global_step,
            device=self.device,
            rank=env.rank,
            world_size=env.world_size,
            amp_dtype=self.amp_dtype,
            out_dir=out_dir,
            micro_batch=self.micro_batch,
        )
        was_training = model.training
        model.eval()
        try:
            autocast = torch.autocast(
                self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
            )
            with torch.no_grad(), autocast, worker_errors():
                result = self.task.evaluate(model, loader, ctx) if n else {}
        finally:
            model.train(was_training)
            shutdown_loader(loader)
        return {k: float(v) for k, v in dict(result or {}).items()}, n


def weighted_mean(parts: list[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """Per-rank metric dicts combined as means weighted by each rank's sample count."""
    totals: dict[str, float] = {}
    weights: dict[str, int] = {}
    for metrics, n in parts:
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) * n
            weights[name] = weights.get(name, 0) + n
    return {name: totals[name] / weights[name] for name in totals if weights[name] > 0}
