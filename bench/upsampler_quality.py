"""Upsampler quality on held-out synthetic lidar pairs: a trained model against geometric baselines.

The held-out pairs are synthetic airborne-lidar tiles (terrain, tree crowns,
buildings on the larger tiles; :func:`pointforge.data.pairs.scenes.synthetic_pair`)
drawn from ``--seed`` (default 1000), which the training presets never use
(``pointforge/configs/upsampler/*.yaml`` draw their pairs from seed 0), with sizes spread
log-uniformly over ``--min``..``--max`` sparse points. Every method turns each
sparse cloud into exactly r·N points and is scored by
:func:`pointforge.upsampling.evaluate.evaluate_upsampling` (Chamfer,
Hausdorff, point-to-surface, uniformity, in metres): the trained model, the
sparse input repeated r times, k-NN edge midpoints and a local-plane fit
(:mod:`pointforge.upsampling.baselines`); the dense truth's own
uniformity is the floor. A model whose children start on the local planes
(``task.model.start: plane``) is also scored at its start (``start``: the
same network with its output heads zeroed, i.e. the geometric upsampler it
learns a correction to), so what the training adds shows apart from it.

The model comes from ``--run DIR`` (an existing ``pointforge train upsampler``
run: ``DIR/checkpoints/best.pt``; training minutes = its run.json's wall time)
or ``--train CONFIG`` (trains it here first, in a subprocess, and also records
the training's CPU minutes).

    python bench/upsampler_quality.py --train pointforge/configs/upsampler/small.yaml [--set train.epochs=25]
    python bench/upsampler_quality.py --run runs/upsampler/small
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import machine, print_table, write_json
from pointforge.data.pairs.manifest import read_manifest
from pointforge.data.pairs.scenes import spread_sizes, write_synthetic_pairs
from pointforge.data.pointio import read_points, write_points
from pointforge.inference.upsampler import LoadedUpsampler, load_upsampler
from pointforge.nn.upsampler import NodeShuffleUpsampler
from pointforge.upsampling.baselines import BASELINES, upsample_baseline
from pointforge.upsampling.evaluate import COLUMNS, evaluate_upsampling
from pointforge.upsampling.pipeline import upsample_points

REPO = Path(__file__).resolve().parent.parent


def train(config: str, run_dir: Path, overrides: list[str]) -> dict:
    """Train in a subprocess; wall and CPU minutes (this process's children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pointforge",
            "train",
            "upsampler",
            "--config",
            config,
            f"run.dir={run_dir}",
            *overrides,
        ],
        check=True,
        cwd=REPO,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_minutes": (time.perf_counter() - start) / 60, "cpu_minutes": cpu / 60}


def run_minutes(run_dir: Path) -> dict:
    info = json.loads((run_dir / "run.json").read_text())
    return {"wall_minutes": (info["updated_at"] - info["started_at"]) / 60, "cpu_minutes": None}


def start_of(upsampler: LoadedUpsampler) -> NodeShuffleUpsampler:
    """The network with its coarse and fine offset heads zeroed: its output is where its children start."""
    net = copy.deepcopy(upsampler.model)
    for head in (net.coarse, net.decode[-1][-1]):
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    return net


def predict_all(root: Path, ckpt: Path, threads: int) -> dict[str, Path]:
    """Write every method's r·N points per held-out pair under ``root/pred/<method>/``; the folders."""
    torch.set_num_threads(threads)
    upsampler = load_upsampler(ckpt, "cpu")
    networks = {"model": upsampler}
    if upsampler.model.config.start != "input":
        networks["start"] = start_of(upsampler)
    folders = {m: root / "pred" / m for m in (*networks, *BASELINES)}
    seconds = dict.fromkeys(folders, 0.0)
    for entry in read_manifest(root / "pairs.csv"):
        sparse = read_points(entry.sparse).xyz
        for method, folder in folders.items():
            t = time.perf_counter()
            if method in networks:
                dense = upsample_points(networks[method], sparse, normalization=upsampler.normalization)
            else:
                dense = upsample_baseline(method, sparse, upsampler.ratio)
            seconds[method] += time.perf_counter() - t
            write_points(folder / f"{entry.pair_id}.npy", dense)
    print("seconds to upsample all pairs: " + ", ".join(f"{m} {s:.1f}" for m, s in seconds.items()))
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, help="existing upsampler run dir (uses checkpoints/best.pt)")
    source.add_argument("--train", help="train this config first, e.g. pointforge/configs/upsampler/small.yaml")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--min", type=int, default=2_000)
    parser.add_argument("--max", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1000, help="held-out seed (the presets train on seed 0)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="keep the pairs and predictions in this folder")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for --train (key=value)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pf-quality-") as tmp:
        root = args.keep or Path(tmp)
        if args.train:
            run_dir = root / "run"
            minutes = train(args.train, run_dir, args.set)
        else:
            run_dir, minutes = args.run, run_minutes(args.run)
        sizes = spread_sizes(args.pairs, args.min, args.max, seed=args.seed)
        write_synthetic_pairs(root / "heldout", sizes, seed=args.seed)
        folders = predict_all(root / "heldout", run_dir / "checkpoints" / "best.pt", args.threads)
        results = {m: evaluate_upsampling(f, root / "heldout" / "dense") for m, f in folders.items()}

    rows = [[m, *(r.summary[c]["mean"] for c in COLUMNS[:-1])] for m, r in results.items()]
    rows.append(["dense truth (floor)", None, None, None, results["model"].summary["truth_uniformity"]["mean"]])
    print(f"machine: {machine()}; {args.pairs} held-out pairs (seed {args.seed}), {args.min}..{args.max} sparse points")
    print(f"training: {minutes}")
    print_table(["method", "Chamfer m²", "Hausdorff m", "P2S m", "uniformity CV"], rows)
    per_pair = {m: r.rows for m, r in results.items()}
    record = {
        "machine": machine(),
        "torch": torch.__version__,
        "run": str(run_dir),
        "training": minutes,
        "overrides": args.set,
        "heldout": {"pairs": args.pairs, "min": args.min, "max": args.max, "seed": args.seed, "sizes": sizes},
        "summary": {m: r.summary for m, r in results.items()},
        "pairs": per_pair,
    }
    print(f"wrote {write_json('upsampler_quality', record)}")


if __name__ == "__main__":
    main()
