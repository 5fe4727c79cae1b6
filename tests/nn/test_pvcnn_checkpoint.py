"""PVCNN2's activation checkpointing: the same function, the same gradients, the same random numbers."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvcnn import PVCNN2

pytestmark = pytest.mark.usefixtures("one_thread")


def _training_step(tiny, checkpointed: bool):
    """Forward and backward of the tiny network in training mode (dropout on), from fixed seeds."""
    model = PVCNN2("tiny", checkpoint_activations=checkpointed)
    model.load_state_dict(tiny["state_dict"])
    model.train()
    torch.manual_seed(7)
    y = model(tiny["x"], tiny["t"])
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    after = torch.rand(4)  # the generator's state once the step is done
    return y.detach(), {name: p.grad for name, p in model.named_parameters()}, after


def test_checkpointing_changes_neither_outputs_nor_gradients_nor_the_random_stream(tiny):
    y_off, grads_off, after_off = _training_step(tiny, False)
    y_on, grads_on, after_on = _training_step(tiny, True)
    torch.testing.assert_close(y_on, y_off, rtol=0, atol=0)
    assert grads_on.keys() == grads_off.keys() and all(g is not None for g in grads_on.values())
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, msg=lambda m, name=name: f"{name}: {m}")
    # The recomputation replays dropout from the stashed state and hands the generator
    # back where the forward pass left it: the next random numbers are the same.
    assert torch.equal(after_on, after_off)


def test_dropout_is_live_in_the_compared_step(tiny):
    # Otherwise the test above could not catch a recomputation that draws other masks.
    first, _, _ = _training_step(tiny, False)  # seed 7
    model = PVCNN2("tiny")
    model.load_state_dict(tiny["state_dict"])
    torch.manual_seed(8)
    assert not torch.equal(model.train()(tiny["x"], tiny["t"]).detach(), first)


def test_checkpointed_network_reproduces_upstream_with_gradients_recorded(tiny):
    model = PVCNN2("tiny", checkpoint_activations=True)
    model.load_state_dict(tiny["state_dict"], strict=True)
    y = model.eval()(tiny["x"], tiny["t"])  # autograd records: the checkpointed path runs
    assert y.requires_grad
    torch.testing.assert_close(y.detach(), tiny["y"], atol=1e-4, rtol=1e-4)
    assert "activation checkpointing" in model.extra_repr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpointing_on_cuda_gives_the_same_gradients(tiny):
    results = []
    for checkpointed in (False, True):
        model = PVCNN2("tiny", checkpoint_activations=checkpointed).cuda()
        model.load_state_dict(tiny["state_dict"])
        torch.manual_seed(7)
        y = model.train()(tiny["x"].cuda(), tiny["t"].cuda())
        y.square().mean().backward()
        results.append((y.detach(), [p.grad for p in model.parameters()]))
    (y_off, g_off), (y_on, g_on) = results
    torch.testing.assert_close(y_on, y_off)
    for a, b in zip(g_on, g_off):
        torch.testing.assert_close(a, b)
