"""Defective skull in, implant out, in memory: the PCDiff pipeline for one case.

Stages (the PCDiff paper's pipeline, Friedrich et al., MICCAI 2023), each timed:

1. **surface** — the defective skull's surface (marching cubes at 0.5, area-uniform
   samples, :func:`~pointforge.data.surface.surface_points`) in voxel-index
   coordinates of the *work grid*: the input with its voxel axes turned to
   follow its header's physical axes (:func:`~pointforge.data.orientation.canonical_axes`:
   a transpose and flips, no interpolation) and, for anisotropic voxels
   (SkullFix), resampled to isotropic voxels of its finest spacing, as
   ``pointforge data prepare`` does for training; every output is mapped back
   to the input's grid at the end. What the networks see is then independent
   of the scanner: PCDiff normalises by the skull's own bounding box (and its
   atlas registers in millimetres), and the voxelizer's cube is the one it was
   trained in, in millimetres, placed on the skull (step 3).
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
   Its unit cube is its training cube in millimetres with the skull where its
   training skulls sat (:class:`~pointforge.data.skulls.grids.VoxelizerFrame`),
   whatever this scan's voxel size and field of view, as the voxelizer carries
   it in its checkpoint; for a voxelizer without one (a checkpoint written
   before the frame existed), the work volume's own cube (a note says so).
4. **postprocess** — :func:`~pointforge.implant.postprocess.implant_from_proposals`
   (dilate, majority vote, minus the defective skull, near the generated points,
   opening / largest component / median / closing / hole filling, each sized in
   millimetres as upstream's at 0.45 mm: see that module). Each proposal
   is also turned into an implant on its own (same chain, no vote and no
   dilation): their per-voxel mean is the agreement (uncertainty) map.
The models come from :mod:`pointforge.implant.models`, the options from
:mod:`pointforge.implant.options`; :mod:`pointforge.implant.memory` refuses a case
that will not fit before anything runs. One case from its file to its folder is
:func:`pointforge.implant.case.generate_case` (read, this pipeline, then
:mod:`pointforge.implant.writer`); a whole dataset, :mod:`pointforge.implant.folder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pointforge.data.orientation import AxisTurn, canonical_axes
from pointforge.data.prepare import is_isotropic, resample_isotropic
from pointforge.data.skulls.grids import unit_cube_scale
from pointforge.data.surface import bounding_box, sample_mesh, volume_to_mesh
from pointforge.data.volumes import Volume
from pointforge.errors import DataError
from pointforge.implant.memory import check_generate_memory
from pointforge.implant.models import Models
from pointforge.implant.options import GenerateOptions
from pointforge.implant.postprocess import implant_and_agreement, read_region
from pointforge.implant.proposals import complete, inside_volume, proposal_sampler
from pointforge.implant.timing import timed
from pointforge.implant.voxelize import Cube, points_to_volume, solve_resolution
from pointforge.nn.diffusion.samplers.base import Sampler
from pointforge.nn.dpsr_grid import normalize_resolution
from pointforge.upsampling.pipeline import upsample_points

__all__ = ["Generated", "build_sampler", "generate_implant"]


Progress = Callable[[str, int, int], None]


@dataclass
class Generated:
    """One case's results, all on the input's grid."""

    defective: Volume
    implant: np.ndarray  # bool
    proposals: list[np.ndarray]  # bool, one implant per proposal (empty when not asked for)
    agreement: np.ndarray | None  # float32 in [0, 1] (None when not asked for)
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
    if is_isotropic(volume.spacing):
        return volume, None
    iso = float(min(volume.spacing))
    mask, info = resample_isotropic(volume, iso)
    work = Volume(data=mask, spacing=(iso, iso, iso), origin=volume.origin, direction=volume.direction)
    return work, np.asarray(info["to_original_index_scale"], dtype=np.float64)


def _work_shape(volume: Volume) -> tuple[int, ...]:
    """The shape :func:`_isotropic` will give ``volume`` (without resampling it)."""
    if is_isotropic(volume.spacing):
        return tuple(volume.shape)
    spacing = np.asarray(volume.spacing, dtype=np.float64)
    extent = (np.asarray(volume.shape) - 1) * spacing
    return tuple(int(n) for n in np.floor(extent / spacing.min() + 1e-6).astype(int) + 1)  # as resample_isotropic


def _to_input_grid(
    values: np.ndarray, scale: np.ndarray | None, shape: tuple[int, int, int], *, binary: bool
) -> np.ndarray:
    """Map a work-grid array back to the input grid: input index p reads work index p / scale (linear).

    Only the box of input voxels whose two neighbours per axis can reach a non-zero work voxel is
    interpolated; every other voxel is 0 in the whole-volume transform too. The box starts where
    scipy's shift can be its first index exactly (:func:`_exact_start`), so each voxel's coordinate
    is computed as in the whole-volume call: the same array, bit for bit, at the implant's cost
    rather than the volume's (a SkullFix case's seven whole-volume transforms took 148 of its 384 s,
    on a loaded machine)."""
    if scale is None:
        return values
    from scipy.ndimage import affine_transform

    zoom = 1.0 / np.asarray(scale, dtype=np.float64)
    out = np.zeros(shape, dtype=bool if binary else np.float32)
    box = _reach_box(values, zoom, shape)
    if box is None:  # no input voxel reaches a non-zero work voxel
        return out
    box, offset = _exact_start(box, zoom)
    size = tuple(b.stop - b.start for b in box)
    # A bool mask is read as its 0/1 bytes, without a float copy of the whole volume (the same values).
    source = values.view(np.uint8) if values.dtype == bool else values.astype(np.float32, copy=False)
    part = affine_transform(source, zoom, offset=offset, output_shape=size, output=np.float32, order=1, mode="nearest")
    out[box] = part >= 0.5 if binary else part
    return out


def _reach_box(values: np.ndarray, zoom: np.ndarray, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The input-grid box outside which linear interpolation of ``values`` at ``p * zoom`` is exactly 0."""
    nonzero = bounding_box(values != 0)
    if nonzero is None:
        return None
    box = []
    for axis, (n, z) in enumerate(zip(shape, zoom)):
        lo, hi = nonzero[axis].start, nonzero[axis].stop  # work indices lo .. hi - 1 hold the non-zero values
        # p reads floor(p z) and the next index (clamped to the work grid): it can touch the box once
        # p z > lo - 1 and until p z reaches hi; one voxel of slack on each side covers rounding.
        # Past the work grid's ends the coordinate is clamped to them: a box touching an end reaches the
        # input grid's end on that side.
        first = 0 if lo == 0 else max(0, int(np.floor((lo - 1) / z)) - 1)
        stop = n if hi >= values.shape[axis] else min(n, int(np.ceil(hi / z)) + 2)
        if first >= stop:
            return None
        box.append(slice(first, stop))
    return tuple(box)


def _exact_start(box: tuple[slice, ...], zoom: np.ndarray) -> tuple[tuple[slice, ...], np.ndarray]:
    """The box, each axis started at or before its first index where a float64 offset ``o`` has
    ``o / zoom == start`` exactly, and those offsets. scipy shifts output index ``k`` by ``o / zoom``
    and multiplies by ``zoom``: with the quotient exactly ``start``, voxel ``start + k``'s coordinate
    is the whole call's ``(start + k) * zoom``. Starting earlier only adds voxels that are 0; at 0 the
    offset 0 always works."""
    starts, offsets = [], np.zeros(len(box), dtype=np.float64)
    for axis, (b, z) in enumerate(zip(box, np.asarray(zoom, dtype=np.float64))):
        start = b.start
        while start > 0:
            guess = np.float64(start) * z
            hit = next(
                (o for o in (guess, np.nextafter(guess, np.inf), np.nextafter(guess, -np.inf)) if o / z == start), None
            )
            if hit is not None:
                offsets[axis] = hit
                break
            start -= 1
        starts.append(slice(start, b.stop))
    return tuple(starts), offsets


def _proposals(
    work: Volume, skull_pts, models: Models, options: GenerateOptions, sampler: Sampler, progress, given
) -> np.ndarray:
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
        generator=torch.Generator().manual_seed(int(options.seed)),
        spacing=work.spacing,
        progress=(lambda i, n: progress("sample", i, n)) if progress else None,
    )
    return np.asarray(implants, dtype=np.float64)


@dataclass
class _Work:
    """The grid the networks work on (module docs, stage 1) and the way back to the input's."""

    volume: Volume  # turned and isotropic
    turn: AxisTurn  # input → turned grid
    scale: np.ndarray | None  # turned-grid index p reads work index p / scale (None: not resampled)
    bbox: tuple[np.ndarray, np.ndarray]  # the defective skull's surface box, work voxel coordinates

    def to_input(self, values: np.ndarray, *, binary: bool) -> np.ndarray:
        """A work-grid array on the input's grid."""
        turned_shape = tuple(self.turn.shape[p] for p in self.turn.perm)
        return self.turn.unturn(_to_input_grid(values, self.scale, turned_shape, binary=binary))  # type: ignore[arg-type]

    def points_to_input(self, points: np.ndarray) -> np.ndarray:
        """Work voxel coordinates → the input's voxel coordinates."""
        turned = points if self.scale is None else points * self.scale
        return turned if self.turn.identity else self.turn.points_to_old(turned)


def _work_surface(defective: Volume, options: GenerateOptions, notes: list[str]):
    """The work grid (:class:`_Work`), its surface points, and the surface itself (vertices, faces)
    when that is the input's (neither turned nor resampled; else None)."""
    turned, turn = canonical_axes(defective)
    if not turn.identity:
        notes.append(
            f"voxel axes turned to follow the header's directions (axes {list(turn.perm)}, "
            f"flipped {[a for a in range(3) if turn.flips[a]]}) for the networks; outputs turned back"
        )
    work, scale = _isotropic(turned)
    if scale is not None:
        notes.append(
            f"resampled to isotropic {work.spacing[0]:g} mm voxels {work.shape} for the networks; outputs mapped back"
        )
    verts, faces = volume_to_mesh(work.data)
    points = sample_mesh(verts, faces, int(options.surface_points), seed=int(options.seed))
    own = scale is None and turn.identity
    return _Work(work, turn, scale, (verts.min(axis=0), verts.max(axis=0))), points, ((verts, faces) if own else None)


def _voxelizer_cube(work: _Work, models: Models, notes: list[str]) -> Cube | None:
    """The voxelizer's training cube placed on this skull (module docs, stage 3); None: the volume's own."""
    frame = models.voxelizer_frame
    if frame is None:
        notes.append(
            "the voxelizer checkpoint carries no training cube (written before the frame existed), so its cube "
            "in millimetres is unknown: it sees this skull in the volume's own cube (a field of view unlike its "
            "training data's changes the skull's scale); retrain it to give it one"
        )
        return None
    corner, side = frame.cube(*work.bbox, float(work.volume.spacing[0]))
    return Cube(corner=(float(corner[0]), float(corner[1]), float(corner[2])), side=side)


def _solve_resolution(work: Volume, models: Models, options: GenerateOptions, cube: Cube | None) -> int:
    """The DPSR grid: ``options.voxel_resolution``, else :func:`solve_resolution` for the cube on ``work``."""
    if options.voxel_resolution is not None:
        return int(options.voxel_resolution)
    trained = normalize_resolution(models.voxelizer_config.task.network().dpsr_res)[0]
    side = float(cube.side) if cube is not None else float(unit_cube_scale(work.shape))
    return solve_resolution(trained, side, float(np.min(work.spacing)))


def _voxelize(dense, skull_pts, work: Volume, models: Models, options: GenerateOptions, progress, cube) -> list:
    """One completed-skull volume per proposal: a fresh skull subsample plus the proposal, through the voxelizer,
    filled in only inside the box post-processing reads (:func:`~pointforge.implant.postprocess.read_region`).

    The skull part has ``options.skull_points`` points, by default ``voxelizer n_points - n_implant`` (at
    least PCDiff's ``n_skull``), as many as the voxelizer was trained on; ``cube``: its unit cube on
    ``work``'s grid.
    """
    n_vox_skull = options.skull_points or max(
        int(models.voxelizer_config.task.n_points) - dense.shape[1], models.pcdiff.config.n_skull
    )
    rng = np.random.default_rng(int(options.seed))
    resolution = _solve_resolution(work, models, options, cube)
    # Only the box the clean-up reads is filled in: the rest would change no output voxel.
    region = read_region(dense, work.shape, spacing=work.spacing)
    completed = []
    for k, proposal in enumerate(dense):
        take = rng.choice(len(skull_pts), size=min(n_vox_skull, len(skull_pts)), replace=False)
        points = np.concatenate([skull_pts[take], proposal], axis=0)
        vol = points_to_volume(
            models.voxelizer, points, work, resolution=resolution, device=models.device, cube=cube, region=region
        )
        completed.append(vol.data)
        if progress:
            progress("voxelize", k + 1, len(dense))
    return completed


def _postprocess(
    completed: list, dense: np.ndarray, work: _Work, defective: Volume, options: GenerateOptions, timings, each: bool
):
    """The voted implant, and with ``each`` each proposal's own implant and their agreement, on the input's
    grid (:func:`~pointforge.implant.postprocess.implant_and_agreement`, which fills ``timings``)."""
    implant, own, agreement = implant_and_agreement(
        completed,
        work.volume.data,
        dense,
        spacing=work.volume.spacing,
        components=options.components,
        reach_mm=options.reach_mm,
        timings=timings,
        each=each,
    )
    implant = work.to_input(implant, binary=True)
    own = [work.to_input(m, binary=True) for m in own]
    agreement = None if agreement is None else work.to_input(agreement, binary=False)
    implant &= ~defective.data  # resampling back must not put implant voxels into bone
    return implant, own, agreement


def build_sampler(models: Models, options: GenerateOptions) -> Sampler:
    """The sampler ``options`` ask for on the PCDiff's own schedule (and prior): ConfigError when they do not fit."""
    pcdiff = models.pcdiff
    return proposal_sampler(options.sampler, options.steps, pcdiff.schedule, pcdiff.config.prior, pcdiff.student)


def generate_implant(
    defective: Volume,
    models: Models,
    options: GenerateOptions | None = None,
    *,
    sampler: Sampler | None = None,
    log: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    proposals_mm: np.ndarray | None = None,
    each: bool = True,
) -> Generated:
    """Run the pipeline on one defective skull (a bool :class:`Volume`, e.g. from read_binary_volume).

    ``sampler`` is :func:`build_sampler`'s for ``options``, built here when not
    given (:func:`~pointforge.implant.case.generate_case` builds it before it reads
    the input, so a wrong sampler fails first). ``proposals_mm`` (``[n, P, 3]``
    physical coordinates) replaces PCDiff's proposals: the rest of the pipeline
    alone, e.g. fed the true implant points to measure what the voxelizer and
    clean-up can reach (the demo's oracle row). ``each=False`` skips each proposal's own implant and
    the agreement map (``Generated.proposals`` empty, ``agreement`` None): the voted implant alone,
    which is all that scoring reads.

    ``progress(stage, done, total)`` is called as sampler steps and voxelised
    proposals complete. Raises DataError when the result is empty (no implant
    survives post-processing: an input without a defect, or undertrained models).
    """
    options = options or GenerateOptions()
    if defective.data.ndim != 3 or defective.data.dtype != bool:
        raise DataError("the defective skull must be a 3-D binary (bool) volume; read it with read_binary_volume")
    if not defective.data.any():
        raise DataError("the defective skull volume is empty (no bone voxel)")
    check_generate_memory(models, options, _work_shape(defective))
    if sampler is None:
        sampler = build_sampler(models, options)
    say = log or (lambda _msg: None)
    timings: dict[str, float] = {}
    notes: list[str] = []

    (grid, skull_pts, skull_mesh), timings["surface_s"] = timed(lambda: _work_surface(defective, options, notes))
    work = grid.volume
    say(f"surface: {len(skull_pts)} points on the defective skull ({timings['surface_s']:.1f} s)")
    implants, timings["sample_s"] = timed(
        lambda: _proposals(work, skull_pts, models, options, sampler, progress, proposals_mm)
    )
    say(
        f"sample: {options.ensemble} proposals × {models.pcdiff.config.n_implant} points, {options.sampler}"
        f" {sampler.num_steps} steps ({timings['sample_s']:.1f} s)"
    )
    implants = inside_volume(implants, work.shape, notes)
    dense = implants
    if models.upsampler is not None:
        dense, timings["upsample_s"] = timed(
            lambda: inside_volume(np.stack([upsample_points(models.upsampler, p) for p in implants]), work.shape, notes)
        )
    cube = _voxelizer_cube(grid, models, notes)
    completed, timings["voxelize_s"] = timed(lambda: _voxelize(dense, skull_pts, work, models, options, progress, cube))
    say(f"voxelize: {len(completed)} completed skulls ({timings['voxelize_s']:.1f} s)")
    (implant, own, agreement), timings["postprocess_s"] = timed(
        lambda: _postprocess(completed, dense, grid, defective, options, timings, each)
    )
    if not implant.any():
        raise DataError(
            "no implant survived post-processing (the proposals do not close a defect in this skull); "
            "check that the input has a defect, or train the models longer"
        )
    say(f"postprocess: implant of {int(implant.sum())} voxels ({timings['postprocess_s']:.1f} s)")
    points_in = grid.points_to_input(implants)
    return Generated(defective, implant, own, agreement, points_in.astype(np.float32), timings, notes, skull_mesh)
