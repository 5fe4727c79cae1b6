"""What the point-voxel operators share: input checks and the kernels' distance arithmetic.

Squared distances are always formed as ``(dx*dx + dy*dy) + dz*dz`` from coordinate
differences, in the dtype of the input, because that is the kernels' arithmetic: the
discrete decisions (who is inside a ball, who is nearest, which point is furthest) and
the 3-NN and trilinear weights then agree bit for bit with the kernels instead of
merely being close.
"""

from __future__ import annotations

from torch import Tensor

from pointforge.errors import DataError

__all__ = ["FAR", "METHODS", "PAIR_BUDGET", "expect_coords", "expect_method", "squared_distance"]

# FPS starts every point's distance to the chosen set at this value; 3-NN clamps its
# squared distances to at most this (so an unfilled slot ends up here).
FAR = 1e10
# Pairs evaluated at once by the chunked paths (bounds temporary memory to ~100 MB).
PAIR_BUDGET = 1 << 22
METHODS = ("auto", "dense", "grid")


def expect_coords(op: str, name: str, coords: Tensor, batch: int | None = None) -> None:
    if not isinstance(coords, Tensor) or coords.dim() != 3 or coords.shape[1] != 3:
        shape = tuple(coords.shape) if isinstance(coords, Tensor) else type(coords).__name__
        raise DataError(f"{op}: {name} must be a [B, 3, N] tensor (channel-first xyz), got {shape}")
    if not coords.is_floating_point():
        raise DataError(f"{op}: {name} must be floating point, got {coords.dtype}; convert it with .float()")
    if batch is not None and coords.shape[0] != batch:
        raise DataError(f"{op}: {name} has batch size {coords.shape[0]}, expected {batch} like the other inputs")


def expect_method(op: str, method: str) -> None:
    if method not in METHODS:
        raise DataError(f"{op}: method must be one of {', '.join(METHODS)}, got {method!r}")


def squared_distance(ax: Tensor, ay: Tensor, az: Tensor, bx: Tensor, by: Tensor, bz: Tensor) -> Tensor:
    """``(ax-bx)^2 + (ay-by)^2 + (az-bz)^2`` in the kernels' order, broadcasting, in place where possible."""
    d = ax - bx
    d.mul_(d)
    t = ay - by
    t.mul_(t)
    d.add_(t)
    t = az - bz
    t.mul_(t)
    return d.add_(t)
