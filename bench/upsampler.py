"""Upsampler on the CPU: inference on a 100k-point cloud; point-budget vs fixed-count batches.

1. Inference: one synthetic lidar tile of ``--infer-points`` sparse points
   (default 100k), per model preset: kNN graph (KD-tree), normalisation, forward
   pass in eval mode without gradients, and the process's peak memory.
2. Training throughput (forward + Chamfer loss + backward, a plain loop, no
   engine): ``--clouds`` clouds whose sizes spread log-uniformly from ``--min``
   to ``--max`` points, batched once by a point budget (``--budget`` points per
   batch, :class:`PointBudgetBatchSampler`) and once by a fixed number of
   clouds per batch, chosen to give the same number of batches. Both see the
   same clouds in one epoch; reported are input points per second, the
   largest batch in points and the peak resident memory. The two schemes run
   in ``--rounds`` interleaved rounds and the fastest round of each is kept.

3. The same comparison through the training engine (``pointforge train
   upsampler``: DataLoader, collate, forward, Chamfer, backward, Adam step,
   the engine's per-step bookkeeping), on the same sizes written as a pair set
   (``write_synthetic_pairs``) and read from disk: ``task.batching=budget``
   (:class:`PointBudgetBatchSampler` through the task's ``batch_sampler`` hook,
   ``--budget`` points per batch) against ``task.batching=count`` (the
   engine's own sampler, a fixed number of clouds per batch, the same number
   as in part 2). ``--epochs`` epochs are run; the first is a warm-up (PyG
   code generation, kNN graphs computed and cached) and is not counted.
   Throughput = input points of the counted epochs / the engine's own step
   times (data loading included, logged every step). Peak memory is the
   process's ``ru_maxrss`` at the end of the run; "baseline" is its peak after
   the imports, before ``train()``.

Every measurement runs in a fresh subprocess, so that each peak memory
(``ru_maxrss``) belongs to that measurement alone; "baseline" is the peak
after the data were built (part 3: after the imports) and before the measured
work started.

    python bench/upsampler.py [--parts inference,plain,engine] [--presets tiny,small] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _common import machine, print_table, write_json
from pointforge.data.batching import PointBudgetBatchSampler, collate_pairs
from pointforge.data.pairs import CloudPair, pair_normalization, spread_sizes, synthetic_pair, write_synthetic_pairs
from pointforge.nn.knn import knn_graph
from pointforge.nn.losses import chamfer_distance
from pointforge.nn.upsampler import build_upsampler

HERE = Path(__file__).resolve()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def make_pair(n: int, seed: int, index: int, k: int = 10) -> CloudPair:
    sparse, dense = synthetic_pair(n, seed=seed)
    edges = knn_graph(torch.from_numpy(sparse - sparse.min(axis=0)), k)
    norm = pair_normalization(sparse, "spacing", edges.numpy())
    return CloudPair(
        sparse=torch.from_numpy(norm.apply(sparse)),
        dense=torch.from_numpy(norm.apply(dense)),
        edge_index=edges,
        center=norm.center,
        scale=norm.scale,
        pair_id=f"c{index}",
        index=index,
    )


# --------------------------------------------------------------------------- workers (one per subprocess)


def worker_inference(args) -> dict:
    torch.manual_seed(0)
    model = build_upsampler(args.preset).eval()
    sparse, _ = synthetic_pair(args.infer_points, seed=1)
    base = peak_rss_mb()
    start = time.perf_counter()
    edges = knn_graph(torch.from_numpy(sparse - sparse.min(axis=0)), model.config.k)
    graph_s = time.perf_counter() - start
    norm = pair_normalization(sparse, "spacing", edges.numpy())
    pos = torch.from_numpy(norm.apply(sparse))
    norm_s = time.perf_counter() - start - graph_s
    with torch.no_grad():
        model(pos[:2000], None, knn_graph(pos[:2000], model.config.k))  # warm-up: PyG builds its propagate code once
        forward = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = model(pos, None, edges)
            forward.append(time.perf_counter() - t)
    result = norm.inverse(out.points)
    assert result.shape == (model.config.ratio * len(sparse), 3)
    return {
        "preset": args.preset,
        "points_in": len(sparse),
        "points_out": len(result),
        "edges": int(edges.shape[1]),
        "parameters": sum(p.numel() for p in model.parameters()),
        "graph_s": graph_s,
        "normalise_s": norm_s,
        "forward_s": min(forward),
        "total_s": graph_s + norm_s + min(forward),
        "baseline_rss_mb": base,
        "peak_rss_mb": peak_rss_mb(),
    }


def fixed_count_batches(n: int, per_batch: int, seed: int) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(n).tolist()
    return [order[i : i + per_batch] for i in range(0, n, per_batch)]


def worker_train(args) -> dict:
    sizes = spread_sizes(args.clouds, args.min, args.max, seed=0)
    items = [make_pair(n, seed=100 + i, index=i) for i, n in enumerate(sizes)]
    budget = PointBudgetBatchSampler(np.array(sizes), args.budget, seed=0)
    budget_batches = list(budget)
    per_batch = math.ceil(len(sizes) / len(budget_batches))
    batches = budget_batches if args.scheme == "budget" else fixed_count_batches(len(sizes), per_batch, seed=0)
    torch.manual_seed(0)
    model = build_upsampler(args.preset).train()
    warm = collate_pairs([make_pair(500, seed=1, index=0)])
    model(warm.sparse, warm.sparse_batch, warm.edge_index).points.sum().backward()  # PyG code generation, once
    model.zero_grad(set_to_none=True)
    base = peak_rss_mb()
    step_s, batch_points = [], []
    for indices in batches:
        batch = collate_pairs([items[i] for i in indices])
        t = time.perf_counter()
        out = model(batch.sparse, batch.sparse_batch, batch.edge_index)
        loss = chamfer_distance(out.points, batch.dense, out.batch, batch.dense_batch, num_clouds=batch.num_clouds)
        loss.backward()
        model.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t)
        batch_points.append(batch.num_points)
    total = sum(batch_points)
    return {
        "scheme": args.scheme,
        "preset": args.preset,
        "clouds": len(sizes),
        "sizes": sizes,
        "batches": len(batches),
        "clouds_per_batch": per_batch if args.scheme == "fixed" else None,
        "budget": args.budget if args.scheme == "budget" else None,
        "points": total,
        "seconds": sum(step_s),
        "points_per_s": total / sum(step_s),
        "max_batch_points": max(batch_points),
        "slowest_step_s": max(step_s),
        "baseline_rss_mb": base,
        "peak_rss_mb": peak_rss_mb(),
    }


def worker_engine(args) -> dict:
    from pointforge.tasks import get_task
    from pointforge.tasks.configs import load_train_config
    from pointforge.train.engine import train

    base = peak_rss_mb()
    run_dir = Path(args.run_dir)
    overrides = [
        f"run.dir={run_dir}", "run.device=cpu", f"train.epochs={args.epochs}", "train.eval_every=0",
        f"data.global_batch={args.per_batch if args.scheme == 'fixed' else args.clouds}",
        "optim.name=adam", "optim.lr=1e-3", "sched.name=constant", f"perf.threads={args.threads}",
        "ckpt.every_epochs=0", "ckpt.every_minutes=0", "log.every_steps=1", "log.tensorboard=false",
        "log.csv=false", "log.progress=off", f"task.preset={args.preset}", f"task.data_root={args.data}",
        "task.val_fraction=0", f"task.batching={'budget' if args.scheme == 'budget' else 'count'}",
        f"task.max_points={args.budget}",
    ]  # fmt: skip
    cfg = load_train_config("upsampler", None, overrides)
    result = train(get_task("upsampler"), cfg, console=False)
    peak = peak_rss_mb()
    status = json.loads((run_dir / "run.json").read_text())
    per_epoch = int(status["steps_per_epoch"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/it_per_s" in r and r["step"] > per_epoch]  # epoch 0 is the warm-up
    seconds = sum(1.0 / r["train/it_per_s"] for r in steps)
    points = sum(r["train/points"] for r in steps)  # one micro-batch per step: the step's points
    return {
        "scheme": args.scheme,
        "preset": args.preset,
        "clouds": args.clouds,
        "steps_per_epoch": per_epoch,
        "clouds_per_batch": args.per_batch if args.scheme == "fixed" else None,
        "budget": args.budget if args.scheme == "budget" else None,
        "epochs_timed": args.epochs - 1,
        "points": int(points),
        "seconds": seconds,
        "points_per_s": points / seconds,
        "max_batch_points": int(max(r["train/points"] for r in steps)),
        "slowest_step_s": max(1.0 / r["train/it_per_s"] for r in steps),
        "data_wait_frac": sum(r["train/data_wait_frac"] / r["train/it_per_s"] for r in steps) / seconds,
        "final_loss": result.metrics.get("train/loss"),
        "baseline_rss_mb": base,
        "peak_rss_mb": peak,
    }


# --------------------------------------------------------------------------- driver


def run_worker(kind: str, common: list[str], extra: list[str]) -> dict:
    cmd = [sys.executable, str(HERE), "--worker", kind, *common, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"benchmark worker failed: {' '.join(cmd)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="inference,plain,engine", help="which parts to run (default all three)")
    parser.add_argument("--presets", default="tiny,small", help="model presets for inference (default tiny,small)")
    parser.add_argument("--infer-points", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=2, help="timed inference passes; best is kept")
    parser.add_argument("--train-preset", default="small")
    parser.add_argument("--clouds", type=int, default=16)
    parser.add_argument("--min", type=int, default=1_000)
    parser.add_argument("--max", type=int, default=50_000)
    parser.add_argument("--budget", type=int, default=64_000, help="points per batch for the point-budget scheme")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved training rounds per scheme; best is kept")
    parser.add_argument("--epochs", type=int, default=2, help="engine runs: epochs per run, the first one untimed")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: the reference machine is shared)"
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run (20k points, 6 clouds up to 8k)")
    parser.add_argument("--worker", choices=["inference", "train", "engine"], help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--scheme", choices=["budget", "fixed"], help=argparse.SUPPRESS)
    parser.add_argument("--per-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    return parser


def bench_inference(args, common: list[str], record: dict) -> None:
    inference = [run_worker("inference", common, ["--preset", p]) for p in args.presets.split(",")]
    print(f"\ninference, one cloud of {args.infer_points} points (best of {args.repeats} forward passes):")
    print_table(
        ["preset", "params", "edges", "graph s", "forward s", "total s", "out pts/s", "peak MB", "baseline MB"],
        [[r["preset"], r["parameters"], r["edges"], r["graph_s"], r["forward_s"], r["total_s"],
          r["points_out"] / r["total_s"], r["peak_rss_mb"], r["baseline_rss_mb"]] for r in inference],
    )  # fmt: skip
    record["inference"] = inference


def bench_plain(args, common: list[str], record: dict) -> None:
    # Interleaved rounds, best kept per scheme: a shared machine's load drifts over minutes.
    rounds = {"budget": [], "fixed": []}
    for _ in range(args.rounds):
        for scheme in rounds:
            rounds[scheme].append(run_worker("train", common, ["--preset", args.train_preset, "--scheme", scheme]))
    budget, fixed = _best_of(rounds)
    print(
        f"\ntraining step, plain loop (forward + Chamfer + backward), preset {args.train_preset}, {budget['clouds']} clouds of "
        f"{args.min}..{args.max} points ({budget['points']} in all), {budget['batches']} budget batches vs {fixed['batches']} fixed:"
    )
    _training_table(args, [budget, fixed])
    record["training"] = [budget, fixed]
    record["ratios"] = _ratios(budget, fixed)
    print("ratios (budget / fixed): " + ", ".join(f"{k} {v:.3f}" for k, v in record["ratios"].items()))


def bench_engine(args, common: list[str], record: dict, sizes: list[int]) -> None:
    per_batch = math.ceil(len(sizes) / len(PointBudgetBatchSampler(np.array(sizes), args.budget, seed=0)))
    work = Path(tempfile.mkdtemp(prefix="pointforge-bench-upsampler-"))
    try:
        write_synthetic_pairs(work / "data", sizes, seed=0)
        rounds = {"budget": [], "fixed": []}
        for n in range(args.rounds):
            for scheme in rounds:
                extra = ["--preset", args.train_preset, "--scheme", scheme, "--per-batch", str(per_batch),
                         "--epochs", str(args.epochs), "--data", str(work / "data"), "--run-dir", str(work / f"run-{scheme}-{n}")]  # fmt: skip
                rounds[scheme].append(run_worker("engine", common, extra))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    budget, fixed = _best_of(rounds)
    print(
        f"\ntraining through the engine (pointforge train upsampler), preset {args.train_preset}, {len(sizes)} clouds of "
        f"{args.min}..{args.max} points, {args.epochs - 1} timed epoch(s) after a warm-up epoch; "
        f"{budget['steps_per_epoch']} budget steps vs {fixed['steps_per_epoch']} fixed steps per epoch:"
    )
    _training_table(args, [budget, fixed])
    record["engine_training"] = [budget, fixed]
    record["engine_ratios"] = _ratios(budget, fixed)
    print("ratios (budget / fixed): " + ", ".join(f"{k} {v:.3f}" for k, v in record["engine_ratios"].items()))


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.quick:
        args.infer_points, args.clouds, args.max, args.budget, args.repeats, args.rounds = (
            20_000,
            6,
            8_000,
            10_000,
            1,
            1,
        )
    torch.set_num_threads(args.threads)

    if args.worker:
        result = {"inference": worker_inference, "train": worker_train, "engine": worker_engine}[args.worker](args)
        print(json.dumps(result))
        return
    parts = set(args.parts.split(","))
    if parts - {"inference", "plain", "engine"}:
        parser.error(
            f"unknown part(s) {sorted(parts - {'inference', 'plain', 'engine'})}; choose from inference, plain, engine"
        )

    common = [
        "--infer-points", str(args.infer_points), "--repeats", str(args.repeats), "--clouds", str(args.clouds),
        "--min", str(args.min), "--max", str(args.max), "--budget", str(args.budget), "--threads", str(args.threads),
    ]  # fmt: skip
    print(f"machine: {machine()}; torch {torch.__version__}, {args.threads} thread(s)")
    record: dict = {"machine": machine(), "torch": torch.__version__, "threads": args.threads}
    if "inference" in parts:
        bench_inference(args, common, record)
    if "plain" in parts:
        bench_plain(args, common, record)
    if "engine" in parts:
        bench_engine(args, common, record, spread_sizes(args.clouds, args.min, args.max, seed=0))
    path = write_json("upsampler", record)
    print(f"wrote {path}")


def _best_of(rounds: dict[str, list[dict]]) -> tuple[dict, dict]:
    best = {s: min(runs, key=lambda r: r["seconds"] / max(r["points"], 1)) for s, runs in rounds.items()}
    for scheme, runs in rounds.items():
        best[scheme]["seconds_all_rounds"] = [r["seconds"] for r in runs]
    return best["budget"], best["fixed"]


def _training_table(args, rows: list[dict]) -> None:
    print_table(
        ["batching", "points/s", "points", "seconds (rounds)", "largest batch pts", "slowest step s", "peak MB", "baseline MB"],
        [[f"budget {args.budget} pts" if r["scheme"] == "budget" else f"fixed {r['clouds_per_batch']} clouds",
          r["points_per_s"], r["points"], " / ".join(f"{v:.1f}" for v in r["seconds_all_rounds"]), r["max_batch_points"],
          r["slowest_step_s"], r["peak_rss_mb"], r["baseline_rss_mb"]] for r in rows],
    )  # fmt: skip


def _ratios(budget: dict, fixed: dict) -> dict[str, float]:
    return {
        "throughput_budget_over_fixed": budget["points_per_s"] / fixed["points_per_s"],
        "peak_budget_over_fixed": budget["peak_rss_mb"] / fixed["peak_rss_mb"],
        "peak_growth_budget_over_fixed": (budget["peak_rss_mb"] - budget["baseline_rss_mb"])
        / max(fixed["peak_rss_mb"] - fixed["baseline_rss_mb"], 1e-9),
        "largest_batch_budget_over_fixed": budget["max_batch_points"] / fixed["max_batch_points"],
    }


if __name__ == "__main__":
    main()
