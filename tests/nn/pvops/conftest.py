"""Fixtures of the point-voxel operator tests."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvops.cell_grid import CellGrid
from tests.nn.pvops.cases import OPS_FIXTURE


@pytest.fixture(scope="module")
def ops():
    data = torch.load(OPS_FIXTURE, weights_only=True)
    # What each entry holds (and that float outputs are bit-exact except atomics).
    assert "ball_query" in data["notes"] and "atomicAdd" in data["notes"]
    return data


@pytest.fixture(params=["dense table", "binary search"])
def cell_lookup(request, monkeypatch):
    """Each of the cell grid's two ways to find a cell's points (the same starts and counts)."""
    monkeypatch.setattr(CellGrid, "_DENSE_PER_KEY", 1 << 30 if request.param == "dense table" else 0)
    return request.param
