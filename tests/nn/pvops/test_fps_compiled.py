"""The compiled FPS loop that skips points (Numba) against the plain NumPy loop: the same indices, ties included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn import backends
from pointforge.nn.pvops import fps
from pointforge.nn.pvops.fps import furthest_point_sample_indices

pytest.importorskip("numba", reason="the compiled FPS loop needs Numba (a core dependency: pip install numba)")
from pointforge.nn.pvops.fps_compiled import bucketed_fps

pytestmark = pytest.mark.usefixtures("one_thread")


def _plain(coords: torch.Tensor, samples: int) -> torch.Tensor:
    return furthest_point_sample_indices(coords, samples, method="numpy")


def _compiled(coords: torch.Tensor, samples: int) -> torch.Tensor:
    return furthest_point_sample_indices(coords, samples, backend="compiled")


def _lattice(side: int) -> torch.Tensor:
    axes = torch.meshgrid(*[torch.arange(float(side))] * 3, indexing="ij")
    return torch.stack(axes).reshape(1, 3, -1)


def _sphere(batch: int, n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    v = torch.randn(batch, 3, n, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return 3 * v / v.norm(dim=1, keepdim=True)


@pytest.mark.parametrize(("n", "samples"), [(300, 100), (2000, 700), (5000, 1500)])
def test_random_clouds_give_the_plain_indices(n, samples):
    coords = torch.rand(2, 3, n, generator=torch.Generator().manual_seed(n)) * 4 - 2
    assert torch.equal(_compiled(coords, samples), _plain(coords, samples))


def test_a_lattice_with_ties_everywhere_gives_the_plain_indices():
    # 12^3 = 1728 > 512 points on a grid: almost every pick is a tie, decided by the
    # smallest index modulo 512 and then the smallest index.
    coords = _lattice(12)
    expected = _plain(coords, 1728)
    assert torch.equal(_compiled(coords, 1728), expected)
    # The modulo-512 rule decides here: ties to the plain smallest index pick otherwise.
    assert not torch.equal(fps._fps_numpy(coords.contiguous(), 1728), expected)


def test_duplicated_points_give_the_plain_indices():
    cloud = torch.rand(2, 3, 700, generator=torch.Generator().manual_seed(3))
    coords = torch.cat([cloud, cloud, cloud[:, :, :300]], 2)  # every point two or three times
    assert torch.equal(_compiled(coords, 1700), _plain(coords, 1700))


def test_a_far_cluster_gives_the_plain_indices():
    g = torch.Generator().manual_seed(4)
    coords = torch.cat([torch.rand(1, 3, 3000, generator=g), 50 + torch.rand(1, 3, 5, generator=g)], 2)
    expected = _plain(coords, 900)
    assert torch.equal(_compiled(coords, 900), expected)
    assert expected[0, 1] >= 3000  # the first pick after index 0 is in the far cluster


def test_float64_and_coordinates_far_from_the_origin_give_the_plain_indices():
    coords = _sphere(2, 3000, 5, torch.float64)
    assert torch.equal(_compiled(coords, 1000), _plain(coords, 1000))
    # float32 far from the origin: the distances' rounding is coarse against the box bounds.
    offset = (1000 + _sphere(1, 3000, 6) * 1e-3).float()
    assert torch.equal(_compiled(offset, 1000), _plain(offset, 1000))


def test_more_samples_than_points_and_one_sample():
    coords = torch.rand(1, 3, 600, generator=torch.Generator().manual_seed(7))
    expected = _plain(coords, 650)
    assert torch.equal(_compiled(coords, 650), expected)
    assert expected[0, 600:].eq(0).all()  # once every point is chosen, index 0
    assert _compiled(coords, 1).tolist() == [[0]]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_of_different_clouds_on_threads(threads):
    coords = torch.cat([_sphere(1, 4000, 8), _lattice(16)[:, :, :4000] / 5, torch.rand(1, 3, 4000) * 6], 0)
    order = fps._fps_scan_order(4000, coords.device)
    assert order is not None
    pts = coords.index_select(2, order).contiguous().numpy()
    got = torch.from_numpy(bucketed_fps(pts, 1200, threads=threads))
    assert torch.equal(order[got], _plain(coords, 1200))
    for e in range(3):  # each element alone gives its row: nothing leaks between them
        assert torch.equal(order[got[e]], _plain(coords[e : e + 1], 1200)[0])


@pytest.mark.parametrize("leaf_size", [1, 4, 1000])
def test_any_leaf_size_gives_the_plain_indices(leaf_size):
    # One point per leaf (all pruning), tiny leaves, one leaf for everything (no pruning).
    coords = torch.cat([_sphere(1, 900, 9), _lattice(8).expand(1, -1, -1) / 3], 2)
    pts = coords.index_select(2, fps._fps_scan_order(1412, coords.device)).contiguous().numpy()
    order = fps._fps_scan_order(1412, coords.device)
    got = torch.from_numpy(bucketed_fps(pts, 800, leaf_size=leaf_size))
    assert torch.equal(order[got], _plain(coords, 800))


def _loop(coords: torch.Tensor, backend: str = "auto", method: str = "auto") -> str:
    return fps._pick_loop(coords, method, backend)[0]


def test_auto_takes_the_compiled_loop_on_cpu_and_falls_back_without_numba(monkeypatch):
    monkeypatch.setitem(backends.PATHS, "fps", dataclasses.replace(backends.PATHS["fps"], min_size=50))
    coords = torch.rand(1, 3, 50)
    assert _loop(coords) == "compiled"
    assert _loop(coords[:, :, :49]) == "numpy"  # small clouds: no compilation to pay
    assert _loop(coords.half()) == "numpy"
    assert _loop(coords, backend="plain") == "numpy"
    assert _loop(coords, method="torch") == "torch"  # a plain loop named: no compiled one
    broken = coords.clone()
    broken[0, 0, 3] = float("nan")
    assert _loop(broken) == "numpy"  # NaN distances: only the plain loop's rule
    with pytest.raises(DataError, match="finite"):
        furthest_point_sample_indices(broken, 5, backend="compiled")
    with pytest.raises(ConfigError, match="plain loop"):
        furthest_point_sample_indices(coords, 5, backend="compiled", method="numpy")
    with pytest.raises(DataError, match="method must be one of"):
        furthest_point_sample_indices(coords, 5, method="numba")
    monkeypatch.setattr(backends, "load", lambda name: None)
    assert _loop(coords) == "numpy"
    assert torch.equal(furthest_point_sample_indices(coords, 20), _plain(coords, 20))
    with pytest.raises(ConfigError, match="pip install numba"):
        furthest_point_sample_indices(coords, 5, backend="compiled")
