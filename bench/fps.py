"""Furthest point sampling at the paper network's sizes: the plain loops against the blocked loop.

The paper preset samples 10,240 of 30,720 points, then 2,560 of those, 640 and 160. Each
level's input is the previous level's samples of bench/pvcnn.py's synthetic skull (one
skull per batch element), as in the network. Every backend is first checked to give
exactly the plain loop's indices (NumPy's on CPU, torch's elsewhere); then the backends run interleaved in one process, the
order rotating each round, and the median per backend is reported with the load average.

    python bench/fps.py [--device cpu] [--batches 1 5] [--rounds 3] [--threads 2] [--torch-loop]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from pvcnn import synthetic_skull

from _common import machine, print_table, write_json
from pointforge.nn.ops.fps import furthest_point_sample_indices
from pointforge.nn.ops.grouping import gather

LEVELS = (10_240, 2_560, 640, 160)


def level_inputs(batch: int, device: torch.device) -> list[torch.Tensor]:
    """The four levels' input clouds: the skulls, then each level's samples."""
    coords = torch.cat([synthetic_skull(seed) for seed in range(batch)]).to(device)
    inputs = []
    for samples in LEVELS:
        inputs.append(coords)
        coords = gather(coords, furthest_point_sample_indices(coords, samples))
    return inputs


def _seconds(coords: torch.Tensor, samples: int, backend: str) -> float:
    if coords.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    furthest_point_sample_indices(coords, samples, backend=backend)
    if coords.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(batch: int, device: torch.device, backends: list[str], rounds: int) -> list[dict[str, Any]]:
    records = []
    for coords, samples in zip(level_inputs(batch, device), LEVELS):
        plain = furthest_point_sample_indices(coords, samples, backend=backends[0])
        for backend in backends[1:]:
            if not torch.equal(furthest_point_sample_indices(coords, samples, backend=backend), plain):
                raise SystemExit(f"bench/fps.py: backend {backend!r} differs from the plain loop at {samples} samples")
        times: dict[str, list[float]] = {backend: [] for backend in backends}
        for r in range(rounds):
            for backend in backends[r % len(backends) :] + backends[: r % len(backends)]:
                times[backend].append(_seconds(coords, samples, backend))
        records.append(
            {
                "batch": batch,
                "points": coords.shape[2],
                "samples": samples,
                "seconds": times,
                "median_s": {b: statistics.median(t) for b, t in times.items()},
                "load_average": os.getloadavg()[0],
            }
        )
        print(f"batch {batch}, {coords.shape[2]} -> {samples}: done, load average {records[-1]['load_average']:.1f}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-loop", action="store_true", help="on CPU also time the plain torch loop (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backends = ["torch", "blocked"]
    if device.type == "cpu":
        backends = ["numpy"] + backends if args.torch_loop else ["numpy", "blocked"]
    records = [rec for batch in args.batches for rec in measure(batch, device, backends, args.rounds)]
    base = backends[0]
    rows = [
        [rec["batch"], f"{rec['points']} -> {rec['samples']}", *(rec["median_s"][b] for b in backends)]
        + [rec["median_s"][base] / rec["median_s"]["blocked"]]
        for rec in records
    ]
    print(f"{machine()} | {args.device}, {args.threads} threads, median of {args.rounds} interleaved rounds")
    print_table(["batch", "level", *(f"{b} s" for b in backends), f"blocked speed-up over {base}"], rows)
    record = {"machine": machine(), "device": args.device, "threads": args.threads, "levels": records}
    print(f"wrote {write_json('fps', record)}")


if __name__ == "__main__":
    main()
