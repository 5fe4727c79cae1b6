"""``task.prior``: sampling that starts from the atlas estimate of the implant (SDEdit) and training on the steps it uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.pipeline import denoise, sample_ensemble
from pointforge.nn.diffusion.samplers.base import respaced_timesteps
from pointforge.nn.diffusion.samplers.registry import make_sampler
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.pcdiff.frame import PriorSection, estimate_implant, prior_points
from tests.helpers import CONFIGS as REPO_CONFIGS

CONFIGS = REPO_CONFIGS / "pcdiff"
SCHEDULE = NoiseSchedule.from_name("linear", 1e-4, 0.02, 60, prediction="v")


@pytest.mark.parametrize("name,steps", [("ddim", 5), ("dpm++2m", 6), ("ddpm", None)])
def test_a_sampler_with_a_start_spreads_its_steps_below_it_and_the_default_is_unchanged(name, steps):
    started = make_sampler(name, steps, schedule=SCHEDULE, start=30)
    assert int(started.timesteps[0]) == 30 and int(started.timesteps[-1]) == 0
    assert (started.timesteps.diff() < 0).all()
    if steps is None:
        assert started.num_steps == 31
    plain = make_sampler(name, steps, schedule=SCHEDULE)
    if steps is not None:
        assert torch.equal(plain.timesteps, respaced_timesteps(SCHEDULE, steps, plain.spacing))
    assert int(plain.timesteps[0]) == 59
    with pytest.raises(ConfigError, match="start step"):
        make_sampler(name, steps, schedule=SCHEDULE, start=60)


class _Recorder(torch.nn.Module):
    """Predicts v for ``clean`` exactly (so every sampler lands on it) and records what it was shown."""

    def __init__(self, clean: torch.Tensor):
        super().__init__()
        self.clean, self.seen = clean, []

    def forward(self, x, t):
        self.seen.append((x[:, :, -self.clean.shape[-1] :].clone(), t.clone()))
        ac = SCHEDULE.coefficient("alphas_cumprod", t, x)
        gen = x[:, :, -self.clean.shape[-1] :]
        eps = (gen - ac.sqrt() * self.clean) / (1 - ac).sqrt()
        v = ac.sqrt() * eps - (1 - ac).sqrt() * self.clean
        return torch.cat([torch.zeros_like(x[:, :, : -gen.shape[-1]]), v], dim=2)


def test_denoise_from_an_estimate_starts_at_the_estimate_noised_to_the_first_step():
    clean = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    init = clean + 0.1
    noise = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    net = _Recorder(clean)
    sampler = make_sampler("ddim", 4, schedule=SCHEDULE, start=20)
    out = denoise(net, sampler, torch.zeros(2, 3, 5, dtype=torch.float64), 8, noise=noise, init=init)
    first, t = net.seen[0]
    assert t.tolist() == [20, 20]
    torch.testing.assert_close(first, SCHEDULE.q_sample(init, 20, noise))
    torch.testing.assert_close(out[:, :, 5:], clean, rtol=1e-6, atol=1e-6)
    with pytest.raises(DataError, match="init must be"):
        denoise(net, sampler, torch.zeros(2, 3, 5, dtype=torch.float64), 8, init=init[:1])


def test_an_ensemble_takes_one_estimate_per_proposal():
    clean = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    net = _Recorder(clean)
    init = torch.stack([clean[0] + k for k in range(3)])  # [n, C, P]
    sampler = make_sampler("ddim", 2, schedule=SCHEDULE, start=1)
    sample_ensemble(net, sampler, torch.zeros(3, 4, dtype=torch.float64), 8, 3, init=init)
    first, _ = net.seen[0]
    means = first.mean(dim=(1, 2))
    assert means[1] - means[0] > 0.5 and means[2] - means[1] > 0.5  # each proposal started from its own estimate


def test_the_estimate_points_lie_on_the_missing_cap():
    def shell(center, radius, n, seed):
        v = np.random.default_rng(seed).normal(size=(n, 3))
        return center + radius * v / np.linalg.norm(v, axis=1, keepdims=True)

    atlas = [shell(np.zeros(3), r, 6000, s) for r, s in ((78.0, 1), (80.0, 2), (83.0, 3))]
    skull = shell(np.array([5.0, -3.0, 2.0]), 81.0, 8000, 4)
    cap = (skull - skull.mean(axis=0)) @ np.array([0.6, 0.0, 0.8]) > 81.0 * np.cos(np.deg2rad(30))
    found = estimate_implant(skull[~cap], atlas)
    assert len(found.points) > 50
    from scipy.spatial import cKDTree

    to_cap = cKDTree(skull[cap]).query(found.points)[0]
    assert np.median(to_cap) < 6.0  # mm: the estimate's points lie on the missing bone, not around the skull
    drawn = prior_points(found.points, 300, np.random.default_rng(0))
    assert drawn.shape == (300, 3)
    assert len(estimate_implant(skull[~cap], atlas, agree=1.0).points) <= len(found.points)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("task.frame=null task.prior.start_step=100", "needs 'task.frame'"),
        ("task.frame.scale=0.5 task.prior.start_step=1000", "start_step"),
        ("task.frame.scale=0.5 task.prior.agree=0", "agree"),
        ("task.frame.scale=0.5 task.prior.start_step=5 task.eval.steps=10", "eval.steps"),
    ],
)
def test_prior_config_errors(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_train_config("pcdiff", CONFIGS / "tiny.yaml", override.split())


def test_training_with_a_prior_draws_only_the_steps_sampling_uses():
    from pointforge.tasks import get_task

    cfg = load_train_config("pcdiff", CONFIGS / "tiny.yaml", "task.frame.scale=0.5 task.prior.start_step=40".split())
    task = get_task("pcdiff")
    task.configure(cfg.task)
    seen: list[torch.Tensor] = []

    def model(x, t):
        seen.append(t)
        return torch.zeros_like(x)

    torch.manual_seed(0)
    points = torch.randn(64, sum(cfg.task.points), 3)
    for _ in range(5):
        task.training_step(model, {"points": points}, None)
    steps = torch.cat(seen)
    assert int(steps.max()) <= 40 and int(steps.max()) >= 30 and int(steps.min()) <= 10
    assert task.sampler.timesteps[0] == 40  # validation samples from the prior's step too
    assert isinstance(cfg.task.prior, PriorSection)
