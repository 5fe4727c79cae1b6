"""PCDiff demo training step on CPU: steps per second as `pointforge demo` runs it, optionally against another checkout.

The workload is one optimizer step of ``pointforge/configs/pcdiff/demo.yaml`` as the
engine runs it: PVCNN2 ``tiny`` with the condition mark and the frame, 1536 skull + 256
implant points, batch 4, one torch thread; a batch from the task's dataset and collate
(``num_workers: 0``, on the main thread), forward, diffusion loss, backward, the
engine's optimizer (``train/schedule.build_optimizer``), ``zero_grad``, the engine's EMA
update (``train.ema_decay``). Data loading and the step are timed apart, in process
CPU time (the steadier figure on a shared machine) and wall time.

Each measurement runs in a fresh process (``--worker``) that imports ``pointforge``
from the checkout it measures; the step sees the same batches and the same seeds in
every process, so two checkouts can be compared step for step. ``--against DIR`` (a
checkout of another commit, e.g. ``git worktree add /tmp/base main``) alternates the two
checkouts' processes ``--rounds`` times (bench/_common.py's harness: the order flipping
each round) and reports each
one's median, their ratio, and the largest difference of their losses over the first
steps (the same computation gives the same loss curve up to float rounding).
``--compile`` alternates this checkout's eager step with the same step through
``torch.compile`` (Inductor; bench/_compile.py: the index searches left eager, static
shapes, as the plain ``torch.compile(model)`` of ``perf.compile=true`` fails on PVCNN2),
compares their losses the same way, and reports the warm-up apart: the first
``WARMUP`` steps, where compilation happens, in CPU and wall seconds, and how many
graphs and graph breaks Dynamo made.
``--profile`` prints torch.profiler's table of one checkout's step instead.

    python bench/pcdiff_step.py [--rounds 5] [--repeats 12] [--against DIR | --compile] [--data PREPARED_ROOT]
    python bench/pcdiff_step.py --profile [--against DIR]   # the table of DIR's step (default: this checkout)

Without ``--data`` a synthetic demo dataset (10 skulls at 64^3, as ``make demo``
builds) is made in a temporary folder first (~15 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, alternate, checkouts, fresh_process, machine, print_table, write_json

HERE = Path(__file__).resolve()
WARMUP = 3  # oneDNN primitives, the allocator, the data path's caches


def demo_dataset(folder: Path) -> Path:
    from pointforge.data.prepare import prepare_dataset
    from pointforge.data.synthetic.dataset import synthesize

    synthesize(str(folder / "raw"), 10, 64, 0, layout="skullbreak")
    prepare_dataset(
        str(folder / "raw"), str(folder / "prepared"), n_points=16384, seed=0, split="0.6,0.2,0.2", workers=1
    )
    return folder / "prepared"


def _demo_parts(tree: Path, data_root: Path) -> tuple[Any, Any, Any, Any, Any, dict[str, Any]]:
    """The task, its training dataset's loader, model, optimizer and EMA, as the demo builds them."""
    import torch
    import yaml

    from pointforge.config.coercion import from_dict
    from pointforge.config.training import OptimSection
    from pointforge.tasks.pcdiff.config import PCDiffConfig
    from pointforge.tasks.pcdiff.task import PCDiffTask
    from pointforge.train.ema import EMA
    from pointforge.train.schedule import build_optimizer

    full = yaml.safe_load((tree / "pointforge" / "configs" / "pcdiff" / "demo.yaml").read_text())
    section = {**full["task"], "data_root": str(data_root), "val_split": None}
    cfg = from_dict(PCDiffConfig, section, prefix="task")
    task = PCDiffTask()
    task.configure(cfg)
    train_ds, _ = task.build_datasets(cfg)
    loader = torch.utils.data.DataLoader(
        train_ds,
        batch_size=int(full["data"]["global_batch"]),
        shuffle=True,
        drop_last=True,
        collate_fn=task.collate,
        generator=torch.Generator().manual_seed(0),
    )
    torch.manual_seed(0)
    model = task.build_model(cfg).train()
    optim = from_dict(OptimSection, full["optim"], prefix="optim")
    optimizer = build_optimizer(model.parameters(), optim, optim.lr)
    ema = EMA(model, float(full["train"]["ema_decay"]))
    return task, loader, model, optimizer, ema, full


def worker(tree: Path, data_root: Path, repeats: int, profile: bool, compiled: bool = False) -> dict[str, Any]:
    """Measure this process's checkout (``pointforge`` as imported); one JSON-able record."""
    import torch
    from _compile import compile_pvcnn

    torch.set_num_threads(1)  # perf.threads in the demo recipe
    task, loader, model, optimizer, ema, full = _demo_parts(tree, data_root)
    step_model = compile_pvcnn(model) if compiled else model
    batches = iter(loader)

    def next_batch() -> Any:
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(loader)
            return next(batches)

    def step(index: int, batch: Any) -> float:
        torch.manual_seed(1000 + index)  # the same t and noise in every process
        loss = task.training_step(step_model, batch, None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)
        return loss.item()

    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        for index in range(WARMUP):
            step(index, next_batch())
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for index in range(WARMUP, WARMUP + repeats):
                step(index, next_batch())
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        return {"profile": table, "steps": repeats}

    losses: list[float] = []
    times: dict[str, list[float]] = {"data_cpu": [], "data_wall": [], "step_cpu": [], "step_wall": []}
    warmup: dict[str, list[float]] = {"step_cpu": [], "step_wall": []}
    for index in range(WARMUP + repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        batch = next_batch()
        data_wall, data_cpu = time.perf_counter() - wall, time.process_time() - cpu
        wall, cpu = time.perf_counter(), time.process_time()
        losses.append(step(index, batch))
        step_wall, step_cpu = time.perf_counter() - wall, time.process_time() - cpu
        if index >= WARMUP:
            for key, value in zip(times, (data_cpu, data_wall, step_cpu, step_wall)):
                times[key].append(value)
        else:
            warmup["step_cpu"].append(step_cpu)
            warmup["step_wall"].append(step_wall)
    return {
        "medians": {key: statistics.median(values) for key, values in times.items()},
        "losses": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
        "warmup": warmup,
        "timed": times,
        **(_dynamo_counts() if compiled else {}),
    }


def _dynamo_counts() -> dict[str, Any]:
    """How many graphs Dynamo compiled and why it broke them (its own counters, this process)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": {reason[:160]: int(n) for reason, n in counters["graph_break"].items()},
    }


def run_worker(
    tree: Path, data_root: Path, repeats: int, profile: bool = False, compiled: bool = False
) -> dict[str, Any]:
    """One measurement in a fresh process importing ``pointforge`` from ``tree``."""
    args = ["--worker", "--tree", str(tree), "--data", str(data_root), "--repeats", str(repeats)]
    args += (["--profile"] if profile else []) + (["--compile"] if compiled else [])
    return fresh_process(HERE, args, tree)


Variant = tuple[str, Path, bool]  # name, checkout, through torch.compile


def compare(variants: list[Variant], data_root: Path, rounds: int, repeats: int) -> dict[str, Any]:
    def measure(i: int, r: int) -> dict[str, Any]:
        _, tree, compiled = variants[i]
        return run_worker(tree, data_root, repeats, compiled=compiled)

    done = alternate([name for name, _, _ in variants], rounds, measure)
    summary: dict[str, Any] = {}
    for name, records in done.runs.items():
        summary[name] = {
            key: done.median(name, lambda rec, key=key: rec["medians"][key]) for key in records[0]["medians"]
        }
        summary[name]["per_round_step_cpu"] = [rec["medians"]["step_cpu"] for rec in records]
        for key in ("step_cpu", "step_wall"):
            summary[name][f"warmup_{key}"] = done.median(name, lambda rec, key=key: sum(rec["warmup"][key]))
    return {"runs": done.runs, "summary": summary, "loads": done.loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="processes per variant, alternating (default 5)")
    parser.add_argument(
        "--repeats", type=int, default=12, help=f"timed steps per process, after {WARMUP} warm-up steps"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--against", type=Path, help="another checkout to measure in alternation with this one")
    which.add_argument(
        "--compile", action="store_true", help="this checkout's step eager against torch.compile(model), alternating"
    )
    parser.add_argument("--data", type=Path, help="a prepared dataset (default: synthesise the demo's)")
    parser.add_argument("--profile", action="store_true", help="print the profiler table of one checkout's step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.tree, args.data, args.repeats, args.profile, args.compile)))
        return

    with tempfile.TemporaryDirectory(prefix="pcdiff_step_") as scratch:
        data_root = args.data if args.data is not None else demo_dataset(Path(scratch))
        if args.profile:
            tree = (args.against or ROOT).resolve()
            print(f"torch.profiler, {args.repeats} demo steps of {tree} (self CPU time), 1 thread")
            print(run_worker(tree, data_root, args.repeats, profile=True, compiled=args.compile)["profile"])
            return
        variants: list[Variant] = [(name, tree, False) for name, tree in checkouts(args.against)]
        if args.compile:
            variants = [("eager", ROOT, False), ("torch.compile", ROOT, True)]
        result = compare(variants, data_root, args.rounds, args.repeats)
    report(args, variants, result)


def report(args: argparse.Namespace, variants: list[Variant], result: dict[str, Any]) -> None:
    print(
        "PCDiff demo training step (PVCNN2 tiny + mark + frame, batch 4, 1536 + 256 points, "
        f"engine optimizer + EMA), 1 torch thread; median of {args.rounds} processes x {args.repeats} steps"
    )
    print(machine())
    print(f"load average per round: {', '.join(f'{x:.1f}' for x in result['loads'])} on {os.cpu_count()} cores")
    summary = result["summary"]
    base = summary[variants[-1][0]] if args.against else summary[variants[0][0]]
    rows = []
    for name, _, _ in variants:
        s = summary[name]
        rows.append(
            [
                name,
                s["step_cpu"],
                1 / s["step_cpu"],
                s["step_wall"],
                1 / s["step_wall"],
                s["data_cpu"] * 1e3,
                (base["step_cpu"] + base["data_cpu"]) / (s["step_cpu"] + s["data_cpu"]),
                s["warmup_step_cpu"],
                s["warmup_step_wall"],
            ]
        )
    print_table(
        [
            "variant",
            "CPU s/step",
            "steps/s (CPU)",
            "wall s/step",
            "steps/s (wall)",
            "data CPU ms/batch",
            "speed-up (CPU, step + data)",
            f"first {WARMUP} steps CPU s",
            f"first {WARMUP} steps wall s",
        ],
        rows,
    )
    if len(variants) > 1:
        first = [result["runs"][name][0]["losses"] for name, _, _ in variants]
        diff = max(abs(a - b) for a, b in zip(*first))
        print(f"largest loss difference over the first {len(first[0])} steps: {diff:.3g}")
        result["max_loss_difference"] = diff
    if args.compile:
        record = result["runs"]["torch.compile"][0]
        print(f"torch.compile: {record['graphs']} graphs; graph breaks by reason (one process):")
        for reason, count in sorted(record["graph_breaks"].items(), key=lambda item: -item[1]):
            print(f"  {count:4d}  {reason}")
    record = {
        "benchmark": "pcdiff_step",
        "machine": machine(),
        "threads": 1,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "variants": [[name, str(tree), compiled] for name, tree, compiled in variants],
        **result,
    }
    print(f"\nwrote {write_json('pcdiff_step', record)}")


if __name__ == "__main__":
    main()
