"""``task.prior.correct``: training examples diffused from the case's own leave-one-out atlas estimate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointforge.errors import ConfigError
from pointforge.nn.diffusion.loss import training_target
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.pcdiff.correction import (
    effective_noise,
    from_start,
    leave_one_out_estimate,
    paired_to,
)
from pointforge.tasks.pcdiff.frame import FrameSection, atlas_cases, atlas_estimate, build_atlas
from tests.helpers import CONFIGS as REPO_CONFIGS

CONFIGS = REPO_CONFIGS / "pcdiff"
SCHEDULE = NoiseSchedule.from_name("linear", 1e-4, 0.02, 60, prediction="v")


def test_pairing_undoes_a_shuffle_and_keeps_a_shifted_copy_in_order():
    rng = np.random.default_rng(0)
    target = rng.normal(size=(64, 3))
    perm = rng.permutation(64)
    assert np.array_equal(paired_to(target[perm], target), target)
    shifted = target + np.array([0.05, 0.0, 0.0])
    assert np.array_equal(paired_to(shifted[perm], target), shifted)


def test_the_effective_noise_lands_the_truth_on_the_noised_estimate_and_targets_the_truth():
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(3, 3, 16, generator=g, dtype=torch.float64)
    start = clean + torch.randn(3, 3, 16, generator=g, dtype=torch.float64)
    noise = torch.randn(3, 3, 16, generator=g, dtype=torch.float64)
    t = torch.tensor([5, 30, 59])
    eff = effective_noise(SCHEDULE, clean, start, noise, t)
    landed = SCHEDULE.q_sample(clean, t, eff)
    torch.testing.assert_close(landed, SCHEDULE.q_sample(start, t, noise))
    v = training_target(SCHEDULE, clean, eff, t)  # v-prediction: the clean cloud it implies is the truth
    x0 = (
        SCHEDULE.coefficient("sqrt_alphas_cumprod", t, v) * landed
        - SCHEDULE.coefficient("sqrt_one_minus_alphas_cumprod", t, v) * v
    )
    torch.testing.assert_close(x0, clean)


def test_only_the_flagged_examples_get_the_noise_of_their_estimate_diffused_to_the_start_step():
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(4, 3, 8, generator=g)
    start = clean + 5.0
    batch = {"start": start.transpose(1, 2), "from_start": torch.tensor([True, False, True, False])}
    t = torch.tensor([3, 7, 40, 13])
    torch.manual_seed(0)
    noise = from_start(SCHEDULE, clean, batch, t, 40)
    torch.manual_seed(0)
    plain = torch.randn_like(clean)
    ratio = SCHEDULE.coefficient("sqrt_alphas_cumprod", torch.tensor([40]), clean) / SCHEDULE.coefficient(
        "sqrt_one_minus_alphas_cumprod", torch.tensor([40]), clean
    )
    torch.testing.assert_close(noise[[1, 3]], plain[[1, 3]])
    torch.testing.assert_close(noise[[0, 2]], plain[[0, 2]] + ratio * 5.0)
    # At the start step a flagged example is its estimate diffused with the plain noise, as sampling starts.
    torch.testing.assert_close(
        SCHEDULE.q_sample(clean[2:3], 40, noise[2:3]), SCHEDULE.q_sample(start[2:3], 40, plain[2:3])
    )


def test_the_estimate_leaves_out_the_cases_own_skull():
    def shell(center, radius, n, seed):
        v = np.random.default_rng(seed).normal(size=(n, 3))
        return center + radius * v / np.linalg.norm(v, axis=1, keepdims=True)

    own = shell(np.array([5.0, -3.0, 2.0]), 81.0, 3000, 4)
    others = [shell(np.zeros(3), r, 3000, s) for r, s in ((70.0, 1), (90.0, 2))]
    atlas = torch.from_numpy(np.stack([others[0], own, others[1]]).astype(np.float32))
    cap = (own - own.mean(axis=0)) @ np.array([0.6, 0.0, 0.8]) > 81.0 * np.cos(np.deg2rad(30))
    section = FrameSection(atlas_points=1000)
    ids = ["a", "own", "b"]
    left_out = leave_one_out_estimate(atlas, ids, "own", own[~cap], np.ones(3), section, 0.5)
    without = atlas_estimate(atlas[[0, 2]], own[~cap], np.ones(3), section, 0.5)
    every = atlas_estimate(atlas, own[~cap], np.ones(3), section, 0.5)
    assert np.array_equal(left_out.points, without.points)
    assert not np.array_equal(left_out.points, every.points)
    unknown = leave_one_out_estimate(atlas, ids, "new", own[~cap], np.ones(3), section, 0.5)
    assert np.array_equal(unknown.points, every.points)


def test_correct_out_of_range_is_one_config_error():
    with pytest.raises(ConfigError, match=r"task\.prior\.correct"):
        load_train_config("pcdiff", CONFIGS / "tiny.yaml", ["task.frame.scale=0.5", "task.prior.correct=1.5"])


def test_training_items_carry_their_paired_estimate_mirrored_with_them(synthetic_skulls):
    from pointforge.data.skulls.prepared import PreparedDataset
    from pointforge.tasks.pcdiff.dataset import PCDiffDataset
    from pointforge.tasks.pcdiff.frame import PriorSection

    data = PreparedDataset(synthetic_skulls)
    section = FrameSection(atlas_points=500)
    ids = list(atlas_cases(data, "train"))
    atlas = build_atlas(data, "train", section.atlas_points)
    assert len(ids) == atlas.shape[0] == 2  # build_atlas's order and count
    prior = PriorSection(start_step=40, agree=0.5, correct=0.5)
    kw = dict(
        n_skull=256, n_implant=64, half_extent=3.0, frame=section, seed=3, own_estimates=(atlas, ids), prior=prior
    )
    plain, mirrored = PCDiffDataset(data, "train", **kw), PCDiffDataset(data, "train", mirror=True, **kw)
    flags, flips = [], []
    for i in range(len(plain)):
        a, b = plain[i], mirrored[i]
        assert a["start"].shape == (64, 3) and a["start"].dtype == torch.float32
        flip = bool(torch.equal(b["points"][:, 0], -a["points"][:, 0])) and not torch.equal(a["points"], b["points"])
        assert torch.equal(b["start"][:, 0], -a["start"][:, 0] if flip else a["start"][:, 0])
        flags.append(bool(a["from_start"]))
        flips.append(flip)
        implant = a["points"][-64:]
        paired = (a["start"] - implant).norm(dim=1).mean()
        shuffled = (a["start"][torch.randperm(64)] - implant).norm(dim=1).mean()
        assert paired < shuffled  # each estimate point sits next to the true point it is paired with
    assert any(flags) and not all(flags)
    assert any(flips)
