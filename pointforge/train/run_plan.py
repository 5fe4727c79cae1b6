"""The run as it will happen: batch split, learning rate, steps, checkpoints.

:func:`dry_run_plan` is what ``train --dry-run`` (and ``train --nproc``,
before it starts any process) prints; the engine makes the same
:class:`RunPlan` at start-up and logs it, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pointforge.config.training import TrainConfig
from pointforge.errors import ConfigError, DataError, DeviceError
from pointforge.train.checkpoint import format as ckpt_io
from pointforge.train.data import derive_seed, seed_everything
from pointforge.train.dist import probe_env, resolve_device
from pointforge.train.preflight import check_compile
from pointforge.train.schedule import BatchPlan, plan_batches, scale_lr
from pointforge.train.task import Task


@dataclass
class RunPlan:
    """Everything ``--dry-run`` prints: the run as it will happen."""

    task: str
    run_dir: Path
    world_size: int
    backend: str
    devices: list[str]
    batch: BatchPlan
    lr: float
    lr_scaled: float
    lr_scaling: str
    base_batch: int | None
    schedule: str
    train_size: int
    val_size: int | None
    steps_per_epoch: int
    epochs: int
    total_steps: int
    samples_dropped: int
    amp: str
    compile: bool
    tf32: bool
    ema_decay: float | None
    eval_on: str
    eval_every: int
    checkpoints: str
    workers: int
    existing_checkpoints: int = 0

    def lines(self) -> list[str]:
        b = self.batch
        accum = f" × {b.accumulation} accumulation steps" if b.accumulation > 1 else ""
        if self.lr_scaling == "none" or self.base_batch is None:
            lr = f"{self.lr:g} (no scaling)"
        else:
            lr = f"{self.lr:g} tuned for batch {self.base_batch}, {self.lr_scaling} scaling to batch {b.global_batch} → {self.lr_scaled:g}"
        devices = (
            ", ".join(self.devices)
            if len(set(self.devices)) > 1 or len(self.devices) == 1
            else f"{self.devices[0]} ×{len(self.devices)}"
        )
        val = f"{self.val_size} validation" if self.val_size is not None else "no validation set"
        dropped = f", {self.samples_dropped} dropped per epoch to keep batches whole" if self.samples_dropped else ""
        existing = (
            f" (holds {self.existing_checkpoints} checkpoint(s): add --resume auto to continue)"
            if self.existing_checkpoints
            else " (new)"
        )
        return [
            f"pointforge train {self.task} — plan",
            f"  run dir          {self.run_dir}{existing}",
            f"  world size       {self.world_size} ({self.backend}); devices: {devices}",
            f"  batch            global {b.global_batch} = {b.world_size} rank(s) × {b.micro_batch} per device{accum}",
            f"  effective batch  {b.effective_batch} samples per optimizer step",
            f"  learning rate    {lr}",
            f"  schedule         {self.schedule}",
            f"  data             {self.train_size} training samples, {val}; {self.steps_per_epoch} steps per epoch{dropped}",
            f"  length           {self.epochs} epoch(s) = {self.total_steps} optimizer steps",
            f"  precision        amp {self.amp}, compile {'on' if self.compile else 'off'}, tf32 {'on' if self.tf32 else 'off'}"
            + (f", EMA {self.ema_decay}" if self.ema_decay else ""),
            f"  evaluation       {'every ' + str(self.eval_every) + ' epoch(s) on ' + ('all ranks' if self.eval_on == 'all' else 'rank 0') if self.eval_every and self.val_size else 'off'}",
            f"  checkpoints      {self.checkpoints}",
            f"  loader workers   {self.workers} per rank",
        ]

    def text(self) -> str:
        return "\n".join(self.lines())


def _schedule_text(cfg: TrainConfig) -> str:
    s = cfg.sched
    warm = f"linear warm-up over {s.warmup_steps} steps, then " if s.warmup_steps else ""
    body = {
        "constant": "constant",
        "cosine": f"cosine decay to {s.min_lr_ratio:g}×lr",
        "linear": f"linear decay to {s.min_lr_ratio:g}×lr",
        "exponential": f"exponential decay ×{s.gamma:g} per step",
    }[s.name]
    if s.horizon_minutes is not None:
        body += f" over {s.horizon_minutes:g} min of training"
    return warm + body


def _ckpt_text(cfg: TrainConfig, best_metric: str | None, best_mode: str) -> str:
    c = cfg.ckpt
    when = []
    if c.every_steps:
        when.append(f"every {c.every_steps} steps")
    if c.every_minutes:
        when.append(f"every {c.every_minutes:g} min")
    when.append("at each epoch end")
    parts = [f"latest {', '.join(when)}"]
    if c.every_epochs:
        parts.append(f"epoch-NNNN every {c.every_epochs} epoch(s), keep {c.keep_last or 'all'}")
    if best_metric:
        parts.append(f"best by {best_metric} ({best_mode})")
    return "; ".join(parts)


def steps_per_epoch(
    task: Task, cfg: TrainConfig, train_ds: Any, batch: BatchPlan, rank: int, epoch: int = 0
) -> tuple[int, list[list[int]] | None]:
    custom = task.batch_sampler(
        train_ds,
        rank=rank,
        world_size=batch.world_size,
        micro_batch=batch.micro_batch,
        accumulation=batch.accumulation,
        seed=cfg.train.seed,
        epoch=epoch,
    )
    if custom is not None:
        batches = [list(b) for b in custom]
        return len(batches) // batch.accumulation, batches
    if len(train_ds) < batch.global_batch:
        raise DataError(
            f"the training set has {len(train_ds)} samples, fewer than data.global_batch={batch.global_batch}; lower data.global_batch or add data"
        )
    return len(train_ds) // batch.global_batch, None


def best_rule(task: Task, cfg: TrainConfig) -> tuple[str | None, str]:
    """The metric ``best.pt`` is chosen by, and whether lower or higher wins (config over task)."""
    return (cfg.ckpt.best_metric or task.best_metric, cfg.ckpt.best_mode or task.best_mode)


def make_plan(
    task: Task,
    cfg: TrainConfig,
    *,
    world_size: int,
    backend: str,
    devices: list[str],
    train_ds: Any,
    val_ds: Any,
    rank: int,
) -> RunPlan:
    check_compile(task, cfg.perf.compile).raise_if_failed()
    batch = plan_batches(cfg.data.global_batch, world_size, cfg.data.micro_batch)
    steps, custom = steps_per_epoch(task, cfg, train_ds, batch, rank)
    if steps < 1:
        raise ConfigError(
            f"an epoch would have no optimizer steps ({len(train_ds)} samples, global batch {batch.global_batch}); lower data.global_batch"
        )
    total = steps * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    best_metric, best_mode = best_rule(task, cfg)
    return RunPlan(
        task=task.name,
        run_dir=Path(cfg.run.dir),
        world_size=world_size,
        backend=backend,
        devices=devices,
        batch=batch,
        lr=cfg.optim.lr,
        lr_scaled=scale_lr(cfg.optim.lr, cfg.optim.lr_scaling, batch.global_batch, cfg.optim.base_batch),
        lr_scaling=cfg.optim.lr_scaling,
        base_batch=cfg.optim.base_batch,
        schedule=_schedule_text(cfg),
        train_size=len(train_ds),
        val_size=len(val_ds) if val_ds is not None else None,
        steps_per_epoch=steps,
        epochs=cfg.train.epochs,
        total_steps=total,
        samples_dropped=(len(train_ds) - steps * batch.global_batch) if custom is None else 0,
        amp=cfg.perf.amp,
        compile=cfg.perf.compile,
        tf32=cfg.perf.tf32,
        ema_decay=cfg.train.ema_decay,
        eval_on=getattr(task, "eval_on", "all"),
        eval_every=cfg.train.eval_every,
        checkpoints=_ckpt_text(cfg, best_metric, best_mode),
        workers=cfg.data.num_workers,
        existing_checkpoints=len(ckpt_io.resume_candidates(cfg.run.dir)),
    )


def dry_run_plan(task: Task, cfg: TrainConfig, *, world_size: int | None = None) -> RunPlan:
    """The plan for ``cfg`` without training (``world_size`` overrides the torchrun environment)."""
    task.configure(cfg.task)
    if world_size is None:
        env = probe_env(cfg.run.device)
        devices = [str(env.device)] if env.world_size == 1 else [str(env.device.type)] * env.world_size
        size = env.world_size
    else:
        first = resolve_device(cfg.run.device, local_rank=0, world_size=world_size)
        if first.type == "cuda":
            count = torch.cuda.device_count()
            if world_size > count:
                raise DeviceError(
                    f"--nproc {world_size} asks for {world_size} GPUs but {count} are visible; use --nproc {count} or fewer"
                )
            devices = [f"cuda:{i}" for i in range(world_size)]
        else:
            devices = ["cpu"] * world_size
        size = world_size
    backend: str = (
        cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if devices[0].startswith("cuda") else "gloo")
    )
    if size == 1:
        backend = "single process"
    seed_everything(derive_seed(cfg.train.seed, "init"))
    train_ds, val_ds = task.build_datasets(cfg.task)
    return make_plan(
        task, cfg, world_size=size, backend=backend, devices=devices, train_ds=train_ds, val_ds=val_ds, rank=0
    )
