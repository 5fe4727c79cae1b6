"""DPSR's pruned CPU solve (ducc0) against the plain one: the node box, the solve, the fused filter pass."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.dpsr import _raw_solve
from pointforge.nn.dpsr_grid import PointCorners, rasterize
from pointforge.nn.dpsr_pruned import combine_and_filter, pruned_raw_solve
from pointforge.nn.dpsr_spectrum import Spectrum

pytestmark = pytest.mark.usefixtures("one_thread")


def _cloud(n: int, lo, hi, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lo, hi = torch.tensor(lo, dtype=dtype), torch.tensor(hi, dtype=dtype)
    points = lo + (hi - lo) * torch.rand(n, 3, generator=g, dtype=dtype)
    normals = torch.randn(n, 3, generator=g, dtype=dtype)
    return points, normals


# Boxes along axes 0 and 1 narrower than the grid (the pruned passes), one wrapping
# around the periodic boundary along axis 0 (points in the last cell), one everywhere.
CLOUDS = {
    "inside": ((0.31, 0.22, 0.4), (0.62, 0.71, 0.55)),
    "corner": ((0.0, 0.0, 0.0), (0.3, 0.25, 0.2)),
    "wraps": ((0.75, 0.1, 0.3), (0.9999, 0.4, 0.6)),
    "everywhere": ((0.0, 0.0, 0.0), (0.9999, 0.9999, 0.9999)),
}


@pytest.mark.parametrize("res", [(16, 16, 16), (15, 21, 19), (20, 12, 9)])
@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_node_box_is_the_range_of_nodes_the_splat_touches(res, cloud):
    points, _ = _cloud(300, *CLOUDS[cloud], seed=sum(res))
    box = PointCorners(points, res, 64).node_box()
    touched = rasterize(points[None], torch.ones(1, 300, 1, dtype=points.dtype), res)[0, 0] != 0
    for axis, (start, stop) in enumerate(box):
        used = touched.any(dim=tuple(a for a in range(3) if a != axis)).nonzero().view(-1)
        if cloud in ("wraps", "everywhere") and axis == 0:
            assert (start, stop) == (0, res[0])  # the last node's upper neighbour is node 0
        else:
            assert (start, stop) == (int(used.min()), int(used.max()) + 1)
    assert touched.any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("res", [(16, 16, 16), (15, 21, 19), (20, 12, 9)])
@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_pruned_solve_equals_the_plain_solve(res, cloud, dtype):
    points, normals = _cloud(400, *CLOUDS[cloud], seed=7 + sum(res), dtype=dtype)
    spectrum = Spectrum(res, 2.0, dtype, "cpu")
    plain = _raw_solve(PointCorners(points, res, 128), normals, spectrum, None)
    pruned = pruned_raw_solve(PointCorners(points, res, 128), normals, spectrum, 1)
    assert pruned.shape == plain.shape and pruned.dtype == plain.dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert (pruned - plain).abs().max().item() <= tol * plain.abs().max().item()


def test_pruned_solve_on_two_threads_and_unsmoothed_equals_the_plain_solve():
    res = (24, 18, 20)
    points, normals = _cloud(900, *CLOUDS["inside"], seed=3)
    spectrum = Spectrum(res, 0.0, torch.float64, "cpu")
    plain = _raw_solve(PointCorners(points, res, 128), normals, spectrum, None)
    pruned = pruned_raw_solve(PointCorners(points, res, 128), normals, spectrum, 2)
    assert (pruned - plain).abs().max().item() <= 1e-12 * plain.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_combined_filter_pass_equals_the_derivative_sum_then_the_filter(dtype):
    res = (18, 12, 10)
    spectrum = Spectrum(res, 2.0, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    shape = (res[0], res[1], res[2] // 2 + 1)
    spec = torch.randn(shape, dtype=spectrum.complex_dtype, generator=g)
    axis0 = torch.randn(shape, dtype=spectrum.complex_dtype, generator=g)
    expected = spec.clone().addcmul_(axis0, spectrum.derivative(0, -1.0))
    spectrum.apply_filter_(expected)
    combine_and_filter(spec, axis0, spectrum, 2)
    assert spec[0, 0, 0] == 0
    rounding = 4 * torch.finfo(dtype).eps
    assert torch.allclose(torch.view_as_real(spec), torch.view_as_real(expected), rtol=rounding, atol=0)
