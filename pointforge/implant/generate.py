"""Defective skull in, implant out: the whole PCDiff pipeline for one case or a dataset.

Stages (upstream PCDiff's inference and post-processing, github.com/pfriedri/pcdiff-implant), each timed:

1. **surface** — the defective skull's surface (marching cubes at 0.5, area-uniform
   samples, :func:`~pointforge.data.surface.surface_points`) in voxel-index
   coordinates. A scan with anisotropic voxels (SkullFix) is first resampled to
   isotropic voxels of its finest spacing, as ``pointforge data prepare`` does for
   training; every output is mapped back to the input's grid at the end.
2. **sample** — :func:`~pointforge.inference.pcdiff.complete`: the conditioning
   subsample, the same normalisation as in training, ``n`` implant proposals in
   one batched pass of the chosen sampler, mapped back to voxel coordinates.
3. **voxelize** — per proposal, the voxelizer (Shape-as-Points + DPSR,
   :func:`~pointforge.implant.voxelize.points_to_volume`) turns a fresh
   subsample of the defective skull's surface plus the proposal's implant points
   into a completed-skull volume. The skull part has ``voxelizer n_points -
   n_implant`` points, so the voxelizer sees as many points as it was trained on.
4. **postprocess** — :func:`~pointforge.implant.postprocess.implant_from_proposals`
   (dilate, majority vote, minus the defective skull, near the generated points,
   opening / largest component / median / closing / hole filling, each sized in
   millimetres as upstream's at 0.45 mm: see that module). Each proposal
   is also turned into an implant on its own (same chain, no vote and no
   dilation): their per-voxel mean is the agreement (uncertainty) map.
5. **write** — into a temporary sibling folder renamed into place at the end, so
   a folder under the final name is always complete (module :func:`generate_case`).

Outputs of one case (``EXT`` is the input's: NRRD in → NRRD out, NIfTI → NIfTI):

* ``implant.EXT`` — bool mask on the input's grid with its exact shape, spacing,
  origin, direction and kept header fields;
* ``implant.stl`` — the implant surface in millimetres in the input's physical
  space (its affine), watertight, normals outward (voxels touching only along an
  edge or a corner are joined by one filled voxel first, so the surface is a
  closed manifold; the report counts them);
* ``proposals/implant_K.EXT`` — each proposal's own implant;
* ``proposals/points.npy`` — the generated implant points, ``[n, P, 3]`` float32
  voxel indices of the input grid;
* ``uncertainty.EXT`` — float32, the fraction of proposals whose implant holds the
  voxel (1 = all agree it is implant, 0 = none; in-between values mark where
  the proposals disagree);
* ``completed_skull.EXT`` — defective skull ∪ implant;
* ``preview.png`` — skull and implant from four surgical views, the implant
  coloured by agreement;
* ``report.json`` — parameters, seed, models, timings per stage, implant volume,
  mesh checks, agreement statistics, versions.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from pointforge.data.volumes import Volume, read_binary_volume, volume_format, write_volume
from pointforge.errors import ConfigError, DataError, UserError

__all__ = [
    "GenerateOptions",
    "Models",
    "Generated",
    "load_models",
    "generate_implant",
    "generate_case",
    "generate_folder",
    "REPORT",
]

REPORT = "report.json"
_ISOTROPY_TOLERANCE = 1e-3


# --------------------------------------------------------------------------- models and options


@dataclass
class Models:
    """Everything loaded once and reused across cases."""

    pcdiff: Any  # LoadedPCDiff: (model, schedule, config)
    voxelizer: torch.nn.Module
    voxelizer_config: Any  # the voxelizer run's TrainConfig
    device: torch.device
    pcdiff_path: str
    voxelizer_path: str
    upsampler: Any = None  # TrainedUpsampler or None
    upsampler_path: str | None = None

    def describe(self) -> dict:
        cfg = self.pcdiff.config
        out = {
            "pcdiff": {"checkpoint": self.pcdiff_path, "preset": cfg.model, "n_skull": cfg.n_skull,
                       "n_implant": cfg.n_implant, "timesteps": cfg.diffusion.timesteps, "weights": self.pcdiff.weights},
            "voxelizer": {"checkpoint": self.voxelizer_path, "preset": self.voxelizer_config.task.preset,
                          "n_points": self.voxelizer_config.task.n_points},
        }
        if self.upsampler is not None:
            out["upsampler"] = {"checkpoint": self.upsampler_path, "ratio": self.upsampler.ratio}
        return out


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; one clear DeviceError for a device that is not there."""
    from pointforge.upsample_api import resolve_device as _resolve

    return _resolve(device)


def load_models(pcdiff: str | os.PathLike, voxelizer: str | os.PathLike, *, device: str = "auto",
                upsample: str | os.PathLike | None = None) -> Models:
    """Load the PCDiff and voxelizer checkpoints (and optionally an upsampler) on ``device``.

    Each loader checks that its checkpoint was written by its own task, so a
    voxelizer checkpoint given as ``--pcdiff`` (or the reverse) is one clear
    CheckpointError naming the file and the task it belongs to.
    """
    from pointforge.implant.voxelize import load_voxelizer
    from pointforge.inference.pcdiff import load_pcdiff

    dev = resolve_device(device)
    for task, path in (("pcdiff", pcdiff), ("voxelizer", voxelizer), ("upsampler", upsample)):
        if path is not None and not Path(path).is_file():
            raise UserError(f"{path}: no such file; give a checkpoint written by `pointforge train {task}`")
    loaded = load_pcdiff(pcdiff, dev)
    vox_model, vox_cfg = load_voxelizer(voxelizer, dev)
    ups = None
    if upsample is not None:
        from pointforge.upsample_api import load_upsampler

        ups = load_upsampler(upsample, dev)
    return Models(pcdiff=loaded, voxelizer=vox_model, voxelizer_config=vox_cfg, device=dev,
                  pcdiff_path=str(pcdiff), voxelizer_path=str(voxelizer), upsampler=ups,
                  upsampler_path=None if upsample is None else str(upsample))


@dataclass
class GenerateOptions:
    ensemble: int = 5
    sampler: str = "ddim"  # ddpm | ddim | dpm++2m
    steps: int | None = None  # the sampler's default when None (ddim 50, dpm++2m 20; ddpm always all T)
    seed: int = 0
    surface_points: int = 50_000  # defective-skull surface samples the conditioning is drawn from
    voxel_resolution: int | None = None  # DPSR solve grid; the voxelizer's training resolution when None
    subsample: str = "random"  # how the conditioning points are drawn: random (as in training) or fps

    def validate(self) -> None:
        from pointforge.nn.diffusion import SAMPLER_NAMES

        if isinstance(self.ensemble, bool) or not isinstance(self.ensemble, int) or self.ensemble < 1:
            raise ConfigError(f"--ensemble must be a positive integer, got {self.ensemble!r}")
        if str(self.sampler).lower() not in SAMPLER_NAMES:
            raise ConfigError(f"unknown sampler {self.sampler!r}; choose one of: {', '.join(SAMPLER_NAMES)}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be a positive integer, got {self.steps}")
        if self.surface_points < 1000:
            raise ConfigError(f"surface_points must be at least 1000, got {self.surface_points}")
        if self.subsample not in ("random", "fps"):
            raise ConfigError(f"subsample must be random or fps, got {self.subsample!r}")


# --------------------------------------------------------------------------- the pipeline


@dataclass
class Generated:
    """One case's results, all on the input's grid."""

    defective: Volume
    implant: np.ndarray  # bool
    proposals: list[np.ndarray]  # bool, one implant per proposal
    agreement: np.ndarray  # float32 in [0, 1]
    implant_points: np.ndarray  # [n, P, 3] generated implant points, input voxel coordinates
    timings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def completed(self) -> np.ndarray:
        return self.defective.data | self.implant


def _isotropic(volume: Volume) -> tuple[Volume, np.ndarray | None]:
    """The volume on isotropic voxels (finest spacing) and the work→input index scale, or itself and None."""
    from pointforge.data.prepare import resample_isotropic

    spacing = np.asarray(volume.spacing, dtype=np.float64)
    if spacing.max() / spacing.min() <= 1 + _ISOTROPY_TOLERANCE:
        return volume, None
    iso = float(spacing.min())
    mask, info = resample_isotropic(volume, iso)
    work = Volume(data=mask, spacing=(iso, iso, iso), origin=volume.origin, direction=volume.direction)
    return work, np.asarray(info["to_original_index_scale"], dtype=np.float64)


def _to_input_grid(values: np.ndarray, scale: np.ndarray | None, shape: tuple[int, int, int], *,
                   binary: bool) -> np.ndarray:
    """Map a work-grid array back to the input grid: input index p reads work index p / scale."""
    if scale is None:
        return values
    from scipy.ndimage import affine_transform

    out = affine_transform(values.astype(np.float32), 1.0 / scale, output_shape=shape, order=1, mode="nearest")
    return out >= 0.5 if binary else out.astype(np.float32)


def _inside_volume(implants: np.ndarray, shape: tuple[int, int, int], notes: list[str]) -> np.ndarray:
    """Keep each proposal's points that lie in the volume (one voxel of slack).

    A trained model's points lie on the skull; points far outside come from an
    undertrained model or an input unlike the training data. A few stray points
    are replaced by copies of inside ones (the proposals stay one array) and
    noted in the report; a proposal with fewer than half its points inside is
    an error rather than an implant.
    """
    hi = np.asarray(shape, dtype=np.float64)
    inside = ((implants >= -1.0) & (implants <= hi)).all(axis=2)  # [n, P]
    if inside.all():
        return implants
    worst = float(inside.mean(axis=1).min())
    if worst < 0.5:
        raise DataError(
            f"the PCDiff proposals fall outside the volume ({100 * (1 - worst):.0f}% of one proposal's points); "
            "the model is undertrained or this skull is unlike its training data"
        )
    fixed = implants.copy()
    for k in range(len(implants)):
        good = np.flatnonzero(inside[k])
        bad = np.flatnonzero(~inside[k])
        if bad.size:
            fixed[k, bad] = implants[k, good[np.arange(bad.size) % good.size]]
    notes.append(f"{int((~inside).sum())} generated points outside the volume were replaced by copies of inside ones")
    return fixed


def _sampler(models: Models, options: GenerateOptions):
    from pointforge.nn.diffusion import make_sampler

    return make_sampler(options.sampler, options.steps, schedule=models.pcdiff.schedule)


def generate_implant(defective: Volume, models: Models, options: GenerateOptions | None = None, *,
                     log: Callable[[str], None] | None = None,
                     progress: Callable[[str, int, int], None] | None = None,
                     proposals_mm: np.ndarray | None = None) -> Generated:
    """Run the pipeline on one defective skull (a bool :class:`Volume`, e.g. from read_binary_volume).

    ``proposals_mm`` (``[n, P, 3]`` physical coordinates) replaces PCDiff's
    proposals: the rest of the pipeline alone, e.g. fed the true implant points
    to measure what the voxelizer and clean-up can reach (the demo's oracle row).

    ``progress(stage, done, total)`` is called as sampler steps and voxelised
    proposals complete. Raises DataError when the result is empty (no implant
    survives post-processing: an input without a defect, or undertrained models).
    """
    from pointforge.data.surface import surface_points
    from pointforge.implant.postprocess import implant_from_proposals
    from pointforge.implant.voxelize import points_to_volume
    from pointforge.inference.pcdiff import complete

    options = options or GenerateOptions()
    options.validate()
    say = log or (lambda _msg: None)
    if defective.data.ndim != 3 or defective.data.dtype != bool:
        raise DataError("the defective skull must be a 3-D binary (bool) volume; read it with read_binary_volume")
    if not defective.data.any():
        raise DataError("the defective skull volume is empty (no bone voxel)")
    timings: dict[str, float] = {}
    notes: list[str] = []
    model, _, cfg = models.pcdiff
    generator = torch.Generator().manual_seed(int(options.seed))
    rng = np.random.default_rng(int(options.seed))

    t = time.perf_counter()
    work, scale = _isotropic(defective)
    if scale is not None:
        notes.append(f"resampled to isotropic {work.spacing[0]:g} mm voxels {work.shape} for the networks; outputs mapped back")
    skull_pts = surface_points(work.data, int(options.surface_points), seed=int(options.seed))
    timings["surface_s"] = time.perf_counter() - t
    say(f"surface: {len(skull_pts)} points on the defective skull ({timings['surface_s']:.1f} s)")

    t = time.perf_counter()
    sampler = _sampler(models, options)
    steps = getattr(sampler, "num_steps", None)
    if proposals_mm is None:
        implants = complete(skull_pts, model, sampler, options.ensemble, config=cfg, subsample=options.subsample,
                            generator=generator, spacing=work.spacing,
                            progress=(lambda i, n: progress("sample", i, n)) if progress else None)
        implants = np.asarray(implants, dtype=np.float64)  # [n, P, 3] work voxel coordinates
    else:
        implants = work.physical_to_voxel(np.asarray(proposals_mm, dtype=np.float64).reshape(-1, 3)).reshape(np.shape(proposals_mm))
    timings["sample_s"] = time.perf_counter() - t
    say(f"sample: {options.ensemble} proposals × {cfg.n_implant} points, {options.sampler}"
        f"{'' if steps is None else f' {steps} steps'} ({timings['sample_s']:.1f} s)")

    implants = _inside_volume(implants, work.shape, notes)

    t = time.perf_counter()
    dense = implants
    if models.upsampler is not None:
        from pointforge.upsample_api import upsample_points

        dense = _inside_volume(np.stack([upsample_points(models.upsampler, p) for p in implants]), work.shape, notes)
        timings["upsample_s"] = time.perf_counter() - t
        t = time.perf_counter()
    n_vox_skull = max(int(models.voxelizer_config.task.n_points) - dense.shape[1], cfg.n_skull)
    completed = []
    for k, proposal in enumerate(dense):
        take = rng.choice(len(skull_pts), size=min(n_vox_skull, len(skull_pts)), replace=False)
        points = np.concatenate([skull_pts[take], proposal], axis=0)
        vol = points_to_volume(models.voxelizer, points, work, resolution=options.voxel_resolution, device=models.device)
        completed.append(vol.data)
        if progress:
            progress("voxelize", k + 1, len(dense))
    timings["voxelize_s"] = time.perf_counter() - t
    say(f"voxelize: {len(completed)} completed skulls ({timings['voxelize_s']:.1f} s)")

    t = time.perf_counter()
    implant, _ = implant_from_proposals(completed, work.data, dense.reshape(-1, 3), spacing=work.spacing)
    own = [implant_from_proposals([c], work.data, p, dilate=0, spacing=work.spacing)[0] for c, p in zip(completed, dense)]
    agreement = np.mean(own, axis=0, dtype=np.float32) if own else np.zeros(work.shape, np.float32)
    implant = _to_input_grid(implant, scale, defective.shape, binary=True)
    own = [_to_input_grid(m, scale, defective.shape, binary=True) for m in own]
    agreement = _to_input_grid(agreement, scale, defective.shape, binary=False)
    implant &= ~defective.data  # resampling back must not put implant voxels into bone
    timings["postprocess_s"] = time.perf_counter() - t
    if not implant.any():
        raise DataError(
            "no implant survived post-processing (the proposals do not close a defect in this skull); "
            "check that the input has a defect, or train the models longer"
        )
    say(f"postprocess: implant of {int(implant.sum())} voxels ({timings['postprocess_s']:.1f} s)")
    points_in = implants if scale is None else implants * scale[None, None, :]
    return Generated(defective=defective, implant=implant, proposals=own, agreement=agreement,
                     implant_points=points_in.astype(np.float32), timings=timings, notes=notes)


# --------------------------------------------------------------------------- writing one case


def _suffix_of(path: Path) -> str:
    return ".nii.gz" if str(path).lower().endswith(".nii.gz") else (".nii" if volume_format(path) == "nifti" else ".nrrd")


def _mesh_checks(mesh) -> dict:
    import trimesh

    components = trimesh.graph.connected_components(mesh.face_adjacency, nodes=np.arange(len(mesh.faces)))
    watertight = bool(mesh.is_watertight)
    return {
        "watertight": watertight,
        "winding_consistent": bool(mesh.is_winding_consistent),
        "outward_normals": bool(watertight and mesh.volume > 0),
        "components": int(len(components)),
        "vertices": int(len(mesh.vertices)),
        "faces": int(len(mesh.faces)),
        "volume_cm3": round(float(mesh.volume) / 1000.0, 3) if watertight else None,
        "units": "mm",
    }


def _versions() -> dict:
    import scipy
    import skimage
    import trimesh

    from pointforge import __version__

    return {"pointforge": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "scipy": scipy.__version__, "scikit-image": skimage.__version__, "trimesh": trimesh.__version__,
            "python": platform.python_version()}


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_case(result: Generated, folder: Path, *, suffix: str, report: dict) -> dict:
    """Write every output of one case into ``folder`` (which the caller renames into place);
    returns ``report`` completed with what was written. The caller writes report.json last."""
    from pointforge.data.surface import make_well_composed
    from pointforge.implant.export import Layer, render_preview
    from pointforge.implant.voxelize import field_to_mesh

    t = time.perf_counter()
    ref = result.defective
    folder.mkdir(parents=True, exist_ok=True)
    files = {"implant": f"implant{suffix}", "uncertainty": f"uncertainty{suffix}",
             "completed_skull": f"completed_skull{suffix}", "mesh": "implant.stl", "preview": "preview.png",
             "proposals": [f"proposals/implant_{k}{suffix}" for k in range(len(result.proposals))],
             "points": "proposals/points.npy"}
    write_volume(folder / files["implant"], ref.with_data(result.implant))
    for rel, mask in zip(files["proposals"], result.proposals):
        write_volume(folder / rel, ref.with_data(mask))
    np.save(folder / files["points"], result.implant_points)
    write_volume(folder / files["uncertainty"], ref.with_data(result.agreement.astype(np.float32)))
    write_volume(folder / files["completed_skull"], ref.with_data(result.completed))
    # A printable mesh must be a closed 2-manifold: implant voxels that touch only
    # along an edge or at a corner give marching cubes non-manifold edges. The
    # mesh is made from the implant with one voxel filled per such configuration
    # (a handful, at the rim; counted in the report); the NRRD keeps the implant
    # itself, disjoint from the skull.
    solid = make_well_composed(result.implant.copy())
    mesh = field_to_mesh(solid, ref)
    mesh.export(folder / files["mesh"], file_type="stl")
    spacing = tuple(float(s) for s in ref.spacing)
    render_preview(folder / files["preview"], [
        Layer(ref.data, (0.89, 0.85, 0.76), 1.0, "defective skull"),
        Layer(result.implant, (0.95, 0.45, 0.1), 1.0, "implant (colour: agreement of proposals, yellow = all)",
              values=result.agreement, cmap="plasma"),
    ], spacing=spacing, title=report.get("title", ""))
    result.timings["write_s"] = time.perf_counter() - t

    inside = result.agreement[result.implant]
    voxel_mm3 = float(np.prod(spacing))
    report.update({
        "outputs": files,
        "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
        "implant": {"voxels": int(result.implant.sum()),
                    "volume_cm3": round(int(result.implant.sum()) * voxel_mm3 / 1000.0, 3),
                    "shape": list(ref.shape), "spacing_mm": list(spacing), "origin_mm": [float(o) for o in ref.origin]},
        "mesh": {**_mesh_checks(mesh), "voxels_filled_for_manifold": int(solid.sum() - result.implant.sum())},
        "agreement": {"meaning": "fraction of proposals whose own implant contains the voxel",
                      "mean_in_implant": round(float(inside.mean()), 4) if inside.size else None,
                      "unanimous_fraction_in_implant": round(float((inside >= 1.0).mean()), 4) if inside.size else None},
        "notes": result.notes,
        "versions": _versions(),
    })
    return report


def _partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _remove_stale_partials(out: Path) -> None:
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


def case_done(out: Path) -> bool:
    """A case folder is complete exactly when its report.json exists (written last, then renamed in)."""
    return (out / REPORT).is_file()


def generate_case(input_path: str | os.PathLike, out: str | os.PathLike, models: Models,
                  options: GenerateOptions | None = None, *, overwrite: bool = False,
                  log: Callable[[str], None] | None = None,
                  progress: Callable[[str, int, int], None] | None = None, title: str = "",
                  proposals_mm: np.ndarray | None = None) -> dict:
    """Generate the implant for the defective skull at ``input_path`` into the folder ``out``.

    All outputs are written into a hidden sibling folder that is renamed to
    ``out`` only once complete; a failure leaves ``out`` as it was. An existing
    ``out`` is refused unless ``overwrite``. Returns the report.
    """
    options = options or GenerateOptions()
    options.validate()
    input_path, out = Path(input_path), Path(out)
    steps = getattr(_sampler(models, options), "num_steps", None)  # a sampler/steps mismatch fails before any work
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it, or choose another --out")
    suffix = _suffix_of(input_path)
    t0 = time.perf_counter()
    defective = read_binary_volume(input_path)
    load_s = time.perf_counter() - t0
    result = generate_implant(defective, models, options, log=log, progress=progress, proposals_mm=proposals_mm)
    result.timings = {"read_s": load_s, **result.timings}
    report = {
        "input": str(input_path),
        "title": title or f"{input_path.name}: generated implant",
        "parameters": {**asdict(options), "sampler_steps": steps,
                       "device": str(models.device)},
        "seed": options.seed,
        "models": models.describe(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    partial = _partial_dir(out)
    try:
        write_case(result, partial, suffix=suffix, report=report)
        report["timings_s"]["total_s"] = round(time.perf_counter() - t0, 3)
        (partial / REPORT).write_text(json.dumps(report, indent=1, default=_json_default))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(partial, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, out)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return report


# --------------------------------------------------------------------------- a whole dataset


@dataclass
class FolderCase:
    case_id: str
    defect: str
    source: Path


def cases_of(root: str | os.PathLike, split: str = "test") -> list[FolderCase]:
    """The defective skulls to process under ``root``.

    A prepared dataset (``cases.csv``): the cases of ``split``, each read from the
    raw volume its surface points were prepared from. A raw dataset in the
    SkullBreak or SkullFix layout: every defective skull (a raw dataset has no
    split: ``test``, the default, and ``all`` both mean every case there; asking
    for ``train`` or ``val`` is an error).
    """
    from pointforge.data.skulls import PreparedDataset, list_cases

    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder")
    if (root / "cases.csv").is_file():
        data = PreparedDataset(root)
        chosen = data.split(split, require=("defective",))
        if not chosen:
            raise DataError(f"{root}: the prepared dataset has no case in split '{split}'")
        out = []
        for case in chosen:
            source = data.meta(case.defective).get("source")
            if not source:
                raise DataError(f"{root}: case {case.case_id} does not record its source volume; re-run prepare")
            out.append(FolderCase(case.case_id, case.defect, Path(source)))
        return out
    if split not in ("all", "test"):
        raise ConfigError(f"{root} is a raw dataset, which has no {split} split; prepare it first "
                          "(pointforge data prepare) or leave --split out to process every case")
    _, raw = list_cases(root)
    cases = [FolderCase(c.case_id, c.defect, Path(c.defective)) for c in raw if c.defective is not None]
    if not cases:
        raise DataError(f"{root}: no defective skull found")
    return cases


@dataclass
class FolderResult:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # complete from an earlier run
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def generate_folder(root: str | os.PathLike, out: str | os.PathLike, models: Models,
                    options: GenerateOptions | None = None, *, split: str = "test",
                    log: Callable[[str], None] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> FolderResult:
    """Every case of ``root`` (see :func:`cases_of`) into ``out/<case_id>/``.

    Resumable: a case whose folder is complete is skipped. One failing case is
    logged and recorded and never stops the others. ``out/summary.json`` lists
    what was done, skipped and failed (with the error).
    """
    from pointforge.atomic import atomic_write_text

    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    cases = cases_of(root, split)
    out = Path(out)
    result = FolderResult()
    for k, case in enumerate(cases):
        target = out / case.case_id
        if case_done(target):
            result.skipped.append(case.case_id)
        else:
            try:
                generate_case(case.source, target, models, options, overwrite=target.exists(),
                              title=f"{case.case_id} ({case.defect})")
                result.done.append(case.case_id)
            except Exception as err:  # noqa: BLE001 - one case must never stop the others
                message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                if not isinstance(err, UserError):
                    message = f"{type(err).__name__}: {message}"
                    say(traceback.format_exc().rstrip())
                result.failed[case.case_id] = message
                say(f"case {case.case_id} failed: {message}")
        if progress:
            progress(k + 1, len(cases))
    result.seconds = time.perf_counter() - t0
    atomic_write_text(out / "summary.json", json.dumps(asdict(result), indent=1))
    return result
