"""A sampler by name: how ``--sampler ddpm|ddim|dpm++2m --steps N`` and configs pick one."""

from __future__ import annotations

from typing import Optional

from pointforge.errors import ConfigError
from pointforge.nn.diffusion.checks import check_real
from pointforge.nn.diffusion.samplers.base import Sampler
from pointforge.nn.diffusion.samplers.ddim import DDIMSampler
from pointforge.nn.diffusion.samplers.ddpm import DDPMSampler
from pointforge.nn.diffusion.samplers.dpmpp_2m import DPMSolverPP2MSampler
from pointforge.nn.diffusion.schedule import NoiseSchedule

__all__ = ["SAMPLER_NAMES", "DEFAULT_STEPS", "make_sampler"]

SAMPLER_NAMES = ("ddpm", "ddim", "dpm++2m")
# Steps a fast sampler takes when none are asked for (ddpm always runs all T).
DEFAULT_STEPS = {"ddim": 50, "dpm++2m": 20}


def make_sampler(
    name: str,
    steps: Optional[int] = None,
    eta: float = 0.0,
    *,
    clamp: Optional[float] = None,
    spacing: Optional[str] = None,
    schedule: Optional[NoiseSchedule] = None,
    start: Optional[int] = None,
) -> Sampler:
    """A sampler by name: ``ddpm`` (all T steps), ``ddim`` (default 50 steps,
    ``eta``, ``clamp``, uniform ``spacing``) or ``dpm++2m`` (default 20 steps,
    quadratic ``spacing``); ``start``: the noisiest step, for sampling that starts
    part-way from a noised estimate (default ``T - 1``, pure noise)."""
    if not isinstance(name, str) or name.lower() not in SAMPLER_NAMES:
        raise ConfigError(f"unknown sampler {name!r}; choose one of: {', '.join(SAMPLER_NAMES)}")
    name = name.lower()
    eta = check_real(eta, "eta")
    for option, value, default, owners in (
        ("eta", eta, 0.0, ("ddim",)),
        ("clamp", clamp, None, ("ddim",)),
        ("spacing", spacing, None, ("ddim", "dpm++2m")),
    ):
        if name not in owners and value != default:
            raise ConfigError(f"{option} applies to the {' and '.join(owners)} sampler only; remove it for {name}")
    if name == "ddpm":
        sampler = DDPMSampler(schedule, start)
        if steps is not None and steps != sampler.num_steps:
            raise ConfigError(
                f"ddpm runs all {sampler.num_steps} steps, got steps={steps}; use ddim or dpm++2m for fewer"
            )
        return sampler
    if steps is None:
        steps = DEFAULT_STEPS[name]
    if name == "ddim":
        return DDIMSampler(steps, eta, clamp=clamp, spacing=spacing or "uniform", schedule=schedule, start=start)
    return DPMSolverPP2MSampler(steps, spacing=spacing or "quadratic", schedule=schedule, start=start)
