"""`pointforge demo`'s parts: refusals, training side by side in timed phases, the report.

The whole demo takes about ten minutes and is not run here; `make demo` is its test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pointforge.errors import DataError, UserError
from pointforge.implant.demo.report import write_report
from pointforge.implant.demo.run import run_demo
from pointforge.implant.demo.scoring import chosen_phase, mean_dsc
from pointforge.implant.demo.settings import DemoSettings
from pointforge.implant.demo.training import decays, phase_worker, train_side_by_side
from pointforge.implant.evaluate import Evaluation, summarise
from pointforge.train.launch import worker_args
from tests.helpers import TOY_TINY

TOY = TOY_TINY


def test_a_used_folder_and_bad_settings_are_refused(tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "report.md").write_text("an earlier demo")
    with pytest.raises(UserError, match="already exists and is not empty"):
        run_demo(used, DemoSettings(minutes=1))
    assert (used / "report.md").read_text() == "an earlier demo"
    for settings, message in (
        (DemoSettings(minutes=0), "--minutes"),
        (DemoSettings(skulls=3), "--skulls"),
        (DemoSettings(size=32), "--size"),
    ):
        with pytest.raises(UserError, match=message):
            run_demo(tmp_path / "new", settings)
    assert not (tmp_path / "new").exists()


def _toy_job(run_dir: Path, minutes: float, *extra: str) -> list[str]:
    overrides = [
        f"run.dir={run_dir}",
        f"train.max_minutes={minutes}",
        "train.epochs=100000",
        "task.step_delay_s=0.05",
        "log.progress=off",
        "log.tensorboard=false",
        "perf.threads=1",
        *extra,
    ]
    return worker_args("toy", config=TOY, overrides=overrides, resume="auto")


def test_jobs_train_side_by_side_and_resume_in_phases(tmp_path):
    runs = {"a": tmp_path / "runs" / "a", "b": tmp_path / "runs" / "b"}
    seen = []
    first = train_side_by_side(
        {n: _toy_job(d, 0.01) for n, d in runs.items()},
        runs,
        0.01,
        progress=lambda done, total, info: seen.append(info),
    )
    assert {first[n]["status"] for n in runs} == {"finished"}
    steps = {n: first[n]["global_step"] for n in runs}
    assert all(s >= 1 for s in steps.values())
    second = train_side_by_side({n: _toy_job(d, 0.01) for n, d in runs.items()}, runs, 0.01)
    assert all(second[n]["global_step"] > steps[n] for n in runs)  # resumed, not restarted
    assert "time budget" in (runs["a"] / "train.log").read_text()

    bad = {"a": _toy_job(runs["a"], 0.01, "optim.lrr=1")}
    # torchrun's exit status (1: a worker failed); the cause is the worker's own error line.
    with pytest.raises(DataError, match=r"training a failed \(exit 1\): error: unknown config key 'optim.lrr'"):
        train_side_by_side(bad, {"a": runs["a"]}, 0.01)


def test_a_decaying_schedule_is_spread_over_the_whole_budget(tmp_path):
    """Each phase is one launch of a few minutes; a cosine or linear decay must span all of them."""
    decaying = tmp_path / "decay.yaml"
    decaying.write_text("sched:\n  name: cosine\n")
    constant = tmp_path / "constant.yaml"
    constant.write_text("sched:\n  name: constant\n")
    assert decays(decaying) and not decays(constant)
    cmd = phase_worker("pcdiff", decaying, tmp_path / "run", tmp_path / "data", 7.5, "cpu", 30.0)
    assert "train.max_minutes=7.5000" in cmd and "sched.horizon_minutes=30" in cmd
    cmd = phase_worker("voxelizer", constant, tmp_path / "run", tmp_path / "data", 7.5, "cpu", None)
    assert not any(a.startswith("sched.") for a in cmd)


def _evaluation(values: dict[str, float | None]) -> Evaluation:
    rows = []
    for case_id, dsc in values.items():
        nan = float("nan")
        rows.append(
            {
                "case_id": case_id,
                "defect": case_id.split("/")[0],
                "dsc": nan if dsc is None else dsc,
                "bdsc": nan if dsc is None else dsc,
                "hd95": nan if dsc is None else 3.0,
                "hd": nan,
                "error": None,
            }
        )
    return Evaluation(rows=rows, summary=summarise(rows))


def report_inputs(tmp_path: Path):
    """A demo's results as the report writer takes them: (summary, curve, baseline evaluation), two cases,
    random_1/001 failed; bilateral/001's case folder holds only a report.json under tmp_path/implants/final."""
    cases = ["bilateral/001", "random_1/001"]
    pipeline = _evaluation({"bilateral/001": 0.8})  # random_1 failed: no row at all
    baseline = _evaluation({"bilateral/001": 0.5, "random_1/001": 0.5})
    oracle = _evaluation({"bilateral/001": 0.9, "random_1/001": 0.7})
    root = tmp_path / "implants" / "final"
    (root / "bilateral/001").mkdir(parents=True)
    (root / "bilateral/001" / "report.json").write_text(
        json.dumps(
            {
                "implant": {"volume_cm3": 12.5},
                "agreement": {"mean_in_implant": 0.9},
                "mesh": {"watertight": True},
                "timings_s": {"sample_s": 2.0, "voxelize_s": 0.5},
            }
        )
    )
    curve = [
        {
            "minutes": 5.0,
            "steps": {"pcdiff": 100, "voxelizer": 200},
            "failed": {"random_1/001": "no implant"},
            "evaluation": pipeline,
            "root": root,
        }
    ]
    summary = {
        "settings": {
            "skulls": 10,
            "size": 64,
            "split": "0.6,0.2,0.2",
            "minutes": 5.0,
            "ensemble": 5,
            "sampler": "dpm++2m",
            "steps": 20,
        },
        "cases": cases,
        "pipeline": pipeline.summary,
        "baseline": baseline.summary,
        "curve": [
            {
                "minutes": 5.0,
                "steps": curve[0]["steps"],
                "failed": curve[0]["failed"],
                "dsc_mean": mean_dsc(pipeline, cases),
                "val_dsc_mean": 0.6,
                "placement": {"centroid_error": 4.25, "spread_ratio": 1.12, "pred_to_true": 3.0, "true_to_pred": 2.5},
            }
        ],
        "baseline_dsc_mean": mean_dsc(baseline, cases),
        "beats_baseline": False,
        "chosen": 0,
        "oracle": oracle.summary,
        "oracle_dsc_mean": mean_dsc(oracle, cases),
        "timings_s": {"data_s": 10.0, "total_s": 600.0},
    }
    return summary, curve, baseline


def test_the_report_counts_failures_as_zero_and_says_who_wins(tmp_path):
    summary, curve, baseline = report_inputs(tmp_path)
    assert summary["curve"][0]["dsc_mean"] == pytest.approx(0.4)
    assert summary["baseline_dsc_mean"] == pytest.approx(0.5)
    md, page = write_report(tmp_path, summary, curve, baseline, tmp_path / "baseline")
    text = md.read_text()
    assert "mean DSC of 0.400" in text and "against 0.500" in text and "does NOT beat the baseline" in text
    assert "models after 5 min, chosen by their validation mean DSC, 0.600" in text
    assert "| 5 (chosen) | 100 | 200 | 0.400 |" in text and "| 1 | 0.600 |" in text
    assert "| random_1/001 | failed: no implant |" in text
    assert "| bilateral/001 | 0.800 | 0.500 |" in text and "12.50" in text
    # Which stage limits the result: PCDiff's row with its placement, the oracle's, the baseline's.
    assert "| PCDiff (chosen models) | 0.400 |" in text and "| 4.2 | 1.12 | 3.0 | 2.5 |" in text
    assert "| the true implant (oracle) | 0.800 |" in text and "| baseline (mean registered skull) | 0.500 |" in text
    assert "pointforge train pcdiff --config paper --nproc 8" in text
    assert (tmp_path / "curve.png").stat().st_size > 5_000
    html_text = page.read_text()
    assert html_text.startswith("<!doctype html>") and "does NOT beat the baseline" in html_text
    assert "<img src='curve.png'" in html_text
    assert "DSC 0.800 (baseline 0.500)" in html_text and "failed: no implant" in html_text  # one card per case
    assert "no 3-D view" in html_text  # bilateral/001's folder here has a report.json but no view.html


def test_the_phase_is_chosen_on_the_validation_cases_never_the_test_cases():
    curve = [{"val_dsc_mean": 0.7}, {"val_dsc_mean": 0.8}, {"val_dsc_mean": 0.75}]
    assert chosen_phase(curve) == 1
    assert chosen_phase([{"val_dsc_mean": 0.8}, {"val_dsc_mean": 0.8}]) == 1  # a tie: the longer training
    assert chosen_phase([{"val_dsc_mean": None}, {"val_dsc_mean": None}]) == 1  # no validation split: the last
