"""One paper-config implant, stage by stage: seconds and peak memory of `pointforge generate` on one case.

What runs is :func:`pointforge.implant.case.generate_case` (everything
`pointforge generate` does for one case: read the NRRD, surface, sample,
voxelize, post-process, write every output it writes by default, which leaves out
the pictures: ``--pictures`` adds preview.png and view.html as ``generate --pictures``
does) on a synthetic 512³ SkullBreak-like
case (0.45 mm voxels, a ``random_1`` defect, drawn from ``--seed``) with the
paper's configuration: PVCNN2 ``paper`` preset with 27,648 skull + 3,072
implant points and T = 1000, ``--ensemble`` proposals (default 5) sampled in
one batch, and the ``paper`` voxelizer solving at 512³.

Weights. ``--pcdiff``/``--voxelizer`` take trained (or ``ckpt import-pcdiff``
imported) checkpoints. Without them the networks are the paper presets with
random weights, written to a temporary folder: their cost is the trained
networks' cost, but their outputs are noise, and noise makes the later stages
unrepresentative (proposals scattered over the volume, a voxelized blob). So
with random weights each network is wrapped to return what an ideal network
would, after running in full: PCDiff's denoiser returns the exact noise of the
case's true implant (so the sampler lands on it), the voxelizer returns the
true surface normals of the complete skull at its points. ``--raw-outputs``
keeps the random outputs instead.

Teacher and student. Each run times the teacher's pipeline (``--sampler``/``--steps``,
default `generate`'s DDIM-7) and its few-step student's (``--student``, a
``pointforge train pcdiff_student`` checkpoint; without one, a student of the
random teacher with ``--student-calls`` calls, idealised the same way, so both
land on the same implant), alternated ``--repeats`` times; it prints both
tables of medians, the stages side by side, the ratio student / teacher end to
end and how many voxels the two implants differ by (``--no-student``: the
teacher alone).

Stages (the timings :func:`generate_implant` and :func:`write_case` record):
read, surface, sample (also seconds per sampler step: the first, and the
median of the rest), voxelize (per proposal), postprocess (split into the vote
with its clean-up, and the proposals' own implants with the agreement map),
write (with each part's own seconds: the 8 volumes, the STL and, with
``--pictures``, the preview and the 3-D view; they run side by side), and the end-to-end total. Peak memory per stage is the resident high-water mark
restarted at each stage's start (Linux ``/proc/self/clear_refs``), so each
stage's figure is its own.

Threads: ``--threads`` (default: the cores this process may run on,
what `pointforge generate` uses,
:func:`pointforge.devices.available_cores`). The same stages run on CUDA with
``--device cuda``: THAT BRANCH HAS NOT BEEN RUN (no GPU was available; the
issue's goal there is 20 s on an H100).

    python bench/paper_pipeline.py [--sampler ddim --steps 10] [--ensemble 5] [--threads N] [--repeats 3]
                                   [--pcdiff CK --voxelizer CK --student CK] [--student-calls 2]
                                   [--no-student] [--pictures] [--raw-outputs] [--label NAME] [--keep DIR] [--device cpu|cuda]

Writes ``bench/results/paper_pipeline[-LABEL].json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from _common import machine, print_table, proc_status_mb, reset_peak, write_json
from pointforge.config.coercion import to_dict
from pointforge.data.skulls.normalization import bbox_normalization
from pointforge.data.surface import surface_points
from pointforge.data.synthetic.defects import make_defect
from pointforge.data.synthetic.domes import make_skull
from pointforge.data.volumes import Volume, write_volume
from pointforge.devices import use_threads
from pointforge.implant.case import generate_case
from pointforge.implant.models import Models, load_models
from pointforge.implant.options import GenerateOptions
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.pcdiff.dataset import HALF_EXTENT
from pointforge.train.checkpoint import format as ck

REPO = Path(__file__).resolve().parent.parent
STAGES = ("read", "surface", "sample", "voxelize", "postprocess", "write")
# Within postprocess and write (the parts of each run side by side: their sum exceeds the stage).
PARTS = ("vote_s", "agreement_s", "write_volumes_s", "write_mesh_s", "write_preview_s", "write_view_s")


# --------------------------------------------------------------------------- the case and the networks


def make_case(folder: Path, size: int, seed: int) -> tuple[Path, np.ndarray, np.ndarray]:
    """A synthetic SkullBreak-like case written as NRRD: (its path, the complete skull, the true implant)."""
    rng = np.random.default_rng(seed)
    skull, spacing = make_skull(size, rng)
    implant = make_defect(skull, "random_1", rng, spacing)
    path = folder / "defective.nrrd"
    write_volume(path, Volume(data=skull & ~implant, spacing=spacing, origin=(0.0, 0.0, 0.0), direction=np.eye(3)))
    return path, skull, implant


def random_checkpoint(task: str, config: str, path: Path) -> Path:
    """A checkpoint of ``config``'s network with random (seeded) weights."""
    cfg = load_train_config(task, REPO / "pointforge" / "configs" / task / config)
    torch.manual_seed(0)
    model = get_task(task).build_model(cfg.task)
    ck.save_checkpoint(path, {"task": task, "config": to_dict(cfg), "model": ck.model_state(model)})
    return path


def random_student(teacher: Path, calls: int, path: Path) -> Path:
    """A few-step student checkpoint of ``teacher`` (same weights, ``calls`` DDIM calls): what
    ``pointforge train pcdiff_student`` writes, loaded the same way; its cost per call is the teacher's."""
    preset = REPO / "pointforge" / "configs" / "pcdiff_student" / "demo.yaml"
    cfg = load_train_config("pcdiff_student", preset, [f"task.teacher={teacher}", f"task.calls={calls}"])
    ckpt = ck.load_checkpoint(teacher)
    config = to_dict(cfg)
    config["task"]["teacher_task"] = ckpt["config"]["task"]
    ck.save_checkpoint(path, {"task": "pcdiff_student", "config": config, "model": ckpt["model"]})
    return path


class IdealDenoiser(nn.Module):
    """Runs the PCDiff network in full, then returns the exact noise of the true implant (ε-prediction).

    The true implant is normalised as :func:`~pointforge.implant.proposals.complete`
    normalises the conditioning subsample; the bounding box of all the skull's
    surface points stands in for the subsample's (within a voxel of it).
    """

    def __init__(self, net: nn.Module, schedule, implant_vox: np.ndarray, skull_vox: np.ndarray):
        super().__init__()
        self.net, self.schedule = net, schedule
        norm = bbox_normalization(skull_vox, HALF_EXTENT)
        self.register_buffer("x0", torch.from_numpy(norm.apply(implant_vox).astype(np.float32)).T.contiguous())

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.net(x, t)
        x_gen = x[:, :, -self.x0.shape[1] :]
        a = self.schedule.coefficient("sqrt_alphas_cumprod", t, x_gen)
        b = self.schedule.coefficient("sqrt_one_minus_alphas_cumprod", t, x_gen)
        return (x_gen - a * self.x0.to(x_gen)) / b


class IdealNormals(nn.Module):
    """Runs the voxelizer network in full, then returns its input points, unmoved, with the true surface normals.

    The true normals are computed before anything is timed, for every point the
    pipeline can hand the voxelizer (the skull's surface samples and the true
    implant's points): minus the Gaussian-weighted first moment of the complete
    skull's mask in a 7³ window around each (the smoothed mask's gradient points
    into bone), normalised. A call looks its points up (nearest of those), so
    the wrapper adds milliseconds, not the stencil's seconds, to the stage.
    """

    def __init__(self, net: nn.Module, complete: np.ndarray, candidates_vox: np.ndarray):
        super().__init__()
        from scipy.spatial import cKDTree

        self.net, self.cfg, self.side = net, net.cfg, max(complete.shape)
        self.normals = torch.from_numpy(_stencil_normals(complete, candidates_vox).astype(np.float32))
        self.tree = cKDTree(candidates_vox / self.side)

    def oriented_points(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moved, _ = self.net.oriented_points(points)
        k = moved.shape[1] // points.shape[1]
        _, nearest = self.tree.query(points[0].detach().cpu().double().numpy())  # CUDA points too
        normals = self.normals[torch.from_numpy(nearest)].to(points)
        return points.repeat_interleave(k, dim=1), normals.repeat_interleave(k, dim=0)[None]


def _stencil_normals(mask: np.ndarray, points_vox: np.ndarray) -> np.ndarray:
    r = np.arange(-3, 4)
    offsets = np.stack(np.meshgrid(r, r, r, indexing="ij"), axis=-1).reshape(-1, 3)
    weights = np.exp(-(offsets**2).sum(axis=1) / (2 * 1.5**2))[:, None] * offsets
    vox = np.rint(points_vox).astype(np.int64)
    hi = np.asarray(mask.shape) - 1
    normals = np.zeros(vox.shape, dtype=np.float64)
    for offset, weight in zip(offsets, weights):
        idx = np.clip(vox + offset, 0, hi)
        normals -= mask[idx[:, 0], idx[:, 1], idx[:, 2]][:, None] * weight
    return normals / (np.linalg.norm(normals, axis=1, keepdims=True) + 1e-12)


def idealise(models: Models, complete: np.ndarray, implant: np.ndarray, seed: int) -> Models:
    """``models`` with both networks wrapped to give an ideal network's outputs (module docs)."""
    defective = complete & ~implant
    skull_pts = surface_points(defective, 50_000, seed=seed)  # what generate_implant samples (same seed)
    implant_pts = surface_points(implant, models.pcdiff.config.n_implant, seed=seed)
    denoiser = IdealDenoiser(models.pcdiff.model, models.pcdiff.schedule, implant_pts, skull_pts).eval()
    pcdiff = dataclasses.replace(models.pcdiff, model=denoiser)
    normals = IdealNormals(models.voxelizer, complete, np.concatenate([skull_pts, implant_pts]))
    return dataclasses.replace(models, pcdiff=pcdiff, voxelizer=normals)


# --------------------------------------------------------------------------- timing one case


class StageClock:
    """Stage boundaries from generate_case's callbacks: each stage's peak memory, per-step and per-proposal times."""

    def __init__(self) -> None:
        self.peaks: dict[str, float | None] = {}
        self.at: dict[str, float] = {}
        self.ticks: dict[str, list[float]] = {"sample": [], "voxelize": []}
        self.start = time.perf_counter()

    def boundary(self, stage: str) -> None:
        self.peaks[stage] = proc_status_mb("VmHWM")
        self.at[stage] = time.perf_counter()
        reset_peak()

    def log(self, message: str) -> None:
        stage = message.split(":", 1)[0]
        if stage in STAGES:
            self.boundary(stage)
        print(f"  {message}", flush=True)

    def progress(self, stage: str, done: int, total: int) -> None:
        self.ticks.setdefault(stage, []).append(time.perf_counter())


def _timed_read(clock: StageClock):
    """generate_case's reader, recording the read stage's end."""
    from pointforge.implant import case as case_module

    original = case_module.read_skull_input

    def read(path, **kwargs):
        got = original(path, **kwargs)
        clock.boundary("read")
        return got

    case_module.read_skull_input = read  # type: ignore[assignment]


def run_case(models: Models, case: Path, out: Path, options: GenerateOptions, pictures: bool) -> dict:
    """One case through generate_case: seconds and peak MB per stage, seconds per sampler step and per proposal.
    ``pictures``: with preview.png and view.html (``generate --pictures``; by default it writes neither)."""
    clock = StageClock()
    _timed_read(clock)
    reset_peak()
    report = generate_case(
        case,
        out,
        models,
        options,
        overwrite=True,
        log=clock.log,
        progress=clock.progress,
        title="paper pipeline",
        preview=pictures,
        view=pictures,
    )
    clock.boundary("write")
    timings = report["timings_s"]
    return {
        "seconds": {s: timings.get(f"{s}_s") for s in STAGES} | {"total": timings["total_s"]},
        "parts_s": {k[:-2]: v for k, v in timings.items() if k in PARTS},
        "peak_mb": dict(clock.peaks),
        "step_s": np.diff([clock.at["surface"], *clock.ticks["sample"]]).tolist(),
        "proposal_s": np.diff([clock.at["sample"], *clock.ticks["voxelize"]]).tolist(),
        "implant_voxels": report["implant"]["voxels"],
        "notes": report.get("notes", []),
    }


# --------------------------------------------------------------------------- driver


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pcdiff", type=Path, help="a PCDiff checkpoint (default: the paper preset, random weights)")
    parser.add_argument("--voxelizer", type=Path, help="a voxelizer checkpoint (default: the paper preset, random)")
    parser.add_argument("--student", type=Path, help="its few-step student (default: one of --student-calls calls)")
    parser.add_argument("--student-calls", type=int, default=1, help="calls of the default student (random weights)")
    parser.add_argument("--no-student", action="store_true", help="time the teacher alone")
    parser.add_argument(
        "--pictures", action="store_true", help="also write preview.png and view.html (generate --pictures)"
    )
    parser.add_argument("--raw-outputs", action="store_true", help="keep random networks' outputs (no ideal wrapper)")
    parser.add_argument("--sampler", default="ddim", help="the teacher's sampler")
    parser.add_argument("--steps", type=int, default=None, help="the teacher's sampler steps (default: generate's)")
    parser.add_argument("--ensemble", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, alternated; the table shows medians")
    parser.add_argument("--size", type=int, default=512, help="the synthetic case's side in voxels")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the available cores)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the CUDA branch has not been run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="suffix of the JSON record's name (e.g. before/after)")
    parser.add_argument("--keep", type=Path, help="keep the case, checkpoints and outputs in this folder")
    return parser.parse_args()


def _variants(args: argparse.Namespace, work: Path, complete: np.ndarray, implant: np.ndarray) -> dict:
    """The teacher (its sampler) and, unless ``--no-student``, its student: {name: (models, options)}."""
    pcdiff = args.pcdiff or random_checkpoint("pcdiff", "paper.yaml", work / "pcdiff-paper-random.pt")
    voxelizer = args.voxelizer or random_checkpoint("voxelizer", "paper.yaml", work / "voxelizer-paper-random.pt")
    ideal = args.pcdiff is None and args.voxelizer is None and not args.raw_outputs
    common = dict(ensemble=args.ensemble, seed=args.seed)
    chosen = {"teacher": (pcdiff, GenerateOptions(sampler=args.sampler, steps=args.steps, **common))}
    if not args.no_student:
        student = args.student or random_student(pcdiff, args.student_calls, work / "pcdiff-student-random.pt")
        chosen["student"] = (student, GenerateOptions(sampler="ddim", steps=None, **common))
    variants = {}
    for name, (checkpoint, options) in chosen.items():
        models = load_models(checkpoint, voxelizer, device=args.device)
        variants[name] = (idealise(models, complete, implant, args.seed) if ideal else models, options)
    return variants


def _dsc(out: Path, implant: np.ndarray) -> float:
    from pointforge.data.volumes import read_binary_volume

    found = read_binary_volume(out / "implant.nrrd").data
    return float(2 * (found & implant).sum() / max(int(found.sum() + implant.sum()), 1))


def _implant(out: Path) -> np.ndarray:
    from pointforge.data.volumes import read_binary_volume

    return read_binary_volume(out / "implant.nrrd").data


def median_run(runs: list[dict]) -> dict:
    """Per stage and part, the median seconds over ``runs``; the first run's peaks and per-step times."""
    first = runs[0]
    return {
        **first,
        "seconds": {k: statistics.median(r["seconds"][k] for r in runs) for k in first["seconds"]},
        "parts_s": {k: statistics.median(r["parts_s"][k] for r in runs) for k in first["parts_s"]},
    }


def report_table(result: dict) -> None:
    total = result["seconds"]["total"]
    rows = [[s, result["seconds"][s], 100 * result["seconds"][s] / total, result["peak_mb"].get(s)] for s in STAGES]
    rows.append(["end to end", total, 100.0, max(v for v in result["peak_mb"].values() if v is not None)])
    print_table(["stage", "seconds", "% of total", "peak MB"], rows)
    steps = result["step_s"]
    if steps:
        rest = statistics.median(steps[1:]) if len(steps) > 1 else float("nan")
        print(f"sampler: {len(steps)} steps, first {steps[0]:.2f} s, median of the rest {rest:.2f} s")
    print(f"voxelize per proposal: {', '.join(f'{s:.2f}' for s in result['proposal_s'])} s")
    print("parts: " + ", ".join(f"{k} {v:.2f} s" for k, v in result["parts_s"].items()))


def compare_table(teacher: dict, student: dict) -> float:
    """Both pipelines' median stage seconds side by side; returns student / teacher end to end."""
    rows = [[s, teacher["seconds"][s], student["seconds"][s]] for s in (*STAGES, "total")]
    print_table(["stage (median s)", "teacher", "student"], rows)
    ratio = student["seconds"]["total"] / teacher["seconds"]["total"]
    print(f"student / teacher end to end: {ratio:.2f}")
    return ratio


def main() -> None:
    args = parse_args()
    threads = use_threads(args.threads)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        case, complete, implant = make_case(work, args.size, args.seed)
        print(
            f"case: {args.size}³ synthetic skull, implant {int(implant.sum())} voxels ({time.perf_counter() - t:.0f} s)"
        )
        variants = _variants(args, work, complete, implant)
        for k in range(args.repeats):
            for name, (models, options) in variants.items():
                print(f"{name}, run {k + 1} of {args.repeats}:")
                result = run_case(models, case, work / f"out-{name}", options, pictures=args.pictures)
                result["dsc_to_true_implant"] = _dsc(work / f"out-{name}", implant)
                runs.setdefault(name, []).append(result)
        differ = None
        if "student" in variants:  # the same implant voxel for voxel when the networks' outputs are the same
            differ = int((_implant(work / "out-teacher") != _implant(work / "out-student")).sum())
    medians = {name: median_run(found) for name, found in runs.items()}
    for name, result in medians.items():
        print(f"\n{name} ({args.repeats} run(s), medians):")
        report_table(result)
        print(f"DSC of the result against the true implant: {result['dsc_to_true_implant']:.3f}")
    ratio = compare_table(medians["teacher"], medians["student"]) if "student" in medians else None
    if differ is not None:
        print(f"voxels where the two implants differ: {differ}")
    record = {
        "machine": machine(),
        "threads": threads,
        "device": args.device,
        "argv": sys.argv[1:],
        "ideal_outputs": args.pcdiff is None and args.voxelizer is None and not args.raw_outputs,
        "variants": {
            name: {
                "options": dataclasses.asdict(variants[name][1]),
                "models": variants[name][0].describe(),
                "median": medians[name],
                "runs": runs[name],
            }
            for name in variants
        },
        "student_over_teacher": ratio,
        "implant_voxels_differing": differ,
    }
    name = "paper_pipeline" + (f"-{args.label}" if args.label else "")
    print(f"wrote {write_json(name, record)}")


if __name__ == "__main__":
    main()
