"""Gathering point features by index: single points (``gather``) and neighbourhoods (``grouping``)."""

from __future__ import annotations

import torch
from torch import Tensor

from pointforge.errors import DataError

__all__ = ["gather", "grouping"]


def gather(features: Tensor, indices: Tensor) -> Tensor:
    """``features[b, :, indices[b, m]]`` -> ``[B, C, M]`` (upstream ``gather_features``)."""
    if features.dim() != 3 or indices.dim() != 2 or indices.shape[0] != features.shape[0]:
        raise DataError(
            f"gather: expected features [B, C, N] and indices [B, M], got {tuple(features.shape)} and {tuple(indices.shape)}"
        )
    b, c, _ = features.shape
    index = indices.long().unsqueeze(1).expand(b, c, indices.shape[1])
    return torch.gather(features, 2, index)


def grouping(features: Tensor, indices: Tensor) -> Tensor:
    """``features[b, :, indices[b, m, u]]`` -> ``[B, C, M, U]``; indices outside ``[0, N)`` give 0.

    The zero for invalid indices follows the bounds check of PCDiff's grouping kernel.
    """
    if features.dim() != 3 or indices.dim() != 3 or indices.shape[0] != features.shape[0]:
        raise DataError(
            f"grouping: expected features [B, C, N] and indices [B, M, U], got {tuple(features.shape)} and {tuple(indices.shape)}"
        )
    b, c, n = features.shape
    _, m, u = indices.shape
    idx = indices.long()
    valid = (idx >= 0) & (idx < n)
    all_valid = bool(valid.all())
    if not all_valid:
        idx = torch.where(valid, idx, torch.zeros_like(idx))
    out = torch.gather(features, 2, idx.view(b, 1, m * u).expand(b, c, m * u)).view(b, c, m, u)
    if not all_valid:
        out = torch.where(valid.unsqueeze(1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out
