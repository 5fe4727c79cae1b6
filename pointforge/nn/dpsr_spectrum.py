"""DPSR's frequency side: the spectral filter of the Poisson solve and the plain path's FFTs.

With ``w = 2*pi*k`` (``k`` the integer frequency vector) the filter is
``G(k) / (-|w|^2 + 1e-6)``, ``G(k) = exp(-0.5 * (2 * sigma * |k| / r0)^2)`` a Gaussian
smoothing (``r0`` on every axis, as upstream does), with the DC term set to zero; it is
applied in place, slab by slab, to half spectra of real FFTs.

The FFTs here are torch.fft's (every device); the compiled CPU path has its own, with the
same signatures, in :mod:`pointforge.nn.dpsr_pruned`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["LAPLACIAN_EPS", "SLAB_ELEMENTS", "Spectrum", "irfftn_consuming", "rfftn"]

# Half-spectrum elements filtered per step: the filter's temporaries (about 24
# bytes an element) stay near 12 MB whatever the grid.
SLAB_ELEMENTS = 1 << 19

LAPLACIAN_EPS = 1e-6


def _integer_frequencies(n: int, half: bool, device) -> Tensor:
    if half:
        return torch.arange(n // 2 + 1, device=device)
    k = torch.arange(n, device=device)
    return torch.where(k > (n - 1) // 2, k - n, k)


class Spectrum:
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
        rows = max(1, SLAB_ELEMENTS // (r1 * rh))
        g12 = self.gauss64[1][:, None] * self.gauss64[2][None, :]
        w2 = self.omega_sq32[2][None, None, :]
        for start in range(0, r0, rows):
            stop = min(start + rows, r0)
            gauss = (self.gauss64[0][start:stop, None, None] * g12).to(torch.float32)
            w01 = self.omega_sq32[0][start:stop, None, None] + self.omega_sq32[1][None, :, None]
            lap = (-(w01 + w2)) + LAPLACIAN_EPS
            factor = gauss.to(self.dtype) / lap.to(self.dtype)
            # On the real view a real factor needs no complex temporary.
            torch.view_as_real(spec[start:stop]).mul_(factor[..., None])
        spec[0, 0, 0] = 0


def rfftn(x: Tensor) -> Tensor:
    return torch.fft.rfftn(x)


def irfftn_consuming(spec: Tensor, res: tuple[int, int, int]) -> Tensor:
    """Inverse real FFT of a spectrum the caller gives up (the compiled path's overwrites it).

    torch.fft copies the spectrum internally for a multi-axis inverse (measured), so its
    peak holds the spectrum twice plus the result.
    """
    return torch.fft.irfftn(spec, s=res)
