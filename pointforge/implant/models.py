"""The implant pipeline's trained models, loaded once and reused across cases: :func:`load_models`.

Each loader (:mod:`pointforge.inference`) checks that its checkpoint was written
by its own task; a checkpoint of another of the pipeline's tasks, given to the
wrong flag, is one CheckpointError naming the flag it belongs to. The loader
already read which task wrote it, so the file is not read again to say so.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from pointforge.devices import resolve_device
from pointforge.errors import CheckpointError, UserError
from pointforge.inference.loading import WrongTaskCheckpoint
from pointforge.inference.pcdiff import LoadedPCDiff, load_pcdiff
from pointforge.inference.upsampler import load_upsampler
from pointforge.inference.voxelizer import load_voxelizer

__all__ = ["FLAGS", "Models", "load_models", "named_flag"]

# The command-line flag that takes each task's checkpoint.
FLAGS = {
    "pcdiff": "--pcdiff",
    "pcdiff_student": "--pcdiff",
    "voxelizer": "--voxelizer",
    "upsampler": "--upsample",
    "unet": "--unet",
}


@dataclass
class Models:
    """Everything loaded once and reused across cases."""

    pcdiff: LoadedPCDiff
    voxelizer: torch.nn.Module
    voxelizer_config: Any  # the voxelizer run's TrainConfig (LoadedVoxelizer.run_config)
    device: torch.device
    pcdiff_path: str
    voxelizer_path: str
    upsampler: Any = None  # LoadedUpsampler or None
    upsampler_path: str | None = None
    voxelizer_frame: Any = None  # VoxelizerFrame (LoadedVoxelizer.frame) or None: the volume's own cube

    def describe(self) -> dict:
        cfg = self.pcdiff.config
        out = {
            "pcdiff": {
                "checkpoint": self.pcdiff_path,
                "preset": cfg.model,
                "n_skull": cfg.n_skull,
                "n_implant": cfg.n_implant,
                "timesteps": cfg.diffusion.timesteps,
                "weights": self.pcdiff.weights,
            },
            "voxelizer": {
                "checkpoint": self.voxelizer_path,
                "preset": self.voxelizer_config.task.preset,
                "n_points": self.voxelizer_config.task.n_points,
            },
        }
        student = self.pcdiff.student
        if student is not None:
            out["pcdiff"]["student"] = {
                "calls": student.calls,
                "teacher": student.teacher,
                "teacher_sampler": student.teacher_sampler,
                "teacher_steps": student.teacher_steps,
            }
        if self.upsampler is not None:
            out["upsampler"] = {"checkpoint": self.upsampler_path, "ratio": self.upsampler.ratio}
        return out


def load_models(
    pcdiff: str | os.PathLike,
    voxelizer: str | os.PathLike,
    *,
    device: str = "auto",
    upsample: str | os.PathLike | None = None,
) -> Models:
    """Load the PCDiff and voxelizer checkpoints (and optionally an upsampler) on ``device``.

    A voxelizer checkpoint given as ``--pcdiff`` (or the reverse) is one clear
    CheckpointError naming the file, the task it belongs to and its flag.
    """
    dev = resolve_device(device)
    for task, path in (("pcdiff", pcdiff), ("voxelizer", voxelizer), ("upsampler", upsample)):
        if path is not None and not Path(path).is_file():
            raise UserError(f"{path}: no such file; give a checkpoint written by `pointforge train {task}`")
    with named_flag(pcdiff, "pcdiff"):
        loaded = load_pcdiff(pcdiff, dev)
    with named_flag(voxelizer, "voxelizer"):
        vox = load_voxelizer(voxelizer, dev)
    ups = None
    if upsample is not None:
        with named_flag(upsample, "upsampler"):
            ups = load_upsampler(upsample, dev)
    return Models(
        pcdiff=loaded,
        voxelizer=vox.model,
        voxelizer_config=vox.run_config,
        device=dev,
        pcdiff_path=str(pcdiff),
        voxelizer_path=str(voxelizer),
        upsampler=ups,
        upsampler_path=None if upsample is None else str(upsample),
        voxelizer_frame=vox.frame,
    )


@contextmanager
def named_flag(path: str | os.PathLike, task: str) -> Iterator[None]:
    """A checkpoint of another of the pipeline's tasks, given in the wrong place: name the flag it belongs to."""
    try:
        yield
    except WrongTaskCheckpoint as err:
        written_by = err.written_by
        if written_by is None or written_by not in FLAGS:
            raise
        raise CheckpointError(
            f"{path} is a {written_by} checkpoint, given as {FLAGS[task]}; give it as {FLAGS[written_by]}, "
            f"and as {FLAGS[task]} a checkpoint written by `pointforge train {task}`"
        ) from None
