"""The voxelizer at work: completed skull points → indicator field → binary volume → mesh in millimetres.

Coordinates. Points come in the voxel-index coordinates of a reference volume
(what ``pointforge data prepare`` stores, and what PCDiff's samples are mapped
back to): voxel ``(i, j, k)`` has its centre at ``(i, j, k)``. They are scaled
to the unit cube exactly as the training data was, by dividing by the
volume's longest side ``S`` (:func:`~pointforge.data.skulls.grids.unit_cube_scale`),
so the solve grid's node ``n`` along an axis of ``R`` nodes sits at voxel
coordinate ``n * S / R``.

The cube. That default cube is the volume's own, so the skull's size in it
depends on the scan's voxel size and field of view. A :class:`Cube` places
it elsewhere: ``unit = (voxel - corner) / side``. The pipeline gives the cube
the voxelizer was trained on, in millimetres, placed on the skull
(:class:`~pointforge.data.skulls.grids.VoxelizerFrame`), so the network sees
a skull from any scanner at the scale and place it was trained on. Voxels
outside such a cube are outside the solid.

Resolution. The Poisson solve may run coarser than the volume (e.g. 256³ for
a 512³ scan): :func:`points_to_volume` then interpolates the field trilinearly
at every voxel centre (voxel ``v`` reads the field at ``v * R / S``) and
thresholds it (inside where the field is ≤ 0). The interpolation is separable
and done slab by slab along the first axis, so besides the field and the
output mask it holds only a few times ``chunk_voxels`` floats at a time
(about 100 MB by default), whatever the volume's size. When the solve runs at another resolution than training,
the Gaussian smoothing is scaled with it (``sigma * R / R_train``), which keeps
the smoothing the same in millimetres.

Meshes come from marching cubes (outward faces) and are placed in the
reference volume's physical space with its affine (spacing, origin,
direction); a direction matrix with a reflection flips the faces back, so
normals always point out of the solid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pointforge.data.skulls.grids import unit_cube_scale
from pointforge.data.surface import volume_to_mesh
from pointforge.data.volumes import Volume
from pointforge.devices import resolve_device
from pointforge.errors import ConfigError, DataError
from pointforge.inference.loading import LoadedModel
from pointforge.nn.dpsr import dpsr
from pointforge.nn.dpsr_grid import normalize_resolution

__all__ = [
    "Cube",
    "solve_resolution",
    "unit_points",
    "points_to_field",
    "points_to_volume",
    "field_to_mesh",
    "resample_inside",
    "Region",
]

_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))
# Points may sit up to half a voxel beyond the outermost voxel centres (marching
# cubes on a mask touching the border); one voxel of slack is allowed.
_SLACK_VOXELS = 1.0


@dataclass(frozen=True)
class Cube:
    """The voxelizer's unit cube in a volume's voxel coordinates: ``unit = (voxel - corner) / side``."""

    corner: tuple[float, float, float]
    side: float  # voxels


# The solve's node spacing at which the clean-up chain stops gaining: true oriented surface points
# of a real skull (SkullFix 060) through DPSR and the chain gave DSC 0.882 at 3.6 mm nodes (64³
# over its 230 mm cube), 0.909 at 1.8 mm and 0.909 at 0.9 mm (docs/experiments/realskulls.md).
SOLVE_NODE_MM = 2.0
MAX_SOLVE_RESOLUTION = 256


def solve_resolution(trained: int, cube_side_voxels: float, spacing_mm: float) -> int:
    """The DPSR grid a cube of ``cube_side_voxels`` voxels of ``spacing_mm`` is solved on by default.

    The voxelizer's training resolution, doubled while its nodes are more than
    :data:`SOLVE_NODE_MM` apart, as long as the nodes stay no closer than the volume's
    own voxels (a finer solve than the grid it is read on adds nothing) and the grid
    stays within :data:`MAX_SOLVE_RESOLUTION`. A 64³-trained voxelizer on a real CT
    (a 230 mm cube of 0.45 mm voxels) solves at 128³; on a 64³ synthetic volume at 64³.
    """
    if not (trained >= 2 and cube_side_voxels > 0 and spacing_mm > 0):
        raise DataError(
            f"cannot size the solve for resolution {trained}, a cube of {cube_side_voxels} voxels of {spacing_mm} mm"
        )
    res = int(trained)
    while (
        2 * res <= MAX_SOLVE_RESOLUTION
        and 2 * res <= cube_side_voxels
        and cube_side_voxels * spacing_mm / res > SOLVE_NODE_MM
    ):
        res *= 2
    return res


def _device(device: str | torch.device | None, fallback: torch.device) -> torch.device:
    return fallback if device is None else resolve_device(device)


# --------------------------------------------------------------------------- points → field


def _check_shape(volume_shape: Any) -> tuple[int, int, int]:
    try:
        shape = tuple(int(s) for s in volume_shape)
    except (TypeError, ValueError):
        raise DataError(f"volume shape must be three positive integers, got {volume_shape!r}") from None
    if len(shape) != 3 or min(shape) < 1:
        raise DataError(f"volume shape must be three positive integers, got {volume_shape!r}")
    return shape


def unit_points(points_vox: Any, volume_shape: Any, cube: Cube | None = None) -> torch.Tensor:
    """Voxel-index points [N, 3] of a volume → float32 [1, N, 3] in [0, 1), as the training data.

    ``cube``: where the unit cube lies (module docs); default the volume's own.

    Raises :class:`DataError` for an empty cloud, NaN/infinite values, or
    coordinates that are not voxel indices of ``volume_shape`` (more than a
    voxel outside it: millimetres or normalised coordinates, most likely).
    """
    shape = _check_shape(volume_shape)
    points = points_vox.detach().cpu().numpy() if isinstance(points_vox, torch.Tensor) else np.asarray(points_vox)
    if points.ndim == 3 and points.shape[0] == 1:
        points = points[0]
    if points.ndim != 2 or points.shape[-1] != 3:
        raise DataError(f"points must have shape [N, 3] (voxel indices), got {tuple(points.shape)}")
    if points.shape[0] == 0:
        raise DataError("the point cloud is empty; the voxelizer needs the completed skull's surface points")
    if not np.issubdtype(points.dtype, np.number):
        raise DataError(f"points must be numbers, got {points.dtype}")
    points = points.astype(np.float64)
    if not np.isfinite(points).all():
        bad = int((~np.isfinite(points)).any(axis=1).sum())
        raise DataError(f"{bad} of {points.shape[0]} points have NaN or infinite coordinates; drop or fix them first")
    lo, hi = points.min(axis=0), points.max(axis=0)
    upper = np.asarray(shape, dtype=np.float64) - 1.0 + _SLACK_VOXELS
    if (lo < -_SLACK_VOXELS).any() or (hi > upper).any():
        ranges = ", ".join(f"axis {a}: {lo[a]:.4g}..{hi[a]:.4g}" for a in range(3))
        raise DataError(
            f"point coordinates are out of range for a volume of shape {shape} ({ranges}); "
            "points must be voxel indices of the reference volume, not millimetres or normalised coordinates"
        )
    if cube is None:
        unit = points / unit_cube_scale(shape)
    else:
        unit = (points - np.asarray(cube.corner, dtype=np.float64)) / float(cube.side)
    unit = np.clip(unit, 0.0, _BELOW_ONE)
    return torch.from_numpy(unit.astype(np.float32))[None]


def _solve(
    model: nn.Module, points_vox, volume_shape, *, resolution, device, sigma, memory_limit, cube=None
) -> torch.Tensor:
    if isinstance(model, LoadedModel):
        model = model.model
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "oriented_points"):
        raise ConfigError("model must be a voxelizer (a VoxelizerNet, as load_voxelizer returns)")
    trained = normalize_resolution(cfg.dpsr_res)
    res = trained if resolution is None else normalize_resolution(resolution)
    if sigma is None:
        sigma = float(cfg.dpsr_sigma) * res[0] / trained[0]
    params = next(iter(model.parameters()), None)
    device = _device(device, params.device if params is not None else torch.device("cpu"))
    dtype = params.dtype if params is not None else torch.float32
    points = unit_points(points_vox, volume_shape, cube).to(device=device, dtype=dtype)
    limit = memory_limit if memory_limit is not None else getattr(cfg, "dpsr_memory_limit", None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            moved, normals = model.oriented_points(points)  # type: ignore[operator]  # a VoxelizerNet, checked above
            field = dpsr(moved, normals, res, sigma, memory_limit=limit)
    finally:
        model.train(was_training)
    return field[0].float()


def points_to_field(
    model: nn.Module,
    points_vox: Any,
    volume_shape: Any,
    *,
    resolution: int | tuple[int, int, int] | None = None,
    device: str | torch.device | None = None,
    sigma: float | None = None,
    memory_limit: float | None = None,
    cube: Cube | None = None,
) -> torch.Tensor:
    """The indicator field (CPU float32, ``resolution``³, inside ≤ 0) of voxel-index points.

    ``resolution``: the Poisson grid (default: the one the model was trained
    on); node ``n`` sits at voxel coordinate ``n * S / R`` (module docs).
    ``sigma``: the Gaussian smoothing (default: the model's, scaled to this
    resolution). ``memory_limit`` (bytes): a solve estimated to need more
    raises :class:`ConfigError` before anything is allocated (default: the
    memory the device has available). ``device``: default the model's.
    ``cube``: where the unit cube lies (module docs; default the volume's own).
    """
    return _solve(
        model,
        points_vox,
        volume_shape,
        resolution=resolution,
        device=device,
        sigma=sigma,
        memory_limit=memory_limit,
        cube=cube,
    ).cpu()


# --------------------------------------------------------------------------- field → volume


def _axis_weights(
    n_out: int, n_field: int, scale: float, device, corner: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower/upper field node, weight, and whether inside the cube, for each voxel along one axis
    (voxel v reads index (v - corner) * n_field / scale)."""
    pos = (torch.arange(n_out, dtype=torch.float64, device=device) - corner) * (n_field / scale)
    inside = (pos >= 0) & (pos <= n_field - 1)
    low = pos.floor().clamp_(0, n_field - 1)
    weight = (pos - low).clamp_(0.0, 1.0).float()
    low = low.long()
    high = (low + 1).clamp_(max=n_field - 1)
    return low, high, weight, inside


Region = tuple[slice, ...]  # a box of voxels: three slices without steps


def _check_region(region: Any, shape: tuple[int, int, int]) -> Region:
    """``region`` as three clipped slices of ``shape`` (the whole volume when None)."""
    if region is None:
        return (slice(0, shape[0]), slice(0, shape[1]), slice(0, shape[2]))
    if len(region) != 3 or any(not isinstance(r, slice) or r.step not in (None, 1) for r in region):
        raise DataError(f"region must be three slices without steps, got {region!r}")
    return tuple(slice(*r.indices(n)[:2]) for r, n in zip(region, shape))


def resample_inside(
    field: torch.Tensor,
    volume_shape: Any,
    *,
    chunk_voxels: int = 1 << 22,
    cube: Cube | None = None,
    region: Region | None = None,
) -> np.ndarray:
    """Bool mask of ``volume_shape``: the field (on the unit cube) interpolated at each voxel centre, ≤ 0.

    Trilinear and separable, slab by slab along the first axis on the field's
    device: the temporaries stay near 6 × ``chunk_voxels`` floats (about 100 MB by default).
    ``cube``: where the unit cube lies (module docs; default the volume's own); voxels outside
    a given cube are outside. ``region``: only the voxels of this box are interpolated (every
    one of them as the whole volume's would be); the rest of the mask is False.
    """
    shape = _check_shape(volume_shape)
    if field.dim() != 3:
        raise DataError(f"the field must be a 3-D grid, got shape {tuple(field.shape)}")
    box = _check_region(region, shape)
    out = np.zeros(shape, dtype=bool)
    if cube is None and all(n == unit_cube_scale(shape) for n in field.shape):
        # Solved at the volume's own resolution: voxel v reads node v exactly (interpolation weight
        # 0), so the interpolation is the field itself, cut to the volume: one comparison.
        out[box] = (field[box] <= 0).cpu().numpy()
        return out
    _interpolate_inside(field, shape, chunk_voxels, cube, box, out)
    return out


def _nodes_read(weights: tuple) -> tuple:
    """One axis's (low, high, weight, inside) with the node indices made relative to the span of nodes
    they read, and that span (a slice of the field's axis) appended."""
    low, high, weight, inside = weights
    first, last = int(low.min()), int(high.max())
    return low - first, high - first, weight, inside, slice(first, last + 1)


def _interpolate_inside(
    field: torch.Tensor,
    shape: tuple[int, int, int],
    chunk_voxels: int,
    cube: Cube | None,
    box: Region,
    out: np.ndarray,
) -> None:
    scale = unit_cube_scale(shape) if cube is None else float(cube.side)
    corner = (0.0, 0.0, 0.0) if cube is None else cube.corner
    device = field.device
    field = field.float()
    ax0, ax1, ax2 = (
        tuple(t[box[a]] for t in _axis_weights(shape[a], field.shape[a], scale, device, corner[a])) for a in range(3)
    )
    if min(b.stop - b.start for b in box) == 0:
        return
    # Only the field nodes the region's voxels read along axes 1 and 2 (all of them for the whole volume).
    ax1, ax2 = _nodes_read(ax1), _nodes_read(ax2)
    field = field[:, ax1[4], ax2[4]]
    size = [b.stop - b.start for b in box]
    widest = max(size[1], field.shape[1]) * max(size[2], field.shape[2])
    slab = max(1, int(chunk_voxels) // max(1, widest))
    for start in range(0, size[0], slab):
        stop = min(start + slab, size[0])
        lo, hi, w, _ = (t[start:stop] for t in ax0)
        rows = torch.lerp(field.index_select(0, lo), field.index_select(0, hi), w[:, None, None])
        # Advanced indexing gathers along inner axes about twice as fast as index_select.
        lo, hi, w, _, _ = ax1
        rows = torch.lerp(rows[:, lo], rows[:, hi], w[None, :, None])
        lo, hi, w, _, _ = ax2
        rows = torch.lerp(rows[:, :, lo], rows[:, :, hi], w[None, None, :])
        out[box[0].start + start : box[0].start + stop, box[1], box[2]] = (rows <= 0).cpu().numpy()
    if cube is not None:  # beyond the cube the field says nothing (it is periodic): outside
        for axis, weights in enumerate((ax0, ax1, ax2)):
            outside = np.flatnonzero(~weights[3].cpu().numpy()) + box[axis].start
            if outside.size:
                index: list[Any] = [slice(None)] * 3
                index[axis] = outside
                out[tuple(index)] = False


def points_to_volume(
    model: nn.Module,
    points_vox: Any,
    reference: Volume,
    *,
    resolution: int | tuple[int, int, int] | None = None,
    device: str | torch.device | None = None,
    sigma: float | None = None,
    memory_limit: float | None = None,
    chunk_voxels: int = 1 << 22,
    cube: Cube | None = None,
    region: Region | None = None,
) -> Volume:
    """The solid the points enclose, as a binary (bool) volume on ``reference``'s grid.

    Same shape, spacing, origin, direction and kept header as ``reference``;
    inside where the interpolated field is ≤ 0. Options as in
    :func:`points_to_field`; ``chunk_voxels`` bounds the interpolation's
    temporaries, ``cube`` places the unit cube (module docs). ``region``: the box of
    voxels a caller will read (:func:`resample_inside`); outside it the volume is False.
    """
    if not isinstance(reference, Volume):
        raise DataError(
            f"reference must be a Volume (pointforge.data.volumes.read_volume), got {type(reference).__name__}"
        )
    field = _solve(
        model,
        points_vox,
        reference.shape,
        resolution=resolution,
        device=device,
        sigma=sigma,
        memory_limit=memory_limit,
        cube=cube,
    )
    mask = resample_inside(field, reference.shape, chunk_voxels=chunk_voxels, cube=cube, region=region)
    del field
    return reference.with_data(mask)


# --------------------------------------------------------------------------- → mesh


def field_to_mesh(field_or_volume: Any, reference: Volume, *, step_size: int = 1, cube: Cube | None = None):
    """A watertight triangle mesh (``trimesh.Trimesh``) in millimetres, normals outward.

    Accepts a :class:`Volume` or bool array on ``reference``'s grid (the
    surface between inside and outside voxels), or a float field with inside
    ≤ 0: either on ``reference``'s grid, or a solve grid from
    :func:`points_to_field` (node ``n`` at voxel ``n * S / R``), which gives a
    smoother surface (``cube``: the one it was solved in, default the
    volume's own). Vertices are mapped to physical space with ``reference``'s affine.
    """
    import trimesh

    if not isinstance(reference, Volume):
        raise DataError(f"reference must be a Volume, got {type(reference).__name__}")
    data = field_or_volume.data if isinstance(field_or_volume, Volume) else field_or_volume
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    data = np.asarray(data)
    if data.ndim != 3:
        raise DataError(f"expected a 3-D volume or field, got shape {tuple(data.shape)}")
    voxel_scale, voxel_shift = np.ones(3), np.zeros(3)
    if data.dtype == bool or isinstance(field_or_volume, Volume):
        if tuple(data.shape) != reference.shape:
            raise DataError(
                f"the volume has shape {tuple(data.shape)} but the reference has {reference.shape}; they must match"
            )
        solid = data.astype(bool, copy=False)
        if not solid.any():
            raise DataError("the volume is empty: nothing is inside, so there is no surface")
        verts, faces = volume_to_mesh(solid, step_size=step_size)
    else:
        if not np.issubdtype(data.dtype, np.floating):
            raise DataError(f"a field must hold floats (inside ≤ 0), got {data.dtype}")
        if cube is not None:
            voxel_scale = float(cube.side) / np.asarray(data.shape, dtype=np.float64)
            voxel_shift = np.asarray(cube.corner, dtype=np.float64)
        elif tuple(data.shape) != reference.shape:
            voxel_scale = unit_cube_scale(reference.shape) / np.asarray(data.shape, dtype=np.float64)
        if not np.isfinite(data).all():
            raise DataError("the field contains NaN or infinite values")
        if not (data <= 0).any():
            raise DataError("the field is positive everywhere: nothing is inside, so there is no surface")
        # 0.5 - field is >= 0.5 exactly where the field is <= 0; the zero padding
        # volume_to_mesh adds reads as outside, which closes the surface.
        verts, faces = volume_to_mesh(0.5 - data.astype(np.float32), level=0.5, step_size=step_size)
    verts_mm = reference.voxel_to_physical(verts * voxel_scale + voxel_shift)
    if np.linalg.det(reference.affine()[:3, :3]) < 0:
        faces = faces[:, ::-1].copy()  # a mirroring affine turns outward faces inward
    return trimesh.Trimesh(vertices=verts_mm, faces=faces, process=False)
