"""The upsampler task: sparse → dense point clouds, trained by the engine.

What this task hands the engine (see :mod:`pointforge.train.task`):

* model: :func:`pointforge.nn.upsampler.build_upsampler` from ``task.preset``
  plus any ``task.model.*`` overrides;
* data: :class:`~pointforge.data.pairs.dataset.UpsamplingPairs` from a manifest under
  ``task.data_root``, split into training and validation pairs by a seeded
  draw (``task.val_fraction``) or given a validation manifest of its own;
* batches: by a point budget (``task.batching=budget``, the default) through
  :class:`~pointforge.data.batching.PointBudgetBatchSampler`: at most
  ``task.max_points`` sparse points and at most ``data.micro_batch`` clouds
  per device and micro-batch, the same number of batches on every rank, each
  optimizer step ``accumulation`` consecutive batches. ``task.batching=count``
  leaves batching to the engine (a fixed number of clouds per batch), which
  exists for comparison;
* loss: Chamfer distance between the predicted and the dense cloud, the mean
  over the clouds of the micro-batch, always computed in float32 (outside
  autocast: nearest-neighbour search in bfloat16 would pick wrong neighbours),
  plus ``task.surface_weight`` times the point-to-plane distance to the dense
  cloud (:func:`pointforge.nn.losses.point_to_plane_distance`; 0 turns it off);
* evaluation: per-cloud mean Chamfer on the validation pairs in normalised
  units (``val_chamfer``, what ``best.pt`` is chosen by), in source units
  (``val_chamfer_src``: squared metres for metric lidar; a pair's normalised
  Chamfer times its scale squared) and the Chamfer of the sparse input itself
  (``val_chamfer_input``: what doing nothing scores).

Synthetic data. With ``task.synthetic.pairs > 0`` a missing ``data_root`` is
filled with that many synthetic lidar-like pairs before training
(:func:`ensure_synthetic_pairs`). Every rank calls it at once; an exclusive
``flock`` on a lock file beside ``data_root`` lets one build the set in a
temporary folder and rename it into place while the others wait and then find
it. No collective is involved (the engine has not started one yet), so this
also works when the ranks are separate single processes sharing a folder.
The lock needs a filesystem where ``flock`` works across the processes that
share it (local disks do; some network filesystems do not).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from pointforge.data.batching import PairBatch, PointBudgetBatchSampler, collate_pairs
from pointforge.data.pairs.dataset import UpsamplingPairs
from pointforge.data.pairs.manifest import PairEntry, read_manifest
from pointforge.data.pairs.scenes import spread_sizes, write_synthetic_pairs
from pointforge.errors import ConfigError, DataError
from pointforge.flock import exclusive_lock
from pointforge.nn.losses import chamfer_distance, point_to_plane_distance
from pointforge.nn.upsampler import PRESETS, NodeShuffleUpsampler, UpsamplerConfig, training_step_bytes
from pointforge.train.logs import get_logger
from pointforge.train.task import EvalContext, StepContext, Task

__all__ = [
    "UpsamplingConfig",
    "ModelOverrides",
    "SyntheticPairsSection",
    "UpsamplerTask",
    "ensure_synthetic_pairs",
    "model_config",
    "select_clouds",
    "budget_groups",
]

log = get_logger("tasks.upsampling")

SYNTHETIC_STAMP = "synthetic.json"


@dataclass
class ModelOverrides:
    """Settings that replace the preset's (null: keep the preset's value)."""

    ratio: Optional[int] = None
    k: Optional[int] = None
    hidden: Optional[int] = None
    feature_layers: Optional[int] = None
    heads: Optional[int] = None
    concat: Optional[bool] = None
    beta: Optional[bool] = None
    dropout: Optional[float] = None
    # Where the children start: on their parent (input) or on its local plane (plane; pointforge.nn.upsampler).
    start: Optional[Literal["input", "plane"]] = None
    # A learned gate on each child's offset from its start (pointforge.nn.upsampler).
    gate: Optional[bool] = None
    # The plane start from the point and its plane_k - 1 nearest neighbours only (pointforge.nn.upsampler).
    plane_k: Optional[int] = None


@dataclass
class SyntheticPairsSection:
    """A synthetic pair set written into ``data_root`` when it is missing (``pairs: 0`` = never)."""

    pairs: int = 0
    min_points: int = 1_000  # sparse points of the smallest pair
    max_points: int = 50_000  # ... and of the largest; sizes between spread log-uniformly
    seed: int = 0
    format: Literal["npy", "ply", "las", "laz"] = "npy"

    def validate(self, prefix: str) -> None:
        if self.pairs < 0:
            raise ConfigError(f"config key '{prefix}.pairs' must be 0 (off) or more, got {self.pairs}")
        if self.pairs and not 1 <= self.min_points <= self.max_points:
            raise ConfigError(
                f"config keys '{prefix}.min_points' and '{prefix}.max_points' need 1 <= min_points <= max_points, "
                f"got {self.min_points} and {self.max_points}"
            )


@dataclass
class UpsamplingConfig:
    """The ``task:`` section of an upsampler config."""

    preset: Literal["tiny", "small", "paper"] = "tiny"
    model: ModelOverrides = field(default_factory=ModelOverrides)
    # Data: a manifest (CSV or JSON, pointforge.data.pairs) relative to data_root unless absolute.
    data_root: str = "data/upsampler/synthetic"
    manifest: str = "pairs.csv"
    # Validation: a manifest of its own, or else a seeded share of the pairs (0: no validation).
    val_manifest: Optional[str] = None
    val_fraction: float = 0.1
    split_seed: int = 0
    normalization: Literal["spacing", "extent"] = "spacing"
    graph_cache: Literal["memory", "disk"] = "memory"
    # Batching: budget = at most max_points sparse points (and data.micro_batch clouds) per device
    # and micro-batch; count = the engine's fixed data.micro_batch clouds per batch.
    batching: Literal["budget", "count"] = "budget"
    max_points: int = 20_000
    # Weight of the point-to-plane term (pointforge.nn.losses.point_to_plane_distance) added to Chamfer; 0: off.
    surface_weight: float = 0.0
    synthetic: SyntheticPairsSection = field(default_factory=SyntheticPairsSection)

    def validate(self, prefix: str) -> None:
        if self.max_points < 1:
            raise ConfigError(f"config key '{prefix}.max_points' must be at least 1, got {self.max_points}")
        if not self.surface_weight >= 0:
            raise ConfigError(f"config key '{prefix}.surface_weight' must be 0 or more, got {self.surface_weight}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"config key '{prefix}.val_fraction' must lie in [0, 1), got {self.val_fraction}")
        if self.val_manifest is not None and self.val_fraction > 0:
            raise ConfigError(
                f"config keys '{prefix}.val_manifest' and '{prefix}.val_fraction' both choose validation pairs; "
                f"set {prefix}.val_fraction=0 when giving a validation manifest"
            )
        if self.synthetic.pairs and self.manifest != "pairs.csv":
            raise ConfigError(
                f"config key '{prefix}.manifest' must stay pairs.csv when {prefix}.synthetic.pairs writes the set; "
                f"set {prefix}.synthetic.pairs=0 to use a manifest of your own"
            )
        try:
            model_config(self)  # bad model settings fail while the config loads, not at build time
        except ConfigError as err:
            raise ConfigError(f"config section '{prefix}.model' (preset {self.preset}): {err}") from None


def model_config(cfg: UpsamplingConfig) -> UpsamplerConfig:
    """The network's settings: the preset with the non-null ``model`` overrides applied."""
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items() if v is not None}
    if cfg.preset not in PRESETS:
        raise ConfigError(f"unknown upsampler preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}")
    return UpsamplerConfig.preset(cfg.preset, **overrides)


# --------------------------------------------------------------------------- synthetic data


def _synthetic_recipe(section: SyntheticPairsSection) -> dict[str, Any]:
    sizes = spread_sizes(section.pairs, section.min_points, section.max_points, seed=section.seed)
    return {
        "pairs": section.pairs, "min_points": section.min_points, "max_points": section.max_points,
        "seed": section.seed, "format": section.format, "sizes": [int(s) for s in sizes],
    }  # fmt: skip


def ensure_synthetic_pairs(data_root: str | os.PathLike, section: SyntheticPairsSection) -> bool:
    """Write ``section.pairs`` synthetic pairs into ``data_root`` unless it already holds a pair set.

    Safe when many processes call it at once (module docs). Returns True if this
    call wrote the set. A ``data_root`` that holds a synthetic set made with
    other settings is refused rather than silently reused.
    """
    root = Path(data_root)
    recipe = _synthetic_recipe(section)
    lock = root.parent / f".{root.name}.lock"
    with exclusive_lock(lock):
        if root.exists():
            _check_existing(root, recipe)
            return False
        # Holding the lock, any temporary folder of this name is a crashed builder's leftover.
        for stale in root.parent.glob(f".{root.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        log.info(
            f"writing {section.pairs} synthetic pairs ({section.min_points}..{section.max_points} points) to {root}"
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent))
        try:
            write_synthetic_pairs(tmp, recipe["sizes"], seed=section.seed, fmt=section.format)
            (tmp / SYNTHETIC_STAMP).write_text(json.dumps(recipe, indent=2) + "\n")
            os.replace(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


def _check_existing(root: Path, recipe: dict[str, Any]) -> None:
    stamp = root / SYNTHETIC_STAMP
    if stamp.is_file():
        try:
            made = json.loads(stamp.read_text())
        except (OSError, json.JSONDecodeError):
            made = None
        if made != recipe:
            raise ConfigError(
                f"{root} holds a synthetic pair set made with other task.synthetic settings; "
                "delete the folder to have it rewritten, or point task.data_root elsewhere"
            )
    elif not (root / "pairs.csv").is_file():
        raise DataError(
            f"{root} exists but holds no pairs.csv; task.synthetic only fills a missing folder: "
            "remove it, or point task.data_root at a pair set"
        )


# --------------------------------------------------------------------------- batches


def select_clouds(batch: PairBatch, start: int, stop: int) -> PairBatch:
    """Clouds ``start .. stop-1`` of a collated batch, as a batch of their own."""
    if not 0 <= start < stop <= batch.num_clouds:
        raise IndexError(f"cannot select clouds {start}..{stop - 1} of a batch of {batch.num_clouds}")
    s0, s1 = int(batch.sparse_ptr[start]), int(batch.sparse_ptr[stop])
    d0, d1 = int(batch.dense_ptr[start]), int(batch.dense_ptr[stop])
    edge_cloud = batch.sparse_batch[batch.edge_index[1]]
    keep = (edge_cloud >= start) & (edge_cloud < stop)
    return PairBatch(
        sparse=batch.sparse[s0:s1],
        sparse_batch=batch.sparse_batch[s0:s1] - start,
        sparse_ptr=batch.sparse_ptr[start : stop + 1] - s0,
        dense=batch.dense[d0:d1],
        dense_batch=batch.dense_batch[d0:d1] - start,
        dense_ptr=batch.dense_ptr[start : stop + 1] - d0,
        edge_index=batch.edge_index[:, keep] - s0,
        center=batch.center[start:stop],
        scale=batch.scale[start:stop],
        pair_ids=list(batch.pair_ids[start:stop]),
        indices=batch.indices[start:stop],
    )


def budget_groups(sizes: list[int], max_points: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` runs of clouds holding at most ``max_points`` points (a bigger cloud alone)."""
    groups, start, load = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and load + size > max_points:
            groups.append((start, i))
            start, load = i, 0
        load += size
    if sizes:
        groups.append((start, len(sizes)))
    return groups


# --------------------------------------------------------------------------- the task


class UpsamplerTask(Task):
    name = "upsampler"
    Config = UpsamplingConfig
    best_metric = "val_chamfer"
    best_mode = "min"

    def configure(self, cfg: UpsamplingConfig) -> None:
        self._cfg = cfg

    def build_model(self, cfg: UpsamplingConfig) -> nn.Module:
        return NodeShuffleUpsampler(model_config(cfg))

    def build_datasets(self, cfg: UpsamplingConfig) -> tuple[Dataset, Dataset | None]:
        root = Path(cfg.data_root)
        if cfg.synthetic.pairs > 0:
            ensure_synthetic_pairs(root, cfg.synthetic)
        manifest = _under(root, cfg.manifest)
        if not manifest.is_file():
            hint = (
                " (or set task.synthetic.pairs to have a synthetic set written there)"
                if cfg.synthetic.pairs == 0
                else ""
            )
            raise DataError(f"no pair manifest at {manifest}; set task.data_root / task.manifest to your pairs{hint}")
        entries = read_manifest(manifest)
        if cfg.val_manifest is not None:
            train_entries, val_entries = entries, read_manifest(_under(root, cfg.val_manifest))
        else:
            train_entries, val_entries = _split(entries, cfg.val_fraction, cfg.split_seed)
        k = model_config(cfg).k

        def make(items: list) -> UpsamplingPairs:
            return UpsamplingPairs(items, k=k, normalization=cfg.normalization, graph_cache=cfg.graph_cache)

        return make(train_entries), (make(val_entries) if val_entries else None)

    def batch_sampler(self, dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch):
        if self._cfg.batching == "count":
            return None
        return PointBudgetBatchSampler(
            dataset.sparse_sizes,
            self._cfg.max_points,
            max_clouds=micro_batch,
            world_size=world_size,
            rank=rank,
            accumulation=accumulation,
            seed=seed,
            epoch=epoch,
        )

    def collate(self, items: list[Any]) -> PairBatch:
        return collate_pairs(items)

    def training_step(self, model: nn.Module, batch: PairBatch, ctx: StepContext):
        out = model(batch.sparse, batch.sparse_batch, batch.edge_index)
        with torch.autocast(ctx.device.type, enabled=False):
            loss = chamfer_distance(
                out.points.float(), batch.dense, out.batch, batch.dense_batch, num_clouds=batch.num_clouds
            )
            extras = {"clouds": float(batch.num_clouds), "points": float(batch.num_points)}
            if self._cfg.surface_weight > 0:
                surface = point_to_plane_distance(
                    out.points.float(),
                    batch.dense,
                    out.batch,
                    batch.dense_batch,
                    num_clouds=batch.num_clouds,
                )
                loss = loss + self._cfg.surface_weight * surface
                extras["surface"] = float(surface.detach())
        return loss, extras

    def memory_estimate(self, cfg: UpsamplingConfig, micro_batch: int) -> int | None:
        """With budget batching, a float32 training step on ``max_points`` sparse points
        (:func:`~pointforge.nn.upsampler.training_step_bytes`), whatever the micro-batch's
        cloud count; with count batching the points per batch are unknown: None."""
        if cfg.batching != "budget":
            return None
        config = model_config(cfg)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in NodeShuffleUpsampler(config).parameters())
        return training_step_bytes(config, cfg.max_points, parameters=parameters)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        # Per cloud, summed: Chamfer normalised, in source units, the input's own; point-to-plane, the input's own.
        totals = torch.zeros(5, dtype=torch.float64)
        clouds = 0
        for batch in loader:
            sizes = batch.sparse_ptr.diff().tolist()
            for start, stop in budget_groups(sizes, self._cfg.max_points):
                part = select_clouds(batch, start, stop).to(ctx.device)
                out = model(part.sparse, part.sparse_batch, part.edge_index)
                with torch.autocast(ctx.device.type, enabled=False):
                    pred, pred_surface = _scores(out.points.float(), out.batch, part)
                    base, base_surface = _scores(part.sparse, part.sparse_batch, part)
                scale2 = part.scale.double().cpu() ** 2
                totals += torch.stack(
                    [pred.sum(), (pred * scale2).sum(), base.sum(), pred_surface.sum(), base_surface.sum()]
                )
                clouds += part.num_clouds
        if not clouds:
            return {}
        cd, cd_src, cd_input, surface, surface_input = (totals / clouds).tolist()
        return {
            "val_chamfer": cd,
            "val_chamfer_src": cd_src,
            "val_chamfer_input": cd_input,
            "val_surface": surface,
            "val_surface_input": surface_input,
        }


def _scores(points: Tensor, batch: Tensor, part: PairBatch) -> tuple[Tensor, Tensor]:
    """Per cloud (float64, CPU): Chamfer to the dense cloud, and the point-to-plane distance to it."""
    n = part.num_clouds
    chamfer = chamfer_distance(points, part.dense, batch, part.dense_batch, num_clouds=n, reduction="none")
    surface = torch.stack(
        [point_to_plane_distance(points[batch == i], part.dense[part.dense_batch == i]) for i in range(n)]
    )
    return chamfer.double().cpu(), surface.double().cpu()


def _under(root: Path, name: str) -> Path:
    path = Path(name)
    return path if path.is_absolute() else root / path


def _split(entries: list[PairEntry], fraction: float, seed: int) -> tuple[list[PairEntry], list[PairEntry]]:
    """A seeded train/validation split by pair, the same on every rank and run."""
    if fraction <= 0:
        return entries, []
    if len(entries) < 2:
        raise DataError(
            f"task.val_fraction={fraction} needs at least 2 pairs to split, the manifest lists {len(entries)}; "
            "add pairs, give task.val_manifest, or set task.val_fraction=0"
        )
    n_val = min(len(entries) - 1, max(1, int(round(fraction * len(entries)))))
    order = np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 0x5B17])).permutation(len(entries))
    val = set(order[:n_val].tolist())
    return [e for i, e in enumerate(entries) if i not in val], [e for i, e in enumerate(entries) if i in val]
