"""The U-Net peer in use: a scan of any grid in, the implant on that grid out; `generate --unet`; a case scored."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from pointforge.config.coercion import to_dict
from pointforge.data.skulls.coarse_grids import frame_around, occupancy
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.volumes import read_volume, write_volume
from pointforge.errors import CheckpointError, UserError
from pointforge.implant.unet import predict, predict_implant, score_case
from pointforge.inference.unet import LoadedUNet
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.checkpoint import format as ck
from tests.data.test_coarse_grids import _reoriented, _rotation
from tests.helpers import CONFIGS, TOY_TINY, physical_skull, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = CONFIGS / "unet" / "tiny.yaml"
GRID, MARGIN = 32, 4.0


class KnownCube(nn.Module):
    """Stands in for a trained U-Net: logits that put the true implant on the cube it is asked about."""

    def __init__(self, logits: np.ndarray):
        super().__init__()
        self.register_buffer("logits", torch.from_numpy(logits)[None, None])

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        assert image.shape[-3:] == self.logits.shape[-3:]
        return self.logits.expand(image.shape[0], -1, -1, -1, -1)


def knowing(defective, truth_fine) -> LoadedUNet:
    """A loaded 'U-Net' whose probability on ``defective``'s cube is ≥ 0.5 where ``truth_fine`` fills half a cell."""
    cfg = load_train_config("unet", TINY, [f"task.grid={GRID}", f"task.margin_mm={MARGIN}"])
    frame = frame_around(defective, GRID, MARGIN)
    logits = 20.0 * (occupancy(truth_fine, frame) - 0.5)
    return LoadedUNet(KnownCube(logits), cfg.task, cfg, "model", torch.device("cpu"), "known", "unet")


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2 * float((a & b).sum()) / float(a.sum() + b.sum())


@pytest.mark.parametrize("spacing, degrees", [((1.0, 1.0, 1.0), 0.0), ((0.7, 0.9, 1.6), 0.0), ((0.8, 1.1, 1.3), 20.0)])
def test_the_implant_comes_back_on_the_inputs_own_grid(spacing, degrees):
    _, truth_fine = physical_skull((0.5, 0.5, 0.5))
    defective, implant = physical_skull(spacing, direction=_rotation(degrees))
    found = predict(defective, knowing(defective, truth_fine))
    assert found.implant.shape == defective.shape and found.implant.dtype == bool
    assert not np.any(found.implant & defective.data)  # never in the bone
    # A 4 mm plate through cells of 72 mm / 32: what the cube can hold of it, on this grid.
    assert _dice(found.implant, implant.data) > 0.85, _dice(found.implant, implant.data)
    assert found.box is not None and found.probability.shape == tuple(s.stop - s.start for s in found.box)
    assert math.prod(found.probability.shape) < 0.5 * math.prod(defective.shape)  # only around the implant
    # The same scan stored with its axes permuted and one reversed: the same implant, voxel for voxel.
    turned = _reoriented(defective)
    again = predict_implant(turned, knowing(turned, truth_fine))
    assert np.sum(again != _reoriented(replace(defective, data=found.implant)).data) <= 2


def _unet_checkpoint(path, *, bias: float = 10.0):
    """A tiny U-Net checkpoint whose output layer's bias makes it call every cell implant."""
    cfg = load_train_config("unet", TINY)
    model = get_task("unet").build_model(cfg.task)
    last = [m for m in model.modules() if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d))][-1]
    assert last.out_channels == 1 and last.bias is not None
    with torch.no_grad():
        last.bias.fill_(bias)
    ck.save_checkpoint(path, {"task": "unet", "config": to_dict(cfg), "model": ck.model_state(model)})
    return path


def test_generate_with_a_unet_checkpoint_writes_the_implant_on_the_inputs_grid(tmp_path):
    defective, _ = physical_skull((1.2, 1.2, 1.6))
    source = write_volume(tmp_path / "defective.nrrd", defective.with_data(defective.data.astype(np.uint8) * 255))
    ckpt = _unet_checkpoint(tmp_path / "unet.pt")
    out = tmp_path / "case"
    result = run_cli("generate", source, "--unet", ckpt, "--out", out, "--device", "cpu")
    assert result.exit_code == 0, (result.output, result.exception)
    written = read_volume(out / "implant.nrrd")
    assert written.shape == defective.shape and np.allclose(written.spacing, (1.2, 1.2, 1.6))
    assert np.allclose(written.origin, defective.origin) and set(np.unique(written.data)) == {0, 255}
    assert not np.any((written.data > 0) & defective.data)
    report = json.loads((out / "report.json").read_text())
    assert report["models"]["unet"]["grid"] == 32 and report["parameters"]["cube"]["size"] == 32
    assert report["implant"]["voxels"] == int((written.data > 0).sum()) and (out / "implant.stl").is_file()
    again = run_cli("generate", source, "--unet", ckpt, "--out", out)
    assert isinstance(again.exception, UserError) and "already exists" in str(again.exception)


def test_a_wrong_checkpoint_or_wrong_flags_for_the_unet_are_one_line(tmp_path):
    defective, _ = physical_skull((2.0, 2.0, 2.0))
    source = write_volume(tmp_path / "defective.nrrd", defective)
    toy_cfg = load_train_config("toy", TOY_TINY)
    toy = get_task("toy").build_model(toy_cfg.task)
    ck.save_checkpoint(tmp_path / "toy.pt", {"task": "toy", "config": to_dict(toy_cfg), "model": ck.model_state(toy)})
    vox_cfg = load_train_config("voxelizer", CONFIGS / "voxelizer" / "tiny.yaml")
    vox = get_task("voxelizer").build_model(vox_cfg.task)
    ck.save_checkpoint(
        tmp_path / "vox.pt", {"task": "voxelizer", "config": to_dict(vox_cfg), "model": ck.model_state(vox)}
    )
    unet = _unet_checkpoint(tmp_path / "unet.pt")
    for k, (args, kind, words) in enumerate(
        [
            (["--unet", tmp_path / "toy.pt"], CheckpointError, "of task 'toy', not of task 'unet'"),
            (
                ["--unet", tmp_path / "vox.pt"],
                CheckpointError,
                "is a voxelizer checkpoint, given as --unet; give it as --voxelizer",
            ),
            (
                ["--unet", tmp_path / "missing.pt"],
                UserError,
                "no such file; give a checkpoint written by `pointforge train unet`",
            ),
            (
                ["--pcdiff", unet, "--voxelizer", tmp_path / "vox.pt"],
                CheckpointError,
                "is a unet checkpoint, given as --pcdiff; give it as --unet",
            ),
        ]
    ):
        out = tmp_path / f"out{k}"
        result = run_cli("generate", source, *args, "--out", out)
        assert isinstance(result.exception, kind), (words, result.output, result.exception)
        assert words in str(result.exception) and "\n" not in str(result.exception), str(result.exception)
        assert not out.exists()
    both = run_cli("generate", source, "--unet", unet, "--pcdiff", unet, "--out", tmp_path / "o")
    assert both.exit_code == 2 and "give either --unet, or --pcdiff with --voxelizer" in both.output
    neither = run_cli("generate", source, "--out", tmp_path / "o")
    assert neither.exit_code == 2 and "or --unet" in neither.output


def test_a_prepared_case_is_scored_on_its_own_grid(synthetic_skulls):
    data = PreparedDataset(synthetic_skulls)
    case = data.split("test")[0]
    from pointforge.data.volumes import read_binary_volume

    defective = read_binary_volume(data.meta(case.defective)["source"])
    truth = read_binary_volume(data.meta(case.implant)["source"])
    row = score_case(data, case, knowing(defective, truth))
    assert row["case_id"] == case.case_id and row["error"] is None
    assert row["dsc"] > 0.5 and row["hd95"] < 10.0 and row["seconds"] > 0
