"""A case served through `pointforge serve` against the same case run by `generate`, side by side.

Per round, one case is generated in this process (``generate_case``, models
loaded once, the same options as the service: what ``pointforge generate``
does minus loading the models), once as the command writes it and once
without preview.png as the service writes it, then the same file is uploaded to a real
`pointforge serve` process (loaded once, one worker) and the answer polled every
50 ms until the job is done: upload, check, queue, generate, write and the
poll itself. The rounds alternate so that the load of a shared machine falls
on both alike; the first round of each is a warm-up and not counted. The
overhead (served minus generate) is what the service adds to a case.

    python bench/serve_latency.py --pcdiff CK --voxelizer CK --input skull.nrrd --rounds 5

Without the three inputs it says so and does nothing (``make bench`` runs it bare).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _common import machine, print_table, write_json


def start_server(args, data: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pointforge", "serve", "--pcdiff", args.pcdiff, "--voxelizer", args.voxelizer]
    cmd += ["--port", "0", "--data-dir", str(data), "--device", "cpu", "--threads", str(args.threads)]
    cmd += ["--ensemble", str(args.ensemble), "--sampler", args.sampler, "--max-disk-gb", "100"]
    cmd += ["--steps", str(args.steps)] if args.steps else []
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return proc, found.group(1)
    raise SystemExit(f"pointforge serve did not start (exit {proc.wait()})")


def served_seconds(client: httpx.Client, body: bytes) -> float:
    start = time.perf_counter()
    job = client.post("/api/cases", params={"name": "bench.nrrd"}, content=body).json()
    while (status := client.get(f"/api/cases/{job['id']}").json()["status"]) in ("queued", "running"):
        time.sleep(0.05)
    if status != "done":
        raise SystemExit(f"the served case ended {status}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pcdiff", help="a PCDiff checkpoint")
    parser.add_argument("--voxelizer", help="a voxelizer checkpoint")
    parser.add_argument("--input", help="a defective skull (NRRD/NIfTI) to generate and serve")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ensemble", type=int, default=2)
    parser.add_argument("--sampler", default="ddim")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not (args.pcdiff and args.voxelizer and args.input):
        # `make bench` runs every script bare; this one measures given models on a given case.
        print("bench/serve_latency.py: skipped; give --pcdiff, --voxelizer and --input (a defective skull) to run it")
        return

    import torch

    from pointforge.implant.case import generate_case
    from pointforge.implant.models import load_models
    from pointforge.implant.options import GenerateOptions

    torch.set_num_threads(args.threads)
    models = load_models(args.pcdiff, args.voxelizer, device="cpu")
    options = GenerateOptions(ensemble=args.ensemble, sampler=args.sampler, steps=args.steps)
    body = Path(args.input).read_bytes()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        proc, url = start_server(args, Path(scratch) / "data")
        rows = []
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                for k in range(args.rounds + 1):
                    start = time.perf_counter()
                    generate_case(args.input, Path(scratch) / f"cli{k}", models, options)
                    as_cli = time.perf_counter() - start
                    start = time.perf_counter()
                    generate_case(args.input, Path(scratch) / f"case{k}", models, options, preview=False)
                    generated = time.perf_counter() - start
                    served = served_seconds(client, body)
                    if k:
                        rows.append((k, as_cli, generated, served, served - generated))
        finally:
            proc.terminate()
            proc.wait(30)
    overhead = [r[4] for r in rows]
    print(machine())
    print_table(["round", "generate (CLI) s", "generate, no preview s", "served s", "overhead s"], rows)
    summary = {
        "generate_cli_median_s": statistics.median(r[1] for r in rows),
        "generate_median_s": statistics.median(r[2] for r in rows),
        "served_median_s": statistics.median(r[3] for r in rows),
        "overhead_median_s": statistics.median(overhead),
        "overhead_max_s": max(overhead),
    }
    print(", ".join(f"{k} {v:.3f}" for k, v in summary.items()), f"(load average {load:.1f} at start)")
    write_json("serve_latency", {"machine": machine(), "args": vars(args), "rows": rows, **summary, "load": load})


if __name__ == "__main__":
    main()
