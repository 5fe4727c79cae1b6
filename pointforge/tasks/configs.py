"""Training configs by task name: the registry lookup above :mod:`pointforge.config`'s generic loader.

``config.py`` sits below every network and task, so it cannot ask the
registry which dataclass a task's ``task`` section is; this module can, and
hands that class to :func:`pointforge.config.resolve_train_config`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from pointforge.config import TrainConfig, resolve_train_config, stored_task_name
from pointforge.tasks import get_task

__all__ = ["load_train_config", "train_config_from_dict"]


def load_train_config(
    task_name: str,
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    data: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """Resolve a training config for ``task_name``: preset file (or ``data``), then overrides."""
    task = get_task(task_name)
    return resolve_train_config(task.name, task.Config, path, overrides, data=data)


def train_config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Rebuild a resolved config (from a checkpoint or a run dir's config.yaml)."""
    return load_train_config(stored_task_name(data), data=data)
