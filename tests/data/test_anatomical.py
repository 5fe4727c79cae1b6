"""The anatomical skull family: the fsaverage template, the skulls made from it, their variation and defects."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage
from skimage.measure import euler_number

from pointforge.data.synthetic import anatomical, domes, fsaverage, raster
from pointforge.data.synthetic.dataset import FAMILIES, synthesize
from pointforge.data.synthetic.defects import DEFECT_CLASSES
from pointforge.data.volumes import read_volume
from pointforge.errors import ConfigError
from tests.helpers import run_cli

STRUCT26 = np.ones((3, 3, 3), dtype=bool)
SEED = 7


def _read(path: Path) -> np.ndarray:
    return np.asarray(read_volume(path).data) != 0


def _box(mask: np.ndarray) -> list[np.ndarray]:
    """Per axis, the indices where the mask has voxels."""
    return [np.flatnonzero(mask.any(axis=tuple(a for a in range(3) if a != axis))) for axis in range(3)]


def _digest(mask: np.ndarray) -> str:
    return hashlib.sha256(np.packbits(mask).tobytes() + repr(mask.shape).encode()).hexdigest()[:16]


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * float((a & b).sum()) / float(a.sum() + b.sum())


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """{case id: (complete, {class: (defective, implant)})} of a two-skull anatomical dataset, read back."""
    out = tmp_path_factory.mktemp("anatomical")
    summary = synthesize(out, 2, 64, SEED, family="anatomical")
    found = {}
    for case in summary["cases"]:
        cid = case["id"]
        defects = {
            cls: (_read(out / "defective_skull" / cls / f"{cid}.nrrd"), _read(out / "implant" / cls / f"{cid}.nrrd"))
            for cls in DEFECT_CLASSES
        }
        found[cid] = (_read(out / "complete_skull" / f"{cid}.nrrd"), defects)
    return found


# --------------------------------------------------------------------------- the template


def test_template_axes_match_the_grid_convention():
    """MNE's fiducials (nasion, left and right preauricular points) lie on the scalp where the grid's axes say."""
    mne = pytest.importorskip("mne")
    template = fsaverage.load_template()
    points, _ = mne.io.read_fiducials(fsaverage.fsaverage_folder() / "fsaverage-fiducials.fif")
    named = {int(p["ident"]): np.asarray(p["r"]) * 1000.0 * np.array([-1.0, -1.0, 1.0]) for p in points}
    lpa, nasion, rpa = named[1], named[2], named[3]  # FIFF point idents: 1 LPA, 2 nasion, 3 RPA
    assert nasion[1] < template.centre[1] - 80  # the face is at the low end of axis 1
    assert lpa[0] > template.centre[0] + 70 and rpa[0] < template.centre[0] - 70  # axis 0 runs to the left
    for point in (lpa, nasion, rpa):
        offset = point - template.centre
        u = (offset / np.linalg.norm(offset)).astype(np.float32)[:, None]
        scalp = template(u)[3][0]
        assert scalp == pytest.approx(np.linalg.norm(offset), abs=6.0)


def test_template_table_matches_the_mesh_above_the_skull_base():
    template = fsaverage.load_template()
    surface = fsaverage.read_surface(fsaverage.INNER_SKULL_FILE)
    rng = np.random.default_rng(0)
    u = rng.normal(size=(3000, 3))
    u = u[u[:, 2] > -0.3]
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    ((exact, _),) = fsaverage.cast_rays([surface], template.centre, u)
    inner, smooth, cosine, scalp = template(u.T.astype(np.float32))
    assert np.abs(inner - exact).max() < 0.2
    assert np.abs(smooth - inner).max() < 8.0 and np.all((cosine > 0.3) & (cosine <= 1.0))
    assert np.all(scalp > inner + 4.0)


# --------------------------------------------------------------------------- the skulls


def test_same_generator_same_skull_and_other_seeds_other_skulls():
    a, spacing_a = anatomical.make_skull(64, np.random.default_rng(5))
    b, spacing_b = anatomical.make_skull(64, np.random.default_rng(5))
    c, _ = anatomical.make_skull(64, np.random.default_rng(6))
    assert spacing_a == spacing_b == pytest.approx((230 / 64,) * 3)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


# Computed when the family was added: a change that alters the anatomical data fails here.
PINNED = {
    "complete": "3f49ff2319430997",
    "bilateral": "0b6058ab51952c37",
    "frontoorbital": "1e0b56ca8d35b71b",
    "parietotemporal": "2c6da30ff699618f",
    "random_1": "fcac79791db0855f",
    "random_2": "867a5f654405a965",
}


def test_synthesized_volumes_are_bit_identical_to_the_pinned_ones(cases):
    complete, defects = cases["000"]
    got = {"complete": _digest(complete)} | {cls: _digest(defects[cls][1]) for cls in DEFECT_CLASSES}
    assert got == PINNED


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_complete_skull_is_one_cap_open_only_at_the_base(seed):
    skull, spacing = anatomical.make_skull(64, np.random.default_rng(seed))
    # One piece, topologically a disc (no tunnels, no cavities) under 6- and 26-connectivity.
    assert ndimage.label(skull)[1] == 1
    assert euler_number(skull, connectivity=1) == 1 and euler_number(skull, connectivity=3) == 1
    box = _box(skull)
    cx, cy = (box[0][0] + box[0][-1]) // 2, (box[1][0] + box[1][-1]) // 2
    # The vertex is closed; below, the cavity opens through the base to the bottom of the grid.
    assert skull[cx, cy, box[2][-1] - 5 :].any()
    assert not skull[cx - 3 : cx + 4, cy - 3 : cy + 4, : box[2][0] + 5].any()
    outside, _ = ndimage.label(~skull)
    cz = (box[2][0] + box[2][-1]) // 2
    assert outside[cx, cy, cz] == outside[cx, cy, 0] == outside[0, 0, -1]


def test_skull_proportions_orientation_and_margin():
    for seed in range(4):
        skull, spacing = anatomical.make_skull(64, np.random.default_rng(20 + seed))
        box = _box(skull)
        width, length, height = np.array([b[-1] - b[0] + 1 for b in box]) * np.asarray(spacing)
        assert 125 <= width <= 180 and 160 <= length <= 220 and 95 <= height <= 165, (width, length, height)
        assert length > width
        for b, n in zip(box, skull.shape):
            assert b[0] >= 1 and n - 1 - b[-1] >= 1
        # Axis 1 runs backwards: the forehead is narrower than the back of the head.
        quarter = (box[1][-1] - box[1][0]) // 4

        def width_at(y0, y1):
            return np.ptp(np.flatnonzero(skull[:, y0:y1].any(axis=(1, 2))))

        assert width_at(box[1][0], box[1][0] + quarter) < width_at(box[1][-1] - quarter, box[1][-1])


def _box_normalised(skull: np.ndarray, size: int = 48) -> np.ndarray:
    """The skull's bounding box stretched to a cube: per-axis scale and shift taken out, the shape left."""
    lo, hi = (np.array(e) for e in zip(*[(b[0], b[-1] + 1) for b in _box(skull)]))
    crop = skull[lo[0] : hi[0], lo[1] : hi[1], lo[2] : hi[2]].astype(np.float32)
    return ndimage.zoom(crop, [size / s for s in crop.shape], order=1) >= 0.5


def test_anatomical_skulls_vary_more_than_the_domes():
    """Beyond size and proportions, which registration removes, anatomical skulls differ more in shape."""
    mean_dice = {}
    for name, make in (("domes", domes.make_skull), ("anatomical", anatomical.make_skull)):
        shapes = [_box_normalised(make(64, np.random.default_rng(seed))[0]) for seed in range(5)]
        mean_dice[name] = np.mean([_dice(a, b) for a, b in itertools.combinations(shapes, 2)])
    assert mean_dice["anatomical"] < mean_dice["domes"] - 0.08, mean_dice


def test_block_sparse_rasterisation_equals_evaluating_every_voxel():
    spacing = np.full(3, 230 / 64)
    for seed in (0, 1):
        params = anatomical.draw_params(np.random.default_rng(seed), spacing, spacing * 64)
        sparse = raster.rasterize(params, (64, 64, 64), spacing)
        assert sparse.any() and np.array_equal(sparse, raster.rasterize_dense(params, (64, 64, 64), spacing))


# --------------------------------------------------------------------------- defects


def test_every_defect_class_removes_bone_and_leaves_an_implant_of_that_bone(cases):
    for complete, defects in cases.values():
        for cls, (defective, implant) in defects.items():
            assert implant.any() and not (implant & ~complete).any(), cls
            assert np.array_equal(defective, complete & ~implant), cls
            assert ndimage.label(implant, STRUCT26)[1] == (2 if cls == "bilateral" else 1), cls
            assert ndimage.label(defective, STRUCT26)[1] == 1, cls
            assert 0.01 < implant.sum() / complete.sum() < 0.2, cls


def test_defects_sit_where_their_class_says(cases):
    for complete, defects in cases.values():
        box = _box(complete)
        lo = np.array([b[0] for b in box], dtype=float)
        span = np.array([b[-1] - b[0] for b in box], dtype=float)
        rel = {cls: (np.array(ndimage.center_of_mass(imp)) - lo) / span for cls, (_, imp) in defects.items()}
        assert rel["frontoorbital"][1] < 0.15 and abs(rel["frontoorbital"][0] - 0.5) < 0.2
        assert abs(rel["parietotemporal"][0] - 0.5) > 0.3
        assert abs(rel["bilateral"][0] - 0.5) < 0.1 and rel["bilateral"][2] > 0.5


def test_skullfix_layout_works_and_a_small_field_of_view_is_refused(tmp_path):
    synthesize(tmp_path, 1, 64, SEED, layout="skullfix", family="anatomical")
    complete, implant = _read(tmp_path / "complete_skull/000.nrrd"), _read(tmp_path / "implant/000.nrrd")
    assert complete.shape[:2] == (64, 64) and 0.5 * 64 <= complete.shape[2] <= 0.7 * 64
    assert implant.any() and not (implant & ~complete).any()
    with pytest.raises(ConfigError, match="field of view"):
        anatomical.make_skull(64, np.random.default_rng(0), shape=(64, 64, 24))


# --------------------------------------------------------------------------- choosing the family


def test_the_families_are_registered_and_a_typo_names_them(tmp_path):
    assert set(FAMILIES) == {"domes", "anatomical"}
    with pytest.raises(ConfigError) as err:
        synthesize(tmp_path / "x", 1, 64, 0, family="anatomic")
    assert "domes" in str(err.value) and "anatomical" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "x").exists()


def test_cli_family_flag(tmp_path, capsys):
    from pointforge.cli.entry import run
    from pointforge.cli.main import app

    result = run_cli("data", "synth", tmp_path / "a", "--skulls", 1, "--size", 64, "--family", "anatomical")
    assert result.exit_code == 0, result.output
    assert "anatomical" in result.output and (tmp_path / "a/implant/random_2/000.nrrd").exists()
    assert run(app, ["data", "synth", str(tmp_path / "b"), "--size", "64", "--family", "anatomic"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown skull family 'anatomic'; choose one of: domes, anatomical"
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_size_512_works(tmp_path):
    synthesize(tmp_path, 1, 512, 1, family="anatomical")
    complete = _read(tmp_path / "complete_skull" / "000.nrrd")
    assert complete.shape == (512, 512, 512)
    box = tuple(slice(max(b[0] - 2, 0), b[-1] + 3) for b in _box(complete))
    complete = complete[box]
    assert ndimage.label(complete)[1] == 1
    for cls in DEFECT_CLASSES:
        implant = _read(tmp_path / "implant" / cls / "000.nrrd")[box]
        defective = _read(tmp_path / "defective_skull" / cls / "000.nrrd")[box]
        assert np.array_equal(implant, complete & ~defective) and implant.any()
        assert ndimage.label(implant, STRUCT26)[1] == (2 if cls == "bilateral" else 1)
        assert ndimage.label(defective, STRUCT26)[1] == 1
