"""Voxelizer inference on one completed skull at 256³ and 512³: time and peak memory per stage.

The skull is synthetic, 512³ voxels of 0.45 mm (SkullBreak's grid), and the
pipeline is what ``pointforge.inference.voxelizer`` does to a completed cloud:

1. network   the `paper` VoxelizerNet turns 30,720 points into 7 × 30,720
             oriented points (random weights, or ``--checkpoint``; the cost does
             not depend on the weights)
2. dpsr      the Poisson solve on the R³ grid (σ = 2 · R / 512, as
             ``points_to_field`` scales it for a model trained at 512³)
3. resample  trilinear interpolation of the field at every voxel of the 512³
             volume, threshold at 0 (``resample_inside``)
4. mesh      marching cubes on the 512³ result, vertices to millimetres
             (``field_to_mesh``)

plus ``pipeline``: ``points_to_volume`` and ``field_to_mesh`` in one process,
for the API's own peak. Without a trained 512³ model the solve gets the
oriented points from the skull's surface itself (exact normals at 215,040
surface samples, as many as the network would give): an untrained network's
field is noise, and marching cubes over noise would time nothing real. With
``--checkpoint`` the network's own oriented points are used instead.

Every stage runs in a fresh process: "working MiB" is the stage's peak
resident memory (the high-water mark, restarted once imports and inputs are
in) minus the resident size at that moment.
Times are wall-clock (the fastest of ``--rounds`` fresh processes); "CPU s" is
that process's user + system time. Stage inputs are written to a scratch
folder by the stage before, outside the timed region.

    python bench/voxelizer.py                  # 256 and 512, 2 threads
    python bench/voxelizer.py --res 256 --threads 1 --rounds 3
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

from _common import machine, print_table, proc_status_mb, reset_peak, write_json  # noqa: E402

SIZE = 512
N_INPUT = 30_720  # upstream's completed cloud: 27,648 skull + 3,072 implant points
STAGES = ("network", "dpsr", "resample", "mesh", "pipeline")
UPSTREAM_A100_512_S = (
    23.0  # upstream PCDiff's voxelisation of one case at 512³ on an A100 (github.com/pfriedri/pcdiff-implant)
)


# --------------------------------------------------------------------------- inputs


def make_inputs(work: Path, seed: int) -> dict:
    """A 512³ synthetic skull, its completed cloud (voxel indices) and exact oriented surface samples."""
    import trimesh

    from pointforge.data.surface import volume_to_mesh
    from pointforge.data.synthetic.domes import make_skull

    mask, spacing = make_skull(SIZE, np.random.default_rng(seed))
    verts, faces = volume_to_mesh(mask)
    mesh = trimesh.Trimesh(verts, faces, process=False)
    cloud, _ = trimesh.sample.sample_surface(mesh, N_INPUT, seed=seed)
    oriented, face = trimesh.sample.sample_surface(mesh, 7 * N_INPUT, seed=seed + 1)
    np.save(work / "mask.npy", mask)
    np.save(work / "cloud.npy", cloud.astype(np.float32))
    np.save(work / "oriented.npy", np.concatenate([oriented, mesh.face_normals[face]], axis=1).astype(np.float32))
    info = {
        "shape": [SIZE] * 3,
        "spacing": list(spacing),
        "origin": [-(SIZE - 1) * s / 2 for s in spacing],
        "voxels": int(mask.sum()),
        "seed": seed,
    }
    (work / "info.json").write_text(json.dumps(info))
    return info


def _reference(work: Path, with_mask: bool = False):
    from pointforge.data.volumes import Volume

    info = json.loads((work / "info.json").read_text())
    data = np.load(work / "mask.npy") if with_mask else np.zeros(info["shape"], dtype=bool)
    return Volume(data=data, spacing=tuple(info["spacing"]), origin=tuple(info["origin"]))


class GivenOrientation:
    """Stands in for the network in ``pipeline``: the oriented points it would produce, given."""

    def __init__(self, points, normals, cfg):
        import torch

        self.points, self.normals, self.cfg = points, normals, cfg
        self._params = [torch.zeros(1)]
        self.training = False

    def parameters(self):
        return iter(self._params)

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def oriented_points(self, _points):
        return self.points, self.normals


def _oriented(work: Path, res: int):
    import torch

    data = np.load(work / ("network_oriented.npy" if (work / "network_oriented.npy").exists() else "oriented.npy"))
    if data[:, :3].max() > 1.0:  # surface samples are voxel indices; the network's are unit coordinates
        data[:, :3] = np.clip(data[:, :3] / SIZE, 0.0, np.nextafter(np.float32(1), np.float32(0)))
    t = torch.from_numpy(data)[None]
    return t[..., :3].contiguous(), t[..., 3:].contiguous()


# --------------------------------------------------------------------------- one stage in this process


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    peak_mb = proc_status_mb("VmHWM")
    return int(peak_mb * 2**20) if peak_mb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_stage(stage: str, res: int, work: Path, threads: int, checkpoint: str | None) -> dict:
    import torch

    torch.set_num_threads(threads)
    from pointforge.implant.voxelize import field_to_mesh, points_to_volume, resample_inside, unit_points
    from pointforge.inference.voxelizer import load_voxelizer
    from pointforge.nn.dpsr import dpsr
    from pointforge.nn.voxelizer import VoxelizerConfig, VoxelizerNet

    sigma = 2.0 * res / SIZE
    extra: dict = {}
    # Inputs first, outside the timed region.
    if stage == "network":
        model = load_voxelizer(checkpoint)[0] if checkpoint else VoxelizerNet("paper").eval()
        points = unit_points(np.load(work / "cloud.npy"), (SIZE,) * 3)
    elif stage == "dpsr":
        points, normals = _oriented(work, res)
    elif stage == "resample":
        field = torch.from_numpy(np.load(work / f"field-{res}.npy"))
    elif stage == "mesh":
        volume = np.load(work / f"volume-{res}.npy")
        reference = _reference(work)
    elif stage == "pipeline":
        points, normals = _oriented(work, res)
        stand_in = GivenOrientation(points, normals, VoxelizerConfig(dpsr_res=SIZE, dpsr_sigma=2.0))
        cloud = np.load(work / "cloud.npy")
        reference = _reference(work)
    base_rss = _rss_now()
    if not reset_peak():
        raise SystemExit("cannot reset the peak-memory counter (/proc/self/clear_refs); this benchmark needs Linux")
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with torch.no_grad():
        if stage == "network":
            moved, normals_out = model.oriented_points(points)
        elif stage == "dpsr":
            field = dpsr(points, normals, res, sigma)[0]
        elif stage == "resample":
            inside = resample_inside(field, (SIZE,) * 3)
        elif stage == "mesh":
            mesh = field_to_mesh(volume, reference)
        elif stage == "pipeline":
            result = points_to_volume(stand_in, cloud, reference, resolution=res)
            mesh = field_to_mesh(result, reference)
    seconds = time.perf_counter() - t0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = _peak_rss()
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    # Outputs for the next stage, outside the timed region.
    if stage == "network":
        extra["oriented_points"] = int(moved.shape[1])
        if checkpoint:
            np.save(work / "network_oriented.npy", torch.cat([moved, normals_out], -1)[0].numpy())
    elif stage == "dpsr":
        np.save(work / f"field-{res}.npy", field.numpy())
    elif stage == "resample":
        np.save(work / f"volume-{res}.npy", inside)
    elif stage in ("mesh", "pipeline"):
        extra.update(faces=int(len(mesh.faces)), watertight=bool(mesh.is_watertight))
    if stage == "pipeline":
        truth = _reference(work, with_mask=True).data
        extra["iou_vs_skull"] = round(float((result.data & truth).sum() / (result.data | truth).sum()), 4)
    return {
        "stage": stage,
        "res": res,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "working_mib": (peak - base_rss) / 2**20,
        "peak_mib": peak / 2**20,
        **extra,
    }


def _child(stage: str, res: int, work: Path, threads: int, checkpoint: str | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        stage,
        "--res",
        str(res),
        "--work",
        str(work),
        "--threads",
        str(threads),
    ]
    if checkpoint:
        cmd += ["--checkpoint", checkpoint]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"stage {stage} at {res}^3 failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--res", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="fresh-process rounds per stage; the fastest is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="a trained voxelizer (its oriented points feed the solve)")
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_stage(args.child, args.res[0], Path(args.work), args.threads, args.checkpoint)))
        return

    with tempfile.TemporaryDirectory(prefix="bench-voxelizer-") as scratch:
        work = Path(scratch)
        t0 = time.perf_counter()
        info = make_inputs(work, args.seed)
        print(
            f"synthetic skull {SIZE}^3, spacing {info['spacing'][0]:.3f} mm, {info['voxels']} voxels "
            f"(inputs made in {time.perf_counter() - t0:.0f} s); {args.threads} thread(s)"
        )
        records = []
        for res in args.res:
            for stage in STAGES:
                runs = [_child(stage, res, work, args.threads, args.checkpoint) for _ in range(args.rounds)]
                best = min(runs, key=lambda r: r["seconds"])
                best["working_mib"] = max(r["working_mib"] for r in runs)
                records.append(best)
                print(f"  {res}^3 {stage}: {best['seconds']:.2f} s", flush=True)

    rows = []
    for res in args.res:
        mine = [r for r in records if r["res"] == res]
        for r in mine:
            note = ", ".join(
                f"{k} {v}" for k, v in r.items() if k in ("oriented_points", "faces", "watertight", "iou_vs_skull")
            )
            rows.append([f"{res}^3", r["stage"], r["seconds"], r["cpu_seconds"], round(r["working_mib"]), note])
        stages = [r for r in mine if r["stage"] != "pipeline"]
        rows.append(
            [
                f"{res}^3",
                "sum of stages",
                sum(r["seconds"] for r in stages),
                sum(r["cpu_seconds"] for r in stages),
                "",
                "",
            ]
        )
    print()
    print(f"machine: {machine()}; torch threads {args.threads}")
    print_table(["grid", "stage", "wall s", "CPU s", "working MiB", "notes"], rows)
    by = {(r["res"], r["stage"]): r for r in records}
    if 256 in args.res and 512 in args.res:
        ratios = {s: by[(512, s)]["seconds"] / by[(256, s)]["seconds"] for s in STAGES if by[(256, s)]["seconds"] > 0}
        print("512^3 / 256^3 wall time: " + ", ".join(f"{s} {v:.2f}x" for s, v in ratios.items()))
    print(
        f"context: upstream's voxelisation at 512^3 takes about {UPSTREAM_A100_512_S:g} s on an A100 (upstream PCDiff's figure)"
    )
    path = write_json(
        "voxelizer",
        {
            "machine": machine(),
            "threads": args.threads,
            "rounds": args.rounds,
            "seed": args.seed,
            "checkpoint": args.checkpoint,
            "skull": info,
            "records": records,
            "upstream_a100_512_seconds": UPSTREAM_A100_512_S,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
