"""The task-agnostic training engine: the loop and its parts, checkpoints, distributed runs, the Task contract.

Import from the modules themselves: :mod:`pointforge.train.engine` (``train``),
:mod:`pointforge.train.run_plan` (``dry_run_plan``), :mod:`pointforge.train.task`
(the Task contract), :mod:`pointforge.train.preflight` (the checks that can
refuse a run), :mod:`pointforge.train.checkpoint.format` (the file format) and
:mod:`pointforge.train.checkpoint.manager` (resume and save),
:mod:`pointforge.train.step`, :mod:`pointforge.train.evaluation`,
:mod:`pointforge.train.metrics_logger`, :mod:`pointforge.train.schedule`,
:mod:`pointforge.train.state`, :mod:`pointforge.train.logs`, :mod:`pointforge.train.records`,
:mod:`pointforge.train.torchrun` and :mod:`pointforge.train.dist`.
"""
