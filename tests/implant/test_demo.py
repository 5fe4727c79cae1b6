"""`pointforge demo`'s parts: refusals, training side by side in timed phases, the probe's choice of
cases, the pool of workers, the verdict with its intervals, the time split and the report.

The whole demo takes about ten minutes and is not run here; `make demo` is its test. A tiny
end-to-end run (a minute or two) is marked slow.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pointforge.cli.demo import _student_line
from pointforge.data.prepare import prepare_dataset
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.synthetic.dataset import synthesize
from pointforge.data.volumes import read_binary_volume, write_volume
from pointforge.errors import DataError, UserError
from pointforge.implant.baseline import Atlas, mean_skull_implant
from pointforge.implant.demo.budget import TimeSplit
from pointforge.implant.demo.report import write_report
from pointforge.implant.demo.run import run_demo
from pointforge.implant.demo.scoring import chosen_phase, full_options, mean_dsc, probe_options, spread_cases
from pointforge.implant.demo.settings import DemoSettings, check_out, make_data, record_settings, settings_record
from pointforge.implant.demo.student import (
    STUDENT_RECORD,
    check_student,
    student_budget,
    student_config,
    student_intervals,
    train_student,
    written_means,
)
from pointforge.implant.demo.training import (
    DEMO_TASKS,
    decays,
    demo_config,
    phase_name,
    phase_steps,
    phase_worker,
    train_side_by_side,
)
from pointforge.implant.demo.verdict import case_values, intervals, verdict_sentences
from pointforge.implant.demo.workers import atlas_surfaces, baseline_case, case_jobs, case_pool, run_cases
from pointforge.implant.demo.worst import why_it_fails, worst_cases
from pointforge.implant.evaluate import Evaluation, summarise
from pointforge.tasks.configs import load_train_config
from pointforge.train.torchrun import worker_args
from tests.helpers import TOY_TINY, run_cli_process, write_raw_dataset

TOY = TOY_TINY


def test_a_used_folder_and_bad_settings_are_refused(tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "report.md").write_text("an earlier demo")
    with pytest.raises(UserError, match="already exists and is not empty.*or --resume"):
        run_demo(used, DemoSettings(minutes=1))
    with pytest.raises(UserError, match="--resume: .* holds no demo run"):
        run_demo(used, DemoSettings(minutes=1), resume=True)
    assert (used / "report.md").read_text() == "an earlier demo"
    for settings, message in (
        (DemoSettings(minutes=0), "--minutes"),
        (DemoSettings(skulls=3), "--skulls"),
        (DemoSettings(size=32), "--size"),
        (DemoSettings(family="blobs"), "--family 'blobs': no such skull family; choose one of: domes, anatomical"),
        (DemoSettings(probe_cases=0), "probe"),
        (DemoSettings(split="train=000-009,tset=010-012"), "--split"),
        (DemoSettings(train_steps=(600, 0)), "--train-steps"),
        (DemoSettings(train_steps=(600,)), "--train-steps"),  # type: ignore[arg-type]
        (DemoSettings(reach_mm=0.0), "--reach-mm must be a positive distance"),
        (DemoSettings(skull_points=10), "--skull-points must be at least 64"),
        (DemoSettings(config="skulfix"), "did you mean 'skullfix'"),
    ):
        with pytest.raises(UserError, match=message):
            run_demo(tmp_path / "new", settings)
    assert not (tmp_path / "new").exists()


def test_a_student_is_refused_for_bad_calls_and_for_a_config_without_a_student_preset(tmp_path):
    for calls in (3, -1, True):
        with pytest.raises(UserError, match=f"--distill-calls must be 1 or 2 .*, got {calls!r}; or leave out"):
            run_demo(tmp_path / "new", DemoSettings(distill=calls))
    # pcdiff/small.yaml and voxelizer/small.yaml exist; pcdiff_student/small.yaml does not.
    with pytest.raises(UserError, match=r"no few-step student preset for --config small .*student presets: demo, "):
        run_demo(tmp_path / "new", DemoSettings(config="small", distill=1))
    assert not (tmp_path / "new").exists()
    # The same refusal from the command line: one line, exit status 2.
    code, _, err = run_cli_process("demo", "--out", tmp_path / "cli", "--distill-calls", 3)
    said = "error: --distill-calls must be 1 or 2 (the student's network calls per proposal), got 3"
    assert code == 2 and err.strip() == said
    assert not (tmp_path / "cli").exists()


def test_a_resumed_demo_may_add_or_drop_the_student_and_change_nothing_else(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    s = DemoSettings(minutes=1)
    record_settings(out, s)
    for distill in (0, 1, 2):
        check_out(out, replace(s, distill=distill), resume=True)
    with pytest.raises(UserError, match=r"other settings \(ensemble 5 → 3\); give the same options"):
        check_out(out, replace(s, distill=1, ensemble=3), resume=True)
    with pytest.raises(UserError, match=r"other settings \(student_steps None → 4\)"):
        check_out(out, replace(s, distill=1, student_steps=4), resume=True)
    # A demo written before a setting existed ran with its default: resumed, it may gain a student.
    older = {k: v for k, v in settings_record(s).items() if k not in ("distill", "student_steps")}
    (out / "demo_settings.json").write_text(json.dumps(older))
    check_out(out, replace(s, distill=1), resume=True)
    with pytest.raises(UserError, match=r"other settings \(minutes 1 → 2\)"):
        check_out(out, replace(s, minutes=2, distill=1), resume=True)
    # A student already distilled here keeps its calls, however the run was resumed since.
    (out / STUDENT_RECORD).write_text(json.dumps({"calls": 1, "teacher": "t.pt", "minutes": 1.0, "finished": False}))
    check_student(out, replace(s, distill=1), resume=True)
    check_student(out, replace(s, distill=0), resume=True)
    with pytest.raises(UserError, match="holds a 1-call student .*give --distill-calls 1, or a new --out"):
        check_student(out, replace(s, distill=2), resume=True)


def test_a_finished_student_is_kept_on_resume_and_its_budget_is_its_preset_s_steps(tmp_path):
    assert student_config("demo").name == "demo.yaml"
    assert student_budget(DemoSettings(), student_config("demo")) == 500  # pcdiff_student/demo.yaml's max_steps
    assert student_budget(DemoSettings(student_steps=7), student_config("demo")) == 7
    out = tmp_path / "demo"
    out.mkdir()
    checkpoint = out / "checkpoints" / "pcdiff_student-1call.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"a student")
    done = {"calls": 1, "teacher": "t.pt", "minutes": 10.8, "finished": True, "steps": 500}
    done["checkpoint"] = str(checkpoint)
    (out / STUDENT_RECORD).write_text(json.dumps(done))
    said = []
    kept = train_student(out, DemoSettings(distill=1), "t.pt", tmp_path / "prepared", said.append, None, resume=True)
    assert kept == done and said == ["[student] the 1-call student was distilled by the run being resumed: kept"]
    assert not (out / "runs").exists()  # nothing launched
    with pytest.raises(DataError, match="was distilled from t.pt, but the chosen PCDiff is now other.pt; delete"):
        train_student(out, DemoSettings(distill=1), "other.pt", tmp_path / "prepared", said.append, None, resume=True)


def test_the_student_s_spread_agreement_and_sampling_are_read_from_its_written_cases(tmp_path):
    root = tmp_path / "implants"
    agreement = np.zeros((4, 4, 4), dtype=np.float32)
    agreement[0, 0, :2] = [0.5, 1.0]  # the mean where above 0 is 0.75, not diluted by the empty voxels
    for case_id, sample_s in (("bilateral/001", 2.0), ("random_1/001", 4.0)):
        (root / case_id).mkdir(parents=True)
        write_volume(root / case_id / "uncertainty.nrrd", agreement)
        report = {"outputs": {"uncertainty": "uncertainty.nrrd"}, "timings_s": {"sample_s": sample_s}}
        (root / case_id / "report.json").write_text(json.dumps(report))
    placements = [{"case": "bilateral/001", "spread_ratio": 0.8}, {"case": "random_1/001", "spread_ratio": 0.6}]
    found = written_means(root, ["bilateral/001", "random_1/001", "random_2/001"], placements)  # one failed: no folder
    assert found == pytest.approx({"spread_ratio": 0.7, "agreement_mean": 0.75, "sample_s_per_case": 3.0})
    assert written_means(root, [], []) == {"spread_ratio": None, "agreement_mean": None, "sample_s_per_case": None}
    # Student − pipeline, paired: 0.05 better on every case.
    cases = [f"c/{k:03d}" for k in range(10)]
    hard = np.random.default_rng(1).random(10) * 0.5
    pipeline = _evaluation(dict(zip(cases, hard)))
    student = _evaluation(dict(zip(cases, hard + 0.05)))
    found = student_intervals(student, pipeline, cases, seed=0)
    assert found["dsc"]["difference"]["mean"] == pytest.approx(0.05) and found["dsc"]["verdict"] == "beats"
    assert found["hd95"]["verdict"] == "no clear difference from" and found["hd95"]["cases"] == 10


def test_the_skullfix_preset_trains_both_networks_and_the_reach_reaches_generation():
    for task in DEMO_TASKS:
        assert demo_config(task, "skullfix").name == "skullfix.yaml"
        load_train_config(task, demo_config(task, "skullfix"))  # every key known, every value valid
    pcdiff = load_train_config("pcdiff", demo_config("pcdiff", "skullfix")).task
    assert pcdiff.prior.start_step == 400
    # The voxelizer trains on the points generate gives it: PCDiff's implant points beside 6,144 skull points.
    voxelizer = load_train_config("voxelizer", demo_config("voxelizer", "skullfix")).task
    assert round(voxelizer.n_points * voxelizer.implant_fraction) == pcdiff.n_implant
    assert voxelizer.n_points - pcdiff.n_implant == 6144
    s = DemoSettings(config="skullfix", reach_mm=8.0)
    assert full_options(s).reach_mm == probe_options(s).reach_mm == 8.0
    assert full_options(DemoSettings()).reach_mm is None
    s = DemoSettings(skull_points=6144)
    assert full_options(s).skull_points == probe_options(s).skull_points == 6144


def test_a_prepared_folder_is_used_as_it_is(tmp_path):
    raw = write_raw_dataset(tmp_path / "raw", "skullfix", n_skulls=3)
    prepare_dataset(raw, tmp_path / "prep", n_points=2000, split="train=000,val=001,test=002", workers=1)
    said = []
    got = make_data(tmp_path / "out", DemoSettings(data=str(tmp_path / "prep")), said.append, None)
    assert got == (raw.resolve(), tmp_path / "prep") and "its split" in said[0]
    assert not (tmp_path / "out").exists()  # nothing prepared again
    with pytest.raises(UserError, match="already prepared with its own split"):
        make_data(tmp_path / "out", DemoSettings(data=str(tmp_path / "prep"), split="0.5,0,0.5"), said.append, None)


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


def test_a_step_budget_trains_each_phase_to_its_share_of_the_steps(tmp_path):
    """With --train-steps the phases end at fixed global steps, whatever the time: runs compare at equal budget."""
    constant = tmp_path / "constant.yaml"
    constant.write_text("sched:\n  name: constant\n")
    assert [phase_steps(600, f) for f in (0.25, 0.5, 1.0)] == [150, 300, 600] and phase_steps(2, 0.1) == 1
    cmd = phase_worker("pcdiff", constant, tmp_path / "run", tmp_path / "data", 7.5, "cpu", None, until_step=150)
    assert "train.max_steps=150" in cmd and "train.max_minutes=null" in cmd
    assert not any(a.startswith("train.max_minutes=7") for a in cmd)
    steps = {"pcdiff": 3000, "voxelizer": 1500}
    assert phase_name(2.5, steps, by_steps=True) == "3,000 PCDiff and 1,500 voxelizer steps"  # not the nominal minutes
    assert phase_name(2.5, steps, by_steps=False) == "2.5 min"


def _evaluation(dsc: dict[str, float | None], hd95: dict[str, float] | None = None) -> Evaluation:
    """An evaluation with a row per case that has a DSC (None: the case failed and has no row)."""
    rows = []
    for case_id, value in dsc.items():
        if value is None:
            continue
        h = (hd95 or {}).get(case_id, 3.0)
        rows.append(
            {"case_id": case_id, "defect": case_id.split("/")[0], "dsc": value, "bdsc": value, "hd95": h, "hd": h}
        )
        rows[-1]["error"] = None
    return Evaluation(rows=rows, summary=summarise(rows))


def test_a_failed_case_counts_as_dsc_0_and_leaves_the_hd95_comparison():
    cases = ["bilateral/001", "random_1/001", "random_2/001"]
    pipeline = _evaluation({"bilateral/001": 0.8, "random_1/001": None, "random_2/001": 0.6}, {"bilateral/001": 2.0})
    baseline = _evaluation(dict.fromkeys(cases, 0.5), {"bilateral/001": 9.0})
    values, used = case_values({"pipeline": pipeline, "baseline": baseline}, cases, "dsc")
    assert values["pipeline"].tolist() == [0.8, 0.0, 0.6] and used == cases
    values, used = case_values({"pipeline": pipeline, "baseline": baseline}, cases, "hd95")
    assert used == ["bilateral/001", "random_2/001"] and values["baseline"].tolist() == [9.0, 3.0]
    nothing = _evaluation(dict.fromkeys(cases))
    found = intervals({"pipeline": nothing, "baseline": baseline}, cases)
    assert found["hd95"]["cases"] == 0 and found["dsc"]["verdict"] == "loses to"
    assert verdict_sentences(found)[2] == "HD95: no case where every method made an implant, nothing to compare"


def test_beats_is_said_only_where_the_paired_interval_excludes_zero():
    cases = [f"c/{k:03d}" for k in range(20)]
    hard = np.random.default_rng(0).random(20) * 0.5
    # DSC: 0.05 better on every case; bDSC: better on half, worse on half; HD95: 2 mm lower on every case.
    pipeline = _evaluation(dict(zip(cases, hard + 0.05)), dict(zip(cases, 10 - hard * 4)))
    baseline = _evaluation(dict(zip(cases, hard)), dict(zip(cases, 12 - hard * 4)))
    for k, row in enumerate(pipeline.rows):
        row["bdsc"] = hard[k] + (0.05 if k % 2 else -0.05)
    found = intervals({"pipeline": pipeline, "baseline": baseline}, cases, seed=3)
    assert found["dsc"]["verdict"] == "beats" and found["dsc"]["difference"]["low"] == pytest.approx(0.05)
    assert found["bdsc"]["verdict"] == "no clear difference from"
    assert found["hd95"]["verdict"] == "beats" and found["hd95"]["difference"]["mean"] == pytest.approx(-2.0)
    assert found["dsc"]["pipeline"]["low"] < found["dsc"]["baseline"]["high"]  # the means alone overlap
    assert intervals({"pipeline": pipeline, "baseline": baseline}, cases, seed=3) == found  # seeded
    worse = intervals({"pipeline": baseline, "baseline": pipeline}, cases, seed=3)
    assert worse["dsc"]["verdict"] == "loses to" and worse["hd95"]["verdict"] == "loses to"


def test_the_probe_takes_its_cases_from_every_defect_class():
    class Case:
        def __init__(self, defect, skull):
            self.defect, self.case_id = defect, f"{defect}/{skull}"

    cases = [Case(d, s) for d in ("bilateral", "frontoorbital", "random_1") for s in ("004", "007")]
    picked = spread_cases(cases, 4)
    assert [c.case_id for c in picked] == ["bilateral/004", "bilateral/007", "frontoorbital/004", "random_1/004"]
    assert spread_cases(cases, 10) == cases and spread_cases(cases, 2)[1].defect == "frontoorbital"


def test_the_time_split_adds_up_to_the_total():
    split = TimeSplit()
    split.add("training", 300.0)
    with split.timed("scoring"):
        pass
    split.add("generating", 100.0)
    table = split.table(450.0)
    assert table["training"] == 300.0 and table["generating"] == 100.0 and table["total"] == 450.0
    assert table["other"] == pytest.approx(50.0, abs=0.1)
    with pytest.raises(ValueError, match="unknown kind of work 'napping'"):
        split.add("napping", 1.0)


def test_the_worker_pool_runs_cases_in_order_and_writes_the_baseline(tmp_path):
    """The atlas surfaces are computed once on the pool and shared; the implants are those of an atlas
    built in one process."""
    raw, prepared = tmp_path / "raw", tmp_path / "prepared"
    synthesize(raw, 3, 64, 0, family="domes")
    prepare_dataset(raw, prepared, n_points=1000, seed=0, split="0.67,0,0.33", workers=1)
    dataset = PreparedDataset(prepared)
    jobs = case_jobs(dataset, dataset.split("test")[:3])
    seen = []
    with case_pool(2) as pool:
        surfaces = atlas_surfaces(pool, str(prepared), tmp_path / "baseline" / "atlas_surfaces.npz")
        base = str(tmp_path / "baseline")
        results = run_cases(pool, baseline_case, jobs, base, str(surfaces), progress=lambda d, n: seen.append(d))
    assert [r["case_id"] for r in results] == [j.case_id for j in jobs] and seen == [0, 1, 2, 3]
    with np.load(surfaces) as found:
        names = found["names"].tolist()
        assert sorted(names) == sorted({c.skull_id for c in dataset.split("train")}) and len(names) == 2
    atlas = Atlas.from_prepared(dataset, "train")
    for job, case in zip(jobs, dataset.split("test")[:3]):
        written = read_binary_volume(tmp_path / "baseline" / job.case_id / "implant.nrrd").data
        defective = read_binary_volume(Path(dataset.meta(case.defective)["source"]))
        assert written.any() and np.array_equal(written, mean_skull_implant(defective, atlas).data)


def report_inputs(tmp_path: Path):
    """A demo's results as the report writer takes them: (summary, test, baseline evaluation); two test
    cases, random_1/001 failed; bilateral/001's case folder holds only a report.json under tmp_path/implants/test."""
    cases = ["bilateral/001", "random_1/001"]
    pipeline = _evaluation({"bilateral/001": 0.8, "random_1/001": None})
    baseline = _evaluation({"bilateral/001": 0.5, "random_1/001": 0.5})
    oracle = _evaluation({"bilateral/001": 0.9, "random_1/001": 0.7})
    prior = _evaluation({"bilateral/001": 0.6, "random_1/001": 0.4})
    root = tmp_path / "implants" / "test"
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
    test = {"root": root, "failed": {"random_1/001": "no implant"}, "evaluation": pipeline}
    settings = {"family": "anatomical", "skulls": 16, "size": 64, "split": "0.625,0.125,0.25", "minutes": 6.0}
    settings.update(ensemble=5, sampler="dpm++2m", steps=20, probe_ensemble=2, probe_steps=10)
    scored = {"pipeline": pipeline, "baseline": baseline, "oracle": oracle, "prior": prior}
    summary = {
        "settings": settings,
        "cases": cases,
        "curve": [
            {"minutes": 1.5, "steps": {"pcdiff": 30, "voxelizer": 50}, "val_dsc_mean": 0.7, "val_failed": {}},
            {
                "minutes": 6.0,
                "steps": {"pcdiff": 100, "voxelizer": 200},
                "val_dsc_mean": 0.6,
                "val_failed": {"bilateral/004": "no implant"},
                "placement": {"centroid_error": 4.25, "spread_ratio": 1.12},
            },
        ],
        "chosen": 0,
        "test": {"placement": {"centroid_error": 4.25, "spread_ratio": 1.12, "pred_to_true": 3.0, "true_to_pred": 2.5}},
        **{name: ev.summary for name, ev in scored.items()},
        **{f"{name}_dsc_mean": mean_dsc(ev, cases) for name, ev in scored.items()},
        "intervals": intervals(scored, cases),
        "worst": worst_cases(
            {name: {r["case_id"]: r["dsc"] for r in ev.rows} for name, ev in scored.items()},
            cases,
            failed={"random_1/001": "no implant"},
        ),
        "timings_s": {"data_s": 10.0, "total_s": 600.0},
        "time_split_s": {"data": 10.0, "training": 360.0, "generating": 150.0, "scoring": 30.0, "report": 0.0}
        | {"other": 50.0, "total": 600.0},
    }
    return summary, test, baseline


def test_the_report_gives_intervals_counts_failures_as_zero_and_says_who_wins(tmp_path):
    summary, test, baseline = report_inputs(tmp_path)
    assert summary["pipeline_dsc_mean"] == pytest.approx(0.4) and summary["baseline_dsc_mean"] == pytest.approx(0.5)
    md, page = write_report(tmp_path, summary, test, baseline)
    text = md.read_text()
    assert "anatomical family: 16 skulls" in text and "(2 proposals, 10 steps)" in text
    assert "mean DSC of 0.400 on 2 test cases from 1 skulls" in text and "against 0.500" in text
    assert "models after 1.5 min, chosen by their validation DSC in the probe, 0.700" in text
    # Two cases: the DSC differences are +0.3 and -0.5, so the interval holds 0 and nobody wins.
    assert "PCDiff's pipeline shows no clear difference from the baseline on DSC" in text
    assert "| PCDiff pipeline | 0.400 [0.000, 0.800] |" in text
    assert "| difference PCDiff − baseline (paired) | -0.100 [-0.500, +0.300] |" in text
    assert "| PCDiff … | no clear difference from the baseline |" in text
    assert (
        "| 1.5 (chosen) | 30 | 50 | 0.700 | – | – | 0 | 0.400 |" in text and "| 6 | 100 | 200 | 0.600 | 4.2 |" in text
    )
    assert "| random_1/001 | failed: no implant |" in text
    assert "| bilateral/001 | 0.800 | 0.500 |" in text and "12.50" in text
    assert "| PCDiff (chosen models) | 0.400 |" in text and "| 4.2 | 1.12 | 3.0 | 2.5 |" in text
    assert "| the true implant (oracle) | 0.800 |" in text and "| baseline (mean registered skull) | 0.500 |" in text
    # What PCDiff adds to the atlas estimate it starts from: +0.2 and -0.4 on the two cases.
    assert "| the atlas estimate PCDiff starts from | 0.500 |" in text
    assert "| difference PCDiff − its atlas start (paired) | -0.100 [-0.400, +0.200] |" in text
    assert "| PCDiff … | no clear difference from its atlas start |" in text
    assert "| training | 360.0 | 60 % |" in text and "| total | 600.0 | 100 % |" in text and "| report |" not in text
    assert "pointforge train pcdiff --config paper --nproc 8" in text
    assert (tmp_path / "curve.png").stat().st_size > 5_000
    html_text = page.read_text()
    assert html_text.startswith("<!doctype html>") and "no clear difference from the baseline on DSC" in html_text
    assert "<img src='curve.png'" in html_text
    assert "DSC 0.800 (baseline 0.500)" in html_text and "failed: no implant" in html_text  # one card per case
    assert "no 3-D view" in html_text  # bilateral/001's folder here has a report.json but no view.html
    # The worst cases, the failed one first, each with why it fails.
    worst = text.split("## The worst test cases, and why")[1]
    assert worst.index("**random_1/001** (DSC –): no implant: no implant (counted as DSC 0).") < worst.index(
        "**bilateral/001** (DSC 0.800): of its DSC loss 0.200"
    )
    assert "the atlas estimate PCDiff starts from gave 0.600 (+0.200 by PCDiff)" in worst
    assert "<h2 id='worst'>The worst test cases, and why</h2>" in html_text
    assert "A few-step student" not in text + html_text  # this run distilled none


def test_the_report_s_student_section_says_what_it_cost_and_what_it_changed(tmp_path):
    summary, test, baseline = report_inputs(tmp_path)
    cases = summary["cases"]
    student = _evaluation({"bilateral/001": 0.75, "random_1/001": 0.1}, {"bilateral/001": 3.5})
    summary["student"] = {
        "calls": 2,
        "steps": 500,
        "training_minutes": 10.84,
        "evaluation": student.summary,
        "dsc_mean": mean_dsc(student, cases),
        "intervals": student_intervals(student, test["evaluation"], cases, seed=0),
        "spread_ratio": {"pipeline": 0.76, "student": 0.75},
        "agreement_mean": {"pipeline": 0.88, "student": 0.9},
        "sample_s_per_case": {"pipeline": 2.0, "student": 0.25},
    }
    md, page = write_report(tmp_path, summary, test, baseline)
    text = md.read_text()
    section = text.split("## A few-step student")[1].split("## ")[0]
    assert "into a 2-call student cost 10.8 minutes of training (500 steps, one process)" in section
    assert "sampling a case took 0.25 s instead of 2.00 s" in section
    # Paired over the two cases: DSC -0.05 and +0.1 (the failed case counts as 0); HD95 on the one case with both.
    assert "DSC +0.025 [-0.050, +0.100], bDSC +0.025 [-0.050, +0.100], HD95 +0.50 [+0.50, +0.50] mm." in section
    assert "| PCDiff pipeline (dpm++2m 20) | 0.400 | 0.800 | 3.00 | 0.76 | 0.88 | 2.00 |" in section
    assert "| 2-call student (ddim 2) | 0.425 | 0.425 | 3.25 | 0.75 | 0.90 | 0.25 |" in section
    assert "| difference student − pipeline (paired) | +0.025 [-0.050, +0.100] |" in section
    assert "<h2>A few-step student</h2>" in page.read_text()
    assert _student_line(summary) == (  # the command's last lines name it too
        "2-call student (500 steps, 10.8 min to distil): mean DSC 0.425 against the pipeline's 0.400 "
        "(student − pipeline 0.025 [-0.050, 0.100], paired 95 %); sampling 0.25 s per case against 2.00 s"
    )


def test_a_case_s_loss_is_split_between_the_voxelizer_chain_and_pcdiff_s_points():
    place = {"centroid_error": 3.94, "spread_ratio": 0.88, "pred_to_true": 1.6, "true_to_pred": 5.4}
    said = why_it_fails(0.70, oracle=0.80, start=0.51, placement=place)
    assert said.startswith("of its DSC loss 0.300, 0.200 is lost by the voxelizer and clean-up")
    assert "reach 0.800 here) and 0.100 by PCDiff's points: mostly the voxelizer and clean-up" in said
    assert "gave 0.510 (+0.190 by PCDiff)" in said and "centred 3.9 mm" in said and "5.4 mm from the nearest" in said
    assert "mostly PCDiff's points" in why_it_fails(0.60, oracle=0.95)
    assert "PCDiff stayed near it" in why_it_fails(0.75, start=0.74)
    assert why_it_fails(None, failed="the proposals fall outside the volume").startswith("no implant: the proposals")
    dsc = {"pipeline": {"a": 0.9, "b": 0.5, "c": float("nan"), "d": 0.7}, "oracle": {"b": 0.8}}
    found = worst_cases(dsc, ["a", "b", "c", "d"], [{"case": "b", **place}], n=3)
    assert [w["case_id"] for w in found] == ["c", "b", "d"]  # no score counts as the worst
    assert found[1]["oracle_dsc"] == 0.8 and "centred 3.9 mm" in found[1]["why"] and found[0]["dsc"] is None


def test_the_phase_is_chosen_on_the_validation_cases_never_the_test_cases():
    curve = [{"val_dsc_mean": 0.7}, {"val_dsc_mean": 0.8}, {"val_dsc_mean": 0.75}]
    assert chosen_phase(curve) == 1
    assert chosen_phase([{"val_dsc_mean": 0.8}, {"val_dsc_mean": 0.8}]) == 1  # a tie: the longer training
    assert chosen_phase([{"val_dsc_mean": None}, {"val_dsc_mean": None}]) == 1  # no validation split: the last


@pytest.mark.slow
@pytest.mark.timeout(900)  # a few minutes on a quiet 2-core machine; a busy one took past the default 300 s
def test_a_tiny_demo_runs_end_to_end(tmp_path):
    """Every stage for real on the dome family, as small as the demo allows (a few minutes on 2 cores),
    then resumed with --distill: a 2-step student added to the finished demo (about a minute more)."""
    settings = DemoSettings(minutes=0.1, family="domes", skulls=5, size=64, points=4000, phases=(0.5, 1.0))
    settings.split, settings.ensemble, settings.steps = "0.6,0.2,0.2", 2, 2
    settings.probe_cases, settings.probe_ensemble, settings.probe_steps = 2, 1, 2
    settings.student_steps = 2  # for the student the resume adds below; a setting it may not change
    said = []
    result = run_demo(tmp_path / "demo", settings, log=said.append)
    s = result.summary
    assert len(s["cases"]) == 5 and len(s["curve"]) == 2 and all(c["val_dsc_mean"] is not None for c in s["curve"])
    assert set(s["intervals"]) == {"dsc", "bdsc", "hd95"} and set(s["beats_baseline"]) == {"dsc", "bdsc", "hd95"}
    assert s["time_split_s"]["training"] > 0 and s["time_split_s"]["generating"] > 0
    assert (tmp_path / "demo" / "oracle" / "metrics.csv").is_file()
    assert (tmp_path / "demo" / "prior" / "metrics.csv").is_file() and "over_prior" in s["intervals"]["dsc"]
    assert len(list((tmp_path / "demo" / "baseline").glob("*/*/implant.nrrd"))) == 5
    text = result.report_md.read_text()
    assert "dome" in text and "Where the demo's time went" in text and "[3/7] probing" in "\n".join(said)
    assert len(s["worst"]) == 3 and "## The worst test cases, and why" in text
    scored = [w["why"] for w in s["worst"] if w["dsc"] is not None]  # a tiny run's case may have failed
    assert all("is lost by the voxelizer and clean-up" in why and "centred" in why for why in scored)

    # Without --distill, nothing of a student: no section, no stage, no files.
    assert "student" not in s and "A few-step student" not in text and "student_train_s" not in s["timings_s"]
    assert not (tmp_path / "demo" / "implants" / "student").exists()

    # Resumed with other settings: refused, nothing touched. With the same and --distill (the one setting
    # that may change): the same models and result, and the student added to the finished demo.
    with pytest.raises(UserError, match=r"other settings \(ensemble 2 → 3\)"):
        run_demo(tmp_path / "demo", replace(settings, ensemble=3), resume=True)
    resumed = run_demo(tmp_path / "demo", replace(settings, distill=1), log=said.append, resume=True)
    again = resumed.summary
    assert [c["steps"] for c in again["curve"]] == [c["steps"] for c in s["curve"]]
    assert again["pipeline_dsc_mean"] == s["pipeline_dsc_mean"] and again["chosen"] == s["chosen"]
    student = again["student"]
    assert student["calls"] == 1 and student["steps"] == settings.student_steps and student["training_minutes"] > 0
    assert student["teacher"] == s["phases"][s["chosen"]]["pcdiff"]["checkpoint"]
    assert Path(student["checkpoint"]).is_file() and 0 <= student["dsc_mean"] <= 1
    written = list((tmp_path / "demo" / "implants" / "student").glob("*/*/implant.nrrd"))
    assert len(written) == 5 - len(student["failed"])
    assert set(student["intervals"]) == {"dsc", "bdsc", "hd95"}
    assert np.isfinite(student["intervals"]["dsc"]["difference"]["mean"])
    for key in ("spread_ratio", "agreement_mean", "sample_s_per_case"):
        assert all(np.isfinite(student[key][who]) and student[key][who] > 0 for who in ("pipeline", "student"))
    assert "[student] distilling the chosen PCDiff into a 1-call student: 2 steps" in "\n".join(said)
    text = resumed.report_md.read_text()
    assert "## A few-step student" in text and "| 1-call student (ddim 1) |" in text
    assert "A few-step student" in resumed.report_html.read_text()


def test_placement_puts_generated_points_on_the_prepared_grid_of_a_resampled_volume():
    from pointforge.implant.demo.workers import placement_mm

    truth = np.array([[10.0, 20.0, 30.0], [12.0, 20.0, 30.0]])  # prepared: isotropic 0.4 mm voxels

    class Prepared:
        def meta(self, key):
            return {
                "spacing": [0.4, 0.4, 0.4],
                "resampled": {"to_original_index_scale": [1.0, 1.0, 0.64]},  # the source had 0.625 mm slices
            }

        def points(self, key):
            return truth

    # The same points as indices of the source volume: slices 0.625 mm apart.
    generated = (truth * np.array([1.0, 1.0, 0.64]))[None]
    found = placement_mm(Prepared(), "defective", "implant", generated)
    assert found["centroid_error"] == pytest.approx(0.0, abs=1e-9)
    assert found["pred_to_true"] == pytest.approx(0.0, abs=1e-9)
