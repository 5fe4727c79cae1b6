"""The task-agnostic training engine.

Public entry points (imported lazily, so ``import pointforge.train`` is cheap):

- :func:`train` / :func:`dry_run_plan` / :class:`TrainResult` / :class:`RunPlan` (``engine``)
- :func:`load_checkpoint`, :func:`save_checkpoint`, :func:`load_model_state`,
  :func:`model_weights`, :func:`find_resume_checkpoint` (``checkpoint``)
- :func:`plan_batches`, :func:`scale_lr` (``schedule``)
- :func:`get_logger` (``tracking``)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "train": "engine",
    "dry_run_plan": "engine",
    "TrainResult": "engine",
    "RunPlan": "engine",
    "TrainingDiverged": "engine",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "save_weights": "checkpoint",
    "load_model_state": "checkpoint",
    "model_weights": "checkpoint",
    "find_resume_checkpoint": "checkpoint",
    "plan_batches": "schedule",
    "scale_lr": "schedule",
    "get_logger": "tracking",
    "DistributedFailure": "dist",
    "RankDivergenceError": "dist",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pointforge.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pointforge.train.{module}"), name)
