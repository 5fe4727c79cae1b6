"""Iterative furthest point sampling with the tie rule of upstream's CUDA kernel.

The plain loop runs over the samples and is vectorised over points and batch (torch on any
device; NumPy on CPU, the same steps with the same IEEE arithmetic, only faster per step).
On CPU, where Numba is installed, a compiled loop that skips the points a sample cannot
reach (:mod:`.fps_compiled`) gives the same indices, ten times faster at the paper's sizes.
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from pointforge.errors import DataError
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
BACKENDS = ("auto", "torch", "numpy", "numba")
# "auto" takes the compiled loop from this many points up: measured 7-13x faster from
# 10,240 points (bench/fps_compiled.py). Below, NumPy's loop costs milliseconds and a
# process that only ever samples small clouds (the demo's tiny network, 1,792 points)
# never pays Numba's import and first compilation (seconds; about a minute uncached).
COMPILED_MIN_POINTS = 8192


@functools.cache
def _compiled() -> ModuleType | None:
    """The compiled loop's module, imported on first use (Numba's import costs a second); None without Numba."""
    try:
        from pointforge.nn.pvops import fps_compiled
    except ImportError:
        return None
    return fps_compiled


def _fps_compiled(pts: Tensor, num_samples: int) -> Tensor:
    compiled = _compiled()
    if compiled is None:
        raise DataError(
            "furthest_point_sample: the numba backend needs Numba; pip install numba, or use backend='auto'"
        )
    picked = compiled.bucketed_fps(pts.numpy(), num_samples, threads=torch.get_num_threads())
    return torch.from_numpy(picked)


def _pick_backend(pts: Tensor, backend: str) -> str:
    """The backend that runs: ``backend`` itself once it is checked, or what ``"auto"`` stands for here."""
    on_cpu = pts.device.type == "cpu"
    if backend == "numpy" and not (on_cpu and pts.dtype in _NUMPY_DTYPES):
        raise DataError(
            f"furthest_point_sample: the numpy backend needs a CPU float16/32/64 tensor, got {pts.dtype} on {pts.device}"
        )
    # Finite coordinates only: with NaN or infinity the plain loop's distances are NaN,
    # which np.minimum spreads and argmax prefers; the compiled loop does not mimic that.
    compiled_ok = (
        backend in ("auto", "numba") and on_cpu and pts.dtype in _COMPILED_DTYPES and bool(torch.isfinite(pts).all())
    )
    if backend == "numba" and not compiled_ok:
        raise DataError(
            "furthest_point_sample: the numba backend needs a CPU float32/64 tensor of finite coordinates, "
            f"got {pts.dtype} on {pts.device}; use backend='auto'"
        )
    if backend != "auto":
        return backend
    if compiled_ok and pts.shape[2] >= COMPILED_MIN_POINTS and _compiled() is not None:
        return "numba"
    return "numpy" if on_cpu and pts.dtype in _NUMPY_DTYPES else "torch"


def furthest_point_sample_indices(coords: Tensor, num_samples: int, backend: str = "auto") -> Tensor:
    """Indices ``[B, num_samples]`` of iterative furthest point sampling.

    Starts at index 0; each step takes the point whose squared distance to the chosen set
    is largest (distances start at 1e10); ties go to the smallest index modulo 512, then
    to the smallest index. Once every point is chosen the remaining picks are index 0, as
    in the kernel. The loop runs over the samples and is vectorised over points and batch.

    ``backend``: ``"torch"`` (any device), ``"numpy"`` (CPU tensors; same result, faster
    steps), ``"numba"`` (CPU float32/64 tensors of finite coordinates; the compiled loop
    that skips points, same result) or ``"auto"`` (Numba for clouds of at least
    ``COMPILED_MIN_POINTS`` points where it applies and is installed, else NumPy for
    CPU tensors it can hold, else torch).
    """
    expect_coords("furthest_point_sample", "coords", coords)
    if backend not in BACKENDS:
        raise DataError(f"furthest_point_sample: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
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
    run = {"torch": _fps_torch, "numpy": _fps_numpy, "numba": _fps_compiled}[_pick_backend(pts, backend)]
    picked = run(pts, num_samples)
    if order is not None:
        picked = order[picked]
    return picked.contiguous()


def furthest_point_sample(coords: Tensor, num_samples: int) -> tuple[Tensor, Tensor]:
    """``(centers_coords [B, 3, M], indices [B, M])``; the coordinates keep their gradient path."""
    indices = furthest_point_sample_indices(coords, num_samples)
    return gather(coords, indices), indices
