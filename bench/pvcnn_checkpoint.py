"""Activation checkpointing in PVCNN2: the memory a training step saves and the time it costs.

For each case (by default the paper preset at batch 1 and 2 and the tiny preset at
batch 8, each at its PCDiff config's points: 27,648 + 3,072 and 896 + 128) one model
with one set of weights runs full training steps (forward, loss on the implant points,
backward, Adam step) with ``checkpoint_activations`` off and on, alternating, after a
warm-up step of each; the table gives the median wall time per step of each and their
ratio. Then the peak memory of one step of each, beyond the weights, as
``bench/pvcnn_memory.py`` measures it (PyTorch's ``MemTracker``, after one untracked step
so that Adam's state exists), and the part of it that is activations (the tracker's
"Activation" and "Temp"); on CUDA also ``torch.cuda.max_memory_allocated`` less what the
step started with.

The inputs are skull-like shells with noisy implant points (``bench/pvcnn.py``), one
per sample. ``--device cuda`` synchronises around every step; ``--bf16`` runs the
forward under bfloat16 autocast.

    python bench/pvcnn_checkpoint.py [--device cpu] [--bf16] [--threads 2] [--repeats 3]
    python bench/pvcnn_checkpoint.py --cases tiny:8 paper:1 paper:2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch
from pvcnn import synthetic_skull
from torch.distributed._tools.mem_tracker import MemTracker

from _common import machine, print_table, record_header, write_json
from pointforge.nn.pvcnn import PVCNN2
from pointforge.tasks.pcdiff.config import PRESET_POINTS

MB = 2**20
T_STEP = 500
MODES = (False, True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _peaks(model: PVCNN2, step: Callable[[], None], optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """Bytes beyond the weights at the step's peak, and the activations among them (MemTracker)."""
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")[device]
    by_kind = {getattr(k, "value", k): v for k, v in snapshot.items()}
    peak = {
        "beyond_weights_bytes": int(by_kind["Total"] - by_kind.get("Parameter", 0)),
        "activation_bytes": int(by_kind.get("Activation", 0) + by_kind.get("Temp", 0)),
    }
    if device.type == "cuda":
        _sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peak["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device) - start)
    return peak


def run_case(preset: str, batch: int, device: torch.device, bf16: bool, repeats: int) -> dict[str, Any]:
    conditioning, generated = PRESET_POINTS[preset]
    torch.manual_seed(0)
    model = PVCNN2(preset).to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.cat([synthetic_skull(seed, conditioning, generated) for seed in range(batch)]).to(device)
    t = torch.full((batch,), T_STEP, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            y = model(x, t)
        (y[:, :, -generated:].float() ** 2).mean().backward()
        optimizer.step()

    seconds: dict[bool, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(repeats + 1):  # round 0 warms both up
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            model.checkpoint_activations = mode
            elapsed = _timed(step, device)
            if round_index:
                seconds[mode].append(elapsed)
    memory = {}
    for mode in MODES:
        model.checkpoint_activations = mode
        memory[mode] = _peaks(model, step, optimizer, device)
    return {
        "preset": preset,
        "batch": batch,
        "points": conditioning + generated,
        "step_seconds": {"off": seconds[False], "on": seconds[True]},
        "memory": {"off": memory[False], "on": memory[True]},
    }


def print_rows(records: list[dict[str, Any]]) -> None:
    rows = []
    for r in records:
        off, on = (statistics.median(r["step_seconds"][m]) for m in ("off", "on"))
        mem_off, mem_on = r["memory"]["off"], r["memory"]["on"]
        row = [
            r["preset"],
            r["points"],
            r["batch"],
            off,
            on,
            on / off,
            mem_off["beyond_weights_bytes"] / MB,
            mem_on["beyond_weights_bytes"] / MB,
            mem_on["beyond_weights_bytes"] / mem_off["beyond_weights_bytes"],
            mem_off["activation_bytes"] / MB,
            mem_on["activation_bytes"] / MB,
        ]
        if "cuda_max_allocated_bytes" in mem_off:
            row += [mem_off["cuda_max_allocated_bytes"] / MB, mem_on["cuda_max_allocated_bytes"] / MB]
        rows.append(row)
    headers = ["preset", "points", "batch", "step s off", "step s on", "time on/off"]
    headers += ["peak MB off", "peak MB on", "peak on/off", "activations MB off", "activations MB on"]
    if rows and len(rows[0]) > len(headers):
        headers += ["CUDA max MB off", "CUDA max MB on"]
    print_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="run the forward under bfloat16 autocast")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each mode per case (median)")
    parser.add_argument("--cases", nargs="*", default=["tiny:8", "paper:1", "paper:2"], help="PRESET:BATCH ...")
    parser.add_argument("--name", default="pvcnn_checkpoint", help="results file bench/results/NAME.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/pvcnn_checkpoint.py: --device cuda asked for, but CUDA is not available here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(args.threads)
    cases = []
    for case in args.cases:
        preset, _, batch = case.partition(":")
        if preset not in PRESET_POINTS or not batch.isdigit() or int(batch) < 1:
            raise SystemExit(
                f"bench/pvcnn_checkpoint.py: a case is PRESET:BATCH with PRESET in {list(PRESET_POINTS)}, got {case!r}"
            )
        cases.append((preset, int(batch)))
    load_before = os.getloadavg()
    print(machine(), f"| {device}, {args.threads} threads, {'bf16 autocast' if args.bf16 else 'float32'}")
    records = [run_case(preset, batch, device, args.bf16, args.repeats) for preset, batch in cases]
    print_rows(records)
    load_after = os.getloadavg()
    print(f"median of {args.repeats} steps each; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    load = {"before": load_before, "after": load_after}
    record = record_header("pvcnn_checkpoint", device=str(device), bf16=args.bf16, threads=args.threads, load=load)
    record.update(repeats=args.repeats, cases=records)
    print(f"wrote {write_json(args.name, record)}")


if __name__ == "__main__":
    main()
