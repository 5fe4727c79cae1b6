"""PVCNN2 paper forward in evaluation: whole batches against per-sample chunks, in one process.

The paper preset's evaluation forward (no grad, as sampling runs it) on bench/pvcnn.py's
synthetic skulls (30,720 points each), at each batch size, with ``eval_chunk_points``
unset (the whole batch in one pass) and set to 1, 2, ... samples' worth of points.
Rounds interleave the settings (the order rotating each round) so that all see the same
load; the figures are the medians over rounds of wall and process CPU time, with the
load average after each round. Each
chunked output is compared with the whole batch's (largest absolute difference).

    python bench/pvcnn_chunks.py [--batches 5 8] [--chunks 1 2] [--rounds 3] [--threads 2]
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
from pointforge.nn.pvcnn import PVCNN2

T_STEP = 500


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[5, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2], help="samples per chunk to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = PVCNN2("paper").eval()
    result: dict[str, Any] = {"machine": machine(), "threads": args.threads, "batches": {}}
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            x = torch.cat([synthetic_skull(seed) for seed in range(batch)])
            t = torch.full((batch,), T_STEP)
            settings: list[int | None] = [None] + [c for c in args.chunks if c < batch]
            model.eval_chunk_points = None
            whole = model(x, t)  # warm-up, and the reference output
            diffs = {}
            for chunk in settings[1:]:
                model.eval_chunk_points = chunk * x.shape[2]
                diffs[chunk] = float((model(x, t) - whole).abs().max())
            walls: dict[int | None, list[float]] = {s: [] for s in settings}
            cpus: dict[int | None, list[float]] = {s: [] for s in settings}
            loads = []
            for r in range(args.rounds):
                for s in settings[r % len(settings) :] + settings[: r % len(settings)]:
                    model.eval_chunk_points = None if s is None else s * x.shape[2]
                    start, cpu = time.perf_counter(), time.process_time()
                    model(x, t)
                    walls[s].append(time.perf_counter() - start)
                    cpus[s].append(time.process_time() - cpu)
                loads.append(os.getloadavg()[0])
                print(f"batch {batch}: round {r + 1}/{args.rounds}, load average {loads[-1]:.1f}", flush=True)
            base = statistics.median(walls[None])
            for s in settings:
                wall = statistics.median(walls[s])
                name = "whole batch" if s is None else f"{s} per chunk"
                cpu = statistics.median(cpus[s])
                rows.append([batch, name, wall, wall / batch, base / wall, cpu, diffs.get(s, 0.0)])
            result["batches"][str(batch)] = {
                "walls": {str(s): w for s, w in walls.items()},
                "cpus": {str(s): c for s, c in cpus.items()},
                "loads": loads,
                "max_abs_difference": {str(s): d for s, d in diffs.items()},
            }
    print(f"PVCNN2 paper forward (eval, no grad), 30,720 points per sample, {args.threads} threads; {machine()}")
    print_table(
        ["batch", "setting", "median wall s", "s per sample", "speed-up", "median CPU s", "max |out diff|"], rows
    )
    print(f"wrote {write_json('pvcnn_chunks', result)}")


if __name__ == "__main__":
    main()
