"""DPSR's compiled CPU path: ducc0's FFTs, and a forward solve that transforms only the lines holding data.

It is one row of :mod:`pointforge.nn.backends`' table (``backend="compiled"``, which
``"auto"`` takes for CPU tensors where ducc0 and Numba import), imported only when it runs.
ducc0 (the successor of the pocketfft that SciPy ships) writes into given arrays and
inverts in the spectrum itself, with no internal copy (docs/experiments/implant.md);
:func:`rfftn` and :func:`irfftn_consuming` have the signatures of
:mod:`pointforge.nn.dpsr_spectrum`'s torch.fft ones, and serve the backward pass too.

The forward solve is linear in the three splatted normal grids ``N_a``:
``Phi = F * sum_a (-i w_a) FFT(N_a)``, ``F`` the filter of :mod:`pointforge.nn.dpsr_spectrum`.
Done as three whole 3-D transforms, it is ten passes of 1-D FFTs over a 512^3 grid and
a few more of complex arithmetic. This module computes the same sum with less:

1. A splat is zero outside the box of grid nodes its points use
   (:meth:`PointCorners.node_box`). The real FFT along axis 2 runs only over the rows
   ``(i, j)`` inside the box along axes 0 and 1, the FFT along axis 1 only over the
   planes ``i`` inside it along axis 0 (the other rows and planes are zero and stay
   zero); only the pass along axis 0 covers every line.
2. ``-i w_a`` depends on ``k_a`` alone, so it can be applied as soon as axis ``a`` has
   been transformed: the axis-2 component after its first pass, the axis-1 component
   after its second, where the two are summed. The pass along axis 0 then runs twice
   (that sum, and the axis-0 component), not three times.
3. The axis-0 derivative, the last sum and the filter are one compiled pass over the
   spectrum (:func:`combine_and_filter`), the filter's factor formed in registers exactly
   as :meth:`Spectrum.apply_filter_` forms it.

The inverse is :func:`irfftn_consuming`. Every step is the plain solve's
linear map; only the rounding of the sums differs (tests/nn/test_dpsr_pruned.py holds it
to the plain solve, docs/experiments/implant.md has the measurements).
"""

from __future__ import annotations

import ducc0
import numba
import numpy as np
import torch
from torch import Tensor

from pointforge.nn.dpsr_grid import PointCorners
from pointforge.nn.dpsr_spectrum import LAPLACIAN_EPS, Spectrum
from pointforge.nn.pvops.compiled_support import run_threaded

__all__ = ["combine_and_filter", "irfftn_consuming", "pruned_raw_solve", "rfftn"]

# Planes of the spectrum per piece of work of the compiled pass (two threads share them).
_PLANES_PER_PIECE = 8


def _line_spectra(corners: PointCorners, normals: Tensor, axis: int, grid: Tensor, out: Tensor, threads: int) -> None:
    """``out`` (the box's planes, all rows) = the spectrum along axes 2 and 1 of normal component ``axis``.

    ``grid`` is zero outside the box (and inside it before the first component). The real
    FFT along axis 2 covers the rows inside the box; the rows outside it are zero before
    the FFT along axis 1, which the caller runs over every row of the box's planes.
    """
    (a0, b0), (a1, b1), _ = corners.node_box()
    inside = grid[a0:b0, a1:b1]
    if axis != 2:
        inside.zero_()  # the splat touches nothing outside the box
    corners.splat(grid.view(-1), normals[:, axis])
    out[:, :a1].zero_()
    out[:, b1:].zero_()
    ducc0.fft.r2c(inside.numpy(), axes=(2,), out=out[:, a1:b1].numpy(), nthreads=threads)


def _along(axis: int, spec: Tensor, threads: int) -> None:
    ducc0.fft.c2c(spec.numpy(), axes=(axis,), out=spec.numpy(), nthreads=threads)


def pruned_raw_solve(corners: PointCorners, normals: Tensor, spectrum: Spectrum, threads: int) -> Tensor:
    """Unnormalised Poisson solution (*res) of one item: the plain solve's, computed as the module says."""
    res = spectrum.res
    (a0, b0), (a1, b1), _ = corners.node_box()
    half = (res[0], res[1], res[2] // 2 + 1)
    grid = torch.zeros(res, dtype=normals.dtype)
    spec = torch.empty(half, dtype=spectrum.complex_dtype)
    summed = spec[a0:b0]
    _line_spectra(corners, normals, 2, grid, summed, threads)
    summed[:, a1:b1].mul_(spectrum.derivative(2, -1.0))
    _along(1, summed, threads)
    part = torch.empty_like(summed)
    _line_spectra(corners, normals, 1, grid, part, threads)
    _along(1, part, threads)
    summed.addcmul_(part, spectrum.derivative(1, -1.0))
    del part
    axis0 = torch.empty(half, dtype=spectrum.complex_dtype)
    _line_spectra(corners, normals, 0, grid, axis0[a0:b0], threads)
    del grid
    _along(1, axis0[a0:b0], threads)
    for full in (spec, axis0):
        full[:a0].zero_()
        full[b0:].zero_()
        _along(0, full, threads)
    combine_and_filter(spec, axis0, spectrum, threads)
    del axis0
    return irfftn_consuming(spec, res)


def rfftn(x: Tensor) -> Tensor:
    return torch.from_numpy(ducc0.fft.r2c(x.detach().numpy(), nthreads=torch.get_num_threads()))


def irfftn_consuming(spec: Tensor, res: tuple[int, int, int]) -> Tensor:
    """Inverse real FFT of a spectrum the caller gives up: ducc0 works in the spectrum itself."""
    out = torch.empty(res, dtype=spec.real.dtype)
    ducc0.fft.c2r(
        spec.detach().numpy(),
        lastsize=res[-1],
        forward=False,
        inorm=2,
        out=out.numpy(),
        nthreads=torch.get_num_threads(),
        allow_overwriting_input=True,
    )
    return out


def combine_and_filter(spec: Tensor, axis0: Tensor, spectrum: Spectrum, threads: int) -> None:
    """``spec = (spec - i w_0 axis0) * G / (-|w|^2 + 1e-6)`` in place, the DC term 0.

    The same values as ``spec.addcmul_(axis0, spectrum.derivative(0, -1.0))`` followed by
    ``spectrum.apply_filter_(spec)``, in one pass over the two spectra.
    """
    real = spec.real.dtype
    omega0 = spectrum.omega[0].to(real).numpy()
    gauss12 = (spectrum.gauss64[1][:, None] * spectrum.gauss64[2][None, :]).numpy()
    sq = [s.numpy() for s in spectrum.omega_sq32]
    eps = np.float32(LAPLACIAN_EPS)
    one = np.ones(1, dtype=omega0.dtype)
    target = torch.view_as_real(spec).numpy()
    source = torch.view_as_real(axis0).numpy()
    g0 = spectrum.gauss64[0].numpy()
    starts = list(range(0, spec.shape[0], _PLANES_PER_PIECE))

    def run(start: int) -> None:
        stop = min(start + _PLANES_PER_PIECE, spec.shape[0])
        _combine_filter_planes(target, source, omega0, g0, gauss12, sq[0], sq[1], sq[2], eps, one, start, stop)

    run_threaded(run, starts, threads)
    spec[0, 0, 0] = 0


@numba.njit(cache=True, nogil=True)
def _combine_filter_planes(
    target, source, omega0, g0, gauss12, sq0, sq1, sq2, eps, one, start, stop
):  # pragma: no cover - compiled
    """Planes ``[start, stop)`` of :func:`combine_and_filter` on the real views (…, 2) of the spectra.

    ``(-i w)(x + iy) = w y - i w x``. The filter's Gaussian is the float64 product rounded
    to float32 and its Laplacian float32, as ``apply_filter_`` has them; ``one`` (a 1 of
    the spectrum's real dtype) brings both to that dtype for the division.
    """
    n1, nh = target.shape[1], target.shape[2]
    gauss = np.empty(nh, dtype=one.dtype)
    lap = np.empty(nh, dtype=one.dtype)
    for i in range(start, stop):
        w = omega0[i]
        for j in range(n1):
            s01 = sq0[i] + sq1[j]
            for k in range(nh):
                gauss[k] = np.float32(g0[i] * gauss12[j, k]) * one[0]
                lap[k] = ((-(s01 + sq2[k])) + eps) * one[0]
            for k in range(nh):
                factor = gauss[k] / lap[k]
                re = target[i, j, k, 0] + w * source[i, j, k, 1]
                im = target[i, j, k, 1] - w * source[i, j, k, 0]
                target[i, j, k, 0] = re * factor
                target[i, j, k, 1] = im * factor
