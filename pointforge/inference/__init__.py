"""Using trained networks: one way to load any of them, then run them (one layer above the tasks).

::

    import pointforge.inference as inference

    loaded = inference.load("runs/pcdiff/small/checkpoints/best.pt", device="auto")
    loaded.model, loaded.config, loaded.weights   # plus task extras, e.g. loaded.schedule

:func:`load` reads the checkpoint once, sees which task wrote it and builds
that task's result (:class:`~pointforge.inference.pcdiff.LoadedPCDiff`,
:class:`~pointforge.inference.voxelizer.LoadedVoxelizer`,
:class:`~pointforge.inference.upsampler.LoadedUpsampler`,
:class:`~pointforge.inference.unet.LoadedUNet`, or the plain
:class:`~pointforge.inference.loading.LoadedModel` for any other registered
task). The per-task loaders (``load_pcdiff``, ``load_voxelizer``,
``load_upsampler``, ``load_unet``) do the same and insist on their task. All share one EMA
rule (``weights="auto"``: EMA when the checkpoint has it) and one device
resolver (:func:`pointforge.devices.resolve_device`).

Loading lives here rather than beside each task because using a network is
a layer above training it: the products (implant, upsampling), benchmarks and
users need these modules, the engine never does. Running the networks is the
products' job. May import the tasks and every layer below them.
"""

from __future__ import annotations

import os

import torch

from pointforge.devices import resolve_device
from pointforge.inference.loading import LoadedModel, Weights, check_weights, from_checkpoint, open_checkpoint
from pointforge.inference.pcdiff import LoadedPCDiff
from pointforge.inference.unet import LoadedUNet
from pointforge.inference.upsampler import LoadedUpsampler
from pointforge.inference.voxelizer import LoadedVoxelizer

__all__ = ["load"]

# The result type of each task; a task not listed here loads as a plain LoadedModel.
RESULT_TYPES: dict[str, type[LoadedModel]] = {
    "pcdiff": LoadedPCDiff,
    "pcdiff_student": LoadedPCDiff,
    "voxelizer": LoadedVoxelizer,
    "upsampler": LoadedUpsampler,
    "unet": LoadedUNet,
}


def load(
    checkpoint_path: str | os.PathLike, device: str | torch.device = "auto", *, weights: Weights = "auto"
) -> LoadedModel:
    """The trained network in ``checkpoint_path``, whichever task wrote it, in eval mode on ``device``."""
    check_weights(weights)
    dev = resolve_device(device)
    ckpt, cfg = open_checkpoint(checkpoint_path)
    return from_checkpoint(RESULT_TYPES.get(cfg.run.task, LoadedModel), ckpt, cfg, checkpoint_path, dev, weights)
