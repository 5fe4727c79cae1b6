"""PVCNN2 against upstream (tiny fixture, paper key list)."""

from __future__ import annotations

import ast

import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn import pvcnn, pvcnn_blocks, pvcnn_config
from pointforge.nn.pvcnn import PVCNN2
from pointforge.nn.pvcnn_blocks import SetAbstraction
from pointforge.nn.pvcnn_config import PVCNN2Config, get_preset
from pointforge.nn.pvcnn_upstream import expected_shapes
from pointforge.nn.pvops import ball_query, fps, three_nn
from tests.helpers import FIXTURES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_model(tiny):
    model = PVCNN2("tiny")
    model.load_state_dict(tiny["state_dict"], strict=True)
    return model.eval()


def _upstream_keys() -> list[tuple[str, tuple[int, ...], str]]:
    rows = []
    for line in (FIXTURES / "upstream_pvcnn2_keys.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, shape, dtype = line.split("\t")
        rows.append((key, tuple(ast.literal_eval(shape)), dtype.strip()))
    return rows


# --------------------------------------------------------------------------- structure


def test_paper_preset_reproduces_upstream_keys_shapes_dtypes():
    with torch.device("meta"):
        model = PVCNN2("paper")
    ours = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()]
    upstream = _upstream_keys()
    assert len(upstream) == 296
    assert ours == upstream  # names, order, shapes, dtypes
    assert sum(p.numel() for p in model.parameters()) == 27_648_963
    assert not list(model.buffers())


def test_tiny_preset_is_the_fixture_network(tiny):
    cfg = tiny["config"]
    from_fixture = PVCNN2Config.from_upstream(
        cfg["sa_blocks"], cfg["fp_blocks"], **{k: v for k, v in cfg["ctor_kwargs"].items() if k != "sv_points"}
    )
    assert from_fixture == get_preset("tiny")


def test_upstream_quirks_are_kept():
    paper = get_preset("paper")
    # One PVConv block in SA levels after the first, whatever upstream's tuple says.
    assert [lvl.conv.num_blocks if lvl.conv else 0 for lvl in paper.sa_levels] == [2, 1, 1, 0]
    # Voxel attention only in the second SA level; none in FP levels (never fires upstream).
    assert [lvl.voxel_attention for lvl in paper.sa_levels] == [False, True, False, False]
    keys = expected_shapes("paper")
    assert "sa_layers.1.0.voxel_layers.6.q.weight" in keys
    assert not any(".voxel_layers.6.q." in k for k in keys if k.startswith("fp_layers."))


def test_presets_build_and_run():
    for name, points in [("small", 3840), ("tiny", 1024)]:
        model = PVCNN2(name).eval()
        x = torch.randn(2, 3, points)
        with torch.no_grad():
            y = model(x, torch.tensor([3, 900]))
        assert y.shape == (2, 3, points) and torch.isfinite(y).all()
    counts = {name: sum(p.numel() for p in PVCNN2(name).parameters()) for name in ("small", "tiny")}
    assert counts == {"small": 6_924_259, "tiny": 609_755}


def test_config_round_trip_and_validation():
    paper = get_preset("paper")
    assert PVCNN2Config.from_dict(paper.to_dict()) == paper
    assert pvcnn_config.resolve_config(paper.to_dict()) == paper
    with pytest.raises(ConfigError, match="unknown PVCNN2 preset"):
        get_preset("huge")
    with pytest.raises(ConfigError, match="multiple of 8"):
        PVCNN2Config.from_upstream(
            [((12, 1, 8), (16, 0.1, 8, (16,)))], [((16,), (16, 1, 8))], embed_dim=8, use_att=False
        )
    with pytest.raises(ConfigError, match="as many FP levels"):
        PVCNN2Config.from_upstream([((16, 1, 8), (16, 0.1, 8, (16,)))], [], embed_dim=8, use_att=False)


def test_bad_inputs_raise_data_error(tiny_model):
    with pytest.raises(DataError, match=r"\[B, 3, N\]"):
        tiny_model(torch.randn(1, 4, 1024), torch.tensor([1]))
    with pytest.raises(DataError, match="at least 256 points"):
        tiny_model(torch.randn(1, 3, 100), torch.tensor([1]))
    with pytest.raises(DataError, match="t of shape"):
        tiny_model(torch.randn(2, 3, 1024), torch.tensor([1]))


# --------------------------------------------------------------------------- against upstream's output


def test_tiny_reproduces_upstream_output(tiny, tiny_model):
    with torch.no_grad():
        y = tiny_model(tiny["x"], tiny["t"])
    assert y.shape == tiny["y"].shape == (2, 3, 1024)  # every point, conditioning included
    torch.testing.assert_close(y, tiny["y"], atol=1e-4, rtol=1e-4)
    # The fork's CPU fallback computes another function (notes: differs by ~2.6).
    assert (y - tiny["y_fork_cpu_backend"]).abs().max() > 0.1


def test_tiny_reproduces_upstream_float64_output(tiny):
    model = PVCNN2("tiny").double()
    model.load_state_dict(tiny["state_dict"])
    with torch.no_grad():
        y = model.eval()(tiny["x"].double(), tiny["t"])
    torch.testing.assert_close(y, tiny["y_float64"], atol=1e-9, rtol=1e-9)


def _record(monkeypatch):
    calls = []

    def wrap(module, name, fn):
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append((name, args, out))
            return out

        monkeypatch.setattr(module, name, recorded)

    for module, name in (
        (fps, "furthest_point_sample_indices"),
        (ball_query, "ball_query"),
        (three_nn, "three_nearest_neighbors"),
    ):
        wrap(module, name, getattr(module, name))
    return calls


def test_tiny_discrete_intermediates_equal_upstream(tiny, tiny_model, monkeypatch):
    calls = _record(monkeypatch)
    with torch.no_grad():
        tiny_model(tiny["x"], tiny["t"])
    # Upstream interpolates features and embedding separately with the same neighbours;
    # we interpolate them together, so each of our 3-NN calls stands for two of theirs.
    upstream = [c for c in tiny["intermediates"] if c["op"] != "three_nearest_neighbors_interpolate_forward"]
    upstream_nn = [c for c in tiny["intermediates"] if c["op"] == "three_nearest_neighbors_interpolate_forward"]
    ours = [c for c in calls if c[0] != "three_nearest_neighbors"]
    ours_nn = [c for c in calls if c[0] == "three_nearest_neighbors"]
    assert [c[0] for c in ours] == ["furthest_point_sample_indices", "ball_query"] * 4
    assert len(upstream) == 8 and len(ours_nn) * 2 == len(upstream_nn) == 8
    for (name, args, out), ref in zip(ours, upstream):
        if name == "ball_query":
            torch.testing.assert_close(args[0], ref["centers_coords"], rtol=0, atol=0)
            assert torch.equal(out, ref["indices"].long())
        else:
            torch.testing.assert_close(args[0], ref["coords"], rtol=0, atol=0)
            assert torch.equal(out, ref["indices"].long())
    for i, (_, args, (indices, weights)) in enumerate(ours_nn):
        for ref in upstream_nn[2 * i : 2 * i + 2]:
            torch.testing.assert_close(args[0], ref["points_coords"], rtol=0, atol=0)
            assert torch.equal(indices, ref["indices"].long())
            assert torch.equal(weights, ref["weights"])


def test_ops_on_the_fixture_intermediates(tiny):
    # Independently of our forward: every recorded upstream call, replayed through our ops.
    for call in tiny["intermediates"]:
        if call["op"] == "furthest_point_sampling":
            out = fps.furthest_point_sample_indices(call["coords"], call["num_samples"])
            assert torch.equal(out, call["indices"].long())
        elif call["op"] == "ball_query":
            for method in ("dense", "grid"):
                out = ball_query.ball_query(
                    call["centers_coords"], call["points_coords"], call["radius"], call["num_neighbors"], method=method
                )
                assert torch.equal(out, call["indices"].long())
        else:
            for method in ("dense", "grid"):
                indices, weights = three_nn.three_nearest_neighbors(
                    call["points_coords"], call["centers_coords"], method=method
                )
                assert torch.equal(indices, call["indices"].long())
                assert torch.equal(weights, call["weights"])


def _set_distinct_slots(model, value):
    for m in model.modules():
        if isinstance(m, SetAbstraction):
            m.distinct_slots = value


def test_distinct_slot_fast_path_equals_upstream_dense_path(tiny):
    """Same output and gradients (float64, so that rounding cannot hide a difference)."""
    model = PVCNN2("tiny").double().eval()
    model.load_state_dict(tiny["state_dict"])
    results = []
    for distinct in (True, False):
        _set_distinct_slots(model, distinct)
        model.zero_grad()
        x = tiny["x"].double().clone().requires_grad_()
        y = model(x, tiny["t"])
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        results.append((y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
    (y1, gx1, gp1), (y2, gx2, gp2) = results
    torch.testing.assert_close(y1, y2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx1, gx2, rtol=1e-9, atol=1e-9 * gx2.abs().max().item())
    scale = max(g.abs().max().item() for g in gp2)
    for a, b in zip(gp1, gp2):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9 * scale)


def test_training_mode_backward_runs(tiny):
    model = PVCNN2("tiny").train()
    x = tiny["x"].clone()
    y = model(x, tiny["t"])
    loss = (y[:, :, -128:] ** 2).mean()  # a diffusion loss touches the generated points
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_direct_onednn_conv3d_equals_pytorch_conv3d():
    conv = torch.nn.Conv3d(16, 8, 3, padding=1)
    x = torch.randn(2, 16, 6, 6, 6).contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    y = pvcnn_blocks._conv3d(conv, x)
    grads = torch.autograd.grad(y.square().sum(), [x, conv.weight, conv.bias])
    # Reference: PyTorch's convolution in float64 (never oneDNN).
    conv64 = torch.nn.Conv3d(16, 8, 3, padding=1).double()
    conv64.load_state_dict(conv.state_dict())
    x64 = x.detach().double().requires_grad_()
    y64 = pvcnn_blocks._conv3d(conv64, x64)
    grads64 = torch.autograd.grad(y64.square().sum(), [x64, conv64.weight, conv64.bias])
    torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, grads64):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-4)
    assert pvcnn_blocks._use_mkldnn(x) == (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def test_conv3d_traces_under_torch_compile():
    # Dynamo cannot trace the direct oneDNN call (its fake kernel rejects fake tensors), so
    # a compiled PVCNN2 takes the ordinary convolution; fullgraph: no graph break either.
    conv = torch.nn.Conv3d(4, 8, 3, padding=1)
    x = torch.randn(2, 4, 5, 5, 5)
    compiled = torch.compile(lambda grid: pvcnn_blocks._conv3d(conv, grid), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), conv(x), rtol=1e-5, atol=1e-5)


def test_timestep_embedding_matches_upstream_formula():
    t = torch.tensor([0, 1, 999])
    emb = pvcnn.timestep_embedding(t, 64)
    half = torch.exp(
        torch.arange(32, dtype=torch.float64) * -(torch.log(torch.tensor(10000.0, dtype=torch.float64)) / 31)
    ).float()
    expected = torch.cat([torch.sin(t[:, None] * half), torch.cos(t[:, None] * half)], 1)
    assert torch.equal(emb, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_on_cuda_matches_upstream(tiny, tiny_model):
    model = PVCNN2("tiny").cuda().eval()
    model.load_state_dict(tiny["state_dict"])
    with torch.no_grad():
        y = model(tiny["x"].cuda(), tiny["t"].cuda())
    torch.testing.assert_close(y.cpu(), tiny["y"], atol=1e-4, rtol=1e-4)
