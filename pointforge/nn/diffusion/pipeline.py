"""The denoising loop: the one place that calls the network while sampling.

:func:`denoise` starts the generated points from noise and, at each of the
sampler's steps, shows the network the whole cloud ``[condition | generated]``
and hands its output to the sampler, which returns the next sample. Any
network (a :data:`~pointforge.nn.diffusion.conditioning.Denoiser`) runs under
any sampler this way: inference, training-time evaluation and the benchmarks
all sample through it. :func:`sample_ensemble` runs ``n`` proposals per
condition in one batched pass.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from pointforge.errors import DataError
from pointforge.nn.diffusion.checks import check_cloud, check_int, check_n_generated, standard_normal, work_dtype
from pointforge.nn.diffusion.conditioning import Denoiser, network_output
from pointforge.nn.diffusion.samplers.base import Sampler, StepOutput

__all__ = ["ProgressCallback", "denoise", "repeat_for_ensemble", "sample_ensemble"]

# Called after every sampler step with (steps done, steps in total).
ProgressCallback = Callable[[int, int], None]


def _start(cond: Tensor, n_generated: int, noise: Optional[Tensor], generator: Optional[torch.Generator]) -> Tensor:
    """The noisiest sample ``[B, C, n_generated]`` in the work dtype: ``noise``, or drawn with ``generator``."""
    batch, channels, _ = cond.shape
    like = cond.to(work_dtype(cond.dtype))
    if noise is None:
        return standard_normal((batch, channels, n_generated), like, generator)
    if noise.shape != (batch, channels, n_generated):
        raise DataError(f"initial noise must be [{batch}, {channels}, {n_generated}], got {tuple(noise.shape)}")
    return noise.to(device=like.device, dtype=like.dtype)


def denoise(
    network: Denoiser,
    sampler: Sampler,
    cond: Tensor,
    n_generated: int,
    *,
    generator: Optional[torch.Generator] = None,
    noise: Optional[Tensor] = None,
    init: Optional[Tensor] = None,
    progress: Optional[ProgressCallback] = None,
    grad: bool = False,
) -> Tensor:
    """Generate ``n_generated`` points for each conditioning cloud, calling ``network`` once per sampler step.

    ``cond`` is ``[B, C, N_cond]`` (``N_cond`` may be 0). The start is
    ``noise`` (``[B, C, n_generated]``) or standard normal drawn with
    ``generator``, which also feeds a stochastic sampler's steps. Returns
    ``[B, C, N_cond + n_generated]`` in ``cond``'s dtype, the conditioning
    points exactly as given. The network is called as ``network(x, t)``; put a
    module in eval mode first. ``progress(done, total)`` follows every step.

    ``init`` (``[B, C, n_generated]``), an estimate of the clean generated
    points, starts the chain part-way as SDEdit does (Meng et al., ICLR 2022):
    the start is ``init`` diffused to the sampler's first (noisiest) step with
    the noise above, so a sampler built with ``start`` < T - 1 refines the
    estimate instead of drawing from pure noise.

    ``grad``: record the whole chain for backpropagation (a few-step student
    trains through its own sampling, :mod:`pointforge.tasks.pcdiff.student`);
    by default sampling records nothing.
    """
    with torch.set_grad_enabled(grad):
        return _denoise(network, sampler, cond, n_generated, generator, noise, init, progress)


def _denoise(
    network: Denoiser,
    sampler: Sampler,
    cond: Tensor,
    n_generated: int,
    generator: Optional[torch.Generator],
    noise: Optional[Tensor],
    init: Optional[Tensor],
    progress: Optional[ProgressCallback],
) -> Tensor:
    check_cloud(cond, "cond")
    n_generated = check_n_generated(n_generated)
    condition = cond.to(work_dtype(cond.dtype))
    sample = _start(cond, n_generated, noise, generator)
    if init is not None:
        if tuple(init.shape) != tuple(sample.shape):
            raise DataError(f"init must be [{', '.join(map(str, sample.shape))}], got {tuple(init.shape)}")
        first = int(sampler.timesteps[0])
        sample = sampler.schedule.q_sample(init.to(device=sample.device, dtype=sample.dtype), first, sample)
    previous: Optional[StepOutput] = None
    total = sampler.num_steps
    for done, t in enumerate(sampler.timesteps.tolist(), start=1):
        t_batch = torch.full((cond.shape[0],), t, dtype=torch.int64, device=sample.device)
        output = network_output(network, torch.cat([condition, sample], dim=2), t_batch, n_generated)
        # A Python int step: the sampler checks it without reading the device back.
        previous = sampler.step(output, t, sample, generator=generator, previous=previous)
        sample = previous.prev_sample
        if progress is not None:
            progress(done, total)
    return torch.cat([cond, sample.to(cond.dtype)], dim=2)


def repeat_for_ensemble(cond: Tensor, n: int) -> Tensor:
    """``[C, N]`` or ``[B, C, N]`` conditioning → ``[B * n, C, N]``, each case's
    ``n`` copies adjacent, so one batched pass samples ``n`` proposals per case."""
    n = check_int(n, "ensemble size", 1)
    if isinstance(cond, Tensor) and cond.dim() == 2:
        cond = cond.unsqueeze(0)
    check_cloud(cond, "cond")
    return cond.repeat_interleave(n, dim=0)


def sample_ensemble(
    network: Denoiser,
    sampler: Sampler,
    cond: Tensor,
    n_generated: int,
    n: int,
    *,
    generator: Optional[torch.Generator] = None,
    init: Optional[Tensor] = None,
    progress: Optional[ProgressCallback] = None,
) -> Tensor:
    """``n`` proposals per conditioning cloud in one batched pass of :func:`denoise`.

    ``init``: each proposal's clean estimate to start from (:func:`denoise`),
    ``[n, C, n_generated]`` for a ``[C, N]`` cloud, ``[B, n, C, n_generated]``
    for ``[B, C, N]``. Returns ``[n, C, N]`` for a ``[C, N]`` cloud, ``[B, n, C, N]`` for ``[B, C, N]``.
    """
    single = isinstance(cond, Tensor) and cond.dim() == 2
    batched = repeat_for_ensemble(cond, n)
    if init is not None:
        init = init.reshape(-1, *init.shape[-2:])
    out = denoise(network, sampler, batched, n_generated, generator=generator, init=init, progress=progress)
    out = out.reshape(-1, n, *out.shape[1:])
    return out[0] if single else out
