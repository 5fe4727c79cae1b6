"""Furthest point sampling at the paper's four levels: the NumPy plain loop, the plain loop compiled, the bucketed loop.

Three exact loops, identical indices (checked at every level before anything is timed):

* ``plain, numpy``: ``method="numpy"``, the CPU default before the compiled loop;
* ``plain, compiled``: the same loop compiled: the bucketed kernel below with all points
  in one leaf, so every step scans every point (one fused pass: lower every distance,
  track the first maximum), batch elements on threads;
* ``bucketed, compiled``: ``backend="compiled"`` (``pointforge/nn/pvops/fps_compiled.py``),
  which skips the kd leaves a sample cannot reach; ``"auto"`` picks it on CPU.

Rounds are interleaved in one process (the order rotating each round), median of
``--rounds``; the load average is printed before and after, since the machine may be
shared (the ratios are the point, absolute times context). ``--compile`` also times,
in fresh processes, the first call with an empty Numba cache and with a warm one.

    python bench/fps_compiled.py [--threads 2] [--rounds 5] [--compile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numba
import torch
from torch import Tensor

from _common import print_table, record_header, write_json
from pointforge.nn.pvops.fps import _fps_scan_order, furthest_point_sample_indices
from pointforge.nn.pvops.fps_compiled import bucketed_fps

LEVELS = ((30720, 10240), (10240, 2560), (2560, 640), (640, 160))
FIRST_CALL = (
    "import time; t = time.perf_counter(); import torch; "
    "from pointforge.nn.pvops.fps import furthest_point_sample_indices as f; "
    "f(torch.rand(1, 3, 2000), 50, backend='compiled'); f(torch.rand(1, 3, 2000).double(), 50, backend='compiled'); "
    "print(time.perf_counter() - t)"
)


def plain_compiled(coords: Tensor, num_samples: int, threads: int) -> Tensor:
    """The plain loop compiled: the package's kernel with every point in one leaf, which no sample can skip."""
    n = coords.shape[2]
    order = _fps_scan_order(n, coords.device)
    pts = (coords if order is None else coords.index_select(2, order)).contiguous().numpy()
    out = torch.from_numpy(bucketed_fps(pts, num_samples, threads=threads, leaf_size=n))
    return out if order is None else order[out]


def first_call_seconds(cache_dir: str | None) -> float:
    """Seconds of a fresh process's import and first two compiled calls (float32, float64)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    done = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def _time_level(coords: Tensor, samples: int, rounds: int, threads: int) -> dict[str, list[float]]:
    paths: dict[str, Callable[[], Tensor]] = {
        "plain, numpy": lambda: furthest_point_sample_indices(coords, samples, method="numpy"),
        "plain, compiled": lambda: plain_compiled(coords, samples, threads),
        "bucketed, compiled": lambda: furthest_point_sample_indices(coords, samples, backend="compiled"),
    }
    reference = None
    for name, run in paths.items():
        got = run()
        if reference is None:
            reference = got
        elif not torch.equal(got, reference):
            raise SystemExit(f"{name} differs from the plain NumPy loop at {coords.shape}, {samples} samples")
    times: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--compile", action="store_true", help="also time first calls in fresh processes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(1)
    rows, record = [], []
    for batch in args.batches:
        v = torch.randn(batch, 3, LEVELS[0][0], generator=g)
        cloud = 3 * v / v.norm(dim=1, keepdim=True)  # points on a sphere, as on a skull
        for points, samples in LEVELS:
            coords = cloud[:, :, :points].contiguous()
            times = _time_level(coords, samples, args.rounds, args.threads)
            base = statistics.median(times["plain, numpy"])
            median = {name: statistics.median(spent) for name, spent in times.items()}
            rows.append(
                [batch, f"{points:,} → {samples:,}", *median.values(), *(base / m for m in list(median.values())[1:])]
            )
            record.append({"batch": batch, "points": points, "samples": samples, "times_s": times})
            print(f"batch {batch}, {points:,} → {samples:,}: done, load {os.getloadavg()[0]:.1f}", flush=True)
    load_after = os.getloadavg()
    first_calls = {}
    if args.compile:
        with tempfile.TemporaryDirectory() as empty:
            first_calls["empty cache s"] = first_call_seconds(empty)
        first_calls["warm cache s"] = first_call_seconds(None)
    load = {"before": load_before, "after": load_after}
    header = record_header("fps_compiled", device="cpu", bf16=False, threads=args.threads, load=load)
    print(f"{header['machine']}; torch {header['torch']}, numba {numba.__version__}, {args.threads} threads")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (1 min)")
    print(f"indices identical on every path and level; medians of {args.rounds} interleaved rounds, seconds")
    print_table(
        ["batch", "level", "plain numpy s", "plain compiled s", "bucketed s", "plain compiled ×", "bucketed ×"],
        rows,
    )
    for name, seconds in first_calls.items():
        print(f"first call in a fresh process (import, two dtypes), {name}: {seconds:.1f}")
    path = write_json("fps_compiled", {**header, "numba": numba.__version__, "levels": record, **first_calls})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
