"""Batch split, learning-rate scaling and learning-rate schedules.

``global_batch`` (samples per optimizer step, all ranks together) is the only
batch size a user states. :func:`plan_batches` derives the per-device
micro-batch and the gradient-accumulation count from it; :func:`scale_lr`
applies the LR scaling rule exactly once, from the config, never from a value
read back out of an optimizer or a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from pointforge.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    world_size: int
    micro_batch: int  # per device, per forward/backward
    accumulation: int  # micro-batches per optimizer step on each device

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size


def _nearest_multiples(value: int, unit: int) -> list[int]:
    low = (value // unit) * unit
    return sorted({m for m in (low, low + unit) if m > 0})


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0 for d in (i, n // i)})


def plan_batches(global_batch: int, world_size: int, micro_batch: int | None = None) -> BatchPlan:
    """Split ``global_batch`` over ``world_size`` devices, with accumulation if ``micro_batch`` is smaller.

    Raises ConfigError with the nearest valid sizes when the numbers do not divide.
    """
    if global_batch < 1 or world_size < 1:
        raise ConfigError(f"data.global_batch ({global_batch}) and the world size ({world_size}) must be positive")
    if global_batch % world_size:
        near = " or ".join(str(m) for m in _nearest_multiples(global_batch, world_size))
        raise ConfigError(
            f"data.global_batch={global_batch} cannot be split evenly over {world_size} devices; "
            f"use a multiple of {world_size}, e.g. data.global_batch={near}"
        )
    per_device = global_batch // world_size
    if micro_batch is None:
        return BatchPlan(global_batch, world_size, per_device, 1)
    if micro_batch > per_device:
        raise ConfigError(
            f"data.micro_batch={micro_batch} is larger than the per-device batch {per_device} "
            f"(data.global_batch={global_batch} over {world_size} devices); use data.micro_batch={per_device} or less"
        )
    if per_device % micro_batch:
        valid = [d for d in _divisors(per_device)]
        nearest = sorted(valid, key=lambda d: (abs(d - micro_batch), d))[:2]
        near_global = " or ".join(str(m) for m in _nearest_multiples(global_batch, world_size * micro_batch))
        raise ConfigError(
            f"data.micro_batch={micro_batch} does not divide the per-device batch {per_device} "
            f"(data.global_batch={global_batch} over {world_size} devices); "
            f"use data.micro_batch={' or '.join(map(str, sorted(nearest)))}, or data.global_batch={near_global}"
        )
    return BatchPlan(global_batch, world_size, micro_batch, per_device // micro_batch)


def scale_lr(lr: float, rule: str, global_batch: int, base_batch: int | None) -> float:
    """The learning rate for ``global_batch`` given ``lr`` tuned at ``base_batch``."""
    if rule == "none" or base_batch is None:
        return lr
    ratio = global_batch / base_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise ConfigError(f"optim.lr_scaling={rule!r} is not a scaling rule; valid choices: none, linear, sqrt")


SCHEDULES = ("constant", "cosine", "linear", "exponential")


def lr_factor(
    name: str,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_start_factor: float = 0.0,
    min_lr_ratio: float = 0.0,
    gamma: float = 0.999,
    progress: Callable[[int], float] | None = None,
) -> Callable[[int], float]:
    """The multiplier on the peak LR as a function of the optimizer step (0-based).

    The cosine and linear decays run over ``total_steps`` unless ``progress`` is
    given: then ``progress(step)`` is the fraction of the schedule behind (a
    training-time budget, see ``sched.horizon_minutes``). Warm-up counts steps.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"sched.name={name!r} is not a schedule; valid choices: {', '.join(SCHEDULES)}")

    def done(after: int) -> float:
        if progress is not None:
            return min(1.0, max(0.0, progress(after + warmup_steps)))
        return min(1.0, after / max(1, total_steps - warmup_steps))

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            # Step 0 already trains, so the ramp reaches the peak at step warmup_steps.
            return warmup_start_factor + (1.0 - warmup_start_factor) * (step + 1) / (warmup_steps + 1)
        after = step - warmup_steps
        if name == "constant":
            return 1.0
        if name == "exponential":
            return gamma**after
        shape = 1.0 - done(after) if name == "linear" else 0.5 * (1.0 + math.cos(math.pi * done(after)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, sched_cfg, total_steps: int, progress: Callable[[int], float] | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lr_factor(
            sched_cfg.name,
            total_steps=total_steps,
            warmup_steps=sched_cfg.warmup_steps,
            warmup_start_factor=sched_cfg.warmup_start_factor,
            min_lr_ratio=sched_cfg.min_lr_ratio,
            gamma=sched_cfg.gamma,
            progress=progress,
        ),
    )


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict, peak_lrs: list[float]) -> None:
    """Load a scheduler's position but keep the peak LR from the current config.

    The stored ``base_lrs`` are ignored on purpose: the LR is computed from the
    config once, so a resumed run can neither scale it twice nor silently keep
    an LR the user has since changed.
    """
    state = dict(state)
    state["base_lrs"] = list(peak_lrs)
    state.pop("_last_lr", None)
    scheduler.load_state_dict(state)
    for group, base, lam in zip(scheduler.optimizer.param_groups, peak_lrs, scheduler.lr_lambdas):
        group["lr"] = base * lam(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _fusable(params: list) -> bool:
    """Whether every parameter is a plain floating-point tensor on the CPU or one CUDA device,
    which PyTorch's fused Adam/AdamW kernels take."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return (
        bool(tensors)
        and all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() for p in tensors)
        and len({p.device for p in tensors}) == 1
        and tensors[0].device.type in ("cpu", "cuda")
    )


def build_optimizer(params, optim_cfg, lr: float) -> torch.optim.Optimizer:
    """The configured optimizer. Adam and AdamW run fused (one kernel for all parameters)
    where PyTorch can: the per-parameter loop dispatched ~10 small ops per tensor, a
    visible share of the tiny PCDiff step on one CPU thread (docs/experiments/benchmarks.md);
    the update is the same up to float rounding."""
    params = list(params)
    if optim_cfg.name in ("adam", "adamw"):
        adam = torch.optim.Adam if optim_cfg.name == "adam" else torch.optim.AdamW
        return adam(
            params,
            lr=lr,
            betas=tuple(optim_cfg.betas),
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
            fused=True if _fusable(params) else None,
        )
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=optim_cfg.momentum, nesterov=optim_cfg.nesterov, weight_decay=optim_cfg.weight_decay
        )
    raise ConfigError(f"optim.name={optim_cfg.name!r} is not an optimizer; valid choices: adam, adamw, sgd")
