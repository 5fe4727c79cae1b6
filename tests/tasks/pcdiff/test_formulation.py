"""PCDiff's formulation options: x0/v prediction, zero-terminal-SNR and cosine schedules,
loss weightings, the condition mark, and the local implant frame with its atlas estimate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointforge.errors import ConfigError
from pointforge.nn.diffusion.conditioning import MarkConditioning, network_output
from pointforge.nn.diffusion.loss import diffusion_loss
from pointforge.nn.diffusion.pipeline import denoise
from pointforge.nn.diffusion.samplers.registry import make_sampler
from pointforge.nn.diffusion.schedule import NoiseSchedule, rescale_zero_terminal_snr
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.pcdiff.frame import (
    FramedDenoiser,
    FrameSection,
    LocalFrame,
    bent,
    estimate_implant,
    frame_condition,
    main_pieces,
    nearest_indices,
)
from pointforge.tasks.pcdiff.placement import condition_use, placement_metrics
from tests.helpers import CONFIGS as REPO_CONFIGS

CONFIGS = REPO_CONFIGS / "pcdiff"


# --------------------------------------------------------------------------- schedules and predictions


def test_zero_terminal_snr_keeps_the_first_step_and_leaves_no_signal_at_the_last():
    base = NoiseSchedule.from_name("linear", 1e-4, 0.02, 1000)
    zero = NoiseSchedule.from_name("linear", 1e-4, 0.02, 1000, prediction="v", zero_terminal_snr=True)
    assert float(zero.alphas_cumprod_float64[-1]) == 0.0
    assert math.isclose(float(zero.alphas_cumprod_float64[0]), float(base.alphas_cumprod_float64[0]), rel_tol=1e-9)
    assert bool((zero.alphas_cumprod_float64.diff() < 0).all())
    assert rescale_zero_terminal_snr(base.betas_float64.numpy())[-1] == 1.0
    with pytest.raises(ConfigError, match="x0 or v"):
        NoiseSchedule.from_name("linear", zero_terminal_snr=True)  # ε cannot say where points are at zero SNR


def test_cosine_schedule_is_monotone_and_capped():
    betas = NoiseSchedule.from_name("cosine", num_timesteps=100).betas_float64
    assert float(betas.max()) <= 0.999 and float(betas.min()) > 0
    assert bool((NoiseSchedule.from_name("cosine", num_timesteps=100).alphas_cumprod_float64.diff() < 0).all())


class _Exact(torch.nn.Module):
    """Returns the exact prediction target for clean generated points ``clean`` [C, n]."""

    def __init__(self, schedule: NoiseSchedule, clean: torch.Tensor):
        super().__init__()
        self.schedule, self.clean = schedule, clean

    def forward(self, x, t):
        n = self.clean.shape[1]
        x_gen = x[:, :, -n:]
        ac = self.schedule.alphas_cumprod_float64[t].reshape(-1, 1, 1).to(x.dtype)
        a, s = ac.sqrt(), (1 - ac).sqrt()
        x0 = self.clean.to(x.dtype).expand_as(x_gen)
        eps = (x_gen - a * x0) / s
        out = {"eps": eps, "x0": x0, "v": a * eps - s * x0}[self.schedule.prediction]
        return torch.cat([torch.zeros_like(x[:, :, :-n]), out], dim=2)


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
def test_eps_and_x0_recover_noise_and_clean_points_from_any_parameterisation(prediction):
    schedule = NoiseSchedule.from_name("linear", 1e-4, 0.02, 100, prediction=prediction)
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(3, 16, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 3, 16, generator=g, dtype=torch.float64)
    t = torch.tensor([3, 80])
    x_t = schedule.q_sample(clean.expand(2, -1, -1), t, noise)
    x = torch.cat([torch.zeros(2, 3, 5, dtype=torch.float64), x_t], dim=2)
    eps, x0 = schedule.eps_and_x0(network_output(_Exact(schedule, clean), x, t, 16), t, x_t)
    torch.testing.assert_close(eps, noise, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x0, clean.expand(2, -1, -1), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("prediction,zero_snr", [("x0", False), ("v", False), ("v", True), ("x0", True)])
@pytest.mark.parametrize("sampler,steps", [("ddpm", None), ("ddim", 8), ("dpm++2m", 6)])
def test_every_sampler_lands_on_the_clean_points_under_an_exact_model(prediction, zero_snr, sampler, steps):
    schedule = NoiseSchedule.from_name("linear", 1e-4, 0.02, 60, prediction=prediction, zero_terminal_snr=zero_snr)
    clean = torch.randn(3, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cond = torch.zeros(2, 3, 4, dtype=torch.float64)
    out = denoise(
        _Exact(schedule, clean),
        make_sampler(sampler, steps, schedule=schedule),
        cond,
        12,
        generator=torch.Generator().manual_seed(2),
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :, 4:], clean.expand(2, -1, -1), rtol=1e-6, atol=1e-6)


def test_loss_targets_and_weightings():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 10, generator=g)
    noise = torch.randn(2, 3, 6, generator=g)
    t = torch.tensor([5, 40])
    zero = lambda x, t: torch.zeros_like(x)  # noqa: E731  (predicts 0: the loss is the target's mean square)
    for prediction in ("eps", "x0", "v"):
        schedule = NoiseSchedule.from_name("linear", 1e-4, 0.02, 50, prediction=prediction)
        a = schedule.coefficient("sqrt_alphas_cumprod", t, noise)
        s = schedule.coefficient("sqrt_one_minus_alphas_cumprod", t, noise)
        target = {"eps": noise, "x0": x0[:, :, 4:], "v": a * noise - s * x0[:, :, 4:]}[prediction]
        plain = diffusion_loss(zero, schedule, x0, 6, t=t, noise=noise, reduction="none")
        torch.testing.assert_close(plain, target.pow(2).mean(dim=(1, 2)))
        snr = schedule.snr(t, noise).reshape(-1)
        natural = {"eps": snr, "x0": torch.ones_like(snr), "v": snr + 1}[prediction]
        for weighting, wanted in (("min_snr", snr.clamp_max(5.0)), ("trunc_snr", snr.clamp_min(1.0))):
            weighted = diffusion_loss(zero, schedule, x0, 6, t=t, noise=noise, reduction="none", weighting=weighting)
            torch.testing.assert_close(weighted, plain * wanted / natural)
    with pytest.raises(ConfigError, match="loss weighting"):
        diffusion_loss(zero, schedule, x0, 6, weighting="snr")


def test_condition_mark_feeds_one_extra_channel():
    seen = {}

    def net(x, t):
        seen["x"] = x
        return x * 2

    marked = MarkConditioning(net_module(net), 3)
    x = torch.randn(2, 3, 7)
    out = marked(x, torch.zeros(2, dtype=torch.long))
    torch.testing.assert_close(out, x * 2)  # the network's first C output channels
    assert seen["x"].shape == (2, 4, 7)
    assert seen["x"][:, 3, :4].eq(1).all() and seen["x"][:, 3, 4:].eq(0).all()
    with pytest.raises(ConfigError, match="smaller than the 3 generated points"):
        marked(torch.randn(2, 3, 2), torch.zeros(2, dtype=torch.long))


def net_module(fn):
    class Wrapped(torch.nn.Module):
        def forward(self, x, t):
            return fn(x, t)

    return Wrapped()


# --------------------------------------------------------------------------- diagnostics


def test_placement_metrics_in_closed_form():
    true = torch.tensor([[[0.0, 0, 0], [2, 0, 0]]])
    pred = torch.tensor([[[10.0, 0, 0], [14, 0, 0]]])
    m = placement_metrics(pred, true)
    assert float(m["centroid_error"]) == pytest.approx(11.0)
    assert float(m["spread_ratio"]) == pytest.approx(2.0)
    assert float(m["pred_to_true"]) == pytest.approx((8 + 12) / 2)
    assert float(m["true_to_pred"]) == pytest.approx((10 + 8) / 2)


def test_condition_use_tells_a_model_that_reads_its_condition_from_one_that_does_not():
    schedule = NoiseSchedule.from_name("linear", 1e-4, 0.02, 100, prediction="x0")
    g = torch.Generator().manual_seed(0)
    cond = torch.randn(4, 3, 5, generator=g) * 3
    x0 = torch.cat([cond, cond[:, :, :2] + 0.1], dim=2)  # the generated points sit on the condition's first two

    def reads(x, t):  # predicts the generated points from the condition
        return torch.cat([torch.zeros_like(x[:, :, :5]), x[:, :, :2] + 0.1], dim=2)

    def ignores(x, t):
        return torch.zeros_like(x)

    used = condition_use(net_module(reads), schedule, x0, 2, generator=torch.Generator().manual_seed(1))
    blind = condition_use(net_module(ignores), schedule, x0, 2, generator=torch.Generator().manual_seed(1))
    assert all(used[f"cond_use_b{k}"] > 10 for k in range(4))
    assert all(blind[f"cond_use_b{k}"] == pytest.approx(1.0) for k in range(4))


# --------------------------------------------------------------------------- the frame


def _shell(center, radius, n, seed):
    v = np.random.default_rng(seed).normal(size=(n, 3))
    return center + radius * v / np.linalg.norm(v, axis=1, keepdims=True)


def test_atlas_estimate_finds_the_missing_cap_of_a_shell():
    atlas = [_shell(np.zeros(3), r, 6000, s) for r, s in ((78.0, 1), (80.0, 2), (83.0, 3))]
    skull = _shell(np.array([5.0, -3.0, 2.0]), 81.0, 8000, 4)
    direction = np.array([0.6, 0.0, 0.8])
    cap = (skull - skull.mean(axis=0)) @ direction > 81.0 * np.cos(np.deg2rad(30))
    found = estimate_implant(skull[~cap], atlas).center
    assert np.linalg.norm(found - skull[cap].mean(axis=0)) < 6.0  # mm, on a cap 80 mm wide
    box = (skull[~cap].min(axis=0) + skull[~cap].max(axis=0)) / 2
    assert np.linalg.norm(box - skull[cap].mean(axis=0)) > 30.0  # what no estimate would give


def test_atlas_votes_count_the_skulls_with_a_missing_point_within_the_radius():
    from pointforge.tasks.pcdiff.frame import _votes

    rng = np.random.default_rng(3)
    found = [rng.uniform(0, 40, (n, 3)) for n in (50, 0, 80, 30)]
    missing, votes = _votes(found, 6.0)
    near = np.linalg.norm(missing[:, None] - np.concatenate(found)[None], axis=-1) <= 6.0
    owner = np.concatenate([np.full(len(f), k) for k, f in enumerate(found)])
    brute = np.array([len(np.unique(owner[row])) for row in near])
    np.testing.assert_array_equal(votes, brute)
    assert votes.max() == 3 and votes.min() >= 1  # skull 1 found nothing; each point votes for its own skull


def test_atlas_estimate_drops_a_small_stray_piece():
    # A second, small hole far from the cap: every atlas skull misses bone there too,
    # but it is a stray piece next to the cap's, and only pieces=0 keeps it.
    atlas = [_shell(np.zeros(3), r, 6000, s) for r, s in ((78.0, 1), (80.0, 2), (83.0, 3))]
    skull = _shell(np.zeros(3), 80.0, 8000, 4)
    cap = skull @ np.array([0.6, 0.0, 0.8]) > 80.0 * np.cos(np.deg2rad(30))
    stray = skull @ np.array([0.0, -1.0, 0.0]) > 80.0 * np.cos(np.deg2rad(12))
    kept = estimate_implant(skull[~cap & ~stray], atlas, pieces=0.5)
    every = estimate_implant(skull[~cap & ~stray], atlas, pieces=0.0)
    near_stray = lambda pts: int((pts @ np.array([0.0, -1.0, 0.0]) > 60.0).sum())  # noqa: E731
    assert near_stray(every.points) > 0
    assert near_stray(kept.points) == 0
    assert np.linalg.norm(kept.center - skull[cap].mean(axis=0)) < 6.0


def test_bent_atlas_follows_the_rim_across_a_defect():
    # The atlas is 4 mm smaller than the skull everywhere: registered without scale it
    # sits inside; bent, its bone across the missing cap moves out toward the skull's.
    from scipy.spatial import cKDTree

    atlas = _shell(np.zeros(3), 80.0, 3000, 1)
    skull = _shell(np.zeros(3), 84.0, 4000, 2)
    up = np.array([0.0, 0.0, 1.0])
    present = skull[skull @ up < 84.0 * np.cos(np.deg2rad(20))]
    moved = bent(atlas, present, cKDTree(present), sigma_mm=15.0, reach_mm=10.0)
    radius = np.linalg.norm(moved, axis=1)
    cap = atlas @ up > 80.0 * np.cos(np.deg2rad(12))  # the cap's middle: 12+ mm from the rim
    assert abs(np.median(radius[~cap]) - 84.0) < 1.0
    assert np.median(radius[cap]) > 82.0  # from 80, with no skull point within 10 mm


def test_main_pieces_keeps_the_pieces_near_the_largest_in_size():
    rng = np.random.default_rng(0)
    a = rng.normal(0.0, 3.0, (300, 3))
    b = rng.normal(0.0, 3.0, (200, 3)) + [60.0, 0.0, 0.0]  # a second plate, 2/3 of the first
    c = rng.normal(0.0, 1.0, (30, 3)) + [0.0, 100.0, 0.0]  # a stray, 1/10
    mask = main_pieces(np.concatenate([a, b, c]), 10.0, 0.5)
    assert mask[:500].all() and not mask[500:].any()
    assert main_pieces(np.concatenate([a, b, c]), 10.0, 0.0).all()


def test_frame_condition_crops_around_the_centre_and_maps_back():
    skull = _shell(np.zeros(3), 30.0, 5000, 0)
    section = FrameSection(scale=0.5, crop=1.0, jitter=0.0)
    center = np.array([30.0, 0, 0])
    chosen, frame = frame_condition(skull, center, 200, section, np.random.default_rng(0), half_extent=3.0)
    assert chosen.shape == (200, 3)
    np.testing.assert_allclose(frame.center, center, atol=1e-9)
    assert np.linalg.norm(chosen - center, axis=1).max() <= 10.0 + 1e-9  # crop 1 normalised unit = 10 mm here
    np.testing.assert_allclose(frame.inverse(frame.apply(chosen)), chosen, atol=1e-4)
    jittered, moved = frame_condition(
        skull, center, 200, FrameSection(jitter=0.3), np.random.default_rng(0), half_extent=3.0, jitter=True
    )
    assert np.linalg.norm(moved.center - center) > 0
    assert list(nearest_indices(skull, center, 3)) == sorted(np.argsort(((skull - center) ** 2).sum(1))[:3])
    assert isinstance(LocalFrame(center, 2.0).apply(chosen), np.ndarray)


def test_framed_model_carries_its_atlas_through_a_state_dict():
    atlas = torch.randn(3, 50, 3)
    saved = FramedDenoiser(torch.nn.Linear(2, 2), atlas).state_dict()
    fresh = FramedDenoiser(torch.nn.Linear(2, 2))
    fresh.load_state_dict(saved)
    torch.testing.assert_close(fresh.atlas_mm, atlas)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("task.frame.crop=0", "task.frame.crop"),
        ("task.frame.pieces=1.5", "task.frame.pieces"),
        ("task.frame.bend_mm=-1", "task.frame.bend_mm"),
        ("task.diffusion.prediction=eps task.diffusion.zero_terminal_snr=true", "x0 or v"),
        ("task.frame.scale=1 task.rotate_degrees=10", "rotate_degrees"),
    ],
)
def test_formulation_config_errors(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_train_config("pcdiff", CONFIGS / "tiny.yaml", override.split())


# --------------------------------------------------------------------------- through the engine and back


def test_framed_run_logs_placement_and_its_checkpoint_places_implants_alone(tmp_path, synthetic_skulls):
    from pointforge.data.skulls.prepared import PreparedDataset
    from pointforge.implant.proposals import complete
    from pointforge.inference.pcdiff import load_pcdiff
    from pointforge.tasks import get_task
    from pointforge.train.engine import train

    root = synthetic_skulls
    cfg = load_train_config(
        "pcdiff",
        CONFIGS / "tiny.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            f"task.data_root={root}",
            "log.progress=off",
            "log.tensorboard=false",
            "perf.threads=1",
            "train.epochs=1",
            "train.eval_every=1",
            "task.eval.steps=3",
            "task.frame.scale=0.5",
            "task.diffusion.prediction=v",
            "task.diffusion.zero_terminal_snr=true",
            "task.condition_mark=true",
        ],
    )
    result = train(get_task("pcdiff"), cfg)
    assert result.status == "finished"
    for name in (
        "val_centroid_error_mm",
        "val_spread_ratio",
        "val_pred_to_true_mm",
        "val_true_to_pred_mm",
        "val_cond_use_b3",
    ):
        assert np.isfinite(result.metrics[name]), name
    loaded = load_pcdiff(tmp_path / "run" / "checkpoints" / "latest.pt")
    assert loaded.config.frame is not None and loaded.schedule.prediction == "v"
    assert loaded.model.atlas_mm.shape == (2, 2000, 3)  # the 2 training skulls travelled in the checkpoint
    data = PreparedDataset(root)
    case = data.split("val")[0]
    skull = np.asarray(data.points(case.defective))
    spacing = data.meta(case.defective)["spacing"]
    implants = complete(
        skull,
        loaded.model,
        make_sampler("dpm++2m", 4, schedule=loaded.schedule),
        2,
        config=loaded.config,
        generator=torch.Generator().manual_seed(0),
        spacing=spacing,
    )
    assert implants.shape == (2, 128, 3) and np.isfinite(implants).all()
    # Untrained, the points still start around the atlas estimate of the implant, not the skull's centre.
    true_center = np.asarray(data.points(case.implant)).mean(axis=0)
    box_center = (skull.min(axis=0) + skull.max(axis=0)) / 2
    assert np.linalg.norm(implants.mean(axis=(0, 1)) - true_center) < np.linalg.norm(box_center - true_center)
    # The same checkpoint told to start from its atlas estimate (task.prior): it needs a sampler that starts there.
    from pointforge.implant.proposals import proposal_sampler
    from pointforge.tasks.pcdiff.frame import PriorSection

    loaded.config.prior = PriorSection(start_step=30, agree=0.8)
    with pytest.raises(ConfigError, match="sampler starts at"):
        complete(
            skull,
            loaded.model,
            make_sampler("dpm++2m", 4, schedule=loaded.schedule),
            2,
            config=loaded.config,
            spacing=spacing,
        )
    started = proposal_sampler("dpm++2m", 4, loaded.schedule, loaded.config.prior)
    assert int(started.timesteps[0]) == 30
    from_prior = complete(
        skull,
        loaded.model,
        started,
        2,
        config=loaded.config,
        generator=torch.Generator().manual_seed(0),
        spacing=spacing,
    )
    assert from_prior.shape == (2, 128, 3) and np.isfinite(from_prior).all()
    assert np.linalg.norm(from_prior.mean(axis=(0, 1)) - true_center) < np.linalg.norm(box_center - true_center)


def test_mirror_flips_half_the_training_items_left_right_and_nothing_else(synthetic_skulls):
    from pointforge.tasks.pcdiff.dataset import PCDiffDataset
    from pointforge.tasks.pcdiff.task import PCDiffTask

    root = synthetic_skulls
    kw = dict(n_skull=512, n_implant=128, half_extent=3.0, frame=FrameSection(), seed=3)
    plain, mirrored = PCDiffDataset(root, "train", **kw), PCDiffDataset(root, "train", mirror=True, **kw)
    flips = []
    for epoch in range(4):
        plain.set_epoch(epoch)
        mirrored.set_epoch(epoch)
        for i in range(len(plain)):
            a, b = plain[i]["points"], mirrored[i]["points"]
            assert torch.equal(a[:, 1:], b[:, 1:])  # the same subsample and frame either way
            assert torch.equal(b[:, 0], a[:, 0]) or torch.equal(b[:, 0], -a[:, 0])
            flips.append(bool(torch.equal(b[:, 0], -a[:, 0])))
    assert 0.2 < np.mean(flips) < 0.8
    # Only the training split is mirrored.
    cfg = load_train_config("pcdiff", CONFIGS / "demo.yaml", [f"task.data_root={root}"])
    assert cfg.task.mirror
    train_set, val_set = PCDiffTask().build_datasets(cfg.task)
    assert train_set.mirror and (val_set is None or not val_set.mirror)


def test_upstream_import_refuses_a_config_with_another_formulation(tmp_path):
    from pointforge.nn.pvcnn import PVCNN2
    from pointforge.ops.pcdiff_import import import_pcdiff_checkpoint

    source = tmp_path / "upstream.pth"
    torch.save({"epoch": 1, "model_state": {"model." + k: v for k, v in PVCNN2("tiny").state_dict().items()}}, source)
    with pytest.raises(ConfigError, match="task.frame, task.diffusion.prediction"):
        import_pcdiff_checkpoint(
            source, tmp_path / "out.pt", overrides=["task.frame.scale=0.5", "task.diffusion.prediction=v"]
        )
    assert not (tmp_path / "out.pt").exists()
    assert import_pcdiff_checkpoint(source, tmp_path / "ok.pt").preset == "tiny"
