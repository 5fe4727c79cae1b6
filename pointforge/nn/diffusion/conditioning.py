"""How a conditioned cloud meets the network: the ``[condition | generated]`` layout and the condition mark.

A cloud is ``[B, C, N]``: the first ``N - n_generated`` points (the defective
skull) are never noised and condition the network; only the last
``n_generated`` points (the implant) are diffused, denoised and scored. The
network (a :data:`Denoiser`, any callable ``network(x, t)``) sees the whole
cloud and may answer for every point (as PVCNN2 does) or only for the
generated ones; :func:`network_output` calls it and keeps the generated part.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from pointforge.errors import ConfigError
from pointforge.nn.diffusion.checks import check_int

__all__ = ["Denoiser", "network_output", "MarkConditioning"]

# network(x [B, C, N], t int64 [B]) -> its prediction for [B, C, N] or the [B, C, n_generated] generated points.
Denoiser = Callable[[Tensor, Tensor], Tensor]


def network_output(network: Denoiser, x: Tensor, t: Tensor, n_generated: int) -> Tensor:
    """``network(x, t)`` for the generated points, ``[B, C, n_generated]``.

    A ConfigError when the network answers in another shape: that is a wrong
    network for this cloud, not a wrong cloud.
    """
    out = network(x, t)
    batch, channels, num_points = x.shape
    if (
        not isinstance(out, Tensor)
        or out.dim() != 3
        or out.shape[:2] != (batch, channels)
        or out.shape[2] not in (num_points, n_generated)
    ):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ConfigError(
            f"the denoiser returned {got} for input {tuple(x.shape)}; it must return its "
            f"prediction as [B, C, N] or [B, C, n_generated={n_generated}]"
        )
    return out[:, :, out.shape[2] - n_generated :]


class MarkConditioning(torch.nn.Module):
    """A denoiser that also tells the network which points are the condition.

    Appends one feature channel to ``x`` (1 on the conditioning points, 0 on the
    ``n_generated`` generated ones) and returns the wrapped network's first ``C``
    output channels. Upstream PCDiff feeds xyz only, so the network must tell an
    implant point from a skull point by where it lies; with the mark it need not.
    The wrapped network takes ``C + 1`` input channels (PVCNN2's
    ``extra_feature_channels = 1``).
    """

    def __init__(self, net: torch.nn.Module, n_generated: int):
        super().__init__()
        self.net = net
        self.n_generated = check_int(n_generated, "n_generated", 1)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        batch, channels, num_points = x.shape
        n_cond = num_points - self.n_generated
        if n_cond < 0:
            raise ConfigError(
                f"a cloud of {num_points} points is smaller than the {self.n_generated} generated points "
                "this network was built for; pass the skull's points, then the generated ones"
            )
        mark = torch.zeros(batch, 1, num_points, dtype=x.dtype, device=x.device)
        mark[:, 0, :n_cond] = 1.0
        return self.net(torch.cat([x, mark], dim=1), t)[:, :channels]
