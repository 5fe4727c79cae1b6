"""A print-ready implant: one implant mask grown to a minimum wall thickness and a margin, as a closed mesh.

Both are made on a fine isotropic grid over the implant's box (the input's
voxels resampled by linear interpolation, threshold 0.5; the working voxel is
at most a quarter of the thickness), in millimetres:

* **margin** ``M``: a flange on the outer surface of the skull, every voxel
  outside bone within ``M`` of the implant and within the thickness of the
  skull, on the side away from the brain (farther from the completed skull's
  centroid than its nearest bone voxel);
* **thickness** ``T``: where the implant (with its flange) is thinner than
  ``T`` (not covered by a ball of diameter ``T`` inside it, the morphological
  opening), balls of that diameter are laid from its brain side outward; what
  is still thin after that is covered by balls centred on it. The result is
  its own opening by the ball (every point lies in a ball of diameter ``T`` +
  two working voxels inside it), so its local thickness is at least that.

The surface is marching cubes of the grown mask (closed, manifold, and free of
self-intersections, as a marching-cubes surface of a well-composed mask is),
and its minimum thickness is then measured on the mesh itself
(:mod:`~pointforge.implant.thickness`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import ndimage

from pointforge.atomic import atomic_path, atomic_write_text
from pointforge.data.dicom import read_skull_input
from pointforge.data.surface import bounding_box, make_well_composed, volume_to_mesh
from pointforge.data.volumes import Volume, read_binary_volume
from pointforge.errors import ConfigError, DataError, UserError
from pointforge.implant.dicom_out import write_encapsulated_stl
from pointforge.implant.thickness import min_wall_thickness

__all__ = ["PrintOptions", "measuring_pitch", "printable_mesh", "write_printable"]

_MAX_WORK_VOXELS = 4_000_000
_COVER_PASSES = 4
_GROW_ROUNDS = 2


@dataclass(frozen=True)
class PrintOptions:
    """Which implant becomes the STL and how it is made printable; checked when made (ConfigError)."""

    choice: str = "vote"  # "vote", or a proposal's number K (its proposals/implant_K file)
    min_thickness_mm: float = 0.0  # 0: as generated
    margin_mm: float = 0.0  # 0: no flange; a flange is min_thickness_mm thick, so needs one

    def __post_init__(self) -> None:
        if self.choice != "vote" and not (self.choice.isdigit() and len(self.choice) < 4):
            raise ConfigError(
                f"the implant to print must be 'vote' or a proposal's number (0, 1, ...), got {self.choice!r}"
            )
        for name, value, most in (("min thickness", self.min_thickness_mm, 20), ("margin", self.margin_mm, 30)):
            if not 0 <= value <= most:
                raise ConfigError(f"the {name} must be between 0 and {most} mm, got {value}")
        if 0 < self.min_thickness_mm < 1:
            raise ConfigError(
                f"a minimum thickness of {self.min_thickness_mm} mm is below 1 mm, too thin to print or to measure "
                "in bounded time; use 0 (as generated) or 1 to 20 mm"
            )
        if self.margin_mm > 0 and self.min_thickness_mm == 0:
            raise ConfigError("a margin needs a minimum thickness too (the flange on the skull is that thick)")

    @property
    def proposal(self) -> int | None:
        return None if self.choice == "vote" else int(self.choice)

    def slug(self) -> str:
        """The choice in a file name: vote-t3mm-m2mm, proposal1-t0mm-m0mm."""
        name = "vote" if self.proposal is None else f"proposal{self.proposal}"
        return f"{name}-t{self.min_thickness_mm:g}mm-m{self.margin_mm:g}mm"


@dataclass
class _Grid:
    """A fine isotropic grid: voxel j lies at the input's index ``start + j * step``."""

    start: np.ndarray
    step: np.ndarray
    voxel_mm: float

    def resample(self, mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        values = ndimage.affine_transform(
            mask.astype(np.float32), self.step, offset=self.start, output_shape=shape, order=1, cval=0.0
        )
        return values >= 0.5


def _grid(implant: np.ndarray, spacing: np.ndarray, options: PrintOptions) -> tuple[_Grid, tuple[int, ...]]:
    box = bounding_box(implant)
    if box is None:
        raise DataError("the chosen implant is empty: there is nothing to print")
    wanted = [float(spacing.min())]
    wanted += [options.min_thickness_mm / 4] if options.min_thickness_mm else []
    reach_mm = options.margin_mm + 3 * options.min_thickness_mm + 3 * float(spacing.max())
    lo = np.array([b.start for b in box]) - reach_mm / spacing
    hi = np.array([b.stop - 1 for b in box]) + reach_mm / spacing
    extent_mm = (hi - lo) * spacing
    voxel = max(min(wanted), float(np.prod(extent_mm) / _MAX_WORK_VOXELS) ** (1 / 3))
    shape = tuple(int(n) for n in np.ceil(extent_mm / voxel) + 1)
    return _Grid(lo, voxel / spacing, voxel), shape


def _dilate(mask: np.ndarray, radius: float) -> np.ndarray:
    return ndimage.distance_transform_edt(~mask) <= radius


def _open(mask: np.ndarray, radius: float) -> np.ndarray:
    return _dilate(ndimage.distance_transform_edt(mask) > radius, radius)


def _flange(implant: np.ndarray, skull: np.ndarray, centre: np.ndarray, margin: float, thick: float) -> np.ndarray:
    """Voxels outside bone within ``margin`` of the implant and ``thick`` of the skull, on the skull's outer side."""
    near_skull, nearest = ndimage.distance_transform_edt(~skull, return_indices=True)
    candidate = ~skull & ~implant & (near_skull <= thick) & _dilate(implant, margin)
    points = np.argwhere(candidate)
    bone = nearest[:, candidate].T
    outer = np.einsum("ij,ij->i", points - bone, bone - centre) > 0
    flange = np.zeros_like(implant)
    flange[tuple(points[outer].T)] = True
    return flange


def _thicken(solid: np.ndarray, centre: np.ndarray, radius: int) -> np.ndarray:
    """``solid`` grown until every voxel lies in a ball of ``radius`` voxels inside it: outward first, then
    balls centred on what is still thin, until the well-composed mask (what is meshed) holds no thin voxel."""
    thin = solid & ~_open(solid, radius)
    if thin.any():
        points = np.argwhere(thin)
        outward = (points - centre) / np.maximum(np.linalg.norm(points - centre, axis=1, keepdims=True), 1e-9)
        limit = np.array(solid.shape) - 1
        behind = np.clip(np.rint(points - outward), 0, limit).astype(int)
        brain_side = ~solid[tuple(behind.T)]
        centres = np.zeros_like(solid)
        ahead = np.clip(np.rint(points[brain_side] + radius * outward[brain_side]), 0, limit).astype(int)
        centres[tuple(ahead.T)] = True
        solid = solid | _dilate(centres, radius)
    # Where two balls touch only along an edge or at a corner, making the mask well-composed (as it is before
    # meshing) fills a voxel that lies in no ball: a bridge the mesh would keep as a thin pinch. Covered too.
    for _ in range(_COVER_PASSES):
        solid = make_well_composed(solid)
        thin = solid & ~_open(solid, radius)
        if not thin.any():
            break
        solid = solid | _dilate(thin, radius)
    return solid


def _smoothed(solid: np.ndarray) -> np.ndarray:
    """The field that is meshed at 0.5: ``solid`` made well-composed, smoothed by one working voxel (so the
    surface has no voxel staircase, whose ledges would be thin features of their own), and a cavity sealed
    inside it filled (it would trap resin or powder, and its walls would measure as thin as it is small)."""
    field = ndimage.gaussian_filter(make_well_composed(solid.copy()).astype(np.float32), sigma=1.0)
    inside = field >= 0.5
    field[ndimage.binary_fill_holes(inside) & ~inside] = 1.0
    return field


def _solid(fine: np.ndarray, bone: np.ndarray, centre: np.ndarray, voxel_mm: float, radius: int, margin_mm: float):
    """The implant with its flange (``margin_mm``), every voxel in a ball of ``radius`` voxels inside it."""
    solid = fine
    if margin_mm:
        thick = (2 * radius - 1) * voxel_mm
        solid = solid | _flange(fine, bone, centre, margin_mm / voxel_mm, thick / voxel_mm)
    if radius:
        pad = 2 * radius + 2
        solid = _thicken(np.pad(solid, pad), centre + pad, radius)[(slice(pad, -pad),) * 3]
    return solid


def _mesh(solid: np.ndarray, grid: _Grid, skull: Volume):
    """The closed surface of ``solid`` (on ``grid``) in ``skull``'s physical space, in mm."""
    import trimesh

    field = _smoothed(solid)
    verts, faces = volume_to_mesh(field, level=0.5)
    verts_mm = skull.voxel_to_physical(grid.start + verts * grid.step)
    if np.linalg.det(skull.affine()[:3, :3]) < 0:
        faces = faces[:, ::-1].copy()
    # The mesh as the STL holds it (float32), so that what is checked and measured is what is written: far
    # from the origin (a CT's table position) vertices a few µm apart become one, and their triangles lines.
    mesh = trimesh.Trimesh(vertices=verts_mm.astype(np.float32).astype(np.float64), faces=faces, process=False)
    mesh.merge_vertices()
    mesh.update_faces(mesh.nondegenerate_faces())
    mesh.remove_unreferenced_vertices()
    return mesh


def measuring_pitch(options: PrintOptions, voxel_mm: float) -> float:
    """The measuring voxel: a sixth of the thickness asked, so that the reading (up to two voxels low) is within
    a third of it whatever the implant's size; as generated, half the working voxel (at least 0.5 mm)."""
    return options.min_thickness_mm / 6 if options.min_thickness_mm else max(voxel_mm / 2, 0.5)


def printable_mesh(implant: np.ndarray, skull: Volume, options: PrintOptions):
    """The printable mesh (``trimesh.Trimesh``, mm, the input's physical space) of ``implant`` (a mask on
    ``skull``'s grid) and what was measured on it. With a minimum thickness ``T``, the solid is made for
    ``T`` plus two measuring voxels (what the reading may lose) and measured; grown by a working voxel and
    made again, at most twice, while the reading is below ``T``."""
    spacing = np.asarray(skull.spacing, dtype=np.float64)
    grid, shape = _grid(implant, spacing, options)
    fine = grid.resample(implant, shape)
    bone = grid.resample(skull.data, shape) & ~fine
    if not fine.any():
        raise DataError("the chosen implant is thinner than half a voxel everywhere: there is nothing to print")
    centre = (np.argwhere(skull.data | implant).mean(axis=0) - grid.start) / grid.step
    wanted = options.min_thickness_mm
    pitch = measuring_pitch(options, grid.voxel_mm)
    radius = int(np.ceil((wanted + 2 * pitch) / (2 * grid.voxel_mm))) + 1 if wanted else 0
    up_to = 1.5 * wanted if wanted else 8 * pitch
    for grow in range(_GROW_ROUNDS + 1 if wanted else 1):
        solid = _solid(fine, bone, centre, grid.voxel_mm, radius + grow, options.margin_mm)
        mesh = _mesh(solid, grid, skull)
        thickness = min_wall_thickness(mesh, pitch, up_to)
        if thickness >= wanted:
            break
    else:
        raise DataError(
            f"the STL measured {thickness:.2f} mm thick where {wanted:g} mm was asked, after growing it "
            f"{_GROW_ROUNDS} times; ask a smaller thickness, or report this case"
        )
    return mesh, {
        "choice": options.choice,
        "min_thickness_mm": options.min_thickness_mm,
        "margin_mm": options.margin_mm,
        "measured_min_thickness_mm": round(thickness, 3),
        "measured_at_mm": round(pitch, 4),
        "measured_up_to_mm": round(up_to, 3),
        "working_voxel_mm": round(grid.voxel_mm, 4),
        "overlap_with_skull_mm3": round(float((solid & bone).sum()) * grid.voxel_mm**3, 1),
    }


def write_printable(case: Path, input_path: Path, options: PrintOptions) -> tuple[Path, dict]:
    """The printable STL of a finished case folder (``generate``'s, made from ``input_path``), made once per
    choice and setting into ``case/printable/<case>-<slug>.stl`` (named for the case and the choice, so that a
    copy taken elsewhere still says what it is) with its measurements beside it (``.json``); (the STL, the
    measurements). For a CT series in, the same mesh also as Encapsulated STL in the series' Frame of Reference,
    ``<case>-<slug>.dcm``, named in the measurements as ``stl_dicom``."""
    stem = f"{case.resolve().name}-{options.slug()}"  # no with_suffix: a slug such as t2.5mm has a dot of its own
    stl, record = case / "printable" / f"{stem}.stl", case / "printable" / f"{stem}.json"
    if stl.is_file() and record.is_file():
        return stl, json.loads(record.read_text())
    outputs = json.loads((case / "report.json").read_text())["outputs"]
    if options.proposal is not None and options.proposal >= len(outputs["proposals"]):
        raise UserError(f"this case has proposals 0 to {len(outputs['proposals']) - 1}; choose one of them or 'vote'")
    chosen = outputs["implant"] if options.proposal is None else outputs["proposals"][options.proposal]
    skull, series = read_skull_input(input_path)
    implant = read_binary_volume(case / chosen, allow_empty=True).data
    mesh, measured = printable_mesh(implant, skull, options)
    measured["watertight"] = bool(mesh.is_watertight)
    measured["volume_cm3"] = round(float(mesh.volume) / 1000.0, 3)
    stl.parent.mkdir(exist_ok=True)
    with atomic_path(stl, suffix=".stl") as tmp:
        mesh.export(tmp, file_type="stl")
    if series is not None:
        title = f"pointforge print-ready implant {options.slug()}"
        write_encapsulated_stl(stl.parent / f"{stem}.dcm", stl.read_bytes(), series.headers, description=title)
        measured["stl_dicom"] = f"{stem}.dcm"
    atomic_write_text(record, json.dumps(measured, indent=1))
    return stl, measured
