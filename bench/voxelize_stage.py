"""The paper pipeline's voxelize stage, one proposal at a time: the voxelizer network, the 512^3 solve, the threshold.

What runs is :func:`pointforge.implant.voxelize.points_to_volume` as
``generate`` calls it for each proposal (the heap kept, as ``load_pcdiff`` leaves it,
``devices.reuse_freed_memory``), on clouds of a synthetic 512^3 case made as
``bench/paper_pipeline.py`` makes it: 27,648 of the defective skull's surface samples plus
the true implant's 3,072 surface points, jittered by half a voxel for each proposal,
with the true surface normals. The ``paper`` voxelizer (random weights) runs in full
and its output is then replaced by those normals at its (unmoved) points, as the paper
bench's ideal wrapper does, so the solve sees a real skull.

Each measurement is a fresh process (``--worker``) importing ``pointforge`` from the
checkout it measures. ``--against DIR`` (e.g. ``git worktree add /tmp/base main``)
alternates that checkout's processes with this one's (bench/_common.py's harness: the
order flipping each round) and reports each one's median seconds per proposal (the first proposal of a process,
which pays for the first allocations, reported apart), their ratio, and how many
voxels of the proposals' volumes differ between the two.

    python bench/voxelize_stage.py [--rounds 3] [--proposals 4] [--against DIR] [--case FILE.npz]

The case (~30 s to make) is kept in ``--case`` (default: a temporary file) and reused.
Writes ``bench/results/voxelize_stage.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import ROOT, alternate, checkouts, fresh_process, machine, print_table, write_json

HERE = Path(__file__).resolve()
SIZE, SKULL_POINTS, IMPLANT_POINTS = 512, 27_648, 3_072


def make_clouds(path: Path, proposals: int) -> None:
    from paper_pipeline import _stencil_normals, make_case

    from pointforge.data.surface import surface_points

    with tempfile.TemporaryDirectory() as scratch:
        _, complete, implant = make_case(Path(scratch), SIZE, 0)
    skull = surface_points(complete & ~implant, 50_000, seed=0)
    true_implant = surface_points(implant, IMPLANT_POINTS, seed=0)
    rng = np.random.default_rng(1)
    clouds = []
    for _ in range(proposals):
        take = rng.choice(len(skull), size=SKULL_POINTS, replace=False)
        clouds.append(np.concatenate([skull[take], true_implant + rng.normal(0, 0.5, true_implant.shape)]))
    points = np.stack(clouds)
    normals = np.stack([_stencil_normals(complete, c) for c in points])
    np.savez(path, points=points, normals=normals, shape=np.array(complete.shape))


def worker(case_path: Path, masks_out: Path | None) -> None:
    import torch
    from torch import nn

    from pointforge.data.volumes import Volume
    from pointforge.devices import reuse_freed_memory, use_threads
    from pointforge.implant import voxelize
    from pointforge.tasks import get_task
    from pointforge.tasks.configs import load_train_config

    use_threads(None)
    reuse_freed_memory()
    case = np.load(case_path)
    shape = tuple(int(s) for s in case["shape"])
    cfg = load_train_config("voxelizer", ROOT / "pointforge" / "configs" / "voxelizer" / "paper.yaml")
    torch.manual_seed(0)
    net = get_task("voxelizer").build_model(cfg.task).eval()
    seconds: dict[str, list[float]] = {"network": [], "solve": [], "threshold": [], "proposal": []}

    class GivenNormals(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.cfg, self.normals = net, net.cfg, torch.empty(0)

        def oriented_points(self, points):
            t = time.perf_counter()
            moved, _ = self.net.oriented_points(points)
            seconds["network"].append(time.perf_counter() - t)
            k = moved.shape[1] // points.shape[1]
            return points.repeat_interleave(k, dim=1), self.normals.to(points).repeat_interleave(k, dim=0)[None]

    def timed(name, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[name].append(time.perf_counter() - t)
            return out

        return call

    voxelize.dpsr = timed("solve", voxelize.dpsr)
    voxelize.resample_inside = timed("threshold", voxelize.resample_inside)
    model = GivenNormals()
    reference = Volume(data=np.zeros(shape, bool), spacing=(0.45,) * 3, origin=(0.0,) * 3, direction=np.eye(3))
    masks = []
    for points, normals in zip(case["points"], case["normals"]):
        model.normals = torch.from_numpy(normals.astype(np.float32))
        t = time.perf_counter()
        masks.append(voxelize.points_to_volume(model, points, reference).data)
        seconds["proposal"].append(time.perf_counter() - t)
    if masks_out is not None:
        np.savez_compressed(masks_out, *masks)
    print(json.dumps(seconds))


def measure(tree: Path, case: Path, masks: Path | None) -> dict[str, list[float]]:
    return fresh_process(HERE, ["--worker", "--case", str(case)] + (["--masks", str(masks)] if masks else []), tree)


def _differing_voxels(a: Path, b: Path) -> list[int]:
    with np.load(a) as x, np.load(b) as y:
        return [int((x[k] != y[k]).sum()) for k in x.files]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--proposals", type=int, default=4, help="proposals per process")
    parser.add_argument("--against", type=Path, help="another checkout, measured in alternation with this one")
    parser.add_argument("--case", type=Path, help="the case's clouds (.npz): made there if missing, then reused")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--masks", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.case, args.masks)
        return
    with tempfile.TemporaryDirectory() as scratch:
        case = args.case or Path(scratch) / "case.npz"
        if not case.exists():
            make_clouds(case, args.proposals)
        variants = checkouts(args.against)

        def one(i: int, r: int) -> dict[str, list[float]]:
            name, tree = variants[i]
            seconds = measure(tree, case, Path(scratch) / f"masks-{i}.npz" if r == 0 else None)
            print(f"round {r + 1}: {name}: {', '.join(f'{s:.2f}' for s in seconds['proposal'])} s", flush=True)
            return seconds

        runs = alternate([name for name, _ in variants], args.rounds, one).runs
        differing = (
            _differing_voxels(Path(scratch) / "masks-0.npz", Path(scratch) / "masks-1.npz") if args.against else []
        )
    summary = {}
    for name, rs in runs.items():
        later = {k: statistics.median([v for run in rs for v in run[k][1:]]) for k in rs[0]}
        summary[name] = {"first_proposal_s": statistics.median(run["proposal"][0] for run in rs), **later}
    rows = [
        [t, s["first_proposal_s"], s["proposal"], s["network"], s["solve"], s["threshold"]] for t, s in summary.items()
    ]
    print_table(["checkout", "first s", "proposal s", "network s", "solve s", "threshold s"], rows)
    if args.against:
        ours, theirs = (summary[name] for name, _ in variants)
        print(f"proposal: {ours['proposal'] / theirs['proposal']:.2f}x of {args.against}'s time")
        print(f"voxels differing per proposal: {differing}")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    record = {"machine": machine(), "argv": sys.argv[1:], "summary": summary, "differing_voxels": differing}
    record |= {"runs": runs, "trees": {name: str(tree) for name, tree in variants}, "load_average": load}
    print(f"wrote {write_json('voxelize_stage', record)}")


if __name__ == "__main__":
    main()
