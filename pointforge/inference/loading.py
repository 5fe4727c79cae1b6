"""What every trained-model loader shares: the checkpoint checks, the EMA rule, the result's shape.

One rule for the weights, whatever the task: ``weights="auto"`` takes the EMA
weights when the checkpoint has them and the trained weights otherwise;
``"ema"`` insists on EMA (a clear error when the run kept none) and
``"model"`` takes the trained weights. One device resolver
(:func:`pointforge.devices.resolve_device`). One result type,
:class:`LoadedModel`, which each task extends with what sampling needs (the
PCDiff noise schedule, the upsampler's normalisation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from pointforge.config.training import TrainConfig
from pointforge.devices import resolve_device
from pointforge.errors import CheckpointError, ConfigError
from pointforge.tasks import get_task
from pointforge.tasks.configs import train_config_from_dict
from pointforge.train.checkpoint.format import is_pointforge_checkpoint, load_checkpoint, load_model_state

__all__ = [
    "Weights",
    "LoadedModel",
    "WrongTaskCheckpoint",
    "check_weights",
    "open_checkpoint",
    "choose_weights",
    "from_checkpoint",
    "load_trained",
]

Weights = Literal["auto", "ema", "model"]

L = TypeVar("L", bound="LoadedModel")


@dataclass
class LoadedModel:
    """A trained network in eval mode on ``device``, with what it was trained with.

    ``config`` is the task's section of the run config, ``run_config`` the
    whole resolved :class:`~pointforge.config.training.TrainConfig`, ``weights`` which
    weights were loaded (``"ema"`` or ``"model"``), ``source`` the checkpoint.
    """

    model: nn.Module
    config: Any
    run_config: TrainConfig
    weights: str
    device: torch.device
    source: str
    task: str
    step: int | None = None

    @classmethod
    def extras(cls, cfg: TrainConfig) -> dict[str, Any]:
        """A task's further fields (or other values of the common ones), derived from the run config (none here)."""
        return {}


class WrongTaskCheckpoint(CheckpointError):
    """A checkpoint written by another task than the one asked for; ``written_by`` names that task,
    so a caller can say where the file belongs without reading it again."""

    def __init__(self, message: str, written_by: str | None = None):
        super().__init__(message)
        self.written_by = written_by


def _not_ours_hint(path: Path, task: str | None) -> str:
    if task in ("pcdiff", "pcdiff_student"):
        return (
            f"an upstream PCDiff checkpoint must first be converted with `pointforge ckpt import-pcdiff {path} OUT.pt`"
        )
    return f"give one written by `pointforge train {task or 'TASK'}`"


def open_checkpoint(
    path: str | os.PathLike, task: str | tuple[str, ...] | None = None
) -> tuple[dict[str, Any], TrainConfig]:
    """The checkpoint at ``path`` and its resolved config; one CheckpointError if it is not ``task``'s.

    ``task``: a task name or the names a loader takes (PCDiff's: a PCDiff or its
    few-step student); None accepts any task (the generic :func:`pointforge.inference.load`).
    """
    path = Path(path)
    tasks = (task,) if isinstance(task, str) else task
    ckpt = load_checkpoint(path)
    if not is_pointforge_checkpoint(ckpt) or not isinstance(ckpt.get("config"), dict):
        hint = _not_ours_hint(path, tasks[0] if tasks else None)
        raise CheckpointError(f"{path} is not a pointforge training checkpoint; {hint}")
    written_by = ckpt.get("task")
    if tasks is not None and written_by not in tasks:
        names = " or ".join(f"'{name}'" for name in tasks)
        raise WrongTaskCheckpoint(
            f"{path} is a checkpoint of task '{written_by}', not of task {names}; "
            f"give one written by `pointforge train {tasks[0]}` (pointforge.inference.load takes any task's)",
            written_by,
        )
    try:
        cfg = train_config_from_dict(ckpt["config"])
    except ConfigError as err:
        raise CheckpointError(f"{path} holds a {written_by} config this version cannot read ({err})") from None
    return ckpt, cfg


def check_weights(weights: str) -> None:
    if weights not in ("auto", "ema", "model"):
        raise ConfigError(f"weights must be auto, ema or model, got {weights!r}")


def choose_weights(ckpt: dict[str, Any], weights: str, path: str | os.PathLike) -> str:
    """``"ema"`` or ``"model"`` by the one rule (module docs)."""
    check_weights(weights)
    has_ema = ckpt.get("ema") is not None
    if weights == "ema" and not has_ema:
        raise CheckpointError(f"{path} has no EMA weights (the run had train.ema_decay unset); use weights='model'")
    return "ema" if (weights == "ema" or (weights == "auto" and has_ema)) else "model"


def from_checkpoint(
    cls: type[L], ckpt: dict[str, Any], cfg: TrainConfig, path: str | os.PathLike, device: torch.device, weights: str
) -> L:
    """The task's network built from ``cfg``, the chosen weights loaded, in eval mode on ``device``."""
    chosen = choose_weights(ckpt, weights, path)
    model = get_task(cfg.run.task).build_model(cfg.task)
    load_model_state(model, ckpt[chosen])
    model.to(device).eval()
    step = (ckpt.get("progress") or {}).get("global_step")
    fields: dict[str, Any] = dict(
        model=model,
        config=cfg.task,
        run_config=cfg,
        weights=chosen,
        device=device,
        source=str(path),
        task=cfg.run.task,
        step=step,
    )
    fields.update(cls.extras(cfg))  # a task's extras may say what config sampling reads (a student: its teacher's)
    return cls(**fields)


def load_trained(
    cls: type[L],
    path: str | os.PathLike,
    task: str | tuple[str, ...] | None,
    device: str | torch.device,
    weights: str,
) -> L:
    """Check the arguments, read ``path`` (``task``'s checkpoint, any task's for None) and build ``cls``."""
    check_weights(weights)
    dev = resolve_device(device)
    ckpt, cfg = open_checkpoint(path, task)
    return from_checkpoint(cls, ckpt, cfg, path, dev, weights)
