"""The voxelizer task: config, augmentation, synthetic data on first use, and real training through the engine."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pointforge.data.cache import ensure_synthetic_prepared
from pointforge.data.skulls.datasets import VoxelAugmentation, VoxelizationDataset
from pointforge.data.skulls.grids import inside_grid, transform_inside
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.volumes import read_binary_volume
from pointforge.errors import ConfigError
from pointforge.implant.voxelize import points_to_volume
from pointforge.inference.voxelizer import load_voxelizer
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.checkpoint import format as ck
from pointforge.train.data import global_batches
from pointforge.train.engine import train
from tests.helpers import REPO

TINY = REPO / "pointforge" / "configs" / "voxelizer" / "tiny.yaml"

# Measured with pointforge/configs/voxelizer/tiny.yaml as it is (100 steps of batch 2, one
# thread, torch 2.13 CPU, about 12 s): mean volume IoU over the 5 held-out test
# cases (the 5 defects of the skull the split holds out) 0.444, per case
# 0.39-0.48. Baselines: all outside 0; a blob (the same points with normals
# pointing away from their centroid: the head filled in) 0.113. The threshold
# sits a little below the measurement.
HELD_OUT_IOU_MIN = 0.40
BLOB_IOU_MAX = 0.15


def tiny_cfg(run_dir: Path, data_root: Path, *overrides: str):
    return load_train_config(
        "voxelizer", TINY, [f"run.dir={run_dir}", f"task.data_root={data_root}", "log.progress=off", *overrides]
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tiny.yaml trained for real, from a data_root that does not exist yet."""
    tmp = tmp_path_factory.mktemp("vox")
    data_root = tmp / "data" / "synthetic"
    cfg = tiny_cfg(tmp / "run", data_root)
    result = train(get_task("voxelizer"), cfg, console=False)
    return result, cfg, data_root


# --------------------------------------------------------------------------- config


def test_configs_load_and_describe_their_networks():
    for name, res in (("tiny", 64), ("small", 64), ("paper", 512)):
        cfg = load_train_config("voxelizer", REPO / "pointforge" / "configs" / "voxelizer" / f"{name}.yaml")
        assert cfg.task.network().dpsr_res == (res,) * 3
    paper = load_train_config("voxelizer", REPO / "pointforge" / "configs" / "voxelizer" / "paper.yaml")
    assert (paper.optim.lr, paper.data.global_batch, paper.task.n_points, paper.task.repeats) == (5e-4, 2, 30720, 10)
    assert paper.task.synthetic is None and get_task("voxelizer").best_metric == "val_iou"


@pytest.mark.parametrize(
    "override, words",
    [
        ("task.model.dpsr_ress=64", "unknown voxelizer config field"),
        ("task.model.dpsr_res=[32,32,64]", "one size for all axes"),
        ("task.flip_p=1.5", "flip_p must lie in"),
        ("task.preset=huge", "valid choices: tiny, small, paper"),
        ("task.synthetic.skulls=0", "task.synthetic.skulls"),
        ("task.synthetic.family=blobs", "task.synthetic.family' must be one of domes, anatomical"),
        ("task.repeats=0", "task.repeats"),
    ],
)
def test_config_mistakes_are_one_line_errors(override, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        load_train_config("voxelizer", TINY, [override])


# --------------------------------------------------------------------------- augmentation


def test_transform_inside_flips_exactly_and_rotates_about_the_centre():
    g = torch.Generator().manual_seed(0)
    inside = torch.rand(2, 12, 12, 12, generator=g) > 0.6
    res = 12
    flip = torch.tensor([[-1.0, 0, 0, (res - 1) / res], [0, 1, 0, 0], [0, 0, 1, 0]])
    identity = torch.eye(3, 4)
    out = transform_inside(inside, torch.stack([flip, identity]))
    assert torch.equal(out[0], inside[0].flip(0))  # x -> (res-1)/res - x maps node i to node res-1-i
    assert torch.equal(out[1], inside[1])
    # A quarter turn about the grid's centre in the (0, 1) plane is a rot90 of the array.
    c = (res - 1) / (2 * res)
    quarter = torch.tensor([[0.0, -1, 0, 2 * c], [1, 0, 0, 0], [0, 0, 1, 0]])
    assert torch.equal(transform_inside(inside[0], quarter), torch.rot90(inside[0], 1, dims=(0, 1)))
    chunked = transform_inside(inside, torch.stack([quarter, flip]), chunk_bytes=1)
    assert torch.equal(chunked, transform_inside(inside, torch.stack([quarter, flip])))


def test_augmented_points_stay_on_the_augmented_target(trained):
    _, cfg, data_root = trained
    data = PreparedDataset(data_root)
    res = 64
    plain = VoxelizationDataset(data, "train", n_points=2000, resolution=res, seed=1, target_format="inside")
    aug = VoxelizationDataset(
        data,
        "train",
        n_points=2000,
        resolution=res,
        seed=1,
        target_format="inside",
        augment=VoxelAugmentation(rotate_p=1.0, flip_p=1.0, noise_p=0.0),
    )

    def distance_to_surface(item):
        inside = transform_inside(item["target"], item["transform"]).numpy()
        from scipy.ndimage import binary_erosion, distance_transform_edt

        surface = inside & ~binary_erosion(inside)
        nodes = np.clip(np.round(item["points"].numpy() * res).astype(int), 0, res - 1)
        return distance_transform_edt(~surface)[tuple(nodes.T)]

    for index in range(2):
        a = aug[index]
        assert not torch.equal(a["transform"], torch.eye(3, 4))
        assert not torch.equal(a["points"], plain[index]["points"])
        assert 0 <= float(a["points"].min()) and float(a["points"].max()) < 1
        # Points lie on the moved target's surface (within a node or two), as on the plain one.
        assert np.median(distance_to_surface(a)) <= 1.0
        assert np.percentile(distance_to_surface(a), 95) <= 2.0
        assert np.percentile(distance_to_surface(plain[index]), 95) <= 2.0


def test_augmentation_is_per_epoch_and_reaches_the_dataset_through_batch_sampler(trained):
    _, cfg, data_root = trained
    task = get_task("voxelizer")
    train_ds, val_ds = task.build_datasets(cfg.task)
    first = train_ds[0]["points"]
    batches = task.batch_sampler(train_ds, rank=0, world_size=1, micro_batch=2, accumulation=1, seed=0, epoch=3)
    assert train_ds.epoch == 3  # the engine does not call set_epoch; batch_sampler does
    assert batches == global_batches(
        len(train_ds), global_batch=2, micro_batch=2, accumulation=1, world_size=1, rank=0, seed=0, epoch=3
    )
    assert not torch.equal(train_ds[0]["points"], first)
    task.batch_sampler(train_ds, rank=0, world_size=1, micro_batch=2, accumulation=1, seed=0, epoch=0)
    assert torch.equal(train_ds[0]["points"], first)  # (seed, epoch, index) decide everything
    assert torch.equal(val_ds[0]["transform"], torch.eye(3, 4))  # validation is never augmented


def test_inside_grid_strided_path_equals_interpolation():
    from scipy.ndimage import map_coordinates

    mask = np.random.default_rng(0).random((48, 40, 36)) > 0.7
    for res in (24, 16, 48):  # 48 is a multiple of each: the strided path
        axis = np.arange(res) * 48 / res
        coords = np.stack(np.meshgrid(axis, axis, axis, indexing="ij")).reshape(3, -1)
        expected = map_coordinates(mask.astype(np.float32), coords, order=1, mode="constant", cval=0.0) >= 0.5
        assert np.array_equal(inside_grid(mask, res), expected.reshape((res,) * 3))


# --------------------------------------------------------------------------- synthetic data on first use


def test_synthetic_data_is_built_once_when_two_processes_ask_at_once(tmp_path):
    root = tmp_path / "syn"
    root.mkdir()  # an empty folder counts as absent
    (tmp_path / ".syn.building-leftover").mkdir()  # a crashed builder's temporary folder
    script = textwrap.dedent(f"""
        import sys
        from pointforge.data.cache import ensure_synthetic_prepared
        path = ensure_synthetic_prepared({str(root)!r}, 1, 64, 3, 1000, log=lambda m: print(m, flush=True))
        print("RESULT", path)
    """)
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    text = "\n".join(outputs)
    assert text.count("synthesising") == 1, text  # one builder; the other waited and reused it
    assert text.count(f"RESULT {root}") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".syn.lock", "syn"]  # no temporary folders left
    recipe = json.loads((root / "synthetic.json").read_text())
    assert recipe["skulls"] == 1 and recipe["seed"] == 3
    info = json.loads((root / "dataset.json").read_text())
    assert info["source_root"] == str(root / "raw") and (root / "raw" / "complete_skull" / "000.nrrd").is_file()
    assert len(PreparedDataset(root).cases) == 5
    with pytest.raises(ConfigError, match="other settings: seed 3 \\(asked 4\\)"):
        ensure_synthetic_prepared(root, 1, 64, 4, 1000, log=lambda m: None)
    # The cache keys on the skull family too; a recipe from before the family was recorded was of domes.
    assert recipe["family"] == "domes"
    with pytest.raises(ConfigError, match="other settings: family 'domes' \\(asked 'anatomical'\\)"):
        ensure_synthetic_prepared(root, 1, 64, 3, 1000, log=lambda m: None, family="anatomical")
    (root / "synthetic.json").write_text(json.dumps({k: v for k, v in recipe.items() if k != "family"}))
    assert ensure_synthetic_prepared(root, 1, 64, 3, 1000, log=lambda m: None) == root


def test_synthetic_data_under_a_relative_path_records_where_its_raw_volumes_ended_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = ensure_synthetic_prepared(Path("data") / "syn", 1, 64, 0, 1000, log=lambda m: None)
    data = PreparedDataset(root)
    sources = [Path(data.meta(c.defective)["source"]) for c in data.cases]
    assert sources and all(s.is_absolute() and s.is_file() for s in sources)  # not into the deleted build folder
    assert json.loads((root / "dataset.json").read_text())["source_root"] == str((tmp_path / root / "raw").resolve())


# --------------------------------------------------------------------------- training for real


def test_tiny_config_trains_from_nothing(trained):
    result, cfg, data_root = trained
    assert result.status == "finished" and result.global_step == 100
    assert (data_root / "synthetic.json").is_file()
    run = Path(cfg.run.dir)
    assert result.best["metric"] == "val_iou" and (run / "checkpoints" / "best.pt").is_file()
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_iou" in line]
    assert len(evals) == 4 and {"val_loss", "val_l2", "val_iou", "val_fill"} <= set(evals[-1])
    assert 0 < evals[-1]["val_fill"] < 10
    best = ck.load_checkpoint(run / "checkpoints" / "best.pt")
    assert best["progress"]["best_value"] == max(e["val_iou"] for e in evals)


def _held_out_iou(model, data_root: Path, *, n_points: int = 2048) -> list[float]:
    data = PreparedDataset(data_root)
    scores = []
    for case in data.split("test"):
        reference = read_binary_volume(data_root / "raw" / "complete_skull" / f"{case.skull_id}.nrrd")
        rng = np.random.default_rng(0)
        skull = np.asarray(data.points(case.defective))
        implant = np.asarray(data.points(case.implant))
        n_implant = n_points // 10
        points = np.concatenate(
            [
                skull[rng.choice(len(skull), n_points - n_implant, replace=False)],
                implant[rng.choice(len(implant), n_implant, replace=False)],
            ]
        )
        predicted = points_to_volume(model, points, reference).data
        truth = reference.data
        scores.append(float((predicted & truth).sum() / (predicted | truth).sum()))
    return scores


class RadialNormals(torch.nn.Module):
    """The blob baseline: every normal points away from the cloud's centroid."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def oriented_points(self, points):
        normals = points - points.mean(dim=1, keepdim=True)
        return points, normals / normals.norm(dim=-1, keepdim=True)


def test_trained_tiny_reconstructs_held_out_skulls(trained):
    result, cfg, data_root = trained
    loaded = load_voxelizer(Path(cfg.run.dir) / "checkpoints" / "best.pt")
    model, loaded_cfg = loaded.model, loaded.run_config
    assert loaded_cfg.task.model == cfg.task.model
    scores = _held_out_iou(model, data_root)
    blob = _held_out_iou(RadialNormals(model.cfg), data_root)
    print(f"held-out IoU {np.mean(scores):.3f} (per case {np.round(scores, 3).tolist()}), blob {np.mean(blob):.3f}")
    assert len(scores) == 5
    assert np.mean(blob) <= BLOB_IOU_MAX
    assert np.mean(scores) >= HELD_OUT_IOU_MIN
    assert np.mean(scores) >= 3 * np.mean(blob)


def test_resumed_run_equals_an_uninterrupted_one(trained, tmp_path):
    _, _, data_root = trained
    fast = ["task.n_points=512", "train.eval_every=1"]
    train(get_task("voxelizer"), tiny_cfg(tmp_path / "straight", data_root, "train.epochs=2", *fast), console=False)
    train(get_task("voxelizer"), tiny_cfg(tmp_path / "cut", data_root, "train.epochs=1", *fast), console=False)
    resumed = train(
        get_task("voxelizer"),
        tiny_cfg(tmp_path / "cut", data_root, "train.epochs=2", *fast),
        resume="auto",
        console=False,
    )
    assert resumed.resumed_from is not None and resumed.global_step == 10
    a = ck.load_checkpoint(tmp_path / "straight" / "checkpoints" / "latest.pt")["model"]
    b = ck.load_checkpoint(tmp_path / "cut" / "checkpoints" / "latest.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_carries_its_training_frame_without_the_data(trained, tmp_path):
    """The frame (the training cube in mm, the skulls' centre in it) is computed from the training data when
    the run builds the model and saved with the weights: loading needs no access to that data. Before, it was
    read from task.data_root at load time, so a checkpoint moved away from its data lost it silently."""
    import shutil

    from pointforge.data.skulls.grids import training_frame

    _, _, shared = trained
    data_root = tmp_path / "data"
    shutil.copytree(shared, data_root)
    cfg = tiny_cfg(tmp_path / "run", data_root, "task.n_points=512", "train.epochs=1", "train.eval_every=1")
    train(get_task("voxelizer"), cfg, console=False)
    expected = training_frame(PreparedDataset(data_root), cfg.task.train_split)
    assert expected is not None and expected.cube_mm > 0
    checkpoint = Path(cfg.run.dir) / "checkpoints" / "latest.pt"
    saved = ck.load_checkpoint(checkpoint)
    for weights in ("model", "ema"):
        if saved.get(weights) is not None:
            assert float(saved[weights]["frame_cube_mm"]) == pytest.approx(expected.cube_mm)

    shutil.rmtree(data_root)
    for weights in ("auto", "model"):
        frame = load_voxelizer(checkpoint, weights=weights).frame
        assert frame is not None
        assert frame.cube_mm == pytest.approx(expected.cube_mm)
        assert frame.centre == pytest.approx(expected.centre)


def test_the_frame_is_not_used_in_training_and_a_bare_build_has_none(trained):
    """A model built without data (loading, an old preset) has no frame; the frame buffers change nothing the
    network computes."""
    _, cfg, _ = trained
    task = get_task("voxelizer")
    bare = task.build_model(cfg.task)
    assert bare.frame() is None and float(bare.frame_cube_mm) == 0.0
    torch.manual_seed(0)
    framed = task.build_model(cfg.task)
    framed.load_state_dict(bare.state_dict())
    framed.set_frame(230.0, (0.5, 0.4, 0.6))
    assert framed.frame() == (230.0, (0.5, 0.4, 0.6))
    points = torch.rand(1, 256, 3, generator=torch.Generator().manual_seed(1))
    a, b = bare.eval()(points), framed.eval()(points)
    assert torch.equal(a.points, b.points) and torch.equal(a.normals, b.normals) and torch.equal(a.psr, b.psr)


def test_a_collapsed_voxelizer_is_named_with_what_to_do_and_a_working_one_is_not():
    task = get_task("voxelizer")
    said = task.health({"val_iou": 0.0, "val_fill": 0.0001})
    assert (
        len(said) == 1
        and "collapsed" in said[0]
        and "train.seed" in said[0]
        and "task.model.max_offset=0.05" in said[0]
    )
    assert task.health({"val_iou": 0.45, "val_fill": 1.1}) == [] and task.health({"val_loss": 1.0}) == []
