"""`pointforge upsample --method`: the geometric baselines from the command line, and the network's gate."""

import laspy
import numpy as np
import pytest
import torch

from pointforge.data.pairs.scenes import synthetic_pair
from pointforge.data.pointio import read_points, write_points
from pointforge.errors import ConfigError
from pointforge.nn.knn import knn_graph
from pointforge.nn.losses import point_to_plane_distance
from pointforge.nn.upsampler import build_upsampler, plane_start
from pointforge.upsampling.baselines import upsample_baseline
from tests.helpers import run_cli, run_cli_process


@pytest.mark.parametrize("method", ["plane", "midpoint", "input"])
def test_a_baseline_densifies_a_file_as_its_function_does(tmp_path, method):
    sparse, _ = synthetic_pair(300, seed=5)
    write_points(tmp_path / "s.npy", sparse)
    result = run_cli("upsample", tmp_path / "s.npy", "--method", method, "--out", tmp_path / "d.npy")
    assert result.exit_code == 0, result.output
    assert "300 → 600 points" in result.output
    assert np.array_equal(read_points(tmp_path / "d.npy").xyz, upsample_baseline(method, sparse, 2))


def test_a_baseline_keeps_the_las_geometry_and_the_ratio(tmp_path):
    sparse, _ = synthetic_pair(200, seed=6)
    write_points(tmp_path / "s.las", sparse, las=None)
    scales = tuple(laspy.read(tmp_path / "s.las").header.scales)
    result = run_cli("upsample", tmp_path / "s.las", "--method", "plane", "--ratio", 3, "--out", tmp_path / "d.laz")
    assert result.exit_code == 0, result.output
    back = laspy.read(tmp_path / "d.laz")
    assert len(back.points) == 600 and tuple(back.header.scales) == scales


def test_a_method_without_what_it_needs_is_one_line(tmp_path):
    write_points(tmp_path / "s.npy", synthetic_pair(50, seed=1)[0])
    code, _, err = run_cli_process("upsample", tmp_path / "s.npy", "--out", tmp_path / "d.npy")
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err
    assert last == "error: give --ckpt (a trained upsampler) or --method plane|midpoint|input (a geometric baseline)"
    for args, says in (
        (("--method", "model"), "--method model needs --ckpt"),
        (("--method", "spline"), "unknown method 'spline'"),
        (("--method", "plane", "--ckpt", tmp_path / "x.pt"), "--method plane uses no checkpoint"),
    ):
        result = run_cli("upsample", tmp_path / "s.npy", "--out", tmp_path / "d.npy", *args)
        assert isinstance(result.exception, ConfigError) and says in str(result.exception)
    assert not (tmp_path / "d.npy").exists()


def test_a_closed_gate_keeps_the_plane_start_and_an_open_one_moves_off_it():
    torch.manual_seed(0)
    pos = torch.randn(200, 3)
    model = build_upsampler("tiny", start="plane", gate=True).eval()
    for head in (model.coarse, model.decode[-1][-1]):
        torch.nn.init.normal_(head.weight, std=0.3)
    edges = knn_graph(pos, model.config.k)
    with torch.no_grad():
        torch.nn.init.zeros_(model.gate.weight)
        model.gate.bias.fill_(-1e4)  # closed
        closed = model(pos, None, edges).points
        model.gate.bias.fill_(1e4)  # open: the plain network's output
        opened = model(pos, None, edges).points
    src, dst = edges
    mean_dist = torch.zeros(200).index_add_(0, dst, (pos[src] - pos[dst]).norm(dim=1))
    mean_dist /= torch.zeros(200).index_add_(0, dst, torch.ones(len(dst)))
    assert torch.allclose(closed, plane_start(pos, edges, mean_dist, 2), atol=1e-6)
    assert (opened - closed).abs().max() > 1e-2
    assert sum(p.numel() for p in model.gate.parameters()) == model.config.hidden + 1
    assert build_upsampler("tiny").gate is None


def test_the_surface_term_is_the_mean_squared_distance_across_the_plane():
    grid = torch.stack(torch.meshgrid(torch.arange(10.0), torch.arange(10.0), indexing="ij"), -1).reshape(-1, 2)
    target = torch.cat([grid, torch.zeros(100, 1)], dim=1)
    pred = target[:20] + torch.tensor([0.0, 0.0, 0.5])
    assert point_to_plane_distance(pred, target).item() == pytest.approx(0.25, abs=1e-5)


def test_plane_k_puts_the_parents_where_the_plane_fit_baseline_does():
    rng = np.random.default_rng(0)
    xyz = np.column_stack([rng.uniform(0, 20, (400, 2)), rng.normal(0, 0.3, 400)])
    xyz[:100, 2] += rng.uniform(0, 5, 100)  # a rough patch, where the symmetrised graph's extra edges tilt planes
    pos = torch.from_numpy(xyz)
    edges = knn_graph(pos, 10)
    model = build_upsampler("tiny", start="plane", plane_k=10).double()
    for head in (model.coarse, model.decode[-1][-1]):
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    with torch.no_grad():
        parents = model(pos, None, edges).points.numpy()[::2]
        graph_parents = build_upsampler("tiny", start="plane").double()(pos, None, edges).points.detach().numpy()[::2]
    want = upsample_baseline("plane", xyz, 2)[: len(xyz)]
    assert np.abs(parents - want).max() < 1e-6
    assert np.abs(graph_parents - want).max() > 1e-2
    with pytest.raises(ConfigError, match="plane_k"):
        build_upsampler("tiny", plane_k=2)
