"""GroupNorm and SiLU in one pass for evaluation on CPU (:mod:`.fused_norm_compiled`), where it applies.

PVCNN2 follows nearly every convolution and point MLP with GroupNorm(8) and SiLU, each a
pass over memory of its own, and its voxel branch copies each grid to the contiguous
layout before the norm (PyTorch's CPU GroupNorm loses ~1e-4 relative precision on
channels-last grids) and back to channels-last for the next convolution. The compiled
pass reads a channels-last grid as it is, takes float64 statistics, and overwrites it in
the same layout: one read for the statistics, one read and write for the rest, no copies.

It is an evaluation path: where autograd records (training), on other devices or dtypes,
under ``torch.compile``, without Numba, or below ``COMPILED_MIN_ELEMENTS``, callers run
their PyTorch code unchanged. The two agree to float32 rounding (tests/nn/test_fused_norm.py).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor, nn

__all__ = ["COMPILED_MIN_ELEMENTS", "applies", "group_norm_act_"]

# Elements from which the compiled pass runs. Measured (bench/fused_norm.py): 2.1-11x faster
# on the paper preset's grids, 1.1-2.9x on its point features; on the tiny preset's shapes
# (512-229,376 elements) 0.93-1.7x, calls of 20-200 us, so below this the gain is noise and
# the tiny preset at batch 1 (one call above it) mostly never imports Numba.
COMPILED_MIN_ELEMENTS = 1 << 16


@functools.cache
def _compiled() -> ModuleType | None:
    """The compiled kernels' module, imported on first use; None without Numba."""
    try:
        from pointforge.nn import fused_norm_compiled
    except ImportError:
        return None
    return fused_norm_compiled


def _channels_last(x: Tensor) -> bool | None:
    """False for a contiguous tensor, True for one whose channels are its innermost axis in
    memory (a channels-last grid, a transposed ``[B, N, C]``), None for other layouts."""
    if x.is_contiguous():
        return False
    if x.movedim(1, -1).is_contiguous():
        return True
    return None


def applies(x: Tensor, norm: nn.GroupNorm) -> bool:
    """Whether :func:`group_norm_act_` runs ``norm`` on ``x``: CPU float32, autograd not
    recording, an affine norm, a layout it reads, at least ``COMPILED_MIN_ELEMENTS``."""
    weight, bias = norm.weight, norm.bias
    if weight is None or bias is None or x.dim() < 3 or x.numel() < COMPILED_MIN_ELEMENTS:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return False
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and bias.dtype == torch.float32
        and not torch.compiler.is_compiling()
        and _channels_last(x) is not None
        and _compiled() is not None
    )


def group_norm_act_(x: Tensor, norm: nn.GroupNorm, silu: bool) -> Tensor:
    """``x`` overwritten with ``F.silu(norm(x))`` (``norm(x)`` when not ``silu``) in one
    compiled pass, in its own layout, and returned; only where :func:`applies` says so, and
    only on a tensor nothing else reads (a convolution's or product's fresh output)."""
    compiled = _compiled()
    last = _channels_last(x)
    assert compiled is not None and last is not None and norm.weight is not None and norm.bias is not None
    b, c = x.shape[:2]
    flat = x.detach().movedim(1, -1).view(b, -1, c) if last else x.detach().view(b, c, -1)
    compiled.group_norm_act_(
        flat.numpy(),
        last,
        norm.num_groups,
        norm.weight.detach().numpy(),
        norm.bias.detach().numpy(),
        float(norm.eps),
        silu,
    )
    return x
