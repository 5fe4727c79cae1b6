"""Chamfer distance between batches of point clouds of different sizes.

Definition (per cloud b, predicted points P_b, target points Q_b, both non-empty)::

    CD(b) = mean_{p in P_b} min_{q in Q_b} |p - q|^2  +  mean_{q in Q_b} min_{p in P_b} |q - p|^2

squared Euclidean distances, each direction averaged over its own points (so
clouds of different sizes weigh the same), the two directions *summed*. The
batch loss is the plain mean of CD(b) over the clouds of the batch: every cloud
counts once, whatever its size.

Nearest neighbours are searched without gradients (:mod:`pointforge.nn.knn`:
KD-tree on the CPU, chunked exact distances elsewhere); the distances are then
recomputed from the gathered points, so gradients reach both clouds exactly as
they would through a brute-force ``min`` (away from ties, where the gradient of
``min`` is not unique anyway).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError
from pointforge.nn.knn import DEFAULT_MAX_PAIRS, batch_ptr, check_batch, knn

__all__ = ["chamfer_distance", "point_to_plane_distance", "REDUCTIONS"]

REDUCTIONS = ("mean", "none")


def _per_cloud_mean(values: Tensor, batch: Tensor, num_clouds: int) -> Tensor:
    sums = torch.zeros(num_clouds, dtype=values.dtype, device=values.device).index_add(0, batch, values)
    counts = torch.bincount(batch, minlength=num_clouds).to(values.dtype)
    return sums / counts


def chamfer_distance(
    pred: Tensor,
    target: Tensor,
    pred_batch: Optional[Tensor] = None,
    target_batch: Optional[Tensor] = None,
    *,
    num_clouds: Optional[int] = None,
    reduction: str = "mean",
    backend: str = "auto",
    max_pairs: int = DEFAULT_MAX_PAIRS,
) -> Tensor:
    """Chamfer distance (module docs) of ``pred [P, 3]`` to ``target [Q, 3]`` cloud by cloud.

    Batch vectors are sorted cloud ids (``None``: one cloud); both sides must
    cover the same clouds ``0 .. B-1``, none of them empty. ``reduction="mean"``
    returns the mean over clouds (a scalar), ``"none"`` the ``[B]`` per-cloud values.
    """
    if reduction not in REDUCTIONS:
        raise ConfigError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    for x, what in ((pred, "predicted points"), (target, "target points")):
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != 3 or not x.is_floating_point():
            desc = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise DataError(f"{what} must be a floating-point [N, 3] tensor, got {desc}")
    if pred.device != target.device:
        raise DataError(f"predicted and target points are on different devices ({pred.device}, {target.device})")
    pred_batch = check_batch(pred_batch, pred.shape[0], "pred_batch").to(pred.device)
    target_batch = check_batch(target_batch, target.shape[0], "target_batch").to(pred.device)
    if num_clouds is None:
        num_clouds = max(
            int(pred_batch[-1]) + 1 if pred_batch.numel() else 0,
            int(target_batch[-1]) + 1 if target_batch.numel() else 0,
        )
    if num_clouds < 1:
        raise DataError("chamfer distance needs at least one non-empty cloud on each side")
    empty_pred = (batch_ptr(pred_batch, num_clouds).diff() == 0).nonzero().flatten().tolist()
    empty_target = (batch_ptr(target_batch, num_clouds).diff() == 0).nonzero().flatten().tolist()
    if empty_pred or empty_target:
        side, ids = ("predicted", empty_pred) if empty_pred else ("target", empty_target)
        raise DataError(f"cloud(s) {ids[:5]} have no {side} points; every cloud needs points on both sides")

    to_target = knn(target, pred, 1, target_batch, pred_batch, backend=backend, max_pairs=max_pairs).index[:, 0]
    to_pred = knn(pred, target, 1, pred_batch, target_batch, backend=backend, max_pairs=max_pairs).index[:, 0]
    d_pred = ((pred - target[to_target]) ** 2).sum(-1)
    d_target = ((target - pred[to_pred]) ** 2).sum(-1)
    per_cloud = _per_cloud_mean(d_pred, pred_batch, num_clouds) + _per_cloud_mean(d_target, target_batch, num_clouds)
    return per_cloud.mean() if reduction == "mean" else per_cloud


def point_to_plane_distance(
    pred: Tensor,
    target: Tensor,
    pred_batch: Optional[Tensor] = None,
    target_batch: Optional[Tensor] = None,
    *,
    num_clouds: Optional[int] = None,
    k: int = 10,
    backend: str = "auto",
) -> Tensor:
    """Mean over clouds of the mean squared distance from each predicted point to the plane
    fitted to its ``k`` nearest target points (least squares: through their centroid, normal
    along their covariance's smallest eigenvector).

    The across-surface part of the error alone, which the Chamfer distance sees only mixed
    with the distance *along* the surface to the nearest target point: where the target's
    spacing is larger than the noise to remove, Chamfer's pull across the surface is weak.
    The planes come from the target only, without gradients; gradients reach ``pred``.
    """
    pred_batch = check_batch(pred_batch, pred.shape[0], "pred_batch").to(pred.device)
    target_batch = check_batch(target_batch, target.shape[0], "target_batch").to(pred.device)
    if num_clouds is None:
        num_clouds = int(pred_batch[-1]) + 1 if pred_batch.numel() else 0
    with torch.no_grad():
        index = knn(target, pred.detach(), k, target_batch, pred_batch, backend=backend).index
        neighbours = target[index.clamp(min=0)]  # a cloud with fewer than k targets repeats its first
        neighbours = torch.where((index >= 0).unsqueeze(-1), neighbours, neighbours[:, :1])
        centroid = neighbours.mean(dim=1)
        centred = neighbours - centroid.unsqueeze(1)
        normal = torch.linalg.eigh(centred.transpose(1, 2) @ centred).eigenvectors[:, :, 0]
    distance = ((pred - centroid) * normal).sum(-1) ** 2
    return _per_cloud_mean(distance, pred_batch, num_clouds).mean()
