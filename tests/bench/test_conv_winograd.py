"""bench/conv_winograd.py: its Winograd convolutions are the convolution they are timed against."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("res", [4, 5, 7])  # whole tiles, and grids the tiles overhang
def test_winograd_is_the_convolution(bench_module, m, res):
    winograd = bench_module("conv_winograd")
    gen = torch.Generator().manual_seed(res)
    x = torch.randn(2, 3, res, res, res, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 3, 3, 3, 3, generator=gen, dtype=torch.float64)
    b = torch.randn(5, generator=gen, dtype=torch.float64)
    got = winograd.winograd_conv3d(x, w, b, m)
    torch.testing.assert_close(got, F.conv3d(x, w, b, padding=1), rtol=1e-10, atol=1e-10)


def test_other_tile_sizes_are_refused(bench_module):
    with pytest.raises(ValueError, match="m must be 2 or 4"):
        bench_module("conv_winograd").winograd_matrices(3)
