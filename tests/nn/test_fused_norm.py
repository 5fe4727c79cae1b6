"""The compiled GroupNorm + SiLU pass against F.group_norm + F.silu, in the network and out of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("numba", reason="the fused norm needs Numba (a core dependency: pip install numba)")

from pointforge.nn import backends, fused_norm
from pointforge.nn.pvcnn import PVCNN2
from tests.helpers import FIXTURES

pytestmark = pytest.mark.usefixtures("one_thread")


def _norm(channels: int, eps: float = 1e-5, seed: int = 0) -> nn.GroupNorm:
    torch.manual_seed(seed)
    norm = nn.GroupNorm(8, channels, eps=eps)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm


MIN_ELEMENTS = backends.PATHS["fused_norm"].min_size


def _every_size(monkeypatch) -> None:
    """The compiled pass for every norm, whatever its size."""
    monkeypatch.setitem(backends.PATHS, "fused_norm", dataclasses.replace(backends.PATHS["fused_norm"], min_size=1))


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(1, -1).contiguous().movedim(-1, 1)


@pytest.mark.parametrize(
    "shape, last",
    [
        ((3, 24, 1001), False),
        ((2, 16, 7, 33), False),
        ((2, 16, 5, 7, 3), True),
        ((1, 64, 9, 9, 9), True),
        ((2, 40, 77), True),
    ],
)
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_fused_pass_equals_group_norm_then_silu(shape, last, silu, eps):
    norm = _norm(shape[1], eps)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    x = _channels_last(x) if last else x
    expected = F.group_norm(x.contiguous(), 8, norm.weight, norm.bias, eps)
    expected = F.silu(expected) if silu else expected
    with torch.no_grad():
        got = fused_norm.group_norm_act_(x.clone(), norm, silu)
    assert got.stride() == x.stride()  # the layout it was given
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_float64_statistics_hold_a_large_mean():
    norm = _norm(16)
    x = torch.randn(1, 16, 4096, generator=torch.Generator().manual_seed(2)) * 0.01 + 300.0
    expected = F.silu(F.group_norm(x.double(), 8, norm.weight.double(), norm.bias.double(), norm.eps))
    with torch.no_grad():
        got = fused_norm.group_norm_act_(x.clone(), norm, True)
    torch.testing.assert_close(got.double(), expected, atol=5e-3, rtol=1e-3)  # float32 input holds ~3e-5


def test_silu_extremes_are_finite_and_exact_where_saturated():
    norm = nn.GroupNorm(8, 8)
    with torch.no_grad():
        norm.weight.fill_(1.0)
        norm.bias.zero_()
    x = torch.zeros(1, 8, 4)
    x[..., 0], x[..., 1] = 1e4, -1e4  # normalised to about +-1.7; scaled up below through the weight
    with torch.no_grad():
        norm.weight.fill_(200.0)
        got = fused_norm.group_norm_act_(x.clone(), norm, True)
        expected = F.silu(F.group_norm(x, 8, norm.weight, norm.bias, norm.eps))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_applies_only_where_no_gradient_is_recorded():
    norm = _norm(8)
    x = torch.randn(1, 8, MIN_ELEMENTS // 8)
    assert not fused_norm.applies(x, norm)  # the parameters need gradients: training
    with torch.no_grad():
        assert fused_norm.applies(x, norm)
        assert not fused_norm.applies(x.double(), norm)
        assert not fused_norm.applies(x[..., :-1], norm)  # below the size threshold
        assert not fused_norm.applies(x.view(1, 8, -1, 2).transpose(2, 3), norm)  # a layout it does not read
        assert fused_norm.applies(_channels_last(x.view(1, 8, 64, -1)), norm)
    norm.requires_grad_(False)
    assert fused_norm.applies(x, norm)
    assert not fused_norm.applies(x.requires_grad_(), norm)


def test_applies_not_without_numba(monkeypatch):
    norm = _norm(8)
    monkeypatch.setattr(backends, "load", lambda name: None)
    with torch.no_grad():
        assert not fused_norm.applies(torch.randn(1, 8, MIN_ELEMENTS), norm)


@pytest.fixture
def tiny_upstream():
    data = torch.load(FIXTURES / "upstream_pvcnn2_tiny.pt", weights_only=True)
    model = PVCNN2("tiny")
    model.load_state_dict(data["state_dict"], strict=True)
    return model.eval(), data


def _calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = fused_norm.group_norm_act_

    def counting(x, norm, silu):
        calls.append(x.numel())
        return original(x, norm, silu)

    monkeypatch.setattr(fused_norm, "group_norm_act_", counting)
    return calls


def test_network_output_equals_the_torch_path_and_the_upstream_fixture(monkeypatch, tiny_upstream):
    model, data = tiny_upstream
    with torch.no_grad():
        torch_path = model(data["x"], data["t"])
        _every_size(monkeypatch)  # every norm of the tiny network
        calls = _calls(monkeypatch)
        fused = model(data["x"], data["t"])
    assert len(calls) > 20
    torch.testing.assert_close(fused, torch_path, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused, data["y"], atol=1e-4, rtol=1e-4)


def test_training_and_gradients_take_the_torch_path(monkeypatch, tiny_upstream):
    model, data = tiny_upstream
    _every_size(monkeypatch)
    calls = _calls(monkeypatch)
    model.train()
    model(data["x"], data["t"]).square().mean().backward()
    assert calls == []
    model.eval()
    model(data["x"], data["t"])  # evaluation with autograd recording: still the torch path
    assert calls == []
