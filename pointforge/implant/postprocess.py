"""From voxelised proposals to one clean implant (upstream's post-processing, REFERENCE.md).

n proposals → each dilated → majority vote (≥ ⌈n/2⌉) → minus the defective skull →
keep voxels within ``radius_factor`` × the radius of the generated implant
points around their centre → opening 3³, largest component, median 3³, closing,
hole filling, largest component. The per-voxel agreement of the proposals is the
uncertainty map.

All morphology runs inside the bounding box of the candidate implant plus a
margin, so a 512³ case costs what its implant costs, not what its volume costs.
The result is identical to running on the full volume as long as the margin
covers the structuring elements' reach (it does: every operation below reaches
at most a few voxels, and the margin is larger).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from pointforge.errors import DataError

_CUBE = np.ones((3, 3, 3), dtype=bool)
_MARGIN = 6


@dataclass
class Vote:
    mask: np.ndarray  # bool, voxels where at least ⌈n/2⌉ proposals agree
    agreement: np.ndarray  # float32 in [0, 1]: fraction of proposals containing each voxel
    n: int


def majority_vote(proposals: list[np.ndarray] | np.ndarray, *, dilate: int = 1) -> Vote:
    """Dilate each proposal ``dilate`` times (3³ cube) and keep voxels in ≥ ⌈n/2⌉ of them."""
    props = [np.asarray(p, dtype=bool) for p in proposals]
    if not props:
        raise DataError("no proposals to vote on")
    shape = props[0].shape
    if any(p.shape != shape for p in props):
        raise DataError(f"proposals differ in shape: {sorted({p.shape for p in props})}")
    counts = np.zeros(shape, dtype=np.uint16)
    for p in props:
        if dilate > 0 and p.any():
            p = _crop_apply(p, lambda m: ndimage.binary_dilation(m, _CUBE, iterations=dilate), margin=dilate + 1)
        counts += p
    n = len(props)
    need = -(-n // 2)  # ceil(n/2)
    return Vote(mask=counts >= need, agreement=(counts / n).astype(np.float32), n=n)


def _bbox(mask: np.ndarray, margin: int) -> tuple[slice, ...] | None:
    if not mask.any():
        return None
    idx = [np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != ax))) for ax in range(mask.ndim)]
    return tuple(slice(max(0, int(i[0]) - margin), min(s, int(i[-1]) + margin + 1)) for i, s in zip(idx, mask.shape))


def _crop_apply(mask: np.ndarray, fn, *, margin: int = _MARGIN) -> np.ndarray:
    box = _bbox(mask, margin)
    out = np.zeros_like(mask, dtype=bool)
    if box is None:
        return out
    out[box] = fn(mask[box])
    return out


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 26-connected component (empty stays empty)."""
    labels, n = ndimage.label(mask, structure=_CUBE)
    if n <= 1:
        return mask.astype(bool)
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    return labels == int(np.argmax(sizes))


def near_points(shape: tuple[int, ...], points_vox: np.ndarray, radius_factor: float = 1.1) -> np.ndarray:
    """Voxels within ``radius_factor`` × (max distance of the points from their centre) of that centre."""
    pts = np.asarray(points_vox, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 3 or len(pts) == 0:
        raise DataError(f"implant points must be a non-empty [N, 3] array, got shape {pts.shape}")
    centre = pts.mean(axis=0)
    radius = np.sqrt(((pts - centre) ** 2).sum(axis=1).max()) * radius_factor
    lo = np.clip(np.floor(centre - radius).astype(int), 0, np.asarray(shape))
    hi = np.clip(np.ceil(centre + radius).astype(int) + 1, 0, np.asarray(shape))
    out = np.zeros(shape, dtype=bool)
    if np.any(hi <= lo):
        return out
    grids = np.ogrid[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
    d2 = sum((g - c) ** 2 for g, c in zip(grids, centre))
    out[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = d2 <= radius**2
    return out


def clean_implant(mask: np.ndarray) -> np.ndarray:
    """Opening 3³, largest component, median 3³, closing, hole filling, largest component."""

    def steps(m: np.ndarray) -> np.ndarray:
        m = ndimage.binary_opening(m, _CUBE)
        m = largest_component(m)
        m = ndimage.median_filter(m.astype(np.uint8), size=3, mode="constant") > 0
        m = ndimage.binary_closing(m, _CUBE)
        m = ndimage.binary_fill_holes(m)
        return largest_component(m)

    return _crop_apply(mask, steps)


def implant_from_proposals(
    proposals: list[np.ndarray],
    defective: np.ndarray,
    implant_points_vox: np.ndarray,
    *,
    dilate: int = 1,
    radius_factor: float = 1.1,
) -> tuple[np.ndarray, Vote]:
    """The full upstream chain. ``proposals`` are completed-skull masks (inside = 1).

    Returns the implant mask and the vote (its agreement map is the uncertainty).
    """
    defective = np.asarray(defective, dtype=bool)
    vote = majority_vote(proposals, dilate=dilate)
    if vote.mask.shape != defective.shape:
        raise DataError(f"proposals have shape {vote.mask.shape}, the defective skull {defective.shape}")
    candidate = vote.mask & ~defective
    candidate &= near_points(defective.shape, implant_points_vox, radius_factor)
    return clean_implant(candidate), vote
