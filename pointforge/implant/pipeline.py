"""Defective skull in, implant out, in memory: the PCDiff pipeline for one case.

Stages (the PCDiff paper's pipeline, Friedrich et al., MICCAI 2023), each timed:

1. **surface** — the defective skull's surface (marching cubes at 0.5, area-uniform
   samples, :func:`~pointforge.data.surface.surface_points`) in voxel-index
   coordinates. A scan with anisotropic voxels (SkullFix) is first resampled to
   isotropic voxels of its finest spacing, as ``pointforge data prepare`` does for
   training; every output is mapped back to the input's grid at the end.
2. **sample** — :func:`~pointforge.implant.proposals.complete`: the conditioning
   subsample, the same normalisation as in training (for a model trained with
   ``task.frame``, the frame its atlas estimates around the defect), ``n``
   implant proposals in one batched pass of the chosen sampler, mapped back to
   voxel coordinates.
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
Writing a case's files is :mod:`pointforge.implant.writer`; a whole dataset,
:mod:`pointforge.implant.folder`.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from pointforge.data.prepare import resample_isotropic
from pointforge.data.surface import sample_mesh, volume_to_mesh
from pointforge.data.volumes import Volume
from pointforge.devices import available_memory_bytes, release_freed_memory, resolve_device
from pointforge.errors import CheckpointError, ConfigError, DataError, UserError
from pointforge.formats import format_bytes
from pointforge.implant.postprocess import implant_and_agreement
from pointforge.implant.proposals import complete, inside_volume, proposal_sampler
from pointforge.implant.voxelize import points_to_volume
from pointforge.inference.pcdiff import LoadedPCDiff, load_pcdiff
from pointforge.inference.upsampler import load_upsampler
from pointforge.inference.voxelizer import load_voxelizer
from pointforge.nn.diffusion.samplers.registry import SAMPLER_NAMES
from pointforge.nn.dpsr import dpsr_memory_bytes
from pointforge.nn.dpsr_grid import normalize_resolution
from pointforge.nn.pvcnn_config import FPLevel, PVCNN2Config, SALevel
from pointforge.train.checkpoint.format import load_checkpoint
from pointforge.upsampling.pipeline import upsample_points

__all__ = [
    "Models",
    "load_models",
    "GenerateOptions",
    "Generated",
    "generate_implant",
    "generate_memory_bytes",
    "check_generate_memory",
]

_ISOTROPY_TOLERANCE = 1e-3


# --------------------------------------------------------------------------- models and options


@dataclass
class Models:
    """Everything loaded once and reused across cases."""

    pcdiff: LoadedPCDiff
    voxelizer: torch.nn.Module
    voxelizer_config: Any  # the voxelizer run's TrainConfig (LoadedVoxelizer.run_config)
    device: torch.device
    pcdiff_path: str
    voxelizer_path: str
    upsampler: Any = None  # LoadedUpsampler or None
    upsampler_path: str | None = None

    def describe(self) -> dict:
        cfg = self.pcdiff.config
        out = {
            "pcdiff": {
                "checkpoint": self.pcdiff_path,
                "preset": cfg.model,
                "n_skull": cfg.n_skull,
                "n_implant": cfg.n_implant,
                "timesteps": cfg.diffusion.timesteps,
                "weights": self.pcdiff.weights,
            },
            "voxelizer": {
                "checkpoint": self.voxelizer_path,
                "preset": self.voxelizer_config.task.preset,
                "n_points": self.voxelizer_config.task.n_points,
            },
        }
        if self.upsampler is not None:
            out["upsampler"] = {"checkpoint": self.upsampler_path, "ratio": self.upsampler.ratio}
        return out


def load_models(
    pcdiff: str | os.PathLike,
    voxelizer: str | os.PathLike,
    *,
    device: str = "auto",
    upsample: str | os.PathLike | None = None,
) -> Models:
    """Load the PCDiff and voxelizer checkpoints (and optionally an upsampler) on ``device``.

    Each loader checks that its checkpoint was written by its own task, so a
    voxelizer checkpoint given as ``--pcdiff`` (or the reverse) is one clear
    CheckpointError naming the file and the task it belongs to.
    """
    dev = resolve_device(device)
    for task, path in (("pcdiff", pcdiff), ("voxelizer", voxelizer), ("upsampler", upsample)):
        if path is not None and not Path(path).is_file():
            raise UserError(f"{path}: no such file; give a checkpoint written by `pointforge train {task}`")
    with _named_flag(pcdiff, "pcdiff"):
        loaded = load_pcdiff(pcdiff, dev)
    with _named_flag(voxelizer, "voxelizer"):
        vox = load_voxelizer(voxelizer, dev)
    ups = None
    if upsample is not None:
        with _named_flag(upsample, "upsampler"):
            ups = load_upsampler(upsample, dev)
    return Models(
        pcdiff=loaded,
        voxelizer=vox.model,
        voxelizer_config=vox.run_config,
        device=dev,
        pcdiff_path=str(pcdiff),
        voxelizer_path=str(voxelizer),
        upsampler=ups,
        upsampler_path=None if upsample is None else str(upsample),
    )


FLAGS = {"pcdiff": "--pcdiff", "voxelizer": "--voxelizer", "upsampler": "--upsample"}


@contextmanager
def _named_flag(path: str | os.PathLike, task: str) -> Iterator[None]:
    """A checkpoint of another of the pipeline's tasks, given in the wrong place: name the flag it belongs to."""
    try:
        yield
    except CheckpointError:
        try:
            written_by = load_checkpoint(path).get("task")
        except UserError:
            written_by = None
        if written_by in FLAGS and written_by != task:
            raise CheckpointError(
                f"{path} is a {written_by} checkpoint, given as {FLAGS[task]}; give it as {FLAGS[written_by]}, "
                f"and as {FLAGS[task]} a checkpoint written by `pointforge train {task}`"
            ) from None
        raise


@dataclass
class GenerateOptions:
    ensemble: int = 5
    sampler: str = "ddim"  # ddpm | ddim | dpm++2m
    steps: int | None = None  # None: proposals.GENERATE_STEPS (ddim 7), else the sampler's default; ddpm always all T
    seed: int = 0
    surface_points: int = 50_000  # defective-skull surface samples the conditioning is drawn from
    voxel_resolution: int | None = None  # DPSR solve grid; the voxelizer's training resolution when None
    subsample: str = "random"  # how the conditioning points are drawn: random (as in training) or fps
    # Clean-up keeps every component of at least this fraction of the largest (1: the largest only, upstream's
    # chain). Safe below 1 because the candidate is already cut to the generated points' neighbourhood; 0.2
    # keeps both plates of a bilateral defect (docs/pcdiff.md, "Where the implant goes").
    components: float = 0.2

    def validate(self) -> None:
        if isinstance(self.ensemble, bool) or not isinstance(self.ensemble, int) or self.ensemble < 1:
            raise ConfigError(f"--ensemble must be a positive integer, got {self.ensemble!r}")
        if str(self.sampler).lower() not in SAMPLER_NAMES:
            raise ConfigError(f"unknown sampler {self.sampler!r}; choose one of: {', '.join(SAMPLER_NAMES)}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be a positive integer, got {self.steps}")
        if self.surface_points < 1000:
            raise ConfigError(f"surface_points must be at least 1000, got {self.surface_points}")
        if not 0 < self.components <= 1:
            raise ConfigError(f"--components must be a fraction in (0, 1], got {self.components}")
        if self.subsample not in ("random", "fps"):
            raise ConfigError(f"subsample must be random or fps, got {self.subsample!r}")


# --------------------------------------------------------------------------- memory


def _pvcnn_bytes_per_cloud(model: torch.nn.Module, n_points: int) -> int:
    """Activations of one cloud in one PVCNN2 forward pass (float32), summed over its stages.

    Every stage's point features and voxel grid are counted, as if all were
    alive at once (the skip connections keep most of them): an upper bound.
    """
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, PVCNN2Config):
        return 0
    total = 0
    levels: list[SALevel | FPLevel] = [*cfg.sa_levels, *cfg.fp_levels]
    for level in levels:
        widths = list(level.mlp)
        conv = level.conv
        if conv is not None:
            widths.append(conv.out_channels)
            if conv.voxel_resolution:
                total += conv.out_channels * conv.voxel_resolution**3 * 4 * 2
        total += n_points * sum(widths) * 4 * 2
    return total


def generate_memory_bytes(models: Models, options: GenerateOptions, shape: tuple[int, ...], ensemble: int) -> dict:
    """Estimated peak memory of one case with ``ensemble`` proposals: ``{"device": bytes, "host": bytes}``.

    ``device`` (the models' device): PCDiff sampling all proposals in one batch,
    plus one voxelizer DPSR solve at the chosen resolution (proposals are solved
    one at a time). ``host`` (numpy): per proposal its completed skull, its own
    implant and its row of the agreement stack (one byte per voxel each), plus
    the vote's counts and agreement map (uint16, float32).
    """
    cfg = models.pcdiff.config
    voxels = math.prod(shape)
    res = normalize_resolution(options.voxel_resolution or models.voxelizer_config.task.network().dpsr_res)
    solve = dpsr_memory_bytes(res, models.voxelizer_config.task.n_points) + math.prod(res) * 4
    sample = ensemble * _pvcnn_bytes_per_cloud(models.pcdiff.model, cfg.n_skull + cfg.n_implant)
    host = ensemble * 3 * voxels + voxels * (2 + 4 + 4)
    return {"device": sample + solve, "host": host}


def check_generate_memory(
    models: Models, options: GenerateOptions, shape: tuple[int, ...], *, budget: dict | None = None
) -> None:
    """ConfigError before anything runs when ``options.ensemble`` proposals of a ``shape`` volume will not fit.

    ``budget`` (``{"device": bytes, "host": bytes}``) stands in for what the
    device and the host have available now. The message names the largest
    ``--ensemble`` that fits, or says that one proposal does not.
    """
    on_cpu = models.device.type == "cpu"
    if budget is None:
        # What earlier cases freed goes back to the system first: a CPU-loaded PCDiff keeps
        # freed blocks in the heap between passes (devices.reuse_freed_memory).
        release_freed_memory()
        host = available_memory_bytes("cpu")
        budget = {"device": host if on_cpu else available_memory_bytes(models.device), "host": host}

    def fits(n: int) -> bool:
        need = generate_memory_bytes(models, options, shape, n)
        if on_cpu:
            return need["device"] + need["host"] <= budget["host"]
        return need["device"] <= budget["device"] and need["host"] <= budget["host"]

    n = options.ensemble
    if fits(n):
        return
    need = generate_memory_bytes(models, options, shape, n)
    volume = f"{n} proposals of a {'x'.join(map(str, shape))} volume need about"
    if on_cpu:
        said = f"{volume} {format_bytes(need['device'] + need['host'])}, more than the {format_bytes(budget['host'])} available"
    else:
        said = (
            f"{volume} {format_bytes(need['device'])} on {models.device} and {format_bytes(need['host'])} of host "
            f"memory, more than is available ({format_bytes(budget['device'])} / {format_bytes(budget['host'])})"
        )
    lo, hi = 0, n  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo:
        raise ConfigError(f"{said}; use --ensemble {lo} or fewer")
    raise ConfigError(f"{said} even for one proposal; use a lower voxelizer resolution or a machine with more memory")


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
    # The defective skull's surface (volume_to_mesh) where the surface stage marched the input itself.
    skull_mesh: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def completed(self) -> np.ndarray:
        return self.defective.data | self.implant


def _isotropic(volume: Volume) -> tuple[Volume, np.ndarray | None]:
    """The volume on isotropic voxels (finest spacing) and the work→input index scale, or itself and None."""
    spacing = np.asarray(volume.spacing, dtype=np.float64)
    if spacing.max() / spacing.min() <= 1 + _ISOTROPY_TOLERANCE:
        return volume, None
    iso = float(spacing.min())
    mask, info = resample_isotropic(volume, iso)
    work = Volume(data=mask, spacing=(iso, iso, iso), origin=volume.origin, direction=volume.direction)
    return work, np.asarray(info["to_original_index_scale"], dtype=np.float64)


def _work_shape(volume: Volume) -> tuple[int, ...]:
    """The shape :func:`_isotropic` will give ``volume`` (without resampling it)."""
    spacing = np.asarray(volume.spacing, dtype=np.float64)
    if spacing.max() / spacing.min() <= 1 + _ISOTROPY_TOLERANCE:
        return tuple(volume.shape)
    extent = (np.asarray(volume.shape) - 1) * spacing
    return tuple(int(n) for n in np.floor(extent / spacing.min() + 1e-6).astype(int) + 1)  # as resample_isotropic


def _to_input_grid(
    values: np.ndarray, scale: np.ndarray | None, shape: tuple[int, int, int], *, binary: bool
) -> np.ndarray:
    """Map a work-grid array back to the input grid: input index p reads work index p / scale."""
    if scale is None:
        return values
    from scipy.ndimage import affine_transform

    out = affine_transform(values.astype(np.float32), 1.0 / scale, output_shape=shape, order=1, mode="nearest")
    return out >= 0.5 if binary else out.astype(np.float32)


def _proposals(work: Volume, skull_pts, models: Models, options: GenerateOptions, sampler, generator, progress, given):
    """``[n, P, 3]`` implant points in ``work``'s voxel coordinates: PCDiff's, or the ``given`` ones (mm)."""
    if given is not None:
        return work.physical_to_voxel(np.reshape(given, (-1, 3))).reshape(np.shape(given))
    implants = complete(
        skull_pts,
        models.pcdiff.model,
        sampler,
        options.ensemble,
        config=models.pcdiff.config,
        subsample=options.subsample,  # type: ignore[arg-type]  # checked in GenerateOptions
        generator=generator,
        spacing=work.spacing,
        progress=(lambda i, n: progress("sample", i, n)) if progress else None,
    )
    return np.asarray(implants, dtype=np.float64)


def _work_surface(defective: Volume, options: GenerateOptions, notes: list[str]):
    """The volume the networks see (isotropic), its input-index scale, its surface points, and the
    surface itself (vertices, faces) when that is the input's (no resampling; else None)."""
    work, scale = _isotropic(defective)
    if scale is not None:
        notes.append(
            f"resampled to isotropic {work.spacing[0]:g} mm voxels {work.shape} for the networks; outputs mapped back"
        )
    verts, faces = volume_to_mesh(work.data)
    points = sample_mesh(verts, faces, int(options.surface_points), seed=int(options.seed))
    return work, scale, points, ((verts, faces) if scale is None else None)


def _voxelize(dense, skull_pts, work: Volume, models: Models, options: GenerateOptions, rng, progress) -> list:
    """One completed-skull volume per proposal: a fresh skull subsample plus the proposal, through the voxelizer.

    The skull part has ``voxelizer n_points - n_implant`` points (at least PCDiff's ``n_skull``), so the
    voxelizer sees as many points as it was trained on.
    """
    n_vox_skull = max(int(models.voxelizer_config.task.n_points) - dense.shape[1], models.pcdiff.config.n_skull)
    completed = []
    for k, proposal in enumerate(dense):
        take = rng.choice(len(skull_pts), size=min(n_vox_skull, len(skull_pts)), replace=False)
        points = np.concatenate([skull_pts[take], proposal], axis=0)
        vol = points_to_volume(
            models.voxelizer, points, work, resolution=options.voxel_resolution, device=models.device
        )
        completed.append(vol.data)
        if progress:
            progress("voxelize", k + 1, len(dense))
    return completed


def _postprocess(
    completed: list, dense: np.ndarray, work: Volume, scale, defective: Volume, components: float, timings: dict
):
    """The voted implant, each proposal's own implant and their agreement, on the input's grid
    (:func:`~pointforge.implant.postprocess.implant_and_agreement`, which fills ``timings``)."""
    implant, own, agreement = implant_and_agreement(
        completed, work.data, dense, spacing=work.spacing, components=components, timings=timings
    )
    implant = _to_input_grid(implant, scale, defective.shape, binary=True)
    own = [_to_input_grid(m, scale, defective.shape, binary=True) for m in own]
    agreement = _to_input_grid(agreement, scale, defective.shape, binary=False)
    implant &= ~defective.data  # resampling back must not put implant voxels into bone
    return implant, own, agreement


def generate_implant(
    defective: Volume,
    models: Models,
    options: GenerateOptions | None = None,
    *,
    log: Callable[[str], None] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    proposals_mm: np.ndarray | None = None,
) -> Generated:
    """Run the pipeline on one defective skull (a bool :class:`Volume`, e.g. from read_binary_volume).

    ``proposals_mm`` (``[n, P, 3]`` physical coordinates) replaces PCDiff's
    proposals: the rest of the pipeline alone, e.g. fed the true implant points
    to measure what the voxelizer and clean-up can reach (the demo's oracle row).

    ``progress(stage, done, total)`` is called as sampler steps and voxelised
    proposals complete. Raises DataError when the result is empty (no implant
    survives post-processing: an input without a defect, or undertrained models).
    """
    options = options or GenerateOptions()
    options.validate()
    say = log or (lambda _msg: None)
    if defective.data.ndim != 3 or defective.data.dtype != bool:
        raise DataError("the defective skull must be a 3-D binary (bool) volume; read it with read_binary_volume")
    if not defective.data.any():
        raise DataError("the defective skull volume is empty (no bone voxel)")
    check_generate_memory(models, options, _work_shape(defective))
    timings: dict[str, float] = {}
    notes: list[str] = []
    cfg = models.pcdiff.config
    generator = torch.Generator().manual_seed(int(options.seed))
    rng = np.random.default_rng(int(options.seed))

    t = time.perf_counter()
    work, scale, skull_pts, skull_mesh = _work_surface(defective, options, notes)
    timings["surface_s"] = time.perf_counter() - t
    say(f"surface: {len(skull_pts)} points on the defective skull ({timings['surface_s']:.1f} s)")

    t = time.perf_counter()
    sampler = proposal_sampler(options.sampler, options.steps, models.pcdiff.schedule, cfg.prior)
    implants = _proposals(work, skull_pts, models, options, sampler, generator, progress, proposals_mm)
    timings["sample_s"] = time.perf_counter() - t
    say(
        f"sample: {options.ensemble} proposals × {cfg.n_implant} points, {options.sampler}"
        f" {sampler.num_steps} steps ({timings['sample_s']:.1f} s)"
    )

    implants = inside_volume(implants, work.shape, notes)

    t = time.perf_counter()
    dense = implants
    if models.upsampler is not None:
        dense = inside_volume(np.stack([upsample_points(models.upsampler, p) for p in implants]), work.shape, notes)
        timings["upsample_s"] = time.perf_counter() - t
        t = time.perf_counter()
    completed = _voxelize(dense, skull_pts, work, models, options, rng, progress)
    timings["voxelize_s"] = time.perf_counter() - t
    say(f"voxelize: {len(completed)} completed skulls ({timings['voxelize_s']:.1f} s)")

    t = time.perf_counter()
    implant, own, agreement = _postprocess(completed, dense, work, scale, defective, options.components, timings)
    timings["postprocess_s"] = time.perf_counter() - t
    if not implant.any():
        raise DataError(
            "no implant survived post-processing (the proposals do not close a defect in this skull); "
            "check that the input has a defect, or train the models longer"
        )
    say(f"postprocess: implant of {int(implant.sum())} voxels ({timings['postprocess_s']:.1f} s)")
    points_in = implants if scale is None else implants * scale[None, None, :]
    return Generated(
        defective=defective,
        implant=implant,
        proposals=own,
        agreement=agreement,
        implant_points=points_in.astype(np.float32),
        timings=timings,
        notes=notes,
        skull_mesh=skull_mesh,
    )
