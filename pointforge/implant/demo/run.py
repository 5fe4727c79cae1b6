"""The demo from start to end: :func:`run_demo` runs every stage in order and writes ``demo.json``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from pointforge.atomic import atomic_write_text
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.devices import available_cores
from pointforge.formats import json_safe
from pointforge.implant.demo.budget import TimeSplit
from pointforge.implant.demo.report import write_report
from pointforge.implant.demo.scoring import (
    chosen_phase,
    mean_dsc,
    probe_phases,
    run_baseline,
    run_given,
    score_test,
    scoring_progress,
)
from pointforge.implant.demo.settings import (
    DemoResult,
    DemoSettings,
    check_out,
    make_data,
    record_settings,
    settings_record,
)
from pointforge.implant.demo.student import check_student, run_student
from pointforge.implant.demo.training import DEMO_TASKS, demo_config, train_phases
from pointforge.implant.demo.verdict import beats, intervals
from pointforge.implant.demo.workers import case_pool
from pointforge.implant.demo.worst import worst_cases
from pointforge.implant.evaluate import evaluate_predictions, write_reports


def _summary(s: DemoSettings, case_ids: list[str], curve: list[dict], test: dict, scored: dict, extra: dict) -> dict:
    """Every number of the run; ``scored``: the test cases' evaluations by method (pipeline, baseline, oracle)."""
    chosen = chosen_phase(curve)
    found = intervals(scored, case_ids, seed=s.seed)
    return {
        "settings": settings_record(s),
        "cases": case_ids,
        "curve": [{k: v for k, v in c.items() if k != "val_evaluation"} for c in curve],
        "chosen": chosen,
        "test": {
            "minutes": curve[chosen]["minutes"],
            "steps": curve[chosen]["steps"],
            "failed": test["failed"],
            "placement": test["placement"],
        },
        **{name: ev.summary for name, ev in scored.items()},
        **{f"{name}_dsc_mean": mean_dsc(ev, case_ids) for name, ev in scored.items()},
        "intervals": found,
        "beats_baseline": beats(found),
        "worst": worst_cases(
            {name: {r["case_id"]: r.get("dsc") for r in ev.rows} for name, ev in scored.items()},
            case_ids,
            test.get("placements", ()),
            test["failed"],
        ),
        **extra,
    }


def _score(out: Path, s: DemoSettings, kept: list[dict], paths: tuple[Path, Path], times, stages, log, progress):
    """Stages 3 to 6 on one pool of worker processes: the probe of every phase, the chosen phase's test
    cases, the oracle and the baseline. Returns (curve, test, evaluations by method, baseline info)."""
    raw, prepared = paths
    dataset = PreparedDataset(prepared)
    test_cases = dataset.split("test")
    case_ids = [c.case_id for c in test_cases]
    with case_pool(s.workers or available_cores()) as pool:
        t = time.perf_counter()
        curve = probe_phases(s, kept, dataset, pool, times, log, progress)
        stages["probe_s"] = time.perf_counter() - t

        t = time.perf_counter()
        chosen = chosen_phase(curve)
        test = score_test(out, s, kept[chosen], paths, pool, times, log, progress)
        stages["test_s"] = time.perf_counter() - t

        t = time.perf_counter()
        log(
            "[5/7] oracle: the true implant points through the same voxelizer and clean-up (what a perfect PCDiff would reach); "
            "prior: the atlas's estimate of them (where PCDiff starts)"
        )
        oracle = run_given(dataset, kept[chosen], s, test_cases, pool, times, "oracle", progress)
        write_reports(oracle, out / "oracle")
        prior = run_given(dataset, kept[chosen], s, test_cases, pool, times, "prior", progress)
        write_reports(prior, out / "prior")
        stages["oracle_s"] = time.perf_counter() - t

        t = time.perf_counter()
        n_atlas = len({c.skull_id for c in dataset.split("train")})
        log(f"[6/7] baseline: the defect filled with the mean of the {n_atlas} registered training skulls")
        base_stats = run_baseline(dataset, out / "baseline", pool, times, progress)
    with times.timed("scoring"):
        baseline = evaluate_predictions(out / "baseline", raw, cases=case_ids, progress=scoring_progress(progress))
        write_reports(baseline, out / "baseline")
    stages["baseline_s"] = time.perf_counter() - t
    scored = {"pipeline": test["evaluation"], "baseline": baseline, "oracle": oracle, "prior": prior}
    return curve, test, scored, base_stats


def run_demo(
    out: str | os.PathLike = "demo_out",
    settings: DemoSettings | None = None,
    *,
    log: Callable[[str], None] = print,
    progress=None,
    resume: bool = False,
) -> DemoResult:
    """Run every stage into ``out``. ``progress(stage, done, total, info)`` reports long stages.

    ``resume``: finish the run an earlier call with the same settings began in ``out`` (stopped,
    killed, out of time): the prepared volumes are kept, each training phase resumes from its last
    checkpoint (one already trained only starts and stops), the test cases already written are kept,
    and everything after is done again. ``settings.distill`` may differ from the earlier run's: a
    finished demo resumed with it gains the student (:mod:`.student`), which itself resumes."""
    s = settings or DemoSettings()
    s.validate()
    for task in DEMO_TASKS:
        demo_config(task, s.config)  # a missing preset is refused now, not after the data stage
    out = Path(out)
    check_out(out, s, resume=resume)
    check_student(out, s, resume=resume)
    out.mkdir(parents=True, exist_ok=True)
    record_settings(out, s)
    if resume:
        log(f"resuming the demo in {out}")
    times, stages = TimeSplit(), {}
    started = t = time.perf_counter()
    with times.timed("data"):
        raw, prepared = make_data(out, s, log, progress)
    stages["data_s"] = time.perf_counter() - t
    case_ids = [c.case_id for c in PreparedDataset(prepared).split("test")]

    t = time.perf_counter()
    with times.timed("training"):
        kept = train_phases(out, s, prepared, log, progress, resume=resume)
    stages["train_s"] = time.perf_counter() - t

    curve, test, scored, base_stats = _score(out, s, kept, (raw, prepared), times, stages, log, progress)
    extra: dict = {"baseline_info": base_stats, "phases": kept}
    if s.distill:
        snap = kept[chosen_phase(curve)]
        args = (out, s, snap, (raw, prepared), test, case_ids, times, stages, log, progress)
        extra["student"] = run_student(*args, resume=resume)
    summary = _summary(s, case_ids, curve, test, scored, extra)

    log("[7/7] writing the report")
    # The report shows where the time went up to its own writing; demo.json adds the report's seconds.
    summary["timings_s"] = {k: round(v, 1) for k, v in stages.items()}
    summary["timings_s"]["total_s"] = round(time.perf_counter() - started, 1)
    summary["time_split_s"] = times.table(time.perf_counter() - started)
    t = time.perf_counter()
    with times.timed("report"):
        md, page = write_report(out, summary, test, scored["baseline"])
    summary["timings_s"]["report_s"] = round(time.perf_counter() - t, 1)
    summary["timings_s"]["total_s"] = round(time.perf_counter() - started, 1)
    summary["time_split_s"] = times.table(time.perf_counter() - started)
    atomic_write_text(out / "demo.json", json.dumps(json_safe(summary), indent=1))
    return DemoResult(out=out, report_md=md, report_html=page, summary=summary)
