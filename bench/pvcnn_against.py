"""PVCNN2 paper forward at batch 1 and 5: this checkout against another, in alternating fresh processes.

Each measurement is a fresh process importing ``pointforge`` from the checkout it measures
(``PYTHONPATH``), running the paper preset's evaluation forward (no grad, as sampling runs
it) on bench/pvcnn.py's synthetic skulls (30,720 points each, one per batch element):
one warm-up forward, then ``--repeats`` timed ones. Rounds alternate the checkouts
(bench/_common.py's harness: the order flipping each round, so both see the same load); the
figure is the median over rounds of each process's median, with the load average after each
round. The outputs of the two checkouts are compared (largest absolute difference).

``--compile`` measures this checkout's eager forward against the same forward through
``torch.compile`` (Inductor; bench/_compile.py: the index searches left eager, static
shapes) instead of two checkouts; the first forward of each process, where compilation
happens, is reported apart.

    python bench/pvcnn_against.py --against DIR [--batches 1 5] [--rounds 3] [--repeats 2] [--threads 2]
    python bench/pvcnn_against.py --compile [--batches 1 5] [--rounds 3] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import ROOT, alternate, checkouts, fresh_process, machine, print_table, write_json

HERE = Path(__file__).resolve()
T_STEP = 500


def worker(batch: int, repeats: int, save: Path | None, compiled: bool = False) -> dict[str, Any]:
    from _compile import compile_pvcnn
    from pvcnn import synthetic_skull

    from pointforge.nn.pvcnn import PVCNN2

    torch.manual_seed(0)
    model = PVCNN2("paper").eval()
    run = compile_pvcnn(model) if compiled else model
    x = torch.cat([synthetic_skull(seed) for seed in range(batch)])
    t = torch.full((batch,), T_STEP)
    walls, cpus = [], []
    with torch.no_grad():
        wall, cpu = time.perf_counter(), time.process_time()
        out = run(x, t)
        first = {"first_wall_s": time.perf_counter() - wall, "first_cpu_s": time.process_time() - cpu}
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            run(x, t)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    if save is not None:
        torch.save(out, save)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "walls": walls, **first}


def run_worker(
    tree: Path, batch: int, repeats: int, threads: int, save: Path | None, compiled: bool = False
) -> dict[str, Any]:
    args = ["--worker", "--batches", str(batch), "--repeats", str(repeats), "--threads", str(threads)]
    args += (["--save", str(save)] if save else []) + (["--compile"] if compiled else [])
    return fresh_process(HERE, args, tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--against", type=Path, help="another checkout, measured in alternation with this one")
    which.add_argument("--compile", action="store_true", help="this checkout eager against torch.compile(model)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed forwards per process, after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker(args.batches[0], args.repeats, args.save, args.compile)))
        return
    variants = checkouts(args.against)
    names, trees = [name for name, _ in variants], [tree for _, tree in variants]
    compiled = [False] * len(trees)
    if args.compile:
        trees, names, compiled = [ROOT, ROOT], ["torch.compile", "eager"], [True, False]
    result: dict[str, Any] = {"batches": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pvcnn_against_") as scratch:
        for batch in args.batches:

            def measure(i: int, r: int) -> dict[str, Any]:
                save = Path(scratch) / f"out{i}_{batch}.pt" if r == 0 else None
                return run_worker(trees[i], batch, args.repeats, args.threads, save, compiled[i])

            done = alternate(names, args.rounds, measure, label=f"batch {batch}: ")
            outs = [torch.load(Path(scratch) / f"out{i}_{batch}.pt") for i in range(len(trees))]
            diff = float((outs[0] - outs[-1]).abs().max())
            wall = {name: done.median(name, "wall_s") for name in names}
            cpu = {name: done.median(name, "cpu_s") for name in names}
            first = {name: done.median(name, "first_wall_s") for name in names}
            for name in names:
                rows.append([batch, name, wall[name], cpu[name], wall[names[-1]] / wall[name], first[name], diff])
            result["batches"][str(batch)] = {"runs": done.runs, "loads": done.loads, "max_abs_difference": diff}
    print(f"PVCNN2 paper forward (eval, no grad), 30,720 points per sample, {args.threads} threads; {machine()}")
    headers = ["batch", "variant", "median wall s", "median CPU s", "speed-up (wall)", "first forward wall s"]
    print_table(headers + ["max |out diff|"], rows)
    result.update({"machine": machine(), "threads": args.threads, "trees": [str(t) for t in trees]})
    print(f"wrote {write_json('pvcnn_against', result)}")


if __name__ == "__main__":
    main()
