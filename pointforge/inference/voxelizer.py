"""Load a trained voxelizer: :func:`load_voxelizer` → :class:`LoadedVoxelizer`.

Running it (completed skull points → indicator field → binary volume → mesh)
is the implant product's :mod:`pointforge.implant.voxelize`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pointforge.data.skulls.grids import VoxelizerFrame
from pointforge.inference.loading import LoadedModel, Weights, load_trained
from pointforge.nn.voxelizer import VoxelizerNet

__all__ = ["LoadedVoxelizer", "load_voxelizer"]


@dataclass
class LoadedVoxelizer(LoadedModel):
    """A trained voxelizer (:class:`~pointforge.inference.loading.LoadedModel`).

    ``model`` is a :class:`~pointforge.nn.voxelizer.VoxelizerNet` (``model.cfg``
    the network's settings), ``config`` the task's section.
    """

    @property
    def frame(self) -> VoxelizerFrame | None:
        """The cube it was trained in, in millimetres (:class:`~pointforge.data.skulls.grids.VoxelizerFrame`),
        as the model carries it (its frame buffers, saved with its weights); None for a model
        without one (a checkpoint written before the frame existed)."""
        if not isinstance(self.model, VoxelizerNet):
            return None
        found = self.model.frame()
        return None if found is None else VoxelizerFrame(cube_mm=found[0], centre=found[1])


def load_voxelizer(
    checkpoint_path: str | os.PathLike, device: str | torch.device = "cpu", *, weights: Weights = "auto"
) -> LoadedVoxelizer:
    """A trained voxelizer from a checkpoint written by ``pointforge train voxelizer``, in eval mode on ``device``.

    ``weights`` follows the one EMA rule of :mod:`pointforge.inference.loading`.
    Raises :class:`CheckpointError` for a missing, corrupt or non-voxelizer checkpoint.
    """
    return load_trained(LoadedVoxelizer, checkpoint_path, "voxelizer", device, weights)
