"""Samplers: construction, respaced grids, and their flows checked against a Gaussian case known in closed form."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.pipeline import denoise
from pointforge.nn.diffusion.samplers.base import SPACINGS, respaced_timesteps
from pointforge.nn.diffusion.samplers.ddim import DDIMSampler
from pointforge.nn.diffusion.samplers.ddpm import DDPMSampler
from pointforge.nn.diffusion.samplers.dpmpp_2m import DPMSolverPP2MSampler
from pointforge.nn.diffusion.samplers.registry import SAMPLER_NAMES, make_sampler
from tests.nn.diffusion.common import (
    N_COND,
    N_GEN,
    SCHEDULE,
    SPREAD,
    GaussianDenoiser,
    close,
    gaussian_mean,
    rms,
    seeded,
)

# --------------------------------------------------------------------------- samplers


@pytest.mark.parametrize(
    "name,steps,kwargs,cls,expected_steps",
    [
        ("ddpm", None, {}, DDPMSampler, 1000),
        ("DDIM", None, {}, DDIMSampler, 50),
        ("ddim", 20, dict(eta=0.5, clamp=1.0), DDIMSampler, 20),
        ("dpm++2m", None, {}, DPMSolverPP2MSampler, 20),
        ("dpm++2m", 10, dict(spacing="logsnr"), DPMSolverPP2MSampler, 10),
    ],
)
def test_make_sampler(name, steps, kwargs, cls, expected_steps):
    sampler = make_sampler(name, steps, **kwargs)
    assert type(sampler) is cls and sampler.num_steps == expected_steps
    assert sampler.timesteps[0] == 999 and sampler.timesteps[-1] == 0


@pytest.mark.parametrize(
    "args,kwargs,fragment",
    [
        (("euler",), {}, "ddpm, ddim, dpm++2m"),
        (("ddpm", 50), {}, "use ddim or dpm++2m"),
        (("dpm++2m", 20, 0.5), {}, "eta applies to the ddim"),
        (("ddpm",), dict(clamp=1.0), "clamp applies to the ddim"),
        (("ddpm",), dict(spacing="uniform"), "spacing applies"),
        (("ddim", 50, 1.5), {}, "eta must lie in [0, 1]"),
        (("ddim", 0), {}, "between 1 and 1000"),
        (("ddim", 1001), {}, "between 1 and 1000"),
        (("ddim", 50), dict(clamp=0.0), "clamp must be positive"),
        (("dpm++2m", 20), dict(spacing="karras"), "uniform, quadratic, logsnr, trailing"),
    ],
)
def test_make_sampler_errors(args, kwargs, fragment):
    with pytest.raises(ConfigError) as caught:
        make_sampler(*args, **kwargs)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    assert set(SAMPLER_NAMES) == {"ddpm", "ddim", "dpm++2m"}


@pytest.mark.parametrize("spacing", [s for s in SPACINGS if s != "trailing"])
@pytest.mark.parametrize("steps", [2, 10, 20, 50])
def test_respaced_grids_descend_from_last_step_to_zero(spacing, steps):
    grid = respaced_timesteps(SCHEDULE, steps, spacing)
    assert grid.dtype == torch.int64 and grid[0] == 999 and grid[-1] == 0
    assert bool((grid.diff() < 0).all()) and len(grid) <= steps
    if steps <= 20:
        assert len(grid) == steps


def test_a_trailing_grid_spends_no_call_at_the_clean_end_and_one_step_jumps_there():
    assert respaced_timesteps(SCHEDULE, 2, "trailing").tolist() == [999, 500]
    assert respaced_timesteps(SCHEDULE, 4, "trailing", start=99).tolist() == [99, 74, 50, 25]
    for spacing in SPACINGS:
        assert respaced_timesteps(SCHEDULE, 1, spacing, start=40).tolist() == [40]
    # One DDIM step lands on the clean estimate itself.
    sample, output = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    one = DDIMSampler(1, schedule=SCHEDULE, start=40)
    stepped = one.step(output, 40, sample)
    assert torch.allclose(stepped.prev_sample, stepped.pred_x0)


def test_a_step_under_grad_is_differentiable_and_under_no_grad_records_nothing():
    sampler = DDIMSampler(2, spacing="trailing", schedule=SCHEDULE)
    output = torch.randn(2, 3, 5, requires_grad=True)
    sample = torch.randn(2, 3, 5)
    sampler.step(output, 999, sample).prev_sample.sum().backward()
    assert output.grad is not None and bool(output.grad.abs().sum() > 0)
    with torch.no_grad():
        assert not sampler.step(output, 999, sample).prev_sample.requires_grad


def test_quadratic_grid_is_denser_at_low_noise():
    uniform = respaced_timesteps(SCHEDULE, 20, "uniform")
    quadratic = respaced_timesteps(SCHEDULE, 20, "quadratic")
    assert (quadratic < 100).sum() > (uniform < 100).sum()


def test_step_rejects_steps_off_the_grid():
    sample = output = torch.zeros(2, 3, 4)
    with pytest.raises(DataError, match="not among them"):
        DDIMSampler(50).step(output, torch.tensor([999, 998]), sample)
    with pytest.raises(DataError, match="not among them"):
        DPMSolverPP2MSampler(20).step(output, 500, sample)
    with pytest.raises(DataError, match="step noise"):
        DDPMSampler().step(output, 5, sample, noise=torch.zeros(2, 3, 10))
    with pytest.raises(DataError, match="model output"):
        DDPMSampler().step(torch.zeros(2, 3, 10), 5, sample)


@pytest.mark.parametrize(
    "sampler,bound",
    [(DDIMSampler(50), 0.06), (DPMSolverPP2MSampler(20), 0.015), (DDIMSampler(1000), 0.004)],
    ids=["ddim50", "dpm++2m-20", "ddim1000"],
)
def test_deterministic_samplers_follow_the_exact_flow(gaussian_case, sampler, bound):
    cond, noise, exact = gaussian_case
    out = denoise(GaussianDenoiser(), sampler, cond, N_GEN, noise=noise)
    assert out.shape == (4, 3, N_COND + N_GEN) and out.dtype == torch.float32
    assert rms(out[:, :, N_COND:], exact) < bound


def test_dpm_solver_is_second_order(gaussian_case):
    cond, noise, exact = gaussian_case
    error = {}
    for steps in (10, 20):
        for sampler in (DDIMSampler(steps, spacing="quadratic"), DPMSolverPP2MSampler(steps)):
            out = denoise(GaussianDenoiser(), sampler, cond, N_GEN, noise=noise)
            error[sampler.name, steps] = rms(out[:, :, N_COND:], exact)
    # Same grid, same evaluations: the multistep correction must beat DDIM (its
    # first-order special case) by far, and halve its error more than twice over.
    assert error["dpm++2m", 20] < error["ddim", 20] / 4
    assert error["dpm++2m", 10] / error["dpm++2m", 20] > 3


def test_ddpm_and_fast_samplers_reach_the_known_distribution(gaussian_case):
    cond, noise, _ = gaussian_case
    mu = gaussian_mean(cond)
    stats = {}
    # Allowed spread error: first-order DDIM-50 under-disperses the narrowest
    # channel (s = 0.3) by about 9 %, the others stay within sampling noise.
    # Ancestral DDIM needs many steps (at 50 it under-disperses by 18 %, as
    # coarse ancestral steps with the posterior variance do), hence 500.
    runs = [
        ("ddpm", DDPMSampler(), dict(generator=seeded(1)), 0.07),
        ("ddim50", DDIMSampler(50), dict(noise=noise), 0.12),
        ("ddim500-eta1", DDIMSampler(500, eta=1.0), dict(generator=seeded(2)), 0.07),
        ("dpm20", DPMSolverPP2MSampler(20), dict(noise=noise), 0.07),
    ]
    for label, sampler, kwargs, spread_tolerance in runs:
        standardised = denoise(GaussianDenoiser(), sampler, cond, N_GEN, **kwargs)[:, :, N_COND:] - mu
        stats[label] = (
            standardised.mean(dim=(0, 2)) / SPREAD,
            standardised.std(dim=(0, 2)) / SPREAD,
        )
        # 2,048 draws per channel: the mean's standard error is 0.022 of the spread.
        assert stats[label][0].abs().max() < 0.1, label
        assert (stats[label][1] - 1).abs().max() < spread_tolerance, label
    assert (stats["dpm20"][1] - stats["ddpm"][1]).abs().max() < 0.07
    assert (stats["ddim50"][1] - stats["ddpm"][1]).abs().max() < 0.1


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_point_mass_data_is_recovered_exactly(name):
    # Data = one point per channel: the clean estimate is exact at every step, so
    # every sampler must return it whatever the start. Float64, because upstream's
    # float32 tables make DDPM's last step scale it by coef1[0] = 0.99983, not 1.
    cond = torch.randn(2, 3, N_COND, generator=seeded(5), dtype=torch.float64)
    model = GaussianDenoiser(spread=torch.zeros(3))
    out = denoise(model, make_sampler(name), cond, N_GEN, generator=seeded(6))
    close(out[:, :, N_COND:], gaussian_mean(cond).expand(-1, -1, N_GEN), rtol=0, atol=1e-9)


@pytest.mark.parametrize("t", [[999, 500, 1], [0, 2, 998]])
def test_ddim_at_eta_one_on_every_step_is_ddpm(t):
    # Keeping every step, ancestral DDIM (eta = 1) has DDPM's posterior mean and
    # variance: the two steps must agree for the same noise.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 3, 30, generator=gen, dtype=torch.float64)
    noise = torch.randn(3, 3, 10, generator=gen, dtype=torch.float64)
    eps = torch.randn(3, 3, 10, generator=gen, dtype=torch.float64)
    t = torch.tensor(t)
    ddim = DDIMSampler(1000, eta=1.0).step(eps, t, x[:, :, 20:], noise=noise)
    ddpm = DDPMSampler().step(eps, t, x[:, :, 20:], noise=noise)
    close(ddim.prev_sample, ddpm.prev_sample, rtol=0, atol=1e-10)


def test_ddim_eta_scales_fresh_noise_as_in_the_ddim_paper():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 16, generator=gen, dtype=torch.float64)
    noise = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)
    eps = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)
    sampler = DDIMSampler(50, eta=0.6)
    t = torch.tensor([999, 510])
    out = sampler.step(eps, t, x[:, :, 10:], noise=noise).prev_sample
    ac = SCHEDULE.alphas_cumprod_float64
    ab, ab_prev = ac[[999, 510]].view(2, 1, 1), ac[[979, 489]].view(2, 1, 1)
    x0 = (x[:, :, 10:] - (1 - ab).sqrt() * eps) / ab.sqrt()
    sigma = 0.6 * ((1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev)).sqrt()
    expected = ab_prev.sqrt() * x0 + (1 - ab_prev - sigma**2).sqrt() * eps + sigma * noise
    close(out, expected, rtol=1e-9, atol=1e-12)
