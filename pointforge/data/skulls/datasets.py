"""The PCDiff and voxelizer training Datasets over a prepared folder, seeded per item."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from pointforge.data.skulls.grids import inside_grid, unit_cube_scale
from pointforge.data.skulls.normalization import bbox_normalization, random_rotation
from pointforge.data.skulls.prepared import PreparedCase, PreparedDataset
from pointforge.errors import ConfigError, DataError


def _subsample(points: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    # With replacement only when the surface has fewer points than asked (tiny volumes).
    idx = rng.choice(points.shape[0], size=n, replace=points.shape[0] < n)
    idx.sort()  # sorted reads from a memory map are much faster
    return np.asarray(points[idx], dtype=np.float32)


class _EpochSeeded(Dataset):
    """Per-item randomness from (seed, epoch, index): identical on any worker count and on resume.

    The engine calls ``set_epoch`` before each epoch. The epoch lives in a
    shared-memory tensor so that persistent DataLoader workers, which hold
    their own copy of the dataset, see the new value too.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        # Created here, before any worker gets a copy of the dataset.
        self._epoch_shared = torch.zeros(1, dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch_shared[0])

    def set_epoch(self, epoch: int) -> None:
        self._epoch_shared[0] = int(epoch)

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, index])


class CompletionDataset(_EpochSeeded):
    """PCDiff training/testing examples: defective-skull points then implant points.

    Item: ``points`` [n_skull + n_implant, 3] float32 normalised (skull first,
    implant last), ``center`` [3] and ``scale`` (to map back to voxel
    coordinates: ``p * scale + center``), ``case_id``.
    """

    def __init__(
        self,
        root: str | os.PathLike | PreparedDataset,
        split: str = "train",
        *,
        n_skull: int = 27_648,
        n_implant: int = 3_072,
        rotate_degrees: float = 0.0,
        half_extent: float = 3.0,
        seed: int = 0,
    ):
        super().__init__(seed)
        self.data = root if isinstance(root, PreparedDataset) else PreparedDataset(root)
        self.cases = self.data.split(split, require=("implant",))
        if not self.cases:
            raise DataError(f"{self.data.root}: the {split!r} split has no case with an implant")
        self.split = split
        self.n_skull, self.n_implant = int(n_skull), int(n_implant)
        self.rotate_degrees = float(rotate_degrees)
        self.half_extent = float(half_extent)

    def __len__(self) -> int:
        return len(self.cases)

    def check_files(self) -> None:
        """DataError if a file this split reads is missing (the engine calls it before the first step)."""
        self.data.check_files(self.cases, ("defective", "implant"), split=self.split, meta=True)

    def __getitem__(self, index: int) -> dict:
        case = self.cases[index]
        rng = self._rng(index)
        skull = _subsample(self.data.points(case.defective), self.n_skull, rng)
        implant = _subsample(self.data.points(case.implant), self.n_implant, rng)
        norm = bbox_normalization(skull, self.half_extent)
        points = norm.apply(np.concatenate([skull, implant]))
        if self.rotate_degrees > 0:
            points = (points @ random_rotation(rng, self.rotate_degrees).T).astype(np.float32)
        return {
            "points": torch.from_numpy(points),
            "center": torch.from_numpy(norm.center.astype(np.float32)),
            "scale": torch.tensor(norm.scale, dtype=torch.float32),
            "case_id": case.case_id,
        }


@dataclass(frozen=True)
class VoxelAugmentation:
    """Upstream PCDiff's augmentation of voxelizer examples (github.com/pfriedri/pcdiff-implant), drawn per item.

    With probability ``rotate_p`` a rotation by independent angles within
    ±``rotate_degrees`` about each axis; with probability ``flip_p`` a mirror
    along array axis ``flip_axis`` (upstream flips axis 0); both about the
    volume's centre. With probability ``noise_p`` Gaussian noise of
    ``noise_voxels`` voxels (standard deviation) on the implant points only.
    """

    rotate_degrees: float = 10.0
    rotate_p: float = 0.8
    flip_p: float = 0.5
    flip_axis: int = 0
    noise_p: float = 0.25
    noise_voxels: float = 1.0

    def __post_init__(self) -> None:
        for name in ("rotate_p", "flip_p", "noise_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"augmentation {name} must lie in [0, 1], got {value}")
        if not (math.isfinite(self.rotate_degrees) and 0.0 <= self.rotate_degrees <= 180.0):
            raise ConfigError(f"augmentation rotate_degrees must lie in [0, 180], got {self.rotate_degrees}")
        if not (math.isfinite(self.noise_voxels) and self.noise_voxels >= 0.0):
            raise ConfigError(f"augmentation noise_voxels must be 0 or more, got {self.noise_voxels}")
        if self.flip_axis not in (0, 1, 2):
            raise ConfigError(f"augmentation flip_axis must be 0, 1 or 2, got {self.flip_axis}")

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, bool]:
        """(linear map M (3×3) for the points, whether to add noise), in a fixed order of draws."""
        linear = np.eye(3)
        if rng.uniform() < self.rotate_p:
            linear = random_rotation(rng, self.rotate_degrees)
        if rng.uniform() < self.flip_p:
            mirror = np.eye(3)
            mirror[self.flip_axis, self.flip_axis] = -1.0
            linear = mirror @ linear
        noise = bool(rng.uniform() < self.noise_p) and self.noise_voxels > 0
        return linear, noise


_BELOW_ONE = np.nextafter(np.float32(1), np.float32(0))


class VoxelizationDataset(_EpochSeeded):
    """Voxelizer examples: the completed cloud in [0, 1)³ and the complete skull's indicator grid.

    Item: ``points`` [n_points, 3] in [0, 1) (defective-skull points, then
    implant points, in the proportions of the completion dataset; voxel
    coordinates divided by the volume's longest side), ``target``
    [res, res, res] (``target_format="indicator"``: +0.5 outside, −0.5 inside,
    float32; ``"inside"``: a bool mask, 4× smaller to collate and move),
    ``transform`` [3, 4], ``scale``, ``case_id``.

    With ``augment``, the points are rotated/flipped about the volume's centre
    and noised (:class:`VoxelAugmentation`), and ``transform`` = [M | t] is the
    map that was applied, ``p' = M p + t`` in unit coordinates (identity
    without augmentation). ``target`` is the grid *before* that map:
    :func:`transform_inside` resamples it to match. That is deliberate: at
    512³ the resampling is 134 M trilinear samples, seconds on a CPU loader
    worker but milliseconds on the training GPU, so the task does it there.

    Each case appears ``repeats`` times per epoch (upstream trains on 10
    augmented copies of each case); item ``i`` is case ``i % n_cases``, and
    all its randomness comes from (seed, epoch, i). Inside grids are computed
    once per complete skull and kept bit-packed (res³/8 bytes each: 16 MB at
    512³, 256 KB at 128³).
    """

    def __init__(
        self,
        root: str | os.PathLike | PreparedDataset,
        split: str = "train",
        *,
        n_points: int = 30_720,
        implant_fraction: float = 0.1,
        resolution: int = 128,
        seed: int = 0,
        augment: VoxelAugmentation | None = None,
        repeats: int = 1,
        target_format: str = "indicator",
    ):
        super().__init__(seed)
        self.data = root if isinstance(root, PreparedDataset) else PreparedDataset(root)
        self.cases = self.data.split(split, require=("implant", "complete_mask"))
        if not self.cases:
            raise DataError(f"{self.data.root}: the {split!r} split has no case with an implant and complete skull")
        self.split = split
        if target_format not in ("indicator", "inside"):
            raise ConfigError(f"target_format must be 'indicator' or 'inside', got {target_format!r}")
        if int(repeats) < 1:
            raise ConfigError(f"repeats must be at least 1, got {repeats}")
        if int(resolution) < 2:
            raise ConfigError(f"target resolution must be at least 2, got {resolution}")
        self.n_points = int(n_points)
        self.n_implant = int(round(self.n_points * implant_fraction))
        self.resolution = int(resolution)
        self.augment = augment
        self.repeats = int(repeats)
        self.target_format = target_format
        self._inside_bits: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.cases) * self.repeats

    def check_files(self) -> None:
        """DataError if a file this split reads is missing (the engine calls it before the first step)."""
        self.data.check_files(self.cases, ("defective", "implant", "complete_mask"), split=self.split, meta=True)

    def inside(self, case: PreparedCase) -> np.ndarray:
        """The complete skull's inside grid at the dataset's resolution (bool, res³)."""
        key = case.complete_mask
        if key not in self._inside_bits:
            self._inside_bits[key] = np.packbits(inside_grid(self.data.complete_mask(case), self.resolution).ravel())
        n = self.resolution**3
        return np.unpackbits(self._inside_bits[key], count=n).view(bool).reshape((self.resolution,) * 3)

    def target(self, case: PreparedCase) -> np.ndarray:
        return np.where(self.inside(case), np.float32(-0.5), np.float32(0.5))

    def __getitem__(self, index: int) -> dict:
        case = self.cases[index % len(self.cases)]
        rng = self._rng(index)
        shape = tuple(self.data.meta(case.defective)["shape"])
        skull = _subsample(self.data.points(case.defective), self.n_points - self.n_implant, rng)
        implant = _subsample(self.data.points(case.implant), self.n_implant, rng)
        scale = unit_cube_scale(shape)
        transform = np.concatenate([np.eye(3), np.zeros((3, 1))], axis=1)
        if self.augment is not None:
            linear, noise = self.augment.draw(rng)
            if noise:
                implant = implant + rng.normal(0.0, self.augment.noise_voxels, implant.shape).astype(np.float32)
            # About the volume's centre, so a flip maps voxel i to shape-1-i as np.flip does.
            centre = (np.asarray(shape, dtype=np.float64) - 1.0) / 2.0 / scale
            transform = np.concatenate([linear, (centre - linear @ centre)[:, None]], axis=1)
        points = np.concatenate([skull, implant]).astype(np.float64) / scale
        points = points @ transform[:, :3].T + transform[:, 3]
        points = np.clip(points, 0.0, _BELOW_ONE)
        inside = self.inside(case)
        target = (
            torch.from_numpy(inside)
            if self.target_format == "inside"
            else torch.from_numpy(np.where(inside, np.float32(-0.5), np.float32(0.5)))
        )
        return {
            "points": torch.from_numpy(points.astype(np.float32)),
            "target": target,
            "transform": torch.from_numpy(transform.astype(np.float32)),
            "scale": torch.tensor(scale, dtype=torch.float32),
            "case_id": case.case_id,
        }
