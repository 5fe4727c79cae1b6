"""Fixtures of the diffusion tests: the upstream reference and the closed-form Gaussian case."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import FIXTURES
from tests.nn.diffusion.common import N_COND, N_GEN, exact_flow_endpoint


@pytest.fixture(scope="module")
def upstream():
    ref = torch.load(FIXTURES / "upstream_diffusion_tiny.pt", weights_only=True)
    notes = ref["notes"]
    # The facts these tests rely on, as the fixture states them.
    assert "x[..., :896] = conditioning" in notes and "NO clipping" in notes
    assert "CLAMPED to [-1,1]" in notes and "unique(round(linspace(0,999,50)))[::-1]" in notes
    assert ref["config"]["sv_points"] == 896 and ref["config"]["num_points"] == 1024
    return ref


@pytest.fixture(scope="module")
def gaussian_case():
    gen = torch.Generator().manual_seed(0)
    cond = torch.randn(4, 3, N_COND, generator=gen)
    noise = torch.randn(4, 3, N_GEN, generator=gen)
    return cond, noise, exact_flow_endpoint(cond, noise)
