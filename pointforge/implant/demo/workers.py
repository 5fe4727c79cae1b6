"""The demo's per-case work in worker processes: one process per core, one torch thread each.

Generating a case with the demo's tiny networks is dispatch-bound: a second
torch thread does not make one case faster, and on a shared 2-core machine it
made generation about ten times slower (threads waiting on each other;
docs/experiments/implant.md). Two processes of
one thread each generate two cases at once instead, which halves the wall
time of every scoring stage on 2 cores.

:func:`case_pool` starts the processes once for the whole scoring (from a
fork server that has imported this module, so each worker starts without
importing torch again); the functions below are what they run, one case per
call. Each worker loads a phase's models once and keeps them for its next
cases. Every case draws its randomness from the demo's seed and its own
index, so the results do not depend on which worker ran it.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.surface import surface_points
from pointforge.data.volumes import read_binary_volume, write_volume
from pointforge.devices import use_threads
from pointforge.errors import DataError, UserError, disk_full_cause
from pointforge.implant.baseline import Atlas, atlas_surface, mean_skull_implant, prepared_skulls
from pointforge.implant.case import generate_case
from pointforge.implant.metrics import evaluate_case
from pointforge.implant.models import Models, load_models
from pointforge.implant.options import GenerateOptions
from pointforge.implant.pipeline import Generated, generate_implant
from pointforge.implant.writer import case_done
from pointforge.tasks.pcdiff.frame import atlas_estimate, prior_points
from pointforge.tasks.pcdiff.placement import placement_metrics

METRICS = ("dsc", "bdsc", "hd95", "hd")


@dataclass(frozen=True)
class CaseJob:
    """One prepared case, as a worker needs it: its raw volumes and where its prepared points are."""

    index: int
    case_id: str
    defect: str
    prepared: str
    defective_points: str  # prepared-relative, as PreparedDataset names them
    implant_points: str


@dataclass(frozen=True)
class Checkpoints:
    pcdiff: str
    voxelizer: str
    device: str


def case_jobs(dataset: PreparedDataset, cases: Sequence) -> list[CaseJob]:
    return [
        CaseJob(k, c.case_id, c.defect, str(dataset.root), str(c.defective), str(c.implant))
        for k, c in enumerate(cases)
    ]


def _start_worker() -> None:
    use_threads(1)


@contextmanager
def case_pool(workers: int) -> Iterator[Executor]:
    """``workers`` processes of one torch thread each, started from a fork server that has imported this module."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_start_worker) as pool:
        yield pool


def run_cases(pool: Executor, work: Callable[..., dict], jobs: list[CaseJob], *args: Any, progress=None) -> list[dict]:
    """``work(job, *args)`` for every job on the pool; the results in the jobs' order. ``progress(done, total)``."""
    futures = [pool.submit(work, job, *args) for job in jobs]
    if progress:
        progress(0, len(jobs))
    for done, future in enumerate(futures, 1):
        future.result()
        if progress:
            progress(done, len(jobs))
    return [f.result() for f in futures]


@lru_cache(maxsize=1)
def _models(checkpoints: Checkpoints) -> Models:
    return load_models(checkpoints.pcdiff, checkpoints.voxelizer, device=checkpoints.device)


@lru_cache(maxsize=1)
def _dataset(root: str) -> PreparedDataset:
    return PreparedDataset(Path(root))


@lru_cache(maxsize=1)
def _atlas(root: str, surfaces: str) -> Atlas:
    """The training skulls' atlas, their surfaces read from ``surfaces`` (:func:`atlas_surfaces`'s file)."""
    with np.load(surfaces) as found:
        known = dict(zip(found["names"].tolist(), found["surfaces"]))
    return Atlas.from_prepared(_dataset(root), split="train", surfaces=known)


def atlas_surface_of(prepared: str, skull_id: str) -> tuple[str, np.ndarray]:
    """One training skull's atlas surface (:func:`~pointforge.implant.baseline.atlas_surface`): the costly
    part of the baseline's atlas, computed once per skull on the pool instead of once per worker."""
    for name, read in prepared_skulls(_dataset(prepared), "train"):
        if name == skull_id:
            volume = read()
            return name, atlas_surface(volume.data, volume.affine())
    raise DataError(f"{prepared}: no training skull {skull_id!r}")


def atlas_surfaces(pool: Executor, prepared: str, path: Path) -> Path:
    """Every training skull's atlas surface, computed side by side on the pool, saved to ``path``
    (npz: ``names``, the skull ids, and ``surfaces``, their points in mm, ``[skulls, ATLAS_POINTS, 3]``)."""
    names = [name for name, _ in prepared_skulls(_dataset(prepared), "train")]
    found = [future.result() for future in [pool.submit(atlas_surface_of, prepared, n) for n in names]]
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, names=np.array([name for name, _ in found]), surfaces=np.stack([points for _, points in found]))
    return path


def _source(dataset: PreparedDataset, points: str) -> Path:
    return Path(dataset.meta(points)["source"])


def _scored(job: CaseJob, generated: Generated, dataset: PreparedDataset) -> dict:
    """The case's metrics against its true implant, and the placement of its generated points (mm)."""
    truth = read_binary_volume(_source(dataset, job.implant_points))
    scores = evaluate_case(generated.implant, truth.data, generated.defective.data, truth.spacing)
    row = {"case_id": job.case_id, "defect": job.defect, **{m: scores[m] for m in METRICS}}
    row.update(notes="; ".join(scores["notes"]), error=scores["error"])
    placement = placement_mm(dataset, job.defective_points, job.implant_points, generated.implant_points)
    return {"row": row, "placement": {"case": job.case_id, **placement}}


def placement_mm(dataset: PreparedDataset, defective: str, implant: str, generated: np.ndarray) -> dict[str, float]:
    """Where a case's generated points (``[n, P, 3]``, voxel indices) lie against its true implant points, in mm
    (:func:`~pointforge.tasks.pcdiff.placement.placement_metrics`, the proposals averaged).

    The generated points are voxel indices of the case's own volume; the prepared points are on the
    grid ``data prepare`` made, which for an anisotropic volume (SkullFix) is resampled to isotropic
    voxels: the generated points are put on that grid first."""
    meta = dataset.meta(defective)
    spacing = np.asarray(meta["spacing"], dtype=np.float64)
    on_grid = np.asarray(generated, dtype=np.float64)
    if meta.get("resampled"):
        on_grid = on_grid / np.asarray(meta["resampled"]["to_original_index_scale"], dtype=np.float64)
    pred = torch.from_numpy(on_grid * spacing)
    true = torch.from_numpy(np.asarray(dataset.points(implant), dtype=np.float64) * spacing)
    found = placement_metrics(pred, true[None].expand(len(pred), -1, -1))
    return {name: float(values.mean()) for name, values in found.items()}


# What a scored case's implant points come from: PCDiff, the true implant (the oracle) or the
# atlas estimate PCDiff's frame (and prior) start from, each through the same voxelizer and clean-up.
SOURCES = ("model", "oracle", "prior")


def score_case(job: CaseJob, checkpoints: Checkpoints, options: GenerateOptions, source: str = "model") -> dict:
    """Generate one case in memory and score it: ``{"row", "placement"}`` or ``{"failed"}``, plus seconds.

    ``source`` (:data:`SOURCES`): ``oracle``, the case's true implant points
    replace PCDiff's proposals; ``prior``, the atlas's estimate of them does.
    """
    dataset = _dataset(job.prepared)
    models = _models(checkpoints)
    defective = read_binary_volume(_source(dataset, job.defective_points))
    start = time.perf_counter()
    given = None
    rng = np.random.default_rng([options.seed, job.index])
    if source == "oracle":
        given = oracle_points(dataset, job, models.pcdiff.config.n_implant, options.ensemble, rng)
    elif source == "prior":
        given = atlas_points(defective, models, options, rng)
    try:
        generated = generate_implant(defective, models, options, proposals_mm=given, each=False)  # scored only
    except DataError as err:
        return {"case_id": job.case_id, "failed": str(err).splitlines()[0], "generating_s": time.perf_counter() - start}
    generating = time.perf_counter() - start
    result = _scored(job, generated, dataset)
    return {
        **result,
        "case_id": job.case_id,
        "generating_s": generating,
        "scoring_s": time.perf_counter() - start - generating,
    }


def oracle_points(
    dataset: PreparedDataset, job: CaseJob, n_implant: int, ensemble: int, rng: np.random.Generator
) -> np.ndarray:
    """``ensemble`` draws of ``n_implant`` of the case's true implant points, in mm: ``[ensemble, n_implant, 3]``."""
    meta = dataset.meta(job.implant_points)
    points = np.asarray(dataset.points(job.implant_points), dtype=np.float64)
    affine = np.asarray(meta["direction"], dtype=np.float64) * np.asarray(meta["spacing"], dtype=np.float64)[None, :]
    points_mm = points @ affine.T + np.asarray(meta["origin"], dtype=np.float64)
    many = len(points_mm) < n_implant
    return np.stack([points_mm[rng.choice(len(points_mm), n_implant, replace=many)] for _ in range(ensemble)])


def atlas_points(defective, models: Models, options: GenerateOptions, rng: np.random.Generator) -> np.ndarray:
    """``[ensemble, n_implant, 3]`` mm: draws of the atlas's estimate of the missing bone
    (:func:`~pointforge.tasks.pcdiff.frame.atlas_estimate`, with the model's atlas and frame)."""
    cfg = models.pcdiff.config
    if cfg.frame is None:
        raise DataError("the atlas prior needs a PCDiff model trained with task.frame (it carries the atlas)")
    agree = cfg.prior.agree if cfg.prior is not None else 0.5
    skull = surface_points(defective.data, int(options.surface_points), seed=int(options.seed))  # as generate's
    atlas = getattr(models.pcdiff.model, "atlas_mm")
    assert isinstance(atlas, torch.Tensor)  # a model trained with task.frame carries its atlas
    found = atlas_estimate(atlas, skull, np.asarray(defective.spacing), cfg.frame, agree)
    draws = np.stack([prior_points(found.points, int(cfg.n_implant), rng) for _ in range(options.ensemble)])
    return defective.voxel_to_physical(draws.reshape(-1, 3)).reshape(draws.shape)


def write_case(job: CaseJob, checkpoints: Checkpoints, options: GenerateOptions, out: str, viewer_js: str) -> dict:
    """Generate one case with every output into ``out/<case_id>`` (:func:`~pointforge.implant.case.generate_case`).

    ``{"case_id", "failed": None or the one-line reason, "generating_s"}``; a
    case already complete there is kept. A full disk is raised, not recorded.
    """
    dataset = _dataset(job.prepared)
    target = Path(out) / job.case_id
    start = time.perf_counter()
    failed = None
    if not case_done(target):
        try:
            generate_case(
                _source(dataset, job.defective_points),
                target,
                _models(checkpoints),
                options,
                overwrite=target.exists(),
                title=f"{job.case_id} ({job.defect})" if job.defect else job.case_id,
                viewer_js=viewer_js,
            )
        except Exception as err:  # noqa: BLE001 - one case must never stop the others
            if disk_full_cause(err) is not None:
                raise
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            failed = message if isinstance(err, UserError) else f"{type(err).__name__}: {message}"
    return {"case_id": job.case_id, "failed": failed, "generating_s": time.perf_counter() - start}


def baseline_case(job: CaseJob, out: str, surfaces: str) -> dict:
    """The case's defect filled with the mean of the registered training skulls, into ``out/<case_id>/implant.nrrd``;
    ``surfaces``: the atlas surfaces' file (:func:`atlas_surfaces`)."""
    dataset = _dataset(job.prepared)
    start = time.perf_counter()
    defective = read_binary_volume(_source(dataset, job.defective_points))
    atlas = _atlas(job.prepared, surfaces)
    write_volume(Path(out) / job.case_id / "implant.nrrd", mean_skull_implant(defective, atlas))
    return {"case_id": job.case_id, "generating_s": time.perf_counter() - start}
