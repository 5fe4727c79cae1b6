"""PCDiff training step of the demo recipe on CPU: seconds per step and steps per second.

The workload is one optimizer step of ``pointforge/configs/pcdiff/demo.yaml`` (PVCNN2 ``tiny``,
1536 skull + 256 implant points, batch 4, Adam, one torch thread): forward, diffusion
loss, backward, Adam step, zero_grad. Data loading (the task's dataset and collate, as
the engine's loader runs them with ``num_workers: 0``) is timed separately. Two recipes:
the demo as configured, and the demo with ``task.condition_mark=true`` and
``task.frame.scale=0.5`` (one more input channel; the dataset reads every skull point
and crops around the implant).

Side by side in one process, interleaved step by step (the order rotating) on models
with the same initial weights, the same batches and the same t and noise, the step runs
with the engine's Adam (``current``) and with ``torch.optim.Adam(..., foreach=True)``,
the multi-tensor step (what ``train/schedule.py`` could pass; measured here, not used by
the engine yet).

The before/after table of the step's earlier cuts (the SA levels' GroupNorm for all batch
elements at once, the scatter-add backward of devoxelisation and 3-NN interpolation,
channels-last grids for oneDNN's 3D convolutions) is historical: it was measured in
2026-11 with switches that kept the old paths selectable, and is kept in
docs/benchmarks.md. The switches are gone; two of the old paths (the per-element GroupNorm
loop, embedding_bag's own backward) live on as test oracles
(tests/nn/oracles.py).

The machine may be shared: each path's median of interleaved steps, wall and process CPU
time, and their ratio are the point; absolute times are context. CPU time (one thread)
is the better measure when other jobs compete for the cores.

    python bench/pcdiff_step.py [--repeats 12] [--data PREPARED_ROOT] [--recipe demo|mark_frame|both]

Without ``--data`` a synthetic demo dataset (10 skulls at 64^3, as ``make demo``
builds) is made in a temporary folder first (~10 s).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from _common import machine, print_table, write_json
from pointforge.config.coercion import from_dict
from pointforge.tasks.pcdiff.config import PCDiffConfig
from pointforge.tasks.pcdiff.task import PCDiffTask

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "pointforge" / "configs" / "pcdiff" / "demo.yaml"

RECIPES: dict[str, dict[str, Any]] = {
    "demo": {},
    "mark_frame": {"condition_mark": True, "frame": {"scale": 0.5}},
}

# Adam options per path; the first is the engine's.
PATH_ADAM: dict[str, dict[str, Any]] = {"current": {}, "+ Adam foreach": {"foreach": True}}
FOREACH = "+ Adam foreach"


def demo_dataset(folder: Path) -> Path:
    from pointforge.data.prepare import prepare_dataset
    from pointforge.data.synthetic.dataset import synthesize

    synthesize(str(folder / "raw"), 10, 64, 0, layout="skullbreak")
    prepare_dataset(
        str(folder / "raw"), str(folder / "prepared"), n_points=16384, seed=0, split="0.6,0.2,0.2", workers=1
    )
    return folder / "prepared"


def task_config(data_root: Path, overrides: dict[str, Any]) -> tuple[PCDiffConfig, dict[str, Any]]:
    full = yaml.safe_load(DEMO_CONFIG.read_text())
    section = {**full["task"], **overrides, "data_root": str(data_root), "val_split": None}
    return from_dict(PCDiffConfig, section, prefix="task"), full


def measure_recipe(name: str, data_root: Path, repeats: int) -> dict[str, Any]:
    cfg, full = task_config(data_root, RECIPES[name])
    task = PCDiffTask()
    task.configure(cfg)
    train_ds, _ = task.build_datasets(cfg)
    batch = int(full["data"]["global_batch"])
    loader = torch.utils.data.DataLoader(
        train_ds,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        collate_fn=task.collate,
        generator=torch.Generator().manual_seed(0),
    )

    # Data loading, as the engine's single-process loader does it.
    batches, data_wall, data_cpu = [], [], []
    iterator = iter(loader)
    while len(batches) < 8:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            item = next(iterator)
        except StopIteration:
            iterator = iter(loader)
            continue
        data_wall.append(time.perf_counter() - wall)
        data_cpu.append(time.process_time() - cpu)
        batches.append(item)

    torch.manual_seed(0)
    base = task.build_model(cfg).train()
    optim = full["optim"]
    models, optimizers = {}, {}
    for path in PATH_ADAM:
        models[path] = copy.deepcopy(base)
        optimizers[path] = torch.optim.Adam(
            models[path].parameters(), lr=float(optim["lr"]), betas=tuple(optim["betas"]), **PATH_ADAM[path]
        )

    def step(path: str, item: dict[str, Any]) -> float:
        model, optimizer = models[path], optimizers[path]
        loss = task.training_step(model, item, None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    times: dict[str, dict[str, list[float]]] = {p: {"wall": [], "cpu": []} for p in PATH_ADAM}
    losses: dict[str, list[float]] = {p: [] for p in PATH_ADAM}
    paths = list(PATH_ADAM)
    for r in range(repeats + 2):  # two warm-up rounds (oneDNN primitives, allocator)
        item = batches[r % len(batches)]
        for path in paths[r % len(paths) :] + paths[: r % len(paths)]:  # rotate who goes first
            torch.manual_seed(1000 + r)  # the same t and noise for every path
            wall, cpu = time.perf_counter(), time.process_time()
            loss = step(path, item)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            losses[path].append(loss)
            if r >= 2:
                times[path]["wall"].append(wall)
                times[path]["cpu"].append(cpu)
    return {
        "recipe": name,
        "overrides": RECIPES[name],
        "parameters": sum(p.numel() for p in base.parameters()),
        "data_wall_s": data_wall,
        "data_cpu_s": data_cpu,
        "step": times,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=12, help="timed steps per path (after 2 warm-up rounds)")
    parser.add_argument(
        "--data", type=Path, help="a prepared dataset (default: synthesise the demo's into a temporary folder)"
    )
    parser.add_argument("--recipe", choices=[*RECIPES, "both"], default="both")
    args = parser.parse_args()
    torch.set_num_threads(1)  # perf.threads in the demo recipe

    recipes = list(RECIPES) if args.recipe == "both" else [args.recipe]
    with tempfile.TemporaryDirectory(prefix="pcdiff_step_") as scratch:
        data_root = args.data if args.data is not None else demo_dataset(Path(scratch))
        results = [measure_recipe(name, data_root, args.repeats) for name in recipes]

    print(
        f"PCDiff demo training step (PVCNN2 tiny, batch 4, 1536 + 256 points, Adam), 1 torch thread, "
        f"{args.repeats} interleaved steps per path"
    )
    print(machine())
    load = os.getloadavg()[0]
    print(
        f"load average when done: {load:.1f} on {os.cpu_count()} cores (other work inflates wall times; CPU time less so)"
    )
    rows = []
    for res in results:

        def med(p: str, k: str) -> float:
            return statistics.median(res["step"][p][k])

        for path in PATH_ADAM:
            rows.append(
                [
                    res["recipe"],
                    path,
                    med(path, "wall"),
                    1 / med(path, "wall"),
                    med(path, "cpu"),
                    1 / med(path, "cpu"),
                    med("current", "cpu") / med(path, "cpu"),
                ]
            )
        res["cpu_speedup"] = med("current", "cpu") / med(FOREACH, "cpu")
        res["wall_speedup"] = med("current", "wall") / med(FOREACH, "wall")
        res["data_cpu_s_per_batch"] = statistics.median(res["data_cpu_s"])
        rows.append(
            [
                res["recipe"],
                "data loading (per batch)",
                statistics.median(res["data_wall_s"]),
                float("nan"),
                res["data_cpu_s_per_batch"],
                float("nan"),
                float("nan"),
            ]
        )
    print_table(
        ["recipe", "path", "wall s/step", "steps/s (wall)", "CPU s/step", "steps/s (CPU)", "speed-up (CPU)"], rows
    )
    for res in results:
        print(
            f"{res['recipe']}: Adam foreach speed-up over current = {res['cpu_speedup']:.2f}x CPU time, {res['wall_speedup']:.2f}x wall time "
            f"(median of {args.repeats}); first losses "
            + ", ".join(f"{p} {res['losses'][p][0]:.5f}" for p in PATH_ADAM)
        )

    record = {
        "benchmark": "pcdiff_step",
        "machine": machine(),
        "torch": torch.__version__,
        "threads": 1,
        "load_average": load,
        "repeats": args.repeats,
        "paths": {p: {"adam": PATH_ADAM[p]} for p in PATH_ADAM},
        "results": results,
    }
    print(f"\nwrote {write_json('pcdiff_step', record)}")


if __name__ == "__main__":
    main()
