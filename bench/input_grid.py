"""The way back to an anisotropic scan's grid: the seven maps of one case, whole volume against the implant's box.

``generate`` works on isotropic voxels; for an anisotropic scan (SkullFix: 0.45 x 0.45 x 0.625 mm) the
voted implant, the five proposals' own implants and the agreement map go back to the scan's grid
by linear interpolation (``pointforge.implant.pipeline._to_input_grid``). This bench makes a
SkullFix-sized case (512 x 512 x 233 input voxels, 512 x 512 x 323 isotropic) with an implant-sized
plate (about 60 x 70 x 12 mm) and its proposals, and times the seven maps done by the whole-volume
``scipy.ndimage.affine_transform`` (the former code) and by the boxed one (the current), checking that
the two give the same arrays. Median of ``--rounds`` rounds, each the seven maps.

    python bench/input_grid.py [--rounds 3]

Writes ``bench/results/input_grid.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from scipy.ndimage import affine_transform

from _common import machine, print_table, write_json
from pointforge.implant.pipeline import _to_input_grid

SPACING = np.array([0.45, 0.45, 0.625])
SHAPE = (512, 512, 233)


def whole_volume(values: np.ndarray, scale: np.ndarray, shape: tuple[int, ...], binary: bool) -> np.ndarray:
    out = affine_transform(values.astype(np.float32), 1.0 / scale, output_shape=shape, order=1, mode="nearest")
    return out >= 0.5 if binary else out.astype(np.float32)


def case(rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, tuple[int, ...]]:
    iso = float(SPACING.min())
    work = tuple(int(n) for n in np.floor((np.array(SHAPE) - 1) * SPACING / iso + 1e-6).astype(int) + 1)
    grid = np.stack(np.meshgrid(*[np.arange(n) * iso for n in work], indexing="ij", sparse=False), -1)
    centre = np.array([115.0, 60.0, 110.0])  # mm: a plate on the skull's side
    masks = []
    for k in range(6):  # the vote, then five proposals a voxel or two apart
        c = centre + rng.normal(0, 0.5, 3) * (k > 0)
        d = (grid - c) / np.array([30.0, 35.0, 6.0])
        masks.append((d**2).sum(-1) <= 1.0)
    agreement = np.mean(masks[1:], axis=0).astype(np.float32)
    return masks, agreement, iso / SPACING, SHAPE


def run(maps, agreement, scale, shape, how) -> tuple[float, list[np.ndarray]]:
    t = time.perf_counter()
    out = [how(m, scale, shape, True) for m in maps] + [how(agreement, scale, shape, False)]
    return time.perf_counter() - t, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    maps, agreement, scale, shape = case(np.random.default_rng(0))
    boxed = lambda v, s, sh, b: _to_input_grid(v, s, sh, binary=b)  # noqa: E731
    times: dict[str, list[float]] = {"whole volume": [], "implant box": []}
    same = True
    for _ in range(args.rounds):
        t_whole, a = run(maps, agreement, scale, shape, whole_volume)
        t_box, b = run(maps, agreement, scale, shape, boxed)
        times["whole volume"].append(t_whole)
        times["implant box"].append(t_box)
        same &= all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))
    rows = [[name, statistics.median(ts), min(ts), max(ts)] for name, ts in times.items()]
    print(f"{machine()}; load {os.getloadavg()[0]:.2f}; input {shape} at {tuple(SPACING)} mm; 7 maps a round")
    print_table(["maps back to the input grid", "median s", "min s", "max s"], rows)
    ratio = statistics.median(times["whole volume"]) / statistics.median(times["implant box"])
    print(f"speed-up {ratio:.1f}x; identical arrays: {same}")
    path = write_json(
        "input_grid",
        {
            "machine": machine(),
            "load_1min": os.getloadavg()[0],
            "input_shape": list(shape),
            "spacing_mm": SPACING.tolist(),
            "rounds": args.rounds,
            "seconds": times,
            "speedup": ratio,
            "identical": bool(same),
        },
    )
    print(f"wrote {path}")
    if not same:
        raise SystemExit("the boxed maps differ from the whole-volume ones")


if __name__ == "__main__":
    main()
