"""Differentiable Poisson surface reconstruction (DPSR), as in Shape-as-Points.

Oriented points in the unit cube become an indicator grid in three steps:

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
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from pointforge.devices import available_memory_bytes
from pointforge.errors import ConfigError, DataError

try:  # pocketfft: on a CPU its inverse real FFT is markedly faster than MKL's (bench/dpsr.py)
    import scipy.fft as _scipy_fft
except ImportError:  # pragma: no cover - scipy is a dependency, but DPSR does not need it
    _scipy_fft = None

__all__ = [
    "DPSR",
    "dpsr",
    "dpsr_memory_bytes",
    "available_memory_bytes",
    "rasterize",
    "interpolate",
    "normalize_resolution",
    "check_oriented_points",
    "psr_tanh_mse_loss",
    "FFT_BACKENDS",
    "resolve_fft_backend",
]

# "auto": SciPy's pocketfft for CPU tensors when SciPy is importable, torch.fft
# otherwise (CUDA). Both compute the same transforms (tested equal).
FFT_BACKENDS = ("auto", "torch", "scipy")

# Points per chunk when splatting or gathering: 8 corners x 2^18 points keeps the
# index and weight temporaries near 30 MB whatever the cloud size.
DEFAULT_POINT_CHUNK = 1 << 18

# Clouds up to this size keep their corner indices and weights (about 120 bytes
# a point, 250 once the backward pass has added the weight derivatives) from the
# forward pass to the backward pass instead of rebuilding them for every use.
_KEEP_CORNERS_UP_TO = 1 << 20

# Half-spectrum elements filtered per step: the filter's temporaries (about 24
# bytes an element) stay near 12 MB whatever the grid.
_SLAB_ELEMENTS = 1 << 19

_LAPLACIAN_EPS = 1e-6

# Measured slack of a forward+backward pass beyond the tensors counted (FFT plans
# and workspace, allocator rounding): about 40 MB on small grids, ~1% at 512^3.
_FIXED_OVERHEAD = 48 << 20


def normalize_resolution(res: int | Sequence[int]) -> tuple[int, int, int]:
    """Return ``res`` as a 3-tuple of ints, each at least 2."""
    if isinstance(res, bool):
        raise ConfigError(f"DPSR resolution must be an int or three ints, got {res!r}")
    dims: tuple[Any, ...]
    if isinstance(res, numbers.Integral):
        dims = (res, res, res)
    else:
        seq = cast(Sequence[int], res)  # numbers.Integral covers the ints, which mypy cannot see
        try:
            dims = tuple(int(r) for r in seq)
        except TypeError:
            raise ConfigError(f"DPSR resolution must be an int or three ints, got {res!r}") from None
        if len(dims) != 3 or any(d != r for d, r in zip(dims, seq)):
            raise ConfigError(f"DPSR resolution must be an int or three ints, got {res!r}")
    if any(d < 2 for d in dims):
        raise ConfigError(f"DPSR resolution must be at least 2 along every axis, got {dims}")
    return dims  # type: ignore[return-value]


def _check_sigma(sigma: float) -> float:
    sigma = float(sigma)
    if not math.isfinite(sigma) or sigma < 0:
        raise ConfigError(f"DPSR sigma must be a finite number >= 0, got {sigma}")
    return sigma


def check_oriented_points(points: Tensor, normals: Tensor | None = None) -> None:
    """Raise :class:`DataError` unless ``points`` is a valid ``(batch, n, 3)`` cloud in ``[0, 1)``."""
    if not isinstance(points, Tensor) or points.dim() != 3 or points.shape[-1] != 3:
        shape = tuple(points.shape) if isinstance(points, Tensor) else type(points).__name__
        raise DataError(f"DPSR points must have shape (batch, n, 3), got {shape}")
    if not points.is_floating_point():
        raise DataError(f"DPSR points must be floating point, got {points.dtype}")
    if points.shape[0] == 0 or points.shape[1] == 0:
        raise DataError(
            f"DPSR got an empty point cloud (shape {tuple(points.shape)}); give it at least one point per item"
        )
    if normals is not None:
        if not isinstance(normals, Tensor) or normals.shape != points.shape:
            shape = tuple(normals.shape) if isinstance(normals, Tensor) else type(normals).__name__
            raise DataError(f"DPSR normals must have the points' shape {tuple(points.shape)}, got {shape}")
        if normals.dtype != points.dtype or normals.device != points.device:
            raise DataError(
                f"DPSR points and normals must share dtype and device, got {points.dtype}/{points.device} "
                f"and {normals.dtype}/{normals.device}"
            )
        if not bool(torch.isfinite(normals).all()):
            raise DataError("DPSR normals contain NaN or infinite values; check the network output or the data")
    with torch.no_grad():
        if not bool(torch.isfinite(points).all()):
            raise DataError("DPSR points contain NaN or infinite values; check the network output or the data")
        lo, hi = float(points.min()), float(points.max())
    if lo < 0.0 or hi >= 1.0:
        raise DataError(
            f"DPSR points must lie in [0, 1) (the unit cube is the periodic domain), got values in "
            f"[{lo:.6g}, {hi:.6g}]; rescale the cloud into the unit cube first"
        )


# ----------------------------------------------------------------------------
# Trilinear corners: shared by splatting, interpolation and their gradients.


@dataclass
class _Corners:
    """The 8 grid nodes around each point of a chunk and their trilinear weights."""

    index: Tensor  # (n, 8) int64 flat node index; corner 4*bx + 2*by + bz, b = 0 lower, 1 upper
    weight: Tensor  # (n, 8)
    axis_weights: Tensor  # (n, 2, 3): weight of the lower / upper node along each axis
    cell: Tensor  # (3,) cell size along each axis
    _with_derivatives: Tensor | None = None

    def with_derivatives(self) -> Tensor:
        """(n, 8, 4): the weight and its derivatives along x, y, z, for one batched product.

        Along each axis the lower weight falls and the upper one rises at 1/cell
        (one-sided from above on a grid plane, so the 8 derivatives sum to zero).
        """
        if self._with_derivatives is None:
            w = self.axis_weights
            slope = torch.stack((-1.0 / self.cell, 1.0 / self.cell), 0).to(w.dtype)  # (2, 3)
            wx, wy, wz = w[:, :, None, None, 0], w[:, None, :, None, 1], w[:, None, None, :, 2]
            sx, sy, sz = slope[None, :, None, None, 0], slope[None, None, :, None, 1], slope[None, None, None, :, 2]
            self._with_derivatives = torch.stack(
                (
                    self.weight,
                    (sx * wy * wz).reshape(-1, 8),
                    (wx * sy * wz).reshape(-1, 8),
                    (wx * wy * sz).reshape(-1, 8),
                ),
                2,
            )
        return self._with_derivatives


def _corners(points: Tensor, res: tuple[int, int, int]) -> _Corners:
    # Weights as |x - node| / cell with the cell size 1/r rounded to the points'
    # dtype, the way the reference forms them, so the roundings agree closely.
    size = torch.tensor(res, dtype=points.dtype, device=points.device)
    cell = 1.0 / size
    # x/cell can round up to r for x just below 1 on grids that are not powers of
    # two; such a point sits on the periodic image of node 0.
    low = torch.minimum(torch.floor(points / cell), size - 1)
    w_upper = (points - low * cell).abs_().div_(cell)
    w_lower = (points - (low + 1) * cell).abs_().div_(cell)
    i0 = low.long()
    i1 = i0 + 1
    i1 = torch.where(i1 == size.long(), 0, i1)
    stride = torch.tensor((res[1] * res[2], res[2], 1), device=points.device)
    offsets = torch.stack((i0 * stride, i1 * stride), 1)  # (n, 2, 3)
    index = (offsets[:, :, None, None, 0] + offsets[:, None, :, None, 1] + offsets[:, None, None, :, 2]).reshape(-1, 8)
    w = torch.stack((w_lower, w_upper), 1)  # (n, 2, 3)
    weight = (w[:, :, None, None, 0] * w[:, None, :, None, 1] * w[:, None, None, :, 2]).reshape(-1, 8)
    return _Corners(index=index, weight=weight, axis_weights=w, cell=cell)


def _chunks(n: int, chunk: int) -> Iterator[slice]:
    for start in range(0, n, chunk):
        yield slice(start, min(start + chunk, n))


class _PointCorners:
    """Corners of one cloud, chunk by chunk: kept after the first use when the
    cloud is small enough (DPSR visits them up to nine times per step), rebuilt
    per use for very large clouds so that memory stays bounded."""

    def __init__(self, points: Tensor, res: tuple[int, int, int], chunk: int):
        self.points, self.res = points, res
        self.slices = list(_chunks(points.shape[0], chunk))
        self._kept: list[Any] | None = [] if points.shape[0] <= _KEEP_CORNERS_UP_TO else None

    def __iter__(self) -> Iterator[tuple[slice, _Corners]]:
        if self._kept is not None and len(self._kept) == len(self.slices):
            yield from zip(self.slices, self._kept)
            return
        for s in self.slices:
            c = _corners(self.points[s], self.res)
            if self._kept is not None:
                self._kept.append(c)
            yield s, c

    def splat(self, flat: Tensor, values: Tensor) -> None:
        """Add the trilinear splat of per-point ``values`` (n,) into the flat grid."""
        for s, c in self:
            flat.index_add_(0, c.index.view(-1), (c.weight * values[s, None]).view(-1))

    def gather(self, flat: Tensor, with_gradient: bool) -> tuple[Tensor, Tensor | None]:
        """Trilinear value (n,) of the flat grid at the points and, if asked, its spatial gradient (n, 3)."""
        n = self.points.shape[0]
        values = flat.new_empty(n)
        gradient = flat.new_empty(n, 3) if with_gradient else None
        for s, c in self:
            nodes = flat.index_select(0, c.index.view(-1)).view(-1, 1, 8)
            if gradient is None:
                values[s] = (nodes.view(-1, 8) * c.weight).sum(1)
            else:
                both = torch.bmm(nodes, c.with_derivatives()).view(-1, 4)
                values[s] = both[:, 0]
                gradient[s] = both[:, 1:]
        return values, gradient


def rasterize(points: Tensor, values: Tensor, res: int | Sequence[int], chunk: int = DEFAULT_POINT_CHUNK) -> Tensor:
    """Trilinear periodic splat of per-point ``values`` (batch, n, f) into a (batch, f, *res) grid.

    Not differentiable; DPSR's own backward pass handles gradients.
    """
    res = normalize_resolution(res)
    check_oriented_points(points)
    if values.shape[:2] != points.shape[:2] or values.dim() != 3:
        raise DataError(f"rasterize values must have shape (batch, n, f) matching points, got {tuple(values.shape)}")
    b, _, f = values.shape
    out = points.new_zeros(b, f, math.prod(res))
    with torch.no_grad():
        for i in range(b):
            corners = _PointCorners(points[i], res, chunk)
            for ch in range(f):
                corners.splat(out[i, ch], values[i, :, ch].to(points.dtype))
    return out.view(b, f, *res)


def interpolate(grid: Tensor, points: Tensor, chunk: int = DEFAULT_POINT_CHUNK) -> Tensor:
    """Trilinear periodic interpolation of a (batch, *res) grid at (batch, n, 3) points -> (batch, n).

    Not differentiable (used for evaluation and the DPSR shift).
    """
    check_oriented_points(points)
    if grid.dim() != 4 or grid.shape[0] != points.shape[0]:
        raise DataError(
            f"interpolate expects a (batch, r0, r1, r2) grid matching the points' batch, got {tuple(grid.shape)}"
        )
    res = normalize_resolution(tuple(grid.shape[1:]))
    with torch.no_grad():
        out = [
            _PointCorners(points[i].to(grid.dtype), res, chunk).gather(grid[i].reshape(-1), False)[0]
            for i in range(grid.shape[0])
        ]
    return torch.stack(out)


# ----------------------------------------------------------------------------
# Spectral filter.


def _integer_frequencies(n: int, half: bool, device) -> Tensor:
    if half:
        return torch.arange(n // 2 + 1, device=device)
    k = torch.arange(n, device=device)
    return torch.where(k > (n - 1) // 2, k - n, k)


class _Spectrum:
    """Frequencies and filter factors of one grid, computed once per solve.

    The factors the reference keeps in float32 (the Gaussian, 2*pi*k and the
    Laplacian) are rounded to float32 here too, also for float64 solves, which is
    what makes a float64 solve reproduce the reference's to ~1e-15.
    """

    def __init__(self, res: tuple[int, int, int], sigma: float, dtype: torch.dtype, device):
        self.res = res
        self.dtype = dtype
        k = [_integer_frequencies(r, d == 2, device) for d, r in enumerate(res)]
        # omega = float32(k) * float32(2 pi), as a float32 tensor times a Python float gives.
        omega32 = [ki.to(torch.float32) * (2 * math.pi) for ki in k]
        self.omega_sq32 = [w * w for w in omega32]
        self.omega = [w.to(dtype) for w in omega32]
        # The Gaussian factorises over axes; its product is formed in float64 and
        # rounded once, as the reference rounds its float64 filter to float32.
        scale = 2.0 * sigma / res[0]
        self.gauss64 = [torch.exp(-0.5 * (scale * ki.to(torch.float64)) ** 2) for ki in k]
        self.complex_dtype = torch.complex64 if dtype == torch.float32 else torch.complex128

    def derivative(self, axis: int, sign: float) -> Tensor:
        """The 1-D factor ``sign * i * omega_axis``, shaped to broadcast over the half spectrum."""
        w = torch.complex(torch.zeros_like(self.omega[axis]), sign * self.omega[axis]).to(self.complex_dtype)
        shape = [1, 1, 1]
        shape[axis] = -1
        return w.view(shape)

    def apply_filter_(self, spec: Tensor) -> None:
        """spec *= G / (-|omega|^2 + 1e-6) in place, slab by slab, and zero the DC term."""
        r0, r1, rh = spec.shape
        rows = max(1, _SLAB_ELEMENTS // (r1 * rh))
        g12 = self.gauss64[1][:, None] * self.gauss64[2][None, :]
        w2 = self.omega_sq32[2][None, None, :]
        for start in range(0, r0, rows):
            stop = min(start + rows, r0)
            gauss = (self.gauss64[0][start:stop, None, None] * g12).to(torch.float32)
            w01 = self.omega_sq32[0][start:stop, None, None] + self.omega_sq32[1][None, :, None]
            lap = (-(w01 + w2)) + _LAPLACIAN_EPS
            factor = gauss.to(self.dtype) / lap.to(self.dtype)
            # On the real view a real factor needs no complex temporary.
            torch.view_as_real(spec[start:stop]).mul_(factor[..., None])
        spec[0, 0, 0] = 0


# ----------------------------------------------------------------------------
# FFT backends.


def resolve_fft_backend(fft: str, device: torch.device | str) -> str:
    """The backend ``fft`` (one of :data:`FFT_BACKENDS`) means for tensors on ``device``."""
    if fft not in FFT_BACKENDS:
        raise ConfigError(f"DPSR fft backend must be one of {', '.join(FFT_BACKENDS)}, got {fft!r}")
    cpu_scipy = torch.device(device).type == "cpu" and _scipy_fft is not None
    if fft == "auto":
        return "scipy" if cpu_scipy else "torch"
    if fft == "scipy" and not cpu_scipy:
        raise ConfigError("DPSR fft='scipy' needs SciPy and CPU tensors; use fft='torch' or 'auto'")
    return fft


def _rfftn(x: Tensor, backend: str) -> Tensor:
    if backend == "scipy":
        return torch.from_numpy(_scipy_fft.rfftn(x.detach().numpy(), workers=torch.get_num_threads()))
    return torch.fft.rfftn(x)


def _irfftn_consuming(spec: Tensor, res: tuple[int, int, int], backend: str) -> Tensor:
    """Inverse real FFT of a spectrum the caller gives up (it may be overwritten).

    Both libraries still copy the spectrum internally for a multi-axis inverse
    (measured), so the peak holds the spectrum twice plus the result.
    """
    if backend == "scipy":
        out = _scipy_fft.irfftn(spec.detach().numpy(), s=res, workers=torch.get_num_threads(), overwrite_x=True)
        return torch.from_numpy(out)
    return torch.fft.irfftn(spec, s=res)


# ----------------------------------------------------------------------------
# The solve and its backward pass.


def _raw_solve(corners: _PointCorners, normals: Tensor, spectrum: _Spectrum, backend: str) -> Tensor:
    """Unnormalised Poisson solution (*res) of one item."""
    res = spectrum.res
    grid = torch.zeros(math.prod(res), dtype=normals.dtype, device=normals.device)
    spec = None
    for axis in range(3):
        if axis:
            grid.zero_()
        corners.splat(grid, normals[:, axis])
        part = _rfftn(grid.view(res), backend)
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
    return _irfftn_consuming(spec, res, backend)


class _DPSRFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, points, normals, res, sigma, shift, scale, chunk, backend):
        batch = points.shape[0]
        spectrum = _Spectrum(res, sigma, points.dtype, points.device)
        out = None
        scales = points.new_ones(batch)
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.corners = []
        for i in range(batch):
            corners = _PointCorners(points[i], res, chunk)
            phi = _raw_solve(corners, normals[i], spectrum, backend)
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
        ctx.res, ctx.sigma, ctx.shift, ctx.scale, ctx.backend = res, sigma, shift, scale, backend
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
        spectrum = _Spectrum(res, ctx.sigma, points.dtype, points.device)
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
            spec = _rfftn(grad_phi, ctx.backend)
            del grad_phi
            spectrum.apply_filter_(spec)
            for axis in range(3):
                channel = spec * spectrum.derivative(axis, 1.0)
                grad_raster = _irfftn_consuming(channel, res, ctx.backend).view(-1)
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
    result). Both FFT backends need the same. The caller's own tensors (points,
    a loss's intermediates) are not included. Measured peaks (bench/dpsr.py)
    stay within a few percent of it at 256^3 and 512^3.
    """
    res = normalize_resolution(res)
    item = torch.empty((), dtype=dtype).element_size()
    grid = math.prod(res) * item
    half = res[0] * res[1] * (res[2] // 2 + 1) * 2 * item
    n_points = max(int(n_points), 0)
    # Corner tables: 8 int64 indices, 8 weights, 6 axis weights; 32 more values
    # (weights with their derivatives) once the backward pass needs them.
    per_point = 64 + (14 + (32 if requires_grad else 0)) * item
    kept = n_points if n_points <= _KEEP_CORNERS_UP_TO else min(n_points, chunk)
    points = kept * per_point * batch + n_points * 3 * item * (4 if requires_grad else 1)
    filter_slab = min(_SLAB_ELEMENTS, half // (2 * item)) * (16 + 2 * item)
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
    fft: str = "auto",
) -> Tensor:
    """Indicator grid (batch, *res) of oriented points (batch, n, 3) in ``[0, 1)``.

    ``sigma`` is the Gaussian smoothing in frequency space (0: none). ``shift``
    and ``scale`` switch the two normalisation steps (both on: mean 0 at the
    points, corner node +0.5, inside negative). ``memory_limit`` in bytes: a solve
    estimated (by :func:`dpsr_memory_bytes`) to need more raises
    :class:`ConfigError` before anything is allocated; ``None`` means the memory
    the device has available now, ``math.inf`` disables the check. ``chunk``
    bounds the points handled at once when splatting. ``fft`` picks the FFT
    backend (see :data:`FFT_BACKENDS`). Gradients flow to points and normals.
    """
    res = normalize_resolution(res)
    sigma = _check_sigma(sigma)
    check_oriented_points(points, normals)
    if int(chunk) < 1:
        raise ConfigError(f"DPSR chunk must be a positive number of points, got {chunk}")
    backend = resolve_fft_backend(fft, points.device)
    requires_grad = torch.is_grad_enabled() and (points.requires_grad or normals.requires_grad)
    _check_memory(
        res, points.shape[1], points.shape[0], points.dtype, requires_grad, int(chunk), memory_limit, points.device
    )
    return _DPSRFunction.apply(
        points.contiguous(), normals.contiguous(), res, sigma, bool(shift), bool(scale), int(chunk), backend
    )


class DPSR(nn.Module):
    """Module form of :func:`dpsr` with its settings fixed at construction."""

    def __init__(
        self,
        res: int | Sequence[int],
        sigma: float = 2.0,
        *,
        shift: bool = True,
        scale: bool = True,
        memory_limit: float | None = None,
        chunk: int = DEFAULT_POINT_CHUNK,
        fft: str = "auto",
    ):
        super().__init__()
        self.res = normalize_resolution(res)
        self.sigma = _check_sigma(sigma)
        self.shift, self.scale = bool(shift), bool(scale)
        self.memory_limit = memory_limit
        self.chunk = int(chunk)
        if fft not in FFT_BACKENDS:
            raise ConfigError(f"DPSR fft backend must be one of {', '.join(FFT_BACKENDS)}, got {fft!r}")
        self.fft = fft

    def forward(self, points: Tensor, normals: Tensor) -> Tensor:
        return dpsr(
            points,
            normals,
            self.res,
            self.sigma,
            shift=self.shift,
            scale=self.scale,
            memory_limit=self.memory_limit,
            chunk=self.chunk,
            fft=self.fft,
        )

    def extra_repr(self) -> str:
        return f"res={self.res}, sigma={self.sigma}, shift={self.shift}, scale={self.scale}, fft={self.fft!r}"


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
