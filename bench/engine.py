"""Training-engine benchmarks: overhead against a bare loop, and 1 vs 2 gloo ranks.

1. Overhead. The same toy model, data, optimizer (Adam) and schedule (cosine),
   trained by a hand-written loop (DataLoader, forward, backward, step,
   ``loss.item()``) and by ``pointforge.train.engine.train`` (with its
   per-step all-reduce-free single-process path, metrics files, run.json and
   a checkpoint at every epoch end). Runs alternate, medians are compared.
   Target: ≤ 5 % overhead.
2. Data parallel on CPU. The same run under torchrun with 1 and 2 gloo ranks
   (global batch fixed), throughput from the engine's own step timing
   (evaluation and checkpoint pauses excluded). On a 2-core machine no
   speed-up is expected; the row exists to compare against bigger machines.

Usage: ``python bench/engine.py [--repeats 5] [--skip-dist]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from _common import machine, print_table, write_json  # noqa: E402
from pointforge.tasks.configs import load_train_config  # noqa: E402
from pointforge.tasks.toy import ToyTask  # noqa: E402
from pointforge.train.data import derive_seed, seed_everything  # noqa: E402
from pointforge.train.engine import train  # noqa: E402
from pointforge.train.schedule import lr_factor  # noqa: E402
from pointforge.train.torchrun import torchrun_command, worker_args, worker_environment  # noqa: E402

TINY = REPO / "pointforge" / "configs" / "toy" / "tiny.yaml"
COMMON = [
    "task.n_train=8192",
    "task.n_val=0",
    "data.global_batch=32",
    "train.eval_every=0",
    "sched.name=cosine",
    "sched.warmup_steps=10",
    "ckpt.every_epochs=0",
    "ckpt.every_minutes=0",
    "log.every_steps=50",
    "log.tensorboard=false",
    "log.progress=off",
    "perf.threads=1",
]
# "small": a few milliseconds of compute per step, the regime the target is
# about; "tiny": so little compute that any per-step cost shows.
WORKLOADS = {
    "small": [*COMMON, "task.n_points=256", "task.hidden=64"],
    "tiny": [*COMMON, "task.n_points=32", "task.hidden=32"],
}
STEPS_PER_EPOCH = 8192 // 32
SHORT, LONG = 1, 3  # epochs; the difference gives the marginal cost per step


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def bare_loop(cfg) -> tuple[float, float]:
    """What a user would write by hand for the same job; returns (wall, CPU) seconds."""
    start = _clock()
    task = ToyTask()
    task.configure(cfg.task)
    seed_everything(derive_seed(cfg.train.seed, "init"))
    model = task.build_model(cfg.task)
    train_ds, _ = task.build_datasets(cfg.task)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))
    steps = (len(train_ds) // cfg.data.global_batch) * cfg.train.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_factor(cfg.sched.name, total_steps=steps, warmup_steps=cfg.sched.warmup_steps)
    )
    loader = DataLoader(
        train_ds,
        batch_size=cfg.data.global_batch,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    running = 0.0
    running_mae = None
    for _epoch in range(cfg.train.epochs):
        for batch in loader:
            pred = model(batch["points"])
            loss = F.mse_loss(pred, batch["target"])
            # The toy task also reports this metric; the hand loop does the same work.
            mae = (pred.detach() - batch["target"]).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += loss.item()
            running_mae = mae if _epoch == 0 and running_mae is None else running_mae + mae
    return _since(start)


def engine_run(cfg) -> tuple[float, float]:
    start = _clock()
    result = train(ToyTask(), cfg, console=False)
    assert result.status == "finished"
    return _since(start)


def overhead(workload: list[str], repeats: int, workdir: Path) -> dict:
    """Marginal time per step (runs of 1 and 4 epochs, so start-up cancels) and fixed start-up cost."""
    torch.set_num_threads(1)
    # Both sides pay torch's one-time lazy imports (the optimizer pulls in
    # dynamo) before timing starts.
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    times: dict[tuple[str, int], list[float]] = {}
    for i in range(repeats + 1):
        for epochs in (SHORT, LONG):
            run_dir = workdir / f"overhead-{i}-{epochs}"
            cfg = load_train_config("toy", TINY, [*workload, f"train.epochs={epochs}", f"run.dir={run_dir}"])
            b = bare_loop(cfg)
            e = engine_run(cfg)
            shutil.rmtree(run_dir, ignore_errors=True)
            if i:  # the first round warms caches and allocators
                times.setdefault(("bare", epochs), []).append(b)
                times.setdefault(("engine", epochs), []).append(e)
    extra_steps = (LONG - SHORT) * STEPS_PER_EPOCH
    out: dict = {
        "repeats": repeats,
        "target_pct": 5.0,
        "runs": {f"{loop}-{epochs}ep": values for (loop, epochs), values in times.items()},
    }
    for index, clock in ((0, "wall"), (1, "cpu")):
        med = {key: statistics.median(v[index] for v in values) for key, values in times.items()}
        per_step = {loop: (med[(loop, LONG)] - med[(loop, SHORT)]) / extra_steps for loop in ("bare", "engine")}
        for loop in ("bare", "engine"):
            out[f"{loop}_{clock}_s_per_step"] = per_step[loop]
            out[f"{loop}_{clock}_startup_s"] = med[(loop, SHORT)] - SHORT * STEPS_PER_EPOCH * per_step[loop]
        out[f"overhead_{clock}_pct"] = 100.0 * (per_step["engine"] / per_step["bare"] - 1.0)
    return out


def torchrun_throughput(nproc: int, workdir: Path) -> dict:
    run_dir = workdir / f"ranks-{nproc}"
    env = worker_environment(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    overrides = [*WORKLOADS["small"], "train.epochs=1", "log.every_steps=32", f"run.dir={run_dir}"]
    cmd = torchrun_command(worker_args("toy", config=TINY, overrides=overrides), nproc=nproc)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun with {nproc} rank(s) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["train/samples_per_s"] for r in records if "train/samples_per_s" in r][1:]  # first window warms up
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"ranks": nproc, "samples_per_s": statistics.median(rates), "wall_s_with_startup": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-dist", action="store_true", help="Skip the torchrun comparison.")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="pointforge-bench-engine-"))
    try:
        payload: dict = {"workloads": WORKLOADS, "overhead": {}}
        rows = []
        for name, workload in WORKLOADS.items():
            over = overhead(workload, args.repeats, workdir)
            payload["overhead"][name] = over
            rows.append(
                [
                    name,
                    over["bare_cpu_s_per_step"] * 1e3,
                    over["engine_cpu_s_per_step"] * 1e3,
                    f"{over['overhead_cpu_pct']:+.1f}%",
                    over["bare_wall_s_per_step"] * 1e3,
                    over["engine_wall_s_per_step"] * 1e3,
                    f"{over['overhead_wall_pct']:+.1f}%",
                    over["engine_wall_startup_s"] - over["bare_wall_startup_s"],
                ]
            )
        print(f"machine: {machine()}")
        print("\nEngine overhead versus a bare loop (same model, data, optimizer, schedule; 1 process, 1 thread).")
        print(
            f"Per step: marginal cost between runs of {SHORT} and {LONG} epochs ({STEPS_PER_EPOCH} steps each), medians "
            f"of {args.repeats}, including the engine's epoch-end checkpoints. CPU time is the steadier measure on a "
            "shared machine; wall time also counts the fsyncs."
        )
        print_table(
            [
                "workload",
                "bare CPU ms",
                "engine CPU ms",
                "overhead CPU",
                "bare wall ms",
                "engine wall ms",
                "overhead wall",
                "extra start-up s",
            ],
            rows,
        )
        print("target: ≤ 5 % per step")
        if not args.skip_dist:
            one = torchrun_throughput(1, workdir)
            two = torchrun_throughput(2, workdir)
            speedup = two["samples_per_s"] / one["samples_per_s"]
            payload["data_parallel"] = {"one": one, "two": two, "speedup": speedup, "efficiency": speedup / 2}
            print("\nData parallel on CPU with gloo ('small' workload, global batch 32 fixed; engine step timing)")
            print_table(
                ["ranks", "samples/s", "speed-up", "efficiency", "wall s incl. start-up"],
                [
                    [1, one["samples_per_s"], 1.0, 1.0, one["wall_s_with_startup"]],
                    [2, two["samples_per_s"], speedup, speedup / 2, two["wall_s_with_startup"]],
                ],
            )
        path = write_json("engine", payload)
        print(f"\nwrote {path}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
