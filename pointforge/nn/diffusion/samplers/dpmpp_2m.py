"""DPM-Solver++(2M) (Lu et al. 2022): a second-order multistep sampler for 10-20 steps."""

from __future__ import annotations

import math
from typing import Optional

import torch

from pointforge.nn.diffusion.samplers.base import Sampler, StepOutput
from pointforge.nn.diffusion.schedule import NoiseSchedule

__all__ = ["DPMSolverPP2MSampler"]


class DPMSolverPP2MSampler(Sampler):
    """DPM-Solver++ (2M): second-order multistep, data prediction (Lu et al. 2022).

    Runs on the discrete schedule at re-spaced integer steps (by default
    ``quadratic`` spacing, which on a Gaussian test case is several times more
    accurate at 10-20 steps than upstream's uniform one), with
    ``alpha_t = sqrt(ac[t])``, ``sigma_t = sqrt(1 - ac[t])`` and half-log-SNR
    ``lambda_t = log(alpha_t / sigma_t)``. The first step is first order (no
    history yet) and so is the last one, from ``t = 0`` to the clean cloud,
    where ``lambda`` is infinite and the update is the clean estimate itself.
    Deterministic: a step takes no fresh noise.
    """

    name = "dpm++2m"

    def __init__(
        self,
        steps: int = 20,
        *,
        spacing: str = "quadratic",
        schedule: Optional[NoiseSchedule] = None,
        start: Optional[int] = None,
    ):
        super().__init__(schedule, steps, spacing, start)
        ac = self.schedule.alphas_cumprod_float64
        self._alpha = torch.sqrt(ac)
        self._sigma = torch.sqrt(1.0 - ac)
        self._lambda = torch.log(self._alpha) - torch.log(self._sigma)

    def __repr__(self) -> str:
        return f"DPMSolverPP2MSampler(steps={self.num_steps}, spacing={self.spacing!r})"

    def _step(self, model_output, t, sample, noise, generator, previous):
        eps, pred_x0 = self.schedule.eps_and_x0(model_output, t, sample)

        # Step coefficients are [B] scalars: float64 on the CPU, then moved.
        t_cpu = t.cpu()
        nxt = self._next_step[t_cpu]
        final = nxt < 0
        safe_next = nxt.clamp_min(0)
        lam_s = self._lambda[t_cpu]
        lam_t = torch.where(final, torch.full_like(lam_s, math.inf), self._lambda[safe_next])
        sigma_ratio = torch.where(final, torch.zeros_like(lam_s), self._sigma[safe_next] / self._sigma[t_cpu])
        alpha_t = torch.where(final, torch.ones_like(lam_s), self._alpha[safe_next])
        h = lam_t - lam_s
        data_coef = -alpha_t * torch.expm1(-h)

        denoised = pred_x0
        if previous is not None:
            t_prev = previous.t.cpu()
            usable = (~final) & (t_prev > t_cpu)
            h_prev = torch.where(usable, lam_s - self._lambda[t_prev], torch.ones_like(lam_s))
            # D = x0 + (x0 - x0_prev) / (2 r), r = h_prev / h: the 2M extrapolation.
            weight = torch.where(usable, h / (2.0 * h_prev), torch.zeros_like(lam_s))
            weight = weight.to(device=sample.device, dtype=sample.dtype).reshape(-1, 1, 1)
            denoised = pred_x0 + weight * (pred_x0 - previous.pred_x0.to(sample.dtype))
        prev_sample = (
            sigma_ratio.to(device=sample.device, dtype=sample.dtype).reshape(-1, 1, 1) * sample
            + data_coef.to(device=sample.device, dtype=sample.dtype).reshape(-1, 1, 1) * denoised
        )
        return StepOutput(prev_sample, pred_x0, eps, t)
