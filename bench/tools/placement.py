"""Does a PCDiff checkpoint put implants where the defect is? Placement, condition use, DSC.

For every case of a prepared dataset's split (default: test) the whole
pipeline runs as ``pointforge generate`` runs it (PCDiff proposals → voxelizer
→ vote → clean-up) and the result is scored:

* placement of the generated points against the true implant points, in mm:
  centroid error, spread ratio (RMS radius generated / true), mean
  nearest-neighbour distance each way (:func:`pointforge.tasks.pcdiff.placement.placement_metrics`);
* condition use: the network's clean-point error per noise bucket with each
  case's own skull versus another case's (ratio > 1: it reads the skull);
* the implant volume's DSC / bDSC / HD95 against the ground truth
  (``pointforge evaluate``), when ``--truth`` names the raw dataset.

    python bench/tools/placement.py PCDIFF.pt VOXELIZER.pt --data PREPARED [--truth RAW]
                              [--split test] [--ensemble 3] [--sampler dpm++2m] [--steps 20]

It prints a table (one row per case, then the means) and writes
``bench/results/placement.json``. Results for the demo data and the ablation
of formulations are in docs/experiments/pcdiff.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import machine, print_table, write_json
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.implant.demo.scoring import placement_rows
from pointforge.implant.folder import generate_folder
from pointforge.implant.models import load_models
from pointforge.implant.options import GenerateOptions
from pointforge.tasks.pcdiff.dataset import HALF_EXTENT, PCDiffDataset
from pointforge.tasks.pcdiff.placement import condition_use

PLACEMENT_KEYS = ("centroid_error", "spread_ratio", "pred_to_true", "true_to_pred")


def _condition_use(loaded, data: PreparedDataset, split: str) -> dict[str, float]:
    cfg = loaded.config
    cases = PCDiffDataset(
        data,
        split,
        n_skull=cfg.n_skull,
        n_implant=cfg.n_implant,
        half_extent=HALF_EXTENT,
        frame=cfg.frame,
        atlas=getattr(loaded.model, "atlas_mm", None),
        seed=1,
    )
    if len(cases) < 2:
        return {}
    x0 = torch.stack([cases[i]["points"] for i in range(len(cases))]).transpose(1, 2)
    found = condition_use(loaded.model, loaded.schedule, x0, cfg.n_implant, generator=torch.Generator().manual_seed(0))
    return {k: v for k, v in found.items() if k.startswith("cond_use")}


def _dsc(out: Path, truth: Path, case_ids: list[str]) -> dict[str, dict]:
    from pointforge.implant.evaluate import evaluate_predictions

    evaluation = evaluate_predictions(out, truth, cases=case_ids)
    return {r["case_id"]: {k: r.get(k) for k in ("dsc", "bdsc", "hd95")} for r in evaluation.rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pcdiff")
    parser.add_argument("voxelizer")
    parser.add_argument("--data", required=True, help="prepared dataset")
    parser.add_argument("--truth", help="raw dataset with the true implants (for DSC)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--ensemble", type=int, default=3)
    parser.add_argument("--sampler", default="dpm++2m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="keep the generated cases here (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = PreparedDataset(args.data)
    cases = data.split(args.split)
    models = load_models(args.pcdiff, args.voxelizer, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        started = time.perf_counter()
        options = GenerateOptions(ensemble=args.ensemble, sampler=args.sampler, steps=args.steps, seed=0)
        result = generate_folder(args.data, out, models, options, split=args.split)
        seconds = time.perf_counter() - started
        rows = placement_rows(data, out, cases)  # failed cases have no points and no row
        scores = _dsc(out, Path(args.truth), [c.case_id for c in cases]) if args.truth else {}
    for row in rows:
        row.update(scores.get(row["case"], {}))
    keys = [*PLACEMENT_KEYS, *(("dsc", "bdsc", "hd95") if scores else ())]
    means = {k: float(np.nanmean([np.nan if r.get(k) is None else r[k] for r in rows])) for k in keys}
    used = _condition_use(models.pcdiff, data, args.split)
    print(
        f"machine: {machine()}\n{len(rows)} cases, {args.ensemble} proposals, {args.sampler}-{args.steps}, "
        f"{seconds / max(len(cases), 1):.1f} s per case\n"
    )
    print_table(["case", *keys], [[r["case"], *[r.get(k) for k in keys]] for r in rows] + [["mean", *means.values()]])
    print(
        "\ncondition use (x0 error with another case's skull / with its own; lowest noise first): "
        + ", ".join(f"{used[k]:.2f}" for k in sorted(used))
    )
    path = write_json(
        "placement",
        {
            "machine": machine(),
            "args": vars(args),
            "rows": rows,
            "mean": means,
            "condition_use": used,
            "failed": result.failed,
            "seconds": seconds,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
