"""GroupNorm + SiLU of PVCNN2, isolated: PyTorch's separate passes against the compiled fused pass.

The shapes are those of a real evaluation forward: the paper preset on bench/pvcnn.py's
synthetic skulls (30,720 points) and the tiny preset on 1,792 points (the demo's 1,536 +
256), recorded by running the network once with every norm call logged. For each distinct
(shape, layout) two ways are timed:

* ``torch``: what the network ran before the fused pass: point features
  ``F.silu(F.group_norm(x))``; channels-last grids ``.contiguous()`` first (PyTorch's CPU
  GroupNorm loses precision on them) and the copy back to channels-last that the next
  convolution or the devoxelisation makes;
* ``fused``: ``pointforge/nn/fused_norm.py``'s pass (in place, on the calling thread),
  forced on whatever the size threshold says.

Every call gets a fresh copy of the input, made just before the clock starts (as a
convolution's output is just written when the norm reads it).

Freed memory stays in the heap (``devices.reuse_freed_memory``, as ``load_pcdiff`` sets
it), so no path pays page faults for fresh outputs. Rounds alternate the paths (order
flipping each round); the figure is the median. The load average is printed after each
preset, since the machine may be shared.

    python bench/fused_norm.py [--presets paper tiny] [--batch 1] [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from pvcnn import synthetic_skull
from torch import Tensor, nn

from _common import print_table, record_header, write_json
from pointforge.devices import reuse_freed_memory
from pointforge.nn import fused_norm
from pointforge.nn.pvcnn import PVCNN2

# (conditioning, generated) points, as bench/pvcnn_roofline.py runs each preset.
SIZES = {"paper": (27_648, 3_072), "tiny": (1_536, 256)}


def norm_calls(preset: str, batch: int) -> list[tuple[tuple[int, ...], bool, int]]:
    """Distinct ``(shape, channels_last, count)`` of the norms an evaluation forward runs."""
    torch.manual_seed(0)
    model = PVCNN2(preset).eval()
    x = torch.cat([synthetic_skull(seed, *SIZES[preset]) for seed in range(batch)])
    seen: dict[tuple[tuple[int, ...], bool], int] = {}
    applies = fused_norm.applies

    def logging(t: Tensor, norm: nn.GroupNorm) -> bool:
        key = (tuple(t.shape), not t.is_contiguous())
        seen[key] = seen.get(key, 0) + 1
        return applies(t, norm)

    fused_norm.applies = logging
    try:
        with torch.no_grad():
            model(x, torch.full((batch,), 500))
    finally:
        fused_norm.applies = applies
    return [(shape, last, count) for (shape, last), count in seen.items()]


def channels_last(x: Tensor) -> Tensor:
    """``x`` with its channels innermost in memory (channels-last for grids)."""
    return x.movedim(1, -1).contiguous().movedim(-1, 1)


def paths(norm: nn.GroupNorm) -> dict[str, Callable[[Tensor], Any]]:
    """Each way, as a function of a fresh input (the fused pass overwrites it)."""

    def torch_path(x: Tensor) -> Tensor:
        if x.is_contiguous():
            return F.silu(F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps))
        return channels_last(F.silu(norm(x.contiguous())))

    def fused(x: Tensor) -> Tensor:
        return fused_norm.group_norm_act_(x, norm, silu=True)

    return {"torch": torch_path, "fused": fused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", choices=sorted(SIZES), default=["paper", "tiny"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_freed_memory()
    start_load = os.getloadavg()
    rows, record = [], []
    for preset in args.presets:
        for shape, last, count in norm_calls(preset, args.batch):
            norm = nn.GroupNorm(8, shape[1])
            with torch.no_grad():
                norm.weight.normal_()
                norm.bias.normal_()
                x = torch.randn(shape)
                if last:
                    x = channels_last(x)
                runs = paths(norm)
                reference = runs["torch"](x.clone())
                for run in runs.values():  # warm-up (and compilation), and the check
                    assert torch.allclose(run(x.clone()), reference, atol=1e-5, rtol=1e-5), "the paths disagree"
                times: dict[str, list[float]] = {name: [] for name in runs}
                for r in range(args.rounds):
                    for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
                        fresh = x.clone()  # as a convolution's output: just written
                        t0 = time.perf_counter()
                        runs[name](fresh)
                        times[name].append(time.perf_counter() - t0)
            medians = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            with torch.no_grad():
                used = "yes" if fused_norm.applies(x, norm) else "no"
            rows.append(
                [preset, "x".join(map(str, shape)), "last" if last else "first", count, x.numel()]
                + list(medians.values())
                + [medians["torch"] / medians["fused"], used]
            )
            record.append({"preset": preset, "shape": shape, "channels_last": last, "calls": count, "ms": times})
        print(f"{preset}: done, load average {os.getloadavg()[0]:.1f}", flush=True)
    header = record_header(
        "fused_norm", device="cpu", bf16=False, threads=args.threads, load={"start": start_load, "end": os.getloadavg()}
    )
    print(
        f"{header['machine']}; torch {header['torch']}, {args.threads} threads, batch {args.batch}; "
        f"load {start_load[0]:.1f} -> {os.getloadavg()[0]:.1f}; ms, median of {args.rounds}"
    )
    names = list(paths(nn.GroupNorm(8, 8)))
    headers = ["preset", "shape", "channels", "calls", "elements"] + names + ["speed-up", "fused by default"]
    print_table(headers, rows)
    print(f"wrote {write_json('fused_norm', {**header, 'batch': args.batch, 'shapes': record})}")


if __name__ == "__main__":
    main()
