"""``task.prior.condition``: the atlas estimate's points shown to the network as a marked part of the condition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from pointforge.errors import ConfigError
from pointforge.nn.diffusion.conditioning import MarkConditioning
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.pcdiff.frame import FrameSection, PriorSection, atlas_cases, atlas_estimate, build_atlas
from tests.helpers import CONFIGS as REPO_CONFIGS, quiet_config

CONFIGS = REPO_CONFIGS / "pcdiff"
HINT = "task.frame.scale=0.5 task.prior.start_step=40 task.prior.condition=32"


class _Recorder(torch.nn.Module):
    def forward(self, x, t):
        self.seen = x
        return x * 2


@pytest.mark.parametrize("n_hint", [0, 3])
def test_the_marks_tell_skull_hint_and_generated_points_apart(n_hint):
    net = _Recorder()
    wrapped = MarkConditioning(net, n_generated=2, n_hint=n_hint)
    x = torch.randn(2, 3, 10)
    out = wrapped(x, torch.zeros(2, dtype=torch.long))
    torch.testing.assert_close(out, x * 2)
    assert net.seen.shape == (2, 3 + (2 if n_hint else 1), 10)
    assert net.seen[:, 3].tolist() == [[1.0] * 8 + [0.0] * 2] * 2  # the condition, hint included
    if n_hint:
        assert net.seen[:, 4].tolist() == [[0.0] * 5 + [1.0] * 3 + [0.0] * 2] * 2  # the hint alone
        with pytest.raises(ConfigError, match="fewer than the 3 hint points"):
            wrapped(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long))  # 2 conditioning points


def test_a_hint_without_the_condition_mark_is_one_config_error():
    with pytest.raises(ConfigError, match=r"task\.prior\.condition.*condition_mark"):
        load_train_config("pcdiff", CONFIGS / "tiny.yaml", [*HINT.split(), "task.condition_mark=false"])
    with pytest.raises(ConfigError, match=r"task\.prior\.condition"):
        load_train_config("pcdiff", CONFIGS / "tiny.yaml", [*HINT.split(), "task.prior.condition=-1"])


def _estimate_points_near(hint: torch.Tensor, item: dict, estimate: np.ndarray) -> float:
    back = hint.numpy() * float(item["scale"]) + item["center"].numpy()
    return float(cKDTree(estimate).query(back)[0].max())


def test_items_carry_the_hint_between_skull_and_implant_from_the_right_estimate(synthetic_skulls):
    from pointforge.data.skulls.prepared import PreparedDataset
    from pointforge.tasks.pcdiff.correction import leave_one_out_estimate
    from pointforge.tasks.pcdiff.dataset import PCDiffDataset

    data = PreparedDataset(synthetic_skulls)
    section = FrameSection(atlas_points=500)
    atlas = build_atlas(data, "train", section.atlas_points)
    ids = list(atlas_cases(data, "train"))
    prior = PriorSection(start_step=40, agree=0.5, condition=32)
    kw = dict(n_skull=256, n_implant=64, half_extent=3.0, frame=section, prior=prior, seed=3)
    train = PCDiffDataset(data, "train", own_estimates=(atlas, ids), **kw)
    val = PCDiffDataset(data, "val", atlas=atlas, **kw)
    off_the_full_atlas = []
    for dataset, own in ((train, True), (val, False)):
        for index, case in enumerate(dataset.cases):
            item = dataset[index]
            assert item["points"].shape == (256 + 32 + 64, 3)
            skull = np.asarray(data.points(case.defective), dtype=np.float64)
            spacing = np.asarray(data.meta(case.defective)["spacing"], dtype=np.float64)
            full = atlas_estimate(atlas, skull, spacing, section, 0.5)
            hint = item["points"][256:288]
            if own:  # training: the estimate made without the case's own skull, as it errs on a new one
                found = leave_one_out_estimate(atlas, ids, case.skull_id, skull, spacing, section, 0.5)
                off_the_full_atlas.append(_estimate_points_near(hint, item, full.points) > 1.0)
            else:
                found = full
                assert item["prior"].shape == (64, 3)
            assert _estimate_points_near(hint, item, found.points) < 1e-3
            assert _estimate_points_near(item["points"][:256], item, skull) < 1e-3  # the skull's points come first
            assert "prior" not in item if own else "start" not in item
    assert any(off_the_full_atlas)  # the leave-one-out estimate is not the full atlas's


def test_a_hinted_model_trains_loads_and_completes_with_its_hint(tmp_path, synthetic_skulls):
    from pointforge.data.skulls.prepared import PreparedDataset
    from pointforge.implant.proposals import complete, proposal_sampler
    from pointforge.inference.pcdiff import load_pcdiff
    from pointforge.tasks import get_task
    from pointforge.train.engine import train

    cfg = quiet_config(
        "pcdiff",
        CONFIGS / "tiny.yaml",
        f"run.dir={tmp_path / 'run'}",
        f"task.data_root={synthetic_skulls}",
        "train.epochs=1",
        "train.eval_every=1",
        "task.eval.steps=3",
        "task.diffusion.prediction=v",
        "task.condition_mark=true",
        *HINT.split(),
    )
    result = train(get_task("pcdiff"), cfg)
    assert result.status == "finished" and np.isfinite(result.metrics["val_chamfer"])
    loaded = load_pcdiff(tmp_path / "run" / "checkpoints" / "latest.pt")
    assert loaded.config.n_hint == 32 and loaded.model.net.n_hint == 32
    data = PreparedDataset(synthetic_skulls)
    case = data.split("val")[0]
    seen: list[torch.Tensor] = []
    hook = loaded.model.net.net.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    implants = complete(
        np.asarray(data.points(case.defective)),
        loaded.model,
        proposal_sampler("dpm++2m", 3, loaded.schedule, loaded.config.prior),
        2,
        config=loaded.config,
        generator=torch.Generator().manual_seed(0),
        spacing=data.meta(case.defective)["spacing"],
    )
    hook.remove()
    assert implants.shape == (2, 128, 3) and np.isfinite(implants).all()
    n_skull = loaded.config.n_skull
    assert seen and seen[0].shape[1:] == (5, n_skull + 32 + 128)  # xyz + two marks; skull, hint, implant
    assert seen[0][:, 4, n_skull : n_skull + 32].eq(1).all() and seen[0][:, 4].sum() == 2 * 32
