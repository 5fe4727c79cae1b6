"""The node-shuffle upsampler: shapes on disjoint batches, no leaks between clouds, it learns; the plane start."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from pointforge.data.pairs.normalization import pair_normalization
from pointforge.data.pairs.scenes import SyntheticScene, synthetic_pair
from pointforge.errors import ConfigError, DataError
from pointforge.nn.knn import knn_graph
from pointforge.nn.losses import chamfer_distance
from pointforge.nn.upsampler import (
    PRESETS,
    NodeShuffleUpsampler,
    UpsamplerConfig,
    build_upsampler,
    child_graph,
    plane_start,
)
from pointforge.upsampling.baselines import plane_fit
from pointforge.upsampling.metrics import cloud_metrics
from pointforge.upsampling.pipeline import upsample_cloud

pytestmark = pytest.mark.usefixtures("one_thread")


SIZES = [50, 500, 2000]


def _clouds(seed=0):
    gen = torch.Generator().manual_seed(seed)
    clouds = [torch.randn(n, 3, generator=gen) * (n**0.5) / 3 for n in SIZES]
    batch = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    return clouds, torch.cat(clouds), batch


def _model(**overrides):
    torch.manual_seed(0)
    model = build_upsampler("tiny", **overrides)
    # Random output heads: the default near-zero init would hide leaks behind tiny offsets.
    for head in (model.coarse, model.decode[-1][-1]):
        torch.nn.init.normal_(head.weight, std=0.3)
    return model.eval()


@pytest.mark.parametrize("ratio", [2, 3])
def test_output_is_ratio_times_input_per_cloud(ratio):
    _, pos, batch = _clouds()
    model = _model(ratio=ratio)
    with torch.no_grad():
        out = model(pos, batch)
    assert out.points.shape == (ratio * sum(SIZES), 3)
    assert torch.equal(torch.bincount(out.batch), torch.tensor(SIZES) * ratio)
    assert torch.all(out.batch[1:] >= out.batch[:-1])
    # Children of point p are rows p*r .. p*r + r-1: they stay near their parent.
    offsets = out.points.reshape(-1, ratio, 3) - pos.unsqueeze(1)
    assert offsets.abs().max() < 20 and offsets.abs().max() > 0


@pytest.mark.parametrize("start", ["input", "plane"])
def test_no_information_leaks_between_clouds(start):
    clouds, pos, batch = _clouds()
    model = _model(start=start)
    with torch.no_grad():
        base = model(pos, batch).points
        perturbed = pos.clone()
        perturbed[SIZES[0] : SIZES[0] + SIZES[1]] += torch.randn(SIZES[1], 3) * 0.5
        moved = model(perturbed, batch).points
        alone = [model(c).points for c in clouds]
    r = model.config.ratio

    def pieces(t):
        return torch.split(t, [r * n for n in SIZES])

    b0, b1, b2 = pieces(base)
    m0, m1, m2 = pieces(moved)
    assert torch.allclose(b0, m0, atol=1e-6, rtol=0) and torch.allclose(b2, m2, atol=1e-6, rtol=0)
    assert not torch.allclose(b1, m1, atol=1e-3)
    # Batched equals one cloud at a time.
    for got, want in zip((b0, b1, b2), alone):
        assert torch.allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("start", ["input", "plane"])
def test_precomputed_graph_equals_internal_one_and_translation_is_equivariant(start):
    _, pos, batch = _clouds(1)
    model = _model(start=start)
    edges = knn_graph(pos, model.config.k, batch)
    with torch.no_grad():
        a = model(pos, batch).points
        b = model(pos, batch, edges).points
        shift = torch.tensor([3.0, -2.0, 1.0])
        c = model(pos + shift, batch, edges).points
    assert torch.equal(a, b)
    assert torch.allclose(c - shift, a, atol=1e-4, rtol=0)


def test_every_parameter_gets_a_gradient():
    # DDP needs every parameter used in every step (no find_unused_parameters).
    _, pos, batch = _clouds(2)
    model = build_upsampler("tiny", dropout=0.1).train()
    out = model(pos[:600], batch[:600])
    out.points.pow(2).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


@pytest.mark.parametrize("settings", [dict(concat=False), dict(beta=False), dict(heads=4, hidden=8, concat=True)])
def test_attention_settings_build_and_run(settings):
    _, pos, batch = _clouds(3)
    model = _model(**settings)
    with torch.no_grad():
        out = model(pos[:100], batch[:100])
    assert out.points.shape == (200, 3) and torch.isfinite(out.points).all()


def test_dropout_acts_only_in_training():
    _, pos, _ = _clouds(4)
    model = _model(dropout=0.5)
    x = pos[:200]
    with torch.no_grad():
        assert torch.equal(model(x).points, model(x).points)
        model.train()
        torch.manual_seed(1)
        first = model(x).points
        torch.manual_seed(2)
        assert not torch.equal(first, model(x).points)


def test_config_validation_and_presets():
    with pytest.raises(ConfigError, match="divisible"):
        UpsamplerConfig(hidden=30, heads=4)
    with pytest.raises(ConfigError, match="preset"):
        UpsamplerConfig.preset("huge")
    with pytest.raises(ConfigError, match="unknown upsampler config field"):
        UpsamplerConfig.preset("tiny", hiden=8)
    with pytest.raises(ConfigError, match="ratio"):
        UpsamplerConfig(ratio=0)
    with pytest.raises(ConfigError, match="start must be one of input, plane"):
        UpsamplerConfig(start="mesh")
    assert {"tiny", "small", "paper"} <= set(PRESETS)
    sizes = [sum(p.numel() for p in NodeShuffleUpsampler(PRESETS[n]).parameters()) for n in ("tiny", "small", "paper")]
    assert sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(DataError, match=r"\[N, 3\]"):
        build_upsampler("tiny")(torch.zeros(5, 2))


def test_child_graph_links_same_copies_and_siblings():
    edges = torch.tensor([[1], [0]])  # 1 -> 0
    got = set(map(tuple, child_graph(edges, 2, 2).t().tolist()))
    assert got == {(2, 0), (3, 1), (1, 0), (0, 1), (3, 2), (2, 3)}


def test_tiny_model_overfits_one_pair():
    sparse, dense = synthetic_pair(64, seed=0, scene=SyntheticScene())
    edges = knn_graph(torch.from_numpy(sparse - sparse.min(axis=0)), 10)
    norm = pair_normalization(sparse, "spacing", edges.numpy())
    pos, target = torch.from_numpy(norm.apply(sparse)), torch.from_numpy(norm.apply(dense))
    torch.manual_seed(0)
    model = build_upsampler("tiny")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss = chamfer_distance(model(pos, None, edges).points, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # The start is "every child on its parent"; three times lower means it placed new points.
    assert np.mean(losses[-5:]) < losses[0] / 3, (losses[0], losses[-5:])


def test_upsample_cloud_returns_source_coordinates():
    sparse, _ = synthetic_pair(300, seed=5)
    model = build_upsampler("tiny")
    out = upsample_cloud(model, sparse)
    assert out.dtype == np.float64 and out.shape == (600, 3)
    # An untrained model keeps children within a fraction of a point spacing of their parents.
    assert np.abs(out - np.repeat(sparse, 2, axis=0)).max() < 0.1
    assert model.training


def _noisy_plane(n=400, seed=0):
    """Points on the tilted plane z = 0.3x − 0.2y, with noise across it; the plane's unit normal."""
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 20, (n, 2))
    normal = np.array([-0.3, 0.2, 1.0]) / np.linalg.norm([-0.3, 0.2, 1.0])
    pos = np.c_[xy, 0.3 * xy[:, 0] - 0.2 * xy[:, 1]] + rng.normal(scale=0.1, size=(n, 1)) * normal
    return torch.from_numpy(pos), normal


@pytest.mark.parametrize("ratio", [2, 3])
def test_plane_start_puts_children_on_the_local_plane_around_their_parent(ratio):
    pos, normal = _noisy_plane()
    edges = knn_graph(pos, 10)
    src, dst = edges
    mean_dist = torch.zeros(len(pos), dtype=pos.dtype).index_add_(0, dst, (pos[src] - pos[dst]).norm(dim=1))
    mean_dist = mean_dist / torch.bincount(dst, minlength=len(pos))
    children = plane_start(pos, edges, mean_dist, ratio).numpy().reshape(-1, ratio, 3)
    height = lambda p: p @ normal  # noqa: E731  (signed distance to the true plane through the origin)
    # Projection removes most of the noise across the surface (0.1 before), for every child.
    assert np.abs(height(pos.numpy())).mean() > 0.07
    assert np.abs(height(children)).mean() < 0.04
    # Child 0 is the parent moved across the plane only; the others lie mean_dist / 2 from it, in the plane.
    moved = children[:, 0] - pos.numpy()
    assert np.linalg.norm(moved - np.outer(moved @ normal, normal), axis=1).max() < 0.05
    spokes = children[:, 1:] - children[:, :1]
    assert np.allclose(np.linalg.norm(spokes, axis=2), mean_dist.numpy()[:, None] / 2, rtol=1e-6)
    if ratio == 3:  # two children: opposite sides of their parent
        assert np.allclose((spokes[:, 0] * spokes[:, 1]).sum(axis=1), -((mean_dist.numpy() / 2) ** 2), rtol=1e-5)
    else:  # the one child points away from the parent's nearest neighbour
        nearest = cKDTree(pos.numpy()).query(pos.numpy(), k=2)[1][:, 1]
        assert ((spokes[:, 0] * (pos.numpy() - pos.numpy()[nearest])).sum(axis=1) > 0).all()


def test_plane_start_model_starts_as_a_plane_fit_and_scores_like_the_baseline():
    # Output heads at zero: the network's output is its start exactly.
    sparse, dense = synthetic_pair(2000, seed=11)
    model = build_upsampler("tiny", start="plane").eval()
    for head in (model.coarse, model.decode[-1][-1]):
        torch.nn.init.zeros_(head.weight)
    out = upsample_cloud(model, sparse)
    edges = knn_graph(torch.from_numpy(sparse - sparse.min(axis=0)), 10)
    norm = pair_normalization(sparse, "spacing", edges.numpy())
    pos = torch.from_numpy(norm.apply(sparse))
    src, dst = edges
    mean_dist = torch.zeros(len(pos), dtype=pos.dtype).index_add_(0, dst, (pos[src] - pos[dst]).norm(dim=1))
    want = norm.inverse(plane_start(pos, edges, mean_dist / torch.bincount(dst, minlength=len(pos)), 2))
    assert np.abs(out - want).max() < 1e-6
    # As close to the surface as the plane-fit baseline, and far closer than the noisy input.
    ours, baseline = cloud_metrics(out, dense), cloud_metrics(plane_fit(sparse, 2), dense)
    assert ours.p2s < 1.1 * baseline.p2s and ours.chamfer < 1.1 * baseline.chamfer
    assert ours.p2s < 0.7 * cloud_metrics(sparse, dense).p2s
