"""3-NN and its interpolation against upstream's kernels (fixture); the cell grid against the dense search."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvops.three_nn import interpolate_from_neighbors, three_nearest_neighbors
from tests.nn.pvops.cases import close, cloud

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("backend", "method"),
    [("plain", "dense"), ("plain", "grid"), ("compiled", "auto")],
    ids=["dense", "grid", "compiled"],
)
@pytest.mark.parametrize("case", ["three_nn_random", "three_nn_ties", "three_nn_many_ties", "three_nn_m2"])
def test_three_nn_matches_upstream(ops, case, backend, method):
    entry = ops[case]
    i = entry["inputs"]
    indices, weights = three_nearest_neighbors(i["points_coords"], i["centers_coords"], method=method, backend=backend)
    assert torch.equal(indices, entry["indices"].long())
    assert torch.equal(weights, entry["weights"])  # rounded exactly like the kernel
    features = i["centers_features"].clone().requires_grad_()
    out = interpolate_from_neighbors(features, indices, weights)
    close(out, entry["out"])
    out.backward(entry["grad_out"])
    close(features.grad, entry["grad_centers_features"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lattice", [False, True])
def test_three_nn_grid_equals_dense(lattice, cell_lookup):
    points = cloud(4000, 2, lattice)
    centers = points[:, :, ::9].contiguous()
    # Far-away points: their third neighbour lies outside the first cells tried, so the
    # retry with larger cells and the dense fallback are exercised too.
    points = torch.cat([points, points[:, :, :50] * 40.0], 2)
    dense = three_nearest_neighbors(points, centers, method="dense")
    grid = three_nearest_neighbors(points, centers, method="grid")
    assert torch.equal(dense[0], grid[0])
    assert torch.equal(dense[1], grid[1])
