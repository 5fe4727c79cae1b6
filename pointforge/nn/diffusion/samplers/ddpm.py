"""DDPM: ancestral sampling over every step of the schedule (upstream PCDiff's sampler)."""

from __future__ import annotations

from typing import Optional

import torch

from pointforge.nn.diffusion.samplers.base import Sampler, StepOutput
from pointforge.nn.diffusion.schedule import NoiseSchedule

__all__ = ["DDPMSampler"]


class DDPMSampler(Sampler):
    """Ancestral sampling over every step with the fixed small posterior variance.

    No clipping of the predicted clean points, and no noise on the final (t = 0)
    step, as upstream PCDiff samples.
    """

    name = "ddpm"

    def __init__(self, schedule: Optional[NoiseSchedule] = None, start: Optional[int] = None):
        super().__init__(schedule, start=start)

    def __repr__(self) -> str:
        return f"DDPMSampler(steps={self.num_steps})"

    def _step(self, model_output, t, sample, noise, generator, previous):
        schedule = self.schedule
        eps, pred_x0 = schedule.eps_and_x0(model_output, t, sample)
        mean = (
            schedule.coefficient("posterior_mean_coef1", t, sample) * pred_x0
            + schedule.coefficient("posterior_mean_coef2", t, sample) * sample
        )
        std = torch.exp(0.5 * schedule.coefficient("posterior_log_variance_clipped", t, sample))
        nonzero = (t != 0).to(sample.dtype).reshape(-1, 1, 1)
        prev_sample = mean + nonzero * std * self._noise(noise, sample, generator)
        return StepOutput(prev_sample, pred_x0, eps, t)
