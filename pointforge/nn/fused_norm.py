"""GroupNorm and SiLU in one pass for evaluation on CPU (:mod:`.fused_norm_compiled`), where it applies.

PVCNN2 follows nearly every convolution and point MLP with GroupNorm(8) and SiLU, each a
pass over memory of its own, and its voxel branch copies each grid to the contiguous
layout before the norm (PyTorch's CPU GroupNorm loses ~1e-4 relative precision on
channels-last grids) and back to channels-last for the next convolution. The compiled
pass reads a channels-last grid as it is, takes float64 statistics, and overwrites it in
the same layout: one read for the statistics, one read and write for the rest, no copies.

It is an evaluation path: where autograd records (training), on other devices or dtypes,
under ``torch.compile``, without Numba, below its size in :mod:`pointforge.nn.backends`'
table, or where the plain backend is chosen, callers run their PyTorch code unchanged. The
two agree to float32 rounding (tests/nn/test_fused_norm.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pointforge.nn import backends

__all__ = ["applies", "group_norm_act_"]


def _channels_last(x: Tensor) -> bool | None:
    """False for a contiguous tensor, True for one whose channels are its innermost axis in
    memory (a channels-last grid, a transposed ``[B, N, C]``), None for other layouts."""
    if x.is_contiguous():
        return False
    if x.movedim(1, -1).is_contiguous():
        return True
    return None


def _compiled_unsuited(x: Tensor, norm: nn.GroupNorm) -> str | None:
    weight, bias = norm.weight, norm.bias
    if weight is None or bias is None:
        return "an affine GroupNorm"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return "autograd not recording (an evaluation pass)"
    if torch.compiler.is_compiling():
        return "eager mode, not torch.compile"
    if not (
        x.dim() >= 3
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and bias.dtype == torch.float32
        and _channels_last(x) is not None
    ):
        return f"CPU float32 features [B, C, ...] channels first or last, got {x.dtype} {tuple(x.shape)} on {x.device}"
    return None


def applies(x: Tensor, norm: nn.GroupNorm, backend: str = "auto") -> bool:
    """Whether :func:`group_norm_act_` runs ``norm`` on ``x`` (``backend`` as in
    :mod:`pointforge.nn.backends`): with ``"auto"`` where it applies (CPU float32, autograd not
    recording, an affine norm, a layout it reads, Numba importable) and ``x`` has at least the
    table's size; never with ``"plain"``; with ``"compiled"`` True, or a one-line error why not."""
    return backends.choose("fused_norm", backend, x.numel(), lambda: _compiled_unsuited(x, norm)) is not None


def group_norm_act_(x: Tensor, norm: nn.GroupNorm, silu: bool) -> Tensor:
    """``x`` overwritten with ``F.silu(norm(x))`` (``norm(x)`` when not ``silu``) in one
    compiled pass, in its own layout, and returned; only where :func:`applies` says so, and
    only on a tensor nothing else reads (a convolution's or product's fresh output)."""
    compiled = backends.load("fused_norm")
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
