"""The ``pcdiff_student`` task: a few-step student distilled from a trained PCDiff.

``pointforge train pcdiff_student --config tiny task.teacher=runs/pcdiff/tiny/checkpoints/best.pt``

Method: direct distillation of the teacher's deterministic sampler (as PSF's
distillation stage, Wu et al., CVPR 2023, and Luhman & Luhman 2021, without a
reflow). For each training item the start is built exactly as generation
builds it (:func:`~pointforge.nn.diffusion.pipeline.denoise`): the condition
(the defective skull's points, framed around the atlas estimate when the
teacher has ``task.frame``) and the atlas estimate's implant points noised to
``prior.start_step`` with fresh noise (pure noise at ``T - 1`` without a
prior). The teacher samples from that start with its sampler
(``teacher_sampler``/``teacher_steps``, DDIM 7 by default, the generate
default) under no_grad; the student, a copy of the teacher's network started
from its weights, samples from the same start in ``calls`` DDIM steps on a
trailing grid (:func:`student_sampler`) with gradients through every call,
and the loss is the mean squared distance of the two outputs, point by point.
Each noise sample maps to the teacher's output for that noise, so proposals
drawn with different noise differ as the teacher's do.

The student's checkpoint holds the teacher's task section (``teacher_task``,
filled in from the teacher's checkpoint when a run starts), so loading it
(:func:`pointforge.inference.pcdiff.load_pcdiff`) needs no teacher; its task
section records the calls and the teacher's sampler it reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import CheckpointError, ConfigError
from pointforge.nn.diffusion.pipeline import denoise
from pointforge.nn.diffusion.samplers.base import Sampler
from pointforge.nn.diffusion.samplers.registry import make_sampler
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.tasks.pcdiff.config import PCDiffConfig, build_schedule
from pointforge.tasks.pcdiff.dataset import HALF_EXTENT, PCDiffDataset, ensure_prepared_dataset
from pointforge.tasks.pcdiff.frame import PriorSection, build_atlas
from pointforge.tasks.pcdiff.task import PCDiffTask, build_model, implant_distances
from pointforge.train.checkpoint.format import (
    is_pointforge_checkpoint,
    load_checkpoint,
    load_model_state,
    model_weights,
)
from pointforge.train.task import EvalContext, StepContext, Task

__all__ = ["StudentConfig", "PCDiffStudentTask", "student_sampler", "teacher_sampler", "read_teacher"]


@dataclass
class StudentConfig:
    """The ``task`` section of a student's training config."""

    teacher: str = ""  # the teacher's checkpoint, written by `pointforge train pcdiff`
    calls: int = 1  # network calls per proposal
    teacher_sampler: Literal["ddim", "dpm++2m"] = "ddim"  # deterministic samplers only: one output per noise
    teacher_steps: int | None = 7  # null: the sampler's default (as `generate --steps`)
    data_root: str | None = None  # null: the teacher's data
    eval_max_cases: int | None = 8  # validation cases (the first in cases.csv order); null = all
    eval_seed: int = 0  # validation noise, the same at every evaluation
    # Filled in from the teacher's checkpoint when a run starts and kept in the student's
    # checkpoints, so a student loads without its teacher; leave it unset.
    teacher_task: PCDiffConfig | None = None

    def validate(self, prefix: str) -> None:
        if not self.teacher:
            raise ConfigError(
                f"config key '{prefix}.teacher' is not set; give the teacher's checkpoint, "
                f"e.g. {prefix}.teacher=runs/pcdiff/tiny/checkpoints/best.pt"
            )
        if isinstance(self.calls, bool) or not 1 <= self.calls <= 4:
            raise ConfigError(f"config key '{prefix}.calls' must be from 1 to 4, got {self.calls}")
        if self.teacher_steps is not None and self.teacher_steps <= self.calls:
            raise ConfigError(
                f"config key '{prefix}.teacher_steps' = {self.teacher_steps} must exceed '{prefix}.calls' = "
                f"{self.calls}: a student distils a longer sampler"
            )
        if self.eval_max_cases is not None and self.eval_max_cases < 1:
            raise ConfigError(f"config key '{prefix}.eval_max_cases' must be at least 1 or null")


def _start(prior: PriorSection | None) -> int | None:
    return prior.start_step if prior is not None else None


def student_sampler(cfg: StudentConfig, schedule: NoiseSchedule, prior: PriorSection | None) -> Sampler:
    """The student's own sampler: deterministic DDIM in ``cfg.calls`` steps on a trailing grid
    from the teacher's start (no call spent at ``t = 0``), the same in training and generation."""
    return make_sampler("ddim", cfg.calls, spacing="trailing", schedule=schedule, start=_start(prior))


def teacher_sampler(cfg: StudentConfig, schedule: NoiseSchedule, prior: PriorSection | None) -> Sampler:
    """The teacher's sampler the student reproduces (``teacher_sampler``, ``teacher_steps``) from the same start."""
    try:
        return make_sampler(cfg.teacher_sampler, cfg.teacher_steps, schedule=schedule, start=_start(prior))
    except ConfigError as err:
        raise ConfigError(f"config key 'task.teacher_steps': {err}") from None


def read_teacher(path: str) -> tuple[PCDiffConfig, dict[str, Any]]:
    """The teacher's task section and weights (EMA when it kept them) from its checkpoint; one-line refusals."""
    from pointforge.tasks.configs import train_config_from_dict  # the registry imports this module

    if not Path(path).is_file():
        raise ConfigError(
            f"task.teacher = {path}: no such file; give a PCDiff checkpoint written by `pointforge train pcdiff`"
        )
    ckpt = load_checkpoint(path)
    written_by = ckpt.get("task") if is_pointforge_checkpoint(ckpt) else None
    if written_by != PCDiffTask.name or not isinstance(ckpt.get("config"), dict):
        what = f"a checkpoint of task '{written_by}'" if written_by else "not a pointforge checkpoint"
        raise CheckpointError(
            f"task.teacher = {path} is {what}, not a PCDiff; give one written by `pointforge train pcdiff`"
        )
    try:
        teacher = train_config_from_dict(ckpt["config"]).task
    except ConfigError as err:
        raise CheckpointError(f"task.teacher = {path} holds a PCDiff config this version cannot read ({err})") from None
    return teacher, model_weights(ckpt, use_ema=True)


class PCDiffStudentTask(Task):
    """A few-step student of a trained PCDiff (module docs)."""

    name = "pcdiff_student"
    Config = StudentConfig
    eval_on = "rank0"
    best_metric = "val_teacher_gap"
    best_mode = "min"
    compile_refusal = PCDiffTask.compile_refusal

    def configure(self, cfg: StudentConfig) -> None:
        teacher, self._teacher_weights = read_teacher(cfg.teacher)
        cfg.teacher_task = teacher  # in place: the engine saves this config in every checkpoint
        self.cfg = cfg
        self.schedule = build_schedule(teacher.diffusion)
        self.student_sampler = student_sampler(cfg, self.schedule, teacher.prior)
        self.teacher_sampler = teacher_sampler(cfg, self.schedule, teacher.prior)
        self._teacher: nn.Module | None = None
        self._atlas: torch.Tensor | None = None

    def build_model(self, cfg: StudentConfig) -> nn.Module:
        teacher = _teacher_task(cfg)
        model = build_model(teacher)  # the atlas buffer (with task.frame) comes with the weights
        if getattr(self, "cfg", None) is not None:  # a training run starts from the teacher's weights
            load_model_state(model, self._teacher_weights)
        return model

    def _data(self, cfg: StudentConfig) -> tuple[PCDiffConfig, PreparedDataset]:
        teacher = _teacher_task(cfg)
        data_root = cfg.data_root or teacher.data_root
        return teacher, PreparedDataset(ensure_prepared_dataset(data_root, teacher.synthetic))

    def build_datasets(self, cfg: StudentConfig) -> tuple[Dataset, Dataset | None]:
        # Conditions and starts as generation makes them: framed around the atlas estimate,
        # with its implant points to start from; no augmentation the sampler never sees.
        teacher, prepared = self._data(cfg)
        atlas = None
        if teacher.frame is not None:
            atlas = build_atlas(prepared, teacher.train_split, teacher.frame.atlas_points)
        common: dict[str, Any] = dict(
            n_skull=teacher.n_skull,
            n_implant=teacher.n_implant,
            half_extent=HALF_EXTENT,
            frame=teacher.frame,
            prior=teacher.prior,
            atlas=atlas,
        )
        train = PCDiffDataset(prepared, teacher.train_split, seed=teacher.data_seed, **common)
        val = None
        if teacher.val_split is not None and prepared.split(teacher.val_split):
            val = PCDiffDataset(
                prepared, teacher.val_split, max_cases=cfg.eval_max_cases, seed=teacher.data_seed + 1, **common
            )
        return train, val

    def batch_sampler(self, dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch):
        set_epoch = getattr(dataset, "set_epoch", None)  # new condition draws every epoch
        if callable(set_epoch):
            set_epoch(epoch)
        return None

    def teacher_on(self, device: torch.device) -> nn.Module:
        """The frozen teacher on ``device``, built once."""
        if self._teacher is None:
            with torch.random.fork_rng(devices=[]):  # its throwaway initial weights must not move the run's stream
                teacher = build_model(_teacher_task(self.cfg))
            load_model_state(teacher, self._teacher_weights)
            self._teacher = teacher.requires_grad_(False).eval()
        return self._teacher.to(device)

    def _sample(self, network: nn.Module, sampler: Sampler, batch: dict, noise: torch.Tensor, *, grad: bool = False):
        """``network``'s generated points ``[B, 3, n_implant]`` under ``sampler`` from the batch's start and ``noise``."""
        n_implant = noise.shape[2]
        cond = batch["points"][:, :-n_implant].transpose(1, 2)
        init = batch["prior"].transpose(1, 2) if "prior" in batch else None
        out = denoise(network, sampler, cond, n_implant, noise=noise, init=init, grad=grad)
        return out[:, :, -n_implant:]

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext):
        points = batch["points"]
        n_implant = _teacher_task(self.cfg).points[1]
        # The global CPU generator: seeded per rank and restored on resume, the same on any device.
        noise = torch.randn(points.shape[0], 3, n_implant).to(device=points.device, dtype=points.dtype)
        target = self._sample(self.teacher_on(points.device), self.teacher_sampler, batch, noise)
        pred = self._sample(model, self.student_sampler, batch, noise, grad=True)
        return (pred.float() - target.float()).square().mean()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, ctx: EvalContext) -> dict[str, float]:
        """``val_teacher_gap``: the student's mean squared distance to the teacher's output for the same noise;
        ``val_teacher_own_gap``: the teacher's own at the student's calls (what distillation must beat);
        ``val_chamfer``, ``val_teacher_chamfer``: each against the true implant (normalised units)."""
        n_implant = _teacher_task(self.cfg).points[1]
        generator = torch.Generator().manual_seed(self.cfg.eval_seed)
        sums: dict[str, float] = {}
        count = 0
        for batch in loader:
            batch = {k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            points = batch["points"]
            noise = torch.randn(points.shape[0], 3, n_implant, generator=generator).to(points)
            teacher = self.teacher_on(ctx.device)
            target = self._sample(teacher, self.teacher_sampler, batch, noise)
            pred = self._sample(model, self.student_sampler, batch, noise)
            own = self._sample(teacher, self.student_sampler, batch, noise)
            true = points[:, -n_implant:].float()
            found = {
                "teacher_gap": (pred - target).square().mean(dim=(1, 2)),
                "teacher_own_gap": (own - target).square().mean(dim=(1, 2)),
                "chamfer": implant_distances(pred.transpose(1, 2), true)["chamfer"],
                "teacher_chamfer": implant_distances(target.transpose(1, 2), true)["chamfer"],
            }
            for name, values in found.items():
                sums[name] = sums.get(name, 0.0) + float(values.sum())
            count += points.shape[0]
        return {f"val_{name}": total / count for name, total in sums.items()} if count else {}


def _teacher_task(cfg: StudentConfig) -> PCDiffConfig:
    if cfg.teacher_task is None:
        raise ConfigError(
            "this student config has no teacher_task: it is filled in from task.teacher when training starts; "
            "load a student from a checkpoint its training wrote"
        )
    return cfg.teacher_task
