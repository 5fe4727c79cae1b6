"""The task-agnostic training engine.

Public entry points (imported lazily, so ``import pointforge.train`` is cheap):

- :func:`train` / :class:`TrainResult` (``engine``); :func:`dry_run_plan` / :class:`RunPlan` (``plan``)
- :class:`Task` / :func:`get_task` / :func:`register_task` (``task``: the contract and registry)
- :class:`TrainState` (``state``: progress and best metric, a checkpoint's ``progress``)
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
    "dry_run_plan": "plan",
    "TrainResult": "engine",
    "RunPlan": "plan",
    "Task": "task",
    "get_task": "task",
    "register_task": "task",
    "available_tasks": "task",
    "TrainState": "state",
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
