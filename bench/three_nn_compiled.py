"""3-NN search at the paper's four feature-propagation levels: the torch path against the compiled grid search.

The points and centres are those of a paper forward: bench/pvcnn.py's synthetic skulls
(30,720 points each), sampled down by FPS to 10,240, 2,560, 640 and 160 centres; each FP
level looks up the three nearest centres of every point of the level above. Two exact
paths, identical indices and weights (checked at every level before anything is timed):

* ``torch``: the path ``"auto"`` took before (the torch cell grid from 2^20 point-centre
  pairs, dense below);
* ``compiled``: ``backend="compiled"`` (``pointforge/nn/pvops/three_nn_compiled.py``).

Rounds are interleaved in one process (the order flipping each round), median of
``--rounds``; the load average is printed after each round, since the machine may be
shared (the ratios are the point, absolute times context).

    python bench/three_nn_compiled.py [--batches 1 5] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from pvcnn import synthetic_skull

from _common import print_table, record_header, write_json
from pointforge.nn.pvops.fps import furthest_point_sample
from pointforge.nn.pvops.three_nn import three_nearest_neighbors

LEVELS = (30720, 10240, 2560, 640, 160)


def torch_method(points: torch.Tensor, centers: torch.Tensor) -> str:
    """What ``"auto"`` ran before the compiled search."""
    b, _, n = points.shape
    m = centers.shape[2]
    return "grid" if m >= 3 and b * n * m >= (1 << 20) else "dense"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start_load = os.getloadavg()
    rows, record = [], []
    for batch in args.batches:
        clouds = [torch.cat([synthetic_skull(seed) for seed in range(batch)])]
        for m in LEVELS[1:]:
            clouds.append(furthest_point_sample(clouds[-1], m)[0].contiguous())
        pairs = list(zip(clouds[:-1], clouds[1:]))
        paths = {
            "torch": lambda p, c: three_nearest_neighbors(p, c, method=torch_method(p, c)),
            "compiled": lambda p, c: three_nearest_neighbors(p, c, backend="compiled"),
        }
        for points, centers in pairs:  # warm-up, and the check
            a, b = (run(points, centers) for run in paths.values())
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "the paths disagree"
        times: dict[tuple[int, str], list[float]] = {(k, name): [] for k in range(len(pairs)) for name in paths}
        for r in range(args.rounds):
            names = list(paths) if r % 2 == 0 else list(reversed(paths))
            for k, (points, centers) in enumerate(pairs):
                for name in names:
                    t0 = time.perf_counter()
                    paths[name](points, centers)
                    times[(k, name)].append(time.perf_counter() - t0)
            print(f"batch {batch}: round {r + 1}/{args.rounds}, load average {os.getloadavg()[0]:.1f}", flush=True)
        for k, (points, centers) in enumerate(pairs):
            before = statistics.median(times[(k, "torch")])
            after = statistics.median(times[(k, "compiled")])
            level = f"{points.shape[2]:,} among {centers.shape[2]:,}"
            rows.append([batch, level, before, after, before / after])
            record.append(
                {
                    "batch": batch,
                    "points": points.shape[2],
                    "centers": centers.shape[2],
                    "torch_s": times[(k, "torch")],
                    "compiled_s": times[(k, "compiled")],
                }
            )
    header = record_header(
        "three_nn_compiled",
        device="cpu",
        bf16=False,
        threads=args.threads,
        load={"start": start_load, "end": os.getloadavg()},
    )
    print(
        f"{header['machine']}; torch {header['torch']}, {args.threads} threads; load {start_load[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print_table(["batch", "level", "torch s", "compiled s", "speed-up"], rows)
    print(f"wrote {write_json('three_nn_compiled', {**header, 'levels': record})}")


if __name__ == "__main__":
    main()
