"""Batch split, LR scaling and LR schedules."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pointforge.errors import ConfigError
from pointforge.train.schedule import (
    build_optimizer,
    build_scheduler,
    lr_factor,
    plan_batches,
    restore_scheduler,
    scale_lr,
)


def test_plan_splits_global_batch():
    plan = plan_batches(32, 4)
    assert (plan.micro_batch, plan.accumulation, plan.effective_batch) == (8, 1, 32)
    plan = plan_batches(32, 4, micro_batch=2)
    assert (plan.micro_batch, plan.accumulation, plan.effective_batch) == (2, 4, 32)


def test_plan_errors_name_nearest_valid_sizes():
    with pytest.raises(
        ConfigError, match=r"global_batch=10 cannot be split evenly over 4 devices.*global_batch=8 or 12"
    ):
        plan_batches(10, 4)
    with pytest.raises(ConfigError, match=r"micro_batch=3 does not divide the per-device batch 8.*micro_batch=2 or 4"):
        plan_batches(16, 2, micro_batch=3)
    with pytest.raises(ConfigError, match="larger than the per-device batch"):
        plan_batches(8, 2, micro_batch=5)


def test_lr_scaling_rules():
    assert scale_lr(1e-3, "none", 64, 16) == pytest.approx(1e-3)
    assert scale_lr(1e-3, "linear", 64, 16) == pytest.approx(4e-3)
    assert scale_lr(1e-3, "sqrt", 64, 16) == pytest.approx(2e-3)
    assert scale_lr(1e-3, "linear", 16, 16) == pytest.approx(1e-3)


def test_warmup_then_schedules():
    warm = lr_factor("constant", total_steps=100, warmup_steps=4)
    assert [round(warm(s), 3) for s in range(6)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    cos = lr_factor("cosine", total_steps=10, min_lr_ratio=0.1)
    assert cos(0) == pytest.approx(1.0)
    assert cos(5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cos(10) == pytest.approx(0.1)
    exp = lr_factor("exponential", total_steps=10, warmup_steps=2, gamma=0.5)
    assert [exp(s) for s in (2, 3, 4)] == [1.0, 0.5, 0.25]
    lin = lr_factor("linear", total_steps=11, warmup_steps=1, min_lr_ratio=0.2)
    assert [round(lin(s), 3) for s in (1, 6, 11, 50)] == [1.0, 0.6, 0.2, 0.2]


def test_decay_over_a_time_horizon_follows_the_clock_not_the_step():
    clock = {"seconds": 0.0}
    cos = lr_factor("cosine", total_steps=10, warmup_steps=2, progress=lambda _step: clock["seconds"] / 60.0)
    lin = lr_factor("linear", total_steps=10, min_lr_ratio=0.1, progress=lambda _step: clock["seconds"] / 60.0)
    assert cos(0) == pytest.approx(1 / 3)  # warm-up counts steps whatever the clock says
    assert cos(5) == pytest.approx(1.0) and lin(5) == pytest.approx(1.0)
    clock["seconds"] = 30.0  # half the horizon, whichever step this is
    assert cos(5) == pytest.approx(0.5) and cos(500) == pytest.approx(0.5)
    assert lin(7) == pytest.approx(0.1 + 0.9 * 0.5)
    clock["seconds"] = 90.0  # past the horizon: the floor
    assert cos(9) == pytest.approx(0.0) and lin(9) == pytest.approx(0.1)


def test_a_time_horizon_needs_a_decay_and_a_positive_length(tmp_path):
    from tests.helpers import TOY_TINY, quiet_config

    base = [f"run.dir={tmp_path}"]
    with pytest.raises(
        ConfigError, match="horizon_minutes' sets the length of a decay; use sched.name=cosine or linear"
    ):
        quiet_config("toy", TOY_TINY, *base, "sched.name=constant", "sched.horizon_minutes=5")
    with pytest.raises(ConfigError, match="horizon_minutes' must be positive"):
        quiet_config("toy", TOY_TINY, *base, "sched.horizon_minutes=0")
    assert (
        quiet_config("toy", TOY_TINY, *base, "sched.name=linear", "sched.horizon_minutes=5").sched.horizon_minutes == 5
    )


def _opt(lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_scheduler_restore_continues_and_never_rescales():
    sched_cfg = SimpleNamespace(name="cosine", warmup_steps=3, warmup_start_factor=0.0, min_lr_ratio=0.0, gamma=1.0)
    opt = _opt(0.4)
    sched = build_scheduler(opt, sched_cfg, total_steps=20)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    state = sched.state_dict()
    # Resume halfway: a fresh optimizer built from the config's LR, scheduler state loaded.
    opt2 = _opt(0.4)
    sched2 = build_scheduler(opt2, sched_cfg, total_steps=20)
    restore_scheduler(sched2, build_scheduler(_opt(0.4), sched_cfg, 20).state_dict(), [0.4])
    restore_scheduler(sched2, state, [0.4])
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] < 0.4  # warm-up did not restart
    # The stored base LR is ignored: the config's value wins, scaled once.
    opt3 = _opt(0.8)
    sched3 = build_scheduler(opt3, sched_cfg, total_steps=20)
    restore_scheduler(sched3, state, [0.8])
    assert opt3.param_groups[0]["lr"] == pytest.approx(2 * opt.param_groups[0]["lr"])
    assert not math.isclose(lrs[0], lrs[3])


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_runs_fused_and_updates_as_the_per_parameter_loop(name):
    """Fused where every parameter is a floating-point CPU/CUDA tensor; the same update
    as PyTorch's per-parameter loop up to float rounding, over a few steps."""
    cfg = SimpleNamespace(name=name, betas=(0.5, 0.999), eps=1e-8, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    fused_params = [torch.nn.Parameter(p.clone()) for p in start]
    loop_params = [torch.nn.Parameter(p.clone()) for p in start]
    fused = build_optimizer([{"params": fused_params}], cfg, 2e-3)
    loop_cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    loop = loop_cls(loop_params, lr=2e-3, betas=(0.5, 0.999), eps=1e-8, weight_decay=0.01, foreach=False)
    assert fused.defaults["fused"] is True
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in start]
        for params, opt in ((fused_params, fused), (loop_params, loop)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
    for a, b in zip(fused_params, loop_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # Not fusable (a complex parameter): PyTorch's default loop.
    assert not build_optimizer([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], cfg, 1e-3).defaults["fused"]
