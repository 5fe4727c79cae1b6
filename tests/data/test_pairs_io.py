"""Point cloud files (npy, ply, las, laz) round-trip exactly; pair manifests, normalisation, graph caches."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pointforge.data.pairs import dataset as pairs_module
from pointforge.data.pairs.dataset import UpsamplingPairs, graph_cache_path
from pointforge.data.pairs.manifest import PairEntry, read_manifest, write_manifest
from pointforge.data.pairs.normalization import pair_normalization
from pointforge.data.pairs.scenes import SyntheticScene, spread_sizes, synthetic_pair, write_synthetic_pairs
from pointforge.data.pointio import LasGeometry, count_points, read_points, write_points
from pointforge.errors import ConfigError, DataError


def _georeferenced(n=500, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    xyz = rng.uniform(0, 100, (n, 3)) + np.array([512_345.678, 4_123_456.789, 201.5])
    return xyz.astype(dtype)


def _no_temp_files(folder):
    return not [p for p in os.listdir(folder) if ".tmp" in p]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("suffix, ascii_", [(".npy", False), (".ply", False), (".ply", True)])
def test_npy_and_ply_round_trip_exactly(tmp_path, dtype, suffix, ascii_):
    xyz = _georeferenced(dtype=dtype)
    path = write_points(tmp_path / f"cloud{suffix}", xyz, ply_ascii=ascii_)
    cloud = read_points(path)
    assert cloud.xyz.dtype == np.float64 and cloud.dtype == dtype
    assert np.array_equal(cloud.xyz, xyz.astype(np.float64))
    assert count_points(path) == len(xyz)
    # Writing what was read restores the same bytes' worth of values in the same precision.
    again = read_points(write_points(tmp_path / f"again{suffix}", cloud, ply_ascii=ascii_))
    assert np.array_equal(again.xyz, cloud.xyz) and again.dtype == dtype
    assert _no_temp_files(tmp_path)


def test_npy_accepts_extra_columns_and_structured_arrays(tmp_path):
    xyz = _georeferenced(20)
    np.save(tmp_path / "wide.npy", np.column_stack([xyz, np.arange(20.0)]))
    assert np.array_equal(read_points(tmp_path / "wide.npy").xyz, xyz)
    rec = np.zeros(20, dtype=[("x", "f8"), ("y", "f8"), ("z", "f8"), ("intensity", "u2")])
    rec["x"], rec["y"], rec["z"] = xyz.T
    np.save(tmp_path / "rec.npy", rec)
    assert np.array_equal(read_points(tmp_path / "rec.npy").xyz, xyz)
    np.save(tmp_path / "flat.npy", xyz[:, :2])
    with pytest.raises(DataError, match=r"\[N, 3\]"):
        read_points(tmp_path / "flat.npy")


def test_ply_reader_skips_faces_other_properties_and_reads_big_endian(tmp_path):
    # A mesh PLY (as other tools write them): vertices with extra properties, then faces.
    verts = np.array([[0.5, 1.25, -2.0], [3.0, 4.0, 5.0], [6.5, 7.0, 8.0]], dtype=">f4")
    header = (
        "ply\nformat binary_big_endian 1.0\ncomment made by hand\nelement vertex 3\n"
        "property float x\nproperty float y\nproperty uchar red\nproperty float z\n"
        "element face 1\nproperty list uchar int vertex_indices\nend_header\n"
    )
    body = b""
    for v in verts:
        body += v[:2].tobytes() + bytes([200]) + v[2:].tobytes()
    body += bytes([3]) + np.array([0, 1, 2], ">i4").tobytes()
    (tmp_path / "mesh.ply").write_bytes(header.encode() + body)
    assert np.array_equal(read_points(tmp_path / "mesh.ply").xyz, verts.astype(np.float64))
    # A face element *before* the vertices is skipped row by row (list lengths vary).
    header2 = (
        "ply\nformat binary_little_endian 1.0\nelement face 2\nproperty list uchar int vertex_indices\n"
        "element vertex 3\nproperty double x\nproperty double y\nproperty double z\nend_header\n"
    )
    faces = bytes([3]) + np.array([0, 1, 2], "<i4").tobytes() + bytes([4]) + np.array([0, 1, 2, 0], "<i4").tobytes()
    (tmp_path / "first.ply").write_bytes(header2.encode() + faces + verts.astype("<f8").tobytes())
    assert np.array_equal(read_points(tmp_path / "first.ply").xyz, verts.astype(np.float64))
    ascii_ = "ply\nformat ascii 1.0\nelement face 1\nproperty list uchar int vertex_indices\nelement vertex 2\nproperty float z\nproperty float y\nproperty float x\nend_header\n3 0 1 2\n1 2 3\n4 5 6\n"
    (tmp_path / "a.ply").write_text(ascii_)
    assert np.array_equal(read_points(tmp_path / "a.ply").xyz, [[3, 2, 1], [6, 5, 4]])
    assert count_points(tmp_path / "a.ply") == 2


def test_truncated_or_foreign_files_raise_one_line_data_errors(tmp_path):
    path = write_points(tmp_path / "c.ply", _georeferenced(100))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 17])
    with pytest.raises(DataError, match="truncated"):
        read_points(path)
    (tmp_path / "junk.ply").write_bytes(b"not a ply at all")
    with pytest.raises(DataError, match="not a PLY"):
        read_points(tmp_path / "junk.ply")
    (tmp_path / "junk.laz").write_bytes(b"LASFgarbage")
    with pytest.raises(DataError, match="junk.laz"):
        read_points(tmp_path / "junk.laz")
    for suffix in (".las", ".laz"):
        data = write_points(tmp_path / f"whole{suffix}", _georeferenced(3000)).read_bytes()
        for cut in (300, len(data) // 2):
            (tmp_path / f"cut{suffix}").write_bytes(data[:cut])
            with pytest.raises(DataError, match=f"cut{suffix}"):
                read_points(tmp_path / f"cut{suffix}")
    # Cut exactly between two LAS records: readable, but fewer points than the header says.
    import laspy

    whole = tmp_path / "whole.las"
    with laspy.open(whole) as reader:
        start, record = reader.header.offset_to_point_data, reader.header.point_format.size
    (tmp_path / "short.las").write_bytes(whole.read_bytes()[: start + 60 * record])
    with pytest.raises(DataError, match="60 of the 3000 points"):
        read_points(tmp_path / "short.las")
    with pytest.raises(DataError, match="unsupported point cloud format"):
        read_points(tmp_path / "cloud.xyz")
    with pytest.raises(DataError, match="no such point cloud"):
        read_points(tmp_path / "missing.npy")
    bad = _georeferenced(5)
    bad[2, 1] = np.nan
    with pytest.raises(DataError, match="NaN"):
        write_points(tmp_path / "nan.npy", bad)


@pytest.mark.parametrize("suffix", [".las", ".laz"])
def test_las_and_laz_keep_scales_offsets_and_integers_exactly(tmp_path, suffix):
    import laspy
    from laspy.vlrs.known import WktCoordinateSystemVlr

    geometry = LasGeometry(
        scales=(0.01, 0.01, 0.001), offsets=(512_000.0, 4_123_000.0, 0.0), point_format=6, version="1.4", wkt=True
    )
    rng = np.random.default_rng(1)
    ints = rng.integers(-(2**30), 2**30, size=(400, 3))
    xyz = ints * np.array(geometry.scales) + np.array(geometry.offsets)
    # A source file from "another tool": carries a WKT CRS we must pass on.
    header = laspy.LasHeader(point_format=6, version="1.4")
    header.scales, header.offsets = np.array(geometry.scales), np.array(geometry.offsets)
    header.vlrs.append(WktCoordinateSystemVlr('PROJCS["WGS 84 / UTM zone 17N"]'))
    header.global_encoding.wkt = True
    las = laspy.LasData(header)
    las.X, las.Y, las.Z = ints.T.astype(np.int32)
    las.write(tmp_path / f"source{suffix}")

    cloud = read_points(tmp_path / f"source{suffix}")
    assert cloud.las == geometry
    assert np.array_equal(cloud.xyz, xyz)
    assert count_points(tmp_path / f"source{suffix}") == 400
    out = write_points(tmp_path / f"copy{suffix}", cloud)
    back = laspy.read(out)
    assert np.array_equal(np.stack([back.X, back.Y, back.Z], 1), ints)
    assert tuple(back.header.scales) == geometry.scales and tuple(back.header.offsets) == geometry.offsets
    assert any("UTM zone 17N" in str(getattr(v, "string", "")) for v in back.header.vlrs)
    assert np.array_equal(read_points(out).xyz, xyz)
    assert _no_temp_files(tmp_path)


def test_las_new_points_quantise_to_the_default_millimetre_and_refuse_overflow(tmp_path):
    xyz = _georeferenced(50)
    cloud = read_points(write_points(tmp_path / "new.laz", xyz))
    assert cloud.las.scales == (0.001, 0.001, 0.001)
    assert np.abs(cloud.xyz - xyz).max() <= 0.0005 + 1e-9
    geometry = LasGeometry(scales=(0.001,) * 3, offsets=(0.0, 0.0, 0.0))
    with pytest.raises(DataError, match="32-bit"):
        write_points(tmp_path / "far.las", xyz, las=geometry)
    assert not (tmp_path / "far.las").exists() and _no_temp_files(tmp_path)


# --------------------------------------------------------------------------- manifests and datasets


def _write_pair(folder, name, sparse, dense, fmt="npy"):
    s = write_points(folder / f"{name}_s.{fmt}", sparse)
    d = write_points(folder / f"{name}_d.{fmt}", dense)
    return s, d


def test_manifests_csv_and_json_relative_paths_ids_and_errors(tmp_path):
    s, d = _write_pair(tmp_path, "a", _georeferenced(30), _georeferenced(60))
    (tmp_path / "m.csv").write_text("sparse,dense\na_s.npy,a_d.npy\n")
    (tmp_path / "m.json").write_text(json.dumps({"pairs": [{"sparse": str(s), "dense": "a_d.npy", "id": "tile7"}]}))
    assert read_manifest(tmp_path / "m.csv") == [PairEntry("a_s", s, d)]
    assert read_manifest(tmp_path / "m.json") == [PairEntry("tile7", s, d)]
    write_manifest(tmp_path / "out.csv", [PairEntry("x", s, d)])
    assert (tmp_path / "out.csv").read_text() == "id,sparse,dense\nx,a_s.npy,a_d.npy\n"
    assert read_manifest(tmp_path / "out.csv") == [PairEntry("x", s, d)]

    (tmp_path / "missing.csv").write_text("sparse,dense\na_s.npy,nope.npy\n")
    with pytest.raises(DataError, match="nope.npy, which does not exist"):
        read_manifest(tmp_path / "missing.csv")
    (tmp_path / "dup.csv").write_text("id,sparse,dense\nq,a_s.npy,a_d.npy\nq,a_s.npy,a_d.npy\n")
    with pytest.raises(DataError, match="share the id"):
        read_manifest(tmp_path / "dup.csv")
    (tmp_path / "cols.csv").write_text("low,high\na_s.npy,a_d.npy\n")
    with pytest.raises(DataError, match="'sparse' and 'dense'"):
        read_manifest(tmp_path / "cols.csv")
    with pytest.raises(DataError, match="no such manifest"):
        read_manifest(tmp_path / "none.csv")


def test_dataset_normalises_pairs_together_from_the_sparse_cloud(tmp_path):
    sparse, dense = synthetic_pair(400, seed=2)
    _write_pair(tmp_path, "p", sparse, dense)
    (tmp_path / "m.csv").write_text("sparse,dense\np_s.npy,p_d.npy\n")
    for mode in ("spacing", "extent"):
        item = UpsamplingPairs(tmp_path / "m.csv", normalization=mode)[0]
        norm = item.normalization
        assert np.allclose(norm.center, (sparse.min(0) + sparse.max(0)) / 2, rtol=0, atol=1e-9)
        # Same centre and scale on both clouds; the inverse restores source coordinates.
        assert np.abs(norm.inverse(item.sparse) - sparse).max() < 1e-4
        assert np.abs(norm.inverse(item.dense) - dense).max() < 1e-4
        if mode == "extent":
            assert abs(item.sparse.abs().max().item() - 1) < 1e-5
        else:
            nn = torch.cdist(item.sparse.double(), item.sparse.double()).fill_diagonal_(float("inf")).min(1).values
            assert abs(np.median(nn.numpy()) - 1) < 1e-5
    with pytest.raises(ConfigError, match="normalization"):
        UpsamplingPairs(tmp_path / "m.csv", normalization="unit")


def test_normalization_corner_cases():
    one = np.array([[5.0, 6.0, 7.0]])
    assert pair_normalization(one).scale == 1.0
    dup = np.array([[0.0, 0, 0]] * 5 + [[1.0, 0, 0], [3.0, 0, 0]])
    # Nearest-neighbour distances 0,0,0,0,0,1,2: the median is 0, so the mean of the others is used.
    assert pair_normalization(dup, "spacing").scale == pytest.approx(1.5)
    assert pair_normalization(np.zeros((4, 3)), "spacing").scale == 1.0


def test_graph_cache_in_memory_and_on_disk(tmp_path, monkeypatch):
    sparse, dense = synthetic_pair(300, seed=3)
    s, _ = _write_pair(tmp_path, "g", sparse, dense)
    (tmp_path / "m.csv").write_text("sparse,dense\ng_s.npy,g_d.npy\n")
    calls = []
    real = pairs_module.knn_graph
    monkeypatch.setattr(pairs_module, "knn_graph", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    ds = UpsamplingPairs(tmp_path / "m.csv", graph_cache="disk")
    first = ds[0].edge_index
    ds[0]
    assert len(calls) == 1  # in memory after the first use
    cache = graph_cache_path(s, 10)
    assert cache.name == "g_s.npy.knn10.npy" and cache.is_file()

    fresh = UpsamplingPairs(tmp_path / "m.csv", graph_cache="disk")
    assert torch.equal(fresh[0].edge_index, first) and len(calls) == 1  # reused from disk
    assert not graph_cache_path(s, 5).exists()
    UpsamplingPairs(tmp_path / "m.csv", graph_cache="disk", k=5)[0]
    assert graph_cache_path(s, 5).is_file() and len(calls) == 2  # keyed by k

    # A source newer than its cache, or a damaged cache, is recomputed.
    os.utime(s, ns=(cache.stat().st_mtime_ns + 10**9,) * 2)
    assert torch.equal(UpsamplingPairs(tmp_path / "m.csv", graph_cache="disk")[0].edge_index, first)
    assert len(calls) == 3
    cache.write_bytes(b"garbage")
    os.utime(cache, ns=(s.stat().st_mtime_ns + 10**9,) * 2)
    assert torch.equal(UpsamplingPairs(tmp_path / "m.csv", graph_cache="disk")[0].edge_index, first)
    assert len(calls) == 4

    # Memory-only datasets never write beside the data.
    cache.unlink()
    UpsamplingPairs(tmp_path / "m.csv")[0]
    assert not cache.exists()


def test_dataset_graph_is_the_symmetric_knn_graph_of_the_sparse_cloud(tmp_path):
    sparse, dense = synthetic_pair(200, seed=4)
    _write_pair(tmp_path, "k", sparse, dense)
    (tmp_path / "m.csv").write_text("sparse,dense\nk_s.npy,k_d.npy\n")
    item = UpsamplingPairs(tmp_path / "m.csv")[0]
    src, dst = item.edge_index
    d = torch.cdist(item.sparse.double(), item.sparse.double()).fill_diagonal_(float("inf"))
    tenth = d.sort(dim=1).values[:, 9]
    directed = d[src, dst] <= tenth[dst] + 1e-9
    reverse = d[src, dst] <= tenth[src] + 1e-9
    assert torch.all(directed | reverse)  # every edge is a kNN edge one way or the other
    assert torch.equal(torch.bincount(dst[directed], minlength=200).clamp(max=10), torch.full((200,), 10))


def test_synthetic_pairs_are_seeded_sized_and_written_with_a_manifest(tmp_path):
    a_s, a_d = synthetic_pair(1000, seed=7)
    b_s, b_d = synthetic_pair(1000, seed=7)
    c_s, _ = synthetic_pair(1000, seed=8)
    assert np.array_equal(a_s, b_s) and np.array_equal(a_d, b_d) and not np.array_equal(a_s, c_s)
    assert a_s.shape == (1000, 3) and a_d.shape == (2000, 3)
    # Terrain plus things standing on it: a spread of heights, georeferenced-like origin.
    z = a_d[:, 2] - 150
    assert z.max() - np.percentile(z, 10) > 3 and a_d[:, 0].min() > 499_990
    scene = SyntheticScene(ratio=4.0, dropout=0.0)
    s, d = synthetic_pair(50, seed=1, scene=scene)
    assert s.shape == (50, 3) and d.shape == (200, 3)
    with pytest.raises(ConfigError, match="ratio"):
        SyntheticScene(ratio=1.0, dropout=0.5)

    sizes = spread_sizes(5, 100, 3000, seed=0)
    assert sizes[0] == 100 and sizes[-1] == 3000 and len(sizes) == 5 and all(100 <= v <= 3000 for v in sizes)
    manifest = write_synthetic_pairs(tmp_path / "set", [60, 90], seed=1, fmt="laz")
    entries = read_manifest(manifest)
    assert [e.pair_id for e in entries] == ["pair_000", "pair_001"]
    ds = UpsamplingPairs(manifest)
    assert ds.sparse_sizes.tolist() == [60, 90] and ds.dense_sizes.tolist() == [120, 180]
    again = write_synthetic_pairs(tmp_path / "again", [60, 90], seed=1, fmt="laz")
    assert np.array_equal(read_points(read_manifest(again)[1].dense).xyz, read_points(entries[1].dense).xyz)
