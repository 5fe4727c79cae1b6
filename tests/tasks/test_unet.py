"""The unet task: its config, the cases' cube cache, and real training through the engine, resumed exactly."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pointforge import inference
from pointforge.data.prepare import prepare_dataset
from pointforge.data.skulls.coarse_cache import GridRecipe, case_grids, ensure_case_grids, load_case_grids
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import ConfigError, DataError
from pointforge.inference.unet import LoadedUNet
from pointforge.tasks import available_tasks, get_task
from pointforge.tasks.unet import CubeGridDataset
from pointforge.train.checkpoint import format as ck
from pointforge.train.engine import train
from tests.helpers import CONFIGS, quiet_config, write_raw_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = CONFIGS / "unet" / "tiny.yaml"


def tiny_cfg(run_dir: Path, data_root: Path, cache_dir: Path, *overrides: str):
    return quiet_config(
        "unet", TINY, f"run.dir={run_dir}", f"task.data_root={data_root}", f"task.cache_dir={cache_dir}", *overrides
    )


@pytest.fixture(scope="module")
def raw_and_prepared(tmp_path_factory):
    """Three small SkullFix-layout skulls (anisotropic voxels), prepared with one skull per split."""
    tmp = tmp_path_factory.mktemp("unet-data")
    raw = write_raw_dataset(tmp / "raw", layout="skullfix", n_skulls=3, spacing=(1.2, 1.2, 1.5))
    result = prepare_dataset(raw, tmp / "prepared", n_points=1000, split="train=000,val=001,test=002", workers=1)
    assert result.ok, result.failures
    return raw, tmp / "prepared"


# --------------------------------------------------------------------------- config


def test_presets_load_and_the_task_is_registered():
    assert "unet" in available_tasks()
    tiny = quiet_config("unet", "tiny")
    assert (tiny.task.grid, tiny.task.channels, tiny.task.strides) == (32, (4, 8, 16), (2, 2))
    real = quiet_config("unet", "skullfix")
    assert (real.task.grid, real.task.channels, real.task.num_res_units) == (64, (24, 48, 96, 192, 384), 1)
    assert real.task.synthetic is None and real.train.max_minutes == 80
    task = get_task("unet")
    assert task.best_metric == "val_dice" and task.best_mode == "max"
    net = task.build_model(tiny.task)
    assert net(torch.zeros(1, 1, 32, 32, 32)).shape == (1, 1, 32, 32, 32)


@pytest.mark.parametrize(
    "override, words",
    [
        ("task.grid=30", "multiple of the strides' product 4"),
        ("task.strides=[2]", "one positive stride per level"),
        ("task.channels=[4]", "2 or more positive widths"),
        ("task.mirror_p=1.5", "mirror_p' must lie in"),
        ("task.margin_mm=-1", "margin_mm' must be 0 or more"),
        ("task.norm=group", "valid choices: instance, batch"),
        ("task.lambda_dice=0", "not both 0"),
    ],
)
def test_config_mistakes_are_one_line_errors(override, words, tmp_path):
    overrides = [override, "task.lambda_ce=0"] if "lambda" in override else [override]
    with pytest.raises(ConfigError, match=words):
        quiet_config("unet", TINY, *overrides)


# --------------------------------------------------------------------------- the cube cache


def test_the_cube_cache_is_built_once_reused_and_remade_when_a_source_changes(raw_and_prepared, tmp_path):
    raw, root = raw_and_prepared
    data = PreparedDataset(root)
    cases = data.split("all")
    recipe = GridRecipe(16, 4.0)
    said: list[str] = []
    folder = ensure_case_grids(data, cases, recipe, log=said.append)
    assert folder == root / "unet-grids" / "g16-m4"  # beside the prepared data by default
    assert sorted(p.name for p in folder.glob("*.npz")) == ["000.npz", "001.npz", "002.npz"]
    assert any("putting 3 of 3 cases" in line for line in said)
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.npz")}
    cached = load_case_grids(folder, cases[1])
    fresh = case_grids(data, cases[1], recipe)
    assert cached.defective.dtype == np.float16 and cached.defective.shape == (16, 16, 16)
    assert np.allclose(cached.defective, fresh.defective, atol=1e-3) and cached.frame == fresh.frame
    assert cached.implant.max() > 0.5  # the implant is on the cube

    said.clear()
    ensure_case_grids(data, cases, recipe, log=said.append)
    assert not said  # nothing to do
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.npz")} == stamps

    source = raw / "implant" / "001.nrrd"
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    ensure_case_grids(data, cases, recipe, log=said.append)
    assert any("putting 1 of 3 cases" in line for line in said)
    changed = {name for name, ns in stamps.items() if (folder / name).stat().st_mtime_ns != ns}
    assert changed == {"001.npz"}
    moved = source.rename(tmp_path / "001.nrrd")
    try:
        with pytest.raises(DataError, match="the raw volume of case 001 is gone"):
            ensure_case_grids(data, cases, recipe)
    finally:
        moved.rename(source)


def test_the_training_set_mirrors_input_and_target_together(raw_and_prepared, tmp_path):
    _, root = raw_and_prepared
    data = PreparedDataset(root)
    folder = ensure_case_grids(data, data.split("all"), GridRecipe(16, 4.0), tmp_path / "cache")
    plain = CubeGridDataset(data, "train", folder)
    mirrored = CubeGridDataset(data, "train", folder, mirror_p=1.0)
    a, b = plain[0], mirrored[0]
    assert a["image"].shape == (1, 16, 16, 16) and a["label"].dtype == torch.float32
    assert torch.equal(b["image"], a["image"].flip(1)) and torch.equal(b["label"], a["label"].flip(1))


# --------------------------------------------------------------------------- training


def test_trains_through_the_engine_resumes_exactly_and_loads(synthetic_skulls, tmp_path):
    cache = tmp_path / "cache"
    fast = ["train.eval_every=1"]
    straight = train(
        get_task("unet"),
        tiny_cfg(tmp_path / "straight", synthetic_skulls, cache, "train.epochs=2", *fast),
        console=False,
    )
    assert straight.status == "finished" and straight.global_step == 10
    assert "val_dice" in straight.metrics and 0.0 <= straight.metrics["val_dice"] <= 1.0
    assert len(list(cache.glob("**/*.npz"))) == 15  # the train and val cases, on the cube once
    train(get_task("unet"), tiny_cfg(tmp_path / "cut", synthetic_skulls, cache, "train.epochs=1", *fast), console=False)
    resumed = train(
        get_task("unet"),
        tiny_cfg(tmp_path / "cut", synthetic_skulls, cache, "train.epochs=2", *fast),
        resume="auto",
        console=False,
    )
    assert resumed.resumed_from is not None and resumed.global_step == 10
    a = ck.load_checkpoint(tmp_path / "straight" / "checkpoints" / "latest.pt")["model"]
    b = ck.load_checkpoint(tmp_path / "cut" / "checkpoints" / "latest.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    loaded = inference.load(tmp_path / "straight" / "checkpoints" / "best.pt", "cpu")
    assert isinstance(loaded, LoadedUNet) and loaded.task == "unet" and not loaded.model.training
    assert loaded.config.grid == 32 and loaded.step is not None
