"""pointforge ckpt inspect / remap: a cuda:7-tagged checkpoint becomes one that loads, and resumes, anywhere."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pointforge.errors import CheckpointError
from pointforge.ops.checkpoint_surgery import inspect_checkpoint, remap_checkpoint
from pointforge.tasks import get_task
from pointforge.train.checkpoint import format as ck
from pointforge.train.engine import train
from tests.helpers import TOY_TINY, quiet_config, run_cli

TINY = TOY_TINY


def _retag(source: Path, target: Path, tag: str, *, prefix: str = "") -> None:
    """Re-save a checkpoint as if every storage lived on ``tag`` and the model were DDP-wrapped."""
    state = torch.load(source, weights_only=True)
    state["model"] = {f"{prefix}{k}": v for k, v in state["model"].items()}
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: tag
    try:
        torch.save(state, target)
    finally:
        torch.serialization.location_tag = original


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = quiet_config("toy", TINY, "log.csv=false", "train.epochs=1", f"run.dir={run_dir}")
    train(get_task("toy"), cfg, console=False)
    return run_dir


def test_remap_turns_a_cuda7_checkpoint_into_one_that_loads_and_resumes_anywhere(trained, tmp_path):
    gpu7 = tmp_path / "gpu7.pt"
    _retag(trained / "checkpoints" / "latest.pt", gpu7, "cuda:7", prefix="module.")
    assert not torch.cuda.is_available()
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        torch.load(gpu7, weights_only=True)  # what every other tool does with such a file
    before = hashlib.sha256(gpu7.read_bytes()).hexdigest()

    info = inspect_checkpoint(gpu7)
    assert info["saved_devices"] == {"cuda:7": info["tensors_total"]} and info["wrapper_prefixes"] == ["module."]

    out = run_cli("ckpt", "remap", str(gpu7))
    assert out.exit_code == 0, out.output
    remapped = tmp_path / "gpu7.remapped.pt"
    assert "a resumable checkpoint" in out.output and "cuda:7" in out.output
    assert hashlib.sha256(gpu7.read_bytes()).hexdigest() == before  # the original is untouched

    plain = torch.load(remapped, weights_only=True)  # no map_location: it loads as it is
    assert all(t.device.type == "cpu" for t in plain["model"].values())
    assert not any(k.startswith("module.") for k in plain["model"])
    assert plain["optimizer"]["state"] and plain["progress"]["global_step"] == 8
    again = inspect_checkpoint(remapped)
    assert set(again["saved_devices"]) == {"cpu"} and again["resumable"] == "yes" and again["wrapper_prefixes"] == []

    # ... and a run resumes from it.
    run_dir = tmp_path / "resumed"
    cfg = quiet_config("toy", TINY, "log.csv=false", "train.epochs=2", f"run.dir={run_dir}")
    result = train(get_task("toy"), cfg, resume=remapped, console=False)
    assert result.resumed_from == remapped and result.global_step == 16


def test_inspect_reports_what_the_issue_lists(trained):
    out = run_cli("ckpt", "inspect", str(trained / "checkpoints" / "latest.pt"))
    assert out.exit_code == 0, out.output
    for field in (
        "size",
        "complete             yes",
        "task                 toy",
        "epoch                1",
        "global_step          8",
        "parameters",
        "saved_devices        cpu",
        "dtypes               float32",
        "key_prefixes         head 4, point 4",
        "config               task toy; 1 epoch(s); global batch 8; adam lr 0.003",
        "resumable            yes",
    ):
        assert field in out.output, field
    out = run_cli("ckpt", "inspect", str(trained), "--json")
    assert out.exit_code == 0 and "latest.pt" in out.output
    out = run_cli("ckpt", "inspect", str(trained / "checkpoints" / "latest.pt"), "--json")
    data = json.loads(out.output)
    assert data["complete"] is True and data["size_bytes"] == (trained / "checkpoints" / "latest.pt").stat().st_size


def test_inspect_says_a_truncated_file_is_incomplete(trained, tmp_path):
    cut = tmp_path / "cut.pt"
    cut.write_bytes((trained / "checkpoints" / "latest.pt").read_bytes()[:4000])
    out = run_cli("ckpt", "inspect", str(cut))
    assert out.exit_code == 1
    assert "complete             no" in out.output and "truncated or corrupt" in out.output


def test_remap_never_overwrites_and_can_write_bare_weights(trained, tmp_path):
    source = trained / "checkpoints" / "latest.pt"
    with pytest.raises(CheckpointError, match="never overwrites the original"):
        remap_checkpoint(source, source)
    target = tmp_path / "w.pt"
    result = remap_checkpoint(source, target, weights_only_output=True)
    assert result.kind == "weights"
    weights = torch.load(target, weights_only=True)
    assert set(weights) == set(ck.load_checkpoint(source)["model"])
    with pytest.raises(CheckpointError, match="already exists; choose another --out or add --force"):
        remap_checkpoint(source, target)
    assert remap_checkpoint(source, target, force=True).kind == "checkpoint"
    out = run_cli("ckpt", "remap", str(source), "--out", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert isinstance(out.exception, Exception) and "two outputs" in str(out.exception)


def test_ckpt_cli_inspect_and_remap(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    upstream = tmp_path / "upstream.pt"
    torch.save({"epoch": 7, "model_state": {f"model.module.{k}": v for k, v in model.state_dict().items()}}, upstream)
    out = run_cli("ckpt", "inspect", str(upstream))
    assert out.exit_code == 0, out.output
    assert "foreign" in out.output and "parameters" in out.output
    clean = tmp_path / "clean.pt"
    out = run_cli("ckpt", "remap", str(upstream), str(clean), "--strip-prefix", "model.")
    assert out.exit_code == 0, out.output
    weights = torch.load(clean, weights_only=True)
    assert set(weights) == set(model.state_dict())
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ck.load_model_state(fresh, weights)
    assert torch.equal(fresh[0].weight, model[0].weight)
