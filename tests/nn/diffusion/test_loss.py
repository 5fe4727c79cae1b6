"""The training loss: which points are noised, seeding, input errors."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.loss import diffusion_loss
from tests.nn.diffusion.common import SCHEDULE

# --------------------------------------------------------------------------- training loss


class CountingDenoiser(torch.nn.Module):
    """A tiny learnable denoiser that records what it was shown."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.seen = []

    def forward(self, x, t):
        self.seen.append((x.detach().clone(), t.clone(), torch.is_grad_enabled()))
        return self.scale * x


def test_loss_noises_only_generated_points_and_is_seeded():
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(3, 3, 20, generator=gen)
    model = CountingDenoiser()
    loss_a = diffusion_loss(model, SCHEDULE, x0, 6, generator=torch.Generator().manual_seed(7))
    loss_b = diffusion_loss(model, SCHEDULE, x0, 6, generator=torch.Generator().manual_seed(7))
    loss_c = diffusion_loss(model, SCHEDULE, x0, 6, generator=torch.Generator().manual_seed(8))
    assert loss_a.item() == loss_b.item() != loss_c.item()
    seen, t, _ = model.seen[0]
    assert torch.equal(seen[:, :, :14], x0[:, :, :14])
    assert not torch.allclose(seen[:, :, 14:], x0[:, :, 14:])
    assert t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) < 1000
    loss_a.backward()
    assert model.scale.grad is not None and model.scale.grad.abs() > 0


def test_loss_input_errors():
    model = CountingDenoiser()
    x0 = torch.zeros(2, 3, 8)
    with pytest.raises(DataError, match="exceeds"):
        diffusion_loss(model, SCHEDULE, x0, 9)
    with pytest.raises(DataError, match=r"\[B, C, N\]"):
        diffusion_loss(model, SCHEDULE, x0[0], 4)
    with pytest.raises(DataError, match="noise must be shaped"):
        diffusion_loss(model, SCHEDULE, x0, 4, noise=torch.zeros(2, 3, 8))
    with pytest.raises(ConfigError, match="reduction"):
        diffusion_loss(model, SCHEDULE, x0, 4, reduction="sum")
    with pytest.raises(ConfigError, match="denoiser returned"):
        diffusion_loss(lambda x, t: x[:, :, :3], SCHEDULE, x0, 4)
