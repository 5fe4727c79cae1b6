"""What every diffusion module checks and how it draws: argument checks, the work dtype, normal draws.

Shared by the schedule, the loss, the samplers and the loop, so each refuses a
bad argument with the same one-line error and steps in the same precision.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError

__all__ = ["check_real", "check_int", "check_cloud", "check_n_generated", "work_dtype", "standard_normal"]


def check_real(value, what: str) -> float:
    """``value`` as a finite float, or a ConfigError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{what} must be finite, got {value!r}")
    return value


def check_int(value, what: str, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high]``, or a ConfigError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{what} must be {bound}, got {value}")
    return value


def check_cloud(x: Tensor, what: str) -> None:
    """A DataError unless ``x`` is a floating-point ``[B, C, N]`` tensor."""
    if not isinstance(x, Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise DataError(f"{what} must be a [B, C, N] tensor, got {shape}")
    if not x.is_floating_point():
        raise DataError(f"{what} must hold floating-point coordinates, got dtype {x.dtype}")


def check_n_generated(n_generated, num_points: Optional[int] = None) -> int:
    """``n_generated`` as a positive int no larger than ``num_points``."""
    n_generated = check_int(n_generated, "n_generated", 1)
    if num_points is not None and n_generated > num_points:
        raise DataError(f"n_generated={n_generated} exceeds the {num_points} points of the cloud")
    return n_generated


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a cloud of ``dtype`` is stepped in."""
    # Reduced-precision clouds are stepped in float32: 1000 updates in bf16 drift.
    return torch.float64 if dtype == torch.float64 else torch.float32


def standard_normal(shape, like: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """Standard normal values of ``like``'s dtype on ``like``'s device, drawn with ``generator``."""
    # Draw on the generator's device so a CPU generator gives the same numbers
    # whichever device the cloud lives on.
    device = generator.device if generator is not None else like.device
    return torch.randn(shape, generator=generator, device=device, dtype=like.dtype).to(like.device)
