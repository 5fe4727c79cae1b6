"""GroupNorm, then SiLU if asked, compiled with Numba for evaluation on CPU: one read of the
input for the statistics, one read and one write for the normalise-and-activate, on the
layout the input has.

Features come as float32 ``[B, C, S]`` (channels first: point features ``[B, C, N]``, a
contiguous grid) or ``[B, S, C]`` (channels last: the grids oneDNN's convolutions return).
Sums and sums of squares are taken in float64 per channel and pooled per group, so the
variance ``E[x^2] - E[x]^2`` loses nothing a float32 activation could show; each channel
then gets a float32 scale and shift (``rstd * weight`` and ``bias - mean * rstd * weight``,
the form PyTorch's CPU GroupNorm applies) and ``z = x * scale + shift`` is written, or
``z / (1 + exp(-z))`` with the exponential written out in float32 arithmetic: the C
library's ``expf`` is a call per element that LLVM cannot vectorise, and made the fused
pass three times slower than PyTorch's separate ones.

The pass overwrites its input (the network hands it a convolution's or product's fresh
output): with a second array LLVM checks at run time that the two do not overlap, and a
fresh output costs a read of every line before it is written. It runs on the calling
thread: on 2 cores a second thread (a pool kept for the process) was no faster at any of
PVCNN2's shapes when the norm ran between torch's ops (whose worker, presumably, still
holds the other core), only in isolation (docs/experiments/benchmarks.md). Compiled code is cached on disk (``cache=True``).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

__all__ = ["group_norm_act_"]

# The sums are float64: letting LLVM reorder them vectorises their loops, and in float64
# the order is far below float32's resolution. Nothing else is reordered.
_SUMS = {"reassoc"}

# The output may fuse a product and a sum into one rounding (FMA), which only sharpens it.
_OUTPUT = {"contract"}

# exp(t) = 2^n exp(r) with n = round(t / ln 2) and r = t - n ln 2 in [-ln2/2, ln2/2]; ln 2 is
# split in two so that n * _LN2_HIGH (9 significant bits times at most 8) is exact, and
# exp(r) is its Taylor series to r^7 (the first term left out is below 0.35^8 / 8! < 6e-9,
# a tenth of a float32 unit). t is clamped to where 2^n is a normal float32.
_LN2_HIGH = 0.693359375
_LN2_LOW = math.log(2.0) - _LN2_HIGH
_T_MIN, _T_MAX = -87.0, 88.0


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits`` (a bit cast NumPy scalars lack)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.int32), codegen


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath=_OUTPUT, inline="always")
def _silu(z: np.float32) -> np.float32:
    t = min(max(-z, np.float32(_T_MIN)), np.float32(_T_MAX))
    n = np.floor(t * np.float32(1.0 / math.log(2.0)) + np.float32(0.5))
    r = (t - n * np.float32(_LN2_HIGH)) - n * np.float32(_LN2_LOW)
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    # Numba passes the typing context itself; mypy sees the decorator's signature.
    power: np.float32 = _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # type: ignore[call-arg]
    return z / (np.float32(1.0) + p * power)


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath=_OUTPUT)
def _apply(row: np.ndarray, scale: np.ndarray, shift: np.ndarray, silu: bool) -> None:
    """``row = act(row * scale + shift)`` elementwise (1-D arrays of one length)."""
    if silu:
        for i in range(row.shape[0]):
            row[i] = _silu(row[i] * scale[i] + shift[i])
    else:
        for i in range(row.shape[0]):
            row[i] = row[i] * scale[i] + shift[i]


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath=_OUTPUT)
def _apply_scalar(row: np.ndarray, scale: np.float32, shift: np.float32, silu: bool) -> None:
    """``row = act(row * scale + shift)`` elementwise, one scale and shift for the row."""
    if silu:
        for i in range(row.shape[0]):
            row[i] = _silu(row[i] * scale + shift)
    else:
        for i in range(row.shape[0]):
            row[i] = row[i] * scale + shift


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _block_sums(block: np.ndarray) -> tuple[float, float]:
    """(sum, sum of squares) of a contiguous 2-D float32 block, in float64."""
    s = 0.0
    q = 0.0
    for r in range(block.shape[0]):
        row = block[r]
        for i in range(row.shape[0]):
            v = np.float64(row[i])
            s += v
            q += v * v
    return s, q


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _row_sums(rows: np.ndarray, sums: np.ndarray, squares: np.ndarray) -> None:
    """Per-column float64 sums and sums of squares of ``rows [S, C]`` added into ``[C]`` arrays."""
    for i in range(rows.shape[0]):
        row = rows[i]
        for k in range(row.shape[0]):
            v = np.float64(row[k])
            sums[k] += v
            squares[k] += v * v


@numba.njit(cache=True, nogil=True)
def _scale_shift(
    s: float, q: float, count: int, weight: np.ndarray, bias: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """float32 scale and shift of a group's channels from its float64 sums over ``count`` values."""
    mean = s / count
    rstd = 1.0 / math.sqrt(max(q / count - mean * mean, 0.0) + eps)
    scale = np.empty(weight.shape[0], dtype=np.float32)
    shift = np.empty(weight.shape[0], dtype=np.float32)
    for k in range(weight.shape[0]):
        a = rstd * np.float64(weight[k])
        scale[k] = a
        shift[k] = np.float64(bias[k]) - mean * a
    return scale, shift


@numba.njit(cache=True, nogil=True)
def _norm_first(x, weight, bias, groups, eps, silu):
    """``x [B, C, S]`` in place, a (sample, group) block at a time: its sums, then its output
    (the block's second read finds it in cache more often than a second sweep would)."""
    per_group = x.shape[1] // groups
    for e in range(x.shape[0]):
        for g in range(groups):
            c0, c1 = g * per_group, (g + 1) * per_group
            s, q = _block_sums(x[e, c0:c1])
            scale, shift = _scale_shift(s, q, per_group * x.shape[2], weight[c0:c1], bias[c0:c1], eps)
            for k in range(per_group):
                _apply_scalar(x[e, c0 + k], scale[k], shift[k], silu)


@numba.njit(cache=True, nogil=True)
def _norm_last(x, weight, bias, groups, eps, silu):
    """``x [B, S, C]`` in place, a sample at a time: per-channel sums over its positions, then
    its output."""
    c = x.shape[2]
    per_group = c // groups
    scale = np.empty(c, dtype=np.float32)
    shift = np.empty(c, dtype=np.float32)
    for e in range(x.shape[0]):
        sums = np.zeros(c)
        squares = np.zeros(c)
        _row_sums(x[e], sums, squares)
        for g in range(groups):
            c0, c1 = g * per_group, (g + 1) * per_group
            count = per_group * x.shape[1]
            a, b = _scale_shift(sums[c0:c1].sum(), squares[c0:c1].sum(), count, weight[c0:c1], bias[c0:c1], eps)
            scale[c0:c1] = a
            shift[c0:c1] = b
        for i in range(x.shape[1]):
            _apply(x[e, i], scale, shift, silu)


def group_norm_act_(
    x: np.ndarray, channels_last: bool, groups: int, weight: np.ndarray, bias: np.ndarray, eps: float, silu: bool
) -> None:
    """GroupNorm of float32 ``x`` (``[B, S, C]`` when ``channels_last``, else ``[B, C, S]``;
    C-contiguous) with float32 ``weight``/``bias [C]``, then SiLU when ``silu``, in place."""
    (_norm_last if channels_last else _norm_first)(x, weight, bias, groups, eps, silu)
