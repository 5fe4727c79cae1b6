"""The diffusion training loss: noise the generated points, score the network's prediction of its target.

The target is what the schedule's ``prediction`` names: the noise (ε, upstream
PCDiff), the clean points (x0) or the velocity ``v = sqrt(ᾱ) ε - sqrt(1 - ᾱ) x0``
(Salimans & Ho 2022); the weighting over steps is ``natural`` (plain MSE),
``min_snr`` or ``trunc_snr``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.checks import check_cloud, check_n_generated, standard_normal
from pointforge.nn.diffusion.conditioning import Denoiser, network_output
from pointforge.nn.diffusion.schedule import NoiseSchedule, Timesteps

__all__ = ["LOSS_WEIGHTINGS", "loss_weight", "training_target", "diffusion_loss"]

# How the loss weights the clean-point error at each step, in x0 terms (see loss_weight).
LOSS_WEIGHTINGS = ("natural", "min_snr", "trunc_snr")


def loss_weight(schedule: NoiseSchedule, t: Tensor, like: Tensor, weighting: str, gamma: float) -> Tensor:
    """Per-example factor turning the prediction's MSE into the chosen x0-error weighting.

    In clean-point terms the plain MSE of an ε prediction weights the x0 error
    by the SNR, of an x0 prediction by 1, of a v prediction by SNR + 1.
    ``min_snr`` re-weights to min(SNR, γ) (Hang et al. 2023), ``trunc_snr`` to
    max(SNR, 1) (Salimans & Ho 2022), which keeps the noisiest steps, where an
    implant's placement is decided, from counting for nothing.
    """
    snr = schedule.snr(t, like).reshape(-1)
    natural = {"eps": snr, "x0": torch.ones_like(snr), "v": snr + 1.0}[schedule.prediction]
    if weighting == "natural":
        return torch.ones_like(snr)
    wanted = torch.clamp_max(snr, gamma) if weighting == "min_snr" else torch.clamp_min(snr, 1.0)
    return wanted / natural


def training_target(schedule: NoiseSchedule, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """What the network must output for clean points ``x0`` noised with ``noise`` to steps ``t``."""
    if schedule.prediction == "eps":
        return noise
    if schedule.prediction == "x0":
        return x0
    return (
        schedule.coefficient("sqrt_alphas_cumprod", t, noise) * noise
        - schedule.coefficient("sqrt_one_minus_alphas_cumprod", t, noise) * x0
    )


def diffusion_loss(
    model: Denoiser,
    schedule: NoiseSchedule,
    x0: Tensor,
    n_generated: int,
    *,
    t: Optional[Timesteps] = None,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    reduction: str = "mean",
    weighting: str = "natural",
    snr_gamma: float = 5.0,
) -> Tensor:
    """MSE of the network's prediction on the generated points (ε for upstream PCDiff).

    ``x0`` is the clean cloud ``[B, C, N]``; its last ``n_generated`` points are
    diffused to a uniformly drawn step ``t`` (or the given one) with Gaussian
    noise (or the given ``[B, C, n_generated]`` noise), the rest stay clean. The
    target is :func:`training_target`. Each example's loss is the mean squared
    error over its ``C * n_generated`` values times the ``weighting`` factor
    (``natural``: 1; see :func:`loss_weight`); ``reduction="mean"`` averages
    those over the batch, ``"none"`` returns them ``[B]``.
    """
    check_cloud(x0, "x0")
    batch, channels, num_points = x0.shape
    n_generated = check_n_generated(n_generated, num_points)
    if reduction not in ("mean", "none"):
        raise ConfigError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if weighting not in LOSS_WEIGHTINGS:
        raise ConfigError(f"unknown loss weighting {weighting!r}; choose one of: {', '.join(LOSS_WEIGHTINGS)}")
    if t is None:
        device = generator.device if generator is not None else x0.device
        t = torch.randint(0, schedule.num_timesteps, (batch,), generator=generator, device=device).to(x0.device)
    else:
        t = schedule.timesteps_for(t, batch, x0.device)
    n_cond = num_points - n_generated
    clean_generated = x0[:, :, n_cond:]
    if noise is None:
        noise = standard_normal(clean_generated.shape, x0, generator)
    elif noise.shape != clean_generated.shape:
        raise DataError(
            f"noise must be shaped like the generated points {tuple(clean_generated.shape)}, got {tuple(noise.shape)}"
        )
    noisy = schedule.diffuse(clean_generated, t, noise)
    out = network_output(model, torch.cat([x0[:, :, :n_cond], noisy], dim=2), t, n_generated)
    target = training_target(schedule, clean_generated, noise, t)
    per_example = (target - out).pow(2).mean(dim=(1, 2))
    if weighting != "natural":
        per_example = per_example * loss_weight(schedule, t, noise, weighting, snr_gamma).to(per_example.dtype)
    return per_example.mean() if reduction == "mean" else per_example
