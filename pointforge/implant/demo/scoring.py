"""The demo's scoring: implants with each phase's models, the oracle and the baseline, all evaluated alike.

The phase the report is about is chosen on the validation cases
(:func:`chosen_phase`), never on the test cases.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.volumes import read_binary_volume, write_volume
from pointforge.implant.baseline import Atlas, mean_skull_implant
from pointforge.implant.demo.settings import DemoSettings
from pointforge.implant.evaluate import evaluate_predictions, write_reports
from pointforge.implant.folder import generate_folder
from pointforge.implant.pipeline import GenerateOptions, load_models
from pointforge.implant.view import PLOTLY_JS
from pointforge.implant.writer import generate_case
from pointforge.tasks.pcdiff.placement import placement_metrics


def generate_and_evaluate(
    out: Path,
    s: DemoSettings,
    kept: list[dict],
    raw: Path,
    prepared: Path,
    case_ids: dict[str, list[str]],
    log: Callable[[str], None],
    progress,
) -> list[dict]:
    """Stage 3: implants for the held-out cases with each phase's checkpoints, each set evaluated.

    ``case_ids`` by split: the test cases make the curve and the verdict; the
    validation cases (when the split has any) choose the phase whose models
    the verdict is about, so the test cases play no part in that choice.
    """
    curve = []
    for k, snap in enumerate(kept):
        label = "final" if k == len(kept) - 1 else f"{snap['minutes']:.2f}min"
        log(f"[3/6] generating implants with the models after {snap['minutes']:g} min")
        models = load_models(snap["pcdiff"]["checkpoint"], snap["voxelizer"]["checkpoint"], device=s.device)
        scored = {}
        for split, root in (("test", out / "implants" / label), ("val", out / "implants" / "validation" / label)):
            if case_ids.get(split):
                scored[split] = _score_split(
                    s, models, split, root, (raw, prepared, out / PLOTLY_JS), case_ids[split], log, progress, snap
                )
        gen, evaluation = scored["test"]
        val = scored.get("val")
        curve.append(
            {
                "minutes": snap["minutes"],
                "steps": {n: snap[n]["step"] for n in ("pcdiff", "voxelizer")},
                "failed": gen.failed,
                "evaluation": evaluation,
                "root": out / "implants" / label,
                "val_dsc_mean": mean_dsc(val[1], case_ids["val"]) if val else None,
            }
        )
    return curve


def _score_split(s: DemoSettings, models, split: str, root: Path, paths: tuple, ids, log, progress, snap):
    """Implants for one split's cases into ``root``, evaluated against the true implants: (generated, evaluation).

    ``paths``: the raw dataset, the prepared one and the shared plotly.js.
    """
    raw, prepared, viewer_js = paths
    log(f"      {len(ids)} {'validation' if split == 'val' else 'test'} cases → {root}")
    gen = generate_folder(
        prepared,
        root,
        models,
        GenerateOptions(ensemble=s.ensemble, sampler=s.sampler, steps=s.steps, seed=s.seed),
        split=split,
        log=log,
        progress=(lambda d, n: progress("generate", d, n, snap["minutes"])) if progress else None,
        viewer_js=viewer_js,
    )
    evaluation = evaluate_predictions(root, raw, cases=ids, progress=scoring_progress(progress))
    write_reports(evaluation, root)
    return gen, evaluation


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


def run_oracle(dataset: PreparedDataset, out: Path, snapshot: dict, s: DemoSettings, cases, progress=None) -> None:
    """Each test case's true implant points, as ``s.ensemble`` proposals, through the pipeline after PCDiff."""
    options = GenerateOptions(ensemble=s.ensemble, sampler=s.sampler, steps=s.steps, seed=s.seed)
    models = load_models(snapshot["pcdiff"]["checkpoint"], snapshot["voxelizer"]["checkpoint"], device=s.device)
    n_implant = models.pcdiff.config.n_implant
    rng = np.random.default_rng(s.seed)
    for k, case in enumerate(cases):
        if progress and k == 0:
            progress("oracle", 0, len(cases), None)
        meta = dataset.meta(case.implant)
        points = np.asarray(dataset.points(case.implant), dtype=np.float64)
        affine = (
            np.asarray(meta["direction"], dtype=np.float64) * np.asarray(meta["spacing"], dtype=np.float64)[None, :]
        )
        points_mm = points @ affine.T + np.asarray(meta["origin"], dtype=np.float64)
        chosen = np.stack(
            [
                points_mm[rng.choice(len(points_mm), n_implant, replace=len(points_mm) < n_implant)]
                for _ in range(s.ensemble)
            ]
        )
        generate_case(
            dataset.meta(case.defective)["source"],
            out / case.case_id,
            models,
            options,
            proposals_mm=chosen,
            title=f"{case.case_id}: oracle (true implant points)",
            viewer_js=out.parent / PLOTLY_JS,
        )
        if progress:
            progress("oracle", k + 1, len(cases), None)


def run_baseline(prepared: Path, out: Path, progress=None) -> dict:
    """Mean-of-registered-training-skulls implants for the test split into ``out/<case_id>/implant.nrrd``."""
    data = PreparedDataset(prepared)
    atlas = Atlas.from_prepared(data, split="train")
    seconds = []
    cases = data.split("test")
    for k, case in enumerate(cases):
        if progress and k == 0:
            progress("baseline", 0, len(cases), None)
        t = time.perf_counter()
        defective = read_binary_volume(data.meta(case.defective)["source"])
        implant = mean_skull_implant(defective, atlas)
        write_volume(out / case.case_id / "implant.nrrd", implant)
        seconds.append(time.perf_counter() - t)
        if progress:
            progress("baseline", k + 1, len(cases), None)
    return {"atlas_skulls": len(atlas), "seconds_per_case": round(sum(seconds) / max(len(seconds), 1), 2)}


def placement_rows(dataset: PreparedDataset, root: Path, cases) -> list[dict]:
    """Per case generated under ``root``: the placement of its generated points (mm) against the true
    implant points (:func:`pointforge.tasks.pcdiff.placement.placement_metrics`, the case's proposals averaged)."""
    rows = []
    for case in cases:
        path = root / case.case_id / "proposals" / "points.npy"
        if not path.is_file():
            continue
        spacing = np.asarray(dataset.meta(case.defective)["spacing"], dtype=np.float64)
        pred = torch.from_numpy(np.load(path).astype(np.float64) * spacing)
        true = torch.from_numpy(np.asarray(dataset.points(case.implant), dtype=np.float64) * spacing)
        found = placement_metrics(pred, true[None].expand(len(pred), -1, -1))
        rows.append({"case": case.case_id, **{name: float(values.mean()) for name, values in found.items()}})
    return rows


def placement_summary(dataset: PreparedDataset, root: Path, cases) -> dict[str, float]:
    """The means of :func:`placement_rows` over the cases."""
    rows = placement_rows(dataset, root, cases)
    return {name: float(np.mean([r[name] for r in rows])) for name in (rows[0] if rows else {}) if name != "case"}
