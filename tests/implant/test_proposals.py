"""Implant proposals: complete() maps samples back to the input's coordinates and refuses bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointforge.data.skulls.normalization import bbox_normalization
from pointforge.errors import ConfigError, DataError
from pointforge.implant.proposals import complete
from pointforge.nn.diffusion.samplers.registry import make_sampler
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.tasks.configs import load_train_config
from tests.helpers import CONFIGS


class _Oracle(torch.nn.Module):
    """The exact noise for known clean implant points: every sampler must then return them."""

    def __init__(self, schedule: NoiseSchedule, implant: torch.Tensor):
        super().__init__()
        self.schedule = schedule
        self.implant = implant  # [3, n] normalised
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # complete() reads the device from the parameters
        self.batches = []

    def forward(self, x, t):
        self.batches.append(x.shape[0])
        n = self.implant.shape[1]
        ac = self.schedule.alphas_cumprod_float64[t].reshape(-1, 1, 1).to(x.dtype)
        eps = torch.zeros_like(x)
        eps[:, :, -n:] = (x[:, :, -n:] - ac.sqrt() * self.implant.to(x.dtype)) / (1 - ac).sqrt()
        return eps


@pytest.mark.parametrize("sampler_name, steps", [("ddpm", None), ("ddim", 7), ("dpm++2m", 5)])
def test_complete_maps_samples_back_to_the_input_coordinates(sampler_name, steps):
    rng = np.random.default_rng(0)
    skull = rng.normal(size=(300, 3)) * [40.0, 30.0, 20.0] + [250.0, 260.0, 100.0]  # voxel-like coordinates
    implant = rng.normal(size=(24, 3)) * 5.0 + [250.0, 260.0, 125.0]
    norm = bbox_normalization(skull, 3.0)
    schedule = NoiseSchedule.from_name("linear", 1e-3, 0.2, 50)
    oracle = _Oracle(schedule, torch.from_numpy(norm.apply(implant).T.astype(np.float64)))
    sampler = make_sampler(sampler_name, steps, schedule=schedule)
    gen = torch.Generator().manual_seed(1)
    # All 300 points kept (in a random order), so the bounding box is the one used above.
    out = complete(skull, oracle, sampler, 3, n_skull=300, n_implant=24, generator=gen)
    assert out.shape == (3, 24, 3)
    assert set(oracle.batches) == {3}  # the three proposals in one batched pass
    for proposal in out:
        np.testing.assert_allclose(proposal, implant, atol=2e-3)
    # torch in, torch out; FPS subsampling gives the same box here too
    again = complete(torch.from_numpy(skull), oracle, sampler, 1, n_skull=300, n_implant=24, subsample="fps")
    assert isinstance(again, torch.Tensor) and again.shape == (1, 24, 3)
    np.testing.assert_allclose(again[0].numpy(), implant, atol=2e-3)


def test_complete_refuses_bad_input():
    schedule = NoiseSchedule.from_name("linear", 1e-3, 0.2, 50)
    oracle = _Oracle(schedule, torch.zeros(3, 4))
    sampler = make_sampler("ddim", 5, schedule=schedule)
    good = np.random.default_rng(0).normal(size=(50, 3))
    with pytest.raises(DataError, match=r"\[M, 3\]"):
        complete(good[:, :2], oracle, sampler, n_skull=40, n_implant=4)
    with pytest.raises(DataError, match="NaN"):
        complete(np.full((50, 3), np.nan), oracle, sampler, n_skull=40, n_implant=4)
    with pytest.raises(ConfigError, match="config="):
        complete(good, oracle, sampler)
    with pytest.raises(ConfigError, match="positive integer"):
        complete(good, oracle, sampler, 0, n_skull=40, n_implant=4)
    cfg = load_train_config("pcdiff", CONFIGS / "pcdiff" / "tiny.yaml").task  # trained with T = 1000
    with pytest.raises(ConfigError, match="50-step schedule"):
        complete(good, oracle, sampler, config=cfg)
