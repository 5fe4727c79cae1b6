"""Points averaged into voxels against upstream's ``avg_voxelize`` kernel (fixture)."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvops.averaging import average_into_voxels, flat_voxel_index, voxel_point_counts
from tests.nn.pvops.cases import close

pytestmark = pytest.mark.usefixtures("one_thread")


def test_averaging_matches_upstream(ops):
    entry = ops["avg_voxelize"]
    i = entry["inputs"]
    r = i["resolution"]
    index = flat_voxel_index(i["coords"], r)
    assert torch.equal(index, entry["ind"].long())
    assert torch.equal(voxel_point_counts(index, r), entry["cnt"].long())
    features = i["features"].clone().requires_grad_()
    grid = average_into_voxels(features, i["coords"], r)
    assert grid.shape == (2, features.shape[1], r, r, r)
    b, c = grid.shape[:2]
    close(grid.reshape(b, c, -1), entry["out"])
    grid.reshape(b, c, -1).backward(entry["grad_out"])
    close(features.grad, entry["grad_features"])
