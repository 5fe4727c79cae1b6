"""Iterative furthest point sampling with the tie rule of upstream's CUDA kernel.

The plain loop runs over the samples and is vectorised over points and batch (torch on any
device; NumPy on CPU, the same steps with the same IEEE arithmetic, only faster per step).
On CPU, where Numba is installed, a compiled loop that skips the points a sample cannot
reach (:mod:`.fps_compiled`, chosen by :mod:`pointforge.nn.backends`) gives the same indices,
much faster at the paper's sizes.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError
from pointforge.nn import backends
from pointforge.nn.pvops.common import FAR, expect_coords
from pointforge.nn.pvops.grouping import gather

__all__ = ["furthest_point_sample", "furthest_point_sample_indices"]

# Upstream's FPS kernel runs 512 threads per batch element; each thread scans the indices
# congruent to its id, and the block reduction prefers lower thread ids, so ties go to the
# smallest index modulo 512 first.
_FPS_THREADS = 512


def _fps_scan_order(n: int, device: torch.device) -> Tensor | None:
    """Point order in which "first maximum wins" reproduces the kernel's tie rule (None = identity)."""
    if n <= _FPS_THREADS:
        return None
    k = torch.arange(n, device=device)
    return torch.argsort((k % _FPS_THREADS) * n + k)


def _fps_torch(pts: Tensor, num_samples: int) -> Tensor:
    b, _, n = pts.shape
    best = torch.full((b, n), FAR, dtype=pts.dtype, device=pts.device)
    diff = torch.empty_like(pts)
    dist = torch.empty((b, n), dtype=pts.dtype, device=pts.device)
    # Samples-major so that each step writes one contiguous row through ``out=``.
    picked = torch.zeros((num_samples, b), dtype=torch.long, device=pts.device)
    for j in range(1, num_samples):
        last = picked[j - 1].view(b, 1, 1).expand(b, 3, 1)
        torch.sub(pts, torch.gather(pts, 2, last), out=diff)
        diff.mul_(diff)
        torch.add(diff[:, 0], diff[:, 1], out=dist)
        dist.add_(diff[:, 2])
        torch.minimum(best, dist, out=best)
        torch.argmax(best, dim=1, out=picked[j])
    return picked.t()


def _fps_numpy(pts: Tensor, num_samples: int) -> Tensor:
    # The same steps as _fps_torch. On CPU the per-step cost is dispatch overhead plus a
    # slow torch.argmax; NumPy's ufuncs and SIMD argmax make a step ~4x cheaper, and the
    # IEEE float arithmetic (separate subtract, multiply, add; no fused multiply-add) is
    # the same, so the result is identical.
    a = pts.numpy()
    b, _, n = a.shape
    best = np.full((b, n), FAR, dtype=a.dtype)
    diff = np.empty_like(a)
    dist = np.empty((b, n), dtype=a.dtype)
    picked = np.zeros((num_samples, b), dtype=np.int64)
    rows = np.arange(b)
    for j in range(1, num_samples):
        np.subtract(a, a[rows, :, picked[j - 1]][:, :, None], out=diff)
        np.multiply(diff, diff, out=diff)
        np.add(diff[:, 0], diff[:, 1], out=dist)
        np.add(dist, diff[:, 2], out=dist)
        np.minimum(best, dist, out=best)
        picked[j] = best.argmax(axis=1)
    return torch.from_numpy(np.ascontiguousarray(picked.T))


_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
_COMPILED_DTYPES = (torch.float32, torch.float64)
METHODS = ("auto", "torch", "numpy")


def _compiled_unsuited(pts: Tensor) -> str | None:
    # Finite coordinates only: with NaN or infinity the plain loop's distances are NaN,
    # which np.minimum spreads and argmax prefers; the compiled loop does not mimic that.
    if pts.device.type == "cpu" and pts.dtype in _COMPILED_DTYPES and bool(torch.isfinite(pts).all()):
        return None
    return f"a CPU float32/64 tensor of finite coordinates, got {pts.dtype} on {pts.device}"


def _pick_loop(pts: Tensor, method: str, backend: str) -> tuple[str, ModuleType | None]:
    """The loop that runs (``"torch"``, ``"numpy"`` or ``"compiled"``) and the compiled module for the last."""
    if method not in METHODS:
        raise DataError(f"furthest_point_sample: method must be one of {', '.join(METHODS)}, got {method!r}")
    if method != "auto" and backend == "compiled":
        raise ConfigError(
            f"furthest_point_sample: method={method!r} picks a plain loop; use backend='plain' or 'auto' with it"
        )
    on_cpu = pts.device.type == "cpu"
    if method == "numpy" and not (on_cpu and pts.dtype in _NUMPY_DTYPES):
        raise DataError(
            f"furthest_point_sample: the numpy loop needs a CPU float16/32/64 tensor, got {pts.dtype} on {pts.device}"
        )
    if method != "auto":
        return method, None
    compiled = backends.choose("fps", backend, pts.shape[2], lambda: _compiled_unsuited(pts))
    if compiled is not None:
        return "compiled", compiled
    return ("numpy" if on_cpu and pts.dtype in _NUMPY_DTYPES else "torch"), None


def furthest_point_sample_indices(
    coords: Tensor, num_samples: int, backend: str = "auto", method: str = "auto"
) -> Tensor:
    """Indices ``[B, num_samples]`` of iterative furthest point sampling.

    Starts at index 0; each step takes the point whose squared distance to the chosen set
    is largest (distances start at 1e10); ties go to the smallest index modulo 512, then
    to the smallest index. Once every point is chosen the remaining picks are index 0, as
    in the kernel. The loop runs over the samples and is vectorised over points and batch.

    ``backend`` (:mod:`pointforge.nn.backends`): ``"compiled"`` is a loop compiled with Numba
    that skips points (CPU float32/64 tensors of finite coordinates; same result), ``"plain"``
    the loop below, ``"auto"`` the compiled loop from its table's size up where it applies.
    ``method`` picks the plain loop: ``"torch"`` (any device), ``"numpy"`` (CPU tensors; the
    same steps, faster) or ``"auto"`` (NumPy for CPU tensors it can hold, else torch).
    """
    expect_coords("furthest_point_sample", "coords", coords)
    backends.check_backend("furthest_point_sample", backend)
    num_samples = int(num_samples)
    b, _, n = coords.shape
    if num_samples < 1 or n < 1:
        raise DataError(
            f"furthest_point_sample: need at least one point and one sample, got {n} points, {num_samples} samples"
        )
    pts = coords.detach()
    order = _fps_scan_order(n, pts.device)
    if order is not None:
        pts = pts.index_select(2, order)
    pts = pts.contiguous()
    loop, compiled = _pick_loop(pts, method, backend)
    if compiled is not None:
        picked = torch.from_numpy(compiled.bucketed_fps(pts.numpy(), num_samples, threads=torch.get_num_threads()))
    else:
        picked = {"torch": _fps_torch, "numpy": _fps_numpy}[loop](pts, num_samples)
    if order is not None:
        picked = order[picked]
    return picked.contiguous()


def furthest_point_sample(coords: Tensor, num_samples: int) -> tuple[Tensor, Tensor]:
    """``(centers_coords [B, 3, M], indices [B, M])``; the coordinates keep their gradient path."""
    indices = furthest_point_sample_indices(coords, num_samples)
    return gather(coords, indices), indices
