"""The tasks, and the registry that finds them by name: ``get_task("toy")`` → a Task instance.

The contract a task fulfils lives one layer down, in
:mod:`pointforge.train.task`; the engine takes a :class:`Task` instance and
never looks a name up, so the registry sits here, beside the tasks it lists.
Built-in tasks are imported only when asked for (asking for the toy task
does not import the diffusion stack). A third-party package adds tasks
through the ``pointforge.tasks`` entry-point group
(``name = "package.module:TaskClass"``) or by calling :func:`register_task`.
"""

from __future__ import annotations

import difflib
from importlib.metadata import EntryPoint, entry_points
from typing import Callable

from pointforge.errors import ConfigError
from pointforge.train.task import Task

__all__ = ["get_task", "register_task", "available_tasks"]

TaskFactory = Callable[[], Task]


def _toy() -> TaskFactory:
    from pointforge.tasks.toy import ToyTask

    return ToyTask


def _pcdiff() -> TaskFactory:
    from pointforge.tasks.pcdiff.task import PCDiffTask

    return PCDiffTask


def _pcdiff_student() -> TaskFactory:
    from pointforge.tasks.pcdiff.student import PCDiffStudentTask

    return PCDiffStudentTask


def _voxelizer() -> TaskFactory:
    from pointforge.tasks.voxelizer import VoxelizerTask

    return VoxelizerTask


def _upsampler() -> TaskFactory:
    from pointforge.tasks.upsampler import UpsamplerTask

    return UpsamplerTask


def _unet() -> TaskFactory:
    from pointforge.tasks.unet import UNetTask

    return UNetTask


# name -> a function importing the task's class: each module is imported only when its task is asked for.
_BUILTIN: dict[str, Callable[[], TaskFactory]] = {
    "toy": _toy,
    "pcdiff": _pcdiff,
    "pcdiff_student": _pcdiff_student,
    "voxelizer": _voxelizer,
    "upsampler": _upsampler,
    "unet": _unet,
}
_REGISTERED: dict[str, TaskFactory] = {}


def register_task(factory: TaskFactory, name: str | None = None) -> TaskFactory:
    """Register a task class (usable as a decorator); ``name`` defaults to ``factory.name``."""
    key = name or getattr(factory, "name", "")
    if not key:
        raise ValueError("a task needs a name: set the class attribute `name` or pass name=")
    _REGISTERED[key] = factory
    return factory


def _entry_points() -> dict[str, EntryPoint]:
    try:
        return {ep.name: ep for ep in entry_points(group="pointforge.tasks")}
    except Exception:  # noqa: BLE001 - broken metadata of another package must not break the registry
        return {}


def available_tasks() -> list[str]:
    return sorted(set(_REGISTERED) | set(_BUILTIN) | set(_entry_points()))


def get_task(name: str) -> Task:
    """A new instance of the task registered as ``name``."""
    if name in _REGISTERED:
        return _instantiate(_REGISTERED[name], name)
    if name in _BUILTIN:
        return _instantiate(_BUILTIN[name](), name)
    entry = _entry_points().get(name)
    if entry is None:
        choices = available_tasks()
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown task '{name}'; {hint}available tasks: {', '.join(choices)}")
    try:
        factory = entry.load()
    except ImportError as err:
        raise ConfigError(
            f"task '{name}' is not available in this install ({entry.value}: {err}); "
            f"available tasks: {', '.join(available_tasks())}"
        ) from None
    return _instantiate(factory, name)


def _instantiate(factory: TaskFactory, name: str) -> Task:
    task = factory()
    if not isinstance(task, Task):
        raise TypeError(f"task '{name}' must be a pointforge.train.task.Task, got {type(task).__name__}")
    return task
