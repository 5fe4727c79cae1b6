"""The demo from start to end: :func:`run_demo` runs every stage in order and writes ``demo.json``."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from pointforge.atomic import atomic_write_text
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.formats import json_safe
from pointforge.implant.demo.report import write_report
from pointforge.implant.demo.scoring import (
    chosen_phase,
    generate_and_evaluate,
    mean_dsc,
    placement_summary,
    run_baseline,
    run_oracle,
    scoring_progress,
)
from pointforge.implant.demo.settings import DemoResult, DemoSettings, check_out, make_data
from pointforge.implant.demo.training import DEMO_TASKS, demo_config, train_phases
from pointforge.implant.evaluate import evaluate_predictions, write_reports


def _summary(
    s: DemoSettings,
    case_ids: list[str],
    curve: list[dict],
    baseline_eval,
    base_stats: dict,
    kept: list[dict],
    timings: dict[str, float],
    placements: list[dict],
    oracle_eval,
) -> dict:
    summary = {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()},
        "cases": case_ids,
        "pipeline": curve[chosen_phase(curve)]["evaluation"].summary,
        "baseline": baseline_eval.summary,
        "curve": [
            {
                "minutes": c["minutes"],
                "steps": c["steps"],
                "failed": c["failed"],
                "dsc_mean": mean_dsc(c["evaluation"], case_ids),
                "val_dsc_mean": c.get("val_dsc_mean"),
                "placement": p,
            }
            for c, p in zip(curve, placements)
        ],
        "oracle": oracle_eval.summary,
        "oracle_dsc_mean": mean_dsc(oracle_eval, case_ids),
        "baseline_dsc_mean": mean_dsc(baseline_eval, case_ids),
        "baseline_info": base_stats,
        "phases": kept,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    summary["chosen"] = chosen_phase(curve)
    pipe = summary["curve"][summary["chosen"]]["dsc_mean"]
    base = summary["baseline_dsc_mean"]
    summary["beats_baseline"] = bool(pipe is not None and base is not None and pipe > base)
    return summary


def run_demo(
    out: str | os.PathLike = "demo_out",
    settings: DemoSettings | None = None,
    *,
    log: Callable[[str], None] = print,
    progress=None,
) -> DemoResult:
    """Run every stage into ``out``. ``progress(stage, done, total, info)`` reports long stages."""
    s = settings or DemoSettings()
    s.validate()
    for task in DEMO_TASKS:
        demo_config(task)  # an install without its presets is refused now, not after the data stage
    out = Path(out)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = t = time.perf_counter()
    raw, prepared = make_data(out, s, log, progress)
    timings["data_s"] = time.perf_counter() - t
    dataset = PreparedDataset(prepared)
    test_cases = dataset.split("test")
    case_ids = [c.case_id for c in test_cases]
    val_ids = [c.case_id for c in dataset.split("val")]

    t = time.perf_counter()
    kept = train_phases(out, s, prepared, log, progress)
    timings["train_s"] = time.perf_counter() - t

    t = time.perf_counter()
    curve = generate_and_evaluate(out, s, kept, raw, prepared, {"test": case_ids, "val": val_ids}, log, progress)
    placements = [placement_summary(dataset, c["root"], test_cases) for c in curve]
    chosen = chosen_phase(curve)
    timings["generate_evaluate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    log(
        "[4/6] oracle: the true implant points through the same voxelizer and clean-up (what a perfect PCDiff would reach)"
    )
    run_oracle(dataset, out / "oracle", kept[chosen], s, test_cases, progress)
    oracle_eval = evaluate_predictions(out / "oracle", raw, cases=case_ids, progress=scoring_progress(progress))
    write_reports(oracle_eval, out / "oracle")
    timings["oracle_s"] = time.perf_counter() - t

    t = time.perf_counter()
    log(
        f"[5/6] baseline: the defect filled with the mean of the {len({c.skull_id for c in dataset.split('train')})} registered training skulls"
    )
    base_root = out / "baseline"
    base_stats = run_baseline(prepared, base_root, progress)
    baseline_eval = evaluate_predictions(base_root, raw, cases=case_ids, progress=scoring_progress(progress))
    write_reports(baseline_eval, base_root)
    timings["baseline_s"] = time.perf_counter() - t

    summary = _summary(s, case_ids, curve, baseline_eval, base_stats, kept, timings, placements, oracle_eval)

    log("[6/6] writing the report")
    t = time.perf_counter()
    timings["report_s"] = 0.0
    summary["timings_s"]["total_s"] = round(time.perf_counter() - started, 1)
    md, page = write_report(out, summary, curve, baseline_eval, base_root)
    summary["timings_s"]["report_s"] = round(time.perf_counter() - t, 1)
    atomic_write_text(out / "demo.json", json.dumps(json_safe(summary), indent=1))
    return DemoResult(out=out, report_md=md, report_html=page, summary=summary)
