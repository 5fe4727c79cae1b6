"""PCDiff: skull completion by point cloud diffusion, as a training task and a Python API.

The task (``pointforge train pcdiff --config configs/pcdiff/{tiny,small,paper}.yaml``):

* model: a :class:`~pointforge.nn.pvcnn.PVCNN2` preset (``task.model``);
* data: a prepared dataset (``task.data_root``, written by ``pointforge data
  prepare``), served by :class:`~pointforge.data.skulls.CompletionDataset`:
  ``n_skull`` defective-skull points then ``n_implant`` implant points,
  normalised by the defective skull's bounding box. With ``task.synthetic`` set
  and no dataset at ``data_root`` yet, a synthetic SkullBreak-style dataset is
  synthesised and prepared there once (see :func:`ensure_prepared_dataset`);
* loss: ε-prediction MSE on the implant points only; the skull points stay
  clean and condition the network (:func:`~pointforge.nn.diffusion.diffusion_loss`);
* evaluation (rank 0 only: it samples): each validation case's implant is
  sampled with a fast sampler (``task.eval``) and compared with the true implant
  points by Chamfer distance, in normalised units (``val_chamfer``, what
  ``best.pt`` is chosen by) and in millimetres via the case's scale and the
  prepared metadata's voxel spacing (``val_chamfer_mm2``, ``val_mean_dist_mm``).

The Python API, for the implant pipeline and for users:

* :func:`load_pcdiff` — a trained network, its noise schedule and task config
  from a pointforge checkpoint (through the engine's one checkpoint loader);
* :func:`complete` — ``n`` implant proposals for a defective skull given as
  points in any coordinates, sampled in one batched pass and returned in those
  coordinates;
* :func:`import_pcdiff_checkpoint` — an upstream PCDiff checkpoint converted
  into a pointforge training checkpoint (``pointforge ckpt import-pcdiff``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from pointforge.config import load_train_config, to_dict, train_config_from_dict
from pointforge.data.skulls import CompletionDataset, PreparedDataset, bbox_normalization
from pointforge.errors import CheckpointError, ConfigError, DataError, DeviceError
from pointforge.nn.diffusion import (
    NoiseSchedule,
    Sampler,
    diffusion_loss,
    make_sampler,
    sample_ensemble,
)
from pointforge.nn.pvcnn import PVCNN2, get_preset
from pointforge.tasks.base import EvalContext, StepContext, Task
from pointforge.train.tracking import get_logger

__all__ = [
    "PRESET_POINTS",
    "SyntheticSection",
    "DiffusionSection",
    "EvalSection",
    "PCDiffConfig",
    "CompletionTask",
    "PCDiffDataset",
    "LoadedPCDiff",
    "ImportResult",
    "build_schedule",
    "build_eval_sampler",
    "ensure_prepared_dataset",
    "implant_distances",
    "load_pcdiff",
    "complete",
    "import_pcdiff_checkpoint",
]

log = get_logger("pcdiff")


def _say(message: str) -> None:
    """Log ``message``; where nothing has set up logging (e.g. the planning pass that
    ``--nproc`` runs before starting workers), print it to stderr instead of losing it."""
    if log.hasHandlers():
        log.info(message)
    else:
        print(message, file=sys.stderr, flush=True)

# Points per example (defective skull, implant) each PVCNN2 preset is laid out for.
PRESET_POINTS: dict[str, tuple[int, int]] = {
    "paper": (27_648, 3_072),
    "small": (3_456, 384),
    "tiny": (896, 128),
}
HALF_EXTENT = 3.0  # normalised clouds lie within about ±3 (as upstream PCDiff, github.com/pfriedri/pcdiff-implant)


# --------------------------------------------------------------------------- config


@dataclass
class SyntheticSection:
    """A synthetic SkullBreak-style dataset built into ``data_root`` when none is there."""

    skulls: int = 4
    size: int = 64  # voxels per side (64 .. 512)
    seed: int = 0
    points: int = 4096  # surface points kept per volume when preparing
    split: str = "0.5,0.25,0.25"  # train, val, test ratios, grouped by skull

    # Called by PCDiffConfig.validate rather than as `validate`: the config
    # loader reads an optional section by trying it and, on any error, reports
    # only that the section did not fit; checking afterwards keeps the detail.
    def check(self, prefix: str) -> None:
        if not 2 <= self.skulls <= 1000:
            raise ConfigError(f"config key '{prefix}.skulls' must be from 2 to 1000 (a training and a validation skull at least), got {self.skulls}")
        if not 64 <= self.size <= 512:
            raise ConfigError(f"config key '{prefix}.size' must be from 64 to 512 voxels, got {self.size}")
        if self.seed < 0:
            raise ConfigError(f"config key '{prefix}.seed' must be 0 or more, got {self.seed}")
        if self.points < 1000:
            raise ConfigError(f"config key '{prefix}.points' must be at least 1000, got {self.points}")
        from pointforge.data.skulls import parse_ratios

        try:
            parse_ratios(self.split)
        except ConfigError as err:
            raise ConfigError(f"config key '{prefix}.split': {err}") from None


@dataclass
class DiffusionSection:
    """The noise schedule (Friedrich et al., MICCAI 2023: T = 1000, linear betas 1e-4 → 0.02)."""

    schedule: Literal["linear", "warm0.1", "warm0.2", "warm0.5"] = "linear"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    timesteps: int = 1000

    def validate(self, prefix: str) -> None:
        try:
            build_schedule(self)
        except ConfigError as err:
            raise ConfigError(f"config section '{prefix}': {err}") from None


@dataclass
class EvalSection:
    """How validation samples implants: a fast sampler, on at most ``max_cases`` cases."""

    sampler: Literal["ddpm", "ddim", "dpm++2m"] = "ddim"
    steps: int | None = 25  # null: the sampler's default (all T steps for ddpm)
    eta: float = 0.0  # ddim only
    max_cases: int | None = 8  # the first N validation cases (in cases.csv order); null = all
    seed: int = 0  # starting noise, the same at every evaluation
    save_samples: bool = True  # write samples.npz (voxel coordinates) under the run's eval/epoch-NNNN

    def validate(self, prefix: str) -> None:
        if self.max_cases is not None and self.max_cases < 1:
            raise ConfigError(f"config key '{prefix}.max_cases' must be at least 1 or null, got {self.max_cases}")
        if self.sampler == "ddpm" and self.steps is not None:
            raise ConfigError(f"config key '{prefix}.steps' must be null for the ddpm sampler (it runs all T steps); use ddim or dpm++2m for fewer")
        if self.sampler != "ddim" and self.eta != 0.0:
            raise ConfigError(f"config key '{prefix}.eta' applies to the ddim sampler only; remove it for {self.sampler}")


@dataclass
class PCDiffConfig:
    """The ``task`` section of a PCDiff training config."""

    data_root: str = "data/pcdiff/prepared"  # a prepared dataset (pointforge data prepare)
    synthetic: SyntheticSection | None = None  # build a synthetic dataset at data_root if none is there
    train_split: Literal["train", "val", "test"] = "train"
    val_split: Literal["train", "val", "test"] | None = "val"
    model: Literal["paper", "small", "tiny"] = "paper"  # PVCNN2 preset
    n_skull: int | None = None  # null: the preset's (PRESET_POINTS)
    n_implant: int | None = None
    rotate_degrees: float = 0.0  # training augmentation: random rotation within ± this about each axis
    data_seed: int = 0  # per-item subsampling and rotation: seeded by (data_seed, epoch, index)
    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self) -> None:
        skull, implant = PRESET_POINTS.get(self.model, (None, None))
        if self.n_skull is None:
            self.n_skull = skull
        if self.n_implant is None:
            self.n_implant = implant

    def validate(self, prefix: str) -> None:
        if self.synthetic is not None:
            self.synthetic.check(f"{prefix}.synthetic")
        if self.n_skull < 1 or self.n_implant < 1:
            raise ConfigError(f"config keys '{prefix}.n_skull' and '{prefix}.n_implant' must be at least 1, got {self.n_skull} and {self.n_implant}")
        need = get_preset(self.model).min_points
        if self.n_skull + self.n_implant < need:
            raise ConfigError(
                f"config keys '{prefix}.n_skull' + '{prefix}.n_implant' = {self.n_skull + self.n_implant} points, "
                f"but PVCNN2 preset '{self.model}' needs at least {need}"
            )
        if not 0.0 <= self.rotate_degrees <= 180.0:
            raise ConfigError(f"config key '{prefix}.rotate_degrees' must lie in [0, 180], got {self.rotate_degrees}")
        if self.val_split is not None and self.val_split == self.train_split:
            raise ConfigError(f"config keys '{prefix}.train_split' and '{prefix}.val_split' are both '{self.train_split}'; validate on another split or set val_split: null")
        if self.eval.steps is not None and not 2 <= self.eval.steps <= self.diffusion.timesteps:
            raise ConfigError(f"config key '{prefix}.eval.steps' must be from 2 to {prefix}.diffusion.timesteps={self.diffusion.timesteps}, got {self.eval.steps}")


def build_schedule(section: DiffusionSection) -> NoiseSchedule:
    return NoiseSchedule.from_name(section.schedule, section.beta_start, section.beta_end, section.timesteps)


def build_eval_sampler(section: EvalSection, schedule: NoiseSchedule) -> Sampler:
    return make_sampler(section.sampler, section.steps, section.eta, schedule=schedule)


def build_model(cfg: PCDiffConfig) -> PVCNN2:
    return PVCNN2(get_preset(cfg.model))


# --------------------------------------------------------------------------- data


_PREPARED_FILES = ("cases.csv", "dataset.json")


def _is_prepared(root: Path) -> bool:
    return all((root / name).is_file() for name in _PREPARED_FILES)


def ensure_prepared_dataset(
    root: str | os.PathLike,
    synthetic: SyntheticSection | None = None,
    *,
    lock_timeout_s: float | None = None,
) -> Path:
    """The prepared dataset at ``root``; with ``synthetic`` and nothing there yet, one is built first.

    The building (synthesise, prepare, rename into place under a file lock so
    the ranks of one job can all call this) is :func:`pointforge.data.cache.ensure_synthetic_prepared`.
    """
    from pointforge.data.cache import ensure_synthetic_prepared

    root = Path(root)
    if synthetic is None:
        if _is_prepared(root):
            return root
        raise DataError(
            f"{root}: no prepared dataset here (cases.csv, dataset.json); run `pointforge data prepare RAW_ROOT --out {root}` "
            "or set task.synthetic to build a synthetic one"
        )
    if root.exists() and not _is_prepared(root):
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()  # an empty folder to build into: the builder renames a finished folder into place
        else:
            raise DataError(f"{root}: exists but is not a prepared dataset; point task.data_root at an empty or new folder to synthesise into")
    return ensure_synthetic_prepared(
        root, synthetic.skulls, synthetic.size, synthetic.seed, synthetic.points, log=_say,
        split=synthetic.split, timeout_s=3600.0 if lock_timeout_s is None else lock_timeout_s,
    )


class PCDiffDataset(CompletionDataset):
    """:class:`CompletionDataset` items plus ``spacing`` [3] (mm per voxel of the case's points).

    ``max_cases`` keeps the first cases in ``cases.csv`` order.
    """

    def __init__(self, root, split: str, *, max_cases: int | None = None, **kwargs: Any):
        super().__init__(root, split, **kwargs)
        if max_cases is not None:
            self.cases = self.cases[:max_cases]
        self._spacing: dict[str, torch.Tensor] = {}

    def spacing(self, index: int) -> torch.Tensor:
        case = self.cases[index]
        if case.defective not in self._spacing:
            try:
                spacing = self.data.meta(case.defective)["spacing"]
            except (OSError, ValueError, KeyError) as err:
                raise DataError(f"{self.data.path(case.defective)}: its .json metadata has no readable spacing ({err}); re-run pointforge data prepare") from None
            self._spacing[case.defective] = torch.tensor([float(s) for s in spacing], dtype=torch.float32)
        return self._spacing[case.defective]

    def __getitem__(self, index: int) -> dict:
        item = super().__getitem__(index)
        item["spacing"] = self.spacing(index)
        return item


# --------------------------------------------------------------------------- metrics


def implant_distances(
    pred: torch.Tensor,
    true: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    spacing: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-case distances between predicted and true implant points, ``[B, P, 3]`` and ``[B, Q, 3]``.

    ``chamfer``: :func:`~pointforge.nn.losses.chamfer_distance` (squared
    distances, each direction averaged, the two summed) in the points' units.
    With ``scale`` [B] (normalised → voxel) and ``spacing`` [B, 3] (mm per
    voxel) also ``chamfer_mm2`` (the same in mm²) and ``mean_dist_mm`` (the
    mean nearest-neighbour distance in mm, the two directions averaged).
    """
    from pointforge.nn.knn import knn
    from pointforge.nn.losses import chamfer_distance

    b, p, _ = pred.shape
    q = true.shape[1]
    pred, true = pred.float(), true.float()
    pred_batch = torch.arange(b, device=pred.device).repeat_interleave(p)
    true_batch = torch.arange(b, device=pred.device).repeat_interleave(q)
    out = {"chamfer": chamfer_distance(pred.reshape(-1, 3), true.reshape(-1, 3), pred_batch, true_batch, num_clouds=b, reduction="none")}
    if scale is not None and spacing is not None:
        factor = scale.float().reshape(b, 1, 1) * spacing.float().reshape(b, 1, 3)
        pred_mm = (pred * factor).reshape(-1, 3)
        true_mm = (true * factor).reshape(-1, 3)
        out["chamfer_mm2"] = chamfer_distance(pred_mm, true_mm, pred_batch, true_batch, num_clouds=b, reduction="none")
        to_true = knn(true_mm, pred_mm, 1, true_batch, pred_batch).dist2[:, 0].sqrt()
        to_pred = knn(pred_mm, true_mm, 1, pred_batch, true_batch).dist2[:, 0].sqrt()
        per_pred = torch.zeros(b, device=pred.device).index_add(0, pred_batch, to_true) / p
        per_true = torch.zeros(b, device=pred.device).index_add(0, true_batch, to_pred) / q
        out["mean_dist_mm"] = (per_pred + per_true) / 2
    return out


# --------------------------------------------------------------------------- the task


class CompletionTask(Task):
    """PCDiff training: PVCNN2 + Gaussian diffusion on the implant points (module docs)."""

    name = "pcdiff"
    Config = PCDiffConfig
    eval_on = "rank0"
    best_metric = "val_chamfer"
    best_mode = "min"

    def configure(self, cfg: PCDiffConfig) -> None:
        self.cfg = cfg
        self.schedule = build_schedule(cfg.diffusion)
        self.sampler = build_eval_sampler(cfg.eval, self.schedule)

    def build_model(self, cfg: PCDiffConfig) -> nn.Module:
        return build_model(cfg)

    def build_datasets(self, cfg: PCDiffConfig) -> tuple[Dataset, Dataset | None]:
        root = ensure_prepared_dataset(cfg.data_root, cfg.synthetic)
        prepared = PreparedDataset(root)
        common = dict(n_skull=cfg.n_skull, n_implant=cfg.n_implant, half_extent=HALF_EXTENT)
        train = PCDiffDataset(prepared, cfg.train_split, rotate_degrees=cfg.rotate_degrees, seed=cfg.data_seed, **common)
        val = None
        if cfg.val_split is not None and prepared.split(cfg.val_split):
            val = PCDiffDataset(prepared, cfg.val_split, max_cases=cfg.eval.max_cases, seed=cfg.data_seed + 1, **common)
        elif cfg.val_split is not None:
            log.warning(f"{root}: the '{cfg.val_split}' split has no case with an implant; training without validation")
        return train, val

    def batch_sampler(self, dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch):
        # The engine calls this before every epoch (and once at planning, for
        # epoch 0) and does not itself call datasets' set_epoch; this is where
        # the task learns the epoch before the loader draws items, so the
        # per-epoch subsampling and rotations change. None: the engine batches.
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return None

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext):
        x0 = batch["points"].transpose(1, 2)  # [B, 3, n_skull + n_implant]
        return diffusion_loss(model, self.schedule, x0, self.cfg.n_implant)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        cfg = self.cfg
        n_skull, n_implant = cfg.n_skull, cfg.n_implant
        generator = torch.Generator().manual_seed(cfg.eval.seed)  # CPU: the same noise on any device
        sums: dict[str, float] = {}
        count = 0
        saved: dict[str, list] = {"case_id": [], "pred_voxel": [], "true_voxel": []}
        started = time.perf_counter()
        for batch in loader:
            points = batch["points"].to(ctx.device)
            cond = points[:, :n_skull].transpose(1, 2)
            out = self.sampler.sample(model, cond, n_implant, generator=generator)
            pred = out[:, :, n_skull:].transpose(1, 2).float()
            true = points[:, n_skull:].float()
            scale = batch["scale"].to(ctx.device)
            found = implant_distances(pred, true, scale=scale, spacing=batch["spacing"].to(ctx.device))
            for name, values in found.items():
                sums[name] = sums.get(name, 0.0) + float(values.sum())
            count += points.shape[0]
            if cfg.eval.save_samples:
                center = batch["center"].to(ctx.device).reshape(-1, 1, 3)
                saved["case_id"] += list(batch["case_id"])
                saved["pred_voxel"].append((pred * scale.reshape(-1, 1, 1) + center).cpu().numpy())
                saved["true_voxel"].append((true * scale.reshape(-1, 1, 1) + center).cpu().numpy())
        if not count:
            return {}
        if cfg.eval.save_samples:
            _save_samples(ctx.out_dir / "samples.npz", saved)
        metrics = {f"val_{name}": total / count for name, total in sums.items()}
        metrics["val_sample_s_per_case"] = (time.perf_counter() - started) / count
        return metrics


def _save_samples(path: Path, saved: Mapping[str, list]) -> None:
    from pointforge.atomic import atomic_writer

    with atomic_writer(path, "wb") as handle:
        np.savez(
            handle,
            case_id=np.asarray(saved["case_id"]),
            pred_voxel=np.concatenate(saved["pred_voxel"]),
            true_voxel=np.concatenate(saved["true_voxel"]),
        )


# --------------------------------------------------------------------------- loading and sampling


class LoadedPCDiff(tuple):
    """``(model, schedule, config)`` from :func:`load_pcdiff`; ``.weights`` says which were loaded.

    Unpacks as a 3-tuple; ``.model``, ``.schedule``, ``.config`` and
    ``.weights`` (``"ema"`` or ``"model"``) name the parts.
    """

    def __new__(cls, model: PVCNN2, schedule: NoiseSchedule, config: PCDiffConfig, weights: str):
        obj = super().__new__(cls, (model, schedule, config))
        obj.weights = weights
        return obj

    model = property(lambda self: self[0])
    schedule = property(lambda self: self[1])
    config = property(lambda self: self[2])


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"'{device}' is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device} asked for, but CUDA is not available here; use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device} does not exist; {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def load_pcdiff(
    checkpoint_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    *,
    weights: Literal["auto", "ema", "model"] = "auto",
) -> LoadedPCDiff:
    """A trained PCDiff network (eval mode, on ``device``), its noise schedule and task config.

    Reads a pointforge checkpoint of the ``pcdiff`` task (a training run's
    ``best.pt``/``latest.pt``, or ``pointforge ckpt import-pcdiff`` output)
    through the engine's checkpoint loader. ``weights="auto"`` takes the EMA
    weights when the checkpoint has them and the trained weights otherwise;
    the result's ``.weights`` says which (and it is logged).
    """
    from pointforge.train.checkpoint import is_pointforge_checkpoint, load_checkpoint, load_model_state

    path = Path(checkpoint_path)
    if weights not in ("auto", "ema", "model"):
        raise ConfigError(f"weights must be auto, ema or model, got {weights!r}")
    dev = _device(device)
    ckpt = load_checkpoint(path)
    if not is_pointforge_checkpoint(ckpt):
        raise CheckpointError(
            f"{path} is not a pointforge checkpoint; an upstream PCDiff checkpoint must first be converted "
            f"with `pointforge ckpt import-pcdiff {path} OUT.pt`"
        )
    if ckpt.get("task") != CompletionTask.name:
        raise CheckpointError(f"{path} was written by task '{ckpt.get('task')}', not '{CompletionTask.name}'; load it with that task's loader")
    try:
        cfg = train_config_from_dict(ckpt.get("config") or {}).task
    except ConfigError as err:
        raise CheckpointError(f"{path} holds a pcdiff config this version cannot read ({err})") from None
    has_ema = ckpt.get("ema") is not None
    if weights == "ema" and not has_ema:
        raise CheckpointError(f"{path} has no EMA weights (the run had train.ema_decay unset); use weights='model'")
    chosen = "ema" if (weights == "ema" or (weights == "auto" and has_ema)) else "model"
    model = build_model(cfg)
    load_model_state(model, ckpt["ema"] if chosen == "ema" else ckpt["model"])
    model.to(dev).eval()
    progress = ckpt.get("progress") or {}
    log.info(
        f"loaded PCDiff ({cfg.model} preset, {cfg.n_skull}+{cfg.n_implant} points, T={cfg.diffusion.timesteps}) "
        f"from {path}: {'EMA' if chosen == 'ema' else 'trained (non-EMA)'} weights, step {progress.get('global_step')}"
    )
    return LoadedPCDiff(model, build_schedule(cfg.diffusion), cfg, chosen)


def _as_points(skull_points: Any) -> tuple[np.ndarray, bool]:
    is_torch = isinstance(skull_points, torch.Tensor)
    array = skull_points.detach().cpu().numpy() if is_torch else np.asarray(skull_points)
    if array.ndim != 2 or array.shape[1] != 3 or array.shape[0] < 2:
        raise DataError(f"skull points must be an [M, 3] array with M >= 2, got shape {tuple(array.shape)}")
    if not np.issubdtype(array.dtype, np.number):
        raise DataError(f"skull points must be numbers, got dtype {array.dtype}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise DataError("skull points contain NaN or infinite coordinates")
    return array, is_torch


def _subsample_indices(points: np.ndarray, n: int, how: str, generator: torch.Generator | None) -> np.ndarray:
    m = points.shape[0]
    if m <= n:
        # Fewer points than the network was trained with: all of them, topped up with repeats.
        extra = torch.randint(0, m, (n - m,), generator=generator).numpy() if n > m else np.empty(0, np.int64)
        return np.concatenate([np.arange(m), extra])
    if how == "random":
        return torch.randperm(m, generator=generator)[:n].numpy()
    from pointforge.nn.pvops import furthest_point_sample_indices

    coords = torch.from_numpy(points.T[None].astype(np.float32))
    return furthest_point_sample_indices(coords, n)[0].numpy()


def complete(
    skull_points: Any,
    model: nn.Module,
    sampler: Sampler,
    n: int = 1,
    *,
    config: PCDiffConfig | None = None,
    n_skull: int | None = None,
    n_implant: int | None = None,
    subsample: Literal["random", "fps"] = "random",
    generator: torch.Generator | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray | torch.Tensor:
    """``n`` implant proposals ``[n, n_implant, 3]`` for a defective skull, in the input's coordinates.

    ``skull_points``: ``[M, 3]`` (NumPy or torch) points of the defective skull
    in any coordinates, e.g. voxel indices of its surface. They are
    subsampled to the ``n_skull`` conditioning points the model was trained
    with (``random``, as training draws them, or ``fps``; with fewer than
    ``n_skull`` points all are used and some repeated), normalised exactly as
    the dataset normalises (centre and half-extent 3 of the subsampled
    skull's bounding box), completed ``n`` times in one batched pass of
    ``sampler`` (:func:`~pointforge.nn.diffusion.sample_ensemble`) and mapped
    back. ``n_skull``/``n_implant`` default to ``config``'s (the third item
    of :func:`load_pcdiff`). ``generator`` (a CPU generator gives the same
    result on any device) draws the subsample and the starting noise;
    ``progress(step, steps)`` is called after each sampler step.

    Returns a NumPy float32 array for NumPy input, a CPU float32 tensor for a tensor.
    """
    if config is not None:
        n_skull = config.n_skull if n_skull is None else n_skull
        n_implant = config.n_implant if n_implant is None else n_implant
        if sampler.schedule.num_timesteps != config.diffusion.timesteps:
            raise ConfigError(
                f"the sampler runs a {sampler.schedule.num_timesteps}-step schedule but the model was trained with "
                f"{config.diffusion.timesteps} steps; build it with make_sampler(..., schedule=<load_pcdiff's schedule>)"
            )
    if n_skull is None or n_implant is None:
        raise ConfigError("complete() needs the model's point counts: pass config= (from load_pcdiff) or n_skull= and n_implant=")
    for name, value in (("n", n), ("n_skull", n_skull), ("n_implant", n_implant)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if subsample not in ("random", "fps"):
        raise ConfigError(f"subsample must be 'random' or 'fps', got {subsample!r}")
    points, as_torch = _as_points(skull_points)
    chosen = points[_subsample_indices(points, int(n_skull), subsample, generator)]
    norm = bbox_normalization(chosen, HALF_EXTENT)
    device = next(model.parameters()).device
    cond = torch.from_numpy(norm.apply(chosen)).to(device).T.contiguous()  # [3, n_skull]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = sample_ensemble(sampler, model, cond, int(n_implant), int(n), generator=generator, progress=progress)
    finally:
        model.train(was_training)
    implants = out[:, :, int(n_skull) :].transpose(1, 2)  # [n, n_implant, 3] normalised
    mapped = norm.inverse(implants.float())
    return torch.from_numpy(mapped) if as_torch else mapped


# --------------------------------------------------------------------------- importing upstream checkpoints


@dataclass
class ImportResult:
    path: Path
    preset: str
    prefix: str  # the key prefix stripped ("model." or "model.module.")
    upstream_epoch: int | None
    epochs_done: int  # what a resumed run counts as finished
    tensors: int
    parameters: int


def import_pcdiff_checkpoint(
    source: str | os.PathLike,
    target: str | os.PathLike,
    *,
    preset: str | None = None,
    config: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    overwrite: bool = False,
    trust: bool = False,
) -> ImportResult:
    """Convert an upstream PCDiff checkpoint into a pointforge ``pcdiff`` training checkpoint.

    ``source``: upstream's ``{"epoch", "model_state", "optimizer_state"}`` file
    (keys ``model.`` or, from DDP, ``model.module.``) or a bare state dict. The
    network is identified by :func:`~pointforge.nn.pcdiff_import.import_upstream_state_dict`
    (``preset`` forces one). The written file has the engine's layout: the
    resolved training config (``config`` YAML and ``overrides``, else the
    defaults, with ``task.model`` set to the preset), the weights, no EMA,
    and a *fresh* optimizer and LR-schedule state — upstream's Adam moments
    are dropped — plus progress saying ``upstream epoch + 1`` epochs are done
    (the epoch upstream would resume at) with the step counter at 0. So both
    ``load_pcdiff`` and ``pointforge train pcdiff --resume OUT.pt`` accept it.
    Written atomically; an existing ``target`` is kept unless ``overwrite``.
    """
    from pointforge.nn.pcdiff_import import import_upstream_state_dict
    from pointforge.train.checkpoint import capture_rng, is_pointforge_checkpoint, load_checkpoint, load_model_state, restore_rng, save_checkpoint
    from pointforge.train.data import derive_seed, seed_everything
    from pointforge.train.schedule import build_optimizer, build_scheduler

    source, target = Path(source), Path(target)
    if target.exists() and not overwrite:
        raise ConfigError(f"{target} already exists; choose another output path or pass --force to replace it")
    if target.resolve() == source.resolve():
        raise ConfigError(f"the output {target} is the input checkpoint; write the converted file elsewhere")
    if preset is not None and preset not in PRESET_POINTS:
        raise ConfigError(f"unknown PVCNN2 preset {preset!r}; choose one of {', '.join(PRESET_POINTS)}")
    upstream = load_checkpoint(source, weights_only=not trust)
    if is_pointforge_checkpoint(upstream):
        raise CheckpointError(f"{source} is already a pointforge checkpoint (task '{upstream.get('task')}'); load it directly")
    imported = import_upstream_state_dict(upstream, preset)
    if imported.preset is None:
        raise CheckpointError(
            f"{source} holds a PVCNN2 that differs from every preset ({', '.join(PRESET_POINTS)}); "
            "the pcdiff task builds its network from a preset, so this checkpoint cannot be trained or loaded here"
        )
    cfg = load_train_config(CompletionTask.name, config, list(overrides))
    chosen = cfg.task.model
    named_in_config = config is not None or any(o.split("=", 1)[0].strip() == "task.model" for o in overrides)
    if named_in_config and chosen != imported.preset:
        raise ConfigError(f"the config's task.model is '{chosen}' but {source} holds a '{imported.preset}' network; use a {imported.preset} config")
    if chosen != imported.preset:
        cfg = load_train_config(CompletionTask.name, config, [*overrides, f"task.model={imported.preset}"])
    model = build_model(cfg.task)
    load_model_state(model, imported.state_dict)
    optimizer = build_optimizer(CompletionTask().parameters(model), cfg.optim, cfg.optim.lr)
    scheduler = build_scheduler(optimizer, cfg.sched, max(1, cfg.train.epochs))
    epochs_done = 0 if imported.epoch is None else imported.epoch + 1
    # A single-rank resume gets the RNG streams a fresh run would have on rank 0.
    saved_rng = capture_rng()
    try:
        seed_everything(derive_seed(cfg.train.seed, "rank", 0))
        rng = capture_rng()
    finally:
        restore_rng(saved_rng)
    state = {
        "task": CompletionTask.name,
        "config": to_dict(cfg),
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "ema": None,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": None,
        "progress": {
            "epoch": epochs_done,
            "step_in_epoch": 0,
            "global_step": 0,
            "samples_seen": 0,
            "nonfinite_streak": 0,
            "skipped_steps": 0,
            "best_metric": CompletionTask.best_metric,
            "best_mode": CompletionTask.best_mode,
            "best_value": None,
            "best_step": None,
            "global_batch": cfg.data.global_batch,
            "steps_per_epoch": None,
            "world_size": 1,
        },
        "rng": {"world_size": 1, "per_rank": [rng]},
        "metrics": {},
        "imported_from": {
            "path": str(source),
            "format": "upstream PCDiff (train_completion.py)",
            "upstream_epoch": imported.epoch,
            "prefix": imported.prefix,
            "optimizer_state": "dropped (fresh Adam state)",
        },
    }
    save_checkpoint(target, state)
    n_params = sum(int(p.numel()) for p in model.parameters())
    return ImportResult(target, imported.preset, imported.prefix, imported.epoch, epochs_done, len(imported.state_dict), n_params)
