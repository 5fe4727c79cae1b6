"""The pcdiff task: configs, the synthetic-data cache, the loss, training through the engine,
load_pcdiff and sampling from what it loads, and importing upstream checkpoints."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from pointforge.data.cache import SyntheticSection
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import CheckpointError, ConfigError, DataError, UserError
from pointforge.implant.proposals import complete
from pointforge.inference import pcdiff as pcdiff_inference
from pointforge.inference.pcdiff import CPU_EVAL_CHUNK_POINTS, load_pcdiff
from pointforge.nn.diffusion.loss import diffusion_loss
from pointforge.nn.diffusion.samplers.registry import make_sampler
from pointforge.nn.pvcnn import PVCNN2
from pointforge.ops.pcdiff_import import import_pcdiff_checkpoint
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.pcdiff import task as pc
from pointforge.tasks.pcdiff.dataset import PCDiffDataset, ensure_prepared_dataset
from pointforge.tasks.pcdiff.task import PCDiffTask
from pointforge.train.checkpoint import format as ck
from pointforge.train.engine import train
from tests.helpers import CONFIGS, FIXTURES

PCDIFF_CONFIGS = CONFIGS / "pcdiff"
FIXTURE = FIXTURES / "upstream_pvcnn2_tiny.pt"


def tiny_cfg(run_dir: Path, data_root: Path, *overrides: str):
    return load_train_config(
        "pcdiff",
        PCDIFF_CONFIGS / "tiny.yaml",
        [
            f"run.dir={run_dir}",
            f"task.data_root={data_root}",
            "log.progress=off",
            "log.tensorboard=false",
            "perf.threads=1",
            *overrides,
        ],
    )


def _cli():
    from pointforge.cli.train import register

    app = typer.Typer(add_completion=False)

    @app.callback()
    def _root() -> None:
        """Test root."""

    register(app)
    return app


# --------------------------------------------------------------------------- configs


def test_presets_load_and_paper_is_the_published_setup():
    tiny = load_train_config("pcdiff", PCDIFF_CONFIGS / "tiny.yaml")
    small = load_train_config("pcdiff", PCDIFF_CONFIGS / "small.yaml")
    paper = load_train_config("pcdiff", PCDIFF_CONFIGS / "paper.yaml")
    assert (tiny.task.model, tiny.task.n_skull, tiny.task.n_implant) == ("tiny", 896, 128)
    assert (small.task.model, small.task.n_skull, small.task.n_implant) == ("small", 3456, 384)
    assert tiny.task.synthetic is not None and small.task.synthetic is not None and paper.task.synthetic is None
    # Friedrich et al., MICCAI 2023: Adam lr 2e-4, β1 0.5, batch 8, constant LR, 15,000 epochs, T = 1000 linear 1e-4 → 0.02.
    assert (paper.optim.name, paper.optim.lr, paper.optim.betas) == ("adam", 2e-4, (0.5, 0.999))
    assert (paper.data.global_batch, paper.sched.name, paper.train.epochs) == (8, "constant", 15000)
    d = paper.task.diffusion
    assert (d.schedule, d.beta_start, d.beta_end, d.timesteps) == ("linear", 1e-4, 0.02, 1000)
    assert (paper.task.model, paper.task.n_skull, paper.task.n_implant) == ("paper", 27648, 3072)
    for cfg in (tiny, small, paper):
        task = PCDiffTask()
        task.configure(cfg.task)  # builds the schedule and the evaluation sampler
        assert task.schedule.num_timesteps == cfg.task.diffusion.timesteps
    # Point counts default to the preset's.
    assert load_train_config("pcdiff", None, ["task.model=small"]).task.n_implant == 384


@pytest.mark.parametrize(
    "override, key",
    [
        ("task.n_implant=0", "task.n_implant"),
        ("task.eval.steps=5000", "task.eval.steps"),
        ("task.model=huge", "task.model"),
        ("task.diffusion.beta_end=2", "task.diffusion"),
        ("task.eval.sampler=ddpm", "task.eval.steps"),
        ("task.n_skull=10", "task.n_skull"),
        ("task.synthetic.size=16", "task.synthetic.size"),
        ("task.synthetic.family=blobs", "task.synthetic.family"),
        ("task.val_split=train", "task.val_split"),
    ],
)
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_train_config("pcdiff", PCDIFF_CONFIGS / "tiny.yaml", [override])


# --------------------------------------------------------------------------- the synthetic-data cache


def test_synthetic_dataset_is_built_once_while_other_callers_wait(tmp_path, monkeypatch):
    import pointforge.data.synthetic.dataset as synthetic

    calls = []
    real = synthetic.synthesize

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "synthesize", counting)
    spec = SyntheticSection(skulls=2, size=64, seed=3, points=1000, split="0.5,0.5,0")
    root = tmp_path / "cache" / "synth"
    results, errors = [], []

    def build():
        try:
            results.append(ensure_prepared_dataset(root, spec))
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [root] * 3
    assert len(calls) == 1  # one builder; the others waited on the lock and reused its folder
    data = PreparedDataset(root)
    from pointforge.data.cache import RECIPE_FILE

    assert json.loads((root / RECIPE_FILE).read_text())["seed"] == 3 and (root / "raw" / "complete_skull").is_dir()
    assert len(data.cases) > 0
    assert [p.name for p in root.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []
    assert ensure_prepared_dataset(root, spec) == root and len(calls) == 1
    with pytest.raises(ConfigError, match="made with other settings"):
        ensure_prepared_dataset(root, SyntheticSection(skulls=3, size=64, seed=3, points=1000))
    with pytest.raises(ConfigError, match="family 'domes' \\(asked 'anatomical'\\)"):
        ensure_prepared_dataset(
            root, SyntheticSection(skulls=2, size=64, seed=3, points=1000, split="0.5,0.5,0", family="anatomical")
        )
    with pytest.raises(DataError, match="no prepared dataset here"):
        ensure_prepared_dataset(tmp_path / "nothing", None)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(DataError, match="exists but is not a prepared dataset"):
        ensure_prepared_dataset(tmp_path / "junk", spec)


def test_a_failed_build_leaves_no_folder_behind(tmp_path, monkeypatch):
    import pointforge.data.prepare as prepare

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prepare, "prepare_dataset", broken)
    root = tmp_path / "synth"
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_prepared_dataset(root, SyntheticSection(skulls=2, size=64, points=1000))
    assert not root.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []


# --------------------------------------------------------------------------- the loss and the data


class _Recorder(torch.nn.Module):
    """Returns a fixed function of its input and remembers what it was given."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(0.5))
        self.seen = []

    def forward(self, x, t):
        self.seen.append((x.detach().clone(), t.clone()))
        return self.weight * x


def test_training_step_noises_only_the_implant_points(synthetic_skulls):
    cfg = tiny_cfg(Path("unused"), synthetic_skulls).task
    task = PCDiffTask()
    task.configure(cfg)
    train_ds, val_ds = task.build_datasets(cfg)
    batch = torch.utils.data.default_collate([train_ds[0], train_ds[1]])
    model = _Recorder()
    torch.manual_seed(5)
    loss = task.training_step(model, batch, ctx=None)
    x_seen, _ = model.seen[0]
    clean = batch["points"].transpose(1, 2)
    assert torch.equal(x_seen[:, :, : cfg.n_skull], clean[:, :, : cfg.n_skull])  # skull clean
    assert not torch.allclose(x_seen[:, :, cfg.n_skull :], clean[:, :, cfg.n_skull :])  # implant noised
    torch.manual_seed(5)
    expected = diffusion_loss(_Recorder(), task.schedule, clean, cfg.n_implant)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert model.weight.grad is not None
    # Validation items carry the voxel spacing (for the mm metrics); the split is grouped by skull.
    assert val_ds[0]["spacing"].shape == (3,) and len(val_ds) == cfg.eval.max_cases
    assert {c.skull_id for c in train_ds.cases}.isdisjoint({c.skull_id for c in val_ds.cases})


def test_batch_sampler_hook_sets_the_dataset_epoch(synthetic_skulls):
    ds = PCDiffDataset(synthetic_skulls, "train", n_skull=896, n_implant=128)
    task = PCDiffTask()
    first = ds[0]["points"]
    assert task.batch_sampler(ds, rank=0, world_size=1, micro_batch=4, accumulation=1, seed=0, epoch=3) is None
    assert ds.epoch == 3 and not torch.equal(ds[0]["points"], first)
    task.batch_sampler(ds, rank=0, world_size=1, micro_batch=4, accumulation=1, seed=0, epoch=0)
    assert torch.equal(ds[0]["points"], first)


def test_implant_distances_in_normalised_units_and_mm():
    true = torch.zeros(1, 4, 3)
    true[0, :, 0] = torch.arange(4.0)
    pred = true + torch.tensor([0.0, 0.0, 0.5])
    out = pc.implant_distances(pred, true, scale=torch.tensor([2.0]), spacing=torch.tensor([[1.0, 1.0, 3.0]]))
    # Every point is 0.5 away (normalised) = 0.5 · 2 voxels · 3 mm = 3 mm.
    torch.testing.assert_close(out["chamfer"], torch.tensor([0.5]))  # 0.25 + 0.25
    torch.testing.assert_close(out["chamfer_mm2"], torch.tensor([18.0]))  # 9 + 9
    torch.testing.assert_close(out["mean_dist_mm"], torch.tensor([3.0]))


# --------------------------------------------------------------------------- training through the engine


def test_train_tiny_through_the_engine_then_load_and_complete(tmp_path, synthetic_skulls, monkeypatch):
    epochs_seen = []
    hook = PCDiffTask.batch_sampler

    def spy(self, dataset, **kwargs):
        epochs_seen.append(kwargs["epoch"])
        return hook(self, dataset, **kwargs)

    monkeypatch.setattr(PCDiffTask, "batch_sampler", spy)
    cfg = tiny_cfg(
        tmp_path / "run",
        synthetic_skulls,
        "train.epochs=2",
        "train.eval_every=1",
        "task.eval.steps=3",
        "train.ema_decay=0.9",
    )
    result = train(get_task("pcdiff"), cfg)
    assert result.status == "finished" and result.global_step == 4 and result.epoch == 2
    for name in ("val_chamfer", "val_chamfer_mm2", "val_mean_dist_mm", "val_sample_s_per_case"):
        assert np.isfinite(result.metrics[name]), name
    assert result.best is not None and result.best["metric"] == "val_chamfer"
    run = Path(cfg.run.dir)
    assert (run / "checkpoints" / "best.pt").is_file()
    with np.load(run / "eval" / "epoch-0001" / "samples.npz") as samples:
        assert samples["pred_voxel"].shape == (2, 128, 3) and samples["true_voxel"].shape == (2, 128, 3)
        assert len(samples["case_id"]) == 2
    assert epochs_seen[-2:] == [0, 1]  # the hook ran before each epoch: the datasets' epochs advance

    heap_calls: list[int] = []
    monkeypatch.setattr(pcdiff_inference, "reuse_freed_memory", lambda: heap_calls.append(1) or True)
    loaded = load_pcdiff(run / "checkpoints" / "latest.pt")
    assert heap_calls == [1]  # on CPU the heap keeps freed blocks for the next pass
    model, schedule, config = loaded.model, loaded.schedule, loaded.config
    assert loaded.weights == "ema" and not model.training and config.n_implant == 128
    chunked = [m.eval_chunk_points for m in model.modules() if isinstance(m, PVCNN2)]
    assert chunked == [CPU_EVAL_CHUNK_POINTS]  # loaded on CPU: evaluation in chunks
    assert load_pcdiff(run / "checkpoints" / "latest.pt", weights="model").weights == "model"
    data = PreparedDataset(synthetic_skulls)
    case = data.split("val")[0]
    skull_voxels = np.asarray(data.points(case.defective))
    sampler = make_sampler("ddim", 3, schedule=schedule)
    implants = complete(skull_voxels, model, sampler, 2, config=config, generator=torch.Generator().manual_seed(0))
    assert implants.shape == (2, 128, 3) and implants.dtype == np.float32 and np.isfinite(implants).all()


# --------------------------------------------------------------------------- upstream checkpoints


@pytest.fixture(scope="module")
def upstream_tiny():
    return torch.load(FIXTURE, weights_only=True)


def _write_upstream(path: Path, fixture, prefix: str = "model.") -> Path:
    torch.save(
        {"epoch": 7, "model_state": {prefix + k: v for k, v in fixture["state_dict"].items()}, "optimizer_state": {}},
        path,
    )
    return path


@pytest.mark.parametrize("prefix", ["model.", "model.module."])
def test_imported_checkpoint_loads_and_reproduces_upstream(tmp_path, upstream_tiny, prefix):
    source = _write_upstream(tmp_path / "upstream.pth", upstream_tiny, prefix)
    result = import_pcdiff_checkpoint(source, tmp_path / "ours.pt")
    assert (result.preset, result.prefix, result.upstream_epoch, result.epochs_done) == ("tiny", prefix, 7, 8)
    state = ck.load_checkpoint(tmp_path / "ours.pt")
    assert ck.is_pointforge_checkpoint(state) and state["task"] == "pcdiff" and state["ema"] is None
    assert state["progress"]["epoch"] == 8 and state["imported_from"]["optimizer_state"].startswith("dropped")
    loaded = load_pcdiff(tmp_path / "ours.pt")
    model, schedule, config = loaded.model, loaded.schedule, loaded.config
    assert loaded.weights == "model" and config.model == "tiny" and schedule.num_timesteps == 1000
    with torch.no_grad():
        y = model(upstream_tiny["x"], upstream_tiny["t"])
    torch.testing.assert_close(y, upstream_tiny["y"], atol=1e-4, rtol=1e-4)


def test_imported_checkpoint_resumes_training(tmp_path, upstream_tiny, synthetic_skulls):
    source = _write_upstream(tmp_path / "upstream.pth", upstream_tiny)
    imported = tmp_path / "ours.pt"
    import_pcdiff_checkpoint(source, imported, config=PCDIFF_CONFIGS / "tiny.yaml")
    cfg = tiny_cfg(tmp_path / "run", synthetic_skulls, "train.epochs=9", "train.eval_every=0", "train.ema_decay=null")
    result = train(get_task("pcdiff"), cfg, resume=imported)
    assert result.resumed_from == imported
    assert (result.status, result.epoch, result.global_step) == ("finished", 9, 2)  # epoch 8 only: 2 steps


def test_import_command_and_its_errors(tmp_path, upstream_tiny):
    runner = CliRunner()
    source = _write_upstream(tmp_path / "upstream.pth", upstream_tiny)
    out = runner.invoke(_cli(), ["ckpt", "import-pcdiff", str(source), str(tmp_path / "a.pt"), "--preset", "tiny"])
    assert out.exit_code == 0, out.output
    assert (
        "PVCNN2 'tiny'" in out.output and "resumes at epoch 8" in out.output and "optimizer state dropped" in out.output
    )

    def error(*args) -> str:
        result = runner.invoke(_cli(), ["ckpt", "import-pcdiff", *map(str, args)])
        assert isinstance(result.exception, UserError), result.output
        message = str(result.exception)
        assert "\n" not in message
        return message

    assert "already exists" in error(source, tmp_path / "a.pt")
    assert "does not exist" in error(tmp_path / "missing.pth", tmp_path / "b.pt")
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(source.read_bytes()[:5000])
    assert "truncated or corrupt" in error(truncated, tmp_path / "b.pt")
    foreign = tmp_path / "foreign.pth"
    torch.save({"encoder.weight": torch.zeros(3, 3)}, foreign)
    assert "not a PCDiff PVCNN2 checkpoint" in error(foreign, tmp_path / "b.pt")
    assert "does not fit preset 'small'" in error(source, tmp_path / "b.pt", "--preset", "small")
    assert "holds a 'tiny' network" in error(source, tmp_path / "b.pt", "--config", PCDIFF_CONFIGS / "small.yaml")
    assert "already a pointforge checkpoint" in error(tmp_path / "a.pt", tmp_path / "b.pt")
    assert not (tmp_path / "b.pt").exists()
    out = runner.invoke(_cli(), ["ckpt", "import-pcdiff", str(source), str(tmp_path / "a.pt"), "--force"])
    assert out.exit_code == 0, out.output


def test_load_pcdiff_refuses_other_checkpoints(tmp_path, upstream_tiny):
    upstream = _write_upstream(tmp_path / "upstream.pth", upstream_tiny)
    with pytest.raises(CheckpointError, match="ckpt import-pcdiff"):
        load_pcdiff(upstream)
    ck.save_checkpoint(tmp_path / "toy.pt", {"task": "toy", "config": {}, "model": {}})
    with pytest.raises(CheckpointError, match="task 'toy'"):
        load_pcdiff(tmp_path / "toy.pt")
    import_pcdiff_checkpoint(upstream, tmp_path / "ours.pt")
    with pytest.raises(CheckpointError, match="no EMA weights"):
        load_pcdiff(tmp_path / "ours.pt", weights="ema")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pcdiff(tmp_path / "nope.pt")
