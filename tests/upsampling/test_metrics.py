"""Upsampling metrics against brute-force definitions, the baselines' shapes, and the folder evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.spatial.distance import cdist

from pointforge.cli.entry import run
from pointforge.cli.main import app
from pointforge.data.pointio import write_points
from pointforge.errors import DataError
from pointforge.upsampling.baselines import BASELINES, knn_midpoints, plane_fit, upsample_baseline
from pointforge.upsampling.evaluate import evaluate_upsampling, write_upsampling_reports
from pointforge.upsampling.metrics import (
    chamfer,
    cloud_metrics,
    hausdorff,
    median_spacing,
    point_to_surface,
    uniformity,
)
from tests.helpers import run_cli


def _clouds(seed=0, n=300, m=500):
    rng = np.random.default_rng(seed)
    truth = rng.uniform(0, 10, (m, 3)) * [1, 1, 0.1] + [1000, 2000, 50]
    pred = truth[rng.choice(m, n)] + rng.normal(0, 0.2, (n, 3))
    return pred, truth


def _brute_plane_distance(p, truth, k):
    nearest = truth[np.argsort(((truth - p) ** 2).sum(1), kind="stable")[:k]]
    centroid = nearest.mean(0)
    _, _, vt = np.linalg.svd(nearest - centroid)
    return abs((p - centroid) @ vt[-1])


def test_chamfer_hausdorff_and_p2s_equal_brute_force():
    pred, truth = _clouds()
    d = cdist(pred, truth)
    assert chamfer(pred, truth, chunk=64) == pytest.approx((d.min(1) ** 2).mean() + (d.min(0) ** 2).mean(), rel=1e-12)
    assert hausdorff(pred, truth, chunk=64) == pytest.approx(max(d.min(1).max(), d.min(0).max()), rel=1e-12)
    brute = np.mean([_brute_plane_distance(p, truth, 10) for p in pred])
    assert point_to_surface(pred, truth, surface_k=10, chunk=70) == pytest.approx(brute, rel=1e-9)
    metrics = cloud_metrics(pred, truth, chunk=50)
    assert metrics.chamfer == pytest.approx(chamfer(pred, truth), rel=1e-12)
    assert metrics.p2s == pytest.approx(brute, rel=1e-9)
    assert (metrics.points, metrics.truth_points) == (len(pred), len(truth))


def test_point_to_surface_ignores_noise_along_a_plane_and_counts_it_across():
    rng = np.random.default_rng(1)
    truth = np.column_stack([rng.uniform(0, 5, (2000, 2)), np.zeros(2000)])
    along = truth[:500] + np.column_stack([rng.normal(0, 0.05, (500, 2)), np.zeros(500)])
    across = truth[:500] + [0, 0, 0.05]
    assert point_to_surface(along, truth) < 1e-9
    assert point_to_surface(across, truth) == pytest.approx(0.05, rel=1e-6)


def test_uniformity_is_the_brute_force_coefficient_of_variation_and_ranks_clumping():
    pred, truth = _clouds(2, n=400, m=400)
    spacing = np.sort(cdist(truth, truth), axis=1)[:, 1]
    assert median_spacing(truth) == pytest.approx(np.median(spacing))
    rng = np.random.default_rng(7)
    centres = truth[rng.choice(len(truth), size=100, replace=False)]
    counts = (cdist(centres, pred) <= 4 * np.median(spacing)).sum(1)
    assert uniformity(pred, truth, seeds=100, seed=7) == pytest.approx(counts.std() / counts.mean(), rel=1e-12)
    clumped = np.repeat(truth[:100], 4, axis=0)  # the same number of points, all in a quarter of the places
    assert uniformity(clumped, truth, seeds=200) > uniformity(truth, truth, seeds=200)


def test_baselines_give_ratio_times_the_points_near_the_input():
    pred, _ = _clouds(3, n=400)
    for name in BASELINES:
        out = upsample_baseline(name, pred, 3)
        assert out.shape == (1200, 3)
        assert cdist(out, pred).min(1).max() < 2.0
    mids = knn_midpoints(pred, 2)
    np.testing.assert_array_equal(mids[:400], pred)
    # no midpoint appears twice: mutual nearest neighbours do not both add theirs
    assert len(np.unique(mids[400:].round(9), axis=0)) == 400


def test_plane_fit_removes_noise_across_a_plane():
    rng = np.random.default_rng(4)
    flat = np.column_stack([rng.uniform(0, 20, (3000, 2)), rng.normal(0, 0.05, 3000)])
    out = plane_fit(flat, 2)
    assert np.abs(out[:, 2]).mean() < 0.5 * np.abs(flat[:, 2]).mean()


def test_bad_clouds_are_one_line_errors():
    with pytest.raises(DataError, match=r"\[N, 3\]"):
        chamfer(np.zeros((4, 2)), np.zeros((4, 3)))
    with pytest.raises(DataError, match="NaN"):
        hausdorff(np.full((4, 3), np.nan), np.zeros((4, 3)))


def test_evaluate_folder_pairs_by_name_reports_and_cli(tmp_path, capsys):
    pred_dir, truth_dir = tmp_path / "pred", tmp_path / "truth"
    for i in range(2):
        pred, truth = _clouds(10 + i)
        write_points(pred_dir / f"t{i}.npy", pred)
        write_points(truth_dir / f"t{i}.laz", truth)
    write_points(truth_dir / "t9.ply", _clouds(20)[1])
    result = evaluate_upsampling(pred_dir, truth_dir)
    assert [r["pair"] for r in result.rows] == ["t0", "t1"] and result.missing == ["t9"]
    expected = chamfer(np.load(pred_dir / "t1.npy"), _clouds(11)[1])
    assert result.rows[1]["chamfer"] == pytest.approx(expected, rel=1e-4)  # LAZ stores millimetres
    assert result.summary["chamfer"]["n"] == 2
    paths = write_upsampling_reports(result, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["missing"] == ["t9"]
    cli = run_cli("evaluate-upsampling", pred_dir, "--truth", truth_dir)
    assert cli.exit_code == 0, cli.output
    assert (pred_dir / "upsampling_metrics.csv").read_text().count("\n") == 3
    assert run(app, ["evaluate-upsampling", str(tmp_path / "nowhere"), "--truth", str(truth_dir)]) == 2
    assert "no such folder" in capsys.readouterr().err
