"""Implant metrics: the reference fixture, the bounding-box restriction, properties, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pointforge.errors import ConfigError, DataError
from pointforge.implant.metrics import (
    boundary_dice,
    dice,
    evaluate_case,
    hausdorff,
    hd95,
    surface_distances,
)
from tests.helpers import FIXTURES

METRIC_KEYS = ("dsc", "bdsc", "hd95", "hd")


@pytest.fixture(scope="module")
def reference():
    data = np.load(FIXTURES / "implant_metrics.npz", allow_pickle=False)
    assert "hd95 = hd95(pred, gt, voxelspacing=sp)" in str(data["notes"])
    return {key: data[key] for key in data.files}


def _case(reference, index):
    prefix = f"c{index:02d}_"
    return reference[prefix + "pred"], reference[prefix + "gt"], reference[prefix + "skull"]


# Where the reference gives NaN (or raises), our documented conventions apply.
def _expected(reference, index, column, name):
    value = float(reference[name][index, column])
    case = str(reference["case_names"][index])
    if case == "skull96_empty_both":
        return {"dsc": 1.0, "bdsc": 1.0, "hd95": 0.0, "hd": 0.0}[name]
    if case in ("skull96_empty_pred", "skull96_empty_gt") and name in ("hd95", "hd"):
        assert reference[f"{name}_error"][index, column].startswith("RuntimeError")
        return math.nan
    if case == "empty_skull64" and name == "bdsc":
        return math.nan
    if name == "bdsc" and math.isnan(value):
        # Neither mask reaches within 10 mm of the skull: 1.0 by convention.
        return 1.0
    return value


@pytest.mark.parametrize("index", range(18))
def test_matches_reference_fixture(reference, index):
    pred, truth, skull = _case(reference, index)
    for column, spacing in enumerate(reference["spacings"]):
        result = evaluate_case(pred, truth, skull, spacing)
        assert result["error"] is None
        for name in METRIC_KEYS:
            expected = _expected(reference, index, column, name)
            got = result[name]
            where = f"{reference['case_names'][index]} spacing {tuple(spacing)} {name}"
            if math.isnan(expected):
                assert math.isnan(got), f"{where}: expected NaN, got {got}"
            else:
                assert got == pytest.approx(expected, abs=1e-6), where
        if column != len(reference["spacings"]) - 1:
            continue
        # The single-metric functions agree with evaluate_case, and HD95 is
        # symmetric like the reference's swapped call (checked on the last,
        # anisotropic spacing only, to keep the suite fast).
        assert dice(pred, truth) == result["dsc"]
        assert boundary_dice(pred, truth, skull, spacing) == pytest.approx(result["bdsc"], nan_ok=True)
        assert hausdorff(pred, truth, spacing) == pytest.approx(result["hd"], nan_ok=True)
        swapped = hd95(truth, pred, spacing)
        assert swapped == pytest.approx(result["hd95"], nan_ok=True)
        if not math.isnan(reference["hd95_swapped"][index, column]):
            assert swapped == pytest.approx(reference["hd95_swapped"][index, column], abs=1e-6)


def test_whole_volume_path_matches_reference_fixture(reference):
    # The restricted path is checked above; here the definition-following
    # whole-volume path, on the anisotropic spacing that exposes axis mix-ups.
    column = [tuple(s) for s in reference["spacings"]].index((0.3, 0.5, 0.8))
    spacing = reference["spacings"][column]
    for index in range(18):
        result = evaluate_case(*_case(reference, index), spacing, restrict=False)
        for name in METRIC_KEYS:
            expected = _expected(reference, index, column, name)
            assert result[name] == pytest.approx(expected, abs=1e-6, nan_ok=True), (index, name)


def test_empty_masks_follow_documented_conventions(reference):
    names = list(reference["case_names"])
    spacing = (0.3, 0.5, 0.8)

    pred, truth, skull = _case(reference, names.index("skull96_empty_both"))
    result = evaluate_case(pred, truth, skull, spacing)
    assert (result["dsc"], result["bdsc"], result["hd95"], result["hd"]) == (1.0, 1.0, 0.0, 0.0)
    assert len(result["notes"]) == 1 and "both empty" in result["notes"][0]
    assert surface_distances(pred, truth, spacing)[0].size == 0

    for case, empty in (("skull96_empty_pred", "prediction"), ("skull96_empty_gt", "ground truth")):
        pred, truth, skull = _case(reference, names.index(case))
        result = evaluate_case(pred, truth, skull, spacing)
        assert result["dsc"] == 0.0 and result["bdsc"] == 0.0
        assert math.isnan(result["hd95"]) and math.isnan(result["hd"])
        assert result["error"] is None
        assert any(note.startswith(f"{empty} is empty") for note in result["notes"])
        assert math.isnan(hd95(pred, truth, spacing)) and math.isnan(hausdorff(pred, truth, spacing))
        assert surface_distances(pred, truth, spacing) is None

    pred, truth, skull = _case(reference, names.index("empty_skull64"))
    result = evaluate_case(pred, truth, skull, spacing)
    assert math.isnan(result["bdsc"]) and not math.isnan(result["dsc"])
    assert any("defective skull is empty" in note for note in result["notes"])

    pred, truth, skull = _case(reference, names.index("boxes64_disjoint"))
    result = evaluate_case(pred, truth, skull, (1.0, 1.0, 1.0))
    assert result["bdsc"] == 1.0 and result["dsc"] == 0.0
    assert any("within 10 mm" in note for note in result["notes"])

    pred, truth, skull = _case(reference, names.index("skull96_shift1_ax2"))
    assert evaluate_case(pred, truth, skull, spacing)["notes"] == []


def _random_blobs(rng, shape, fill):
    """Smooth random blobs, so masks have real borders and interiors."""
    from scipy import ndimage

    noise = ndimage.gaussian_filter(rng.standard_normal(shape), sigma=1.5)
    return noise > np.quantile(noise, 1 - fill)


@pytest.mark.parametrize("seed", range(6))
def test_restricted_equals_whole_volume_on_random_masks(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(14, 30, size=3))
    pred = np.zeros(shape, bool)
    truth = np.zeros(shape, bool)
    # Masks in a sub-box that is flush with an array face or not, per axis,
    # and a skull spread over the whole volume, partly beyond the margin.
    corner = tuple([slice(0, n // 2), slice(n // 2, n), slice(n // 4, 3 * n // 4)][int(rng.integers(3))] for n in shape)
    pred[corner] = _random_blobs(rng, pred[corner].shape, 0.3)
    truth[corner] = _random_blobs(rng, truth[corner].shape, 0.3)
    skull = _random_blobs(rng, shape, 0.05)
    skull &= ~(pred | truth)
    spacing = tuple(rng.uniform(0.3, 1.2, size=3))
    margin = float(rng.uniform(1.0, 6.0))

    fast = evaluate_case(pred, truth, skull, spacing, margin)
    full = evaluate_case(pred, truth, skull, spacing, margin, restrict=False)
    assert fast["notes"] == full["notes"] == []
    for name in METRIC_KEYS:
        assert fast[name] == pytest.approx(full[name], abs=1e-12), name
    for fast_d, full_d in zip(
        surface_distances(pred, truth, spacing), surface_distances(pred, truth, spacing, restrict=False)
    ):
        np.testing.assert_allclose(np.sort(fast_d), np.sort(full_d), atol=1e-12)


def test_margin_is_inclusive_per_axis_spacing():
    # Spacing differs per axis, so a metric that mixes up axes or measures in
    # voxels instead of mm keeps or drops the wrong voxel.
    spacing = (0.5, 2.0, 1.0)
    shape = (60, 20, 30)
    pred = np.zeros(shape, bool)
    pred[5, 5, 5] = True
    truth = pred.copy()
    truth[30, 10, 15] = True  # the only voxel the skull may bring into the boundary region

    def bdsc_with_skull_at(offset):
        skull = np.zeros(shape, bool)
        skull[tuple(np.add((30, 10, 15), offset))] = True
        return [boundary_dice(pred, truth, skull, spacing, restrict=r) for r in (True, False)]

    # Exactly 10 mm: kept (truth alone in the region, so bDSC = 0).
    for offset in ((20, 0, 0), (0, 5, 0), (0, 0, 10), (-12, 0, 8)):
        assert bdsc_with_skull_at(offset) == [0.0, 0.0], offset
    # Just beyond 10 mm: nothing of either mask in the region, 1 by convention.
    for offset in ((21, 0, 0), (0, 6, 0), (0, 0, 11), (-12, 1, 8)):
        assert bdsc_with_skull_at(offset) == [1.0, 1.0], offset


def test_surface_distances_in_mm_along_the_right_axis():
    spacing = (0.5, 1.0, 2.0)
    pred = np.zeros((12, 12, 12), bool)
    pred[3, 3, 3] = True
    for axis, expected in ((0, 1.5), (1, 3.0), (2, 6.0)):
        truth = np.zeros_like(pred)
        position = [3, 3, 3]
        position[axis] += 3
        truth[tuple(position)] = True
        assert hd95(pred, truth, spacing) == pytest.approx(expected)
        assert hausdorff(pred, truth, spacing) == pytest.approx(expected)


def test_hd95_pools_both_directions():
    # A 6x6x6 cube (152 border voxels) against the same cube plus far voxels
    # that only the truth -> prediction direction sees. One far voxel is 1 of
    # 305 pooled distances, below the 95th percentile; 30 far voxels are 9 % of
    # the pool but 16 % of their own direction, so the pooled percentile is
    # smaller than MONAI's larger one-way percentile.
    spacing = (1.0, 1.0, 1.0)
    cube = np.zeros((40, 40, 40), bool)
    cube[2:8, 2:8, 2:8] = True
    lone = cube.copy()
    lone[30, 30, 30] = True
    assert hd95(cube, lone, spacing) == 0.0
    assert hausdorff(cube, lone, spacing) == pytest.approx(math.sqrt(3 * 23**2))

    many = cube.copy()
    many[30, 5:35, 30] = True
    pred_to_truth, truth_to_pred = surface_distances(cube, many, spacing)
    pooled = np.concatenate([pred_to_truth, truth_to_pred])
    assert hd95(cube, many, spacing) == pytest.approx(np.percentile(pooled, 95))
    assert hd95(cube, many, spacing) < np.percentile(truth_to_pred, 95)


def test_identity_and_symmetry():
    rng = np.random.default_rng(11)
    a = _random_blobs(rng, (20, 18, 16), 0.2)
    b = _random_blobs(rng, (20, 18, 16), 0.2)
    skull = _random_blobs(rng, (20, 18, 16), 0.1) & ~(a | b)
    spacing = (0.4, 0.7, 1.1)
    assert dice(a, a) == 1.0
    assert boundary_dice(a, a, skull, spacing) == 1.0
    assert hd95(a, a, spacing) == 0.0 and hausdorff(a, a, spacing) == 0.0
    assert dice(a, b) == dice(b, a) < 1.0
    assert boundary_dice(a, b, skull, spacing) == boundary_dice(b, a, skull, spacing)
    assert hd95(a, b, spacing) == hd95(b, a, spacing) > 0.0
    assert hausdorff(a, b, spacing) == hausdorff(b, a, spacing) >= hd95(a, b, spacing)


def test_any_nonzero_value_is_inside():
    rng = np.random.default_rng(3)
    a = _random_blobs(rng, (16, 16, 16), 0.3)
    b = _random_blobs(rng, (16, 16, 16), 0.3)
    spacing = (1.0, 0.5, 0.8)
    assert dice(a.astype(np.uint8) * 255, b.astype(np.float32) * 0.5) == dice(a, b)
    assert hd95(a.astype(np.int16), b.astype(np.uint8), spacing) == hd95(a, b, spacing)


def test_bad_inputs_raise_data_error_and_evaluate_case_reports_them():
    a = np.zeros((8, 8, 8), bool)
    a[2:5, 2:5, 2:5] = True
    b = np.zeros((8, 8, 9), bool)
    b[2:5, 2:5, 2:5] = True
    spacing = (1.0, 1.0, 1.0)
    with pytest.raises(DataError, match="share one shape"):
        dice(a, b)
    with pytest.raises(DataError, match="share one shape"):
        hd95(a, b, spacing)
    with pytest.raises(DataError, match="share one shape"):
        boundary_dice(a, a, b, spacing)
    with pytest.raises(DataError, match="3-D"):
        dice(a[0], a[0])
    for spacing_bad in ((1.0, 1.0), (1.0, -1.0, 1.0), (1.0, math.nan, 1.0), "abc"):
        with pytest.raises(DataError, match="spacing"):
            hd95(a, a, spacing_bad)
    with pytest.raises(ConfigError, match="margin_mm"):
        boundary_dice(a, a, a, spacing, margin_mm=-1.0)

    result = evaluate_case(a, b, a, spacing)
    assert "share one shape" in result["error"]
    assert all(math.isnan(result[name]) for name in METRIC_KEYS)
    assert "\n" not in result["error"]
