"""Training configs by task name: the registry lookup above :mod:`pointforge.config`'s generic loader.

``config.py`` sits below every network and task, so it cannot ask the
registry which dataclass a task's ``task`` section is; this module can, and
hands that class to :func:`pointforge.config.training.resolve_train_config`.

A config is a YAML file or the name of a preset shipped with the package
(``pointforge/configs/<task>/<name>.yaml``: ``tiny`` for CI, ``small`` for a
CPU, ``demo``, ``paper`` for GPUs), so ``--config paper`` works from any
folder and from an installed wheel.
"""

from __future__ import annotations

import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from pointforge.config.training import TrainConfig, resolve_train_config, stored_task_name
from pointforge.errors import ConfigError
from pointforge.tasks import get_task

__all__ = ["load_train_config", "train_config_from_dict", "preset_names", "resolve_config_path"]


def _preset_folder(task_name: str) -> Path:
    return Path(str(resources.files("pointforge") / "configs" / task_name))


def preset_names(task_name: str) -> list[str]:
    """The presets shipped for ``task_name`` (``[]`` for a task without any)."""
    folder = _preset_folder(task_name)
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def resolve_config_path(task_name: str, config: str | os.PathLike) -> Path:
    """``config`` as a file: an existing path as it is, a bare preset name as the packaged file."""
    path = Path(config)
    if path.is_file() or path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        return path  # a path: load_yaml names it if it is missing
    preset = _preset_folder(task_name) / f"{path.name}.yaml"
    if preset.is_file():
        return preset
    names = preset_names(task_name)
    close = difflib.get_close_matches(path.name, names, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(
        f"--config {config}: no such file and no preset of that name for task '{task_name}'; {hint}"
        f"presets: {', '.join(names) or 'none'}; or give a YAML file"
    )


def load_train_config(
    task_name: str,
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    data: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """Resolve a training config for ``task_name``: a YAML file or preset name (or ``data``), then overrides."""
    task = get_task(task_name)
    if path is not None and data is None:
        path = resolve_config_path(task.name, path)
    return resolve_train_config(task.name, task.Config, path, overrides, data=data)


def train_config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Rebuild a resolved config (from a checkpoint or a run dir's config.yaml)."""
    return load_train_config(stored_task_name(data), data=data)
