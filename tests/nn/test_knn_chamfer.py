"""k-NN search (KD-tree vs chunked torch vs brute force) and the Chamfer loss."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn.knn import knn, knn_graph
from pointforge.nn.losses import chamfer_distance, point_to_plane_distance


def _batch(sizes):
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def brute_knn(ref, query, k, batch_ref, batch_query, exclude_self=False):
    """Full distance matrix, other clouds masked out, rows sorted by (distance, index)."""
    d = ((query[:, None, :] - ref[None, :, :]) ** 2).sum(-1)
    d = d.masked_fill(batch_query[:, None] != batch_ref[None, :], float("inf"))
    if exclude_self:
        d.fill_diagonal_(float("inf"))
    idx = torch.arange(ref.shape[0]).expand_as(d)
    order = torch.argsort(d, dim=1, stable=True)[:, :k]
    dist2, index = d.gather(1, order), idx.gather(1, order)
    index = torch.where(torch.isinf(dist2), -1, index)
    return dist2, index


@pytest.mark.parametrize("exclude_self", [False, True])
def test_knn_backends_match_brute_force_on_disjoint_batch(exclude_self):
    gen = torch.Generator().manual_seed(0)
    sizes_ref = [7, 40, 1, 90]  # the 1-point cloud has no candidate once self is excluded
    ref = torch.randn(sum(sizes_ref), 3, generator=gen)
    b_ref = _batch(sizes_ref)
    if exclude_self:
        query, b_query = ref, b_ref
    else:
        sizes_q = [5, 33, 3, 60]
        query = torch.randn(sum(sizes_q), 3, generator=gen)
        b_query = _batch(sizes_q)
    k = 10
    want_d, want_i = brute_knn(ref, query, k, b_ref, b_query, exclude_self)
    for backend, extra in (("kdtree", {}), ("torch", {}), ("torch", {"max_pairs": 37})):
        got = knn(ref, query, k, b_ref, b_query, exclude_self=exclude_self, backend=backend, **extra)
        assert torch.equal(got.index, want_i), (backend, extra)
        assert torch.allclose(got.dist2, want_d, rtol=0, atol=1e-6, equal_nan=False)
        assert torch.equal(torch.isinf(got.dist2), torch.isinf(want_d))
        # Neighbours never cross clouds.
        valid = got.index >= 0
        assert torch.equal(b_ref[got.index[valid]], b_query.unsqueeze(1).expand_as(got.index)[valid])


def test_knn_ties_give_equal_distances_and_valid_neighbour_sets():
    # An integer grid has many equidistant neighbours: backends may keep different
    # tied candidates at the k-th place but must agree on every distance.
    g = torch.arange(5, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    grid = torch.cat([grid, grid[:10]])  # exact duplicates too
    k = 8
    want_d, _ = brute_knn(
        grid, grid, k, torch.zeros(len(grid), dtype=torch.long), torch.zeros(len(grid), dtype=torch.long), True
    )
    for backend in ("kdtree", "torch"):
        got = knn(grid, grid, k, exclude_self=True, backend=backend, max_pairs=500)
        assert torch.equal(got.dist2, want_d), backend
        # Indices really are at the stated distances, distinct, never the point itself.
        recomputed = ((grid[:, None, :] - grid[got.index]) ** 2).sum(-1)
        assert torch.equal(recomputed, got.dist2)
        assert not (got.index == torch.arange(len(grid))[:, None]).any()
        assert all(len(set(row)) == k for row in got.index.tolist())
        # Rows ordered by (distance, index).
        key = got.dist2 * 10_000 + got.index
        assert torch.all(key[:, 1:] > key[:, :-1])
        # Deterministic across calls.
        again = knn(grid, grid, k, exclude_self=True, backend=backend, max_pairs=500)
        assert torch.equal(again.index, got.index)


def test_knn_graph_symmetric_no_self_loops_no_cross_cloud_edges():
    gen = torch.Generator().manual_seed(1)
    sizes = [3, 25, 50]
    pos = torch.randn(sum(sizes), 3, generator=gen)
    batch = _batch(sizes)
    directed = knn_graph(pos, 10, batch, symmetric=False)
    graph = knn_graph(pos, 10, batch)
    src, dst = graph
    assert not (src == dst).any()
    assert torch.equal(batch[src], batch[dst])
    edges = set(zip(src.tolist(), dst.tolist()))
    assert len(edges) == graph.shape[1]
    assert all((j, i) in edges for i, j in edges)
    assert set(zip(*directed.tolist())) <= edges
    # In-degree of the directed graph: k, or (cloud size - 1) in small clouds.
    indeg = torch.bincount(directed[1], minlength=len(pos))
    assert torch.equal(indeg, torch.tensor([2] * 3 + [10] * 75))
    # Sorted by (target, source).
    key = dst * len(pos) + src
    assert torch.all(key[1:] > key[:-1])
    assert torch.equal(knn_graph(pos, 10, batch, backend="torch"), graph)


def test_knn_rejects_bad_input():
    pts = torch.randn(5, 3)
    with pytest.raises(DataError, match="sorted"):
        knn(pts, pts, 2, torch.tensor([0, 1, 0, 1, 1]), torch.tensor([0, 1, 0, 1, 1]))
    with pytest.raises(ConfigError, match="backend"):
        knn(pts, pts, 2, backend="faiss")
    with pytest.raises(ConfigError, match="k must"):
        knn(pts, pts, 0)
    with pytest.raises(DataError, match=r"\[N, D\]"):
        knn(pts.reshape(-1), pts, 2)


def brute_chamfer(pred, target, b_pred, b_target, num_clouds):
    values = []
    for b in range(num_clouds):
        p, q = pred[b_pred == b], target[b_target == b]
        d = ((p[:, None, :] - q[None, :, :]) ** 2).sum(-1)
        values.append(d.min(dim=1).values.mean() + d.min(dim=0).values.mean())
    return torch.stack(values)


@pytest.mark.parametrize("backend", ["kdtree", "torch"])
def test_chamfer_matches_brute_force_values_and_gradients(backend):
    gen = torch.Generator().manual_seed(2)
    sizes_p, sizes_q = [4, 30, 100], [9, 12, 250]
    pred0 = torch.randn(sum(sizes_p), 3, generator=gen, dtype=torch.float64)
    target0 = torch.randn(sum(sizes_q), 3, generator=gen, dtype=torch.float64)
    b_p, b_q = _batch(sizes_p), _batch(sizes_q)

    pred, target = pred0.clone().requires_grad_(), target0.clone().requires_grad_()
    per_cloud = chamfer_distance(pred, target, b_p, b_q, reduction="none", backend=backend, max_pairs=64)
    loss = chamfer_distance(pred, target, b_p, b_q, backend=backend)
    loss.backward()

    pred_bf, target_bf = pred0.clone().requires_grad_(), target0.clone().requires_grad_()
    want = brute_chamfer(pred_bf, target_bf, b_p, b_q, 3)
    want.mean().backward()

    assert torch.allclose(per_cloud, want, rtol=1e-12, atol=0)
    assert torch.allclose(loss, want.mean(), rtol=1e-12, atol=0)
    assert torch.allclose(pred.grad, pred_bf.grad, rtol=1e-10, atol=1e-14)
    assert torch.allclose(target.grad, target_bf.grad, rtol=1e-10, atol=1e-14)


def test_chamfer_is_zero_for_identical_clouds_and_weights_clouds_equally():
    gen = torch.Generator().manual_seed(3)
    one, big = torch.randn(1, 3, generator=gen), torch.randn(1000, 3, generator=gen)
    batch = _batch([1, 1000])
    target = torch.cat([one, big])
    assert chamfer_distance(target, target, batch, batch).item() == 0.0
    # Move the one-point cloud by 1: its CD is 1 each way = 2; the big cloud's is 0.
    # The mean over clouds is then 1, not the ~0.002 a mean over points would give.
    pred = torch.cat([one + torch.tensor([1.0, 0, 0]), big])
    per_cloud = chamfer_distance(pred, target, batch, batch, reduction="none")
    assert torch.allclose(per_cloud, torch.tensor([2.0, 0.0]), atol=1e-6)
    assert abs(chamfer_distance(pred, target, batch, batch).item() - 1.0) < 1e-6


def test_chamfer_rejects_missing_clouds():
    pts = torch.randn(6, 3)
    with pytest.raises(DataError, match="no target points"):
        chamfer_distance(pts, pts[:3], torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 0, 0]), num_clouds=2)
    with pytest.raises(DataError, match=r"\[N, 3\]"):
        chamfer_distance(pts[:, :2], pts)


def test_point_to_plane_distance_is_the_across_surface_error_per_cloud():
    g = torch.Generator().manual_seed(3)
    plane = torch.cat([torch.rand(400, 2, generator=g) * 5, torch.zeros(400, 1)], 1)
    tilted = plane @ torch.tensor([[1.0, 0, 0], [0, 0.8, 0.6], [0, -0.6, 0.8]])  # a second cloud, another plane
    normal = torch.tensor([0, -0.6, 0.8])
    along = plane[:50] + torch.cat([torch.rand(50, 2, generator=g) * 0.02, torch.zeros(50, 1)], 1)
    across = tilted[:80] + 0.1 * normal
    pred = torch.cat([along, across]).requires_grad_(True)
    pred_batch = torch.cat([torch.zeros(50, dtype=torch.long), torch.ones(80, dtype=torch.long)])
    target_batch = torch.cat([torch.zeros(400, dtype=torch.long), torch.ones(400, dtype=torch.long)])
    loss = point_to_plane_distance(pred, torch.cat([plane, tilted]), pred_batch, target_batch)
    assert float(loss) == pytest.approx((0.0 + 0.01) / 2, rel=1e-4)  # cloud 0 on its plane, cloud 1 0.1 off
    loss.backward()
    grad = pred.grad[50:] / pred.grad[50:].norm(dim=1, keepdim=True)
    assert torch.allclose(grad, normal.expand_as(grad), atol=1e-4)  # the pull is straight across the surface
    assert pred.grad[:50].abs().max() < 1e-6
