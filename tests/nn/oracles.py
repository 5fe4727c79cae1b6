"""Reference implementations the fast paths of PVCNN2 are tested against.

These are the straightforward forms the library replaced with faster ones; they live
here only so that tests can hold the fast paths equal to them.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def weighted_group_norm_per_element(
    x: Tensor, weights: Tensor, segments: Sequence[tuple[int, int]], norm: nn.GroupNorm
) -> Tensor:
    """GroupNorm of ``x [C, K]`` whose columns stand for ``weights`` identical copies each;
    ``segments`` are the column ranges of the batch elements, normalised one at a time."""
    c = x.shape[0]
    g = norm.num_groups
    per_group = c // g
    outs = []
    for start, end in segments:
        xs, ws = x[:, start:end], weights[start:end]
        total = ws.sum() * per_group
        mean = (xs @ ws).view(g, per_group).sum(1) / total
        centred = (xs.view(g, per_group, -1) - mean.view(g, 1, 1)).view(c, -1)
        var = ((centred * centred) @ ws).view(g, per_group).sum(1) / total
        scale = (torch.rsqrt(var + norm.eps).view(g, 1) * norm.weight.view(g, per_group)).view(c, 1)
        outs.append(torch.addcmul(norm.bias.view(c, 1), centred, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def embedding_bag_sum(rows: Tensor, bag_index: Tensor, bag_weight: Tensor, batch: int) -> Tensor:
    """``sum_bags`` through ``embedding_bag`` alone, with embedding_bag's own backward."""
    out = F.embedding_bag(bag_index, rows, per_sample_weights=bag_weight.to(rows.dtype), mode="sum")
    return out.view(batch, -1, rows.shape[1]).transpose(1, 2)
