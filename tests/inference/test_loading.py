"""Loading trained models: one entry point for every task, one EMA rule, one device resolver, clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pointforge import inference
from pointforge.config.coercion import to_dict
from pointforge.errors import CheckpointError, ConfigError
from pointforge.inference.loading import LoadedModel
from pointforge.inference.voxelizer import LoadedVoxelizer, load_voxelizer
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.checkpoint import format as ck
from tests.helpers import CONFIGS, TOY_TINY


def _voxelizer_checkpoint(path: Path, *, ema: bool) -> nn.Module:
    cfg = load_train_config("voxelizer", CONFIGS / "voxelizer" / "tiny.yaml")
    model = get_task("voxelizer").build_model(cfg.task)
    ema_state = None
    if ema:
        ema_state = {k: v + 1.0 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    ck.save_checkpoint(
        path, {"task": "voxelizer", "config": to_dict(cfg), "model": ck.model_state(model), "ema": ema_state}
    )
    return model


def test_load_voxelizer_builds_the_trained_network(tmp_path):
    model = _voxelizer_checkpoint(tmp_path / "v.pt", ema=True)
    result = load_voxelizer(tmp_path / "v.pt", "cpu")
    loaded, cfg = result.model, result.run_config
    assert cfg.run.task == "voxelizer" and cfg.task.preset == "tiny" and loaded.cfg.dpsr_res == (64, 64, 64)
    assert loaded.cfg.grid_resolution == 16  # the config's override of the preset
    assert not loaded.training
    weight = "encoder.fc_pos.weight"
    assert torch.equal(loaded.state_dict()[weight], model.state_dict()[weight] + 1.0)  # EMA weights preferred
    raw = load_voxelizer(tmp_path / "v.pt", weights="model").model
    assert torch.equal(raw.state_dict()[weight], model.state_dict()[weight])


def test_a_voxelizer_checkpoint_from_before_the_frame_loads_without_one(tmp_path):
    """The frame buffers (frame_cube_mm, frame_centre) are optional state: a checkpoint written before they
    existed loads with the same weights and no frame; one that has them gives them back; any other missing
    tensor is still refused."""
    model = _voxelizer_checkpoint(tmp_path / "framed.pt", ema=False)
    model.set_frame(230.0, (0.5, 0.45, 0.55))
    cfg = load_train_config("voxelizer", CONFIGS / "voxelizer" / "tiny.yaml")
    state = ck.model_state(model)
    ck.save_checkpoint(tmp_path / "framed.pt", {"task": "voxelizer", "config": to_dict(cfg), "model": state})
    frame = load_voxelizer(tmp_path / "framed.pt").frame
    assert frame is not None and (frame.cube_mm, frame.centre) == (230.0, (0.5, 0.45, 0.55))

    old = {k: v for k, v in state.items() if not k.startswith("frame_")}
    assert len(old) == len(state) - 2
    ck.save_checkpoint(tmp_path / "old.pt", {"task": "voxelizer", "config": to_dict(cfg), "model": old, "ema": old})
    loaded = load_voxelizer(tmp_path / "old.pt")
    assert loaded.frame is None and loaded.model.frame() is None and loaded.weights == "ema"
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in old.items())

    cut = {k: v for k, v in old.items() if k != "encoder.fc_pos.weight"}
    ck.save_checkpoint(tmp_path / "cut.pt", {"task": "voxelizer", "config": to_dict(cfg), "model": cut})
    with pytest.raises(CheckpointError, match="1 missing"):
        load_voxelizer(tmp_path / "cut.pt")


def test_checkpoints_that_are_not_voxelizers_are_refused(tmp_path):
    toy_cfg = load_train_config("toy", TOY_TINY)
    toy = get_task("toy").build_model(toy_cfg.task)
    ck.save_checkpoint(tmp_path / "toy.pt", {"task": "toy", "config": to_dict(toy_cfg), "model": ck.model_state(toy)})
    with pytest.raises(CheckpointError, match="of task 'toy', not of task 'voxelizer'"):
        load_voxelizer(tmp_path / "toy.pt")
    ck.save_weights(tmp_path / "bare.pt", toy.state_dict())
    with pytest.raises(CheckpointError, match="not a pointforge training checkpoint"):
        load_voxelizer(tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_voxelizer(tmp_path / "missing.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "toy.pt").read_bytes()[:200])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_voxelizer(tmp_path / "cut.pt")


def test_one_entry_point_loads_any_task_with_one_ema_rule(tmp_path):
    model = _voxelizer_checkpoint(tmp_path / "v.pt", ema=True)
    weight = "encoder.fc_pos.weight"
    loaded = inference.load(tmp_path / "v.pt", "cpu")
    assert isinstance(loaded, LoadedVoxelizer) and loaded.task == "voxelizer" and loaded.weights == "ema"
    assert (
        loaded.config is loaded.run_config.task and loaded.device == torch.device("cpu") and not loaded.model.training
    )
    assert torch.equal(loaded.model.state_dict()[weight], model.state_dict()[weight] + 1.0)
    forced = inference.load(tmp_path / "v.pt", "cpu", weights="model")
    assert forced.weights == "model" and torch.equal(forced.model.state_dict()[weight], model.state_dict()[weight])
    _voxelizer_checkpoint(tmp_path / "plain.pt", ema=False)
    assert load_voxelizer(tmp_path / "plain.pt").weights == "model"  # auto: no EMA kept, trained weights
    with pytest.raises(CheckpointError, match="no EMA weights"):
        load_voxelizer(tmp_path / "plain.pt", weights="ema")
    with pytest.raises(ConfigError, match="weights must be auto, ema or model"):
        inference.load(tmp_path / "v.pt", weights="best")

    toy_cfg = load_train_config("toy", TOY_TINY)
    toy = get_task("toy").build_model(toy_cfg.task)
    ck.save_checkpoint(tmp_path / "toy.pt", {"task": "toy", "config": to_dict(toy_cfg), "model": ck.model_state(toy)})
    generic = inference.load(tmp_path / "toy.pt", "cpu")
    assert type(generic) is LoadedModel and generic.task == "toy" and generic.weights == "model"
