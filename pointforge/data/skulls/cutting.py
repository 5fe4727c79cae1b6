"""More cases from the same skulls: the five SkullBreak defect classes cut from a folder's complete skulls.

SkullBreak is CQ500 skulls with Kodym's five defect classes cut in; this does
the same to any folder holding ``complete_skull/NNN.nrrd`` (SkullFix, or a
SkullBreak folder), writing a SkullBreak-layout folder::

    complete_skull/NNN.nrrd
    defective_skull/<class>/NNN.nrrd
    implant/<class>/NNN.nrrd        for each class of DEFECT_CLASSES

Only ``complete_skull`` is read, and only the skulls the split names (a
SkullFix folder's own challenge defect stays where it is). Each defect is
:func:`~pointforge.data.synthetic.defects.make_defect`'s, drawn from a seed
derived from the run's seed, the skull id and the class alone, so a skull's
files do not depend on which other skulls were named. The cut happens with the
voxel axes turned to follow the header (:func:`~pointforge.data.orientation.canonical_axes`:
the grid convention ``make_defect`` expects) and is turned back, so the files
keep each skull's own grid and header and a frontal defect lies at the
forehead whatever the header's axis order. An oblique header's small rotation
(a gantry tilt) stays in the voxels, as everywhere else in pointforge.

Resumable: every file is written atomically and files already there are
skipped. ``cut_defects.json`` records the seed (a second run with another
seed is refused, so one folder never mixes two) and each skull's implant
sizes and places.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from pointforge.atomic import atomic_write_json
from pointforge.data.orientation import canonical_axes
from pointforge.data.skulls.layouts import volumes_in
from pointforge.data.skulls.splits import assign_skulls, missing_skulls
from pointforge.data.synthetic.defects import DEFECT_CLASSES, make_defect
from pointforge.data.volume_jobs import pool_size, run_all
from pointforge.data.volumes import Volume, read_binary_volume, write_volume
from pointforge.errors import ConfigError, DataError

RECORD = "cut_defects.json"


def defect_rng(seed: int, skull_id: str, defect_class: str) -> np.random.Generator:
    """The generator of one skull's defect of one class: from the seed, the id and the class alone."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), zlib.crc32(f"{skull_id}/{defect_class}".encode())]))


def cut_defect(volume: Volume, defect_class: str, rng: np.random.Generator) -> np.ndarray:
    """The implant of one defect, on ``volume``'s own grid: cut with the axes turned to the header's, then turned back."""
    turned, turn = canonical_axes(volume)
    return turn.unturn(make_defect(turned.data, defect_class, rng, turned.spacing))


def _placement(volume: Volume, implant: np.ndarray) -> dict:
    """The implant's size (cm³) and the physical offset (mm, the header's space) of its centroid from the skull's."""
    from scipy import ndimage

    voxel_cm3 = float(np.prod(volume.spacing)) / 1000.0
    skull = volume.voxel_to_physical(np.asarray(ndimage.center_of_mass(volume.data)))
    piece = volume.voxel_to_physical(np.asarray(ndimage.center_of_mass(implant)))
    return {"implant_cm3": round(float(implant.sum()) * voxel_cm3, 2), "offset_mm": np.round(piece - skull, 1).tolist()}


@dataclass(frozen=True)
class SkullJob:
    skull_id: str
    source: Path
    seed: int
    classes: tuple[str, ...]

    def targets(self, out: Path, defect_class: str) -> tuple[Path, Path]:
        """(defective, implant) files of one class."""
        name = f"{self.skull_id}.nrrd"
        return out / "defective_skull" / defect_class / name, out / "implant" / defect_class / name

    def todo(self, out: Path) -> list[str]:
        return [c for c in self.classes if not all(p.exists() for p in self.targets(out, c))]

    def complete_target(self, out: Path) -> Path:
        return out / "complete_skull" / f"{self.skull_id}.nrrd"


def cut_skull(out: Path, job: SkullJob) -> dict:
    """Write one skull's missing files; its record (sizes, places, seconds per class)."""
    started = time.perf_counter()
    volume = read_binary_volume(job.source)
    record: dict = {"source": str(job.source.resolve()), "classes": {}}
    for defect_class in job.todo(out):
        t0 = time.perf_counter()
        implant = cut_defect(volume, defect_class, defect_rng(job.seed, job.skull_id, defect_class))
        defective_path, implant_path = job.targets(out, defect_class)
        if not implant_path.exists():
            write_volume(implant_path, volume.with_data(implant))
        if not defective_path.exists():
            write_volume(defective_path, volume.with_data(volume.data & ~implant))
        record["classes"][defect_class] = _placement(volume, implant) | {"seconds": round(time.perf_counter() - t0, 1)}
    if not job.complete_target(out).exists():
        write_volume(job.complete_target(out), volume)
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


@dataclass
class CutResult:
    out: Path
    skulls: dict[str, dict] = field(default_factory=dict)  # id → record, this run's and earlier ones'
    done: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def plan_skulls(root: Path, split: str, seed: int, classes: tuple[str, ...]) -> list[SkullJob]:
    """One job per skull the split names; a missing folder or skull is one clear line."""
    sources = volumes_in(root / "complete_skull")
    if not sources:
        raise DataError(
            f"{root}: no complete_skull/NNN.nrrd volumes; give a SkullFix or SkullBreak folder holding complete_skull/"
        )
    missing = missing_skulls(list(sources), split)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise DataError(f"{root / 'complete_skull'}: the split names skulls that are not there: {shown}")
    assignment = assign_skulls(list(sources), split, seed)
    return [SkullJob(skull, sources[skull], int(seed), classes) for skull in sorted(assignment)]


def _start_record(out: Path, root: Path, seed: int, classes: tuple[str, ...]) -> dict:
    """The folder's record, refusing a second seed; written before any volume."""
    path = out / RECORD
    record = {"source_root": str(root.resolve()), "seed": int(seed), "classes": list(classes), "skulls": {}}
    if path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            raise DataError(f"{path}: unreadable; delete it (the volumes stay) or choose another --out") from None
        if earlier.get("seed") != int(seed):
            raise ConfigError(
                f"{out} was cut with --seed {earlier.get('seed')}; use that seed to resume, or another --out"
            )
        record["skulls"] = earlier.get("skulls", {})
    atomic_write_json(path, record)
    return record


def cut_dataset(
    root: str | os.PathLike,
    out: str | os.PathLike,
    *,
    split: str,
    seed: int = 0,
    workers: int | None = None,
    classes: tuple[str, ...] = DEFECT_CLASSES,
    progress: Callable[[int, int, str], None] | None = None,
) -> CutResult:
    """Cut ``classes`` from the complete skulls ``split`` names under ``root`` into ``out`` (module docs)."""
    started = time.perf_counter()
    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; give the dataset's root folder (holding complete_skull/)")
    if out.resolve() == root.resolve():
        raise ConfigError(f"--out {out} is the source folder; choose another folder")
    jobs = plan_skulls(root, split, seed, classes)
    record = _start_record(out, root, seed, classes)
    todo = [j for j in jobs if j.todo(out) or not j.complete_target(out).exists()]
    result = CutResult(out=out, skulls=record["skulls"], skipped=len(jobs) - len(todo))
    count = result.skipped
    if progress:
        progress(count, len(jobs), "")
    for job, made, err in run_all(cut_skull, "cutting", out, todo, pool_size(workers, len(todo))):
        count += 1
        if err:
            result.failures.append(err)
        elif made is not None:
            result.done += 1
            earlier = result.skulls.get(job.skull_id, {}).get("classes", {})
            result.skulls[job.skull_id] = made | {"classes": earlier | made["classes"]}
            atomic_write_json(out / RECORD, record)
        if progress:
            progress(count, len(jobs), job.skull_id)
    result.seconds = time.perf_counter() - started
    return result
