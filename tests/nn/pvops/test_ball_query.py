"""Ball query against upstream's kernel (fixture) and its cell grid against the dense search."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvops.ball_query import ball_query
from tests.nn.pvops.cases import cloud

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method", ["dense", "grid"])
def test_ball_query_matches_upstream(ops, method):
    case = ops["ball_query"]
    i = case["inputs"]
    out = ball_query(i["centers_coords"], i["points_coords"], i["radius"], i["num_neighbors"], method=method)
    assert out.dtype == torch.long
    assert torch.equal(out, case["out"].long())
    # The fixture holds empty balls (all zeros) and partly filled ones.
    assert (case["out"] == 0).all(-1).any()


@pytest.mark.parametrize("lattice", [False, True])
def test_ball_query_grid_equals_dense(lattice, cell_lookup):
    points = cloud(3000, 1, lattice)
    centers = points[:, :, ::7]
    for radius, u in [(0.05, 8), (0.3, 32), (0.25, 200)]:
        dense = ball_query(centers, points, radius, u, method="dense")
        grid = ball_query(centers, points, radius, u, method="grid")
        assert torch.equal(dense, grid)
    assert (dense[:, :, 1:] == dense[:, :, :1]).all(-1).any()  # some partly filled balls
