"""What the diffusion tests share: the default schedule, seeded generators, a Gaussian case known in closed form."""

from __future__ import annotations

import torch

from pointforge.nn.diffusion.schedule import NoiseSchedule

SCHEDULE = NoiseSchedule.from_name()


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def close(actual, expected, rtol=1e-5, atol=2e-7):
    """Equal to float32 rounding: ``atol`` is a few float32 ulps at unit scale, since the same float32 sum
    rounds differently with the CPU's vector width (a value near zero then fails any relative bound)."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


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


def rms(a, b):
    return (a - b).pow(2).mean().sqrt().item()
