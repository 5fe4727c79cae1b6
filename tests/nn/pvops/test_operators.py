"""What holds for every point-voxel operator: gradients where upstream has them, one-line shape errors, the same results on CUDA."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import DataError
from pointforge.nn.pvops.averaging import average_into_voxels, voxel_coordinates
from pointforge.nn.pvops.ball_query import ball_query
from pointforge.nn.pvops.devoxelize import trilinear_devoxelize
from pointforge.nn.pvops.fps import furthest_point_sample, furthest_point_sample_indices
from pointforge.nn.pvops.grouping import gather, grouping
from pointforge.nn.pvops.three_nn import interpolate_from_neighbors, three_nearest_neighbors
from tests.nn.pvops.cases import cloud

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gradcheck_feature_ops_float64():
    g = torch.Generator().manual_seed(5)
    r = 3
    coords = torch.rand(2, 3, 7, generator=g, dtype=torch.float64) * 2
    features = torch.randn(2, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    grid = torch.randn(2, 4, r, r, r, generator=g, dtype=torch.float64, requires_grad=True)
    centers = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    norm, vox = voxel_coordinates(coords, r)
    nn_idx, nn_w = three_nearest_neighbors(coords, coords[:, :, :5])
    group_idx = torch.randint(-1, 8, (2, 3, 4), generator=g)  # includes invalid -1 and 7
    gather_idx = torch.randint(0, 7, (2, 6), generator=g)
    checks = [
        (lambda f: average_into_voxels(f, vox, r), features),
        (lambda v: trilinear_devoxelize(v, norm, r), grid),
        (lambda c: interpolate_from_neighbors(c, nn_idx, nn_w), centers),
        (lambda f: grouping(f, group_idx), features),
        (lambda f: gather(f, gather_idx), features),
    ]
    for fn, x in checks:
        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-6)


def test_coordinates_get_gradients_through_gather_and_grouping_only():
    coords = torch.rand(1, 3, 50, requires_grad=True)
    centers, _ = furthest_point_sample(coords, 10)
    idx = ball_query(centers, coords, 0.4, 4)
    (grouping(coords, idx) - centers.unsqueeze(-1)).pow(2).sum().backward()
    assert coords.grad is not None and coords.grad.abs().sum() > 0
    coords.grad = None
    # Devoxelisation and 3-NN treat coordinates as constants, as upstream's kernels do.
    norm, _ = voxel_coordinates(coords, 4)
    assert not norm.requires_grad
    _, w = three_nearest_neighbors(coords, centers)
    assert not w.requires_grad


def test_bad_shapes_raise_data_error():
    with pytest.raises(DataError, match=r"\[B, 3, N\]"):
        ball_query(torch.rand(1, 4, 10), torch.rand(1, 3, 10), 0.1, 4)
    with pytest.raises(DataError, match="batch size"):
        three_nearest_neighbors(torch.rand(2, 3, 10), torch.rand(1, 3, 10))
    with pytest.raises(DataError, match="method"):
        ball_query(torch.rand(1, 3, 10), torch.rand(1, 3, 10), 0.1, 4, method="fast")
    with pytest.raises(DataError, match="floating point"):
        furthest_point_sample_indices(torch.ones(1, 3, 10, dtype=torch.long), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_results_on_cuda():
    points = cloud(2000, 4)
    centers = points[:, :, ::5].contiguous()
    cpu = [
        furthest_point_sample_indices(points, 100),
        ball_query(centers, points, 0.2, 16),
        *three_nearest_neighbors(points, centers),
    ]
    dev = points.cuda()
    cuda = [
        furthest_point_sample_indices(dev, 100),
        ball_query(centers.cuda(), dev, 0.2, 16),
        *three_nearest_neighbors(dev, centers.cuda()),
    ]
    for a, b in zip(cpu, cuda):
        assert torch.equal(a, b.cpu())
