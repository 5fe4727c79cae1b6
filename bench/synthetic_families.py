"""How much synthetic skulls vary, family by family: what the atlas baseline can and cannot take out.

For each skull family, ``synthesize(n_skulls, size, seed)`` writes a
SkullBreak-style dataset; then, side by side:

* raw pairwise DSC of the complete skulls (every pair, on the shared grid;
  both families centre the head in the field of view);
* the same after stretching each skull's bounding box to a cube (per-axis
  scale and shift taken out: what is left is shape);
* the atlas baseline (:func:`pointforge.implant.baseline.mean_skull_implant`):
  the first ``n_skulls - test`` complete skulls are the atlas, the last
  ``test`` skulls' five defects are the cases, implant DSC per class;
* seconds per skull (making it, its defects and writing the files).

    python bench/synthetic_families.py [--skulls 8] [--test 2] [--size 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import ndimage

from _common import machine, print_table, write_json
from pointforge.data.synthetic.dataset import FAMILIES, synthesize
from pointforge.data.synthetic.defects import DEFECT_CLASSES
from pointforge.data.volumes import read_volume
from pointforge.implant.baseline import Atlas, mean_skull_implant
from pointforge.implant.metrics import dice


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * float((a & b).sum()) / float(a.sum() + b.sum())


def box_normalised(skull: np.ndarray, size: int = 48) -> np.ndarray:
    """The skull's bounding box stretched to a ``size``³ cube."""
    nonzero = np.argwhere(skull)
    lo, hi = nonzero.min(axis=0), nonzero.max(axis=0) + 1
    crop = skull[lo[0] : hi[0], lo[1] : hi[1], lo[2] : hi[2]].astype(np.float32)
    return ndimage.zoom(crop, [size / s for s in crop.shape], order=1) >= 0.5


def measure_folder(root: Path, n_skulls: int, n_test: int) -> dict[str, Any]:
    """The variation of a SkullBreak-layout folder of skulls ``000`` … ``n_skulls - 1`` (module docs)."""
    volumes = [read_volume(root / "complete_skull" / f"{k:03d}.nrrd") for k in range(n_skulls)]
    masks = [np.asarray(v.data) != 0 for v in volumes]
    shapes = [box_normalised(m) for m in masks]
    atlas = Atlas.from_volumes(volumes[: n_skulls - n_test])
    per_class: dict[str, list[float]] = {cls: [] for cls in DEFECT_CLASSES}
    for k in range(n_skulls - n_test, n_skulls):
        for cls in DEFECT_CLASSES:
            defective = read_volume(root / "defective_skull" / cls / f"{k:03d}.nrrd")
            truth = np.asarray(read_volume(root / "implant" / cls / f"{k:03d}.nrrd").data) != 0
            predicted = np.asarray(mean_skull_implant(defective, atlas).data) != 0
            per_class[cls].append(dice(predicted, truth))
    return {
        "pairwise_dsc": float(np.mean([_dice(a, b) for a, b in itertools.combinations(masks, 2)])),
        "box_normalised_pairwise_dsc": float(np.mean([_dice(a, b) for a, b in itertools.combinations(shapes, 2)])),
        "baseline_dsc": float(np.mean([s for scores in per_class.values() for s in scores])),
        "baseline_dsc_per_class": {cls: float(np.mean(scores)) for cls, scores in per_class.items()},
    }


def measure(family: str, n_skulls: int, n_test: int, size: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        started = time.perf_counter()
        synthesize(root, n_skulls, size, seed, family=family)
        seconds = (time.perf_counter() - started) / n_skulls
        measured = measure_folder(root, n_skulls, n_test)
    return {"family": family, **measured, "seconds_per_skull": seconds}


def print_variation(results: list[dict[str, Any]]) -> None:
    """The variation table, one row per family (the measures of :func:`measure`)."""
    print_table(
        ["family", "pairwise DSC", "box-normalised", "baseline DSC", *DEFECT_CLASSES, "s/skull"],
        [
            [
                r["family"],
                r["pairwise_dsc"],
                r["box_normalised_pairwise_dsc"],
                r["baseline_dsc"],
                *r["baseline_dsc_per_class"].values(),
                r["seconds_per_skull"],
            ]
            for r in results
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skulls", type=int, default=8)
    parser.add_argument("--test", type=int, default=2, help="skulls whose defects are the baseline's cases")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = [measure(family, args.skulls, args.test, args.size, args.seed) for family in FAMILIES]
    print(f"machine: {machine()}")
    print(f"{args.skulls} skulls at {args.size}³, seed {args.seed}; baseline: {args.skulls - args.test} atlas skulls")
    print_variation(results)
    path = write_json("synthetic_families", {"machine": machine(), "args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
