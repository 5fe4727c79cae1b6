"""Implant metrics on a synthetic 512³ case: restricted (our default) vs whole volume.

The case looks like a SkullBreak one: a spherical skull shell 10 voxels thick,
a curved plate of about 100 x 100 x 10 voxels cut out of it as the true
implant, the rest as the defective skull, and a prediction that is the true
implant shifted by a couple of voxels. Each metric is timed alone and then all
four together through ``evaluate_case``, once with the bounding-box restriction
and once straight from the definition on the whole volume (SciPy distance
transforms over 512³, as the challenge's reference evaluation does). Both must
give the same numbers; the ratio is the point, absolute times are context.

    python bench/metrics.py [--size 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import numpy as np

from _common import machine, print_table, write_json
from pointforge.implant import metrics

SPACING = (0.45, 0.45, 0.5)


def synthetic_case(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prediction, true implant, defective skull) as uint8 volumes of ``size``³."""
    scale = size / 512
    centre = size / 2
    outer = 200 * scale
    thickness = max(10 * scale, 2.0)
    plate_half_width = 50 * scale
    axis = np.arange(size, dtype=np.float32) - centre
    x, y, z = axis[:, None, None], axis[None, :, None], axis[None, None, :]
    radius = np.sqrt(x * x + y * y + z * z)
    shell = (radius <= outer) & (radius > outer - thickness)
    del radius
    # The plate is the part of the shell above a square patch of the skull's
    # top, which makes it curved like a real implant rather than a flat box.
    implant = shell & (z > 0) & (np.abs(x) <= plate_half_width) & (np.abs(y) <= plate_half_width)
    skull = shell & ~implant
    del shell
    shift = (max(round(2 * scale), 1), -max(round(scale), 1), max(round(scale), 1))
    prediction = np.zeros_like(implant)
    source = tuple(slice(max(-s, 0), size - max(s, 0)) for s in shift)
    target = tuple(slice(max(s, 0), size - max(-s, 0)) for s in shift)
    prediction[target] = implant[source]
    prediction &= ~skull
    return prediction.astype(np.uint8), implant.astype(np.uint8), skull.astype(np.uint8)


def best_time(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, value = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        value = run()
        best = min(best, time.perf_counter() - start)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="edge of the cubic volume (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the restricted path; best is kept")
    args = parser.parse_args()

    start = time.perf_counter()
    pred, truth, skull = synthetic_case(args.size)
    build_s = time.perf_counter() - start
    extent = np.ptp(np.argwhere(truth), axis=0) + 1

    measures: dict[str, Callable[[bool], Any]] = {
        "DSC": lambda restrict: metrics.dice(pred, truth, restrict=restrict),
        "bDSC": lambda restrict: metrics.boundary_dice(pred, truth, skull, SPACING, restrict=restrict),
        "HD95": lambda restrict: metrics.hd95(pred, truth, SPACING, restrict=restrict),
        "HD": lambda restrict: metrics.hausdorff(pred, truth, SPACING, restrict=restrict),
        "all four (evaluate_case)": lambda restrict: metrics.evaluate_case(
            pred, truth, skull, SPACING, restrict=restrict
        ),
    }
    rows, results = [], {}
    for name, measure in measures.items():
        fast_s, fast_value = best_time(lambda: measure(True), args.repeats)
        # The whole-volume path takes tens of seconds and gigabytes: run once.
        full_s, full_value = best_time(lambda: measure(False), 1)
        if isinstance(fast_value, dict):
            difference = max(abs(fast_value[k] - full_value[k]) for k in ("dsc", "bdsc", "hd95", "hd"))
        else:
            difference = abs(fast_value - full_value)
        shown = fast_value["hd95"] if isinstance(fast_value, dict) else fast_value
        rows.append([name, fast_s, full_s, full_s / fast_s, difference])
        results[name] = {
            "restricted_s": fast_s,
            "full_volume_s": full_s,
            "speedup": full_s / fast_s,
            "abs_difference": difference,
            "value": shown if not isinstance(fast_value, dict) else fast_value,
        }

    print(f"machine: {machine()}")
    print(
        f"volume {args.size}³, spacing {SPACING} mm, implant extent {tuple(int(e) for e in extent)} voxels, "
        f"{int(truth.sum())} implant / {int(skull.sum())} skull voxels (built in {build_s:.1f} s)"
    )
    print(f"restricted: best of {args.repeats}; whole volume: one run\n")
    print_table(["metric", "restricted s", "whole volume s", "speed-up", "|difference|"], rows)
    values = results["all four (evaluate_case)"]["value"]
    print("\nvalues: " + ", ".join(f"{k} {values[k]:.6f}" for k in ("dsc", "bdsc", "hd95", "hd")))
    path = write_json(
        "metrics",
        {
            "machine": machine(),
            "size": args.size,
            "spacing_mm": SPACING,
            "repeats": args.repeats,
            "implant_extent_voxels": [int(e) for e in extent],
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
