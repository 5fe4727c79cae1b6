import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh

from pointforge.data.prepare import prepare_dataset, resample_isotropic
from pointforge.data.skulls.datasets import CompletionDataset, VoxelizationDataset
from pointforge.data.skulls.grids import indicator_grid
from pointforge.data.skulls.layouts import detect_layout
from pointforge.data.skulls.normalization import bbox_normalization
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.skulls.splits import parse_ratios, split_skulls
from pointforge.data.surface import farthest_point_sample, surface_points, volume_to_mesh
from pointforge.data.volumes import Volume
from pointforge.errors import ConfigError, DataError
from tests.helpers import shell_mask, write_raw_dataset

N = 2000  # points per surface: small and fast


def test_surface_points_lie_on_the_surface_and_mesh_is_closed():
    g = np.stack(np.meshgrid(*[np.arange(40)] * 3, indexing="ij"), -1)
    ball = ((g - 20) ** 2).sum(-1) < 15**2
    verts, faces = volume_to_mesh(ball)
    mesh = trimesh.Trimesh(verts, faces, process=False)
    assert mesh.is_watertight and mesh.volume > 0  # positive volume: outward normals
    pts = surface_points(ball, 5000, seed=3)
    assert pts.dtype == np.float32 and pts.shape == (5000, 3)
    assert np.abs(np.linalg.norm(pts - 20, axis=1) - 15).max() < 0.75
    assert np.array_equal(pts, surface_points(ball, 5000, seed=3))


def test_surface_touching_the_border_is_closed():
    mask = np.zeros((10, 10, 10), bool)
    mask[:, 2:8, 2:8] = True  # touches both faces of axis 0
    mesh = trimesh.Trimesh(*volume_to_mesh(mask), process=False)
    assert mesh.is_watertight


@pytest.mark.parametrize("step", [1, 2, 3])
def test_mesh_of_the_foregrounds_box_is_the_whole_volumes(step):
    """volume_to_mesh marches only the foreground's box; the mesh is the whole volume's, vertex for vertex."""
    from skimage.measure import marching_cubes

    rng = np.random.default_rng(step)
    mask = np.zeros((31, 27, 36), bool)
    mask[5:19, 9:22, 3:30] = rng.random((14, 13, 27)) > 0.3
    mask[0, 20:25, 30:34] = True  # one blob on the border
    verts, faces = volume_to_mesh(mask, step_size=step)
    whole, tri, _, _ = marching_cubes(np.pad(mask.astype(np.float32), 1), 0.5, step_size=step, allow_degenerate=False)
    assert np.array_equal(verts, whole - 1.0) and np.array_equal(faces, tri[:, ::-1])


def test_fps_spreads_points():
    pts = np.random.default_rng(0).random((500, 3)).astype(np.float32)
    idx = farthest_point_sample(pts, 20)
    assert idx[0] == 0 and len(set(idx.tolist())) == 20
    chosen = pts[idx]
    d = np.linalg.norm(chosen[:, None] - chosen[None], axis=-1) + np.eye(20) * 9
    rand = pts[:20]
    dr = np.linalg.norm(rand[:, None] - rand[None], axis=-1) + np.eye(20) * 9
    assert d.min() > dr.min()


def test_layout_detection(tmp_path):
    write_raw_dataset(tmp_path / "sb", "skullbreak", n_skulls=1)
    write_raw_dataset(tmp_path / "sf", "skullfix", n_skulls=1)
    assert detect_layout(tmp_path / "sb") == "skullbreak"
    assert detect_layout(tmp_path / "sf") == "skullfix"
    (tmp_path / "neither" / "stuff").mkdir(parents=True)
    with pytest.raises(DataError, match="neither a SkullBreak nor a SkullFix"):
        detect_layout(tmp_path / "neither")
    with pytest.raises(DataError, match="no such folder"):
        detect_layout(tmp_path / "missing")


def test_split_is_seeded_grouped_and_complete():
    skulls = [f"{i:03d}" for i in range(20)]
    a = split_skulls(skulls, parse_ratios("0.7,0.1,0.2"), seed=5)
    assert a == split_skulls(skulls, parse_ratios("0.7,0.1,0.2"), seed=5)
    assert a != split_skulls(skulls, parse_ratios("0.7,0.1,0.2"), seed=6)
    counts = {s: list(a.values()).count(s) for s in ("train", "val", "test")}
    assert counts == {"train": 14, "val": 2, "test": 4}
    small = split_skulls(["a", "b", "c", "d"], parse_ratios("0.7,0.1,0.2"), seed=0)
    assert sorted(small.values()).count("train") >= 1 and "test" in small.values()
    with pytest.raises(ConfigError, match="split ratios"):
        parse_ratios("0.5,x")


def test_prepare_skullbreak_end_to_end(tmp_path, monkeypatch):
    raw = write_raw_dataset(tmp_path / "raw", "skullbreak", n_skulls=3, spacing=(0.5, 0.5, 0.5))
    out = tmp_path / "prep"
    monkeypatch.chdir(tmp_path)  # a relative raw path, as users type it
    res = prepare_dataset(Path("raw"), out, n_points=N, split="0.5,0,0.5", seed=1, workers=1)
    assert res.ok and res.layout == "skullbreak" and len(res.cases) == 6
    assert res.done == 3 * 5 and res.skipped == 0  # per skull: complete + 2×(defective, implant)
    rows = list(csv.DictReader(open(out / "cases.csv")))
    by_skull = {}
    for r in rows:
        by_skull.setdefault(r["skull_id"], set()).add(r["split"])
    assert all(len(s) == 1 for s in by_skull.values())  # no skull in two splits
    meta = json.loads((out / "surfaces/implant/bilateral/000.json").read_text())
    assert meta["spacing"] == [0.5, 0.5, 0.5] and meta["shape"] == [40, 40, 40] and meta["n_points"] == N
    assert meta["source"] == str((raw / "implant/bilateral/000.nrrd").resolve())  # usable from any directory
    pts = np.load(out / "surfaces/implant/bilateral/000.npy")
    assert pts.dtype == np.float32 and pts.shape == (N, 3)
    # Points in voxel-index coordinates lie on the implant region's boundary.
    assert pts[:, 1].min() >= 9.4 and pts[:, 1].max() <= 29.6
    # Resume: nothing left to do; a changed source is redone.
    again = prepare_dataset(raw, out, n_points=N, split="0.5,0,0.5", seed=1, workers=1)
    assert again.done == 0 and again.skipped == 15
    os.utime(raw / "implant/bilateral/001.nrrd", ns=(1, 1))
    third = prepare_dataset(raw, out, n_points=N, split="0.5,0,0.5", seed=1, workers=1)
    assert third.done == 1
    assert not list(out.rglob("*.tmp*"))


def test_prepare_resumes_after_interruption(tmp_path, monkeypatch):
    raw = write_raw_dataset(tmp_path / "raw", "skullfix", n_skulls=2)
    out = tmp_path / "prep"
    import pointforge.data.prepare as prep

    real = prep.atomic_write_text
    calls = {"n": 0}

    def crash_on_second_meta(path, text):
        if str(path).endswith(".json") and "surfaces" in str(path):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
        return real(path, text)

    monkeypatch.setattr(prep, "atomic_write_text", crash_on_second_meta)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(raw, out, n_points=N, workers=1)
    monkeypatch.setattr(prep, "atomic_write_text", real)
    # The interrupted volume has points but no metadata → redone; the first is skipped.
    res = prepare_dataset(raw, out, n_points=N, workers=1)
    assert res.skipped == 1 and res.done == 5 and res.ok


def test_corrupt_file_is_reported_and_the_rest_finish(tmp_path):
    raw = write_raw_dataset(tmp_path / "raw", "skullbreak", n_skulls=2, defects=("random_1",))
    bad = raw / "defective_skull/random_1/001.nrrd"
    bad.write_bytes(bad.read_bytes()[:200])
    res = prepare_dataset(raw, tmp_path / "prep", n_points=N, workers=2)
    assert not res.ok and len(res.failures) == 1
    assert str(bad) in res.failures[0] and "\n" not in res.failures[0]
    assert [c.case_id for c in res.cases] == ["random_1/000"]
    assert (tmp_path / "prep/surfaces/implant/random_1/001.npy").exists()


def test_other_tools_layouts_nifti_0_255_anisotropic(tmp_path):
    raw = write_raw_dataset(
        tmp_path / "raw",
        "skullfix",
        n_skulls=2,
        shape=(40, 40, 24),
        spacing=(0.45, 0.45, 0.9),
        fmt=".nii.gz",
        foreground=255,
    )
    res = prepare_dataset(raw, tmp_path / "prep", n_points=N, workers=1)
    assert res.ok and res.layout == "skullfix"
    meta = json.loads((tmp_path / "prep/surfaces/defective_skull/000.json").read_text())
    # NIfTI keeps its affine in float32, hence approx.
    assert meta["spacing"] == pytest.approx([0.45] * 3)
    assert meta["resampled"]["original_shape"] == [40, 40, 24]
    assert meta["shape"] == [40, 40, 47]
    assert meta["resampled"]["to_original_index_scale"] == pytest.approx([1.0, 1.0, 0.5])


def test_resample_isotropic_maps_back():
    mask = shell_mask((30, 30, 15), radii=(12, 12, 6), thickness=3)
    vol = Volume(mask, spacing=(1.0, 1.0, 2.0))
    out, info = resample_isotropic(vol, 1.0)
    assert out.shape == (30, 30, 29)
    # Each original voxel equals the resampled voxel at the same physical place.
    assert np.array_equal(out[:, :, ::2], mask)


@pytest.mark.parametrize("spacing", [(0.45117, 0.45117, 0.633), (0.7, 0.5, 0.9), (1.0, 1.0, 1.0)])
def test_resample_isotropic_is_scipys_trilinear_resampling(spacing):
    from scipy.ndimage import map_coordinates

    rng = np.random.default_rng(3)
    mask = shell_mask((34, 30, 26), radii=(12, 11, 9), thickness=3) & (rng.random((34, 30, 26)) > 0.1)
    vol = Volume(mask, spacing=spacing)
    out, info = resample_isotropic(vol, min(spacing))
    grid = np.meshgrid(*[np.arange(n) * s for n, s in zip(out.shape, info["to_original_index_scale"])], indexing="ij")
    expected = map_coordinates(mask.astype(np.float32), grid, order=1, mode="nearest") >= 0.5
    assert out.shape == tuple(info["resampled_shape"]) and np.array_equal(out, expected)
    assert not resample_isotropic(Volume(np.zeros((5, 5, 5), bool), spacing=spacing), 0.4)[0].any()


def test_prepare_errors(tmp_path):
    raw = write_raw_dataset(tmp_path / "raw", "skullfix", n_skulls=1)
    with pytest.raises(ConfigError, match="too few"):
        prepare_dataset(raw, tmp_path / "o", n_points=10)
    with pytest.raises(DataError, match="not a prepared dataset"):
        PreparedDataset(tmp_path / "o")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    raw = write_raw_dataset(tmp / "raw", "skullbreak", n_skulls=3, defects=("bilateral",))
    prepare_dataset(raw, tmp / "prep", n_points=N, split="1,0,0", seed=0, workers=1)
    return tmp / "prep"


def test_completion_dataset(prepared):
    ds = CompletionDataset(prepared, "train", n_skull=900, n_implant=100, seed=3)
    item = ds[0]
    pts = item["points"]
    assert pts.shape == (1000, 3) and pts.dtype == torch.float32
    skull = pts[:900]
    # Normalised by the defective skull's own box: its longest half-side is 3.
    assert torch.isclose((skull.max(0).values - skull.min(0).values).max(), torch.tensor(6.0), atol=1e-4)
    # Mapping back recovers voxel coordinates that are on the raw surfaces.
    back = pts * item["scale"] + item["center"]
    raw_implant = np.load(prepared / "surfaces/implant/bilateral/000.npy")
    assert np.isin(back[900:].numpy().round(3), raw_implant.round(3)).all()
    # Same epoch, same sample; a new epoch, a new subset.
    assert torch.equal(ds[0]["points"], pts)
    ds.set_epoch(1)
    assert not torch.equal(ds[0]["points"], pts)
    rot = CompletionDataset(prepared, "train", n_skull=900, n_implant=100, rotate_degrees=10, seed=3)
    r = rot[0]["points"]
    assert torch.allclose(r.norm(dim=1), pts.norm(dim=1), atol=1e-4) and not torch.allclose(r, pts)


def test_point_files_stay_mapped_and_are_not_pickled(prepared):
    import pickle

    data = PreparedDataset(prepared)
    rel = data.cases[0].defective
    mapped = data.points(rel)
    assert data.points(rel) is mapped and not mapped.flags.writeable
    assert np.array_equal(data.points(rel, mmap=False), mapped)
    copy = pickle.loads(pickle.dumps(data))
    assert copy._maps == {} and np.array_equal(copy.points(rel), mapped)


def test_normalisation_uses_defective_box_only():
    skull = np.array([[0, 0, 0], [10, 4, 2]], np.float32)
    n = bbox_normalization(skull)
    np.testing.assert_allclose(n.center, [5, 2, 1])
    assert n.scale == pytest.approx(5 / 3)
    np.testing.assert_allclose(n.inverse(n.apply(skull)), skull, atol=1e-5)


def test_voxelization_dataset(prepared):
    ds = VoxelizationDataset(prepared, "train", n_points=1000, resolution=20)
    item = ds[1]
    assert item["points"].shape == (1000, 3)
    assert 0 <= item["points"].min() and item["points"].max() < 1
    t = item["target"]
    assert t.shape == (20, 20, 20) and set(t.unique().tolist()) == {-0.5, 0.5}
    # The target's inside matches the complete mask at the grid nodes.
    mask = PreparedDataset(prepared).complete_mask(ds.cases[1])
    assert (t[::2, ::2, ::2] < 0).numpy().tolist() == mask[::4, ::4, ::4].tolist()


def test_indicator_grid_full_resolution_is_the_mask():
    mask = shell_mask((16, 16, 16), radii=(6, 6, 6), thickness=2)
    grid = indicator_grid(mask, 16)
    assert np.array_equal(grid < 0, mask)


def test_epoch_reaches_persistent_workers(prepared):
    from torch.utils.data import DataLoader

    ds = CompletionDataset(prepared, "train", n_skull=90, n_implant=10, seed=1)
    loader = DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True)
    first = [item["points"] for item in loader]
    ds.set_epoch(1)
    second = [item["points"] for item in loader]
    ds.set_epoch(0)
    again = [item["points"] for item in loader]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(second[0], (ds.set_epoch(1), ds[0])[1]["points"])


def test_other_orientation_and_non_cubic_grid(tmp_path):
    from pointforge.data.volumes import read_binary_volume, write_volume

    raw = write_raw_dataset(tmp_path / "raw", "skullbreak", n_skulls=2, shape=(40, 36, 34), defects=("random_2",))
    ras = np.diag([-1.0, -1.0, 1.0])  # RAS-style axes, as some tools write them
    for path in raw.rglob("*.nrrd"):
        vol = read_binary_volume(path, allow_empty=True)
        write_volume(path, vol.data, spacing=(0.7, 0.6, 0.5), origin=(90.0, 100.0, -20.0), direction=ras)
    res = prepare_dataset(raw, tmp_path / "prep", n_points=N, workers=1)
    assert res.ok and len(res.cases) == 2
    meta = json.loads((tmp_path / "prep/surfaces/complete_skull/000.json").read_text())
    # Anisotropic voxels are resampled to the finest spacing in the SkullBreak layout too (as SkullFix).
    assert meta["shape"] == [55, 43, 34] and meta["spacing"] == pytest.approx([0.5, 0.5, 0.5])
    assert meta["resampled"]["original_shape"] == [40, 36, 34]
    assert meta["resampled"]["original_spacing"] == pytest.approx([0.7, 0.6, 0.5])
    np.testing.assert_allclose(meta["direction"], ras)
    assert meta["origin"] == pytest.approx([90.0, 100.0, -20.0])
