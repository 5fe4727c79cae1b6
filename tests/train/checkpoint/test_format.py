"""Checkpoint files: atomic writes, device-agnostic loads, prefixes, corrupt-file fallback, RNG."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from pointforge.atomic import atomic_writer
from pointforge.errors import CheckpointError
from pointforge.train.checkpoint import format as ck


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _save_tagged(path, obj, tag):
    """torch.save, but every storage is recorded as living on device ``tag`` (e.g. cuda:7)."""
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: tag
    try:
        torch.save(obj, path)
    finally:
        torch.serialization.location_tag = original


def test_cuda7_tagged_checkpoint_loads_on_cpu(tmp_path):
    model = _model()
    path = tmp_path / "gpu7.pt"
    state = {
        "format": ck.FORMAT,
        "model": {f"module.{k}": v for k, v in model.state_dict().items()},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(4, 3)}}, "param_groups": []},
    }
    _save_tagged(path, state, "cuda:7")
    assert not torch.cuda.is_available()
    # Proof that the file really names cuda:7: a plain load tries to put tensors there.
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        torch.load(path, weights_only=True)
    loaded = ck.load_checkpoint(path)
    assert all(t.device.type == "cpu" for t in loaded["model"].values())
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ck.load_model_state(fresh, ck.model_weights(loaded))
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_prefixed_state_dicts_load_into_bare_and_wrapped_models():
    model = _model()
    for prefix in ("module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."):
        fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        ck.load_model_state(fresh, {prefix + k: v for k, v in model.state_dict().items()})
        assert torch.equal(fresh[0].weight, model[0].weight)
    upstream = {"model." + k: v for k, v in model.state_dict().items()}
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ck.load_model_state(fresh, upstream, extra_prefixes=("model.",))
    assert torch.equal(fresh[2].bias, model[2].bias)


def test_saved_model_state_has_no_wrapper_prefix():
    model = _model()
    compiled_like = nn.Module()
    compiled_like._orig_mod = model  # what torch.compile's OptimizedModule looks like
    state = ck.model_state(compiled_like)
    assert set(state) == set(model.state_dict())


def test_mismatched_weights_are_a_clear_error():
    with pytest.raises(CheckpointError, match="do not fit this model: .*missing"):
        ck.load_model_state(_model(), {"other.weight": torch.zeros(1)})
    bad = {k: torch.zeros(1) for k in _model().state_dict()}
    with pytest.raises(CheckpointError, match="size mismatch"):
        ck.load_model_state(_model(), bad)


def test_save_is_atomic_and_weights_only_loadable(tmp_path):
    path = tmp_path / "c.pt"
    ck.save_checkpoint(path, {"model": _model().state_dict(), "rng": ck.capture_rng(), "config": {"a": [1, 2]}})
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]
    loaded = torch.load(path, weights_only=True)
    assert loaded["format"] == ck.FORMAT and isinstance(loaded["torch_version"], str)
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with atomic_writer(path, "wb") as handle:
            handle.write(b"half a file")
            raise RuntimeError("crash mid-write")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_truncated_latest_falls_back_to_previous_with_warning(tmp_path):
    files = ck.CheckpointFiles(tmp_path, keep_last=2)
    for step in (1, 2):
        latest = files.write_latest({"format": ck.FORMAT, "progress": {"global_step": step}, "model": {}})
        files.copy_to(latest, files.periodic(step))
    files.write_latest({"format": ck.FORMAT, "progress": {"global_step": 3}, "model": {"w": torch.zeros(1000)}})
    data = files.latest.read_bytes()
    files.latest.write_bytes(data[: len(data) // 2])
    warnings = []
    path, state = ck.find_resume_checkpoint(tmp_path, warn=warnings.append)
    assert path.name == "epoch-0002.pt" and state["progress"]["global_step"] == 2
    assert len(warnings) == 1 and "latest.pt is truncated or corrupt" in warnings[0]
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ck.load_checkpoint(files.latest)


def test_keep_last_k_prunes_oldest(tmp_path):
    files = ck.CheckpointFiles(tmp_path, keep_last=2)
    for epoch in range(1, 5):
        files.copy_to(files.write_latest({"format": ck.FORMAT, "e": epoch}), files.periodic(epoch))
        files.prune()
    assert [p.name for p in ck.periodic_checkpoints(tmp_path)] == ["epoch-0003.pt", "epoch-0004.pt"]


def test_rng_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ck.capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ck.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_missing_file_and_non_checkpoint():
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.load_checkpoint("/nonexistent/x.pt")
    with pytest.raises(CheckpointError, match="no model weights"):
        ck.model_weights({"epoch": 3})


def test_files_that_are_not_checkpoints_say_so(tmp_path):
    from pointforge.errors import CheckpointError
    from pointforge.train.checkpoint.format import load_checkpoint

    text = tmp_path / "pairs.csv"
    text.write_text("sparse,dense\na.npy,b.npy\n")
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint"):
        load_checkpoint(text)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_checkpoint(empty)
