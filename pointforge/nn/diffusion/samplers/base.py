"""What every sampler is: a network-free step from one noise level to the next, on a grid of steps.

A sampler (as diffusers' schedulers) never sees the network. It lists the steps
at which the network is to be evaluated (:attr:`Sampler.timesteps`, noisiest
first) and turns the network's output at one of them into the next, less noisy
sample (:meth:`Sampler.step`). The loop that calls the network is
:func:`pointforge.nn.diffusion.pipeline.denoise`. Samplers hold no state
between steps: what a multistep solver needs from the last step comes back
in its :class:`StepOutput` and is handed to the next, so one sampler object
may serve any number of runs at once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.checks import check_cloud, check_int, standard_normal, work_dtype
from pointforge.nn.diffusion.schedule import NoiseSchedule, Timesteps, default_schedule

__all__ = ["SPACINGS", "StepOutput", "respaced_timesteps", "Sampler"]

SPACINGS = ("uniform", "quadratic", "logsnr", "trailing")

# In a sampler's step-to-next-step lookup: steps off its grid; -1 is "the clean end".
_OFF_GRID = -2


@dataclass
class StepOutput:
    """What one reverse step produced.

    ``prev_sample``: the generated points one step less noisy; ``pred_x0`` and
    ``eps``: the clean-point and noise estimates the network's output implied;
    ``t``: the ``[B]`` steps this step started from. Hand it back to the next
    :meth:`Sampler.step` as ``previous``.
    """

    prev_sample: Tensor
    pred_x0: Tensor
    eps: Tensor
    t: Tensor


def respaced_timesteps(
    schedule: NoiseSchedule, steps: int, spacing: str = "uniform", start: Optional[int] = None
) -> Tensor:
    """Descending, distinct steps from ``start`` (default ``T - 1``) to 0 at which a fast sampler runs.

    ``uniform``: ``unique(round(linspace(0, T-1, steps)))`` as upstream's DDIM;
    ``quadratic``: uniform in ``sqrt(t)``, denser where little noise is left;
    ``logsnr``: the steps nearest to a uniform grid in half-log-SNR;
    ``trailing``: ``steps`` equal strides down from ``start``, the last stride
    landing on the clean end (Lin et al., WACV 2024), so few steps spend no call
    at ``t = 0`` (``[start, start/2]`` for two: a distilled student's grid).
    Rounding can merge neighbours, so a grid may hold fewer than ``steps`` steps.
    One step is ``[start]`` under every spacing: a single jump to the clean end.
    """
    if spacing not in SPACINGS:
        raise ConfigError(f"unknown step spacing {spacing!r}; choose one of: {', '.join(SPACINGS)}")
    last = schedule.num_timesteps - 1 if start is None else start
    if steps == 1:
        return torch.tensor([last], dtype=torch.int64)
    # numpy, not torch: linspace and round-half-to-even must equal upstream's bit for bit.
    if spacing == "uniform":
        grid = np.linspace(0, last, steps).round()
    elif spacing == "trailing":
        grid = np.linspace(last, 0, steps + 1)[:-1].round()
    elif spacing == "quadratic":
        grid = (np.linspace(0, math.sqrt(last), steps) ** 2).round()
    else:
        ac = schedule.alphas_cumprod_float64.numpy()[: last + 1]
        half_log_snr = 0.5 * (np.log(ac) - np.log1p(-ac))
        targets = np.linspace(half_log_snr[0], half_log_snr[-1], steps)
        grid = np.abs(half_log_snr[None, :] - targets[:, None]).argmin(axis=1)
    grid = np.unique(grid.astype(np.int64))[::-1]
    return torch.from_numpy(grid.copy())


class Sampler(ABC):
    """Turns a network's output into the next sample; subclasses define the update.

    ``timesteps`` lists, in order, the steps at which the network is evaluated;
    ``num_steps`` is how many there are. ``start`` (default ``T - 1``) is the
    noisiest step: a sampler that starts part-way (from a noised estimate
    rather than pure noise, as SDEdit) spreads its steps over ``[0, start]``.
    """

    name = "sampler"

    def __init__(
        self,
        schedule: Optional[NoiseSchedule] = None,
        steps: Optional[int] = None,
        spacing: str = "uniform",
        start: Optional[int] = None,
    ):
        self.schedule = schedule if schedule is not None else default_schedule()
        num_timesteps = self.schedule.num_timesteps
        self.spacing = spacing
        start = (
            num_timesteps - 1 if start is None else check_int(start, f"{self.name} start step", 1, num_timesteps - 1)
        )
        if steps is None:
            self.timesteps = torch.arange(start, -1, -1)
        else:
            steps = check_int(steps, f"{self.name} steps", 1, start + 1)
            self.timesteps = respaced_timesteps(self.schedule, steps, spacing, start)
        # For each step on the grid, the step it moves to (-1: the clean end);
        # _OFF_GRID elsewhere.
        self._next_step = torch.full((num_timesteps,), _OFF_GRID, dtype=torch.int64)
        self._next_step[self.timesteps] = torch.cat([self.timesteps[1:], torch.tensor([-1])])
        self._on_device: dict[tuple, Tensor] = {}

    @property
    def num_steps(self) -> int:
        """Network evaluations per sample."""
        return int(self.timesteps.numel())

    def step(
        self,
        model_output: Tensor,
        t: Timesteps,
        sample: Tensor,
        *,
        noise: Optional[Tensor] = None,
        generator: Optional[torch.Generator] = None,
        previous: Optional[StepOutput] = None,
    ) -> StepOutput:
        """One reverse step of the generated points ``sample`` ``[B, C, n]`` from steps ``t``.

        ``t`` (a scalar or ``[B]``, each on this sampler's grid; a Python int
        or CPU tensor is checked without a device round trip); ``model_output``
        (``[B, C, n]``): the network's prediction for ``sample`` at ``t``.
        ``noise`` (``[B, C, n]``) or ``generator`` feed stochastic samplers;
        ``previous`` (the last step's output) feeds multistep solvers; each
        sampler ignores what it does not use. Steps in float32 (float64 for
        float64 input); ``prev_sample`` comes back in ``sample``'s dtype. The step
        runs in the caller's grad mode: under ``torch.no_grad`` (as
        :func:`~pointforge.nn.diffusion.pipeline.denoise` samples) it records
        nothing, with grad on a distillation trains through it.
        """
        check_cloud(sample, "sample")
        if not isinstance(model_output, Tensor) or model_output.shape != sample.shape:
            got = tuple(model_output.shape) if isinstance(model_output, Tensor) else type(model_output).__name__
            raise DataError(f"the model output must be shaped like the sample {tuple(sample.shape)}, got {got}")
        if noise is not None and noise.shape != sample.shape:
            raise DataError(
                f"step noise must be shaped like the sample {tuple(sample.shape)}, got {tuple(noise.shape)}"
            )
        steps = self._on_grid(t, sample.shape[0]).to(sample.device)
        work = sample.to(work_dtype(sample.dtype))
        out = self._step(model_output.to(work.dtype), steps, work, noise, generator, previous)
        out.prev_sample = out.prev_sample.to(sample.dtype)
        return out

    def _on_grid(self, t: Timesteps, batch: int) -> Tensor:
        """``t`` as a CPU int64 ``[batch]`` tensor, each on this sampler's grid."""
        t = self.schedule.timesteps_for(t, batch, torch.device("cpu"))
        off_grid = self._next_step[t] == _OFF_GRID
        if bool(off_grid.any()):
            raise DataError(
                f"{self!r} runs only at its steps {self.timesteps.tolist()[:3]}...; "
                f"{sorted(set(t[off_grid].tolist()))} are not among them"
            )
        return t

    @abstractmethod
    def _step(
        self,
        model_output: Tensor,
        t: Tensor,
        sample: Tensor,
        noise: Optional[Tensor],
        generator: Optional[torch.Generator],
        previous: Optional[StepOutput],
    ) -> StepOutput:
        """The step on checked inputs: ``sample`` and ``model_output`` in the work dtype,
        ``t`` int64 ``[B]`` on the grid, on ``sample``'s device."""

    def _cached(self, name: str, values: Tensor, like: Tensor) -> Tensor:
        key = (name, like.device, like.dtype)
        cached = self._on_device.get(key)
        if cached is None:
            cached = values.to(device=like.device, dtype=like.dtype)
            self._on_device[key] = cached
        return cached

    @staticmethod
    def _noise(noise: Optional[Tensor], like: Tensor, generator) -> Tensor:
        if noise is not None:
            return noise.to(device=like.device, dtype=like.dtype)
        return standard_normal(like.shape, like, generator)
