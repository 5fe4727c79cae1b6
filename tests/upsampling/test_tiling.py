"""Tiled upsampling: the same points as one pass, no duplicates, no seams, bounded by the tile budget."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from pointforge import devices
from pointforge.data.pairs import synthetic_pair
from pointforge.data.pointio import LasGeometry, read_points, write_points
from pointforge.data.pointstream import cloud_writer, open_cloud
from pointforge.errors import ConfigError
from pointforge.inference.upsampler import LoadedUpsampler
from pointforge.nn.upsampler import build_upsampler
from pointforge.tasks.configs import load_train_config
from pointforge.upsampling import pipeline as upsampler_module, tiling as tiling_module
from pointforge.upsampling.pipeline import upsample_cloud, upsample_file, upsample_points
from pointforge.upsampling.tiling import choose_tile_points, iter_tiles, tile_cloud
from tests.helpers import REPO, run_cli

TILE = 1500
pytestmark = pytest.mark.usefixtures("one_thread")


def _scene(tmp_path_factory, start):
    """A 5,000-point lidar-like tile, a tiny network whose offsets are large (so its output depends on the
    neighbourhood: a seam would show), and its untiled output."""
    torch.manual_seed(0)
    net = build_upsampler("tiny", start=start).eval()
    for head in (net.coarse, net.decode[-1][-1]):
        torch.nn.init.normal_(head.weight, std=0.5)
    cfg = load_train_config("upsampler", REPO / "pointforge" / "configs" / "upsampler" / "tiny.yaml")
    model = LoadedUpsampler(net, cfg.task, cfg, "model", torch.device("cpu"), "test", "upsampler")
    sparse, _ = synthetic_pair(5000, seed=5)
    path = tmp_path_factory.mktemp("tiles") / "sparse.npy"
    write_points(path, sparse)
    return path, sparse, model, upsample_points(model, sparse)


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    return _scene(tmp_path_factory, "input")


@pytest.fixture(scope="module")
def plane_scene(tmp_path_factory):
    """The same with the children starting on the local planes (one more use of the graph)."""
    return _scene(tmp_path_factory, "plane")


def _tiled(model, path, folder, margin=None):
    net = model.model
    hops = net.config.feature_layers + 2  # as upsample_file has it
    tiled = tile_cloud(open_cloud(path), folder, tile_points=TILE, k=net.config.k, hops=hops, margin=margin, chunk=700)
    out = np.full((open_cloud(path).count, 2, 3), np.nan)
    seen = np.zeros(len(out), int)
    for index, children in iter_tiles(tiled, lambda xyz, norm: upsample_cloud(net, xyz, norm=norm), 2):
        out[index] = children.reshape(-1, 2, 3)
        np.add.at(seen, index, 1)
    return tiled, out, seen


def _border_distance(tiled, xy):
    """Distance of each point to the nearest inner tile border (its own core's edges inside the grid)."""
    plan = tiled.plan
    ix, iy = plan.cells(xy)
    distance = np.full(len(xy), np.inf)
    for tile in plan.tiles:
        i0, i1, j0, j1 = tile.core
        mine = (ix >= i0) & (ix < i1) & (iy >= j0) & (iy < j1)
        for edge, axis, inner in (
            (i0, 0, i0 > 0),
            (i1, 0, i1 < plan.shape[0]),
            (j0, 1, j0 > 0),
            (j1, 1, j1 < plan.shape[1]),
        ):
            if inner:
                line = plan.origin[axis] + edge * plan.cell
                distance[mine] = np.minimum(distance[mine], np.abs(xy[mine, axis] - line))
    return distance


@pytest.mark.parametrize("which", ["scene", "plane_scene"])
def test_tiled_equals_untiled_with_no_duplicates_and_no_seams(which, request, tmp_path):
    path, sparse, model, whole = request.getfixturevalue(which)
    (tmp_path / "a").mkdir()
    tiled, out, seen = _tiled(model, path, tmp_path / "a")
    assert len(tiled.plan.tiles) >= 4 and all(t.halo_points <= TILE for t in tiled.plan.tiles)
    assert (seen == 1).all()  # every input point is the core of exactly one tile: r·N points, no duplicates
    spacing = tiled.scale
    error = np.abs(out.reshape(-1, 3) - whole).max(axis=1).reshape(-1, 2).max(axis=1) / spacing
    border = _border_distance(tiled, sparse[:, :2])
    near = border < 2 * spacing
    assert near.sum() > 100
    assert error[~near].max() < 1e-3  # away from the borders: the same points as one pass
    assert error[near].max() < 1e-2  # and at them within 1 % of a spacing (float32 rounding in another frame)
    # No seam in density: output points per ball around border points, tiled against untiled.
    centres = sparse[near]
    radius = 3 * spacing
    counts_tiled = cKDTree(out.reshape(-1, 3)).query_ball_point(centres, radius, return_length=True)
    counts_whole = cKDTree(whole).query_ball_point(centres, radius, return_length=True)
    assert counts_tiled.sum() / counts_whole.sum() == pytest.approx(1.0, abs=0.01)

    # The check can fail: without the margin the same tiles differ at their borders.
    (tmp_path / "b").mkdir()
    bare, bare_out, bare_seen = _tiled(model, path, tmp_path / "b", margin=0.0)
    assert (bare_seen == 1).all()
    bare_error = np.abs(bare_out.reshape(-1, 3) - whole).max(axis=1).reshape(-1, 2).max(axis=1) / spacing
    assert bare_error[_border_distance(bare, sparse[:, :2]) < spacing].max() > 0.05


def test_upsample_file_tiles_large_clouds_and_keeps_las_geometry(scene, tmp_path):
    path, sparse, model, whole = scene
    geometry = LasGeometry(scales=(0.001,) * 3, offsets=(500_000.0, 4_100_000.0, 0.0), point_format=3, version="1.4")
    las_in = tmp_path / "in.laz"
    write_points(las_in, sparse, las=geometry)
    result = upsample_file(las_in, tmp_path / "out.laz", model, tile_points=TILE)
    assert result.tiles >= 4 and result.points_out == 2 * len(sparse)
    out = read_points(tmp_path / "out.laz")
    assert out.las == geometry and len(out) == 2 * len(sparse)
    gap, _ = cKDTree(upsample_points(model, read_points(las_in).xyz)).query(out.xyz)
    assert gap.max() < 2e-3  # the one-pass points, up to LAS millimetres
    npy = upsample_file(path, tmp_path / "out.npy", model, tile_points=TILE)
    got = np.load(tmp_path / "out.npy")
    assert npy.tiles == result.tiles and got.shape == whole.shape
    assert cKDTree(whole).query(got)[0].max() < 1e-3 * result.points_in  # loose: same set, tile order
    assert not list(tmp_path.glob(".pointforge-tiles-*"))  # the tile files are gone


def test_tiles_are_bounded_by_the_budget_and_each_gives_its_freed_memory_back(scene, tmp_path, monkeypatch):
    path, sparse, model, _ = scene
    released = []
    monkeypatch.setattr(tiling_module, "release_freed_memory", lambda: released.append(1) or True)
    result = upsample_file(path, tmp_path / "out.npy", model, tile_points=TILE)
    assert len(result.tile_sizes) == result.tiles == len(released) >= 4  # once per tile, after its network pass
    assert max(result.tile_sizes) <= TILE and sum(result.tile_sizes) > len(sparse)  # margins are extra copies
    whole = upsample_file(path, tmp_path / "whole.npy", model, tile_points=len(sparse))
    assert whole.tile_sizes == (len(sparse),) and len(released) == result.tiles  # one pass: no tiles, no trimming
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert devices.release_freed_memory() is glibc and devices.map_large_blocks(4 * 2**20) is glibc


def test_memory_is_checked_up_front_with_what_fits(scene, tmp_path, monkeypatch):
    assert choose_tile_points(16, 2, None, 64 * 2**30) == 100_000
    with pytest.raises(ConfigError, match=r"--tile-points \d+ or less"):
        choose_tile_points(16, 2, 10_000_000, 8 * 2**30)
    with pytest.raises(ConfigError, match="free memory or use a smaller model"):
        choose_tile_points(128, 2, None, 700 * 2**20)
    path, _, model, _ = scene
    monkeypatch.setattr(upsampler_module, "available_memory_bytes", lambda device: 2**30)
    with pytest.raises(ConfigError, match="tiles of 1000000 points"):
        upsample_file(path, tmp_path / "out.npy", model, tile_points=1_000_000)
    assert not (tmp_path / "out.npy").exists()


@pytest.mark.parametrize("suffix", [".npy", ".ply", ".laz"])
def test_streamed_reading_and_writing_equal_whole_files(tmp_path, suffix):
    xyz = np.random.default_rng(0).uniform(0, 100, (2500, 3)).astype(np.float32 if suffix == ".ply" else np.float64)
    write_points(tmp_path / f"a{suffix}", xyz)
    source = open_cloud(tmp_path / f"a{suffix}")
    whole = read_points(tmp_path / f"a{suffix}")
    assert source.count == 2500 and source.dtype == whole.dtype and source.las == whole.las
    np.testing.assert_array_equal(np.concatenate(list(source.chunks(1000))), whole.xyz)
    with cloud_writer(tmp_path / f"b{suffix}", 2500, dtype=whole.dtype, las=whole.las) as write:
        for start in range(0, 2500, 700):
            write(whole.xyz[start : start + 700])
    again = read_points(tmp_path / f"b{suffix}")
    np.testing.assert_array_equal(again.xyz, whole.xyz)
    assert again.dtype == whole.dtype and again.las == whole.las
    with (
        pytest.raises(ValueError, match="of the 2500 points"),
        cloud_writer(tmp_path / f"c{suffix}", 2500, las=whole.las) as write,
    ):
        write(whole.xyz[:10])
    assert not (tmp_path / f"c{suffix}").exists()


def test_cli_reports_the_tiles(scene, tmp_path, monkeypatch):
    path, _, model, _ = scene
    monkeypatch.setattr(upsampler_module, "load_upsampler", lambda ckpt, device: model)
    (tmp_path / "ck.pt").write_bytes(b"")
    result = run_cli("upsample", path, "--ckpt", tmp_path / "ck.pt", "--out", tmp_path / "o.ply", "--tile-points", TILE)
    assert result.exit_code == 0, result.output
    assert "5000 → 10000 points in" in result.output and "tiles" in result.output
