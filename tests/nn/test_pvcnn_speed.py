"""The batched fast paths of PVCNN2 equal the per-example loops they replace."""

import torch
from torch import nn

from pointforge.nn.pvcnn_blocks import FeaturePropagation, _segment_group_norm, _segment_weights, dropout
from pointforge.nn.pvops.bags import sum_bags, weighted_bags
from tests.nn.oracles import embedding_bag_sum, weighted_group_norm_per_element


def test_segment_group_norm_equals_per_example_loop():
    """Values and gradients (float64) of the one-shot weighted GroupNorm over all batch
    elements equal those of the loop over each element's columns."""
    g = torch.Generator().manual_seed(0)
    norm = nn.GroupNorm(8, 16).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g, dtype=torch.float64))
        norm.bias.copy_(torch.randn(16, generator=g, dtype=torch.float64))
    counts = torch.tensor([5, 9, 1, 7])
    segment = torch.repeat_interleave(torch.arange(4), counts)
    weights = torch.randint(1, 5, (segment.numel(),), generator=g).double()
    ends = torch.cumsum(counts, 0).tolist()
    segments = list(zip([0] + ends[:-1], ends))
    x = torch.randn(16, segment.numel(), generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)

    loop = weighted_group_norm_per_element(x, weights, segments, norm)
    batched = _segment_group_norm(x, _segment_weights(weights, segment, 4), segment, norm)
    torch.testing.assert_close(batched, loop, rtol=1e-12, atol=1e-12)
    grads_loop = torch.autograd.grad((loop * probe).sum(), [x, norm.weight, norm.bias])
    grads_batched = torch.autograd.grad((batched * probe).sum(), [x, norm.weight, norm.bias])
    for a, b in zip(grads_batched, grads_loop):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_scatter_bag_backward_equals_embedding_bag_backward():
    """sum_bags' scatter-add gradient equals embedding_bag's own (float64)."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(2 * 27, 5, generator=g, dtype=torch.float64)
    index = torch.randint(0, 27, (2, 8, 40), generator=g)
    weight = torch.rand(2, 8, 40, generator=g, dtype=torch.float64)
    bags = weighted_bags(index, weight, 27)
    probe = torch.linspace(-1, 1, 2 * 5 * 40, dtype=torch.float64).view(2, 5, 40)
    results = []
    for bag_sum in (sum_bags, embedding_bag_sum):
        r = rows.clone().requires_grad_()
        out = bag_sum(r, *bags, 2)
        (out * probe).sum().backward()
        results.append((out.detach(), r.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=1e-12)


def test_dropout_draws_the_mask_of_nn_dropout():
    """Same output, gradient and generator state afterwards as ``nn.Dropout`` from the
    same seed, for point features and channels-last grids; identity in eval mode."""
    for shape, p, layout in [
        ((2, 16, 300), 0.5, torch.contiguous_format),
        ((2, 8, 6, 6, 6), 0.1, torch.channels_last_3d),
    ]:
        x = torch.randn(shape).contiguous(memory_format=layout).requires_grad_(True)
        probe = torch.randn(shape)
        module = nn.Dropout(p)
        outputs = []
        for run in (module, lambda v: dropout(module, v)):
            torch.manual_seed(7)
            y = run(x)
            outputs.append((y, torch.autograd.grad((y * probe).sum(), x)[0], torch.rand(4)))
        for ours, theirs in zip(outputs[1], outputs[0]):
            assert torch.equal(ours, theirs)
        assert 0 < float((outputs[1][0] == 0).float().mean()) < 1
    module.eval()
    assert dropout(module, x) is x


def test_feature_propagation_without_skip_channels_is_the_mlp_of_the_interpolation():
    """The finest level's 0-channel skip adds nothing to the MLP's input: values and
    gradients equal those of the MLP on the interpolated features (float64)."""
    g = torch.Generator().manual_seed(3)
    fp = FeaturePropagation(16, [16, 8]).double()
    centers = torch.randn(2, 16, 20, generator=g, dtype=torch.float64, requires_grad=True)
    indices = torch.randint(0, 20, (2, 3, 50), generator=g)
    weights = torch.rand(2, 3, 50, generator=g, dtype=torch.float64)
    weights = weights / weights.sum(1, keepdim=True)
    skip = torch.zeros(2, 0, 50, dtype=torch.float64)
    interpolated, out = fp.propagate(indices, weights, centers, skip)
    expected_interpolated = (
        centers.gather(2, indices.view(2, 1, -1).expand(-1, 16, -1)).view(2, 16, 3, 50) * weights.unsqueeze(1)
    ).sum(2)
    torch.testing.assert_close(interpolated, expected_interpolated, rtol=1e-12, atol=1e-12)
    expected = fp.mlp(expected_interpolated)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    ours = torch.autograd.grad((out * probe).sum(), [centers, *fp.parameters()])
    reference = torch.autograd.grad((expected * probe).sum(), [centers, *fp.parameters()])
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # With skip channels, they are concatenated after the interpolation.
    fp2 = FeaturePropagation(20, [8]).double()
    extra = torch.randn(2, 4, 50, generator=g, dtype=torch.float64)
    _, out2 = fp2.propagate(indices, weights, centers.detach(), extra)
    torch.testing.assert_close(
        out2, fp2.mlp(torch.cat([expected_interpolated.detach(), extra], 1)), rtol=1e-12, atol=1e-12
    )
