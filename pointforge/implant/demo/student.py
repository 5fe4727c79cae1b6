"""The demo's few-step student (``--distill``): what distilling the chosen PCDiff costs and what it changes.

After the test stage the chosen phase's PCDiff is distilled into a student of
1 or 2 network calls (the ``pcdiff_student`` task, :mod:`pointforge.tasks.pcdiff.student`,
from the packaged ``pcdiff_student/<config>.yaml``), trained as a torchrun job of
one process the way the training phases are (:func:`.training.train_side_by_side`),
for its preset's step budget (steps, not minutes: the same student whatever the
machine's load). Its wall minutes are the distillation's cost. The student then
generates the test cases exactly as the test stage does (the same cases, options
and chosen voxelizer; DDIM in its own calls) under ``implants/student`` and is
scored the same way; the paired intervals student − pipeline per metric say what
it changed, beside the spread of the points, the agreement of the proposals and the
sampling seconds of both.

``student.json`` in the output folder records the student as it trains (calls,
teacher, minutes so far): ``--resume`` keeps a finished student, resumes an
unfinished one from its checkpoint, and refuses one of other calls.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from concurrent.futures import Executor
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

from pointforge.atomic import atomic_path, atomic_write_text
from pointforge.data.volumes import read_volume
from pointforge.devices import available_cores
from pointforge.errors import DataError, UserError
from pointforge.implant.demo.budget import TimeSplit
from pointforge.implant.demo.report_tables import case_report
from pointforge.implant.demo.scoring import full_options, mean_dsc, scoring_progress, write_and_score
from pointforge.implant.demo.settings import DemoSettings
from pointforge.implant.demo.training import train_side_by_side
from pointforge.implant.demo.verdict import paired_comparison
from pointforge.implant.demo.workers import Checkpoints, case_pool
from pointforge.implant.evaluate import Evaluation
from pointforge.tasks.configs import preset_names, resolve_config_path
from pointforge.train.torchrun import worker_args

STUDENT_TASK = "pcdiff_student"
STUDENT_RECORD = "student.json"
# Seconds per student step the progress bar's clock is drawn for; the bar counts steps, this only sizes it.
NOMINAL_STEP_S = 1.0


def student_config(name: str) -> Path:
    """The packaged student preset ``pcdiff_student/<name>.yaml``; a UserError naming those that exist if none."""
    names = preset_names(STUDENT_TASK)
    if name not in names:
        raise UserError(
            f"--distill: there is no few-step student preset for --config {name} "
            f"(pointforge/configs/{STUDENT_TASK}/{name}.yaml); student presets: {', '.join(names) or 'none'}; "
            "give one of those as --config, or leave out --distill"
        )
    return resolve_config_path(STUDENT_TASK, name)


def student_budget(s: DemoSettings, config: Path) -> int:
    """The student's step budget: ``s.student_steps``, else its preset's ``train.max_steps``."""
    if s.student_steps is not None:
        return s.student_steps
    steps = ((yaml.safe_load(config.read_text()) or {}).get("train") or {}).get("max_steps")
    if not isinstance(steps, int) or steps < 1:
        raise DataError(f"{config} sets no train.max_steps; the demo distils its student for a step budget")
    return steps


def _record(out: Path) -> dict | None:
    path = out / STUDENT_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise DataError(f"{path} is unreadable; delete it and {out / 'runs' / STUDENT_TASK} to distil again") from None


def check_student(out: Path, s: DemoSettings, *, resume: bool) -> None:
    """Refused at the start, before the data stage: a ``--config`` without a student preset, and a resumed
    run whose student (``student.json``) has other calls than ``s.distill``."""
    if not s.distill:
        return
    student_config(s.config)
    earlier = _record(out) if resume else None
    if earlier is not None and earlier.get("calls") != s.distill:
        raise UserError(
            f"--resume: {out} holds a {earlier.get('calls')}-call student ({STUDENT_RECORD}); give "
            f"--distill-calls {earlier.get('calls')}, or a new --out"
        )


def _student_job(s: DemoSettings, config: Path, run_dir: Path, teacher: str, prepared: Path, steps: int) -> list[str]:
    overrides = [
        f"run.dir={run_dir}",
        f"task.teacher={teacher}",
        f"task.calls={s.distill}",
        f"task.data_root={prepared}",
        "train.max_minutes=null",
        f"train.max_steps={steps}",
        "train.epochs=100000",
        f"train.seed={s.seed}",
        f"run.device={s.device}",
        "log.progress=off",
    ]
    return worker_args(STUDENT_TASK, config=config, overrides=overrides, resume="auto")


def train_student(
    out: Path, s: DemoSettings, teacher: str, prepared: Path, log: Callable[[str], None], progress, *, resume: bool
) -> dict:
    """The chosen PCDiff (``teacher``, a checkpoint) distilled into an ``s.distill``-call student.

    Returns the record ``student.json`` keeps: calls, steps, the training minutes (summed over the
    launches that finished), the teacher and the student's checkpoint (copied to ``checkpoints/``).
    With ``resume``, a student the earlier run finished is kept; an unfinished one resumes."""
    config = student_config(s.config)
    steps = student_budget(s, config)
    run_dir = out / "runs" / STUDENT_TASK
    earlier = (_record(out) if resume else None) or {}
    if earlier and earlier.get("teacher") != teacher:
        raise DataError(
            f"the student in {run_dir} was distilled from {earlier.get('teacher')}, but the chosen PCDiff is now "
            f"{teacher}; delete {run_dir}, {out / STUDENT_RECORD} and {out / 'implants' / 'student'} to distil again"
        )
    if earlier.get("finished") and earlier.get("steps", 0) >= steps and Path(earlier["checkpoint"]).is_file():
        log(f"[student] the {s.distill}-call student was distilled by the run being resumed: kept")
        return earlier
    record = {"calls": s.distill, "teacher": teacher, "minutes": earlier.get("minutes", 0.0), "finished": False}
    atomic_write_text(out / STUDENT_RECORD, json.dumps(record, indent=1))
    log(f"[student] distilling the chosen PCDiff into a {s.distill}-call student: {steps:,} steps → {run_dir}")
    start = time.perf_counter()
    status = train_side_by_side(
        {STUDENT_TASK: _student_job(s, config, run_dir, teacher, prepared, steps)},
        {STUDENT_TASK: run_dir},
        steps * NOMINAL_STEP_S / 60,
        progress=(lambda d, n, info: progress("train", d, n, info)) if progress else None,
        until={STUDENT_TASK: steps},
    )[STUDENT_TASK]
    src = Path(status.get("last_checkpoint") or run_dir / "checkpoints" / "latest.pt")
    dst = out / "checkpoints" / f"{STUDENT_TASK}-{s.distill}call.pt"
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst, suffix=".pt") as tmp:
        shutil.copyfile(src, tmp)
    record.update(
        minutes=round(record["minutes"] + (time.perf_counter() - start) / 60, 3),
        steps=status.get("global_step"),
        finished=status.get("status") == "finished",
        checkpoint=str(dst),
    )
    atomic_write_text(out / STUDENT_RECORD, json.dumps(record, indent=1))
    return record


def score_student(
    out: Path,
    s: DemoSettings,
    record: dict,
    voxelizer: str,
    paths: tuple[Path, Path],
    pool: Executor,
    times: TimeSplit,
    log: Callable[[str], None],
    progress,
) -> dict:
    """The student's test cases, written under ``implants/student`` and scored as the test stage's
    (:func:`~.scoring.write_and_score`: the same cases and options, DDIM in the student's calls, the
    chosen ``voxelizer``); a case already written there is kept."""
    root = out / "implants" / "student"
    log(f"[student] generating the test cases' implants with the {record['calls']}-call student → {root}")
    return write_and_score(
        out,
        root,
        paths,
        Checkpoints(record["checkpoint"], voxelizer, s.device),
        replace(full_options(s), sampler="ddim", steps=record["calls"]),
        pool,
        times,
        log,
        (lambda d, n: progress("student", d, n, None)) if progress else None,
        scoring_progress(progress),
    )


def written_means(root: Path, case_ids: list[str], placements: list[dict]) -> dict[str, float | None]:
    """Of the cases written under ``root``: the mean spread ratio of their points (``placements``), the
    mean over cases of each case's agreement map where it is above 0 (its ``uncertainty`` volume, named
    in its report.json), and the mean sampling seconds per case (its report's ``sample_s``)."""
    spreads = [p["spread_ratio"] for p in placements if math.isfinite(p.get("spread_ratio", math.nan))]
    agreement, sampling = [], []
    for case_id in case_ids:
        report = case_report(root / case_id)
        volume = (report.get("outputs") or {}).get("uncertainty")
        if volume:
            values = read_volume(root / case_id / volume).data
            if (values > 0).any():
                agreement.append(float(values[values > 0].mean()))
        if "sample_s" in (report.get("timings_s") or {}):
            sampling.append(float(report["timings_s"]["sample_s"]))
    return {
        "spread_ratio": float(np.mean(spreads)) if spreads else None,
        "agreement_mean": float(np.mean(agreement)) if agreement else None,
        "sample_s_per_case": float(np.mean(sampling)) if sampling else None,
    }


def student_intervals(student: Evaluation, pipeline: Evaluation, case_ids: list[str], *, seed: int) -> dict:
    """Per metric (DSC, bDSC, HD95): the paired difference student − pipeline over the test cases, its
    95 % bootstrap interval and what it allows one to say (:func:`~pointforge.implant.stats.verdict`)."""
    return paired_comparison({"student": student, "pipeline": pipeline}, case_ids, "student", "pipeline", seed=seed)


def student_summary(record: dict, student: dict, test: dict, case_ids: list[str], seed: int) -> dict:
    """demo.json's ``student``: the record, the student's evaluation and DSC mean, the paired intervals
    student − pipeline, and the spread, agreement and sampling seconds of both (:func:`written_means`)."""
    means = {
        "student": written_means(student["root"], case_ids, student["placements"]),
        "pipeline": written_means(test["root"], case_ids, test["placements"]),
    }
    return {
        "calls": record["calls"],
        "steps": record.get("steps"),
        "training_minutes": record["minutes"],
        "teacher": record["teacher"],
        "checkpoint": record["checkpoint"],
        "root": str(student["root"]),
        "failed": student["failed"],
        "evaluation": student["evaluation"].summary,
        "dsc_mean": mean_dsc(student["evaluation"], case_ids),
        "intervals": student_intervals(student["evaluation"], test["evaluation"], case_ids, seed=seed),
        **{key: {who: means[who][key] for who in ("pipeline", "student")} for key in means["student"]},
    }


def run_student(
    out: Path,
    s: DemoSettings,
    snap: dict,
    paths: tuple[Path, Path],
    test: dict,
    case_ids: list[str],
    times: TimeSplit,
    stages: dict,
    log: Callable[[str], None],
    progress,
    *,
    resume: bool,
) -> dict:
    """The student's stage: trained from the chosen phase ``snap``, its test cases written and scored on
    a pool of its own, compared with the pipeline's ``test`` on ``case_ids``; returns demo.json's ``student``.
    ``stages`` gets the seconds of both parts."""
    start = time.perf_counter()
    with times.timed("training"):
        record = train_student(out, s, snap["pcdiff"]["checkpoint"], paths[1], log, progress, resume=resume)
    stages["student_train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with case_pool(s.workers or available_cores()) as pool:
        student = score_student(out, s, record, snap["voxelizer"]["checkpoint"], paths, pool, times, log, progress)
    stages["student_test_s"] = time.perf_counter() - start
    return student_summary(record, student, test, case_ids, s.seed)
