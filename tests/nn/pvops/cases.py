"""What the point-voxel operator tests share: the upstream fixture's path, a tolerance, test clouds."""

from __future__ import annotations

import torch

from tests.helpers import FIXTURES

OPS_FIXTURE = FIXTURES / "upstream_ops_cuda_semantics.pt"


def close(actual, expected, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


def cloud(n: int, seed: int, lattice: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(2, 3, n, generator=g)
    pts[:, :, : n // 4] = pts[:, :, : n // 4] * 0.05 + 1.0  # a dense cluster
    pts[:, :, n // 4 : n // 4 + 20] = pts[:, :, n // 4 : n // 4 + 1]  # duplicates
    if lattice:  # many exactly equal distances
        pts = torch.round(pts * 4) / 4
    return pts
