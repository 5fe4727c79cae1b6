"""Score a folder of upsampled clouds against a folder of dense ones (``pointforge evaluate-upsampling``).

Clouds are paired by file stem: ``PRED/tile_01.laz`` is scored against
``TRUTH/tile_01.<npy|ply|las|laz>`` (formats may differ). Each pair gets the
metrics of :mod:`pointforge.upsampling.metrics` (Chamfer, Hausdorff,
point-to-surface, uniformity) and the truth's own uniformity, the floor the
prediction's is to be read against; the summary holds mean, median, standard
deviation, minimum and maximum of each over the pairs. Truth clouds without a
prediction are listed as missing, not scored.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from pointforge.data.pointio import POINT_SUFFIXES, read_points
from pointforge.errors import DataError
from pointforge.formats import summary_stats, write_rows_report
from pointforge.upsampling.metrics import METRICS, cloud_metrics, uniformity

__all__ = ["COLUMNS", "UpsamplingEvaluation", "find_clouds", "evaluate_upsampling", "write_upsampling_reports"]

COLUMNS = (*METRICS, "truth_uniformity")


@dataclass
class UpsamplingEvaluation:
    rows: list[dict] = field(default_factory=list)  # one per scored pair
    missing: list[str] = field(default_factory=list)  # truth stems without a prediction
    summary: dict = field(default_factory=dict)  # metric -> {n, mean, median, std, min, max}
    seconds: float = 0.0


def find_clouds(folder: str | os.PathLike, what: str) -> dict[str, Path]:
    """``{stem: path}`` of the point cloud files directly inside ``folder``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder of {what} clouds; check the path")
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix.lower() in POINT_SUFFIXES:
            if path.stem in found:
                raise DataError(f"{folder}: {found[path.stem].name} and {path.name} share a name; keep one of them")
            found[path.stem] = path
    if not found:
        raise DataError(f"{folder}: no .npy, .ply, .las or .laz files in it; give the folder of {what} clouds")
    return found


def evaluate_upsampling(
    pred_dir: str | os.PathLike,
    truth_dir: str | os.PathLike,
    *,
    surface_k: int = 10,
    seeds: int = 1000,
    radius_factor: float = 4.0,
    workers: int = 1,
    progress: Optional[Callable[[int, int], None]] = None,
) -> UpsamplingEvaluation:
    """Every pair of ``pred_dir`` and ``truth_dir`` scored (module docs); ``progress(done, total)``."""
    start = time.perf_counter()
    preds, truths = find_clouds(pred_dir, "upsampled"), find_clouds(truth_dir, "dense")
    pairs = [stem for stem in truths if stem in preds]
    if not pairs:
        raise DataError(
            f"no file of {pred_dir} has the name of one in {truth_dir}; predictions are paired with dense clouds by "
            "file name (tile_01.laz with tile_01.npy)"
        )
    result = UpsamplingEvaluation(missing=[stem for stem in truths if stem not in preds])
    for done, stem in enumerate(pairs, start=1):
        pred, truth = read_points(preds[stem]).xyz, read_points(truths[stem]).xyz
        scores = cloud_metrics(
            pred, truth, surface_k=surface_k, seeds=seeds, radius_factor=radius_factor, workers=workers
        )
        floor = uniformity(truth, truth, seeds=seeds, radius_factor=radius_factor, workers=workers)
        result.rows.append(
            {"pair": stem, **scores.as_dict(), "truth_uniformity": floor, "prediction": str(preds[stem])}
        )
        if progress is not None:
            progress(done, len(pairs))
    result.summary = {m: summary_stats([row[m] for row in result.rows]) for m in COLUMNS}
    result.seconds = time.perf_counter() - start
    return result


def write_upsampling_reports(evaluation: UpsamplingEvaluation, out_dir: str | os.PathLike) -> dict[str, Path]:
    """``upsampling_metrics.csv`` (per pair) and ``upsampling_metrics.json`` (pairs, summary, missing). Atomic."""
    payload = {
        "pairs": evaluation.rows,
        "summary": evaluation.summary,
        "missing": evaluation.missing,
        "seconds": round(evaluation.seconds, 2),
    }
    fields = ["pair", *COLUMNS, "points", "truth_points", "prediction"]
    return write_rows_report(out_dir, "upsampling_metrics", evaluation.rows, fields, payload)
