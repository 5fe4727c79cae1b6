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
from typing import Sequence

import numpy as np
from scipy import ndimage
from scipy.spatial import cKDTree

from pointforge.data.registration import Registration, register
from pointforge.data.skulls.prepared import PreparedCase, PreparedDataset
from pointforge.data.surface import surface_points
from pointforge.data.volumes import Volume
from pointforge.errors import DataError
from pointforge.implant.postprocess import clean_implant, morphology_radius

__all__ = ["Atlas", "AtlasSkull", "Registration", "register", "surface_points_mm", "mean_skull", "mean_skull_implant"]

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
    def of(cls, name: str, mask: np.ndarray, affine: np.ndarray) -> "AtlasSkull":
        """The skull of a bool ``mask`` on a grid with ``affine``, cropped and packed."""
        nonzero = np.argwhere(mask)
        lo = np.maximum(nonzero.min(axis=0) - 1, 0)
        hi = np.minimum(nonzero.max(axis=0) + 2, mask.shape)
        cropped = mask[lo[0] : hi[0], lo[1] : hi[1], lo[2] : hi[2]]
        shift = np.eye(4)
        shift[:3, 3] = lo
        surface = surface_points_mm(mask, affine, ATLAS_POINTS)
        shape = (int(cropped.shape[0]), int(cropped.shape[1]), int(cropped.shape[2]))
        return cls(name, np.packbits(cropped), shape, affine @ shift, surface, cKDTree(surface))

    @property
    def mask(self) -> np.ndarray:
        """The cropped bool mask, unpacked (a new array each time)."""
        return np.unpackbits(self.bits, count=math.prod(self.shape)).reshape(self.shape).astype(bool)


class Atlas:
    """Complete training skulls, ready to be registered to any number of test skulls."""

    def __init__(self, skulls: Sequence[AtlasSkull]):
        if not skulls:
            raise DataError("the atlas has no skulls; give at least one complete training skull")
        self.skulls = tuple(skulls)

    def __len__(self) -> int:
        return len(self.skulls)

    @classmethod
    def from_volumes(cls, volumes: Sequence[Volume], names: Sequence[str] | None = None) -> "Atlas":
        """An atlas of complete-skull volumes (any grids; geometry from each Volume)."""
        volumes = list(volumes)
        if not volumes:
            raise DataError("the atlas has no skulls; give at least one complete training skull")
        names = list(names) if names is not None else [f"skull {i}" for i in range(len(volumes))]
        skulls = []
        for name, volume in zip(names, volumes):
            mask = _checked_mask(volume, f"atlas skull {name}")
            skulls.append(AtlasSkull.of(name, mask, volume.affine()))
        return cls(skulls)

    @classmethod
    def from_prepared(cls, root, split: str = "train") -> "Atlas":
        """The complete skulls of one split of a prepared dataset (each skull once).

        The masks are on the grid prepare wrote them on (resampled for
        SkullFix); the ``.json`` beside the complete skull's points holds that
        grid's spacing, origin and direction.
        """
        data = root if isinstance(root, PreparedDataset) else PreparedDataset(root)
        seen: dict[str, PreparedCase] = {}
        for case in data.split(split, require=("complete_mask",)):
            seen.setdefault(case.complete_mask, case)
        if not seen:
            raise DataError(f"{data.root}: the {split!r} split has no complete skull; the atlas needs at least one")
        volumes, names = [], []
        for case in seen.values():
            meta = data.meta(case.complete)
            volumes.append(
                Volume(
                    data=data.complete_mask(case),
                    spacing=tuple(meta["spacing"]),
                    origin=tuple(meta["origin"]),
                    direction=np.asarray(meta["direction"]),
                )
            )
            names.append(case.skull_id)
        return cls.from_volumes(volumes, names)


# ----------------------------------------------------------------------------- registration


# ----------------------------------------------------------------------------- mean skull and implant


def _resample_into(skull: AtlasSkull, reg: Registration, target: Volume) -> np.ndarray:
    """The atlas mask seen from the target grid: target voxel → mm → atlas mm → atlas voxel, linear.

    Only the box of the target grid that the atlas skull's bounding box maps
    to is interpolated (the rest is 0 anyway): the skull fills about a third
    of the field of view, and this is the costliest step at 128³.
    """
    to_atlas = np.eye(4)
    to_atlas[:3, :3], to_atlas[:3, 3] = reg.matrix, reg.offset
    m = np.linalg.inv(skull.affine) @ to_atlas @ target.affine()  # target voxel → atlas voxel
    mask = skull.mask
    nonzero = np.argwhere(mask)
    corners = np.array([[a, b, c] for a in (0, 1) for b in (0, 1) for c in (0, 1)], dtype=np.float64)
    corners = nonzero.min(axis=0) - 1 + corners * (nonzero.max(axis=0) - nonzero.min(axis=0) + 2)
    in_target = (corners - m[:3, 3]) @ np.linalg.inv(m[:3, :3]).T
    shape = np.asarray(target.shape)
    lo = np.clip(np.floor(in_target.min(axis=0)).astype(int), 0, shape)
    hi = np.clip(np.ceil(in_target.max(axis=0)).astype(int) + 1, 0, shape)
    out = np.zeros(target.shape, dtype=np.float32)
    if np.any(hi <= lo):
        return out
    out[lo[0] : hi[0], lo[1] : hi[1], lo[2] : hi[2]] = ndimage.affine_transform(
        mask.astype(np.float32),
        m[:3, :3],
        offset=m[:3, :3] @ lo + m[:3, 3],
        output_shape=tuple(int(n) for n in hi - lo),
        order=1,
        mode="constant",
        cval=0.0,
    )
    return out


def mean_skull(
    defective: Volume,
    atlas: Atlas,
    *,
    rotation: bool = True,
    n_points: int = 3000,
) -> tuple[np.ndarray, list[Registration]]:
    """Per-voxel fraction of registered atlas skulls covering each voxel of ``defective``'s grid.

    Returns the probability map (float32, the defective skull's shape) and one
    :class:`Registration` per atlas skull.
    """
    if not isinstance(atlas, Atlas):
        raise DataError(
            f"atlas must be an Atlas (Atlas.from_prepared or Atlas.from_volumes), got {type(atlas).__name__}"
        )
    mask = _checked_mask(defective, "the defective skull")
    points = surface_points_mm(mask, defective.affine(), n_points)
    total = np.zeros(defective.shape, dtype=np.float32)
    regs = []
    for skull in atlas.skulls:
        reg = register(points, skull, rotation=rotation)
        regs.append(reg)
        total += _resample_into(skull, reg, defective)
    return total / len(atlas.skulls), regs


def mean_skull_implant(
    defective: Volume,
    atlas: Atlas,
    *,
    rotation: bool = True,
    threshold: float = 0.5,
    thicken: int | None = None,
) -> Volume:
    """The baseline implant for one defective skull: a bool Volume on the defective skull's grid.

    Mean skull (probability ≥ ``threshold``), dilated ``thicken`` times by a
    3³ cube (default: the pipeline's morphology radius for this grid, as the
    PCDiff pipeline dilates each proposal before its vote), minus the
    defective skull, then the pipeline's cleaning at that radius. Empty when
    nothing survives the cleaning.
    """
    radius = morphology_radius(defective.spacing)
    thicken = radius if thicken is None else thicken
    prob, _ = mean_skull(defective, atlas, rotation=rotation)
    skull = prob >= threshold
    if thicken > 0:
        skull = ndimage.binary_dilation(skull, _CUBE, iterations=thicken)
    return defective.with_data(clean_implant(skull & ~(np.asarray(defective.data) != 0), radius))
