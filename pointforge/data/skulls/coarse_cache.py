"""A prepared dataset's cases on the U-Net's coarse cube, computed once and kept: :func:`ensure_case_grids`.

Each case's defective skull and implant are read from the raw volumes its
prepared ``.json`` names (``source``), put on the cube around the defective
skull (:mod:`pointforge.data.skulls.coarse_grids`) and saved as one
compressed ``<case_id>.npz`` in a folder named by the grid
(``g<size>-m<margin>``): the bone fraction of each cell of both volumes
(float16) and the cube itself. Reading two 512 × 512 × Z scans costs seconds;
a cached case, milliseconds.

Resumable and safe to share: every file is written atomically, records its
sources' sizes and modification times, and is made again when they changed;
processes that build the same folder at once take turns on a lock file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pointforge.atomic import atomic_writer
from pointforge.data.skulls.coarse_grids import CubeFrame, frame_around, occupancy
from pointforge.data.skulls.prepared import PreparedCase, PreparedDataset
from pointforge.data.volumes import read_binary_volume
from pointforge.devices import available_cores
from pointforge.errors import DataError
from pointforge.flock import exclusive_lock

__all__ = ["GridRecipe", "CaseGrids", "ensure_case_grids", "load_case_grids"]

FORMAT = 1
CACHE_DIR = "unet-grids"  # under the prepared dataset, unless a folder is given


@dataclass(frozen=True)
class GridRecipe:
    """How cases are put on the cube: ``size``³ cells, ``margin_mm`` beyond the defective skull on each side."""

    size: int
    margin_mm: float

    @property
    def name(self) -> str:
        return f"g{self.size}-m{self.margin_mm:g}"


@dataclass
class CaseGrids:
    """One case on the cube: bone fractions of the defective skull and the implant (float16 ``[size]*3``)."""

    defective: np.ndarray
    implant: np.ndarray
    frame: CubeFrame


def _sources(dataset: PreparedDataset, case: PreparedCase) -> dict[str, dict]:
    """The raw volume of the case's defective skull and implant, each with its size and modification time."""
    out = {}
    for kind in ("defective", "implant"):
        rel = getattr(case, kind)
        if not rel:
            raise DataError(f"case {case.case_id} has no {kind}; the U-Net learns from defective skull and implant")
        source = dataset.meta(rel).get("source")
        if not source:
            raise DataError(f"{dataset.path(rel)}: records no source volume; re-run `pointforge data prepare`")
        try:
            stat = os.stat(source)
        except OSError:
            raise DataError(
                f"{source}: the raw volume of case {case.case_id} is gone; the U-Net reads the raw volumes "
                "`pointforge data prepare` was run on, so put them back there"
            ) from None
        out[kind] = {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return out


def case_grids(
    dataset: PreparedDataset, case: PreparedCase, recipe: GridRecipe, sources: dict | None = None
) -> CaseGrids:
    """The case's two volumes on the cube around its defective skull (read from their raw files)."""
    sources = sources or _sources(dataset, case)
    defective = read_binary_volume(sources["defective"]["path"])
    implant = read_binary_volume(sources["implant"]["path"], allow_empty=True)
    frame = frame_around(defective, recipe.size, recipe.margin_mm)
    return CaseGrids(occupancy(defective, frame), occupancy(implant, frame), frame)


def _path(folder: Path, case: PreparedCase) -> Path:
    return folder / f"{case.case_id}.npz"


def _current(path: Path, sources: dict) -> bool:
    try:
        with np.load(path) as z:
            return int(z["format"]) == FORMAT and json.loads(str(z["sources"])) == sources
    except (OSError, ValueError, KeyError):
        return False


def _build(dataset: PreparedDataset, case: PreparedCase, recipe: GridRecipe, sources: dict, path: Path) -> None:
    """Put one case on the cube and write its file, atomically."""
    grids = case_grids(dataset, case, recipe, sources)
    with atomic_writer(path) as handle:
        np.savez_compressed(
            handle,
            format=np.asarray(FORMAT),
            sources=np.asarray(json.dumps(sources)),
            defective=grids.defective.astype(np.float16),
            implant=grids.implant.astype(np.float16),
            centre=np.asarray(grids.frame.centre),
            side_mm=np.asarray(grids.frame.side_mm),
        )


def ensure_case_grids(
    dataset: PreparedDataset,
    cases: list[PreparedCase],
    recipe: GridRecipe,
    folder: str | os.PathLike | None = None,
    *,
    log: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> Path:
    """The folder holding every case of ``cases`` on the cube; the missing or outdated ones are made first.

    ``folder`` defaults to ``<prepared>/unet-grids/<recipe.name>``. The cases
    are made ``workers`` at a time in fresh processes (default: one per
    available core, at most 4; reading the scans is most of the work).
    """
    say = log or (lambda _msg: None)
    target = Path(folder) if folder is not None else dataset.root / CACHE_DIR / recipe.name
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"{target}: cannot make the U-Net's grid cache there ({err.strerror}); set task.cache_dir to a writable folder"
        ) from None
    with exclusive_lock(target / ".lock", on_wait=lambda: say(f"waiting for another process building {target}")):
        stamped = [(case, _sources(dataset, case)) for case in cases]
        todo = [(case, sources) for case, sources in stamped if not _current(_path(target, case), sources)]
        if not todo:
            return target
        workers = max(1, min(workers or min(available_cores(), 4), len(todo)))
        say(f"putting {len(todo)} of {len(cases)} cases on the {recipe.size}³ cube into {target} ({workers} processes)")
        started = time.perf_counter()
        jobs = [(dataset, case, recipe, sources, _path(target, case)) for case, sources in todo]

        def made(k: int) -> None:
            if k % 10 == 0 or k == len(todo):
                say(f"  {k}/{len(todo)} cases on the cube ({time.perf_counter() - started:.0f} s)")

        if workers == 1:
            for k, job in enumerate(jobs, 1):
                _build(*job)
                made(k)
        else:
            pool = ProcessPoolExecutor(max_workers=workers, mp_context=_fresh_processes())
            try:
                for k, future in enumerate([pool.submit(_build, *job) for job in jobs], 1):
                    future.result()
                    made(k)
            finally:
                pool.shutdown(cancel_futures=True)
    return target


def _fresh_processes() -> multiprocessing.context.BaseContext:
    """Workers that do not inherit a training process's threads (torch's, BLAS's): forkserver, else spawn."""
    return multiprocessing.get_context(
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )


def load_case_grids(folder: Path, case: PreparedCase) -> CaseGrids:
    """One cached case (:func:`ensure_case_grids` made it)."""
    path = _path(folder, case)
    try:
        with np.load(path) as z:
            defective, implant = z["defective"], z["implant"]
            frame = CubeFrame(
                (float(z["centre"][0]), float(z["centre"][1]), float(z["centre"][2])),
                float(z["side_mm"]),
                int(defective.shape[0]),
            )
    except (OSError, ValueError, KeyError) as err:
        raise DataError(f"{path}: unreadable grid cache file ({err}); delete it to have it made again") from None
    return CaseGrids(defective, implant, frame)
