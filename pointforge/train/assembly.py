"""The engine's parts built, in the order every rank must agree on: :func:`assemble`.

The model and the datasets (the same seed on every rank for both, a per-rank
seed after), the run plan (global batch, steps, learning rate; its steps per
epoch checked equal across ranks) and the optimizer, schedule, scaler and EMA
the plan implies. :mod:`pointforge.train.engine` drives what this builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from pointforge.config.training import TrainConfig
from pointforge.train.checkpoint.manager import Trainables
from pointforge.train.data import derive_seed, seed_everything
from pointforge.train.dist import DistEnv, check_equal
from pointforge.train.ema import EMA
from pointforge.train.parallelize import to_channels_last
from pointforge.train.run_plan import RunPlan, make_plan
from pointforge.train.schedule import build_optimizer, build_scheduler
from pointforge.train.state import TrainState
from pointforge.train.task import Task

__all__ = ["Assembled", "assemble"]


@dataclass
class Assembled:
    """What a run trains: the model on its device, the datasets, the plan and the trainable parts."""

    model: nn.Module
    train_ds: Dataset
    val_ds: Dataset | None
    plan: RunPlan
    parts: Trainables


def assemble(task: Task, cfg: TrainConfig, env: DistEnv, state: TrainState) -> Assembled:
    """Build ``task``'s model and datasets, plan the run and the parts it implies; ``state`` learns the batch shape."""
    model, train_ds, val_ds = _model_and_data(task, cfg, env)
    plan = _plan(task, cfg, env, train_ds, val_ds)
    state.rebatch(plan.batch.global_batch, env.world_size, plan.steps_per_epoch)
    optimizer = build_optimizer(task.parameters(model), cfg.optim, plan.lr_scaled)
    parts = Trainables(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.sched, plan.total_steps, _time_progress(cfg, state)),
        scaler=torch.amp.GradScaler("cuda") if cfg.perf.amp == "fp16" else None,
        ema=EMA(model, cfg.train.ema_decay) if cfg.train.ema_decay else None,
    )
    return Assembled(model, train_ds, val_ds, plan, parts)


def _model_and_data(task: Task, cfg: TrainConfig, env: DistEnv) -> tuple[nn.Module, Dataset, Dataset | None]:
    # Same seed on every rank for the weights and the data; per-rank seeds after.
    seed_everything(derive_seed(cfg.train.seed, "init"))
    model = task.build_model(cfg.task)
    if not isinstance(model, nn.Module):
        raise TypeError(f"task {task.name!r} build_model returned {type(model).__name__}, not an nn.Module")
    if cfg.perf.channels_last:
        to_channels_last(model)
    model = model.to(env.device)
    train_ds, val_ds = task.build_datasets(cfg.task)
    seed_everything(derive_seed(cfg.train.seed, "rank", env.rank))
    return model, train_ds, val_ds


def _plan(task: Task, cfg: TrainConfig, env: DistEnv, train_ds: Dataset, val_ds: Dataset | None) -> RunPlan:
    """The run plan; under several ranks, their steps per epoch checked equal before the first step."""
    device = str(env.device)
    plan = make_plan(
        task,
        cfg,
        world_size=env.world_size,
        backend=env.backend or "single process",
        devices=[device] * env.world_size if env.world_size > 1 else [device],
        train_ds=train_ds,
        val_ds=val_ds,
        rank=env.rank,
    )
    if env.world_size > 1:
        # The plan each rank prints must agree; a rank whose view differs is
        # caught here rather than mid-epoch.
        check_equal(
            env,
            plan.steps_per_epoch,
            "the number of steps per epoch",
            "the task's batch_sampler must give every rank the same number of batches",
        )
    return plan


def _time_progress(cfg: TrainConfig, state: TrainState) -> Callable[[int], float] | None:
    """With ``sched.horizon_minutes``: the schedule's progress is training time, the same on every rank."""
    horizon = cfg.sched.horizon_minutes
    if horizon is None:
        return None
    return lambda _step: state.train_seconds / (horizon * 60)
