"""Time and peak memory of `pointforge upsample` on LAZ tiles of 1, 5 and 10 million points.

For each size a synthetic airborne-lidar LAZ (:func:`pointforge.data.pairs.scenes.synthetic_pair`,
millimetre scales, UTM-like offsets) is written, then upsampled by
:func:`pointforge.inference.upsampler.upsample_file` (what the command runs:
tiles by the point budget, streamed to a LAZ output) in a fresh subprocess,
so that its peak resident memory (``ru_maxrss``, the RSS high-water mark) is
that run's alone; "baseline" is its peak after the imports and the model load,
before the cloud is touched. Memory should not grow with the cloud: only the
tile, the grid and 4 bytes per input point (the spacings) stay in memory.
Per tile the JSON keeps its size (points through the network, margins
included), the resident memory after it and its peak (the RSS high-water mark
restarted after each tile through /proc/self/clear_refs, Linux); flat memory
shows as the peak after the first tile equal to the whole run's.

The network's weights do not change its cost, so the timing uses the ``tiny``
preset trained for its 3 epochs (``--ckpt``, or trained here first when absent).

    python bench/upsample_tiles.py [--sizes 1000000,5000000,10000000] [--threads 1] [--ckpt CK]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, print_table, proc_status_mb, reset_peak, write_json

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class TileMemory:
    """``progress`` for upsample_file: after each tile, the resident memory and the peak since the last reading.

    The first peak covers everything before it too (the model load, the tiling
    passes): it is the high-water mark once the first tile is done.
    """

    def __init__(self) -> None:
        self.rss: list[float | None] = []
        self.peaks: list[float | None] = []

    def __call__(self, done: int, total: int) -> None:
        self.rss.append(proc_status_mb("VmRSS"))
        self.peaks.append(proc_status_mb("VmHWM"))
        if not reset_peak():
            self.peaks[-1] = None  # a running maximum, not this tile's


def worker_make(args) -> dict:
    from pointforge.data.pairs.scenes import synthetic_pair
    from pointforge.data.pointio import LasGeometry, write_points

    start = time.perf_counter()
    sparse, _ = synthetic_pair(args.points, seed=7)
    geometry = LasGeometry(scales=(0.001,) * 3, offsets=(500_000.0, 4_100_000.0, 0.0))
    write_points(args.input, sparse, las=geometry)
    return {"points": args.points, "seconds": time.perf_counter() - start}


def worker_upsample(args) -> dict:
    import torch

    from pointforge.inference.upsampler import load_upsampler
    from pointforge.upsampling.pipeline import upsample_file

    torch.set_num_threads(args.threads)
    model = load_upsampler(args.ckpt, "cpu")
    base = peak_rss_mb()
    memory = TileMemory()
    start = time.perf_counter()
    cpu = time.process_time()
    result = upsample_file(args.input, args.output, model, tile_points=args.tile_points, progress=memory)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peaks = [p for p in memory.peaks if p is not None]
    ends = [p for p in (proc_status_mb("VmHWM"), peak_rss_mb()) if p is not None]
    return {
        "points_in": result.points_in,
        "points_out": result.points_out,
        "tiles": result.tiles,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "baseline_rss_mb": base,
        # The whole run's high-water mark: ru_maxrss restarts with clear_refs, so the largest of the readings.
        "peak_rss_mb": max(peaks + ends),
        "peak_after_first_tile_mb": memory.peaks[0],
        "peak_of_later_tiles_mb": max(peaks[1:], default=None) if len(peaks) == len(memory.peaks) else None,
        "rss_after_first_tile_mb": memory.rss[0],
        "rss_after_last_tile_mb": memory.rss[-1],
        "tile_sizes": list(result.tile_sizes),
        "tile_peak_mb": memory.peaks,
        "rss_after_tile_mb": memory.rss,
        "output_mb": os.path.getsize(args.output) / 2**20,
    }


def in_subprocess(*argv: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE), *argv], check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_checkpoint(folder: Path) -> Path:
    run = folder / "tiny"
    subprocess.run(
        [sys.executable, "-m", "pointforge", "train", "upsampler", "--config", "pointforge/configs/upsampler/tiny.yaml",
         f"run.dir={run}", f"task.data_root={folder / 'data'}"],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    return run / "checkpoints" / "best.pt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,5000000,10000000")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tile-points", type=int, default=None, help="default: upsample_file's own")
    parser.add_argument("--ckpt", type=Path, help="an upsampler checkpoint (default: train the tiny preset here)")
    parser.add_argument("--work", type=Path, help="folder for the LAZ files (default: a temporary one beside this)")
    parser.add_argument("--json-name", default="upsample_tiles", help="bench/results/<name>.json")
    parser.add_argument("--worker", choices=("make", "upsample"))
    parser.add_argument("--points", type=int)
    parser.add_argument("--input", type=Path)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps({"make": worker_make, "upsample": worker_upsample}[args.worker](args)))
        return

    record: dict = {"machine": machine(), "threads": args.threads, "tile_points": args.tile_points, "runs": []}
    print(f"machine: {machine()}; {args.threads} torch thread(s)")
    with tempfile.TemporaryDirectory(prefix="pf-tiles-", dir=args.work or HERE.parent) as tmp:
        folder = Path(tmp)
        ckpt = args.ckpt or tiny_checkpoint(folder)
        record["ckpt"] = str(args.ckpt or "tiny preset, trained here")
        for n in (int(s) for s in args.sizes.split(",")):
            src, dst = folder / f"in_{n}.laz", folder / f"out_{n}.laz"
            made = in_subprocess("--worker", "make", "--points", str(n), "--input", str(src))
            extra = ["--tile-points", str(args.tile_points)] if args.tile_points else []
            run = in_subprocess(
                "--worker", "upsample", "--input", str(src), "--output", str(dst), "--ckpt", str(ckpt),
                "--threads", str(args.threads), *extra,
            )  # fmt: skip
            run["make_seconds"] = made["seconds"]
            record["runs"].append(run)
            print(json.dumps(run), flush=True)
            src.unlink()
            dst.unlink()
            write_json(args.json_name, record)  # after every size: a long run keeps what it measured
    rows = [
        [r["points_in"], r["points_out"], r["tiles"], max(r["tile_sizes"]), r["seconds"], r["cpu_seconds"],
         r["baseline_rss_mb"], r["peak_after_first_tile_mb"], r["peak_rss_mb"], r["rss_after_first_tile_mb"],
         r["rss_after_last_tile_mb"], r["output_mb"]]
        for r in record["runs"]
    ]  # fmt: skip
    print_table(
        ["points in", "points out", "tiles", "largest tile", "wall s", "CPU s", "baseline MB",
         "peak MB after tile 1", "peak MB", "RSS MB after tile 1", "after last", "LAZ MB"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
