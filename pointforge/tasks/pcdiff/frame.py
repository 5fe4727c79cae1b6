"""Where the implant goes: a local frame around the defect, and its estimate from an atlas.

PCDiff as published diffuses the implant in the frame of the whole skull and
starts sampling from noise centred on the skull: the network must discover
where the defect is. Trained for minutes on a CPU it does not; its implants
spread over the whole skull (issue #12, docs/pcdiff.md). A *local frame*
takes placement out of the diffusion: the implant's points are expressed
relative to a centre near the defect, the skull is cropped to the points
nearest that centre, and sampling starts from noise around it. Training uses
the true implant centre, jittered; testing needs an estimate from the
defective skull alone, which :func:`estimate_implant` makes by
registering complete training skulls (an atlas) onto it and taking the atlas
bone that the defective skull lacks.

Coordinates: the functions here work in millimetres (voxel index × spacing);
the frame itself (:class:`LocalFrame`) works in whatever coordinates its centre
is given in.

With ``task.frame`` set, every example is built by :func:`frame_condition`:
the defective skull is normalised by its bounding box as usual, then moved to a
frame centred on the implant (training: the true centre, jittered; validation
and inference: the atlas estimate) and scaled by ``frame.scale``; the
conditioning points are ``n_skull`` of the skull points nearest that centre.
Sampling therefore starts from noise around the estimated centre. The atlas
(surface points of the training split's complete skulls, mm) travels inside the
model as a buffer (:class:`FramedDenoiser`), so a checkpoint alone can place
implants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components
from scipy.spatial import cKDTree
from torch import nn

from pointforge.data.registration import SurfaceTarget, invert, register
from pointforge.data.skulls.normalization import Normalization, bbox_normalization
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import ConfigError, DataError

__all__ = [
    "LocalFrame",
    "nearest_indices",
    "subsample_fixed",
    "ImplantEstimate",
    "estimate_implant",
    "PriorSection",
    "FrameSection",
    "FramedDenoiser",
    "frame_condition",
    "prior_points",
    "build_atlas",
    "atlas_estimate",
]


@dataclass(frozen=True)
class LocalFrame:
    """``local = (p - center) / scale``; ``inverse`` maps back."""

    center: np.ndarray  # [3]
    scale: float

    def apply(self, points: np.ndarray) -> np.ndarray:
        return ((np.asarray(points) - self.center) / self.scale).astype(np.float32)

    def inverse(self, points: np.ndarray) -> np.ndarray:
        return (np.asarray(points) * self.scale + self.center).astype(np.float32)


def nearest_indices(points: np.ndarray, center: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` points nearest ``center`` (all of them, repeated to ``n``, if fewer)."""
    d2 = ((np.asarray(points, dtype=np.float64) - center) ** 2).sum(axis=1)
    if len(d2) <= n:
        return np.resize(np.argsort(d2), n)
    return np.sort(np.argpartition(d2, n - 1)[:n])


def subsample_fixed(points: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` points drawn without replacement by a fixed seed (all if fewer)."""
    points = np.asarray(points)
    if len(points) <= n:
        return np.asarray(points, dtype=np.float64)
    idx = np.random.default_rng(seed).choice(len(points), n, replace=False)
    return np.asarray(points[np.sort(idx)], dtype=np.float64)


@dataclass(frozen=True)
class ImplantEstimate:
    """What the atlas says of a defective skull's missing bone: its centre and its points (same units)."""

    center: np.ndarray  # [3]
    points: (
        np.ndarray
    )  # [M, 3]: missing atlas bone that at least ``agree`` of the best-agreed count of atlas skulls share


def estimate_implant(
    defective_mm: np.ndarray,
    atlas_mm: list[np.ndarray],
    *,
    gap_mm: float = 12.0,
    radius_mm: float = 10.0,
    points: int = 2000,
    agree: float = 0.5,
    pieces: float = 0.5,
    bend_mm: float = 0.0,
) -> ImplantEstimate:
    """The bone missing from a defective skull (mm), from complete skulls: its centre and its points.

    Each atlas skull's surface (``[M, 3]`` mm) is registered onto the defective
    skull (trimmed ICP from the defective points onto the atlas, the direction
    that needs no knowledge of the defect) and mapped back; its points farther
    than ``gap_mm`` from every defective-skull point are bone this skull says is
    missing. Skulls differ in shape, so each also "misses" bone where it merely
    differs; the defect is what *every* atlas skull misses. Each missing point
    gets a vote: how many atlas skulls have a missing point within ``radius_mm``.
    The points are those with at least ``agree`` times the most votes (the
    prior shape :class:`PriorSection` starts sampling from), split into pieces
    (points within ``radius_mm`` of each other are one piece); only pieces with
    at least ``pieces`` times the largest piece's points are kept
    (:func:`main_pieces`), and the centre is the centroid of their points with
    the most votes.

    Measured on the demo data (10 synthetic skulls at 64³, 3.6 mm voxels, 6
    atlas skulls, 20 validation and test cases): mean centre error 6.6 mm, median
    3.8 mm; the median of per-skull centroids gave 18 mm mean, the box centre
    68 mm (docs/experiments/pcdiff.md).
    """
    if not atlas_mm:
        raise DataError("the implant-frame atlas has no skulls; train with at least one complete training skull")
    defective = subsample_fixed(defective_mm, points)
    tree = cKDTree(defective)
    found = []
    for skull in atlas_mm:
        target = SurfaceTarget.of(subsample_fixed(skull, points))
        mapped = invert(register(defective, target, iterations=30), target.surface)
        if bend_mm > 0:
            mapped = bent(mapped, defective, tree, bend_mm, gap_mm)
        found.append(mapped[tree.query(mapped)[0] > gap_mm])
    if not sum(len(m) for m in found):
        # Nothing is missing from the view of any atlas skull: no better guess than the skull itself.
        center = defective.mean(axis=0)
        return ImplantEstimate(center=center, points=center[None])
    missing, votes = _votes(found, radius_mm)
    agreed = votes >= max(1.0, agree * votes.max())
    missing, votes = missing[agreed], votes[agreed]
    kept = main_pieces(missing, radius_mm, pieces)
    missing, votes = missing[kept], votes[kept]
    return ImplantEstimate(center=missing[votes == votes.max()].mean(axis=0), points=missing)


def _votes(found: list[np.ndarray], radius_mm: float) -> tuple[np.ndarray, np.ndarray]:
    """Every atlas skull's missing points together, each with how many skulls have one within ``radius_mm``.

    One k-d tree a skull: memory grows with the points, not with their neighbours (a ball query
    over the missing points of an 8,000-point atlas took gigabytes)."""
    missing = np.concatenate(found)
    votes = np.zeros(len(missing), dtype=np.int64)
    for own in found:
        if len(own):
            dist, _ = cKDTree(own).query(missing, distance_upper_bound=radius_mm * (1 + 1e-9) + 1e-12)
            votes += dist <= radius_mm
    return missing, votes


def bent(atlas: np.ndarray, defective: np.ndarray, tree: cKDTree, sigma_mm: float, reach_mm: float) -> np.ndarray:
    """``atlas`` points moved by a smooth field that pulls them onto the defective skull.

    Each atlas point with a defective-skull point within ``reach_mm`` says how
    far it is off (the vector to that nearest point); every atlas point moves by
    the Gaussian-weighted (``sigma_mm``) mean of those vectors, so the atlas
    bone across a defect follows the rim around it, and the weight fades to
    nothing far from any rim. What rigid-plus-scale registration leaves of
    skull-to-skull shape differences (smooth deformations) is taken up here.
    """
    dist, nearest = tree.query(atlas)
    near = dist < reach_mm
    if not near.any():
        return atlas
    source, offset = atlas[near], defective[nearest[near]] - atlas[near]
    weight = np.exp(-((atlas[:, None, :] - source[None]) ** 2).sum(axis=-1) / (2.0 * sigma_mm**2))
    return atlas + (weight @ offset) / (weight.sum(axis=1, keepdims=True) + 1e-3)


def main_pieces(points: np.ndarray, link: float, keep: float) -> np.ndarray:
    """Mask of ``points`` in pieces of at least ``keep`` times the largest piece's size.

    A piece: points joined by steps of at most ``link``. An atlas that differs
    from the defective skull somewhere besides the defect (a bump, a thinner
    plate) agrees on bone missing there too; such a piece is small next to the
    defect's (measured on the demo's anatomical 30-minute run, seed 1: stray
    pieces 3-39 % of the defect's, 50-150 mm away from it; the two plates of a
    bilateral defect 63-87 % of each other; docs/experiments/pcdiff.md).
    """
    if len(points) < 2 or keep <= 0:
        return np.ones(len(points), dtype=bool)
    pairs = cKDTree(points).query_pairs(link, output_type="ndarray")
    graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(len(points), len(points)))
    _, label = connected_components(graph, directed=False)
    sizes = np.bincount(label)
    return sizes[label] >= keep * sizes.max()


@dataclass
class FrameSection:
    """``task.frame``: diffuse the implant in a local frame (module docs)."""

    scale: float = 0.5  # normalised units per frame unit (an implant spans about ±1 frame units)
    jitter: float = 0.3  # std of the training centre's offset from the true one, normalised units
    crop: float = 2.5  # conditioning points drawn from the skull within this radius of the centre, normalised units
    gap_mm: float = 12.0  # atlas bone farther than this from the defective skull counts as missing
    radius_mm: float = 10.0  # missing points of every atlas skull within this radius agree on the defect
    atlas_points: int = 2000  # surface points kept per atlas skull
    pieces: float = 0.5  # estimate pieces kept: at least this fraction of the largest piece's points (0: all)
    bend_mm: float = (
        0.0  # after registration, atlas bone follows the defective skull by a smooth field this wide (0: off)
    )

    # Called by PCDiffConfig.validate, which checks the optional sections
    # together with the keys that depend on them (rotate_degrees with a frame).
    def check(self, prefix: str) -> None:
        for key in ("scale", "gap_mm", "radius_mm"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"config key '{prefix}.{key}' must be positive, got {getattr(self, key)}")
        if self.jitter < 0:
            raise ConfigError(f"config key '{prefix}.jitter' must be 0 or more, got {self.jitter}")
        if not self.crop > 0:
            raise ConfigError(f"config key '{prefix}.crop' must be positive, got {self.crop}")
        if self.bend_mm < 0:
            raise ConfigError(f"config key '{prefix}.bend_mm' must be 0 or more, got {self.bend_mm}")
        if not 0.0 <= self.pieces <= 1.0:
            raise ConfigError(f"config key '{prefix}.pieces' must lie in [0, 1], got {self.pieces}")
        if self.atlas_points < 100:
            raise ConfigError(f"config key '{prefix}.atlas_points' must be at least 100, got {self.atlas_points}")


def prior_points(points: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` of an implant estimate's points, drawn by ``rng`` (with repeats where it has fewer)."""
    points = np.asarray(points, dtype=np.float64)
    return points[rng.choice(len(points), n, replace=len(points) < n)]


def frame_condition(
    skull: np.ndarray,
    center: np.ndarray,
    n_skull: int,
    section: FrameSection,
    rng: np.random.Generator,
    *,
    half_extent: float,
    jitter: bool = False,
    box: Normalization | None = None,
) -> tuple[np.ndarray, Normalization]:
    """The conditioning points and the frame for one skull.

    ``skull``: all surface points of the defective skull; ``center``: the
    implant centre in the same coordinates. Returns ``n_skull`` skull points
    drawn from those within ``crop`` (normalised units: a radius relative to the
    skull's size, so the crop does not depend on how densely the surface was
    sampled) of the (jittered) centre, or the ``n_skull`` nearest if none is, and the
    :class:`Normalization` into the frame (``apply`` maps into it, ``inverse``
    back), so callers treat it like the bounding-box normalisation. ``box``: the
    skull's :func:`bbox_normalization` when the caller has it already.
    """
    if box is None:
        box = bbox_normalization(skull, half_extent)
    offset = (np.asarray(center, dtype=np.float64) - box.center) / box.scale
    if jitter and section.jitter > 0:
        offset = offset + rng.normal(0.0, section.jitter, 3)
    frame = Normalization(center=box.center + offset * box.scale, scale=box.scale * section.scale)
    within = np.flatnonzero(((skull - frame.center) ** 2).sum(axis=1) <= (section.crop * box.scale) ** 2)
    pool = within if len(within) else nearest_indices(skull, frame.center, n_skull)
    chosen = np.sort(rng.choice(pool, n_skull, replace=len(pool) < n_skull))
    return np.asarray(skull[chosen], dtype=np.float64), frame


def atlas_cases(data: PreparedDataset, split: str) -> dict:
    """The split's first case with a complete skull per skull id, in the order :func:`build_atlas` stacks them."""
    first: dict = {}
    for case in data.split(split, require=("complete",)):
        first.setdefault(case.skull_id, case)
    return first


def build_atlas(data: PreparedDataset, split: str, points: int) -> torch.Tensor:
    """``[K, points, 3]`` float32 surface points (mm) of the split's complete skulls, each skull once."""
    seen: dict[str, np.ndarray] = {}
    for skull_id, case in atlas_cases(data, split).items():
        spacing = np.asarray(data.meta(case.complete)["spacing"], dtype=np.float64)
        full = np.asarray(data.points(case.complete), dtype=np.float64) * spacing
        seen[skull_id] = subsample_fixed(np.resize(full, (max(points, len(full)), 3)), points)
    if not seen:
        raise DataError(f"{data.root}: the {split!r} split has no complete skull; task.frame needs them as its atlas")
    return torch.from_numpy(np.stack(list(seen.values())).astype(np.float32))


def atlas_estimate(
    atlas: torch.Tensor, skull: np.ndarray, spacing: np.ndarray, section: FrameSection, agree: float = 0.5
) -> ImplantEstimate:
    """The atlas estimate of the implant (:func:`estimate_implant`) for ``skull``, in its units (``spacing`` mm)."""
    spacing = np.asarray(spacing, dtype=np.float64)
    skulls = [a.double().numpy() for a in atlas.cpu()]
    found = estimate_implant(
        np.asarray(skull, dtype=np.float64) * spacing,
        skulls,
        gap_mm=section.gap_mm,
        radius_mm=section.radius_mm,
        points=section.atlas_points,
        agree=agree,
        pieces=section.pieces,
        bend_mm=section.bend_mm,
    )
    return ImplantEstimate(center=found.center / spacing, points=found.points / spacing)


@dataclass
class PriorSection:
    """``task.prior``: sampling starts from the atlas estimate of the implant, not from pure noise.

    The atlas bone that the defective skull lacks (:func:`estimate_implant`'s
    points) is resampled to the implant's point count, diffused to
    ``start_step`` and denoised from there (SDEdit, Meng et al., ICLR 2022), so
    the network refines an estimate instead of drawing a shape from nothing;
    training then draws its steps from ``[0, start_step]`` only, the part of the
    chain sampling uses.
    """

    start_step: int = 200  # the noisiest step sampling starts from (of diffusion.timesteps)
    agree: float = 0.5  # missing atlas points kept: at least this fraction of the best-agreed vote count

    def check(self, prefix: str, timesteps: int) -> None:
        if not 1 <= self.start_step < timesteps:
            raise ConfigError(
                f"config key '{prefix}.start_step' must be from 1 to diffusion.timesteps - 1 = {timesteps - 1}, got {self.start_step}"
            )
        if not 0.0 < self.agree <= 1.0:
            raise ConfigError(f"config key '{prefix}.agree' must lie in (0, 1], got {self.agree}")


class FramedDenoiser(nn.Module):
    """The denoiser plus the atlas its frame is estimated from (a buffer: it is saved with the weights).

    The buffer takes the saved shape when a checkpoint is loaded, so a model
    built without data (inference) receives the training run's atlas.
    """

    atlas_mm: torch.Tensor

    def __init__(self, net: nn.Module, atlas: torch.Tensor | None = None):
        super().__init__()
        self.net = net
        self.register_buffer("atlas_mm", atlas if atlas is not None else torch.zeros(0, 0, 3))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(x, t)

    def _load_from_state_dict(self, state_dict, prefix, *args: Any, **kwargs: Any) -> None:
        saved = state_dict.get(prefix + "atlas_mm")
        if saved is not None and saved.shape != self.atlas_mm.shape:
            self.atlas_mm = torch.zeros_like(saved, device=self.atlas_mm.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
