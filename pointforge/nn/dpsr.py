"""Differentiable Poisson surface reconstruction (DPSR), as in Shape-as-Points.

Oriented points in the unit cube become an indicator grid in three steps (the grid
and its rasterisation are :mod:`pointforge.nn.dpsr_grid`, the spectral filter and the
torch FFTs :mod:`pointforge.nn.dpsr_spectrum`, the compiled CPU path (ducc0's FFTs and a
forward solve that transforms only the lines holding data) :mod:`pointforge.nn.dpsr_pruned`;
this module is the solve, its backward pass, its memory estimate and the entry points):

1. Rasterise: each normal is splatted onto the 8 surrounding grid nodes with
   trilinear weights. Grid node ``(i, j, k)`` sits at ``(i/r0, j/r1, k/r2)`` and
   the unit cube is one period of a periodic domain, so the upper neighbour of
   the last node is node 0. Axis 0 of the grid is the first coordinate.
2. Solve ``laplace(phi) = div(N)`` spectrally: with ``w = 2*pi*k`` (``k`` the
   integer frequency vector), ``Phi(k) = -i (w . N(k)) G(k) / (-|w|^2 + 1e-6)``,
   ``G(k) = exp(-0.5 * (2 * sigma * |k| / r0)^2)`` a Gaussian smoothing (``r0``
   is used for every axis, as upstream does), and the DC term set to zero.
3. Normalise: subtract the mean of the (trilinearly interpolated) field at the
   input points, then scale by ``-0.5 / |phi[0, 0, 0]|`` so the corner node is
   ``+0.5``: outside positive, inside negative, the surface near 0.

This is the same function as upstream's solver (matched to the reference
fixture), computed differently so that a 512^3 grid fits in a few GiB: real FFTs,
one normal channel in flight at a time, the spectral filter applied slab by slab
in place, and a hand-written backward pass instead of autograd's saved
intermediates. Unlike upstream, coordinates outside ``[0, 1)`` are rejected
rather than silently wrapped into a neighbouring row of the grid.

Two upstream quirks are kept because they define the function: the Gaussian
uses ``r0`` on every axis of a non-cubic grid, and on even grid sizes the
Nyquist term of the derivative survives along the first two axes but cancels
along the last (a consequence of the half-spectrum inverse FFT), so the field is
exactly symmetric under axis permutations only on odd sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor, nn

from pointforge.devices import available_memory_bytes
from pointforge.errors import ConfigError, DataError
from pointforge.nn import backends, dpsr_spectrum
from pointforge.nn.dpsr_grid import (
    DEFAULT_POINT_CHUNK,
    KEEP_CORNERS_UP_TO,
    PointCorners,
    check_oriented_points,
    normalize_resolution,
)
from pointforge.nn.dpsr_spectrum import SLAB_ELEMENTS, Spectrum

__all__ = ["DPSR", "dpsr", "dpsr_memory_bytes", "psr_tanh_mse_loss"]

# Measured slack of a forward+backward pass beyond the tensors counted (FFT plans
# and workspace, allocator rounding): about 40 MB on small grids, ~1% at 512^3.
_FIXED_OVERHEAD = 48 << 20


def _check_sigma(sigma: float) -> float:
    sigma = float(sigma)
    if not math.isfinite(sigma) or sigma < 0:
        raise ConfigError(f"DPSR sigma must be a finite number >= 0, got {sigma}")
    return sigma


# ----------------------------------------------------------------------------
# The solve and its backward pass.


def _raw_solve(corners: PointCorners, normals: Tensor, spectrum: Spectrum, compiled: ModuleType | None) -> Tensor:
    """Unnormalised Poisson solution (*res) of one item (the compiled path's when given)."""
    if compiled is not None:
        return compiled.pruned_raw_solve(corners, normals, spectrum, torch.get_num_threads())
    res = spectrum.res
    grid = torch.zeros(math.prod(res), dtype=normals.dtype, device=normals.device)
    spec = None
    for axis in range(3):
        if axis:
            grid.zero_()
        corners.splat(grid, normals[:, axis])
        part = dpsr_spectrum.rfftn(grid.view(res))
        part.mul_(spectrum.derivative(axis, -1.0))
        if spec is None:
            spec = part
        else:
            spec.add_(part)
        del part
    del grid
    assert spec is not None  # the loop ran for three axes
    spectrum.apply_filter_(spec)
    # A fresh grid: torch's irfftn(out=...) would compute into a temporary and copy.
    return dpsr_spectrum.irfftn_consuming(spec, res)


def _ffts(compiled: ModuleType | None) -> ModuleType:
    """The module whose ``rfftn`` and ``irfftn_consuming`` the backward pass uses."""
    return dpsr_spectrum if compiled is None else compiled


class _DPSRFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, points, normals, res, sigma, shift, scale, chunk, compiled):
        batch = points.shape[0]
        spectrum = Spectrum(res, sigma, points.dtype, points.device)
        out = None
        scales = points.new_ones(batch)
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.corners = []
        for i in range(batch):
            corners = PointCorners(points[i], res, chunk)
            phi = _raw_solve(corners, normals[i], spectrum, compiled)
            if shift:
                at_points, _ = corners.gather(phi.view(-1), False)
                phi.sub_(at_points.mean())
            if scale:
                corner = phi[0, 0, 0].clone()
                if corner.item() == 0.0:
                    raise DataError(
                        f"DPSR item {i}: the field is exactly 0 at the corner node, so it cannot be scaled "
                        "(all normals zero?); give non-zero normals or call with scale=False"
                    )
                # Same rounding as -phi / |corner| * 0.5: scaling by 2 is exact.
                phi.div_(-2.0 * corner.abs())
                scales[i] = corner
            if batch == 1:
                out = phi.unsqueeze(0)
            else:
                if out is None:
                    out = points.new_empty(batch, *res)
                out[i].copy_(phi)
            del phi
            if keep:
                ctx.corners.append(corners)
        ctx.res, ctx.sigma, ctx.shift, ctx.scale, ctx.ffts = res, sigma, shift, scale, _ffts(compiled)
        ctx.save_for_backward(points, normals, out, scales)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        points, normals, out, scales = ctx.saved_tensors
        res, shift, scale = ctx.res, ctx.shift, ctx.scale
        need_points, need_normals = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_points = torch.zeros_like(points) if need_points else None
        grad_normals = torch.zeros_like(normals) if need_normals else None
        if not (need_points or need_normals):
            return None, None, None, None, None, None, None, None
        spectrum = Spectrum(res, ctx.sigma, points.dtype, points.device)
        n = points.shape[1]
        for i in range(points.shape[0]):
            psi, g, corners = out[i], grad_out[i], ctx.corners[i]
            # Undo the normalisation: gradient with respect to the raw solution phi.
            if scale:
                corner = scales[i]
                magnitude, sign = corner.abs(), torch.sign(corner)
                grad_phi = (g * (-0.5 / magnitude)).contiguous()
                # psi depends on the corner through 1/|corner|; sum(g * psi) is
                # formed as a dot product with grad_phi = -g / (2|c|) to avoid a grid temporary.
                g_dot_psi = torch.dot(grad_phi.view(-1), psi.reshape(-1)) * (-2.0 * magnitude)
                grad_phi[0, 0, 0] -= sign / magnitude * g_dot_psi
            else:
                grad_phi = g.clone(memory_format=torch.contiguous_format)
            if shift:
                # phi' = phi - mean_p interp(phi, x_p): the mean's gradient goes back to
                # the grid through the splat of 1/n at every point, and to the points
                # through the field's spatial gradient there.
                grad_mean = -grad_phi.sum()
                corners.splat(grad_phi.view(-1), (grad_mean / n).expand(n))
                if need_points:
                    # The field minus a constant has the same gradient; phi' = -2|c| psi when scaled.
                    factor = -2.0 * scales[i].abs() if scale else 1.0
                    _, spatial = corners.gather(psi.reshape(-1), True)
                    grad_points[i] += spatial * (grad_mean * factor / n)
            # The raw solve is a real periodic convolution of each normal channel; its
            # adjoint multiplies the spectrum by the conjugate factor (+i omega G / lap).
            spec = ctx.ffts.rfftn(grad_phi)
            del grad_phi
            spectrum.apply_filter_(spec)
            for axis in range(3):
                channel = spec * spectrum.derivative(axis, 1.0)
                grad_raster = ctx.ffts.irfftn_consuming(channel, res).view(-1)
                del channel
                values, spatial = corners.gather(grad_raster, need_points)
                del grad_raster
                if need_normals:
                    grad_normals[i, :, axis] = values
                if need_points:
                    grad_points[i] += spatial * normals[i, :, axis, None]
            del spec
        return grad_points, grad_normals, None, None, None, None, None, None


# ----------------------------------------------------------------------------
# Memory budget.


def dpsr_memory_bytes(
    res: int | Sequence[int],
    n_points: int = 0,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
    chunk: int = DEFAULT_POINT_CHUNK,
) -> int:
    """Estimated peak memory in bytes of one :func:`dpsr` call (forward, and backward with ``requires_grad``).

    Counts the output grids; the forward working set (a real grid and two half
    spectra while the normals are transformed; the spectrum, the inverse FFT's
    internal copy of it and the result at the end); the per-point corner tables;
    and with ``requires_grad`` the incoming gradient grids and the backward
    working set (the gradient's spectrum, one channel, the inverse FFT's copy and
    result). The caller's own tensors (points,
    a loss's intermediates) are not included. Measured peaks (bench/dpsr.py)
    stay within a few percent of it at 256^3 and 512^3. The counts are torch.fft's;
    the compiled path's inverse FFTs (ducc0) work in the spectrum itself, so for it the
    backward figure is an upper bound.
    """
    res = normalize_resolution(res)
    item = torch.empty((), dtype=dtype).element_size()
    grid = math.prod(res) * item
    half = res[0] * res[1] * (res[2] // 2 + 1) * 2 * item
    n_points = max(int(n_points), 0)
    # Corner tables: 8 int64 indices, 8 weights, 6 axis weights; 32 more values
    # (weights with their derivatives) once the backward pass needs them.
    per_point = 64 + (14 + (32 if requires_grad else 0)) * item
    kept = n_points if n_points <= KEEP_CORNERS_UP_TO else min(n_points, chunk)
    points = kept * per_point * batch + n_points * 3 * item * (4 if requires_grad else 1)
    filter_slab = min(SLAB_ELEMENTS, half // (2 * item)) * (16 + 2 * item)
    # One batch item is solved at a time; with a batch > 1 its result is then
    # copied into the output.
    forward = (batch - 1) * grid + grid + 2 * half + (grid if batch > 1 else 0)
    if not requires_grad:
        return forward + points + filter_slab
    backward = 2 * batch * grid + grid + 3 * half
    return max(forward, backward) + points + filter_slab + _FIXED_OVERHEAD


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _check_memory(res, n_points, batch, dtype, requires_grad, chunk, limit, device) -> None:
    if limit is not None and math.isinf(limit):
        return
    need = dpsr_memory_bytes(res, n_points, batch, dtype, requires_grad, chunk)
    budget = available_memory_bytes(device) if limit is None else limit
    if need > budget:
        which = "the memory limit" if limit is not None else f"the memory available on {torch.device(device)}"
        raise ConfigError(
            f"DPSR on a {res[0]}x{res[1]}x{res[2]} grid with batch {batch}"
            f"{' and gradients' if requires_grad else ''} needs about {_gib(need)}, more than "
            f"{which} ({_gib(budget)}); lower the DPSR resolution or the batch size, or raise memory_limit"
        )


# ----------------------------------------------------------------------------
# Public entry points.


def _compiled_unsuited(device: torch.device) -> str | None:
    return None if device.type == "cpu" else f"CPU tensors, got them on {device}"


def dpsr(
    points: Tensor,
    normals: Tensor,
    res: int | Sequence[int],
    sigma: float = 2.0,
    *,
    shift: bool = True,
    scale: bool = True,
    memory_limit: float | None = None,
    chunk: int = DEFAULT_POINT_CHUNK,
    backend: str = "auto",
) -> Tensor:
    """Indicator grid (batch, *res) of oriented points (batch, n, 3) in ``[0, 1)``.

    ``sigma`` is the Gaussian smoothing in frequency space (0: none). ``shift``
    and ``scale`` switch the two normalisation steps (both on: mean 0 at the
    points, corner node +0.5, inside negative). ``memory_limit`` in bytes: a solve
    estimated (by :func:`dpsr_memory_bytes`) to need more raises
    :class:`ConfigError` before anything is allocated; ``None`` means the memory
    the device has available now, ``math.inf`` disables the check. ``chunk``
    bounds the points handled at once when splatting. ``backend`` (:mod:`pointforge.nn.backends`):
    ``"plain"`` solves with torch.fft (every device), ``"compiled"`` with the CPU path of
    :mod:`pointforge.nn.dpsr_pruned` (ducc0's FFTs and the pruned solve, compiled with
    Numba; one choice, both or neither), ``"auto"`` with the latter for CPU tensors where
    ducc0 and Numba import. Gradients flow to points and normals.
    """
    res = normalize_resolution(res)
    sigma = _check_sigma(sigma)
    check_oriented_points(points, normals)
    if int(chunk) < 1:
        raise ConfigError(f"DPSR chunk must be a positive number of points, got {chunk}")
    compiled = backends.choose("dpsr", backend, math.prod(res), lambda: _compiled_unsuited(points.device))
    requires_grad = torch.is_grad_enabled() and (points.requires_grad or normals.requires_grad)
    _check_memory(
        res, points.shape[1], points.shape[0], points.dtype, requires_grad, int(chunk), memory_limit, points.device
    )
    return _DPSRFunction.apply(
        points.contiguous(), normals.contiguous(), res, sigma, bool(shift), bool(scale), int(chunk), compiled
    )


class DPSR(nn.Module):
    """Module form of :func:`dpsr` with its settings fixed at construction.

    With ``memory_limit`` None each solve shape is checked against the memory available the first
    time it is seen only: a training run's shape is the same every step (see ``forward``).
    """

    def __init__(
        self,
        res: int | Sequence[int],
        sigma: float = 2.0,
        *,
        shift: bool = True,
        scale: bool = True,
        memory_limit: float | None = None,
        chunk: int = DEFAULT_POINT_CHUNK,
        backend: str = "auto",
    ):
        super().__init__()
        self.res = normalize_resolution(res)
        self.sigma = _check_sigma(sigma)
        self.shift, self.scale = bool(shift), bool(scale)
        self.memory_limit = memory_limit
        self.chunk = int(chunk)
        self.backend = backends.check_backend("DPSR", backend)
        # Solves already checked against the memory available then (memory_limit None). A training
        # run solves the same shapes every step: checked again, another process's passing peak would
        # stop it mid-run with a ConfigError for a solve that already ran. A shape seen once is left
        # to the allocator, whose own out-of-memory error still stops a real shortage.
        self._checked: set[tuple] = set()

    def forward(self, points: Tensor, normals: Tensor) -> Tensor:
        limit = self.memory_limit
        key = (tuple(points.shape), points.dtype, points.device, torch.is_grad_enabled())
        if limit is None and key in self._checked:
            limit = math.inf
        out = dpsr(
            points,
            normals,
            self.res,
            self.sigma,
            shift=self.shift,
            scale=self.scale,
            memory_limit=limit,
            chunk=self.chunk,
            backend=self.backend,
        )
        self._checked.add(key)
        return out

    def extra_repr(self) -> str:
        return f"res={self.res}, sigma={self.sigma}, shift={self.shift}, scale={self.scale}, backend={self.backend!r}"


def psr_tanh_mse_loss(pred: Tensor, target: Tensor, *, target_is_tanh: bool = False) -> Tensor:
    """Shape-as-Points training loss: MSE between tanh(pred) and tanh(target).

    ``target`` is the ground-truth indicator grid, +0.5 outside and -0.5 inside.
    A data pipeline that stores tanh(target) once per sample passes it with
    ``target_is_tanh=True`` and saves a grid-sized tanh every step.
    """
    if pred.shape != target.shape:
        raise DataError(
            f"PSR loss: prediction shape {tuple(pred.shape)} and target shape {tuple(target.shape)} differ; "
            "build the target on the voxelizer's DPSR grid"
        )
    target = target.to(pred.dtype)
    if not target_is_tanh:
        target = torch.tanh(target)
    return torch.nn.functional.mse_loss(torch.tanh(pred), target)
