"""PCDiff: skull completion by point cloud diffusion, as a training task and a Python API.

The task (``pointforge train pcdiff --config pointforge/configs/pcdiff/{tiny,small,paper}.yaml``):

* model: a :class:`~pointforge.nn.pvcnn.PVCNN2` preset (``task.model``);
* data: a prepared dataset (``task.data_root``, written by ``pointforge data
  prepare``), served by :class:`~pointforge.tasks.pcdiff.dataset.PCDiffDataset`:
  ``n_skull`` defective-skull points then ``n_implant`` implant points, normalised. With
  ``task.synthetic`` set and no dataset at ``data_root`` yet, a synthetic
  SkullBreak-style dataset is synthesised and prepared there once
  (:func:`~pointforge.tasks.pcdiff.dataset.ensure_prepared_dataset`);
* loss: ε-prediction MSE on the implant points only; the skull points stay
  clean and condition the network (:func:`~pointforge.nn.diffusion.loss.diffusion_loss`);
* evaluation (rank 0 only: it samples): each validation case's implant is
  sampled with a fast sampler (``task.eval``) through the one denoising loop
  (:func:`~pointforge.nn.diffusion.pipeline.denoise`) and compared with the true implant
  points by Chamfer distance, in normalised units (``val_chamfer``, what
  ``best.pt`` is chosen by) and in millimetres via the case's scale and the
  prepared metadata's voxel spacing (``val_chamfer_mm2``, ``val_mean_dist_mm``).

The config's dataclasses are :mod:`pointforge.tasks.pcdiff.config`. Loading a
trained network lives a layer up (:mod:`pointforge.inference.pcdiff`), sampling
implant proposals from it in the implant product
(:mod:`pointforge.implant.proposals`); converting upstream checkpoints is
:mod:`pointforge.ops.pcdiff_import`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from pointforge.atomic import atomic_writer
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.nn.diffusion.conditioning import MarkConditioning
from pointforge.nn.diffusion.loss import diffusion_loss
from pointforge.nn.diffusion.pipeline import denoise
from pointforge.nn.knn import knn
from pointforge.nn.losses import chamfer_distance
from pointforge.nn.pvcnn import PVCNN2
from pointforge.nn.pvcnn_config import get_preset
from pointforge.nn.pvcnn_memory import training_step_bytes
from pointforge.tasks.pcdiff.config import PCDiffConfig, build_eval_sampler, build_schedule
from pointforge.tasks.pcdiff.dataset import HALF_EXTENT, PCDiffDataset, ensure_prepared_dataset
from pointforge.tasks.pcdiff.frame import FramedDenoiser, build_atlas
from pointforge.tasks.pcdiff.placement import condition_use, placement_metrics
from pointforge.train.logs import get_logger
from pointforge.train.task import EvalContext, StepContext, Task

__all__ = ["PCDiffTask", "build_model", "implant_distances"]

log = get_logger("pcdiff")


def build_model(cfg: PCDiffConfig, atlas: torch.Tensor | None = None) -> nn.Module:
    """The network ``cfg`` describes: the PVCNN2 preset, with the condition mark and the
    frame's atlas when configured (the upstream configuration is the bare PVCNN2)."""
    preset = get_preset(cfg.model)
    checkpointed = cfg.checkpoint_activations
    if cfg.condition_mark:
        net: nn.Module = MarkConditioning(
            PVCNN2(replace(preset, extra_feature_channels=1), checkpoint_activations=checkpointed),
            cfg.points[1],
        )
    else:
        net = PVCNN2(preset, checkpoint_activations=checkpointed)
    return net if cfg.frame is None else FramedDenoiser(net, atlas)


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
    b, p, _ = pred.shape
    q = true.shape[1]
    pred, true = pred.float(), true.float()
    pred_batch = torch.arange(b, device=pred.device).repeat_interleave(p)
    true_batch = torch.arange(b, device=pred.device).repeat_interleave(q)
    out = {
        "chamfer": chamfer_distance(
            pred.reshape(-1, 3), true.reshape(-1, 3), pred_batch, true_batch, num_clouds=b, reduction="none"
        )
    }
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


class PCDiffTask(Task):
    """PCDiff training: PVCNN2 + Gaussian diffusion on the implant points (module docs)."""

    name = "pcdiff"
    Config = PCDiffConfig
    eval_on = "rank0"
    best_metric = "val_chamfer"
    best_mode = "min"
    compile_refusal = "PVCNN2's index searches break its graph and Inductor fails recompiling it (docs/benchmarks.md)"

    def configure(self, cfg: PCDiffConfig) -> None:
        self.cfg = cfg
        self.schedule = build_schedule(cfg.diffusion)
        self.sampler = build_eval_sampler(cfg.eval, self.schedule, cfg.prior)

    def build_model(self, cfg: PCDiffConfig) -> nn.Module:
        # A training run configures the task first and builds the frame's atlas from
        # its data; a bare build (loading a checkpoint) reads no data: the atlas
        # buffer then takes the checkpoint's.
        return build_model(cfg, self._atlas(cfg) if getattr(self, "cfg", None) is not None else None)

    def _atlas(self, cfg: PCDiffConfig) -> torch.Tensor | None:
        """The frame's atlas from the training split (built once per task object)."""
        if cfg.frame is None:
            return None
        if getattr(self, "_atlas_cache", None) is None:
            prepared = PreparedDataset(ensure_prepared_dataset(cfg.data_root, cfg.synthetic))
            self._atlas_cache = build_atlas(prepared, cfg.train_split, cfg.frame.atlas_points)
        return self._atlas_cache

    def build_datasets(self, cfg: PCDiffConfig) -> tuple[Dataset, Dataset | None]:
        root = ensure_prepared_dataset(cfg.data_root, cfg.synthetic)
        prepared = PreparedDataset(root)
        common: dict[str, Any] = dict(
            n_skull=cfg.n_skull, n_implant=cfg.n_implant, half_extent=HALF_EXTENT, frame=cfg.frame, prior=cfg.prior
        )
        train = PCDiffDataset(
            prepared,
            cfg.train_split,
            rotate_degrees=cfg.rotate_degrees,
            seed=cfg.data_seed,
            mirror=cfg.mirror,
            **common,
        )
        val = None
        if cfg.val_split is not None and prepared.split(cfg.val_split):
            val = PCDiffDataset(
                prepared,
                cfg.val_split,
                max_cases=cfg.eval.max_cases,
                seed=cfg.data_seed + 1,
                atlas=self._atlas(cfg),
                **common,
            )
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
        t = None
        if self.cfg.prior is not None:  # sampling starts at the prior's step: train on the steps it uses
            t = torch.randint(0, self.cfg.prior.start_step + 1, (x0.shape[0],)).to(x0.device)
        loss = diffusion_loss(
            model,
            self.schedule,
            x0,
            self.cfg.points[1],
            t=t,
            weighting=self.cfg.diffusion.loss_weighting,
        )
        return loss

    def memory_estimate(self, cfg: PCDiffConfig, micro_batch: int) -> int:
        """A float32 training step of the PVCNN2 preset on ``n_skull + n_implant`` points
        (:func:`~pointforge.nn.pvcnn_memory.training_step_bytes`: activations fitted to
        measured peaks, plus gradients and Adam's moments; lower with ``task.checkpoint_activations``,
        fitted the same way); AMP only lowers it."""
        preset = replace(get_preset(cfg.model), extra_feature_channels=1 if cfg.condition_mark else 0)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in PVCNN2(preset).parameters())
        return training_step_bytes(
            preset,
            sum(cfg.points),
            micro_batch,
            parameters=parameters,
            checkpointed=cfg.checkpoint_activations,
        )

    def memory_savers(self, cfg: PCDiffConfig) -> dict[str, PCDiffConfig]:
        """Activation checkpointing, where it is off: the same training in less memory."""
        if cfg.checkpoint_activations:
            return {}
        return {"task.checkpoint_activations=true": replace(cfg, checkpoint_activations=True)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        cfg = self.cfg
        n_implant = cfg.points[1]
        generator = torch.Generator().manual_seed(cfg.eval.seed)  # CPU: the same noise on any device
        sums: dict[str, float] = {}
        count = 0
        saved: dict[str, list] = {"case_id": [], "pred_voxel": [], "true_voxel": []}
        clean: list[torch.Tensor] = []
        started = time.perf_counter()
        for batch in loader:
            points = batch["points"].to(ctx.device)
            n_cond = points.shape[1] - n_implant
            cond = points[:, :n_cond].transpose(1, 2)
            init = batch["prior"].to(ctx.device).transpose(1, 2) if "prior" in batch else None
            out = denoise(model, self.sampler, cond, n_implant, generator=generator, init=init)
            pred = out[:, :, n_cond:].transpose(1, 2).float()
            true = points[:, n_cond:].float()
            scale = batch["scale"].to(ctx.device)
            spacing = batch["spacing"].to(ctx.device)
            found = implant_distances(pred, true, scale=scale, spacing=spacing)
            mm = scale.reshape(-1, 1, 1) * spacing.reshape(-1, 1, 3)
            found.update(
                {f"{k}_mm" if k != "spread_ratio" else k: v for k, v in placement_metrics(pred * mm, true * mm).items()}
            )
            clean.append(points.transpose(1, 2).cpu())
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
        if count >= 2:
            x0 = torch.cat(clean).to(ctx.device)
            used = condition_use(
                model, self.schedule, x0, n_implant, generator=torch.Generator().manual_seed(cfg.eval.seed)
            )
            metrics.update({f"val_{k}": v for k, v in used.items() if k.startswith("cond_use")})
        return metrics


def _save_samples(path: Path, saved: Mapping[str, list]) -> None:
    with atomic_writer(path, "wb") as handle:
        np.savez(
            handle,
            case_id=np.asarray(saved["case_id"]),
            pred_voxel=np.concatenate(saved["pred_voxel"]),
            true_voxel=np.concatenate(saved["true_voxel"]),
        )
