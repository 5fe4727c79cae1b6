"""The ``pcdiff`` task: PCDiff (PVCNN2 + Gaussian diffusion) completing a defective skull's point cloud.

``task`` (the Task: config, data, model, loss, evaluation), ``frame`` (the
local frame around the implant and its atlas estimate) and ``placement``
(whether a model learned where the implant goes).
"""
