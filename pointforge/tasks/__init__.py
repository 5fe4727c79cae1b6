"""Task registry: ``get_task("toy")`` → a :class:`~pointforge.tasks.base.Task` instance.

Built-in tasks are listed by module path and imported only when asked for,
so asking for the toy task does not import the diffusion stack. A third-party
package can add tasks through the ``pointforge.tasks`` entry-point group
(``name = "package.module:TaskClass"``) or by calling :func:`register_task`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from typing import Callable

from pointforge.errors import ConfigError
from pointforge.tasks.base import EvalContext, StepContext, StepOutput, Task

__all__ = ["Task", "StepContext", "EvalContext", "StepOutput", "get_task", "register_task", "available_tasks"]

# name -> "module:Class". Tasks whose module is not part of this install are
# reported as unavailable instead of breaking the registry.
_BUILTIN: dict[str, str] = {
    "toy": "pointforge.tasks.toy:ToyTask",
    "pcdiff": "pointforge.tasks.completion:CompletionTask",
    "voxelizer": "pointforge.tasks.voxelization:VoxelizationTask",
    "upsampler": "pointforge.tasks.upsampling:UpsamplingTask",
}
_REGISTERED: dict[str, Callable[[], Task]] = {}


def register_task(factory: type[Task] | Callable[[], Task], name: str | None = None):
    """Register a task class (usable as a decorator); ``name`` defaults to ``factory.name``."""
    key = name or getattr(factory, "name", "")
    if not key:
        raise ValueError("a task needs a name: set the class attribute `name` or pass name=")
    _REGISTERED[key] = factory
    return factory


def _entry_points() -> dict[str, str]:
    try:
        from importlib.metadata import entry_points

        return {ep.name: ep.value for ep in entry_points(group="pointforge.tasks")}
    except Exception:
        return {}


def _module_exists(target: str) -> bool:
    module = target.split(":", 1)[0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_tasks() -> list[str]:
    names = set(_REGISTERED)
    names |= {n for n, target in {**_BUILTIN, **_entry_points()}.items() if _module_exists(target)}
    return sorted(names)


def _load(target: str) -> Callable[[], Task]:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def get_task(name: str | Task) -> Task:
    """The task registered as ``name`` (a Task instance passes through)."""
    if isinstance(name, Task):
        return name
    if name in _REGISTERED:
        return _instantiate(_REGISTERED[name], name)
    target = _BUILTIN.get(name) or _entry_points().get(name)
    if target is None:
        choices = available_tasks()
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown task '{name}'; {hint}available tasks: {', '.join(choices)}")
    if not _module_exists(target):
        raise ConfigError(f"task '{name}' is not available in this install ({target.split(':')[0]} is missing); available tasks: {', '.join(available_tasks())}")
    return _instantiate(_load(target), name)


def _instantiate(factory: Callable[[], Task], name: str) -> Task:
    task = factory()
    if not isinstance(task, Task):
        raise TypeError(f"task '{name}' must be a pointforge.tasks.Task, got {type(task).__name__}")
    return task
