"""Task registry: ``get_task("toy")`` → a :class:`~pointforge.train.task.Task` instance.

The registry lives with the contract in :mod:`pointforge.train.task`, so the
engine finds tasks without importing this package; it is re-exported here
where users have always found it. Built-in tasks are listed there by module
path and imported only when asked for, so asking for the toy task does not
import the diffusion stack. A third-party package can add tasks through the
``pointforge.tasks`` entry-point group (``name = "package.module:TaskClass"``)
or by calling :func:`register_task`.
"""

from __future__ import annotations

from pointforge.train.task import EvalContext, StepContext, StepOutput, Task, available_tasks, get_task, register_task

__all__ = ["Task", "StepContext", "EvalContext", "StepOutput", "get_task", "register_task", "available_tasks"]
