"""The baseline PCDiff is compared against: the defect filled with the mean registered training skull.

An :class:`Atlas` holds the complete training skulls (masks with their
geometry, their bone-surface points in mm and a k-d tree over them), built
once and reused for every test case. For one defective skull,
:func:`mean_skull_implant`

1. registers every atlas skull to it (:func:`register`): ICP from the
   defective skull's surface points *onto* the atlas skull's surface. The
   defect only removes bone, so every defective-skull point has a counterpart
   on a complete skull, while the reverse is false (the atlas bone over the
   defect has none); fitting in this direction needs no knowledge of where the
   defect is. The transform is per-axis scale + translation + rotation,
   initialised by matching centroids, refitted in closed form on the
   nearest-neighbour pairs (optionally dropping the worst ``1 - trim``);
2. resamples each atlas mask into the defective skull's grid through that
   transform (linear interpolation) and averages them: a per-voxel
   probability of bone; the mean skull is where it is at least 0.5;
3. takes mean skull minus the defective skull, optionally thickened first
   (see below), and cleans it with the PCDiff pipeline's own chain
   (:func:`pointforge.implant.postprocess.clean_implant`: opening 3³, largest
   component, median, closing, hole filling, largest component).

Everything happens in physical millimetres (``Volume.affine``), so atlas and
test skulls may have different grids. Deterministic: surface points are
subsampled with a fixed seed, the ICP has a fixed iteration cap and tolerance.

Why the atlas comes from a prepared dataset (:meth:`Atlas.from_prepared`):
its ``cases.csv`` already says which skulls are the training split, and the
complete masks it stores come with their grid geometry in the matching
``.json``; a raw folder has no split. :meth:`Atlas.from_volumes` takes any
complete-skull :class:`~pointforge.data.volumes.Volume` objects.

The cleaning is the PCDiff pipeline's, with its structuring elements sized in
millimetres as upstream's at 0.45 mm (:func:`~pointforge.implant.postprocess.morphology_radius`);
``thicken`` defaults to the same radius (the pipeline dilates each proposal by
it before the vote). Bilateral defects score lowest because the cleaning keeps
the largest component only, i.e. one of the two defects (as upstream's chain).

Its scores on the demo's data, the choices measured along the way (the
clean-up's size, thickening, threshold, rotation, trimming) and its cost per
case are in docs/experiments/implant.md ("The baseline, measured").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy import ndimage
from scipy.spatial import cKDTree

from pointforge.data.registration import Registration, register
from pointforge.data.skulls.prepared import PreparedCase, PreparedDataset
from pointforge.data.surface import bounding_box, surface_points
from pointforge.data.volumes import Volume
from pointforge.errors import DataError
from pointforge.implant.postprocess import clean_implant, morphology_radius

__all__ = [
    "Atlas",
    "AtlasSkull",
    "Registration",
    "atlas_surface",
    "mean_skull",
    "mean_skull_implant",
    "prepared_skulls",
    "register",
    "surface_points_mm",
]

# The mean skull's grid, at most this size in mm (mean_grid): a SkullFix or SkullBreak scan (0.45 / 0.4 mm)
# is counted at 0.9 / 0.8 mm, a 64³ synthetic one (3.6 mm) on its own grid. Its cost and its scores against
# the whole grid's: docs/experiments/realskulls.md (session 24).
MEAN_GRID_MM = 1.0
ATLAS_POINTS = 20_000  # per atlas skull; 50 000 fitted no better (DSC 0.585 both) at twice the time
_CUBE = np.ones((3, 3, 3), dtype=bool)


# ----------------------------------------------------------------------------- surfaces


def _checked_mask(volume: Volume, name: str) -> np.ndarray:
    data = np.asarray(volume.data)
    if data.ndim != 3:
        raise DataError(f"{name} must be a 3-D volume, got an array of shape {tuple(data.shape)}")
    mask = data != 0
    if not mask.any():
        raise DataError(f"{name} is empty (no bone voxel); is this the right volume?")
    return mask


def surface_points_mm(mask: np.ndarray, affine: np.ndarray, n_points: int, *, seed: int = 0) -> np.ndarray:
    """``n_points`` points on the mask's marching-cubes surface (area-uniform, seeded), in mm.

    A mesh surface rather than border voxels: at 64³ the bone is two voxels
    thick, so every bone voxel is a border voxel and the "surface" would be
    the whole slab, within which a nearest-neighbour fit slides freely (a 6 %
    scale error went unnoticed that way). The iso-surface keeps the outer and
    inner sheets of the bone apart.
    """
    points = surface_points(mask, n_points, seed=seed).astype(np.float64)
    return points @ affine[:3, :3].T + affine[:3, 3]


# ----------------------------------------------------------------------------- atlas


def atlas_surface(mask: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """An atlas skull's surface points in mm (:data:`ATLAS_POINTS`, seeded): what its registration fits to.
    The costly part of an atlas skull (marching cubes over the whole skull)."""
    return surface_points_mm(mask, affine, ATLAS_POINTS)


@dataclass(frozen=True)
class AtlasSkull:
    """One complete training skull, kept small: its mask cropped to the bone's box (one empty voxel
    around it) and packed to bits, with ``affine`` for the cropped grid. Sixty full-resolution
    SkullFix skulls held as bool arrays took 5.5 GB in each worker of the demo."""

    name: str
    bits: np.ndarray  # np.packbits of the cropped bool mask
    shape: tuple[int, int, int]  # the cropped mask's shape
    affine: np.ndarray  # 4×4 voxel index of the cropped mask → mm
    surface: np.ndarray  # [ATLAS_POINTS, 3] surface points in mm
    tree: cKDTree  # over ``surface``

    @classmethod
    def of(cls, name: str, mask: np.ndarray, affine: np.ndarray, surface: np.ndarray | None = None) -> "AtlasSkull":
        """The skull of a bool ``mask`` on a grid with ``affine``, cropped and packed; ``surface``: its
        :func:`atlas_surface` when already computed (elsewhere, e.g. by another process), else computed here."""
        box = bounding_box(mask, margin=1)
        if box is None:
            raise DataError(f"atlas skull {name} is empty (no bone voxel)")
        lo = np.array([b.start for b in box])
        cropped = mask[box]
        shift = np.eye(4)
        shift[:3, 3] = lo
        surface = atlas_surface(mask, affine) if surface is None else np.asarray(surface, dtype=np.float64)
        shape = (int(cropped.shape[0]), int(cropped.shape[1]), int(cropped.shape[2]))
        return cls(name, np.packbits(cropped), shape, affine @ shift, surface, cKDTree(surface))

    @property
    def bytes(self) -> np.ndarray:
        """The cropped mask unpacked as 0/1 bytes (uint8; a new array each time)."""
        return np.unpackbits(self.bits, count=math.prod(self.shape)).reshape(self.shape)

    @property
    def mask(self) -> np.ndarray:
        """The cropped bool mask, unpacked (a new array each time)."""
        return self.bytes.view(bool)


class Atlas:
    """Complete training skulls, ready to be registered to any number of test skulls."""

    def __init__(self, skulls: Sequence[AtlasSkull]):
        if not skulls:
            raise DataError("the atlas has no skulls; give at least one complete training skull")
        self.skulls = tuple(skulls)

    def __len__(self) -> int:
        return len(self.skulls)

    @classmethod
    def from_volumes(
        cls,
        volumes: Sequence[Volume],
        names: Sequence[str] | None = None,
        surfaces: Mapping[str, np.ndarray] | None = None,
    ) -> "Atlas":
        """An atlas of complete-skull volumes (any grids; geometry from each Volume). ``surfaces``: the
        :func:`atlas_surface` of skulls by name, where already computed."""
        volumes = list(volumes)
        if not volumes:
            raise DataError("the atlas has no skulls; give at least one complete training skull")
        names = list(names) if names is not None else [f"skull {i}" for i in range(len(volumes))]
        known = surfaces or {}
        skulls = []
        for name, volume in zip(names, volumes):
            mask = _checked_mask(volume, f"atlas skull {name}")
            skulls.append(AtlasSkull.of(name, mask, volume.affine(), known.get(name)))
        return cls(skulls)

    @classmethod
    def from_prepared(cls, root, split: str = "train", surfaces: Mapping[str, np.ndarray] | None = None) -> "Atlas":
        """The complete skulls of one split of a prepared dataset (each skull once; :func:`prepared_skulls`),
        read one at a time (sixty full-resolution masks at once would take gigabytes). ``surfaces``: as
        :meth:`from_volumes`'s."""
        known = surfaces or {}
        skulls = []
        for name, load in prepared_skulls(root, split):
            volume = load()
            mask = _checked_mask(volume, f"atlas skull {name}")
            skulls.append(AtlasSkull.of(name, mask, volume.affine(), known.get(name)))
        return cls(skulls)


def prepared_skulls(root, split: str = "train") -> list[tuple[str, Callable[[], Volume]]]:
    """The complete skulls of one split of a prepared dataset, each once: (skull id, a function reading it).

    The masks are on the grid prepare wrote them on (resampled for SkullFix); the ``.json`` beside the
    complete skull's points holds that grid's spacing, origin and direction.
    """
    data = root if isinstance(root, PreparedDataset) else PreparedDataset(root)
    seen: dict[str, PreparedCase] = {}
    for case in data.split(split, require=("complete_mask",)):
        seen.setdefault(case.complete_mask, case)
    if not seen:
        raise DataError(f"{data.root}: the {split!r} split has no complete skull; the atlas needs at least one")

    def reader(case: PreparedCase) -> Callable[[], Volume]:
        def read() -> Volume:
            meta = data.meta(case.complete)
            return Volume(
                data=data.complete_mask(case),
                spacing=tuple(meta["spacing"]),
                origin=tuple(meta["origin"]),
                direction=np.asarray(meta["direction"]),
            )

        return read

    return [(case.skull_id, reader(case)) for case in seen.values()]


# ----------------------------------------------------------------------------- registration


# ----------------------------------------------------------------------------- mean skull and implant


def _resampled(
    skull: AtlasSkull, reg: Registration, affine: np.ndarray, shape: tuple[int, ...]
) -> tuple[tuple[slice, ...], np.ndarray] | None:
    """The atlas mask seen from a target grid (voxel → mm ``affine``, ``shape``): target voxel → mm →
    atlas mm → atlas voxel, linear.

    Only the box of the target grid that the atlas skull's bone box maps to is interpolated (the
    rest is 0): returns that box and its float32 values, or None when it misses the grid. The
    mask's 0/1 bytes are read as they are, without a float copy (the same values).
    """
    to_atlas = np.eye(4)
    to_atlas[:3, :3], to_atlas[:3, 3] = reg.matrix, reg.offset
    m = np.linalg.inv(skull.affine) @ to_atlas @ affine  # target voxel → atlas voxel
    mask = skull.bytes
    bone = bounding_box(mask)
    if bone is None:
        return None
    first = np.array([b.start for b in bone], dtype=np.float64)
    last = np.array([b.stop - 1 for b in bone], dtype=np.float64)
    corners = np.array([[a, b, c] for a in (0, 1) for b in (0, 1) for c in (0, 1)], dtype=np.float64)
    corners = first - 1 + corners * (last - first + 2)
    in_target = (corners - m[:3, 3]) @ np.linalg.inv(m[:3, :3]).T
    size = np.asarray(shape)
    lo = np.clip(np.floor(in_target.min(axis=0)).astype(int), 0, size)
    hi = np.clip(np.ceil(in_target.max(axis=0)).astype(int) + 1, 0, size)
    if np.any(hi <= lo):
        return None
    values = ndimage.affine_transform(
        mask,
        m[:3, :3],
        offset=m[:3, :3] @ lo + m[:3, 3],
        output_shape=tuple(int(n) for n in hi - lo),
        output=np.float32,
        order=1,
        mode="constant",
        cval=0.0,
    )
    return tuple(slice(int(a), int(b)) for a, b in zip(lo, hi)), values


def mean_grid(spacing, grid_mm: float | None) -> int:
    """How many of the case's voxels per axis one voxel of the mean skull's grid spans: the largest whole
    number whose voxels stay within ``grid_mm`` (at least 1; None: 1, the case's own grid)."""
    if grid_mm is None:
        return 1
    return max(1, int(np.floor(float(grid_mm) / float(np.min(np.asarray(spacing, dtype=np.float64))) + 1e-9)))


def mean_skull(
    defective: Volume,
    atlas: Atlas,
    *,
    rotation: bool = True,
    n_points: int = 3000,
    grid_mm: float | None = MEAN_GRID_MM,
) -> tuple[np.ndarray, list[Registration]]:
    """Per-voxel fraction of registered atlas skulls covering each voxel of ``defective``'s grid.

    The fractions are counted on a grid of about ``grid_mm`` voxels (every ``k``-th voxel of the case's
    grid, :func:`mean_grid`) and interpolated linearly to the case's grid (None: counted on the case's
    own grid): each atlas skull's interpolation is the baseline's cost, and a full-resolution scan has
    tens of millions of voxels in a skull's box (3.3 s a skull on a SkullFix scan, 0.45 mm).
    Returns the probability map (float32, the defective skull's shape) and one
    :class:`Registration` per atlas skull.
    """
    if not isinstance(atlas, Atlas):
        raise DataError(
            f"atlas must be an Atlas (Atlas.from_prepared or Atlas.from_volumes), got {type(atlas).__name__}"
        )
    mask = _checked_mask(defective, "the defective skull")
    points = surface_points_mm(mask, defective.affine(), n_points)
    k = mean_grid(defective.spacing, grid_mm)
    shape = tuple(-(-(n - 1) // k) + 1 for n in defective.shape)  # its last voxel at or past the case's
    affine = defective.affine() @ np.diag([k, k, k, 1.0])
    total = np.zeros(shape, dtype=np.float32)
    regs = []
    for skull in atlas.skulls:
        reg = register(points, skull, rotation=rotation)
        regs.append(reg)
        seen = _resampled(skull, reg, affine, shape)
        if seen is not None:  # outside its box an atlas skull adds 0: the same sums as over the whole grid
            total[seen[0]] += seen[1]
    prob = total / len(atlas.skulls)
    if k == 1:
        return prob, regs
    fine = ndimage.affine_transform(prob, np.full(3, 1.0 / k), output_shape=defective.shape, order=1, mode="nearest")
    return fine.astype(np.float32, copy=False), regs


def mean_skull_implant(
    defective: Volume,
    atlas: Atlas,
    *,
    rotation: bool = True,
    threshold: float = 0.5,
    thicken: int | None = None,
    grid_mm: float | None = MEAN_GRID_MM,
) -> Volume:
    """The baseline implant for one defective skull: a bool Volume on the defective skull's grid.

    Mean skull (probability ≥ ``threshold``), dilated ``thicken`` times by a
    3³ cube (default: the pipeline's morphology radius for this grid, as the
    PCDiff pipeline dilates each proposal before its vote), minus the
    defective skull, then the pipeline's cleaning at that radius. Empty when
    nothing survives the cleaning. ``grid_mm``: :func:`mean_skull`'s.
    """
    radius = morphology_radius(defective.spacing)
    thicken = radius if thicken is None else thicken
    prob, _ = mean_skull(defective, atlas, rotation=rotation, grid_mm=grid_mm)
    skull = prob >= threshold
    if thicken > 0:
        skull = ndimage.binary_dilation(skull, _CUBE, iterations=thicken)
    return defective.with_data(clean_implant(skull & ~(np.asarray(defective.data) != 0), radius))
