"""PVCNN2 (paper preset) on CPU: forward and forward+backward time, peak memory, op shares.

One example of the paper's size: B = 1, 30,720 points (27,648 on a skull-like double
shell with a cap cut out, 3,072 noisy implant points in the cap), normalised like
upstream (bounding-box half-extent 3), torch threads fixed (2 by default).

Each measurement runs in a fresh subprocess, so its peak resident memory (ru_maxrss)
is its own. Side by side in the same run, the same forward goes through the reference
paths (dense all-pairs ball query and 3-NN, the torch FPS loop, upstream's dense
grouping of all neighbour slots, PyTorch's default 3D-convolution dispatch); the
outputs agree and the ratio is the point. Absolute times are context: the machine
may be shared.

    python bench/pvcnn.py [--threads 2] [--repeats 3] [--skip-reference]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from _common import machine, print_table, write_json
from pointforge.nn import pvcnn_blocks
from pointforge.nn.pvcnn import PVCNN2
from pointforge.nn.pvops import averaging, bags, ball_query, fps, three_nn

N_CONDITIONING = 27_648
N_GENERATED = 3_072
T_STEP = 500


def synthetic_skull(seed: int = 0, conditioning: int = N_CONDITIONING, generated: int = N_GENERATED) -> torch.Tensor:
    """``[1, 3, conditioning + generated]``: skull-like shell points, then noisy implant points (upstream's layout)."""
    g = torch.Generator().manual_seed(seed)
    semi_axes = torch.tensor([1.0, 0.8, 0.87])

    def shell(n: int, in_cap: bool) -> torch.Tensor:
        chunks, have = [], 0
        while have < n:
            v = torch.randn(4 * n, 3, generator=g)
            v = v / v.norm(dim=1, keepdim=True)
            v = v[(v[:, 2] > 0.8) == in_cap]
            table = 1.0 - 0.08 * torch.randint(0, 2, (v.shape[0], 1), generator=g)  # outer and inner table
            chunks.append(v * table * semi_axes)
            have += v.shape[0]
        return torch.cat(chunks)[:n]

    skull = shell(conditioning, False)
    implant = shell(generated, True)
    lo, hi = skull.amin(0), skull.amax(0)
    centre, scale = (lo + hi) / 2, float((hi - lo).max()) / 2 / 3
    points = torch.cat([skull, implant]) - centre
    points /= scale
    points[conditioning:] += 0.5 * torch.randn(generated, 3, generator=g)  # noised at t ~ T/2
    return points.t().unsqueeze(0).contiguous()


def _model(train: bool) -> PVCNN2:
    torch.manual_seed(0)
    return PVCNN2("paper").train(train)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of ``repeats`` calls after one warm-up call (one-time
    initialisation: oneDNN primitives, allocator). CPU time, summed over threads, shows
    how much of the wall time was spent waiting for a shared core."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


# --------------------------------------------------------------------------- measurements (run in subprocesses)


def measure_forward(repeats: int) -> dict[str, Any]:
    x, t = synthetic_skull(), torch.tensor([T_STEP])
    model = _model(train=False)
    baseline = _peak_mb()
    with torch.no_grad():
        times, cpu = _timed(lambda: model(x, t), repeats)
    return {"times_s": times, "cpu_s": cpu, "baseline_rss_mb": baseline, "peak_rss_mb": _peak_mb()}


def measure_train(repeats: int) -> dict[str, Any]:
    x, t = synthetic_skull(), torch.tensor([T_STEP])
    model = _model(train=True)
    baseline = _peak_mb()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        y = model(x, t)
        (y[:, :, -N_GENERATED:] ** 2).mean().backward()  # the loss touches the generated points only

    times, cpu = _timed(step, repeats)
    return {"times_s": times, "cpu_s": cpu, "baseline_rss_mb": baseline, "peak_rss_mb": _peak_mb()}


class _Clock:
    """Exclusive wall time per op category, by wrapping the functions the model calls."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()


def measure_breakdown(repeats: int) -> dict[str, Any]:
    x, t = synthetic_skull(), torch.tensor([T_STEP])
    model = _model(train=False)
    clock = _Clock()
    clock.wrap(fps, "furthest_point_sample_indices", "furthest point sampling")
    clock.wrap(ball_query, "ball_query", "ball query")
    clock.wrap(pvcnn_blocks.SetAbstraction, "_pool_distinct", "grouping + SA MLP + max-pool")
    clock.wrap(three_nn, "three_nearest_neighbors", "3-NN search")
    clock.wrap(pvcnn_blocks.VoxelMap, "__init__", "voxel coordinates + corners")
    clock.wrap(averaging, "voxel_means", "point averaging")
    # Devoxelisation calls bags.sum_bags; 3-NN interpolation its own import of it.
    clock.wrap(bags, "sum_bags", "devoxelisation + 3-NN interpolation")
    clock.wrap(three_nn, "sum_bags", "devoxelisation + 3-NN interpolation")
    clock.wrap(pvcnn_blocks, "_conv3d", "3D convolutions")
    clock.wrap(pvcnn_blocks.Attention, "forward", "attention (voxel + global)")
    runs = []
    with torch.no_grad():
        model(x, t)
        for _ in range(repeats):
            clock.totals.clear()
            start = time.perf_counter()
            model(x, t)
            total = time.perf_counter() - start
            runs.append((total, dict(clock.totals)))
    clock.restore()
    total, parts = min(runs, key=lambda run: run[0])
    parts["everything else (MLPs, GroupNorm, SE, glue)"] = total - sum(parts.values())
    return {"total_s": total, "parts_s": parts}


def measure_reference(repeats: int) -> dict[str, Any]:
    """Fast forward once, then the reference paths, on the same weights and input."""
    x, t = synthetic_skull(), torch.tensor([T_STEP])
    model = _model(train=False)
    with torch.no_grad():
        fast_times, _ = _timed(lambda: model(x, t), max(1, repeats - 1))
        fast = model(x, t)
        ball_query.ball_query = functools.partial(ball_query.ball_query, method="dense")
        three_nn.three_nearest_neighbors = functools.partial(three_nn.three_nearest_neighbors, method="dense")
        fps.furthest_point_sample_indices = functools.partial(fps.furthest_point_sample_indices, method="torch")
        pvcnn_blocks._use_mkldnn = lambda tensor: False
        for module in model.modules():
            if isinstance(module, pvcnn_blocks.SetAbstraction):
                module.distinct_slots = False
        start = time.perf_counter()
        reference = model(x, t)
        reference_time = time.perf_counter() - start
    return {
        "fast_times_s": fast_times,
        "reference_time_s": reference_time,
        "max_abs_difference": float((fast - reference).abs().max()),
        "max_abs_output": float(reference.abs().max()),
    }


MEASUREMENTS = {
    "forward": measure_forward,
    "train": measure_train,
    "breakdown": measure_breakdown,
    "reference": measure_reference,
}


# --------------------------------------------------------------------------- driver


def _in_subprocess(name: str, threads: int, repeats: int) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--measure",
        name,
        "--threads",
        str(threads),
        "--repeats",
        str(repeats),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench/pvcnn.py: measurement {name!r} failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-reference", action="store_true", help="skip the slow reference-path forward")
    parser.add_argument("--measure", choices=sorted(MEASUREMENTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(MEASUREMENTS[args.measure](args.repeats)))
        return

    results: dict[str, Any] = {}
    for name in ("forward", "train", "breakdown") + (() if args.skip_reference else ("reference",)):
        results[name] = _in_subprocess(
            name, args.threads, args.repeats if name != "train" else max(1, args.repeats - 1)
        )

    fwd, train, parts = results["forward"], results["train"], results["breakdown"]
    print(
        f"PVCNN2 paper preset ({sum(p.numel() for p in _model(False).parameters()):,} parameters), "
        f"B=1, {N_CONDITIONING + N_GENERATED:,} points, {args.threads} torch threads"
    )
    print(machine())
    load = os.getloadavg()[0]
    print(
        f"load average when done: {load:.1f} on {os.cpu_count()} cores (other work on the machine inflates wall times)"
    )
    rows = [
        [
            "forward (eval, no grad)",
            statistics.median(fwd["times_s"]),
            min(fwd["times_s"]),
            statistics.median(fwd["cpu_s"]),
            fwd["peak_rss_mb"],
        ],
        [
            "forward + backward (train)",
            statistics.median(train["times_s"]),
            min(train["times_s"]),
            statistics.median(train["cpu_s"]),
            train["peak_rss_mb"],
        ],
    ]
    if "reference" in results:
        ref = results["reference"]
        fast = statistics.median(ref["fast_times_s"])
        rows.append(["forward, reference paths", ref["reference_time_s"], ref["reference_time_s"], math.nan, math.nan])
        ratio = ref["reference_time_s"] / fast
        results["reference"]["speedup"] = ratio
    print_table(["measurement", "median wall s", "min wall s", "median CPU s", "peak RSS MB"], rows)
    if "reference" in results:
        print(
            f"reference / fast forward, same process: {ratio:.1f}x "
            f"(max |difference| {ref['max_abs_difference']:.2e} on outputs up to {ref['max_abs_output']:.2f})"
        )
    print(f"model + input alone: {fwd['baseline_rss_mb']:.0f} MB RSS")
    print()
    total = parts["total_s"]
    share_rows = sorted(
        ([name, seconds, 100 * seconds / total] for name, seconds in parts["parts_s"].items()), key=lambda r: -r[1]
    )
    print_table([f"forward op (total {total:.2f} s)", "s", "share %"], share_rows)

    record = {
        "benchmark": "pvcnn",
        "machine": machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "load_average": load,
        "points": {"conditioning": N_CONDITIONING, "generated": N_GENERATED, "batch": 1},
        "results": results,
    }
    print(f"\nwrote {write_json('pvcnn', record)}")


if __name__ == "__main__":
    main()
