"""Noise schedules: shapes, endpoints, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointforge.errors import ConfigError, DataError, UserError
from pointforge.nn.diffusion.schedule import SCHEDULE_NAMES, NoiseSchedule, make_betas
from tests.nn.diffusion.common import SCHEDULE

# --------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("name,fraction", [("warm0.1", 0.1), ("warm0.2", 0.2), ("warm0.5", 0.5)])
@pytest.mark.parametrize("num_timesteps", [1000, 25])
def test_warm_schedules_ramp_then_hold_beta_end(name, fraction, num_timesteps):
    betas = make_betas(name, 1e-4, 0.02, num_timesteps)
    warmup = int(num_timesteps * fraction)  # 25 steps: 2, 5, 12 -- truncated, not rounded
    assert betas.dtype == np.float64 and betas.shape == (num_timesteps,)
    np.testing.assert_array_equal(betas[:warmup], np.linspace(1e-4, 0.02, warmup))
    np.testing.assert_array_equal(betas[warmup:], np.full(num_timesteps - warmup, 0.02))


def test_linear_schedule_endpoints_and_monotone_alphas():
    schedule = NoiseSchedule.from_name("linear", 1e-4, 0.02, 1000)
    assert schedule.num_timesteps == 1000
    assert schedule.betas_float64[0] == 1e-4 and schedule.betas_float64[-1] == 0.02
    assert bool((schedule.alphas_cumprod_float64.diff() < 0).all())
    assert set(SCHEDULE_NAMES) == {"linear", "warm0.1", "warm0.2", "warm0.5", "cosine"}


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(name="sigmoid"), "linear, warm0.1, warm0.2, warm0.5, cosine"),
        (dict(beta_start=0.0), "0 < beta_start"),
        (dict(beta_end=1.0), "0 < beta_start"),
        (dict(beta_start=0.03, beta_end=0.02), "beta_start <= beta_end"),
        (dict(beta_end=float("nan")), "finite"),
        (dict(beta_start="1e-4"), "number"),
        (dict(num_timesteps=1), "at least 2"),
        (dict(num_timesteps=10.0), "integer"),
        (dict(num_timesteps=True), "integer"),
    ],
)
def test_schedule_validation_errors(kwargs, fragment):
    with pytest.raises(ConfigError) as caught:
        NoiseSchedule.from_name(**kwargs)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, UserError)


@pytest.mark.parametrize(
    "betas", [np.zeros((2, 3)) + 0.01, [0.01], [0.01, 0.0], [1.0, 0.01], [0.01, 1.0], [0.01, float("inf")]]
)
def test_custom_betas_validation(betas):
    with pytest.raises(ConfigError):
        NoiseSchedule(betas)


def test_q_sample_rejects_bad_timesteps_and_noise():
    x0 = torch.zeros(2, 3, 4)
    with pytest.raises(DataError, match=r"\[0, 999\]"):
        SCHEDULE.q_sample(x0, torch.tensor([0, 1000]), torch.zeros_like(x0))
    with pytest.raises(DataError, match="integers"):
        SCHEDULE.q_sample(x0, torch.tensor([0.0, 1.0]), torch.zeros_like(x0))
    with pytest.raises(DataError, match="noise shape"):
        SCHEDULE.q_sample(x0, 3, torch.zeros(2, 3, 5))
