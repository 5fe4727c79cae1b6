"""DDIM (Song et al. 2021) on a re-spaced grid of the schedule's steps, deterministic or ancestral."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from pointforge.errors import ConfigError
from pointforge.nn.diffusion.checks import check_real
from pointforge.nn.diffusion.samplers.base import Sampler, StepOutput
from pointforge.nn.diffusion.schedule import NoiseSchedule

__all__ = ["DDIMSampler"]


class DDIMSampler(Sampler):
    """DDIM on re-spaced steps, by default upstream's
    ``unique(round(linspace(0, T-1, steps)))`` descending (see
    :func:`respaced_timesteps` for ``spacing``).

    Each step moves from a kept step to the next kept one below it (to the clean
    cloud after ``t = 0``). ``eta`` in [0, 1] scales the fresh noise: 0 is the
    deterministic sampler, 1 the ancestral one on the re-spaced chain.

    ``clamp``: upstream PCDiff's DDIM clamps every step's output to [-1, 1]
    (``clamp=1.0`` reproduces it). PCDiff's clouds are scaled to about ±3, so
    that clamp flattens any implant beyond the unit cube; the default is none.
    """

    name = "ddim"

    def __init__(
        self,
        steps: int = 50,
        eta: float = 0.0,
        *,
        clamp: Optional[float] = None,
        spacing: str = "uniform",
        schedule: Optional[NoiseSchedule] = None,
        start: Optional[int] = None,
    ):
        super().__init__(schedule, steps, spacing, start)
        eta = check_real(eta, "eta")
        if not 0.0 <= eta <= 1.0:
            raise ConfigError(f"eta must lie in [0, 1] (0 = deterministic DDIM), got {eta}")
        if clamp is not None:
            clamp = check_real(clamp, "clamp")
            if clamp <= 0:
                raise ConfigError(f"clamp must be positive or None, got {clamp}")
        self.eta = eta
        self.clamp = clamp
        self._tables = self._respaced_tables()

    def _respaced_tables(self) -> dict[torch.dtype, dict[str, Tensor]]:
        """Per-step lookups (length T, NaN off the grid) of the re-spaced chain.

        The chain keeps the original ᾱ at the kept steps: beta'_j = 1 - ᾱ[k_j] /
        ᾱ[k_(j-1)]. In float32 it is built as upstream builds it (beta' by float32
        division, then a float64 cumprod) so its reference steps match to the bit;
        float64 work reads the exact float64 ᾱ instead.
        """
        kept = self.timesteps.flip(0)  # ascending
        ac32 = self.schedule.table("alphas_cumprod", torch.device("cpu"), torch.float32)
        before = torch.cat([torch.ones(1), ac32[kept[:-1]]])
        betas = (1.0 - ac32[kept] / before).double()
        if len(kept) == 1:  # a schedule holds two steps at least; the dummy second one is never read
            betas = torch.cat([betas, betas.new_tensor([0.5])])
        respaced = NoiseSchedule(betas, name="ddim-respaced", prediction=self.schedule.prediction)
        ac64 = self.schedule.alphas_cumprod_float64
        exact = {
            "alphas_cumprod": ac64[kept],
            "alphas_cumprod_prev": torch.cat([torch.ones(1, dtype=torch.float64), ac64[kept[:-1]]]),
        }
        exact["sqrt_recip_alphas_cumprod"] = torch.sqrt(1.0 / exact["alphas_cumprod"])
        exact["sqrt_recipm1_alphas_cumprod"] = torch.sqrt(1.0 / exact["alphas_cumprod"] - 1.0)
        tables: dict[torch.dtype, dict[str, Tensor]] = {}
        for precision, source in ((torch.float32, None), (torch.float64, exact)):
            tables[precision] = {}
            for name in (
                "alphas_cumprod",
                "alphas_cumprod_prev",
                "sqrt_recip_alphas_cumprod",
                "sqrt_recipm1_alphas_cumprod",
            ):
                values = (getattr(respaced, name) if source is None else source[name])[: len(kept)]
                full = torch.full((self.schedule.num_timesteps,), math.nan, dtype=precision)
                full[kept] = values.to(precision)
                tables[precision][name] = full
        return tables

    def __repr__(self) -> str:
        return f"DDIMSampler(steps={self.num_steps}, eta={self.eta}, clamp={self.clamp}, spacing={self.spacing!r})"

    def coefficient(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """Re-spaced table ``name`` at kept steps ``t``, shaped ``[B, 1, 1]``.

        ``alphas_cumprod_prev`` is ᾱ of the kept step below ``t`` (1 below 0).
        """
        precision = torch.float64 if like.dtype == torch.float64 else torch.float32
        table = self._cached(name, self._tables[precision][name], like)
        return table[t].reshape(-1, 1, 1)

    def _step(self, model_output, t, sample, noise, generator, previous):
        alpha_bar_prev = self.coefficient("alphas_cumprod_prev", t, sample)
        if self.schedule.prediction == "eps":
            sqrt_recip = self.coefficient("sqrt_recip_alphas_cumprod", t, sample)
            sqrt_recipm1 = self.coefficient("sqrt_recipm1_alphas_cumprod", t, sample)
            eps = model_output
            pred_x0 = sqrt_recip * sample - sqrt_recipm1 * eps
            # Upstream re-derives the noise from the clean estimate; doing the same keeps
            # float32 rounding equal to its reference.
            eps_used = (sqrt_recip * sample - pred_x0) / sqrt_recipm1
        else:
            # x0/v: both estimates come from the network's output, finite even where ᾱ = 0.
            eps, pred_x0 = self.schedule.eps_and_x0(model_output, t, sample)
            eps_used = eps
        prev_sample = pred_x0 * torch.sqrt(alpha_bar_prev)
        if self.eta > 0:
            alpha_bar = self.coefficient("alphas_cumprod", t, sample)
            sigma = (
                self.eta
                * torch.sqrt((1.0 - alpha_bar_prev) / (1.0 - alpha_bar))
                * torch.sqrt(1.0 - alpha_bar / alpha_bar_prev)
            )
            # Rounding can push 1 - ab_prev - sigma^2 a hair below 0 at eta = 1.
            prev_sample = prev_sample + torch.sqrt(torch.clamp_min(1.0 - alpha_bar_prev - sigma**2, 0.0)) * eps_used
            nonzero = (t != 0).to(sample.dtype).reshape(-1, 1, 1)
            prev_sample = prev_sample + nonzero * sigma * self._noise(noise, sample, generator)
        else:
            prev_sample = prev_sample + torch.sqrt(1.0 - alpha_bar_prev) * eps_used
        if self.clamp is not None:
            prev_sample = prev_sample.clamp(-self.clamp, self.clamp)
        return StepOutput(prev_sample, pred_x0, eps, t)
