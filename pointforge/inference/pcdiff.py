"""Loading a trained PCDiff: the network, its noise schedule and its task config from a checkpoint.

:func:`load_pcdiff` reads through the engine's one checkpoint loader, a PCDiff's
checkpoint or its few-step student's (:mod:`pointforge.tasks.pcdiff.student`),
told apart by the task that wrote it. Apart
from the task (:mod:`pointforge.tasks.pcdiff.task`) because using a trained
network is a layer above training one; sampling implant proposals from it is
the implant product's (:mod:`pointforge.implant.proposals`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from pointforge.config.training import TrainConfig
from pointforge.devices import reuse_freed_memory
from pointforge.inference.loading import LoadedModel, Weights, load_trained
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.nn.pvcnn import PVCNN2
from pointforge.tasks.pcdiff.config import build_schedule
from pointforge.tasks.pcdiff.student import PCDiffStudentTask, StudentConfig
from pointforge.tasks.pcdiff.task import PCDiffTask
from pointforge.train.logs import get_logger

__all__ = ["CPU_EVAL_CHUNK_POINTS", "LoadedPCDiff", "load_pcdiff"]

log = get_logger("pcdiff")

# PVCNN2's evaluation budget on CPU (``PVCNN2.eval_chunk_points``): two paper samples per
# pass measured faster than whole batches at batch 5 and 8 on 2 cores (bench/pvcnn_chunks.py,
# docs/experiments/benchmarks.md); with freed blocks kept in the heap (below) the two are
# about as fast, and chunks bound the peak memory. On other devices passes stay whole.
CPU_EVAL_CHUNK_POINTS = 61440


@dataclass
class LoadedPCDiff(LoadedModel):
    """A trained PCDiff (:class:`~pointforge.inference.loading.LoadedModel`) plus its noise schedule.

    ``config`` is the task's :class:`~pointforge.tasks.pcdiff.config.PCDiffConfig`
    (a student's: its teacher's, which says how it conditions and starts).
    ``student``: for a few-step student, its task section (its ``calls``, the
    teacher's sampler it reproduces, ``teacher`` the path it was distilled from);
    None for a PCDiff.
    """

    schedule: NoiseSchedule | None = None
    student: StudentConfig | None = None

    @classmethod
    def extras(cls, cfg: TrainConfig) -> dict[str, Any]:
        if cfg.run.task == PCDiffStudentTask.name:
            teacher = cfg.task.teacher_task
            return {"config": teacher, "schedule": build_schedule(teacher.diffusion), "student": cfg.task}
        return {"schedule": build_schedule(cfg.task.diffusion)}


def load_pcdiff(
    checkpoint_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    *,
    weights: Weights = "auto",
) -> LoadedPCDiff:
    """A trained PCDiff network (eval mode, on ``device``), its noise schedule and task config.

    Reads a pointforge checkpoint of the ``pcdiff`` task (a training run's
    ``best.pt``/``latest.pt``, or ``pointforge ckpt import-pcdiff`` output) or of
    its few-step student (``pcdiff_student``: the result's ``student`` is set, and
    :func:`~pointforge.implant.proposals.proposal_sampler` gives it its own steps)
    through the engine's checkpoint loader; ``weights`` follows the one EMA
    rule of :mod:`pointforge.inference.loading` (the result's ``.weights``
    says which were taken, and it is logged). On CPU the network evaluates in
    chunks of ``CPU_EVAL_CHUNK_POINTS`` points (the same output up to float rounding),
    and the process keeps freed memory in its heap for the next pass
    (:func:`~pointforge.devices.reuse_freed_memory`: no page faults for the same
    temporaries pass after pass, for the rest of the process).
    """
    loaded = load_trained(LoadedPCDiff, checkpoint_path, (PCDiffTask.name, PCDiffStudentTask.name), device, weights)
    if loaded.device.type == "cpu":
        reuse_freed_memory()
        for module in loaded.model.modules():
            if isinstance(module, PVCNN2):
                module.eval_chunk_points = CPU_EVAL_CHUNK_POINTS
    cfg, student = loaded.config, loaded.student
    kind = (
        "PCDiff"
        if student is None
        else (f"a {student.calls}-call PCDiff student of {student.teacher_sampler}-{student.teacher_steps}")
    )
    log.info(
        f"loaded {kind} ({cfg.model} preset, {cfg.n_skull}+{cfg.n_implant} points, T={cfg.diffusion.timesteps}) "
        f"from {loaded.source}: {'EMA' if loaded.weights == 'ema' else 'trained (non-EMA)'} weights, step {loaded.step}"
    )
    return loaded
