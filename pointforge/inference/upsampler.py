"""Use a trained upsampler: load a checkpoint, densify points or a point cloud file.

::

    from pointforge.upsample_api import load_upsampler, upsample_points, upsample_file

    upsampler = load_upsampler("runs/upsampler/small/checkpoints/best.pt", device="auto")
    dense = upsample_points(upsampler, sparse_xyz)          # float64 [r·N, 3], same frame as the input
    upsample_file("tile.laz", "tile_dense.laz", upsampler)   # keeps the tile's scales, offsets and CRS

The checkpoint is read with the engine's one loader
(:func:`pointforge.train.checkpoint.load_checkpoint`) and the model rebuilt from
the config stored inside it (:func:`pointforge.config.train_config_from_dict`),
so the network, its graph's ``k`` and the normalisation it was trained with
come with the weights. The EMA weights are used when the run kept and
evaluated them.

Coordinates: a cloud is normalised exactly as the training pairs were (centre
and scale from the sparse cloud itself), run through the network and mapped
back in float64, so the output lies in the input's own frame (georeferenced
metres stay georeferenced metres). Written files keep the input's storage
precision (float32 stays float32); a LAS/LAZ output takes the input's scales,
offsets, point format, version and coordinate-reference records when the input
is LAS/LAZ too (the new points are quantised to those scales, which is what LAS
does), and millimetres around the data otherwise. Only coordinates are written:
the new points have no intensity, classification or colour.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

from pointforge.data.pointio import LasGeometry, PointCloud, point_format, read_points, write_points
from pointforge.errors import CheckpointError, DataError, DeviceError
from pointforge.nn.upsampler import NodeShuffleUpsampler, upsample_cloud

__all__ = ["TrainedUpsampler", "UpsampleResult", "resolve_device", "load_upsampler", "upsample_points", "upsample_file"]

TASK_NAME = "upsampler"


@dataclass
class TrainedUpsampler:
    """A network with what it was trained with: the normalisation mode and the device it sits on."""

    model: NodeShuffleUpsampler
    normalization: str
    device: torch.device
    source: str = ""

    @property
    def ratio(self) -> int:
        return int(self.model.config.ratio)


@dataclass
class UpsampleResult:
    input: Path
    output: Path
    points_in: int
    points_out: int
    seconds: float


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` (the first GPU if there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; DeviceError otherwise."""
    if isinstance(device, torch.device):
        text = str(device)
    else:
        text = (device or "auto").strip().lower()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index = 0
        if text != "cuda":
            try:
                index = int(text.split(":", 1)[1])
            except ValueError:
                raise DeviceError(f"device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
        if index >= count:
            seen = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
            raise DeviceError(f"device {text} is not available (visible GPUs: {seen}); use --device cpu or auto")
        return torch.device("cuda", index)
    raise DeviceError(f"device {device!r} is not a device; use auto, cpu, cuda or cuda:N")


def load_upsampler(ckpt: Union[str, Path], device: str | torch.device = "auto") -> TrainedUpsampler:
    """The upsampler in a checkpoint written by ``pointforge train upsampler``, in eval mode on ``device``.

    CheckpointError for a missing or damaged file and for a checkpoint of another task.
    """
    from pointforge.config import train_config_from_dict
    from pointforge.errors import ConfigError
    from pointforge.tasks import get_task
    from pointforge.train.checkpoint import is_pointforge_checkpoint, load_checkpoint, load_model_state, model_weights

    target = resolve_device(device)
    path = Path(ckpt)
    state = load_checkpoint(path)
    if not is_pointforge_checkpoint(state) or not isinstance(state.get("config"), dict):
        raise CheckpointError(
            f"{path} is not a pointforge training checkpoint (no task or config inside); "
            "give a checkpoint written by pointforge train upsampler"
        )
    if state.get("task") != TASK_NAME:
        raise CheckpointError(
            f"{path} is a checkpoint of task '{state.get('task')}', not of the upsampler; "
            "give one written by pointforge train upsampler (runs/upsampler/.../checkpoints/best.pt)"
        )
    try:
        cfg = train_config_from_dict(state["config"])
    except ConfigError as err:
        raise CheckpointError(f"{path}: its stored config no longer loads ({err})") from None
    model = get_task(TASK_NAME).build_model(cfg.task)
    use_ema = bool(cfg.train.eval_ema and state.get("ema") is not None)
    load_model_state(model, model_weights(state, use_ema=use_ema))
    model.to(target).eval()
    return TrainedUpsampler(model=model, normalization=cfg.task.normalization, device=target, source=str(path))


def upsample_points(
    model: Union[TrainedUpsampler, NodeShuffleUpsampler],
    xyz: np.ndarray,
    *,
    normalization: str = "spacing",
    device: str | torch.device | None = None,
) -> np.ndarray:
    """Densify one cloud: ``xyz [N, 3]`` in, float64 ``[r·N, 3]`` out, in the input's frame.

    ``model`` is what :func:`load_upsampler` returns (its normalisation and
    device are used) or a bare network (then ``normalization`` and ``device``,
    default the model's own, apply).
    """
    if isinstance(model, TrainedUpsampler):
        net, normalization, where = model.model, model.normalization, model.device if device is None else resolve_device(device)
    elif isinstance(model, NodeShuffleUpsampler):
        net = model
        where = resolve_device(device) if device is not None else next(net.parameters()).device
    else:
        raise TypeError(f"upsample_points needs a TrainedUpsampler or NodeShuffleUpsampler, got {type(model).__name__}")
    points = np.asarray(xyz)
    if points.ndim != 2 or points.shape[1] != 3 or len(points) == 0:
        raise DataError(f"points to upsample must be a non-empty [N, 3] array, got shape {points.shape}")
    if not np.isfinite(points).all():
        raise DataError("points to upsample hold NaN or infinite coordinates; clean them first")
    net.to(where)
    return upsample_cloud(net, points, normalization=normalization, device=where)


def upsample_file(
    input: Union[str, Path],
    output: Union[str, Path],
    model: Union[TrainedUpsampler, str, Path],
    *,
    device: str | torch.device = "auto",
) -> UpsampleResult:
    """Read ``input`` (npy/ply/las/laz), densify it, write ``output`` (any of those, atomically).

    ``model``: a loaded upsampler or a checkpoint path. Everything a user can
    get wrong (paths, suffixes, the checkpoint) is checked before the network runs.
    """
    src, dst = Path(input), Path(output)
    point_format(src)
    out_format = point_format(dst)
    if not src.is_file():
        raise DataError(f"{src}: no such point cloud file; check the path")
    if dst.exists() and dst.resolve() == src.resolve():
        raise DataError(f"{dst}: the output would overwrite the input; choose another --out path")
    if dst.is_dir():
        raise DataError(f"{dst} is a folder; give --out a file name ending in .npy, .ply, .las or .laz")
    upsampler = model if isinstance(model, TrainedUpsampler) else load_upsampler(model, device)
    start = time.perf_counter()
    cloud = read_points(src)
    if len(cloud) == 0:
        raise DataError(f"{src}: point cloud is empty; nothing to upsample")
    dense = upsample_points(upsampler, cloud.xyz)
    las = None
    if out_format in ("las", "laz"):
        las = cloud.las or LasGeometry.around(dense)
    write_points(dst, PointCloud(xyz=dense, dtype=cloud.dtype, las=las))
    return UpsampleResult(input=src, output=dst, points_in=len(cloud), points_out=len(dense), seconds=time.perf_counter() - start)
