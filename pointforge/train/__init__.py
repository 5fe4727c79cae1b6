"""The task-agnostic training engine: the loop, checkpoints, distributed runs, the Task contract.

Import from the modules themselves: :mod:`pointforge.train.engine` (``train``),
:mod:`pointforge.train.plan` (``dry_run_plan``), :mod:`pointforge.train.task`
(the Task contract), :mod:`pointforge.train.checkpoint`,
:mod:`pointforge.train.schedule`, :mod:`pointforge.train.state`,
:mod:`pointforge.train.tracking` and :mod:`pointforge.train.dist`.
"""
