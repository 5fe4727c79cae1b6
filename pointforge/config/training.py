"""The training run's config: the engine's sections plus the task's own ``task`` section.

:class:`TrainConfig` has a common part that the engine reads (sections ``run``,
``train``, ``data``, ``optim``, ``sched``, ``perf``, ``ckpt``, ``dist``,
``log``) plus a ``task`` section whose dataclass the task declares
(``Task.Config``). :func:`resolve_train_config` builds one given that class;
:func:`pointforge.tasks.configs.load_train_config` looks it up by task name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pointforge.config.coercion import from_dict
from pointforge.config.loader import deep_merge, load_yaml, parse_overrides
from pointforge.errors import ConfigError

AmpMode = Literal["none", "bf16", "fp16"]


@dataclass
class RunSection:
    """Who and where: the task, the run directory and the device."""

    task: str = ""
    # {task} and {config} (the config file's stem) are filled in; the default
    # is deterministic so that a restarted job finds its own checkpoints.
    dir: str = "runs/{task}/{config}"
    # auto: cuda:LOCAL_RANK when CUDA is available, else cpu. "cuda:N" pins a
    # single-process run to one visible device.
    device: str = "auto"


@dataclass
class TrainSection:
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; stops early when reached
    # Wall-clock budget of one launch, in minutes: training stops at the first
    # step boundary past it (all ranks at the same step), saves and finishes.
    max_minutes: float | None = None
    seed: int = 0
    eval_every: int = 1  # epochs; 0 = never
    max_nonfinite: int = 5  # consecutive skipped steps before the run aborts
    grad_clip: float | None = None  # max global gradient norm
    ema_decay: float | None = None
    eval_ema: bool = True  # evaluate the EMA weights when EMA is on

    def validate(self, prefix: str) -> None:
        if self.epochs < 1:
            raise ConfigError(f"config key '{prefix}.epochs' must be at least 1, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"config key '{prefix}.max_steps' must be at least 1 or null, got {self.max_steps}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"config key '{prefix}.max_minutes' must be positive or null, got {self.max_minutes}")
        if self.max_nonfinite < 1:
            raise ConfigError(f"config key '{prefix}.max_nonfinite' must be at least 1, got {self.max_nonfinite}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"config key '{prefix}.ema_decay' must lie in (0, 1) or be null, got {self.ema_decay}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"config key '{prefix}.grad_clip' must be positive or null, got {self.grad_clip}")


@dataclass
class DataSection:
    # The batch per optimizer step summed over all ranks. Everything else
    # (per-device batch, accumulation) is derived from it.
    global_batch: int = 8
    # Per-device micro-batch; null = global_batch / world_size (no accumulation).
    micro_batch: int | None = None
    num_workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = True  # only takes effect on CUDA
    persistent_workers: bool = False
    worker_timeout_s: float = 300.0  # a stuck worker raises instead of hanging; 0 = wait forever

    def validate(self, prefix: str) -> None:
        if self.global_batch < 1:
            raise ConfigError(f"config key '{prefix}.global_batch' must be at least 1, got {self.global_batch}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ConfigError(f"config key '{prefix}.micro_batch' must be at least 1 or null, got {self.micro_batch}")
        if self.num_workers < 0:
            raise ConfigError(f"config key '{prefix}.num_workers' must be 0 or more, got {self.num_workers}")
        if self.prefetch_factor < 1:
            raise ConfigError(f"config key '{prefix}.prefetch_factor' must be at least 1, got {self.prefetch_factor}")
        if self.worker_timeout_s < 0:
            raise ConfigError(f"config key '{prefix}.worker_timeout_s' must be 0 or more, got {self.worker_timeout_s}")


@dataclass
class OptimSection:
    name: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = 1e-3  # tuned for base_batch; scaled once by lr_scaling
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch: int | None = None  # the global batch `lr` was tuned for

    def validate(self, prefix: str) -> None:
        if self.lr <= 0:
            raise ConfigError(f"config key '{prefix}.lr' must be positive, got {self.lr}")
        if self.lr_scaling != "none" and self.base_batch is None:
            raise ConfigError(
                f"config key '{prefix}.lr_scaling={self.lr_scaling}' needs '{prefix}.base_batch', the global batch that {prefix}.lr was tuned for"
            )
        if self.base_batch is not None and self.base_batch < 1:
            raise ConfigError(f"config key '{prefix}.base_batch' must be at least 1, got {self.base_batch}")


@dataclass
class SchedSection:
    name: Literal["constant", "cosine", "linear", "exponential"] = "constant"
    warmup_steps: int = 0  # linear ramp from warmup_start_factor·lr to lr
    warmup_start_factor: float = 0.0
    min_lr_ratio: float = 0.0  # cosine, linear: final lr as a fraction of the peak
    gamma: float = 0.999  # exponential: lr factor per optimizer step after warm-up
    # cosine, linear: decay over this many minutes of training (rank 0's clock,
    # summed over resumed launches) instead of over the run's optimizer steps;
    # for time-budgeted runs (train.max_minutes), where the step count is unknown.
    horizon_minutes: float | None = None

    def validate(self, prefix: str) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"config key '{prefix}.warmup_steps' must be 0 or more, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_start_factor <= 1.0:
            raise ConfigError(
                f"config key '{prefix}.warmup_start_factor' must lie in [0, 1], got {self.warmup_start_factor}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"config key '{prefix}.min_lr_ratio' must lie in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"config key '{prefix}.gamma' must lie in (0, 1], got {self.gamma}")
        if self.horizon_minutes is not None:
            if not self.horizon_minutes > 0:
                raise ConfigError(
                    f"config key '{prefix}.horizon_minutes' must be positive or null, got {self.horizon_minutes}"
                )
            if self.name not in ("cosine", "linear"):
                raise ConfigError(
                    f"config key '{prefix}.horizon_minutes' sets the length of a decay; "
                    f"use {prefix}.name=cosine or linear with it (got {self.name})"
                )


@dataclass
class PerfSection:
    amp: AmpMode = "none"  # bf16 on CUDA or CPU; fp16 (with a GradScaler) on CUDA only
    compile: bool = False
    tf32: bool = True  # TF32 matmuls/convolutions on Ampere and newer GPUs
    threads: int | None = None  # intra-op CPU threads; null = torch's default
    channels_last: bool = False  # store 4-D/5-D conv weights channels-last


@dataclass
class CkptSection:
    every_steps: int = 0  # write `latest` every N optimizer steps (0 = off)
    every_minutes: float = 10.0  # and/or every N minutes (0 = off); always at epoch ends
    every_epochs: int = 1  # keep a periodic epoch-NNNN checkpoint every N epochs (0 = off)
    keep_last: int = 3  # periodic checkpoints kept
    best_metric: str | None = None  # validation metric for `best`; null = the task's default
    best_mode: Literal["min", "max"] | None = None  # null = the task's default

    def validate(self, prefix: str) -> None:
        for name in ("every_steps", "every_epochs", "keep_last"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config key '{prefix}.{name}' must be 0 or more, got {getattr(self, name)}")
        if self.every_minutes < 0:
            raise ConfigError(f"config key '{prefix}.every_minutes' must be 0 or more, got {self.every_minutes}")


@dataclass
class DistSection:
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = 600.0  # a collective that waits longer than this ends the job
    # How long other ranks wait for rank-0-only work (evaluation, saving). They
    # wait outside any collective, so this may be far longer than timeout_s.
    rank0_timeout_s: float = 7200.0
    find_unused_parameters: bool = False  # DDP: needed only if some parameters get no gradient in a step

    def validate(self, prefix: str) -> None:
        if self.timeout_s <= 0 or self.rank0_timeout_s <= 0:
            raise ConfigError(f"config keys '{prefix}.timeout_s' and '{prefix}.rank0_timeout_s' must be positive")


@dataclass
class LogSection:
    every_steps: int = 10
    tensorboard: bool = True
    csv: bool = True
    wandb: bool = False
    wandb_project: str = "pointforge"
    wandb_entity: str | None = None
    progress: Literal["auto", "on", "off"] = "auto"  # auto: a bar when stderr is a terminal

    def validate(self, prefix: str) -> None:
        if self.every_steps < 1:
            raise ConfigError(f"config key '{prefix}.every_steps' must be at least 1, got {self.every_steps}")


@dataclass
class TrainConfig:
    """A training run: the engine's sections plus the task's own ``task`` section."""

    run: RunSection = field(default_factory=RunSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    sched: SchedSection = field(default_factory=SchedSection)
    perf: PerfSection = field(default_factory=PerfSection)
    ckpt: CkptSection = field(default_factory=CkptSection)
    dist: DistSection = field(default_factory=DistSection)
    log: LogSection = field(default_factory=LogSection)
    task: Any = None

    def run_dir(self) -> Path:
        return Path(self.run.dir)


def resolve_train_config(
    task_name: str,
    task_config: type,
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    data: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """Resolve a training config for task ``task_name`` whose section class is ``task_config``.

    Preset file (or ``data``), then overrides; ``run.dir`` placeholders are
    filled in, so the result is exactly what the run will use and what gets
    saved beside it. The task's class is a parameter, not looked up here: the
    task registry sits layers above this module, and
    :func:`pointforge.tasks.configs.load_train_config` does the lookup.
    """
    raw = dict(data) if data is not None else (load_yaml(path) if path is not None else {})
    raw = deep_merge(raw, parse_overrides(overrides))
    run = raw.get("run") or {}
    named = run.get("task") if isinstance(run, Mapping) else None
    if named not in (None, "", task_name):
        raise ConfigError(
            f"config file {path} is for task '{named}' but task '{task_name}' was asked for; pick the matching task or config"
        )
    cfg = from_dict(TrainConfig, raw, types={"task": task_config})
    cfg.run.task = task_name
    config_stem = Path(path).stem if path is not None else "default"
    try:
        cfg.run.dir = cfg.run.dir.format(task=task_name, config=config_stem)
    except (KeyError, IndexError, ValueError):
        raise ConfigError(
            f"config key 'run.dir' = {cfg.run.dir!r} may only use the placeholders {{task}} and {{config}}"
        ) from None
    return cfg


def stored_task_name(data: Mapping[str, Any]) -> str:
    """The ``run.task`` of a resolved config (from a checkpoint or a run dir's config.yaml)."""
    run = data.get("run") or {}
    name = run.get("task") if isinstance(run, Mapping) else None
    if not name:
        raise ConfigError("this config has no run.task; it was not written by pointforge train")
    return str(name)
