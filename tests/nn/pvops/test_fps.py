"""Furthest point sampling against upstream's kernel (fixture) and its backends against each other."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvops.fps import furthest_point_sample_indices
from tests.nn.pvops.cases import cloud

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("backend", "method"),
    [("plain", "torch"), ("plain", "numpy"), ("compiled", "auto")],
    ids=["torch", "numpy", "compiled"],
)
@pytest.mark.parametrize("case", ["fps_random", "fps_lattice_ties", "fps_duplicates"])
def test_furthest_point_sampling_matches_upstream(ops, case, backend, method):
    entry = ops[case]
    coords, samples = entry["inputs"]["coords"], entry["inputs"]["num_samples"]
    out = furthest_point_sample_indices(coords, samples, backend=backend, method=method)
    # Exact order, ties included: the lattice case has N = 1331 > 512, so the
    # "smallest index modulo 512 first" rule decides many picks.
    assert torch.equal(out, entry["out"].long())


def test_fps_backends_agree_beyond_512_points():
    coords = cloud(1500, 3, lattice=True)
    a = furthest_point_sample_indices(coords, 300, method="torch")
    b = furthest_point_sample_indices(coords, 300, method="numpy")
    assert torch.equal(a, b)
    assert a[:, 0].eq(0).all()
    assert all(len(set(row.tolist())) == 300 for row in a)  # distinct while points remain


def test_fps_more_samples_than_points_repeats_index_zero():
    coords = torch.rand(1, 3, 5)
    out = furthest_point_sample_indices(coords, 8)
    assert sorted(out[0, :5].tolist()) == [0, 1, 2, 3, 4]
    assert out[0, 5:].tolist() == [0, 0, 0]
