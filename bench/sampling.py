"""PCDiff sampling: time per case and Chamfer distance to the true implant, per sampler.

One validation case of a prepared dataset is completed with ``pointforge.implant.proposals.complete``
(the function ``pointforge generate`` calls) under DDPM-1000, DDIM-100/50/25 and
DPM-Solver++(2M) at 20 and 10 steps, with n = 1 and n = 5 proposals in one batched
pass. Every sampler runs the same network on the same case in the same process, so the
speed-up column is a ratio measured side by side; absolute seconds are context.

The network is either a trained checkpoint (``--checkpoint``; its config names the
dataset) or, by default, the ``small`` preset trained here for ``--train-steps`` steps
through the engine on the small preset's synthetic data (built on first use under
``bench/results/data/``). A few
minutes of CPU training give a network whose samples are still far from the implant:
its Chamfer column shows how the samplers behave on that network, not what PCDiff
reaches. Run with a trained checkpoint for a quality curve worth choosing from.

Every sampler's cost is its number of model calls times the cost of one call at that
batch (1 or 5 clouds); on a shared machine the wall times wander, so the table also
gives seconds per call, which should be about equal within each n.

DDPM-1000 with n = 5 is the slowest entry by far; unless ``--full-ddpm`` it is timed
over its first ``--ddpm-probe-steps`` steps and extrapolated to 1000 (marked so, with
no Chamfer value).

    python bench/sampling.py [--checkpoint runs/pcdiff/small/checkpoints/best.pt]
                             [--train-steps 100] [--threads 1] [--full-ddpm]
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _common import machine, print_table, write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pointforge.data.skulls.normalization import bbox_normalization  # noqa: E402
from pointforge.data.skulls.prepared import PreparedDataset  # noqa: E402
from pointforge.implant.proposals import complete  # noqa: E402
from pointforge.inference.pcdiff import load_pcdiff  # noqa: E402
from pointforge.nn.diffusion.samplers.registry import make_sampler  # noqa: E402
from pointforge.tasks import get_task  # noqa: E402
from pointforge.tasks.configs import load_train_config  # noqa: E402
from pointforge.tasks.pcdiff.dataset import HALF_EXTENT, ensure_prepared_dataset  # noqa: E402
from pointforge.tasks.pcdiff.task import implant_distances  # noqa: E402
from pointforge.train.engine import train  # noqa: E402

SAMPLERS = [("ddpm", None), ("ddim", 100), ("ddim", 50), ("ddim", 25), ("dpm++2m", 20), ("dpm++2m", 10)]


class _Stop(Exception):
    pass


def train_small(steps: int, run_dir: Path) -> tuple[Path, float]:
    """Train the small preset for ``steps`` steps on its synthetic data; returns the checkpoint."""
    cfg = load_train_config(
        "pcdiff",
        "small",
        [
            f"run.dir={run_dir}",
            f"task.data_root={REPO / 'bench' / 'results' / 'data' / 'pcdiff-small'}",
            f"train.max_steps={steps}",
            "train.epochs=100000",
            "train.eval_every=0",
            "train.ema_decay=null",
            "optim.lr=1e-3",
            "data.global_batch=4",
            "data.num_workers=0",
            "log.progress=off",
            "log.tensorboard=false",
            f"perf.threads={torch.get_num_threads()}",
            "ckpt.every_epochs=0",
        ],
    )
    ensure_prepared_dataset(cfg.task.data_root, cfg.task.synthetic)
    started = time.perf_counter()
    result = train(get_task("pcdiff"), cfg, console=False)
    return result.checkpoint, time.perf_counter() - started


def pick_case(root: Path, wanted: str | None):
    data = PreparedDataset(root)
    for split in ("val", "test", "train"):
        cases = data.split(split)
        if wanted is not None:
            cases = [c for c in cases if c.case_id == wanted]
        if cases:
            return data, cases[0], split
    raise SystemExit(f"no case {'named ' + wanted + ' ' if wanted else ''}with an implant in {root}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint", type=Path, help="a trained pcdiff checkpoint; default: train the small preset here"
    )
    parser.add_argument(
        "--data-root", type=Path, help="prepared dataset holding the case (default: the checkpoint config's)"
    )
    parser.add_argument("--case", help="case id (default: the first validation case)")
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ddpm-probe-steps", type=int, default=100)
    parser.add_argument("--full-ddpm", action="store_true", help="run DDPM-1000 with n = 5 in full")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def load_network(args: argparse.Namespace, record: dict):
    """The loaded PCDiff of the given checkpoint, or of the small preset trained here first."""
    if args.checkpoint is not None:
        record["network"] = f"checkpoint {args.checkpoint}"
        return load_pcdiff(args.checkpoint)
    run_dir = Path(tempfile.mkdtemp(prefix="pcdiff-bench-"))
    try:
        print(f"training the small preset for {args.train_steps} steps on synthetic data ({run_dir}) ...", flush=True)
        checkpoint, seconds = train_small(args.train_steps, run_dir)
        loaded = load_pcdiff(checkpoint)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    record["network"] = f"small preset trained here: {args.train_steps} steps, batch 4, Adam 1e-3 (undertrained)"
    record["train_s"] = round(seconds, 1)
    return loaded


def time_sampler(args, name: str, sampler, n: int, skull, model, config, distances) -> dict:
    """One sampler at ensemble size ``n``; DDPM with n > 1 is timed on its first steps and extrapolated."""
    probe = name == "ddpm" and n > 1 and not args.full_ddpm and args.ddpm_probe_steps < sampler.num_steps
    done = []

    def progress(step: int, total: int) -> None:
        done.append(step)
        if probe and step >= args.ddpm_probe_steps:
            raise _Stop

    gen = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    try:
        points = complete(skull, model, sampler, n, config=config, generator=gen, progress=progress)
    except _Stop:
        points = None
    seconds = time.perf_counter() - started
    if probe:
        seconds = seconds / done[-1] * sampler.num_steps
    cd, dist = distances(points) if points is not None else (math.nan, math.nan)
    print(f"  {name}-{sampler.num_steps} n={n}: {seconds:.1f} s{' (extrapolated)' if probe else ''}", flush=True)
    return {
        "sampler": name,
        "steps": sampler.num_steps,
        "n": n,
        "seconds_per_case": seconds,
        "extrapolated_from_steps": done[-1] if probe else None,
        "chamfer_normalised": cd,
        "mean_dist_mm": dist,
    }


def table_rows(results: list[dict], baseline: tuple[float, float]) -> list[list]:
    reference = {r["n"]: r["seconds_per_case"] for r in results if r["sampler"] == "ddpm"}
    rows = []
    for r in results:
        r["speedup_vs_ddpm"] = reference[r["n"]] / r["seconds_per_case"]
        r["seconds_per_model_call"] = r["seconds_per_case"] / r["steps"]
        rows.append(
            [
                f"{r['sampler']}-{r['steps']}",
                r["n"],
                r["steps"],
                f"{r['seconds_per_case']:.1f}"
                + (f" (extrap. from {r['extrapolated_from_steps']} steps)" if r["extrapolated_from_steps"] else ""),
                f"{r['seconds_per_model_call']:.3f}",
                f"{r['speedup_vs_ddpm']:.0f}x",
                "—" if math.isnan(r["chamfer_normalised"]) else f"{r['chamfer_normalised']:.4g}",
                "—" if math.isnan(r["mean_dist_mm"]) else f"{r['mean_dist_mm']:.2f}",
            ]
        )
    rows.append(["random points in the skull's box", 1, "—", "—", "—", "—", f"{baseline[0]:.4g}", f"{baseline[1]:.2f}"])
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    record: dict = {"machine": machine(), "threads": args.threads, "torch": torch.__version__}
    loaded = load_network(args, record)
    model, schedule, config = loaded.model, loaded.schedule, loaded.config
    root = args.data_root or Path(config.data_root)
    data, case, split = pick_case(root, args.case)
    skull = np.asarray(data.points(case.defective), dtype=np.float64)
    implant_all = np.asarray(data.points(case.implant), dtype=np.float32)
    pick = np.random.default_rng(args.seed).choice(
        len(implant_all), size=min(len(implant_all), config.n_implant), replace=False
    )
    true = torch.from_numpy(implant_all[np.sort(pick)])[None]  # voxel coordinates
    spacing = torch.tensor([data.meta(case.defective)["spacing"]], dtype=torch.float32)
    voxels_per_unit = bbox_normalization(skull, HALF_EXTENT).scale  # normalised → voxel
    record.update(
        case=case.case_id,
        split=split,
        n_skull=config.n_skull,
        n_implant=config.n_implant,
        preset=config.model,
        timesteps=config.diffusion.timesteps,
        skull_points=len(skull),
    )
    print(f"{machine()}; {args.threads} thread(s)")
    print(
        f"case {case.case_id} ({split}) of {root}: {len(skull)} skull points → {config.n_skull} + {config.n_implant} sampled; "
        f"PVCNN2 {config.model}, T = {config.diffusion.timesteps}",
        flush=True,
    )

    def distances(points: np.ndarray) -> tuple[float, float]:
        pred = torch.from_numpy(points)
        found = implant_distances(
            pred, true.expand(len(pred), -1, -1), scale=torch.ones(len(pred)), spacing=spacing.expand(len(pred), -1)
        )
        normalised = found["chamfer_mm2"] / (voxels_per_unit**2 * spacing[0].pow(2).mean())
        return float(normalised.mean()), float(found["mean_dist_mm"].mean())

    lo, hi = skull.min(0), skull.max(0)
    uniform = (lo + (hi - lo) * np.random.default_rng(args.seed).random((1, config.n_implant, 3))).astype(np.float32)
    baseline = distances(uniform)
    results = [
        time_sampler(args, name, make_sampler(name, steps, schedule=schedule), n, skull, model, config, distances)
        for name, steps in SAMPLERS
        for n in (1, 5)
    ]
    rows = table_rows(results, baseline)
    print()
    print(f"network: {record['network']}")
    print_table(
        [
            "sampler",
            "n",
            "model calls",
            "s per case",
            "s per call",
            "speed-up vs DDPM",
            "Chamfer (normalised)",
            "mean dist (mm)",
        ],
        rows,
    )
    record["results"] = results
    record["baseline_random_in_box"] = {"chamfer_normalised": baseline[0], "mean_dist_mm": baseline[1]}
    path = write_json("sampling", record)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
