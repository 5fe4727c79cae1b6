"""Gaussian diffusion: upstream parity, schedules, and samplers checked against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointforge.errors import ConfigError, DataError, UserError
from pointforge.nn.diffusion.loss import diffusion_loss
from pointforge.nn.diffusion.pipeline import denoise, repeat_for_ensemble, sample_ensemble
from pointforge.nn.diffusion.samplers.base import SPACINGS, respaced_timesteps
from pointforge.nn.diffusion.samplers.ddim import DDIMSampler
from pointforge.nn.diffusion.samplers.ddpm import DDPMSampler
from pointforge.nn.diffusion.samplers.dpmpp_2m import DPMSolverPP2MSampler
from pointforge.nn.diffusion.samplers.registry import SAMPLER_NAMES, make_sampler
from pointforge.nn.diffusion.schedule import SCHEDULE_NAMES, NoiseSchedule, make_betas
from tests.helpers import FIXTURES

SCHEDULE = NoiseSchedule.from_name()


@pytest.fixture(scope="module")
def upstream():
    ref = torch.load(FIXTURES / "upstream_diffusion_tiny.pt", weights_only=True)
    notes = ref["notes"]
    # The facts these tests rely on, as the fixture states them.
    assert "x[..., :896] = conditioning" in notes and "NO clipping" in notes
    assert "CLAMPED to [-1,1]" in notes and "unique(round(linspace(0,999,50)))[::-1]" in notes
    assert ref["config"]["sv_points"] == 896 and ref["config"]["num_points"] == 1024
    return ref


N_GEN_FIXTURE = 128


class Replay:
    """Stands in for the fixture's tiny PVCNN2: insists on the reference input and
    returns the reference noise for the generated points. The conditioning part
    of its output is NaN, so any use of it would poison the result."""

    def __init__(self, x, t, eps):
        self.x, self.t, self.eps = x, t, eps

    def __call__(self, x, t):
        assert torch.equal(t, self.t) and t.dtype == torch.int64
        torch.testing.assert_close(x, self.x, rtol=0, atol=0)
        out = torch.full_like(x, float("nan"))
        out[:, :, -self.eps.shape[2] :] = self.eps
        return out


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def close(actual, expected, rtol=1e-5, atol=0.0):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- upstream parity


def test_schedule_tables_match_upstream(upstream):
    tables = upstream["schedule"]
    close(SCHEDULE.betas_float64, tables["betas_float64"])
    close(SCHEDULE.alphas_cumprod_float64, tables["alphas_cumprod_float64"])
    for name in NoiseSchedule.TABLE_NAMES:
        assert getattr(SCHEDULE, name).dtype == torch.float32, name
        close(getattr(SCHEDULE, name), tables[name])
    assert tables["posterior_log_variance_clipped"][0] == pytest.approx(np.log(1e-20), rel=1e-6)


def test_q_sample_matches_upstream(upstream):
    ref = upstream["q_sample"]
    x0_generated = upstream["x0"][:, :, -N_GEN_FIXTURE:]
    close(SCHEDULE.q_sample(x0_generated, ref["t"], ref["noise"]), ref["out"])


def test_loss_matches_upstream_mean_over_generated_points_then_batch(upstream):
    ref = upstream["loss"]
    model = Replay(ref["data_t"], ref["t"], ref["eps_pred"])
    kwargs = dict(t=ref["t"], noise=ref["noise"])
    x0 = upstream["x0"]
    per_example = diffusion_loss(model, SCHEDULE, x0, N_GEN_FIXTURE, reduction="none", **kwargs)
    loss = diffusion_loss(model, SCHEDULE, x0, N_GEN_FIXTURE, **kwargs)
    close(per_example, ref["losses"])
    close(loss, ref["loss"])
    assert loss.dim() == 0


def test_ddpm_step_matches_upstream_including_noiseless_t0(upstream):
    ref = upstream["p_sample"]
    assert ref["t"].tolist() == [0, 500]
    sample = ref["x_t"][:, :, -N_GEN_FIXTURE:]
    out = DDPMSampler().step(ref["eps_pred"], ref["t"], sample, noise=ref["noise"])
    close(out.prev_sample, ref["out"][:, :, -N_GEN_FIXTURE:])
    close(out.pred_x0, ref["pred_xstart"])
    # t = 0 adds no noise: the output is the posterior mean itself.
    close(out.prev_sample[0], ref["model_mean"][0])
    # Upstream's step leaves the conditioning points of its output as they were.
    close(ref["out"][:, :, :-N_GEN_FIXTURE], ref["x_t"][:, :, :-N_GEN_FIXTURE])


def test_ddim_step_matches_upstream_respaced_sampler(upstream):
    ref, respaced = upstream["ddim"], upstream["ddim_schedule"]
    sampler = DDIMSampler(50, 0.0, clamp=1.0)
    assert torch.equal(sampler.timesteps, respaced["timesteps"])
    kept = sampler.timesteps
    close(sampler.coefficient("alphas_cumprod", kept, ref["x_t"]).flatten(), respaced["alphas_cumprod_respaced"][kept])
    close(
        sampler.coefficient("alphas_cumprod_prev", kept, ref["x_t"]).flatten(),
        respaced["alphas_cumprod_prev_respaced"][kept],
    )
    out = sampler.step(ref["eps_pred"], ref["t"], ref["x_t"][:, :, -N_GEN_FIXTURE:], noise=ref["noise"])
    close(out.prev_sample, ref["out_test_completion"][:, :, -N_GEN_FIXTURE:])
    close(out.pred_x0, ref["pred_xstart"])


def test_ddim_without_clamp_is_upstream_output_before_its_clamp(upstream):
    ref = upstream["ddim"]
    out = DDIMSampler(50).step(ref["eps_pred"], ref["t"], ref["x_t"][:, :, -N_GEN_FIXTURE:]).prev_sample
    assert out.abs().max() > 1.5  # data at PCDiff's ±3 scale must not be squashed
    close(out.clamp(-1, 1), ref["out_test_completion"][:, :, -N_GEN_FIXTURE:])


def test_ddim_with_every_step_kept_is_upstream_unstrided_step(upstream):
    # With all 1000 steps kept the previous step is t - 1 and nothing is clamped:
    # exactly the step of upstream's training-time sampler. atol covers the
    # cancellation of |pred_x0| ~ 700 down to outputs ~ 1e-3 at float32.
    ref = upstream["ddim"]
    out = DDIMSampler(1000).step(ref["eps_pred"], ref["t"], ref["x_t"][:, :, -N_GEN_FIXTURE:]).prev_sample
    close(out, ref["out_train_completion"][:, :, -N_GEN_FIXTURE:], atol=2e-6)


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


# --------------------------------------------------------------------------- training loss


class CountingDenoiser(torch.nn.Module):
    """A tiny learnable denoiser that records what it was shown."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.seen = []

    def forward(self, x, t):
        self.seen.append((x.detach().clone(), t.clone(), torch.is_grad_enabled()))
        return self.scale * x


def test_loss_noises_only_generated_points_and_is_seeded():
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(3, 3, 20, generator=gen)
    model = CountingDenoiser()
    loss_a = diffusion_loss(model, SCHEDULE, x0, 6, generator=torch.Generator().manual_seed(7))
    loss_b = diffusion_loss(model, SCHEDULE, x0, 6, generator=torch.Generator().manual_seed(7))
    loss_c = diffusion_loss(model, SCHEDULE, x0, 6, generator=torch.Generator().manual_seed(8))
    assert loss_a.item() == loss_b.item() != loss_c.item()
    seen, t, _ = model.seen[0]
    assert torch.equal(seen[:, :, :14], x0[:, :, :14])
    assert not torch.allclose(seen[:, :, 14:], x0[:, :, 14:])
    assert t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) < 1000
    loss_a.backward()
    assert model.scale.grad is not None and model.scale.grad.abs() > 0


def test_loss_input_errors():
    model = CountingDenoiser()
    x0 = torch.zeros(2, 3, 8)
    with pytest.raises(DataError, match="exceeds"):
        diffusion_loss(model, SCHEDULE, x0, 9)
    with pytest.raises(DataError, match=r"\[B, C, N\]"):
        diffusion_loss(model, SCHEDULE, x0[0], 4)
    with pytest.raises(DataError, match="noise must be shaped"):
        diffusion_loss(model, SCHEDULE, x0, 4, noise=torch.zeros(2, 3, 8))
    with pytest.raises(ConfigError, match="reduction"):
        diffusion_loss(model, SCHEDULE, x0, 4, reduction="sum")
    with pytest.raises(ConfigError, match="denoiser returned"):
        diffusion_loss(lambda x, t: x[:, :, :3], SCHEDULE, x0, 4)


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
        (("ddim", 1), {}, "between 2 and 1000"),
        (("ddim", 1001), {}, "between 2 and 1000"),
        (("ddim", 50), dict(clamp=0.0), "clamp must be positive"),
        (("dpm++2m", 20), dict(spacing="karras"), "uniform, quadratic, logsnr"),
    ],
)
def test_make_sampler_errors(args, kwargs, fragment):
    with pytest.raises(ConfigError) as caught:
        make_sampler(*args, **kwargs)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    assert set(SAMPLER_NAMES) == {"ddpm", "ddim", "dpm++2m"}


@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("steps", [2, 10, 20, 50])
def test_respaced_grids_descend_from_last_step_to_zero(spacing, steps):
    grid = respaced_timesteps(SCHEDULE, steps, spacing)
    assert grid.dtype == torch.int64 and grid[0] == 999 and grid[-1] == 0
    assert bool((grid.diff() < 0).all()) and len(grid) <= steps
    if steps <= 20:
        assert len(grid) == steps


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


# Analytic denoiser: the generated points are i.i.d. Gaussian N(mu, s^2) per
# channel, with mu set by the conditioning points' mean, so the exact noise
# prediction is closed-form: eps(x_t) = sigma_t (x_t - a_t mu) / (a_t^2 s^2 + sigma_t^2).
OFFSET = torch.tensor([0.5, -1.0, 2.0])
SPREAD = torch.tensor([0.3, 1.0, 1.5])
N_COND, N_GEN = 64, 512


def gaussian_mean(cond):
    return cond.mean(dim=2, keepdim=True) + OFFSET.to(cond).view(1, 3, 1)


class GaussianDenoiser:
    def __init__(self, spread=SPREAD):
        self.spread = spread
        self.calls = []

    def __call__(self, x, t):
        self.calls.append((x.shape[0], x.dtype))
        cond, generated = x[:, :, :-N_GEN], x[:, :, -N_GEN:]
        a2 = SCHEDULE.alphas_cumprod_float64.to(x)[t].view(-1, 1, 1)
        spread = self.spread.to(x).view(1, 3, 1)
        eps = (1 - a2).sqrt() * (generated - a2.sqrt() * gaussian_mean(cond)) / (a2 * spread**2 + 1 - a2)
        return torch.cat([torch.zeros_like(cond), eps], dim=2)  # PVCNN2-style: all N points


def exact_flow_endpoint(cond, noise):
    """Where the probability-flow ODE takes ``noise`` at t = 999, as the clean
    estimate at t = 0: x_t = a_t mu + sqrt(a_t^2 s^2 + sigma_t^2) z for all t."""
    ac = SCHEDULE.alphas_cumprod_float64.to(cond)
    mu, spread = gaussian_mean(cond), SPREAD.to(cond).view(1, 3, 1)
    z = (noise - ac[-1].sqrt() * mu) / (ac[-1] * spread**2 + 1 - ac[-1]).sqrt()
    return mu + z * ac[0].sqrt() * spread**2 / (ac[0] * spread**2 + 1 - ac[0]).sqrt()


@pytest.fixture(scope="module")
def gaussian_case():
    gen = torch.Generator().manual_seed(0)
    cond = torch.randn(4, 3, N_COND, generator=gen)
    noise = torch.randn(4, 3, N_GEN, generator=gen)
    return cond, noise, exact_flow_endpoint(cond, noise)


def rms(a, b):
    return (a - b).pow(2).mean().sqrt().item()


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


# --------------------------------------------------------------------------- interface


class RecordingDenoiser(torch.nn.Module):
    """Learnable stand-in that records the conditioning part it is shown."""

    def __init__(self, n_generated):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(0.1))
        self.n_generated = n_generated
        self.conds, self.grad_enabled, self.batches = [], [], []

    def forward(self, x, t):
        self.conds.append(x[:, :, : -self.n_generated].clone())
        self.grad_enabled.append(torch.is_grad_enabled())
        self.batches.append(x.shape[0])
        return self.weight * x[:, :, -self.n_generated :]  # generated points only


SMALL = dict(n_cond=12, n_gen=5)
FAST_SAMPLERS = [DDPMSampler(), DDIMSampler(10, eta=0.7), DPMSolverPP2MSampler(10)]


@pytest.mark.parametrize("sampler", FAST_SAMPLERS, ids=lambda s: s.name)
def test_conditioning_points_never_change_and_no_graph_is_kept(sampler):
    cond = torch.randn(2, 3, SMALL["n_cond"], generator=torch.Generator().manual_seed(0))
    model = RecordingDenoiser(SMALL["n_gen"])
    progress = []
    out = denoise(
        model,
        sampler,
        cond,
        SMALL["n_gen"],
        generator=torch.Generator().manual_seed(1),
        progress=lambda done, total: progress.append((done, total)),
    )
    assert torch.equal(out[:, :, : SMALL["n_cond"]], cond)
    assert len(model.conds) == sampler.num_steps
    assert all(torch.equal(seen, cond) for seen in model.conds)
    assert not out.requires_grad and not any(model.grad_enabled)
    assert progress == [(i, sampler.num_steps) for i in range(1, sampler.num_steps + 1)]


@pytest.mark.parametrize("sampler", FAST_SAMPLERS, ids=lambda s: s.name)
def test_sampling_is_deterministic_under_a_generator(sampler):
    cond = torch.randn(2, 3, SMALL["n_cond"], generator=torch.Generator().manual_seed(0))
    model = RecordingDenoiser(SMALL["n_gen"])

    def run(seed):
        return denoise(model, sampler, cond, SMALL["n_gen"], generator=seeded(seed))

    first, again, other = run(11), run(11), run(12)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    # The starting noise is the generator's first draw, so passing it explicitly
    # reproduces a deterministic sampler's run.
    if sampler.name != "ddpm" and getattr(sampler, "eta", 0.0) == 0.0:
        start = torch.randn(2, 3, SMALL["n_gen"], generator=torch.Generator().manual_seed(11))
        assert torch.equal(denoise(model, sampler, cond, SMALL["n_gen"], noise=start), first)


def test_ensemble_is_one_batched_pass_of_independent_members():
    cond = torch.randn(3, SMALL["n_cond"], generator=torch.Generator().manual_seed(0))
    model = RecordingDenoiser(SMALL["n_gen"])
    sampler = DDIMSampler(10)
    members = sample_ensemble(model, sampler, cond, SMALL["n_gen"], 4, generator=torch.Generator().manual_seed(2))
    assert members.shape == (4, 3, SMALL["n_cond"] + SMALL["n_gen"])
    assert set(model.batches) == {4} and len(model.batches) == sampler.num_steps
    assert all(torch.equal(member[:, : SMALL["n_cond"]], cond) for member in members)
    assert not torch.allclose(members[0], members[1])
    # Each member is what a run of its own would give from the same start.
    starts = torch.randn(4, 3, SMALL["n_gen"], generator=torch.Generator().manual_seed(2))
    alone = denoise(model, sampler, cond[None], SMALL["n_gen"], noise=starts[2:3])
    close(members[2], alone[0], rtol=1e-6, atol=1e-6)


def test_repeat_for_ensemble_keeps_each_case_together():
    cond = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    repeated = repeat_for_ensemble(cond, 3)
    assert repeated.shape == (6, 3, 4)
    assert torch.equal(repeated[:3], cond[:1].expand(3, -1, -1))
    assert torch.equal(repeated[3:], cond[1:].expand(3, -1, -1))
    assert repeat_for_ensemble(cond[0], 2).shape == (2, 3, 4)
    with pytest.raises(ConfigError, match="ensemble size"):
        repeat_for_ensemble(cond, 0)
    out = sample_ensemble(RecordingDenoiser(2), DDIMSampler(5), cond, 2, 3)
    assert out.shape == (2, 3, 3, 6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sampling_keeps_the_conditioning_dtype(gaussian_case, dtype):
    cond, noise, exact = gaussian_case
    model = GaussianDenoiser()
    out = denoise(model, DPMSolverPP2MSampler(20), cond.to(dtype), N_GEN, noise=noise.to(dtype))
    assert out.dtype == dtype
    assert torch.equal(out[:, :, :N_COND], cond.to(dtype))
    # Reduced precision is stepped in float32; float64 stays float64 throughout.
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert {d for _, d in model.calls} == {work_dtype}
    tolerance = 0.015 if dtype == torch.float64 else 0.03
    assert rms(out[:, :, N_COND:].double(), exact.double()) < tolerance


def test_sample_input_errors():
    model = RecordingDenoiser(4)
    sampler = DDIMSampler(5)
    with pytest.raises(DataError, match=r"\[B, C, N\]"):
        denoise(model, sampler, torch.zeros(3, 10), 4)
    with pytest.raises(DataError, match="initial noise"):
        denoise(model, sampler, torch.zeros(1, 3, 10), 4, noise=torch.zeros(1, 3, 5))
    with pytest.raises(ConfigError, match="n_generated"):
        denoise(model, sampler, torch.zeros(1, 3, 10), 0)
    with pytest.raises(ConfigError, match="denoiser returned"):
        denoise(lambda x, t: x[:, :2], sampler, torch.zeros(1, 3, 10), 4)


# --------------------------------------------------------------------------- samplers without the network


@pytest.mark.parametrize("sampler", FAST_SAMPLERS, ids=lambda s: s.name)
def test_a_sampler_steps_a_given_output_with_no_network_anywhere(sampler):
    # Only tensors go in: the step is the sampler's arithmetic on the output it is handed.
    sample = torch.randn(2, 3, SMALL["n_gen"], generator=seeded(0), dtype=torch.float64)
    output = torch.randn(2, 3, SMALL["n_gen"], generator=seeded(1), dtype=torch.float64)
    noise = torch.randn(2, 3, SMALL["n_gen"], generator=seeded(2), dtype=torch.float64)
    t = int(sampler.timesteps[0])
    first = sampler.step(output, t, sample, noise=noise)
    again = sampler.step(output.clone(), torch.tensor([t, t]), sample.clone(), noise=noise)
    assert first.prev_sample.shape == sample.shape and first.prev_sample.dtype == torch.float64
    assert torch.equal(first.prev_sample, again.prev_sample)
    # The estimates are the schedule's reading of the output, whichever sampler steps it.
    eps, x0 = sampler.schedule.eps_and_x0(output, torch.tensor([t, t]), sample)
    assert torch.equal(first.eps, eps)
    close(first.pred_x0, x0, rtol=1e-12)
    # A multistep sampler takes the last step's output back; the others ignore it.
    second = sampler.step(output, int(sampler.timesteps[1]), first.prev_sample, noise=noise, previous=first)
    assert torch.isfinite(second.prev_sample).all()


def test_one_trained_network_runs_under_every_sampler_through_the_one_loop():
    torch.manual_seed(0)
    network = torch.nn.Conv1d(3, 3, 1).double()  # a stand-in for a trained PVCNN2: any callable works
    calls = []

    def network_fn(x, t):
        calls.append(t.clone())
        return network(x)

    cond = torch.randn(2, 3, SMALL["n_cond"], generator=seeded(3), dtype=torch.float64)
    for name in SAMPLER_NAMES:
        sampler = make_sampler(name, None if name == "ddpm" else 8)
        calls.clear()
        out = denoise(network_fn, sampler, cond, SMALL["n_gen"], generator=seeded(4))
        assert out.shape == (2, 3, SMALL["n_cond"] + SMALL["n_gen"]) and torch.isfinite(out).all(), name
        assert torch.equal(out[:, :, : SMALL["n_cond"]], cond), name
        # The loop called the network once per sampler step, at the sampler's steps, in order.
        assert [int(t[0]) for t in calls] == sampler.timesteps.tolist(), name
