"""The Task contract, re-exported where task modules and users have always found it.

It lives in :mod:`pointforge.train.task` (the train layer owns the contract
its engine runs, as torchtitan keeps its train spec beside the trainer), so
the engine needs nothing from this package; tasks keep writing
``from pointforge.tasks.base import Task``.
"""

from __future__ import annotations

from pointforge.train.task import EvalContext, NoConfig, StepContext, StepOutput, Task, split_step_output

__all__ = ["Task", "StepContext", "EvalContext", "StepOutput", "NoConfig", "split_step_output"]
