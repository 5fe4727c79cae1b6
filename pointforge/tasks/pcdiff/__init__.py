"""The ``pcdiff`` task: PCDiff (PVCNN2 + Gaussian diffusion) completing a defective skull's point cloud.

``task`` (the Task: data, model, loss, evaluation), ``config`` (the ``task``
section's dataclasses and the schedule and sampler they build), ``frame`` (the
local frame around the implant and its atlas estimate) and ``placement``
(whether a model learned where the implant goes).
"""
