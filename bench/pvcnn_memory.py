"""Training memory of PVCNN2 (PCDiff) and the upsampler: measured peaks against the estimates.

For each network and size, one training step (forward, loss, backward, Adam step) is
measured after a first, untracked step has made Adam's state, as every step after the
first of a run sees it. The peak is taken by PyTorch's own ``MemTracker``
(``torch.distributed._tools.mem_tracker``): it follows every tensor storage that is
made and freed during the step (by the dispatcher, so it counts the same bytes on any
device) and reports the most that were live at once, split into weights,
gradients, optimizer state and activations. "Beyond the weights" is that peak less
the weights, which is what ``Task.memory_estimate`` promises.

PVCNN2: the per-sample bytes are the slope between batch 1 and batch 2; the model of
:mod:`pointforge.nn.pvcnn_memory` counts point, voxel, pair and slot elements from the
config (with the distinct points per ball measured on the same input), and the bytes
per element are fitted here (non-negative least squares over all sizes) and printed for
``BYTES_PER_ELEMENT``. The table then compares the estimate with the measured peak at
every batch. ``--checkpoint`` does all of this with PVCNN2's activation checkpointing on
and fits ``BYTES_PER_ELEMENT_CHECKPOINTED`` (the estimate with ``task.checkpoint_activations``),
under the constraint that the model meets every measured slope: least squares left the
tiny preset's per-sample bytes half below the measurement (a checkpointed step's peak is
its blocks' inputs plus one block's recomputation, which the kinds summed over the whole
network describe less well). Inputs are skull-like double shells with a noisy implant cap (as in
``bench/pvcnn.py``), scaled to half-extent 3.

Upsampler: the peak per sparse point at a few point budgets, against the task's estimate.

The tracker makes each step several times slower (it runs Python for every op); the
times it prints are not training speed. Memory is what is measured.

    python bench/pvcnn_memory.py [--threads 2] [--skip-paper]   # PVCNN2: measure, fit, table
    python bench/pvcnn_memory.py --checkpoint                   # the same, activation checkpointing on
    python bench/pvcnn_memory.py --report [--checkpoint]        # the table again from the JSON
    python bench/pvcnn_memory.py --upsampler                    # the upsampler
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import numpy as np
import torch
from scipy.optimize import linprog, nnls
from torch.distributed._tools.mem_tracker import MemTracker

from _common import RESULTS_DIR, machine, print_table, write_json
from pointforge.nn.knn import knn_graph
from pointforge.nn.losses import chamfer_distance
from pointforge.nn.pvcnn import PVCNN2
from pointforge.nn.pvcnn_memory import (
    BYTES_PER_ELEMENT,
    BYTES_PER_ELEMENT_CHECKPOINTED,
    activation_counts,
    training_step_bytes,
)
from pointforge.nn.pvops import ball_query
from pointforge.nn.upsampler import (
    UpsamplerConfig,
    build_upsampler,
    training_elements,
    training_step_bytes as upsampler_step_bytes,
)

MB = 2**20
KINDS = ("point", "voxel", "pair", "slot")


def skull_points(n: int, seed: int = 0) -> torch.Tensor:
    """``[1, 3, n]``: a skull-like double shell without its cap, then 1/10 noisy cap points."""
    g = torch.Generator().manual_seed(seed)
    n_implant = n // 10
    semi_axes = torch.tensor([1.0, 0.8, 0.87])

    def shell(count: int, in_cap: bool) -> torch.Tensor:
        chunks, have = [], 0
        while have < count:
            v = torch.randn(4 * count, 3, generator=g)
            v = v / v.norm(dim=1, keepdim=True)
            v = v[(v[:, 2] > 0.8) == in_cap]
            table = 1.0 - 0.08 * torch.randint(0, 2, (v.shape[0], 1), generator=g)
            chunks.append(v * table * semi_axes)
            have += v.shape[0]
        return torch.cat(chunks)[:count]

    skull, implant = shell(n - n_implant, False), shell(n_implant, True)
    lo, hi = skull.amin(0), skull.amax(0)
    points = (torch.cat([skull, implant]) - (lo + hi) / 2) / (float((hi - lo).max()) / 6)
    points[n - n_implant :] += 0.5 * torch.randn(n_implant, 3, generator=g)
    return points.t().unsqueeze(0).contiguous()


def peak_beyond_weights(model: torch.nn.Module, step: Callable[[], None], optimizer: torch.optim.Optimizer) -> int:
    """Peak bytes live during ``step`` less the weights (one untracked step first: Adam's state exists)."""
    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    params = sum(v for k, v in snapshot.items() if getattr(k, "value", "") == "Parameter")
    return int(snapshot["Total"] - params)


def hits_per_level(model: PVCNN2, x: torch.Tensor) -> list[float]:
    """Mean distinct points per ball at each SA level for input ``x`` (the network's own queries)."""
    seen: list[float] = []
    original = ball_query.ball_query

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        neighbors = original(*args, **kwargs)
        distinct = 1 + (neighbors[..., 1:] > neighbors[..., :-1]).sum(-1)
        seen.append(float(distinct.double().mean()))
        return neighbors

    ball_query.ball_query = counting
    try:
        with torch.no_grad():
            model(x, torch.zeros(x.shape[0], dtype=torch.long))
    finally:
        ball_query.ball_query = original
    return seen


def measure_pvcnn(preset: str, n_points: int, batches: tuple[int, ...], checkpointed: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = PVCNN2(preset, checkpoint_activations=checkpointed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    one = skull_points(n_points)
    peaks = {}
    for batch in batches:
        x = one.expand(batch, -1, -1).contiguous()
        x[:, :, : n_points // 10] += 0.01 * torch.randn(batch, 3, n_points // 10)
        t = torch.full((batch,), 500)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(x, t).square().mean().backward()
            optimizer.step()

        peaks[batch] = peak_beyond_weights(model, step, optimizer)
    hits = hits_per_level(model, one)
    counts = activation_counts(preset, n_points, hits_per_ball=hits)
    return {
        "preset": preset,
        "points": n_points,
        "checkpointed": checkpointed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_bytes": peaks,
        "per_sample_bytes": peaks[batches[1]] - peaks[batches[0]],
        "hits_per_level": hits,
        "counts": {k: getattr(counts, k) for k in KINDS},
    }


def fit(runs: list[dict[str, Any]], *, never_below: bool = False) -> dict[str, float]:
    """Bytes per element of each kind: non-negative least squares on the per-sample slopes, relative error.

    ``never_below``: the weights that meet or exceed every measured slope with the least
    total relative excess (a linear programme), for a model least squares would leave
    below some measured slopes; rounded up, so that rounding cannot undercut a measurement.
    """
    a = np.array([[run["counts"][k] for k in KINDS] for run in runs], dtype=float)
    b = np.array([run["per_sample_bytes"] for run in runs], dtype=float)
    scale = 1.0 / b  # relative residuals: a small network counts as much as the paper's
    if never_below:
        relative = a * scale[:, None]
        bounded = linprog(relative.sum(0), A_ub=-relative, b_ub=-np.ones(len(b)), bounds=[(0, None)] * len(KINDS))
        return {k: float(np.ceil(v * 10) / 10) for k, v in zip(KINDS, bounded.x)}
    w, _ = nnls(a * scale[:, None], b * scale)
    return {k: float(round(v, 1)) for k, v in zip(KINDS, w)}


def measure_upsampler(preset: str, points: tuple[int, ...]) -> dict[str, Any]:
    """Peaks of upsampler training steps on one cloud of each size (a sphere-like shell, sparse and 2x dense)."""
    torch.manual_seed(0)
    config = UpsamplerConfig.preset(preset)
    model = build_upsampler(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    peaks, edges = {}, {}
    for n in points:
        sparse = skull_points(n)[0].t().contiguous()
        dense = skull_points(config.ratio * n, seed=1)[0].t().contiguous()
        batch = torch.zeros(n, dtype=torch.long)
        edge_index = knn_graph(sparse, config.k, batch)
        edges[n] = edge_index.shape[1] / n

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            out = model(sparse, batch, edge_index)
            chamfer_distance(out.points, dense, out.batch, torch.zeros(len(dense), dtype=torch.long)).backward()
            optimizer.step()

        peaks[n] = peak_beyond_weights(model, step, optimizer)
    lo, hi = points[0], points[-1]
    return {
        "preset": preset,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_bytes": peaks,
        "edges_per_point": edges,
        "per_point_bytes": (peaks[hi] - peaks[lo]) / (hi - lo),
        "elements": training_elements(config, edges[hi]),
    }


def fit_upsampler(runs: list[dict[str, Any]]) -> tuple[float, float]:
    """(edge, node) bytes per element: non-negative least squares on the per-point slopes, relative error."""
    a = np.array([run["elements"] for run in runs], dtype=float)
    b = np.array([run["per_point_bytes"] for run in runs], dtype=float)
    w, _ = nnls(a / b[:, None], np.ones_like(b))
    return float(round(w[0], 2)), float(round(w[1], 2))


def report_upsampler(threads: int) -> dict[str, Any]:
    runs = [measure_upsampler(preset, (1000, 2000, 4000)) for preset in ("tiny", "small", "paper")]
    fitted = fit_upsampler(runs)
    print(f"\nUpsampler training step, one cloud, float32, CPU, {threads} threads")
    print(f"bytes per (edge, node) element fitted: {fitted}")
    rows = []
    for run in runs:
        config = UpsamplerConfig.preset(run["preset"])
        for n, peak in run["peak_bytes"].items():
            estimate = upsampler_step_bytes(config, int(n), parameters=run["parameters"])
            rows.append([run["preset"], n, run["edges_per_point"][n], peak / MB, estimate / MB, estimate / peak])
    print_table(["preset", "sparse points", "edges/point", "measured MB", "estimate MB", "estimate/measured"], rows)
    return {"fitted": fitted, "runs": runs}


SIZES = [("tiny", 1024), ("tiny", 4096), ("small", 3840), ("small", 7680)]


def report_pvcnn(runs: list[dict[str, Any]], threads: int) -> dict[str, float]:
    """Print the fit and the table of measured peaks against the model; return the fitted bytes per element."""
    checkpointed = bool(runs[0].get("checkpointed", False))
    fitted = fit(runs, never_below=checkpointed)
    in_use = BYTES_PER_ELEMENT_CHECKPOINTED if checkpointed else BYTES_PER_ELEMENT
    print(
        f"PVCNN2 training step, float32, CPU, {threads} threads, activation checkpointing {checkpointed}; {machine()}"
    )
    print(f"bytes per element fitted: {fitted} (in use: {in_use})")
    rows = []
    for run in runs:
        counts = activation_counts(run["preset"], run["points"], hits_per_ball=run["hits_per_level"])
        for batch, peak in run["peak_bytes"].items():
            estimate = training_step_bytes(
                run["preset"], run["points"], int(batch), parameters=run["parameters"], checkpointed=checkpointed
            )
            rows.append(
                [
                    run["preset"],
                    run["points"],
                    batch,
                    " ".join(f"{h:.1f}" for h in run["hits_per_level"]),
                    run["per_sample_bytes"] / MB,
                    counts.bytes(in_use) / MB,
                    peak / MB,
                    estimate / MB,
                    estimate / peak,
                ]
            )
    headers = ["preset", "points", "batch", "hits/ball per level", "per sample MB", "model per sample MB"]
    print_table(headers + ["peak MB", "estimate MB", "estimate/peak"], rows)
    return fitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-paper", action="store_true", help="leave out the paper preset (minutes)")
    parser.add_argument("--upsampler", action="store_true", help="measure the upsampler only")
    parser.add_argument("--report", action="store_true", help="the PVCNN2 table from the last recorded run")
    parser.add_argument("--checkpoint", action="store_true", help="PVCNN2 with activation checkpointing on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.upsampler:
        record = report_upsampler(args.threads)
        print(f"wrote {write_json('upsampler_memory', {'machine': machine(), 'threads': args.threads, **record})}")
        return
    name = "pvcnn_memory_checkpoint" if args.checkpoint else "pvcnn_memory"
    if args.report:
        record = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        report_pvcnn(record["runs"], record["threads"])
        return
    sizes = SIZES + ([] if args.skip_paper else [("paper", 30720)])
    runs = [
        measure_pvcnn(preset, n, (1, 2, 3) if preset != "paper" else (1, 2), args.checkpoint) for preset, n in sizes
    ]
    fitted = report_pvcnn(runs, args.threads)
    record = {"machine": machine(), "threads": args.threads, "load": os.getloadavg()[0], "fitted": fitted, "runs": runs}
    print(f"wrote {write_json(name, record)}")


if __name__ == "__main__":
    main()
