"""Load a trained upsampler: :func:`load_upsampler` → :class:`LoadedUpsampler` (network, task config, normalisation).

The checkpoint is read with the engine's one loader
(:func:`pointforge.train.checkpoint.format.load_checkpoint`) and the model rebuilt from
the config stored inside it, so the network, its graph's ``k`` and the
normalisation it was trained with come with the weights. Which weights follows
the one EMA rule of :mod:`pointforge.inference.loading`. Running it on clouds
and files is :mod:`pointforge.upsampling.pipeline`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union, cast

import torch

from pointforge.inference.loading import LoadedModel, Weights, load_trained
from pointforge.nn.upsampler import NodeShuffleUpsampler

__all__ = ["LoadedUpsampler", "load_upsampler"]

TASK_NAME = "upsampler"


@dataclass
class LoadedUpsampler(LoadedModel):
    """A trained upsampler (:class:`~pointforge.inference.loading.LoadedModel`); ``config`` is the task section."""

    @property
    def normalization(self) -> str:
        return self.config.normalization

    @property
    def ratio(self) -> int:
        return int(cast(NodeShuffleUpsampler, self.model).config.ratio)


def load_upsampler(
    ckpt: Union[str, os.PathLike], device: str | torch.device = "auto", *, weights: Weights = "auto"
) -> LoadedUpsampler:
    """The upsampler in a checkpoint written by ``pointforge train upsampler``, in eval mode on ``device``.

    CheckpointError for a missing or damaged file and for a checkpoint of another task.
    """
    return load_trained(LoadedUpsampler, ckpt, TASK_NAME, device, weights)
