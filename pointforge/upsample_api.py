"""Moved to :mod:`pointforge.inference.upsampler`, beside the other trained-model loaders; this path keeps working."""

from pointforge.inference.upsampler import (
    LoadedUpsampler,
    TrainedUpsampler,
    UpsampleResult,
    load_upsampler,
    resolve_device,
    upsample_file,
    upsample_points,
)

__all__ = [
    "LoadedUpsampler",
    "TrainedUpsampler",
    "UpsampleResult",
    "resolve_device",
    "load_upsampler",
    "upsample_points",
    "upsample_file",
]
