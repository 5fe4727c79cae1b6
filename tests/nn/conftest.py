"""Fixtures of the network tests: `tiny`, upstream's tiny PVCNN2 (weights, inputs, outputs)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import FIXTURES


@pytest.fixture(scope="module")
def tiny():
    data = torch.load(FIXTURES / "upstream_pvcnn2_tiny.pt", weights_only=True)
    # The notes say: eval mode, y covers all 1024 points, 896 conditioning + 128 generated.
    assert "eval" in data["notes"] and data["config"]["sv_points"] == 896
    return data
