"""Trilinear devoxelisation against upstream's kernel (fixture)."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvops.devoxelize import trilinear_corners, trilinear_devoxelize
from tests.nn.pvops.cases import close

pytestmark = pytest.mark.usefixtures("one_thread")


def test_trilinear_devoxelize_matches_upstream(ops):
    entry = ops["trilinear"]
    i = entry["inputs"]
    r = i["resolution"]
    indices, weights = trilinear_corners(i["coords"], r)
    assert torch.equal(indices, entry["inds"].long())
    assert torch.equal(weights, entry["wgts"])
    b, c = i["features"].shape[:2]
    features = i["features"].clone().requires_grad_()
    out = trilinear_devoxelize(features.view(b, c, r, r, r), i["coords"], r)
    close(out, entry["out"])
    out.backward(entry["grad_out"])
    close(features.grad, entry["grad_features"], rtol=1e-5, atol=1e-6)
