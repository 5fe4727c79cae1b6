"""Load a trained volumetric U-Net: :func:`load_unet` → :class:`LoadedUNet`.

Running it on a scan (resample onto its cube, predict, back onto the scan's
own grid) is the implant product's :mod:`pointforge.implant.unet`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pointforge.inference.loading import LoadedModel, Weights, load_trained

__all__ = ["LoadedUNet", "load_unet"]


@dataclass
class LoadedUNet(LoadedModel):
    """A trained U-Net (:class:`~pointforge.inference.loading.LoadedModel`).

    ``model`` is MONAI's ``UNet`` (one channel in, one logit channel out),
    ``config`` the task's section: its ``grid`` and ``margin_mm`` say how a
    scan is put on the network's cube.
    """


def load_unet(
    checkpoint_path: str | os.PathLike, device: str | torch.device = "cpu", *, weights: Weights = "auto"
) -> LoadedUNet:
    """A trained U-Net from a checkpoint written by ``pointforge train unet``, in eval mode on ``device``.

    ``weights`` follows the one EMA rule of :mod:`pointforge.inference.loading`.
    Raises :class:`CheckpointError` for a missing, corrupt or non-U-Net checkpoint.
    """
    return load_trained(LoadedUNet, checkpoint_path, "unet", device, weights)
