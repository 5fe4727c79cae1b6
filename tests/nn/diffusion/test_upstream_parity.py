"""Schedule tables, q_sample, the loss and one DDPM and DDIM step against upstream PCDiff's diffusion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointforge.nn.diffusion.loss import diffusion_loss
from pointforge.nn.diffusion.samplers.ddim import DDIMSampler
from pointforge.nn.diffusion.samplers.ddpm import DDPMSampler
from pointforge.nn.diffusion.schedule import NoiseSchedule
from tests.nn.diffusion.common import SCHEDULE, close

N_GEN_FIXTURE = 128


class Replay:
    """Stands in for the fixture's tiny PVCNN2: insists on the reference input and
    returns the reference noise for the generated points. The conditioning part
    of its output is NaN, so any use of it would poison the result."""

    def __init__(self, x, t, eps):
        self.x, self.t, self.eps = x, t, eps

    def __call__(self, x, t):
        assert torch.equal(t, self.t) and t.dtype == torch.int64
        close(x, self.x)  # the same noised input, to float32 rounding (the CPU's vector width moves an ulp)
        out = torch.full_like(x, float("nan"))
        out[:, :, -self.eps.shape[2] :] = self.eps
        return out


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
