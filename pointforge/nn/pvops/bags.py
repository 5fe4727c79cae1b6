"""Weighted sums of gathered rows ("bags"): the one scatter/gather step behind devoxelisation
and 3-NN interpolation. The weights are constants; gradients reach the rows only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sum_bags", "weighted_bags"]


def weighted_bags(index: Tensor, weight: Tensor, rows_per_batch: int) -> tuple[Tensor, Tensor]:
    """Turn per-point neighbour ``index, weight [B, K, N]`` into flat bags ``[B*N, K]`` over
    the rows of all batch elements (row = b * rows_per_batch + index), for :func:`sum_bags`."""
    b, k, n = index.shape
    offset = torch.arange(b, device=index.device).view(b, 1, 1) * rows_per_batch
    # contiguous(): for B = 1 the reshape is a column-major view, which embedding_bag
    # reads an order of magnitude slower.
    bag_index = (index + offset).transpose(1, 2).reshape(b * n, k).contiguous()
    return bag_index, weight.transpose(1, 2).reshape(b * n, k).contiguous()


def sum_bags(rows: Tensor, bag_index: Tensor, bag_weight: Tensor, batch: int) -> Tensor:
    """``out[b, :, n] = sum_k bag_weight[b*N+n, k] * rows[bag_index[b*N+n, k]]`` -> ``[B, C, N]``.

    One ``embedding_bag`` does the gathers, the weighting and the sum in a single pass;
    gradients reach ``rows`` only (the weights are constants, as in upstream's kernels).
    """
    weight = bag_weight.to(rows.dtype)
    # embedding_bag's own backward (``_embedding_bag_dense_backward``) sorts and counts the
    # indices on every call; in the tiny PCDiff network's training step it was ~10% of the
    # time. The gradient of a weighted bag sum is a weighted scatter-add of the output
    # gradient, which ``index_add_`` does in one pass (equal up to float rounding of the
    # summation order). CPU only: on CUDA index_add_ is atomic, hence not deterministic,
    # and the slow backward was measured on CPU.
    if rows.device.type == "cpu" and torch.is_grad_enabled() and rows.requires_grad and not weight.requires_grad:
        out = _SumBags.apply(rows, bag_index, weight)
    else:
        out = F.embedding_bag(bag_index, rows, per_sample_weights=weight, mode="sum")
    return out.view(batch, -1, rows.shape[1]).transpose(1, 2)


class _SumBags(torch.autograd.Function):
    """``embedding_bag(bag_index, rows, per_sample_weights=weight, mode="sum")`` with a
    scatter-add backward into ``rows`` (the weights and indices get no gradient)."""

    @staticmethod
    def forward(ctx, rows: Tensor, bag_index: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(bag_index, weight)
        ctx.num_rows = rows.shape[0]
        return F.embedding_bag(bag_index, rows, per_sample_weights=weight, mode="sum")

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None, None]:
        bag_index, weight = ctx.saved_tensors
        c = grad_out.shape[1]
        spread = (grad_out.unsqueeze(1) * weight.unsqueeze(2)).reshape(-1, c)  # [bags * K, C]
        grad_rows = grad_out.new_zeros((ctx.num_rows, c)).index_add_(0, bag_index.reshape(-1), spread)
        return grad_rows, None, None
