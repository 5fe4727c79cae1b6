"""Training on the atlas estimate PCDiff starts from (``task.prior.correct``).

With ``task.prior`` sampling starts from the atlas estimate of the implant,
diffused to ``start_step``; plain training only ever diffuses the *true*
implant, so the network learns to denoise the truth and never learns what is
wrong with the estimate (it covers the middle of the defect and misses its
rim). With ``correct > 0`` that fraction of the training examples lies on
the path sampling takes from the estimate: the case's own estimate, made from
the atlas *without the case's skull* (leave-one-out, so it errs as it will on
a new skull), with the true implant as the clean cloud the prediction is
measured against. Each estimate point is paired with one true point by an
optimal assignment (squared distances), so every part of the implant is some
point's target and the pairs move as little as possible.

The loss stays the one :func:`~pointforge.nn.diffusion.loss.diffusion_loss`
computes. Diffusing the estimate ``e`` to ``start_step`` with noise ``eps``
gives the same noisy cloud as diffusing the truth ``x`` with the *effective*
noise ``eps' = eps + sqrt(abar_s) / sqrt(1 - abar_s) * (e - x)``, whose target
is the one that predicts the truth. A deterministic sampler that predicts the
truth keeps that noise all the way down (DDIM's ``x_t = sqrt(abar_t) x0 +
sqrt(1 - abar_t) eps'``), so the examples are drawn at every step of
``[0, start_step]`` with ``eps'``: trained at the start step alone (measured:
docs/pcdiff.md) the network corrects its first prediction, and the next steps,
which it learned on the plain noise only, undo it.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from pointforge.data.skulls.normalization import Normalization
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.tasks.pcdiff.frame import FrameSection, ImplantEstimate, atlas_estimate, prior_points

__all__ = ["leave_one_out_estimate", "paired_to", "effective_noise", "start_item", "from_start"]


def leave_one_out_estimate(
    atlas: torch.Tensor,
    skull_ids: list[str],
    skull_id: str,
    skull: np.ndarray,
    spacing: np.ndarray,
    section: FrameSection,
    agree: float,
) -> ImplantEstimate:
    """The atlas estimate of ``skull``'s implant from every atlas skull but its own (all of them if it has none there)."""
    keep = [k for k, other in enumerate(skull_ids) if other != skull_id]
    if keep and len(keep) < len(skull_ids):
        atlas = atlas[keep]
    return atlas_estimate(atlas, skull, spacing, section, agree)


def paired_to(start: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``start``'s points reordered so that point ``i`` is the one optimally assigned to ``target[i]``.

    Both ``[P, 3]``; the assignment minimises the summed squared distances.
    """
    cost = ((target[:, None, :] - start[None, :, :]) ** 2).sum(-1)
    rows, cols = linear_sum_assignment(cost)
    out = np.empty_like(start)
    out[rows] = start[cols]
    return out


def effective_noise(
    schedule: NoiseSchedule, clean: torch.Tensor, start: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """The noise that diffuses ``clean`` to where ``noise`` diffuses ``start`` at steps ``t``.

    ``clean``, ``start``, ``noise``: ``[B, C, P]``; ``t``: ``[B]``.
    """
    return noise + schedule.snr(t, noise).sqrt() * (start - clean)


def start_item(
    estimate: ImplantEstimate, implant: np.ndarray, norm: Normalization, rng: np.random.Generator, correct: float
) -> dict:
    """An item's ``start`` (``len(implant)`` estimate points paired with ``implant``'s, in the frame) and
    ``from_start`` (drawn true with probability ``correct``)."""
    drawn = prior_points(estimate.points, len(implant), rng)
    start = paired_to(drawn, np.asarray(implant, dtype=np.float64))
    return {"start": torch.from_numpy(norm.apply(start)), "from_start": torch.tensor(bool(rng.uniform() < correct))}


def from_start(schedule: NoiseSchedule, clean: torch.Tensor, batch, t: torch.Tensor, start_step: int) -> torch.Tensor:
    """Noise for :func:`~pointforge.nn.diffusion.loss.diffusion_loss` on ``clean`` ``[B, C, P]`` at steps
    ``t``: for the batch's ``from_start`` examples the effective noise of their ``start`` diffused to
    ``start_step`` (so at ``t`` they lie on a sampler's path from there), plain noise for the others."""
    start = batch["start"].transpose(1, 2).to(clean)
    flagged = batch["from_start"].to(clean.device)
    noise = torch.randn_like(clean)
    shifted = effective_noise(schedule, clean, start, noise, torch.full_like(t, start_step))
    return torch.where(flagged.reshape(-1, 1, 1), shifted, noise)
