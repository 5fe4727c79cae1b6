"""The upsampler task through the engine, its data preparation, and `pointforge upsample`."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import laspy
import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from pointforge.cli.upsample import upsample as upsample_command
from pointforge.data.batching import collate_pairs
from pointforge.data.pairs.dataset import UpsamplingPairs
from pointforge.data.pairs.manifest import PairEntry, read_manifest, write_manifest
from pointforge.data.pairs.scenes import spread_sizes, synthetic_pair, write_synthetic_pairs
from pointforge.data.pointio import read_points, write_points
from pointforge.errors import CheckpointError, ConfigError, DataError
from pointforge.inference.upsampler import load_upsampler
from pointforge.nn.losses import chamfer_distance, point_to_plane_distance
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.upsampler import SyntheticPairsSection, ensure_synthetic_pairs, model_config, select_clouds
from pointforge.train.checkpoint import format as ck
from pointforge.train.data import derive_seed, seed_everything
from pointforge.train.engine import train
from pointforge.train.task import EvalContext
from pointforge.upsampling.pipeline import upsample_file, upsample_points
from tests.helpers import QUIET, REPO

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = REPO / "pointforge" / "configs" / "upsampler" / "tiny.yaml"


def make_cfg(run_dir: Path, *overrides: str):
    return load_train_config("upsampler", TINY, [f"run.dir={run_dir}", *QUIET, *overrides])


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    """Six pairs of uneven sizes (60..300 sparse points); the manifest's path."""
    return write_synthetic_pairs(tmp_path_factory.mktemp("pairs") / "set", [60, 150, 90, 300, 120, 200], seed=1)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The shipped tiny config run as from a fresh clone: relative paths, no data prepared beforehand."""
    work = tmp_path_factory.mktemp("fresh")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        cfg = load_train_config("upsampler", TINY, [*QUIET, "train.epochs=1"])
        result = train(get_task("upsampler"), cfg, console=False)
    assert result.status == "finished"
    return work


# --------------------------------------------------------------------------- data preparation


def test_tiny_config_trains_from_nothing_and_keeps_the_best_by_validation_chamfer(tiny_run):
    data = tiny_run / "data" / "upsampler" / "synthetic-tiny"
    assert len(read_manifest(data / "pairs.csv")) == 16
    assert json.loads((data / "synthetic.json").read_text())["sizes"][0] == 200
    run = tiny_run / "runs" / "upsampler" / "tiny"
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "finished" and status["best"]["metric"] == "val_chamfer"
    metrics = status["metrics"]
    assert {"val_chamfer", "val_chamfer_src", "val_chamfer_input", "train/points"} <= set(metrics)
    assert all(np.isfinite(metrics[k]) and metrics[k] > 0 for k in ("val_chamfer", "val_chamfer_src", "train/loss"))
    assert (run / "checkpoints" / "best.pt").is_file()
    assert not list(data.parent.glob(".synthetic-tiny.*.tmp"))


def test_synthetic_set_is_written_once_when_several_ranks_start_together(tmp_path):
    section = SyntheticPairsSection(pairs=3, min_points=40, max_points=120, seed=3)
    root = tmp_path / "shared" / "set"
    (tmp_path / "shared" / ".set.crashed.tmp" / "sparse").mkdir(parents=True)  # left by a builder that was killed
    start = threading.Barrier(3)
    built, errors = [], []

    def rank() -> None:
        start.wait()
        try:
            built.append(ensure_synthetic_pairs(root, section))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=rank) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(built) == [False, False, True]
    assert [len(read_points(e.sparse)) for e in read_manifest(root / "pairs.csv")] == spread_sizes(3, 40, 120, seed=3)
    assert sorted(p.name for p in root.parent.iterdir()) == [".set.lock", "set"]  # no temporary folder left
    assert ensure_synthetic_pairs(root, section) is False
    with pytest.raises(ConfigError, match="other task.synthetic settings"):
        ensure_synthetic_pairs(root, SyntheticPairsSection(pairs=3, min_points=40, max_points=120, seed=4))
    (tmp_path / "foreign").mkdir()
    with pytest.raises(DataError, match="holds no pairs.csv"):
        ensure_synthetic_pairs(tmp_path / "foreign", section)


def test_config_and_data_errors_are_one_clear_line(tmp_path, small_set):
    cases = [
        (["task.max_points=0"], ConfigError, "task.max_points"),
        (["task.val_manifest=pairs.csv"], ConfigError, "val_fraction=0"),
        (["task.model.hidden=15"], ConfigError, "task.model"),
        (["task.batching=greedy"], ConfigError, "budget, count"),
        (["task.synthetic.pairs=4", "task.manifest=other.csv"], ConfigError, "must stay pairs.csv"),
    ]
    for overrides, kind, text in cases:
        with pytest.raises(kind, match=text.replace(".", r"\.")) as caught:
            make_cfg(tmp_path / "r", *overrides)
        assert "\n" not in str(caught.value)
    task = get_task("upsampler")
    cfg = make_cfg(tmp_path / "r", "task.synthetic.pairs=0", f"task.data_root={tmp_path / 'nothing'}")
    with pytest.raises(DataError, match="task.synthetic.pairs"):
        task.build_datasets(cfg.task)
    one = write_manifest(small_set.parent / "one.csv", read_manifest(small_set)[:1])
    cfg = make_cfg(tmp_path / "r", "task.synthetic.pairs=0", f"task.data_root={one.parent}", "task.manifest=one.csv")
    with pytest.raises(DataError, match="at least 2 pairs"):
        task.build_datasets(cfg.task)


def test_shipped_configs_load_and_build_their_networks():
    for name, preset in (("tiny", "tiny"), ("small", "small"), ("paper", "paper")):
        cfg = load_train_config("upsampler", REPO / "pointforge" / "configs" / "upsampler" / f"{name}.yaml")
        assert cfg.task.preset == preset and cfg.task.batching == "budget"
        assert get_task("upsampler").build_model(cfg.task).config == model_config(cfg.task)
    assert (
        load_train_config("upsampler", REPO / "pointforge" / "configs" / "upsampler" / "paper.yaml").perf.amp == "bf16"
    )


# --------------------------------------------------------------------------- batching and evaluation


def test_sampler_hook_keeps_budgets_and_equal_counts_and_split_is_seeded(tmp_path, small_set):
    task = get_task("upsampler")
    cfg = make_cfg(tmp_path / "r", "task.synthetic.pairs=0", f"task.data_root={small_set.parent}",
                   "task.val_fraction=0.2", "task.max_points=350")  # fmt: skip
    task.configure(cfg.task)
    train_ds, val_ds = task.build_datasets(cfg.task)
    again, _ = task.build_datasets(cfg.task)
    assert len(train_ds) == 5 and len(val_ds) == 1
    assert [e.pair_id for e in train_ds.entries] == [e.pair_id for e in again.entries]
    plans = [
        [
            list(b)
            for b in task.batch_sampler(train_ds, rank=r, world_size=2, micro_batch=2, accumulation=1, seed=0, epoch=0)
        ]
        for r in range(2)
    ]
    assert len(plans[0]) == len(plans[1]) >= 2
    for batch in plans[0] + plans[1]:
        assert len(batch) <= 2 and (len(batch) == 1 or train_ds.sparse_sizes[batch].sum() <= 350)
    assert sorted(i for plan in plans for b in plan for i in b) == list(range(5))
    cfg.task.batching = "count"
    task.configure(cfg.task)
    assert task.batch_sampler(train_ds, rank=0, world_size=1, micro_batch=2, accumulation=1, seed=0, epoch=0) is None


def test_validation_metrics_do_not_depend_on_batching_and_source_units_scale_by_the_pair(tmp_path, small_set):
    task = get_task("upsampler")
    ds = UpsamplingPairs(small_set)
    torch.manual_seed(0)
    model = task.build_model(make_cfg(tmp_path / "r").task).eval()
    for head in (model.coarse, model.decode[-1][-1]):  # visible offsets, so the model differs from its input
        torch.nn.init.normal_(head.weight, std=0.3)

    def run(batch_size: int, budget: int) -> dict[str, float]:
        cfg = make_cfg(tmp_path / "r", f"task.max_points={budget}")
        task.configure(cfg.task)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=task.collate)
        ctx = EvalContext(epoch=0, global_step=0, device=torch.device("cpu"), rank=0, world_size=1, amp_dtype=None,
                          out_dir=tmp_path, micro_batch=batch_size)  # fmt: skip
        with torch.no_grad():
            return task.evaluate(model, loader, ctx)

    one, grouped = run(1, 10_000), run(4, 250)
    assert (
        one.keys()
        == grouped.keys()
        == {"val_chamfer", "val_chamfer_src", "val_chamfer_input", "val_surface", "val_surface_input"}
    )
    for key in one:
        assert one[key] == pytest.approx(grouped[key], rel=1e-5)
    assert one["val_chamfer"] != pytest.approx(one["val_chamfer_input"], rel=1e-2)
    # Source units by hand: denormalise both clouds of every pair.
    per_pair = []
    for i in range(len(ds)):
        pair = ds[i]
        batch = collate_pairs([pair])
        with torch.no_grad():
            out = model(batch.sparse, batch.sparse_batch, batch.edge_index)
        pred = torch.from_numpy(batch.denormalize(out.points, out.batch)[0] - pair.center)
        dense = torch.from_numpy(batch.denormalize(batch.dense, batch.dense_batch)[0] - pair.center)
        per_pair.append(float(chamfer_distance(pred, dense)))
    assert one["val_chamfer_src"] == pytest.approx(np.mean(per_pair), rel=1e-4)
    # The point-to-surface numbers are point_to_plane_distance per pair, averaged, for the model and the input.
    per_pair_surface, per_pair_input = [], []
    for i in range(len(ds)):
        batch = collate_pairs([ds[i]])
        with torch.no_grad():
            out = model(batch.sparse, batch.sparse_batch, batch.edge_index)
        per_pair_surface.append(float(point_to_plane_distance(out.points, batch.dense)))
        per_pair_input.append(float(point_to_plane_distance(batch.sparse, batch.dense)))
    assert one["val_surface"] == pytest.approx(np.mean(per_pair_surface), rel=1e-4)
    assert one["val_surface_input"] == pytest.approx(np.mean(per_pair_input), rel=1e-4)
    part = select_clouds(collate_pairs([ds[i] for i in range(4)]), 1, 3)
    assert part.pair_ids == ["pair_001", "pair_002"] and part.num_points == 240
    assert int(part.edge_index.min()) == 0 and int(part.edge_index.max()) == 239


# --------------------------------------------------------------------------- training through the engine


def test_tiny_model_overfits_one_pair_through_the_engine(tmp_path):
    manifest = write_synthetic_pairs(tmp_path / "one", [64], seed=0)
    pair = read_manifest(manifest)[0]
    # One epoch of 150 one-cloud steps: the same pair listed 150 times.
    write_manifest(
        manifest.parent / "repeated.csv", [PairEntry(f"r{i:03d}", pair.sparse, pair.dense) for i in range(150)]
    )
    cfg = make_cfg(
        tmp_path / "run", "task.synthetic.pairs=0", f"task.data_root={manifest.parent}", "task.manifest=repeated.csv",
        "task.val_manifest=pairs.csv", "task.val_fraction=0", "data.global_batch=1", "train.epochs=1", "optim.lr=1e-2",
        "sched.name=constant", "sched.warmup_steps=0", "ckpt.every_epochs=0", "log.every_steps=50",
    )  # fmt: skip
    result = train(get_task("upsampler"), cfg, console=False)
    assert result.global_step == 150
    # An untrained model puts every child on its parent, which scores what the input scores.
    start, end = result.metrics["val_chamfer_input"], result.metrics["val_chamfer"]
    assert end < start / 3, (start, end)


def test_count_batching_leaves_batches_to_the_engine(tmp_path, small_set):
    cfg = make_cfg(tmp_path / "run", "task.synthetic.pairs=0", f"task.data_root={small_set.parent}", "task.val_fraction=0",
                   "task.batching=count", "data.global_batch=2", "train.epochs=1", "log.every_steps=1", "ckpt.every_epochs=0")  # fmt: skip
    result = train(get_task("upsampler"), cfg, console=False)
    assert result.global_step == 3  # 6 clouds, 2 per step
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["train/clouds"] for x in lines if "train/clouds" in x] == [2.0, 2.0, 2.0]


def _first_losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["train/loss"] for x in lines if "train/loss" in x]


def test_bf16_autocast_on_cpu_trains_close_to_float32(tmp_path, small_set):
    common = ["task.synthetic.pairs=0", f"task.data_root={small_set.parent}", "task.val_fraction=0", "train.max_steps=2",
              "log.every_steps=1", "ckpt.every_epochs=0", "data.global_batch=2", "optim.lr=1e-2"]  # fmt: skip
    results = {
        amp: train(get_task("upsampler"), make_cfg(tmp_path / amp, *common, f"perf.amp={amp}"), console=False)
        for amp in ("none", "bf16")
    }
    assert all(r.status == "finished" and r.global_step == 2 for r in results.values())
    fp32, bf16 = _first_losses(tmp_path / "none"), _first_losses(tmp_path / "bf16")
    assert len(bf16) == 2 and all(np.isfinite(bf16))
    # Same weights, same first batch: bf16 rounding shows, but only a little.
    assert bf16[0] != fp32[0] and bf16[0] == pytest.approx(fp32[0], rel=0.05)
    assert ck.load_checkpoint(tmp_path / "bf16" / "checkpoints" / "latest.pt")["config"]["perf"]["amp"] == "bf16"


def test_gradient_accumulation_equals_one_batch_of_the_same_clouds(tmp_path, small_set):
    two = write_manifest(small_set.parent / "two.csv", read_manifest(small_set)[:2])
    common = ["task.synthetic.pairs=0", f"task.data_root={two.parent}", "task.manifest=two.csv", "task.val_fraction=0",
              "data.global_batch=2", "train.epochs=1", "optim.name=sgd", "optim.lr=0.5", "sched.name=constant",
              "sched.warmup_steps=0", "ckpt.every_epochs=0"]  # fmt: skip
    whole = train(get_task("upsampler"), make_cfg(tmp_path / "whole", *common), console=False)
    accum = train(get_task("upsampler"), make_cfg(tmp_path / "accum", *common, "data.micro_batch=1"), console=False)
    assert whole.global_step == accum.global_step == 1  # one step of two clouds, or of two micro-batches of one
    assert "× 2 accumulation steps" in (tmp_path / "accum" / "train.log").read_text()
    a = ck.load_checkpoint(tmp_path / "whole" / "checkpoints" / "latest.pt")["model"]
    b = ck.load_checkpoint(tmp_path / "accum" / "checkpoints" / "latest.pt")["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    seed_everything(derive_seed(0, "init"))  # the engine's initial weights
    initial = get_task("upsampler").build_model(make_cfg(tmp_path / "x").task).state_dict()
    assert sum(not torch.allclose(initial[k], a[k]) for k in a) > len(a) // 2  # the step did move the weights


# --------------------------------------------------------------------------- using a trained model


def _cli(*args: str):
    app = typer.Typer(add_completion=False)
    app.command("upsample")(upsample_command)
    app.callback()(lambda: None)
    return CliRunner().invoke(app, ["upsample", *args])


def _georeferenced_las(path: Path, n: int = 300) -> np.ndarray:
    from laspy.vlrs.known import WktCoordinateSystemVlr

    sparse, _ = synthetic_pair(n, seed=11)
    header = laspy.LasHeader(point_format=6, version="1.4")
    header.scales, header.offsets = np.array([0.01, 0.01, 0.001]), np.array([500_000.0, 4_100_000.0, 100.0])
    header.vlrs.append(WktCoordinateSystemVlr('PROJCS["NAD83 / UTM zone 15N"]'))
    header.global_encoding.wkt = True
    las = laspy.LasData(header)
    ints = np.round((sparse - header.offsets) / header.scales).astype(np.int32)
    las.X, las.Y, las.Z = ints.T
    las.write(path)
    return ints * header.scales + header.offsets


def test_upsample_las_round_trip_keeps_frame_scales_offsets_and_crs(tmp_path, tiny_run):
    best = tiny_run / "runs" / "upsampler" / "tiny" / "checkpoints" / "best.pt"
    xyz = _georeferenced_las(tmp_path / "tile.las")
    result = _cli(
        str(tmp_path / "tile.las"), "--ckpt", str(best), "--out", str(tmp_path / "dense.laz"), "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    assert "300 → 600 points" in result.output
    back = laspy.read(tmp_path / "dense.laz")
    assert len(back.points) == 600
    assert tuple(back.header.scales) == (0.01, 0.01, 0.001) and tuple(back.header.offsets) == (
        500_000.0,
        4_100_000.0,
        100.0,
    )
    assert back.header.point_format.id == 6 and any(
        "UTM zone 15N" in str(getattr(v, "string", "")) for v in back.header.vlrs
    )
    # The same points as the Python API gives, quantised to the input's scales.
    upsampler = load_upsampler(best, "cpu")
    expected = upsample_points(upsampler, read_points(tmp_path / "tile.las").xyz)
    half_step = np.array([0.01, 0.01, 0.001]) / 2 + 1e-9
    assert np.all(np.abs(read_points(tmp_path / "dense.laz").xyz - expected) <= half_step)
    # In the input's frame: every new point lies near the input points (a few point spacings at most).
    span = xyz.max(axis=0) - xyz.min(axis=0)
    assert np.all(expected.min(axis=0) > xyz.min(axis=0) - 0.1 * span)
    assert np.all(expected.max(axis=0) < xyz.max(axis=0) + 0.1 * span)
    # float32 npy in, float32 npy out.
    write_points(tmp_path / "small.npy", xyz[:100].astype(np.float32))
    result = _cli(str(tmp_path / "small.npy"), "--ckpt", str(best), "--out", str(tmp_path / "small_dense.ply"))
    assert result.exit_code == 0, result.output
    assert (
        read_points(tmp_path / "small_dense.ply").dtype == np.float32
        and len(read_points(tmp_path / "small_dense.ply")) == 200
    )


def test_upsample_bad_inputs_fail_with_one_clear_line(tmp_path, tiny_run):
    best = tiny_run / "runs" / "upsampler" / "tiny" / "checkpoints" / "best.pt"
    write_points(tmp_path / "in.npy", np.random.default_rng(0).normal(size=(50, 3)))
    state = ck.load_checkpoint(best)
    ck.save_checkpoint(tmp_path / "toy.pt", {**state, "task": "toy"})
    ck.save_weights(tmp_path / "bare.pt", state["model"])
    cases = [
        ((tmp_path / "missing.npy", best, tmp_path / "o.npy"), DataError, "no such point cloud file"),
        ((tmp_path / "in.xyz", best, tmp_path / "o.npy"), DataError, "unsupported point cloud format '.xyz'"),
        ((tmp_path / "in.npy", best, tmp_path / "o.txt"), DataError, "unsupported point cloud format '.txt'"),
        ((tmp_path / "in.npy", best, tmp_path / "in.npy"), DataError, "overwrite the input"),
        ((tmp_path / "in.npy", tmp_path / "none.pt", tmp_path / "o.npy"), CheckpointError, "does not exist"),
        (
            (tmp_path / "in.npy", tmp_path / "toy.pt", tmp_path / "o.npy"),
            CheckpointError,
            "of task 'toy', not of task 'upsampler'",
        ),
        (
            (tmp_path / "in.npy", tmp_path / "bare.pt", tmp_path / "o.npy"),
            CheckpointError,
            "not a pointforge training checkpoint",
        ),
    ]
    for (src, ckpt, out), kind, text in cases:
        result = _cli(str(src), "--ckpt", str(ckpt), "--out", str(out), "--device", "cpu")
        assert isinstance(result.exception, kind), (text, result.output, result.exception)
        assert text in str(result.exception) and "\n" not in str(result.exception)
    assert not (tmp_path / "o.npy").exists()


def test_plane_start_is_kept_in_the_checkpoint_and_used_by_every_way_of_upsampling(tmp_path, small_set):
    common = ["task.synthetic.pairs=0", f"task.data_root={small_set.parent}", "task.val_fraction=0", "train.max_steps=1",
              "ckpt.every_epochs=0", "data.global_batch=2", "task.model.start=plane"]  # fmt: skip
    assert train(get_task("upsampler"), make_cfg(tmp_path / "run", *common), console=False).status == "finished"
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    state = ck.load_checkpoint(latest)
    assert state["config"]["task"]["model"]["start"] == "plane"
    upsampler = load_upsampler(latest, "cpu")
    assert upsampler.model.config.start == "plane"
    sparse, _ = synthetic_pair(400, seed=3)
    dense = upsample_points(upsampler, sparse)
    # The same weights starting from the parents give other points: the start is honoured, not just stored.
    as_input = type(upsampler.model)(dataclasses.replace(upsampler.model.config, start="input"))
    as_input.load_state_dict(upsampler.model.state_dict())
    assert np.abs(upsample_points(as_input.eval(), sparse) - dense).max() > 0.01
    write_points(tmp_path / "in.npy", sparse)
    upsample_file(tmp_path / "in.npy", tmp_path / "out.npy", upsampler)
    assert np.array_equal(read_points(tmp_path / "out.npy").xyz, dense)
    # A checkpoint from before the option existed has no task.model.start: it loads as "input", as it was trained.
    del state["config"]["task"]["model"]["start"]
    ck.save_checkpoint(tmp_path / "old.pt", state)
    assert load_upsampler(tmp_path / "old.pt", "cpu").model.config.start == "input"
