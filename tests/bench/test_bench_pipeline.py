"""bench/pipeline.py: how it finds its inputs (the benchmark run itself is minutes, not a test).

A smoke run of the bench (``--quick --cases 1``) needs trained models: training
the tiny pair as tests/implant/test_pipeline.py does takes about half a minute and the
run itself another half, over this suite's 15 s allowance for one test, so the
run is not tested here; these tests cover the input handling, which decides
which models every number belongs to.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def pipeline(bench_module):
    return bench_module("pipeline")


def test_the_final_checkpoint_is_the_one_with_most_minutes_not_the_last_name(pipeline, tmp_path):
    for name in (
        "pcdiff-2.50min.pt",
        "pcdiff-10.00min.pt",
        "pcdiff-5.00min.pt",
        "voxelizer-10.00min.pt",
        "pcdiff-notes.pt",
    ):
        (tmp_path / name).write_bytes(b"")
    assert pipeline.newest_checkpoint(tmp_path, "pcdiff").name == "pcdiff-10.00min.pt"


def test_a_demo_gives_the_checkpoints_its_report_chose(pipeline, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for name in ("pcdiff-7.50min.pt", "pcdiff-15.00min.pt", "pcdiff-30.00min.pt"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    assert pipeline.demo_checkpoint(tmp_path, "pcdiff").name == "pcdiff-30.00min.pt"  # no demo.json: the newest
    phases = [{"minutes": 7.5}, {"minutes": 15.0}, {"minutes": 30.0}]
    (tmp_path / "demo.json").write_text(json.dumps({"chosen": 1, "phases": phases}))
    assert pipeline.demo_checkpoint(tmp_path, "pcdiff").name == "pcdiff-15.00min.pt"


def test_a_folder_without_demo_checkpoints_is_one_clear_line(pipeline, tmp_path):
    with pytest.raises(SystemExit, match="no voxelizer-<minutes>min.pt checkpoint"):
        pipeline.newest_checkpoint(tmp_path, "voxelizer")


def _args(**given):
    import argparse

    values = {"demo": None, "pcdiff": None, "voxelizer": None, "data": None}
    values.update(given)
    return argparse.Namespace(**values)


def test_inputs_are_a_demo_folder_or_all_three_paths(pipeline, tmp_path):
    with pytest.raises(SystemExit, match="not both"):
        pipeline.resolve_inputs(_args(demo=tmp_path, pcdiff=tmp_path / "a.pt"))
    with pytest.raises(SystemExit, match="go together"):
        pipeline.resolve_inputs(_args(pcdiff=tmp_path / "a.pt", data=tmp_path))
    with pytest.raises(SystemExit, match="no such folder"):
        pipeline.resolve_inputs(_args(demo=tmp_path / "absent"))
    with pytest.raises(SystemExit, match="no prepared dataset"):
        pipeline.resolve_inputs(_args(demo=tmp_path))


def test_a_demo_folder_gives_its_final_pair_and_its_prepared_data(pipeline, tmp_path):
    (tmp_path / "data" / "prepared").mkdir(parents=True)
    (tmp_path / "data" / "prepared" / "cases.csv").write_text("case_id\n")
    (tmp_path / "checkpoints").mkdir()
    for name in ("pcdiff-0.60min.pt", "pcdiff-1.20min.pt", "voxelizer-0.60min.pt", "voxelizer-1.20min.pt"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    pc, vox, data, source = pipeline.resolve_inputs(_args(demo=tmp_path))
    assert (pc.name, vox.name) == ("pcdiff-1.20min.pt", "voxelizer-1.20min.pt")
    assert data == tmp_path / "data" / "prepared" and str(tmp_path) in source


def test_a_failed_case_counts_as_dsc_zero_and_has_no_hd95(pipeline):
    scored = pipeline.score(None, case=None, defective=None)
    assert scored["dsc"] == 0.0 and scored["bdsc"] == 0.0 and scored["hd95"] != scored["hd95"]  # NaN
    rows = [
        {"ok": False, "dsc": 0.0, "bdsc": 0.0, "hd95": float("nan"), "timings_s": {"read_s": 0.1, "total_s": 1.0}},
        {
            "ok": True,
            "dsc": 0.6,
            "bdsc": 0.8,
            "hd95": 4.0,
            "timings_s": {"read_s": 0.1, "voxelize_s": 2.0, "total_s": 3.0},
        },
    ]
    summary = pipeline.summarise(rows, steps=50, n=2)
    assert summary["failed"] == 1 and summary["dsc_mean"] == pytest.approx(0.3)
    assert summary["hd95_mean"] == 4.0 and summary["hd95_cases"] == 1
    assert summary["voxelize_s_per_proposal"] == pytest.approx(1.0)
