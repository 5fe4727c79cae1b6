"""Point-voxel ops against upstream's CUDA-kernel semantics (fixture) and against each other."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import DataError
from pointforge.nn.ops.ball_query import ball_query
from pointforge.nn.ops.cell_grid import CellGrid
from pointforge.nn.ops.devoxelize import trilinear_corners, trilinear_devoxelize
from pointforge.nn.ops.fps import furthest_point_sample, furthest_point_sample_indices
from pointforge.nn.ops.grouping import gather, grouping
from pointforge.nn.ops.three_nn import interpolate_from_neighbors, three_nearest_neighbors
from pointforge.nn.ops.voxelize import avg_voxelize, flat_voxel_index, voxel_coordinates, voxel_point_counts
from tests.helpers import FIXTURES

pytestmark = pytest.mark.usefixtures("one_thread")

OPS_FIXTURE = FIXTURES / "upstream_ops_cuda_semantics.pt"


@pytest.fixture(scope="module")
def ops():
    data = torch.load(OPS_FIXTURE, weights_only=True)
    # What each entry holds (and that float outputs are bit-exact except atomics).
    assert "ball_query" in data["notes"] and "atomicAdd" in data["notes"]
    return data


def _close(actual, expected, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- fixture: discrete ops


@pytest.mark.parametrize("method", ["dense", "grid"])
def test_ball_query_matches_upstream(ops, method):
    case = ops["ball_query"]
    i = case["inputs"]
    out = ball_query(i["centers_coords"], i["points_coords"], i["radius"], i["num_neighbors"], method=method)
    assert out.dtype == torch.long
    assert torch.equal(out, case["out"].long())
    # The fixture holds empty balls (all zeros) and partly filled ones.
    assert (case["out"] == 0).all(-1).any()


@pytest.mark.parametrize(
    ("backend", "method"),
    [("plain", "torch"), ("plain", "numpy"), ("compiled", "auto")],
    ids=["torch", "numpy", "compiled"],
)
@pytest.mark.parametrize("case", ["fps_random", "fps_lattice_ties", "fps_duplicates"])
def test_furthest_point_sampling_matches_upstream(ops, case, backend, method):
    entry = ops[case]
    coords, samples = entry["inputs"]["coords"], entry["inputs"]["num_samples"]
    out = furthest_point_sample_indices(coords, samples, backend=backend, method=method)
    # Exact order, ties included: the lattice case has N = 1331 > 512, so the
    # "smallest index modulo 512 first" rule decides many picks.
    assert torch.equal(out, entry["out"].long())


@pytest.mark.parametrize(
    ("backend", "method"),
    [("plain", "dense"), ("plain", "grid"), ("compiled", "auto")],
    ids=["dense", "grid", "compiled"],
)
@pytest.mark.parametrize("case", ["three_nn_random", "three_nn_ties", "three_nn_many_ties", "three_nn_m2"])
def test_three_nn_matches_upstream(ops, case, backend, method):
    entry = ops[case]
    i = entry["inputs"]
    indices, weights = three_nearest_neighbors(i["points_coords"], i["centers_coords"], method=method, backend=backend)
    assert torch.equal(indices, entry["indices"].long())
    assert torch.equal(weights, entry["weights"])  # rounded exactly like the kernel
    features = i["centers_features"].clone().requires_grad_()
    out = interpolate_from_neighbors(features, indices, weights)
    _close(out, entry["out"])
    out.backward(entry["grad_out"])
    _close(features.grad, entry["grad_centers_features"], rtol=1e-5, atol=1e-6)


def test_trilinear_devoxelize_matches_upstream(ops):
    entry = ops["trilinear"]
    i = entry["inputs"]
    r = i["resolution"]
    indices, weights = trilinear_corners(i["coords"], r)
    assert torch.equal(indices, entry["inds"].long())
    assert torch.equal(weights, entry["wgts"])
    b, c = i["features"].shape[:2]
    features = i["features"].clone().requires_grad_()
    out = trilinear_devoxelize(features.view(b, c, r, r, r), i["coords"], r)
    _close(out, entry["out"])
    out.backward(entry["grad_out"])
    _close(features.grad, entry["grad_features"], rtol=1e-5, atol=1e-6)


def test_avg_voxelize_matches_upstream(ops):
    entry = ops["avg_voxelize"]
    i = entry["inputs"]
    r = i["resolution"]
    index = flat_voxel_index(i["coords"], r)
    assert torch.equal(index, entry["ind"].long())
    assert torch.equal(voxel_point_counts(index, r), entry["cnt"].long())
    features = i["features"].clone().requires_grad_()
    grid = avg_voxelize(features, i["coords"], r)
    assert grid.shape == (2, features.shape[1], r, r, r)
    b, c = grid.shape[:2]
    _close(grid.reshape(b, c, -1), entry["out"])
    grid.reshape(b, c, -1).backward(entry["grad_out"])
    _close(features.grad, entry["grad_features"])


@pytest.mark.parametrize("op", ["grouping", "gather"])
def test_grouping_and_gather_match_upstream(ops, op):
    entry = ops[op]
    features = entry["inputs"]["features"].clone().requires_grad_()
    fn = grouping if op == "grouping" else gather
    out = fn(features, entry["inputs"]["indices"])
    assert torch.equal(out, entry["out"])
    out.backward(entry["grad_out"])
    _close(features.grad, entry["grad_features"])
    if op == "grouping":  # the fixture's -1 index must read as 0
        assert (entry["inputs"]["indices"] < 0).any()


# --------------------------------------------------------------------------- fast paths equal the reference


def _cloud(n: int, seed: int, lattice: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(2, 3, n, generator=g)
    pts[:, :, : n // 4] = pts[:, :, : n // 4] * 0.05 + 1.0  # a dense cluster
    pts[:, :, n // 4 : n // 4 + 20] = pts[:, :, n // 4 : n // 4 + 1]  # duplicates
    if lattice:  # many exactly equal distances
        pts = torch.round(pts * 4) / 4
    return pts


@pytest.fixture(params=["dense table", "binary search"])
def cell_lookup(request, monkeypatch):
    """Each of the cell grid's two ways to find a cell's points (the same starts and counts)."""
    monkeypatch.setattr(CellGrid, "_DENSE_PER_KEY", 1 << 30 if request.param == "dense table" else 0)
    return request.param


@pytest.mark.parametrize("lattice", [False, True])
def test_ball_query_grid_equals_dense(lattice, cell_lookup):
    points = _cloud(3000, 1, lattice)
    centers = points[:, :, ::7]
    for radius, u in [(0.05, 8), (0.3, 32), (0.25, 200)]:
        dense = ball_query(centers, points, radius, u, method="dense")
        grid = ball_query(centers, points, radius, u, method="grid")
        assert torch.equal(dense, grid)
    assert (dense[:, :, 1:] == dense[:, :, :1]).all(-1).any()  # some partly filled balls


@pytest.mark.parametrize("lattice", [False, True])
def test_three_nn_grid_equals_dense(lattice, cell_lookup):
    points = _cloud(4000, 2, lattice)
    centers = points[:, :, ::9].contiguous()
    # Far-away points: their third neighbour lies outside the first cells tried, so the
    # retry with larger cells and the dense fallback are exercised too.
    points = torch.cat([points, points[:, :, :50] * 40.0], 2)
    dense = three_nearest_neighbors(points, centers, method="dense")
    grid = three_nearest_neighbors(points, centers, method="grid")
    assert torch.equal(dense[0], grid[0])
    assert torch.equal(dense[1], grid[1])


def test_fps_backends_agree_beyond_512_points():
    coords = _cloud(1500, 3, lattice=True)
    a = furthest_point_sample_indices(coords, 300, method="torch")
    b = furthest_point_sample_indices(coords, 300, method="numpy")
    assert torch.equal(a, b)
    assert a[:, 0].eq(0).all()
    assert all(len(set(row.tolist())) == 300 for row in a)  # distinct while points remain


def test_fps_more_samples_than_points_repeats_index_zero():
    coords = torch.rand(1, 3, 5)
    out = furthest_point_sample_indices(coords, 8)
    assert sorted(out[0, :5].tolist()) == [0, 1, 2, 3, 4]
    assert out[0, 5:].tolist() == [0, 0, 0]


# --------------------------------------------------------------------------- gradients


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
        (lambda f: avg_voxelize(f, vox, r), features),
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


# --------------------------------------------------------------------------- errors and devices


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
    points = _cloud(2000, 4)
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
