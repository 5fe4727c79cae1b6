"""Load a trained voxelizer: :func:`load_voxelizer` → :class:`LoadedVoxelizer`.

Running it (completed skull points → indicator field → binary volume → mesh)
is the implant product's :mod:`pointforge.implant.voxelize`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pointforge.config.training import TrainConfig
from pointforge.data.skulls.grids import VoxelizerFrame, training_frame
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import UserError
from pointforge.inference.loading import LoadedModel, Weights, load_trained

__all__ = ["LoadedVoxelizer", "load_voxelizer"]


@dataclass
class LoadedVoxelizer(LoadedModel):
    """A trained voxelizer (:class:`~pointforge.inference.loading.LoadedModel`).

    ``model`` is a :class:`~pointforge.nn.voxelizer.VoxelizerNet` (``model.cfg``
    the network's settings), ``config`` the task's section. ``frame``: the
    cube it was trained in, in millimetres (:class:`~pointforge.data.skulls.grids.VoxelizerFrame`),
    read from its training data's metadata (``task.data_root``), or None where
    that folder is not readable from here.
    """

    frame: VoxelizerFrame | None = None

    @classmethod
    def extras(cls, cfg: TrainConfig) -> dict[str, Any]:
        task = cfg.task
        root = Path(getattr(task, "data_root", "") or "")
        if not (root / "cases.csv").is_file():
            return {"frame": None}
        try:
            return {"frame": training_frame(PreparedDataset(root), getattr(task, "train_split", "train"))}
        except (UserError, OSError, KeyError, TypeError, ValueError):
            return {"frame": None}


def load_voxelizer(
    checkpoint_path: str | os.PathLike, device: str | torch.device = "cpu", *, weights: Weights = "auto"
) -> LoadedVoxelizer:
    """A trained voxelizer from a checkpoint written by ``pointforge train voxelizer``, in eval mode on ``device``.

    ``weights`` follows the one EMA rule of :mod:`pointforge.inference.loading`.
    Raises :class:`CheckpointError` for a missing, corrupt or non-voxelizer checkpoint.
    """
    return load_trained(LoadedVoxelizer, checkpoint_path, "voxelizer", device, weights)
