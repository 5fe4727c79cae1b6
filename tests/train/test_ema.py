"""The EMA's flat update against the per-tensor average it replaces."""

from __future__ import annotations

import torch
from torch import nn

from pointforge.train.ema import EMA


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3).double())
    model[1].running_mean.add_(1.0)
    return model


def _nudge(model: nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        model[1].num_batches_tracked.add_(1)


def _same(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the rounding of lerp's vectorised against its scalar path."""
    assert ours.dtype == expected.dtype
    eps = torch.finfo(ours.dtype).eps
    torch.testing.assert_close(ours, expected, rtol=16 * eps, atol=16 * eps)


def test_flat_update_equals_per_tensor_lerp():
    model = _model()
    ema = EMA(model, 0.9)
    reference = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        _nudge(model, g)
        ema.update(model)
        torch._foreach_lerp_(reference, [p.detach() for p in model.parameters()], 0.1)
    for ours, expected in zip(ema.module.parameters(), reference):
        _same(ours, expected)
    assert all(not p.requires_grad for p in ema.module.parameters())
    assert torch.equal(ema.module[1].num_batches_tracked, model[1].num_batches_tracked)
    # The saved state is copies, not views of the flat tensors; loading it restores the average.
    state = ema.state_dict()
    assert all(v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in state.values())
    _nudge(model, g)
    ema.update(model)
    ema.load_state_dict(state)
    assert all(torch.equal(a, state[k]) for k, a in ema.module.state_dict().items())
    _nudge(model, g)
    ema.update(model)  # the loaded values are updated in place, through the flat tensors
    torch._foreach_lerp_(reference, [p.detach() for p in model.parameters()], 0.1)
    for ours, expected in zip(ema.module.parameters(), reference):
        _same(ours, expected)


def test_update_follows_a_module_moved_to_new_storage():
    model = _model()
    ema = EMA(model, 0.5)
    ema.module.double()
    model.double()
    g = torch.Generator().manual_seed(2)
    _nudge(model, g)
    expected = [
        0.5 * e.detach().clone() + 0.5 * p.detach() for e, p in zip(ema.module.parameters(), model.parameters())
    ]
    ema.update(model)
    for ours, want in zip(ema.module.parameters(), expected):
        torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)
