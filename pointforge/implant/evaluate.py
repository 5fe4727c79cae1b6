"""Score predicted implants against a dataset in the SkullBreak or SkullFix layout.

For every case of the truth dataset that has an implant, the prediction is
looked for, in this order, at

* ``PRED/<case_id>/implant.nrrd`` (what ``pointforge generate`` writes per case),
* ``PRED/implant/<case_id>.nrrd`` (a dataset-like layout),
* ``PRED/<case_id>.nrrd``,

with ``.nii.gz``/``.nii`` accepted too; ``case_id`` is ``<defect>/NNN`` for
SkullBreak and ``NNN`` for SkullFix. Cases without a prediction are listed as
missing, not scored. The defective skull (for bDSC) and the spacing (for bDSC
and HD95) come from the truth dataset's files.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pointforge.data.skulls.layouts import list_cases
from pointforge.data.volumes import read_binary_volume
from pointforge.errors import DataError
from pointforge.formats import summary_stats, write_rows_report
from pointforge.implant.metrics import evaluate_case

METRICS = ("dsc", "bdsc", "hd95", "hd")


@dataclass
class Evaluation:
    rows: list[dict] = field(default_factory=list)  # one per scored case
    missing: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # group -> metric -> {mean, median, std, min, max, n}
    seconds: float = 0.0

    def __json__(self) -> dict:
        """What :func:`~pointforge.formats.json_safe` writes: the summary and the rows."""
        return {"summary": self.summary, "rows": self.rows}


def find_prediction(pred_root: Path, case_id: str) -> Path | None:
    for base in (pred_root / case_id / "implant", pred_root / "implant" / case_id, pred_root / case_id):
        for suffix in (".nrrd", ".nii.gz", ".nii"):
            candidate = base.parent / (base.name + suffix)
            if candidate.is_file():
                return candidate
    return None


def summarise(rows: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["defect"] or "all", []).append(row)
    if len(groups) > 1 or "all" not in groups:
        groups["all"] = rows
    return {
        g: {m: summary_stats([r[m] for r in rs if r.get("error") is None]) for m in METRICS} for g, rs in groups.items()
    }


def evaluate_predictions(
    pred_root: str | os.PathLike,
    truth_root: str | os.PathLike,
    *,
    margin_mm: float = 10.0,
    cases: list[str] | None = None,
    progress=None,
) -> Evaluation:
    t0 = time.perf_counter()
    pred_root, truth_root = Path(pred_root), Path(truth_root)
    if not pred_root.is_dir():
        raise DataError(f"{pred_root}: no such folder of predictions")
    _, raw_cases = list_cases(truth_root)
    raw_cases = [c for c in raw_cases if c.implant is not None and (cases is None or c.case_id in cases)]
    if not raw_cases:
        raise DataError(f"{truth_root}: no case with a ground-truth implant to evaluate against")
    result = Evaluation()
    if progress:
        progress(0, len(raw_cases))
    for k, case in enumerate(raw_cases):
        pred_path = find_prediction(pred_root, case.case_id)
        if pred_path is None:
            result.missing.append(case.case_id)
        else:
            row: dict[str, Any] = {"case_id": case.case_id, "defect": case.defect, "prediction": str(pred_path)}
            try:
                truth = read_binary_volume(case.implant)  # type: ignore[arg-type]  # raw_cases keeps cases with one
                pred = read_binary_volume(pred_path, allow_empty=True)
                defective = read_binary_volume(case.defective)
                if pred.shape != truth.shape:
                    raise DataError(f"{pred_path}: shape {pred.shape} differs from the truth's {truth.shape}")
                if not np.allclose(pred.spacing, truth.spacing, rtol=1e-4):
                    raise DataError(f"{pred_path}: spacing {pred.spacing} differs from the truth's {truth.spacing}")
                scores = evaluate_case(pred.data, truth.data, defective.data, truth.spacing, margin_mm)
                row.update({m: scores[m] for m in METRICS})
                row["notes"] = "; ".join(scores.get("notes") or [])
                row["error"] = scores.get("error")
            except DataError as err:
                row.update({m: math.nan for m in METRICS})
                row["notes"] = ""
                row["error"] = str(err)
            result.rows.append(row)
        if progress:
            progress(k + 1, len(raw_cases))
    result.summary = summarise(result.rows)
    result.seconds = time.perf_counter() - t0
    return result


def write_reports(evaluation: Evaluation, out_dir: str | os.PathLike) -> dict[str, Path]:
    """``metrics.csv`` (per case), ``metrics.json`` (cases, summary, missing). Atomic."""
    payload = {
        "cases": evaluation.rows,
        "summary": evaluation.summary,
        "missing": evaluation.missing,
        "seconds": round(evaluation.seconds, 2),
    }
    fields = ["case_id", "defect", *METRICS, "error", "notes", "prediction"]
    return write_rows_report(out_dir, "metrics", evaluation.rows, fields, payload)
