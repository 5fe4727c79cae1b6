"""The demo's scoring: a cheap probe of every phase on the validation cases, then the chosen phase in full.

Every phase's models are *probed* on the validation cases (a small ensemble,
few sampler steps, nothing written but the scores; :mod:`.budget` sizes it);
the phase with the best validation DSC is chosen (:func:`chosen_phase`), so
the test cases never choose. Only the chosen phase generates the test cases
with every output (implant, mesh, preview, 3-D view) and the demo's own
ensemble and sampler. The oracle (the true implant points through the chosen
voxelizer and clean-up) is scored in memory; the baseline is written and
scored like the pipeline. The cases run on a pool of one-thread worker
processes (:mod:`.workers`), one per core.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Executor
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.implant.demo.budget import TimeSplit
from pointforge.implant.demo.settings import DemoSettings
from pointforge.implant.demo.training import phase_name
from pointforge.implant.demo.workers import (
    Checkpoints,
    atlas_surfaces,
    baseline_case,
    case_jobs,
    placement_mm,
    run_cases,
    score_case,
    write_case,
)
from pointforge.implant.evaluate import Evaluation, evaluate_predictions, summarise, write_reports
from pointforge.implant.options import GenerateOptions
from pointforge.implant.view import PLOTLY_JS, write_plotly_js


def full_options(s: DemoSettings) -> GenerateOptions:
    """The demo's generation for the test cases and the oracle: its ensemble, sampler, steps and reach."""
    return GenerateOptions(
        ensemble=s.ensemble,
        sampler=s.sampler,
        steps=s.steps,
        seed=s.seed,
        reach_mm=s.reach_mm,
        skull_points=s.skull_points,
    )


def probe_options(s: DemoSettings) -> GenerateOptions:
    """The probe's generation: the test cases' options with fewer proposals and steps (:mod:`.budget`)."""
    steps = None if s.steps is None else min(s.steps, s.probe_steps)
    return replace(full_options(s), ensemble=min(s.ensemble, s.probe_ensemble), steps=steps)


def spread_cases(cases: list, n: int) -> list:
    """At most ``n`` of ``cases``, taken in turn from each defect class so a short list covers them all."""
    by_class: dict[str, list] = {}
    for case in cases:
        by_class.setdefault(case.defect, []).append(case)
    order = sorted(range(len(cases)), key=lambda k: (_rank_in_class(cases, k, by_class), cases[k].defect))
    return [cases[k] for k in sorted(order[:n])]


def _rank_in_class(cases: list, k: int, by_class: dict[str, list]) -> int:
    return by_class[cases[k].defect].index(cases[k])


def mean_placement(rows: list[dict]) -> dict[str, float]:
    """The means of per-case placements over the cases."""
    return {name: float(np.mean([r[name] for r in rows])) for name in (rows[0] if rows else {}) if name != "case"}


def _collected(results: list[dict], wall: float, times: TimeSplit) -> tuple[Evaluation, dict[str, str], list[dict]]:
    """The workers' results as an evaluation (a failed case has no row and is listed as missing: it
    counts as DSC 0 in :func:`mean_dsc`), the failures and the placements; ``wall`` seconds are
    split between generating and scoring as the workers' own seconds were."""
    evaluation, failed, placements = Evaluation(), {}, []
    for r in results:
        if "failed" in r:
            failed[r["case_id"]] = r["failed"]
            evaluation.missing.append(r["case_id"])
        else:
            evaluation.rows.append(r["row"])
            placements.append(r["placement"])
    evaluation.summary = summarise(evaluation.rows)
    evaluation.seconds = wall
    _split_wall(times, wall, results)
    return evaluation, failed, placements


def _split_wall(times: TimeSplit, wall: float, results: list[dict]) -> None:
    generating = sum(r.get("generating_s", 0.0) for r in results)
    scoring = sum(r.get("scoring_s", 0.0) for r in results)
    share = generating / (generating + scoring) if generating + scoring > 0 else 1.0
    times.add("generating", wall * share)
    times.add("scoring", wall * (1.0 - share))


def _checkpoints(snap: dict, s: DemoSettings) -> Checkpoints:
    return Checkpoints(snap["pcdiff"]["checkpoint"], snap["voxelizer"]["checkpoint"], s.device)


def probe_phases(
    s: DemoSettings,
    kept: list[dict],
    dataset: PreparedDataset,
    pool: Executor,
    times: TimeSplit,
    log: Callable[[str], None],
    progress,
) -> list[dict]:
    """Stage 3: every phase's models on the validation cases, generated cheaply: the learning curve and the choice.

    Without validation cases the curve holds the phases' steps only and the last phase is chosen.
    """
    cases = spread_cases(dataset.split("val"), s.probe_cases)
    jobs = case_jobs(dataset, cases)
    options = probe_options(s)
    curve = []
    for snap in kept:
        entry = {"minutes": snap["minutes"], "steps": {n: snap[n]["step"] for n in ("pcdiff", "voxelizer")}}
        name = phase_name(entry["minutes"], entry["steps"], s.train_steps is not None)
        entry.update(val_dsc_mean=None, val_failed={}, placement={}, val_cases=[c.case_id for c in cases])
        if cases:
            log(
                f"[3/7] probing the models after {name} on {len(cases)} validation cases "
                f"({options.ensemble} proposals, {options.sampler} {options.steps or 'all'} steps)"
            )
            start = time.perf_counter()
            results = run_cases(
                pool,
                score_case,
                jobs,
                _checkpoints(snap, s),
                options,
                progress=(lambda d, n: progress("probe", d, n, name)) if progress else None,
            )
            evaluation, failed, placements = _collected(results, time.perf_counter() - start, times)
            entry.update(
                val_dsc_mean=mean_dsc(evaluation, entry["val_cases"]),
                val_failed=failed,
                placement=mean_placement(placements),
            )
        curve.append(entry)
    return curve


def score_test(
    out: Path,
    s: DemoSettings,
    snap: dict,
    paths: tuple[Path, Path],
    pool: Executor,
    times: TimeSplit,
    log: Callable[[str], None],
    progress,
) -> dict:
    """Stage 4: the chosen phase's implants for the test cases, every output written, then scored.

    ``paths``: the raw dataset and the prepared one. Returns what :func:`write_and_score` returns.
    """
    cases = PreparedDataset(paths[1]).split("test")
    root = out / "implants" / "test"
    steps = {n: snap[n]["step"] for n in ("pcdiff", "voxelizer")}
    name = phase_name(snap["minutes"], steps, s.train_steps is not None)
    log(f"[4/7] generating the {len(cases)} test cases' implants with the models after {name} → {root}")
    return write_and_score(
        out,
        root,
        paths,
        _checkpoints(snap, s),
        full_options(s),
        pool,
        times,
        log,
        (lambda d, n: progress("generate", d, n, name)) if progress else None,
        scoring_progress(progress),
    )


def write_and_score(
    out: Path,
    root: Path,
    paths: tuple[Path, Path],
    checkpoints: Checkpoints,
    options: GenerateOptions,
    pool: Executor,
    times: TimeSplit,
    log: Callable[[str], None],
    generating=None,
    scoring=None,
) -> dict:
    """The test cases generated with ``checkpoints`` and ``options``, every output written under
    ``root/<case_id>`` (a case already complete there is kept), then scored against the raw dataset.

    ``paths``: the raw dataset and the prepared one; ``generating(done, total)`` and ``scoring(done,
    total)`` report progress. Returns the root, the failures, the evaluation and the placement of the
    generated points (their mean and per case)."""
    raw, prepared = paths
    dataset = PreparedDataset(prepared)
    cases = dataset.split("test")
    write_plotly_js(out / PLOTLY_JS)  # once, before the workers link every case's view to it
    with times.timed("generating"):
        results = run_cases(
            pool,
            write_case,
            case_jobs(dataset, cases),
            checkpoints,
            options,
            str(root),
            str(out / PLOTLY_JS),
            progress=generating,
        )
    failed = {r["case_id"]: r["failed"] for r in results if r["failed"] is not None}
    for case_id, message in failed.items():
        log(f"case {case_id} failed: {message}")
    with times.timed("scoring"):
        case_ids = [c.case_id for c in cases]
        evaluation = evaluate_predictions(root, raw, cases=case_ids, progress=scoring)
        write_reports(evaluation, root)
        placements = placement_rows(dataset, root, cases)
    return {
        "root": root,
        "failed": failed,
        "evaluation": evaluation,
        "placement": mean_placement(placements),
        "placements": placements,
    }


def chosen_phase(curve: list[dict]) -> int:
    """The phase with the best validation mean DSC (the later one on a tie); the last without validation cases."""
    scored = [(c["val_dsc_mean"], k) for k, c in enumerate(curve) if c.get("val_dsc_mean") is not None]
    return max(scored)[1] if scored else len(curve) - 1


def mean_dsc(evaluation, case_ids: list[str]) -> float:
    """Mean DSC over all ``case_ids``; a case without a usable implant (failed, missing, empty) counts as 0."""
    scores = {r["case_id"]: r.get("dsc") for r in evaluation.rows}
    values = [scores.get(c) for c in case_ids]
    return float(sum(v if v is not None and math.isfinite(v) else 0.0 for v in values) / max(len(values), 1))


def scoring_progress(progress):
    return (lambda d, n: progress("score", d, n, None)) if progress else None


def run_given(
    dataset: PreparedDataset,
    snap: dict,
    s: DemoSettings,
    cases,
    pool: Executor,
    times: TimeSplit,
    source: str,
    progress=None,
) -> Evaluation:
    """Each test case's true implant points (``source="oracle"``) or the atlas's estimate of them
    (``"prior"``), as ``s.ensemble`` proposals, through the pipeline after PCDiff; scored."""
    start = time.perf_counter()
    results = run_cases(
        pool,
        score_case,
        case_jobs(dataset, cases),
        _checkpoints(snap, s),
        full_options(s),
        source,
        progress=(lambda d, n: progress(source, d, n, None)) if progress else None,
    )
    return _collected(results, time.perf_counter() - start, times)[0]


def run_baseline(dataset: PreparedDataset, out: Path, pool: Executor, times: TimeSplit, progress=None) -> dict:
    """Mean-of-registered-training-skulls implants for the test split into ``out/<case_id>/implant.nrrd``;
    the atlas skulls' surfaces are computed first, once each, side by side (``out/atlas_surfaces.npz``)."""
    cases = dataset.split("test")
    with times.timed("generating"):
        surfaces = atlas_surfaces(pool, str(dataset.root), out / "atlas_surfaces.npz")
        results = run_cases(
            pool,
            baseline_case,
            case_jobs(dataset, cases),
            str(out),
            str(surfaces),
            progress=(lambda d, n: progress("baseline", d, n, None)) if progress else None,
        )
    seconds = sum(r["generating_s"] for r in results)
    atlas_skulls = len({c.skull_id for c in dataset.split("train")})
    return {"atlas_skulls": atlas_skulls, "seconds_per_case": round(seconds / max(len(results), 1), 2)}


def placement_rows(dataset: PreparedDataset, root: Path, cases) -> list[dict]:
    """Per case generated under ``root`` (its ``proposals/points.npy``): where its points lie (:func:`placement_mm`)."""
    rows = []
    for case in cases:
        path = root / case.case_id / "proposals" / "points.npy"
        if path.is_file():
            rows.append({"case": case.case_id, **placement_mm(dataset, case.defective, case.implant, np.load(path))})
    return rows
