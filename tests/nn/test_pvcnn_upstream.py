"""Upstream PCDiff checkpoints imported onto PVCNN2: prefixes, configurations inferred, errors that say what differs."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import CheckpointError
from pointforge.nn.pvcnn import PVCNN2
from pointforge.nn.pvcnn_config import PVCNN2Config, get_preset
from pointforge.nn.pvcnn_upstream import expected_shapes, import_upstream_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("prefix", ["model.", "model.module."])
def test_import_upstream_checkpoint(tiny, prefix):
    checkpoint = {
        "epoch": 1234,
        "model_state": {prefix + k: v for k, v in tiny["state_dict"].items()},
        "optimizer_state": {"state": {}, "param_groups": []},
    }
    imported = import_upstream_state_dict(checkpoint)
    assert imported.preset == "tiny" and imported.epoch == 1234 and imported.prefix == prefix
    assert imported.config == get_preset("tiny")
    model = PVCNN2(imported.config)
    model.load_state_dict(imported.state_dict, strict=True)
    with torch.no_grad():
        y = model.eval()(tiny["x"], tiny["t"])
    torch.testing.assert_close(y, tiny["y"], atol=1e-4, rtol=1e-4)


def test_import_bare_state_dict_with_config(tiny):
    imported = import_upstream_state_dict(dict(tiny["state_dict"]), config="tiny")
    assert (
        imported.epoch is None and imported.prefix == "" and list(imported.state_dict) == list(expected_shapes("tiny"))
    )


def test_import_infers_scalars_beyond_presets():
    cfg = get_preset("tiny")
    variant = PVCNN2Config(**{**cfg.__dict__, "extra_feature_channels": 2, "num_classes": 6})
    state = {"model." + k: v for k, v in PVCNN2(variant).state_dict().items()}
    imported = import_upstream_state_dict({"epoch": 3, "model_state": state})
    assert imported.config == variant and imported.preset is None
    model = PVCNN2(imported.config).eval()
    model.load_state_dict(imported.state_dict)
    with torch.no_grad():  # extra input channels feed the finest skip connection
        assert model(torch.randn(1, 5, 1024), torch.tensor([7])).shape == (1, 6, 1024)


def test_import_errors_say_what_differs(tiny):
    state = {"model." + k: v for k, v in tiny["state_dict"].items()}
    with pytest.raises(CheckpointError, match="expected a dict"):
        import_upstream_state_dict([1, 2])
    with pytest.raises(CheckpointError, match="no 'model_state' entry"):
        import_upstream_state_dict({"step": 3, "weights": "x"})
    voxelizer = {
        "epoch": 7,
        "model_state": {"encoder.fc_pos.weight": torch.zeros(64, 3), "decoder.fc_out.bias": torch.zeros(7)},
    }
    with pytest.raises(CheckpointError, match="none of its 2 weights look like PVCNN2's"):
        import_upstream_state_dict(voxelizer)
    with pytest.raises(
        CheckpointError,
        match=r"shape of 'sa_layers\.0\.0\.voxel_layers\.0\.weight' is \(8, 3, 3, 3, 3\), expected \(32, 3, 3, 3, 3\)",
    ):
        import_upstream_state_dict({"model_state": state}, config="paper")
    partial = {k: v for k, v in state.items() if not k.startswith("model.fp_layers.3.2.")}
    with pytest.raises(CheckpointError, match="missing 14 keys such as 'fp_layers.3.2"):
        import_upstream_state_dict({"model_state": partial})
    extra = {**state, "model.head.weight": torch.zeros(3)}
    with pytest.raises(CheckpointError, match="unexpected 1 key such as 'head.weight'"):
        import_upstream_state_dict(extra, config="tiny")
    mixed = {**state, "sa_layers.0.0.voxel_layers.0.bias": torch.zeros(8)}
    with pytest.raises(CheckpointError, match="matches no PVCNN2 preset"):
        import_upstream_state_dict(mixed)
    ints = {**state, "model.embedf.0.bias": torch.zeros(32, dtype=torch.long)}
    with pytest.raises(CheckpointError, match="dtype torch.int64"):
        import_upstream_state_dict(ints)
