"""SkullBreak / SkullFix layouts, seeded splits grouped by skull, and Datasets.

Raw layouts (SkullBreak and SkullFix: Kodym et al., Data in Brief 2021):

* SkullBreak: ``complete_skull/NNN.nrrd``, ``defective_skull/<defect>/NNN.nrrd``,
  ``implant/<defect>/NNN.nrrd``.
* SkullFix: ``complete_skull/NNN.nrrd``, ``defective_skull/NNN.nrrd``,
  ``implant/NNN.nrrd``.

NIfTI files (``.nii``/``.nii.gz``) are accepted wherever NRRD is. ``implant`` and
``complete_skull`` may be absent (e.g. a challenge test set): such cases prepare
for inference only.

A prepared dataset (written by :mod:`pointforge.data.prepare`) holds surface
points per volume under ``surfaces/`` mirroring the raw layout, complete-skull
masks under ``masks/``, ``cases.csv`` (one row per defective skull, with its
split) and ``dataset.json``.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pointforge.atomic import atomic_write_text
from pointforge.data.volumes import VOLUME_SUFFIXES
from pointforge.errors import ConfigError, DataError

SKULLBREAK_DEFECTS = ("bilateral", "frontoorbital", "parietotemporal", "random_1", "random_2")
LAYOUTS = ("skullbreak", "skullfix")
SPLITS = ("train", "val", "test")


def _stem(path: Path) -> str:
    name = path.name
    for suffix in sorted(VOLUME_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _volumes_in(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        return {}
    found = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name.lower().endswith(VOLUME_SUFFIXES) and not p.name.startswith("."):
            found[_stem(p)] = p
    return found


@dataclass(frozen=True)
class RawCase:
    """One defective skull, with its implant and complete skull when present."""

    case_id: str  # unique in the dataset, e.g. "bilateral/000" or "000"
    skull_id: str  # the skull it belongs to; splits are grouped by this
    defect: str  # defect class, "" for SkullFix
    defective: Path
    implant: Path | None
    complete: Path | None


def detect_layout(root: str | os.PathLike) -> str:
    """'skullbreak' or 'skullfix', from the folders under ``root``; DataError otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; give the dataset's root folder")
    defective = root / "defective_skull"
    if not defective.is_dir():
        raise DataError(
            f"{root}: neither a SkullBreak nor a SkullFix layout (no 'defective_skull' folder); "
            "expected defective_skull/<defect>/NNN.nrrd (SkullBreak) or defective_skull/NNN.nrrd (SkullFix)"
        )
    has_subdirs = any(p.is_dir() and _volumes_in(p) for p in defective.iterdir())
    has_files = bool(_volumes_in(defective))
    if has_subdirs and not has_files:
        return "skullbreak"
    if has_files and not has_subdirs:
        return "skullfix"
    if has_files and has_subdirs:
        raise DataError(
            f"{defective}: holds both volume files and defect folders; a SkullBreak layout has only "
            "<defect>/ folders, a SkullFix layout only files"
        )
    raise DataError(f"{defective}: no .nrrd or .nii(.gz) volumes found")


def list_cases(root: str | os.PathLike, layout: str | None = None) -> tuple[str, list[RawCase]]:
    root = Path(root)
    layout = layout or detect_layout(root)
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    complete = _volumes_in(root / "complete_skull")
    cases: list[RawCase] = []
    if layout == "skullbreak":
        for defect_dir in sorted(p for p in (root / "defective_skull").iterdir() if p.is_dir()):
            implants = _volumes_in(root / "implant" / defect_dir.name)
            for stem, path in _volumes_in(defect_dir).items():
                cases.append(
                    RawCase(
                        f"{defect_dir.name}/{stem}", stem, defect_dir.name, path, implants.get(stem), complete.get(stem)
                    )
                )
    else:
        implants = _volumes_in(root / "implant")
        for stem, path in _volumes_in(root / "defective_skull").items():
            cases.append(RawCase(stem, stem, "", path, implants.get(stem), complete.get(stem)))
    if not cases:
        raise DataError(f"{root}: no defective skull volumes found")
    return layout, cases


# --------------------------------------------------------------------------- splits


def parse_ratios(text: str | tuple[float, ...]) -> tuple[float, float, float]:
    """'0.7,0.1,0.2' (train, val, test) → normalised tuple."""
    try:
        values = [float(v) for v in (text.split(",") if isinstance(text, str) else text)]
    except ValueError:
        raise ConfigError(
            f"split ratios {text!r} are not numbers; write them like 0.7,0.1,0.2 (train,val,test)"
        ) from None
    if len(values) == 2:
        values = [values[0], 0.0, values[1]]
    if len(values) != 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise ConfigError(
            f"split ratios {text!r} must be 2 or 3 non-negative numbers (train,[val,]test), e.g. 0.7,0.1,0.2"
        )
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def split_skulls(skull_ids: list[str], ratios: tuple[float, float, float], seed: int) -> dict[str, str]:
    """Seeded split of skulls (not cases) so no skull is in two splits.

    Every split with a non-zero ratio gets at least one skull when there are
    enough skulls; the rest goes to train.
    """
    unique = sorted(set(skull_ids))
    n = len(unique)
    order = np.random.default_rng(seed).permutation(n)
    want_test = ratios[2] > 0
    want_val = ratios[1] > 0
    n_test = max(1 if want_test and n >= 2 else 0, int(round(ratios[2] * n)))
    n_val = max(1 if want_val and n >= 3 else 0, int(round(ratios[1] * n)))
    if n_test + n_val >= n:  # keep at least one training skull
        overflow = n_test + n_val - (n - 1)
        n_val = max(0, n_val - overflow)
        n_test = min(n_test, n - 1 - n_val)
    assignment = {}
    for rank, i in enumerate(order):
        if rank < n_test:
            assignment[unique[i]] = "test"
        elif rank < n_test + n_val:
            assignment[unique[i]] = "val"
        else:
            assignment[unique[i]] = "train"
    return assignment


# --------------------------------------------------------------------------- prepared dataset


@dataclass
class PreparedCase:
    case_id: str
    skull_id: str
    defect: str
    split: str
    defective: str  # relative .npy path of the defective skull's surface points
    implant: str  # "" if absent
    complete: str  # "" if absent
    complete_mask: str  # "" if absent


class PreparedDataset:
    """Index of a prepared dataset folder (``cases.csv`` + metadata)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        manifest = self.root / "cases.csv"
        info = self.root / "dataset.json"
        if not manifest.exists() or not info.exists():
            raise DataError(
                f"{self.root}: not a prepared dataset (no cases.csv / dataset.json); "
                "run `pointforge data prepare RAW_ROOT --out DIR` first"
            )
        self.info = json.loads(info.read_text())
        with open(manifest, newline="") as fh:
            self.cases = [PreparedCase(**row) for row in csv.DictReader(fh)]

    def split(self, name: str, *, require: tuple[str, ...] = ("implant",)) -> list[PreparedCase]:
        if name not in SPLITS and name != "all":
            raise ConfigError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)} or all")
        chosen = [c for c in self.cases if name == "all" or c.split == name]
        return [c for c in chosen if all(getattr(c, field) for field in require)]

    def path(self, rel: str) -> Path:
        return self.root / rel

    def points(self, rel: str, *, mmap: bool = True) -> np.ndarray:
        path = self.path(rel)
        try:
            return np.load(path, mmap_mode="r" if mmap else None)
        except FileNotFoundError:
            raise DataError(f"{path}: missing; re-run `pointforge data prepare` to complete the dataset") from None
        except ValueError as exc:
            raise DataError(f"{path}: unreadable point file ({exc}); delete it and re-run prepare") from None

    def meta(self, rel: str) -> dict:
        path = self.path(rel).with_suffix(".json")
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(f"{path}: missing; re-run `pointforge data prepare` to complete the dataset") from None
        except ValueError as exc:
            raise DataError(f"{path}: unreadable metadata ({exc}); delete it and re-run prepare") from None

    def complete_mask(self, case: PreparedCase) -> np.ndarray:
        if not case.complete_mask:
            raise DataError(f"case {case.case_id} has no complete skull; the voxelisation target needs one")
        path = self.path(case.complete_mask)
        try:
            with np.load(path) as z:
                shape = tuple(int(s) for s in z["shape"])
                bits = np.unpackbits(z["bits"], count=int(np.prod(shape)))
        except FileNotFoundError:
            raise DataError(f"{path}: missing; re-run `pointforge data prepare` to complete the dataset") from None
        except (ValueError, KeyError, OSError) as exc:
            raise DataError(f"{path}: unreadable mask file ({exc}); delete it and re-run prepare") from None
        return bits.reshape(shape).astype(bool)

    def check_files(
        self, cases: list[PreparedCase], fields: tuple[str, ...], *, split: str, meta: bool = False
    ) -> None:
        """Stat every file ``cases`` name under ``fields`` (with ``meta``, the defective skull's .json too).

        One ``stat`` per file, so a training run finds a deleted or emptied file
        before its first step instead of in a loader worker hours later.
        Raises DataError naming the first bad file and how many there are.
        """
        bad: list[Path] = []
        for case in cases:
            rels = [getattr(case, name) for name in fields if getattr(case, name)]
            paths = [self.path(rel) for rel in rels]
            if meta and case.defective:
                paths.append(self.path(case.defective).with_suffix(".json"))
            for path in paths:
                try:
                    empty = os.stat(path).st_size == 0
                except OSError:
                    empty = True
                if empty:
                    bad.append(path)
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise DataError(
                f"{bad[0]}{more}: missing or empty ({len(bad)} of the {split!r} split's files); "
                "re-run `pointforge data prepare` with the same --out to complete the dataset"
            )


def write_manifest(root: Path, cases: list[PreparedCase]) -> None:
    fields = list(PreparedCase.__dataclass_fields__)
    lines = [",".join(fields)]
    for c in cases:
        row = asdict(c)
        lines.append(",".join(str(row[f]) for f in fields))
    atomic_write_text(root / "cases.csv", "\n".join(lines) + "\n")


# --------------------------------------------------------------------------- normalisation


@dataclass(frozen=True)
class Normalization:
    """points_normalised = (points - center) / scale; ``inverse`` maps back."""

    center: np.ndarray  # [3]
    scale: float

    def apply(self, points: np.ndarray) -> np.ndarray:
        return ((points - self.center) / self.scale).astype(np.float32)

    def inverse(self, points: np.ndarray | torch.Tensor) -> np.ndarray:
        pts = points.detach().cpu().numpy() if isinstance(points, torch.Tensor) else np.asarray(points)
        return (pts * self.scale + self.center).astype(np.float32)


def bbox_normalization(points: np.ndarray, half_extent: float = 3.0) -> Normalization:
    """Centre of the bounding box; scale so the box's longest half-side maps to ``half_extent``.

    Computed from the defective skull alone in training and at test time, so the
    two agree (upstream used skull+implant in training, defective-only at test).
    """
    lo = points.min(axis=0).astype(np.float64)
    hi = points.max(axis=0).astype(np.float64)
    center = (lo + hi) / 2
    half = float((hi - lo).max()) / 2
    if half <= 0:
        raise DataError("cannot normalise a degenerate point cloud (all points equal)")
    return Normalization(center=center, scale=half / half_extent)


def random_rotation(rng: np.random.Generator, max_degrees: float) -> np.ndarray:
    """A rotation by independent angles within ±max_degrees about each axis."""
    ax, ay, az = np.deg2rad(rng.uniform(-max_degrees, max_degrees, size=3))
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    return rz @ ry @ rx


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


def unit_cube_scale(shape: tuple[int, ...]) -> float:
    """Voxel coordinates → [0, 1): divide by the longest side, so shapes keep their aspect."""
    return float(max(shape))


def inside_grid(mask: np.ndarray, resolution: int) -> np.ndarray:
    """Boolean grid at ``resolution``³: is grid node ``i`` (voxel coordinate ``i * S / resolution``) inside ``mask``?

    Trilinear interpolation of the mask, inside where it is at least 0.5;
    nodes beyond the volume's shorter sides are outside. When ``S`` is a
    multiple of ``resolution`` every node falls on a voxel centre, and the grid
    is the mask taken with a stride (the same values, without interpolating
    134 M nodes at 512³).
    """
    s = int(unit_cube_scale(mask.shape))
    if s % resolution == 0:
        step = s // resolution
        sub = np.asarray(mask[::step, ::step, ::step], dtype=bool)
        out = np.zeros((resolution,) * 3, dtype=bool)
        out[: sub.shape[0], : sub.shape[1], : sub.shape[2]] = sub
        return out
    from scipy.ndimage import map_coordinates

    axis = np.arange(resolution, dtype=np.float64) * s / resolution
    coords = np.stack(np.meshgrid(axis, axis, axis, indexing="ij")).reshape(3, -1)
    inside = map_coordinates(mask.astype(np.float32), coords, order=1, mode="constant", cval=0.0) >= 0.5
    return inside.reshape((resolution,) * 3)


def indicator_grid(mask: np.ndarray, resolution: int) -> np.ndarray:
    """Target grid at ``resolution``³ for a mask in the unit cube: −0.5 inside, +0.5 outside.

    Grid node ``i`` sits at unit coordinate ``i / resolution``, i.e. at voxel
    coordinate ``i * S / resolution`` with ``S`` the longest side (as the points).
    """
    return np.where(inside_grid(mask, resolution), -0.5, 0.5).astype(np.float32)


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


def transform_inside(inside: torch.Tensor, transform: torch.Tensor, *, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """Resample inside grids to match points moved by ``transform`` (see :class:`VoxelizationDataset`).

    ``inside``: bool [B, R, R, R] (or [R, R, R]), node ``i`` at unit coordinate
    ``i / R``; ``transform``: [B, 3, 4] (or [3, 4]), ``p' = M p + t``. The new
    grid at node ``x`` is the old grid at ``M⁻¹ (x − t)``, trilinearly
    interpolated (outside the cube counts as outside), inside where at least
    0.5 as :func:`inside_grid` decides. Runs on the tensors' device, slab by
    slab along the first axis so the sample coordinates take about
    ``chunk_bytes``; items whose transform is the identity are copied as they are.
    """
    import torch.nn.functional as F

    single = inside.dim() == 3
    if single:
        inside, transform = inside[None], transform[None]
    if inside.dim() != 4 or inside.dtype != torch.bool or len({*inside.shape[1:]}) != 1:
        raise DataError(f"transform_inside expects bool grids [B, R, R, R], got {inside.dtype} {tuple(inside.shape)}")
    if transform.shape != (inside.shape[0], 3, 4):
        raise DataError(
            f"transform_inside expects transforms [B, 3, 4] for {inside.shape[0]} grid(s), got {tuple(transform.shape)}"
        )
    b, res = inside.shape[0], inside.shape[1]
    out = inside.clone()
    identity = torch.eye(3, 4, dtype=transform.dtype, device=transform.device)
    axis = torch.arange(res, device=inside.device, dtype=torch.float32) / res
    slab = max(1, int(chunk_bytes) // (res * res * 3 * 4))
    for item in range(b):
        if torch.equal(transform[item], identity):
            continue
        m = transform[item, :, :3].double()
        t = transform[item, :, 3].double()
        inverse = torch.linalg.inv(m)
        offset = -(inverse @ t)
        # Source node index = res * (M⁻¹ x + offset); grid_sample wants (-1..1) with
        # align_corners=True, i.e. 2 * index / (res - 1) - 1, and its last dimension
        # ordered (axis 2, axis 1, axis 0) for a (D, H, W) = (axis 0, 1, 2) volume.
        to_norm = 2.0 * res / (res - 1)
        lin = (inverse * to_norm).float()
        off = (offset * to_norm - 1.0).float()
        volume = inside[item].to(torch.float32)[None, None]
        for start in range(0, res, slab):
            x0 = axis[start : start + slab]
            coords = (
                lin[:, 0] * x0[:, None, None, None]
                + lin[:, 1] * axis[None, :, None, None]
                + lin[:, 2] * axis[None, None, :, None]
                + off
            )  # [slab, R, R, 3] in (axis 0, 1, 2) order
            sampled = F.grid_sample(
                volume, coords.flip(-1)[None], mode="bilinear", padding_mode="zeros", align_corners=True
            )
            out[item, start : start + x0.shape[0]] = sampled[0, 0] >= 0.5
    return out[0] if single else out
