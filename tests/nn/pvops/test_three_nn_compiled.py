"""The compiled 3-NN grid search (Numba) against the dense torch path: the same indices and weights, ties included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn import backends
from pointforge.nn.pvops import three_nn
from pointforge.nn.pvops.three_nn import three_nearest_neighbors

pytest.importorskip("numba", reason="the compiled 3-NN search needs Numba (a core dependency: pip install numba)")
from pointforge.nn.pvops.three_nn_compiled import three_nn_grid

pytestmark = pytest.mark.usefixtures("one_thread")


def _same(points: torch.Tensor, centers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both paths' (indices, weights), checked identical; returns the dense path's."""
    dense = three_nearest_neighbors(points, centers, method="dense")
    compiled = three_nearest_neighbors(points, centers, backend="compiled")
    assert torch.equal(compiled[0], dense[0])
    assert torch.equal(compiled[1], dense[1])
    return dense


def _lattice(side: int) -> torch.Tensor:
    axes = torch.meshgrid(*[torch.arange(float(side))] * 3, indexing="ij")
    return torch.stack(axes).reshape(1, 3, -1)


@pytest.mark.parametrize(("n", "m"), [(500, 40), (3000, 700), (4000, 1000)])
def test_random_clouds_give_the_dense_result(n, m):
    g = torch.Generator().manual_seed(n)
    points = torch.rand(2, 3, n, generator=g) * 4 - 2
    _same(points, points[:, :, torch.randperm(n, generator=g)[:m]].contiguous())


def test_a_lattice_with_ties_everywhere_gives_the_dense_result():
    points = _lattice(11) / 7  # 1,331 points; the centres every other lattice point
    centers = points[:, :, ::2].contiguous()
    indices, _ = _same(points, centers)
    # Ties decide: a point midway between centres has several at its third distance.
    d = ((points[0, :, :, None] - centers[0, :, None, :]) ** 2).sum(0)
    third = d.sort(1).values[:, 2:3]
    assert ((d == third).sum(1) > 1).any()
    assert indices.numel() > 0


def test_duplicated_centres_go_to_the_lower_index():
    g = torch.Generator().manual_seed(3)
    base = torch.rand(1, 3, 400, generator=g)
    centers = torch.cat([base, base, base[:, :, :100]], 2)  # each centre two or three times
    points = torch.rand(1, 3, 2000, generator=g)
    indices, _ = _same(points, centers)
    # The nearest of a point is a centre of the first copy, then its second copy.
    assert (indices[0, 0] < 400).all()
    assert torch.equal(indices[0, 1], indices[0, 0] + 400)


@pytest.mark.parametrize("m", [1, 2])
def test_fewer_than_three_centres(m):
    points = torch.rand(1, 3, 300, generator=torch.Generator().manual_seed(m))
    indices, weights = _same(points, points[:, :, :m].contiguous())
    assert indices[0, m:].eq(0).all()  # empty slots point at index 0 ...
    assert weights[0, m:].lt(1e-6).all()  # ... with distance 1e10, a weight near 0


def test_float64_far_points_and_a_stretched_cloud():
    g = torch.Generator().manual_seed(5)
    points = torch.randn(2, 3, 3000, generator=g, dtype=torch.float64)
    _same(points, points[:, :, ::5].contiguous())
    # Points far outside the centres' grid search many rings before their bound holds.
    far = torch.cat([points[:, :, :2000], points[:, :, 2000:] * 50], 2).float()
    _same(far, points[:, :, :2000:4].float().contiguous())
    # A cloud long in x: the grid's cell cap makes cells larger than the spacing.
    line = torch.rand(1, 3, 4000, generator=g) * torch.tensor([[[1000.0], [1e-3], [1e-3]]])
    _same(line, line[:, :, ::6].contiguous())
    # float32 far from the origin: coarse rounding against the cell edges.
    offset = 1000 + torch.rand(1, 3, 3000, generator=g) * 1e-2
    _same(offset, offset[:, :, ::4].contiguous())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_of_different_clouds_on_threads(threads):
    g = torch.Generator().manual_seed(8)
    points = torch.cat(
        [torch.rand(1, 3, 3000, generator=g), _lattice(15)[:, :, :3000] / 4, torch.randn(1, 3, 3000, generator=g)]
    )
    centers = points[:, :, 1::7].contiguous()
    d, idx = three_nn_grid(points.numpy(), centers.numpy(), threads=threads)
    for e in range(3):  # each element alone gives its rows: nothing leaks between them
        alone = three_nn._three_nn_dense(points[e : e + 1], centers[e : e + 1])
        assert torch.equal(torch.from_numpy(d[e]), alone[0])
        assert torch.equal(torch.from_numpy(idx[e]), alone[1])


def _search(points: torch.Tensor, centers: torch.Tensor, backend: str = "auto", method: str = "auto") -> str:
    return three_nn._pick_method(points, centers, method, backend)[0]


def test_auto_takes_the_compiled_search_on_cpu_and_falls_back_without_numba(monkeypatch):
    monkeypatch.setitem(backends.PATHS, "three_nn", dataclasses.replace(backends.PATHS["three_nn"], min_size=50))
    points = torch.rand(1, 3, 50)
    centers = points[:, :, :10]
    assert _search(points, centers) == "compiled"
    assert _search(points[:, :, :49], centers) == "dense"  # small: no Numba import
    assert _search(points.half(), centers.half()) == "dense"
    assert _search(points, centers, backend="plain") == "dense"
    assert _search(points, centers, method="grid") == "grid"  # a torch search named: no compiled one
    broken = points.clone()
    broken[0, 0, 3] = float("nan")
    assert _search(broken, centers) == "dense"
    with pytest.raises(DataError, match="finite"):
        three_nearest_neighbors(broken, centers, backend="compiled")
    with pytest.raises(DataError, match="method must be one of"):
        three_nearest_neighbors(points, centers, method="kd")
    with pytest.raises(ConfigError, match="torch search"):
        three_nearest_neighbors(points, centers, method="dense", backend="compiled")
    monkeypatch.setattr(backends, "load", lambda name: None)
    assert _search(points, centers) == "dense"
    with pytest.raises(ConfigError, match="pip install numba"):
        three_nearest_neighbors(points, centers, backend="compiled")


def test_a_centre_tied_with_the_third_exactly_at_the_ring_bound_is_found():
    # Cells of side 1 from x = 0: a point at x = 1.5 sees centres x = 0, 1, 2 in its first
    # two rings, and the ring bound (the face at x = 3) is exactly 1.5 away, where the
    # unvisited centre x = 3 ties the third distance (2.25) with a lower index: only a
    # conservative stop finds it.
    centers = torch.tensor([[[3.0, 0.0, 1.0, 2.0], [0.0] * 4, [0.0] * 4]])
    points = torch.tensor([[[1.5], [0.0], [0.0]]])
    d, idx = three_nn_grid(points.numpy(), centers.numpy(), side=1.0)
    assert idx[0, 0].tolist() == [2, 3, 0]
    expected = three_nn._three_nn_dense(points, centers)
    assert torch.equal(torch.from_numpy(idx[0]), expected[1])
    assert torch.equal(torch.from_numpy(d[0]), expected[0])


@pytest.mark.parametrize("side", [0.05, 0.3, 1.0, 7.0])
def test_any_cell_side_gives_the_dense_result(side):
    # Cells far smaller than the spacing (many rings), near it, and one cell for everything.
    points = torch.cat([_lattice(9) / 3, torch.rand(1, 3, 500, generator=torch.Generator().manual_seed(9)) * 3], 2)
    centers = points[:, :, ::5].contiguous()
    d, idx = three_nn_grid(points.numpy(), centers.numpy(), side=side)
    expected = three_nn._three_nn_dense(points, centers)
    assert torch.equal(torch.from_numpy(idx[0]), expected[1])
    assert torch.equal(torch.from_numpy(d[0]), expected[0])
