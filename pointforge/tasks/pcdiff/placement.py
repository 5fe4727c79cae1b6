"""Has a completion model learned *where* the missing piece goes? Numbers for it.

A point-cloud completion model can lower its loss for a long time by learning
what skull surfaces look like in general, without using the skull it is given.
Its samples then look like bone but lie anywhere. These measures make that
visible in every run (issue #12):

* :func:`placement_metrics`: centroid error, spread ratio and nearest-neighbour
  distances between generated and true points (in whatever units the points
  are given, e.g. mm);
* :func:`condition_use`: the clean-point error of the network at several noise
  levels given the true condition versus another case's condition. A network
  that ignores its condition scores the same with either (ratio ≈ 1); one that
  uses it does worse with the wrong one (ratio > 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pointforge.nn.diffusion.conditioning import Denoiser, network_output
from pointforge.nn.diffusion.schedule import NoiseSchedule

__all__ = ["placement_metrics", "condition_use"]


def _rms_radius(points: Tensor) -> Tensor:
    centred = points - points.mean(dim=1, keepdim=True)
    return centred.pow(2).sum(dim=2).mean(dim=1).sqrt()


def placement_metrics(pred: Tensor, true: Tensor) -> dict[str, Tensor]:
    """Per-case placement measures between ``pred`` ``[B, P, 3]`` and ``true`` ``[B, Q, 3]``.

    ``centroid_error``: distance between the two centroids; ``spread_ratio``:
    RMS distance of the points from their centroid, generated over true (1 is
    right; a model that spreads an implant over the skull scores ≫ 1);
    ``pred_to_true`` and ``true_to_pred``: mean nearest-neighbour distance in
    each direction (the first says whether generated points lie on the true
    piece, the second whether they cover it).
    """
    pred, true = pred.double(), true.double()
    dist = torch.cdist(pred, true)
    return {
        "centroid_error": (pred.mean(dim=1) - true.mean(dim=1)).norm(dim=1),
        "spread_ratio": _rms_radius(pred) / _rms_radius(true).clamp_min(1e-12),
        "pred_to_true": dist.min(dim=2).values.mean(dim=1),
        "true_to_pred": dist.min(dim=1).values.mean(dim=1),
    }


@torch.no_grad()
def condition_use(
    model: Denoiser,
    schedule: NoiseSchedule,
    x0: Tensor,
    n_generated: int,
    *,
    buckets: int = 4,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Clean-point error with the true versus a swapped condition, per noise bucket.

    ``x0``: ``[B, C, N]`` clean clouds (condition first, the last
    ``n_generated`` points generated), ``B >= 2``: case ``i`` is given case
    ``i + 1``'s condition. The steps ``0 .. T-1`` are cut into ``buckets``
    equal ranges, lowest noise first; in each, every case is noised to a step
    drawn from the range and the mean squared error of the network's clean-point
    estimate is measured both ways, with the same noise. Returns
    ``x0_err_b{k}``, ``x0_err_swapped_b{k}`` and ``cond_use_b{k}`` (their ratio).
    """
    batch = x0.shape[0]
    if batch < 2:
        raise ValueError("condition_use needs at least 2 cases to swap conditions between")
    n_cond = x0.shape[2] - n_generated
    cond, clean = x0[:, :, :n_cond], x0[:, :, n_cond:]
    swapped = cond.roll(1, dims=0)
    edges = torch.linspace(0, schedule.num_timesteps, buckets + 1).long()
    out: dict[str, float] = {}
    for k in range(buckets):
        t = torch.randint(int(edges[k]), int(edges[k + 1]), (batch,), generator=generator).to(x0.device)
        noise = torch.randn(clean.shape, generator=generator, dtype=clean.dtype).to(x0.device)
        noisy = schedule.q_sample(clean, t, noise)
        errors = []
        for c in (cond, swapped):
            x = torch.cat([c, noisy], dim=2)
            _, pred_x0 = schedule.eps_and_x0(network_output(model, x, t, n_generated), t, noisy)
            errors.append(float((pred_x0 - clean).pow(2).mean()))
        out[f"x0_err_b{k}"], out[f"x0_err_swapped_b{k}"] = errors
        out[f"cond_use_b{k}"] = errors[1] / max(errors[0], 1e-12)
    return out
