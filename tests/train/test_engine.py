"""The engine in one process: outputs, exact resume, guards, accumulation, precision, CLI."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pointforge.errors import CheckpointError, ConfigError, DeviceError, UserError
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.checkpoint import format as ck
from pointforge.train.engine import train
from pointforge.train.step import TrainingDiverged
from tests.helpers import TOY_TINY, quiet_config, run_cli

TINY = TOY_TINY


def make_cfg(tmp_path, *overrides, name="run", task="toy"):
    return quiet_config(task, TINY, f"run.dir={tmp_path / name}", *overrides)


def final_state(run_dir):
    return ck.load_checkpoint(Path(run_dir) / "checkpoints" / "latest.pt")


def assert_same_tensors(a, b, exact=True):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_run_writes_everything_a_user_and_a_monitor_need(tmp_path):
    cfg = make_cfg(tmp_path, "log.tensorboard=true", "train.epochs=2")
    result = train(get_task("toy"), cfg)
    run = Path(cfg.run.dir)
    assert result.status == "finished" and result.global_step == 16 and result.epoch == 2
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "finished" and status["global_step"] == 16 and status["task"] == "toy"
    assert status["last_checkpoint"].endswith("latest.pt") and "val_loss" in status["metrics"]
    assert {"pid", "host", "epoch", "best"} <= set(status)
    assert "finished: 16 steps" in (run / "train.log").read_text()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in x for x in lines) and any("val_loss" in x for x in lines)
    assert (run / "metrics.csv").read_text().startswith("time,step,epoch,name,value")
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert load_train_config("toy", run / "config.yaml").optim == cfg.optim
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best.pt", "epoch-0001.pt", "epoch-0002.pt", "latest.pt"]
    state = torch.load(run / "checkpoints" / "latest.pt", weights_only=True)  # only tensors and plain data
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    assert state["config"]["optim"]["lr"] == cfg.optim.lr and state["pointforge_version"]
    assert state["progress"]["epoch"] == 2 and state["progress"]["step_in_epoch"] == 0


def test_sigterm_mid_epoch_then_resume_equals_uninterrupted(tmp_path):
    common = ["task.dropout=0.2", "data.micro_batch=4", "train.ema_decay=0.9", "train.grad_clip=1.0", "train.epochs=3"]
    train(get_task("toy"), make_cfg(tmp_path, *common, name="ref"))
    stopped = train(
        get_task("faulty_toy"), make_cfg(tmp_path, *common, "task.sigterm_at_step=11", name="cut", task="faulty_toy")
    )
    assert stopped.status == "stopped" and stopped.signal == "SIGTERM"
    assert stopped.global_step == 12 and stopped.epoch == 1
    cut_state = final_state(tmp_path / "cut")
    assert cut_state["progress"]["step_in_epoch"] == 4
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["status"] == "stopped"
    resumed = train(get_task("faulty_toy"), make_cfg(tmp_path, *common, name="cut", task="faulty_toy"), resume="auto")
    assert resumed.status == "finished" and resumed.global_step == 24
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "latest.pt"
    ref, res = final_state(tmp_path / "ref"), final_state(tmp_path / "cut")
    assert_same_tensors(ref["model"], res["model"])
    assert_same_tensors(ref["ema"], res["ema"])
    assert ref["optimizer"]["state"][0]["exp_avg"].equal(res["optimizer"]["state"][0]["exp_avg"])
    assert ref["scheduler"]["last_epoch"] == res["scheduler"]["last_epoch"] == 24
    assert ref["progress"]["best_value"] == res["progress"]["best_value"]


def test_time_budget_stops_at_a_step_saves_and_finishes(tmp_path):
    # 0.2 s steps against a 0.01 min (0.6 s) budget: a few steps, never all 40.
    cfg = make_cfg(tmp_path, "train.epochs=5", "train.max_minutes=0.01", "task.step_delay_s=0.2")
    result = train(get_task("toy"), cfg)
    assert result.status == "finished" and 3 <= result.global_step < 40
    assert final_state(cfg.run.dir)["progress"]["global_step"] == result.global_step
    assert "time budget of 0.01 min (train.max_minutes) reached" in (Path(cfg.run.dir) / "train.log").read_text()
    with pytest.raises(ConfigError, match="max_minutes' must be positive"):
        make_cfg(tmp_path, "train.max_minutes=0", name="bad")


def test_time_horizon_decays_over_training_time_and_resumes_where_it_was(tmp_path):
    # Two launches of 0.6 s each (0.2 s steps) against a 1.2 s linear decay to zero:
    # the LR falls with the training clock, the clock survives the resume, and the
    # second launch ends at the floor instead of restarting at the peak.
    over = ["train.epochs=50", "train.max_minutes=0.01", "task.step_delay_s=0.2", "log.every_steps=1"]
    over += ["sched.name=linear", "sched.warmup_steps=0", "sched.horizon_minutes=0.02"]
    cfg = make_cfg(tmp_path, *over)
    first = train(get_task("toy"), cfg)
    state = final_state(cfg.run.dir)
    seconds = state["progress"]["train_seconds"]
    assert first.status == "finished" and 0.6 <= seconds < 1.2
    lr_saved = state["optimizer"]["param_groups"][0]["lr"]
    assert lr_saved == pytest.approx(cfg.optim.lr * (1 - seconds / 1.2))
    second = train(get_task("toy"), cfg, resume="auto")
    state = final_state(cfg.run.dir)
    assert second.global_step > first.global_step and state["progress"]["train_seconds"] >= 1.2
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.0
    lines = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    lrs = [x["train/lr"] for x in lines if "train/lr" in x]
    assert len(lrs) >= 6 and lrs[0] == pytest.approx(cfg.optim.lr)
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))  # never back up to the peak


def test_existing_run_dir_needs_resume(tmp_path):
    train(get_task("toy"), make_cfg(tmp_path, "train.epochs=1"))
    with pytest.raises(ConfigError, match="already holds checkpoints.*--resume auto"):
        train(get_task("toy"), make_cfg(tmp_path, "train.epochs=1"))
    done = train(get_task("toy"), make_cfg(tmp_path, "train.epochs=1"), resume="auto")
    assert done.status == "finished" and done.global_step == 8  # nothing left to do, and the log says so
    assert "nothing is left to train; raise train.epochs" in (tmp_path / "run" / "train.log").read_text()


def test_resuming_past_the_configs_length_is_refused_saying_what_to_set(tmp_path):
    train(get_task("toy"), make_cfg(tmp_path, "train.epochs=2"))  # 8 steps an epoch
    with pytest.raises(
        ConfigError, match=r"has done 2 epochs \(step 16\) but train.epochs is 1: .*train.epochs above 2"
    ):
        train(get_task("toy"), make_cfg(tmp_path, "train.epochs=1"), resume="auto")
    with pytest.raises(ConfigError, match=r"at step 16 but train.max_steps is 10: .*train.max_steps above 16"):
        train(get_task("toy"), make_cfg(tmp_path, "train.epochs=5", "train.max_steps=10"), resume="auto")
    more = train(get_task("toy"), make_cfg(tmp_path, "train.epochs=3"), resume="auto")
    assert more.status == "finished" and more.global_step == 24


def test_resume_auto_skips_a_truncated_latest(tmp_path):
    train(get_task("toy"), make_cfg(tmp_path, "train.epochs=2", "ckpt.keep_last=3"))
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    result = train(get_task("toy"), make_cfg(tmp_path, "train.epochs=3", "ckpt.keep_last=3"), resume="auto")
    assert result.resumed_from.name == "epoch-0002.pt" and result.global_step == 24
    log = (tmp_path / "run" / "train.log").read_text()
    assert "latest.pt is truncated or corrupt" in log and "WARNING" in log
    latest.write_bytes(latest.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="latest.pt is truncated or corrupt"):
        train(get_task("toy"), make_cfg(tmp_path, "train.epochs=3"), resume=str(latest))
    again = train(
        get_task("toy"),
        make_cfg(tmp_path, "train.epochs=3", name="other"),
        resume=str(tmp_path / "run" / "checkpoints" / "epoch-0001.pt"),
    )
    assert again.resumed_from.name == "epoch-0001.pt" and again.global_step == 24


def test_nonfinite_steps_are_skipped_then_abort(tmp_path):
    result = train(
        get_task("faulty_toy"),
        make_cfg(tmp_path, "train.epochs=1", "task.nan_steps=[3]", name="one", task="faulty_toy"),
    )
    assert result.status == "finished" and final_state(tmp_path / "one")["progress"]["skipped_steps"] == 1
    assert "non-finite loss at step 3" in (tmp_path / "one" / "train.log").read_text()
    with pytest.raises(TrainingDiverged, match=r"non-finite loss for 3 steps in a row \(train.max_nonfinite=3\)"):
        train(
            get_task("faulty_toy"),
            make_cfg(tmp_path, "train.max_nonfinite=3", "task.nan_steps=[2,3,4,5]", name="many", task="faulty_toy"),
        )
    assert json.loads((tmp_path / "many" / "run.json").read_text())["status"] == "failed"


def test_accumulation_matches_one_big_batch(tmp_path):
    train(get_task("toy"), make_cfg(tmp_path, "train.epochs=1", name="big"))
    train(get_task("toy"), make_cfg(tmp_path, "train.epochs=1", "data.micro_batch=2", name="acc"))
    assert_same_tensors(final_state(tmp_path / "big")["model"], final_state(tmp_path / "acc")["model"], exact=False)


def test_loader_workers_give_the_same_run(tmp_path):
    train(get_task("toy"), make_cfg(tmp_path, "train.epochs=2", name="w0"))
    train(
        get_task("toy"),
        make_cfg(
            tmp_path,
            "train.epochs=2",
            "data.num_workers=2",
            "data.persistent_workers=true",
            "data.worker_timeout_s=60",
            name="w2",
        ),
    )
    assert_same_tensors(final_state(tmp_path / "w0")["model"], final_state(tmp_path / "w2")["model"])


def test_bf16_autocast_on_cpu_and_fp16_refused(tmp_path):
    result = train(get_task("toy"), make_cfg(tmp_path, "train.epochs=1", "perf.amp=bf16", name="bf16"))
    assert result.status == "finished" and result.metrics["val_loss"] < 1.0
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        train(get_task("toy"), make_cfg(tmp_path, "perf.amp=fp16", name="fp16"))


def test_devices_and_optional_wandb_fail_clearly(tmp_path):
    with pytest.raises(DeviceError, match=r"run.device=cuda:7 does not exist; visible devices: none"):
        train(get_task("toy"), make_cfg(tmp_path, "run.device=cuda:7", name="dev"))
    # wandb must stay optional; where it is absent, asking for it is a clear error.
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match="wandb package is not installed"):
            train(get_task("toy"), make_cfg(tmp_path, name="wb"), wandb=True)
        assert json.loads((tmp_path / "wb" / "run.json").read_text())["status"] == "failed"


def test_cli_dry_run_prints_the_plan(tmp_path):
    out = run_cli(
        "train",
        "toy",
        "--config",
        TINY,
        "--dry-run",
        "--nproc",
        "2",
        f"run.dir={tmp_path / 'x'}",
        "data.global_batch=16",
        "data.micro_batch=2",
        "optim.lr_scaling=linear",
        "optim.base_batch=8",
    )
    assert out.exit_code == 0, out.output
    text = out.output
    assert "global 16 = 2 rank(s) × 2 per device × 4 accumulation steps" in text
    assert "0.003 tuned for batch 8, linear scaling to batch 16 → 0.006" in text
    assert "4 steps per epoch" in text and "12 optimizer steps" in text and str(tmp_path / "x") in text
    assert not (tmp_path / "x").exists()


def test_cli_config_errors_are_user_errors(tmp_path):
    out = run_cli("train", "toy", "--config", TINY, "--dry-run", "data.global_bach=3")
    assert isinstance(out.exception, UserError)
    assert "did you mean 'data.global_batch'" in str(out.exception)
    out = run_cli("train", "toy", "--config", TINY, "--dry-run", "--nproc", "3")
    assert isinstance(out.exception, UserError) and "global_batch=6 or 9" in str(out.exception)


def _two_rank_envs():
    import datetime

    import torch.distributed as dist

    from pointforge.train.dist import DistEnv

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    envs = []
    for rank in (0, 1):
        client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10))
        envs.append(DistEnv(rank=rank, world_size=2, backend="gloo", _store=client))
    return server, envs


def test_rank0_section_shares_results_and_failures_without_collectives():
    import threading

    from pointforge.train.dist import DistributedFailure, rank0_section

    server, (env0, env1) = _two_rank_envs()
    results = {}

    def rank0(fn):
        try:
            results["rank0"] = rank0_section(env0, "evaluating", fn, timeout_s=5)
        except Exception as err:  # noqa: BLE001 - recorded for the assertion
            results["rank0"] = err

    thread = threading.Thread(target=rank0, args=(lambda: {"val_loss": 0.25},))
    thread.start()
    assert rank0_section(env1, "evaluating", lambda: pytest.fail("rank 1 must not run it"), timeout_s=5) == {
        "val_loss": 0.25
    }
    thread.join()
    assert results["rank0"] == {"val_loss": 0.25}

    def boom():
        raise ValueError("disk full")

    thread = threading.Thread(target=rank0, args=(boom,))
    thread.start()
    with pytest.raises(DistributedFailure, match="rank 0 failed while evaluating: ValueError: disk full"):
        rank0_section(env1, "evaluating", boom, timeout_s=5)
    thread.join()
    assert isinstance(results["rank0"], ValueError)
    # Rank 0 never gets there: rank 1 gives up after its own timeout, not a collective's.
    with pytest.raises(DistributedFailure, match="rank 0 is stuck or gone"):
        rank0_section(env1, "saving a checkpoint", boom, timeout_s=0.3)
    del server


class _EpochRecordingTask:
    """The toy task with a training set that records the engine's set_epoch calls."""

    calls: list = []

    @classmethod
    def make(cls):
        from pointforge.tasks.toy import ToyTask

        class Recording(ToyTask):
            def build_datasets(self, cfg):
                train_ds, val_ds = super().build_datasets(cfg)
                train_ds.set_epoch = cls.calls.append
                return train_ds, val_ds

        return Recording()


def test_engine_calls_set_epoch_before_each_epoch_also_on_resume(tmp_path):
    _EpochRecordingTask.calls.clear()
    train(_EpochRecordingTask.make(), make_cfg(tmp_path, "train.epochs=2"))
    assert _EpochRecordingTask.calls == [0, 1]
    _EpochRecordingTask.calls.clear()
    train(_EpochRecordingTask.make(), make_cfg(tmp_path, "train.epochs=3"), resume="auto")
    assert _EpochRecordingTask.calls == [2]


def test_train_state_is_the_checkpoint_progress_layout_and_tracks_the_best_once():
    from pointforge.train.state import BestMetric, MetricWindow, TrainState

    # A checkpoint's "progress" as the engine has always written it.
    old = {
        "epoch": 3,
        "step_in_epoch": 2,
        "global_step": 26,
        "samples_seen": 208,
        "nonfinite_streak": 1,
        "skipped_steps": 4,
        "best_metric": "val_loss",
        "best_mode": "min",
        "best_value": 0.5,
        "best_step": 16,
        "global_batch": 8,
        "steps_per_epoch": 8,
        "world_size": 2,
    }
    state = TrainState.from_progress(old)
    # Old files load; new files add the training clock (zero for a file written before it existed).
    assert state.state_dict() == {**old, "train_seconds": 0.0}
    assert TrainState.from_progress({**old, "train_seconds": 12.5}).state_dict()["train_seconds"] == 12.5
    assert state.best.summary() == {"metric": "val_loss", "value": 0.5, "step": 16}

    # The run's own rule wins over the file's; a changed global batch keeps the samples already seen behind us.
    resumed = TrainState(best=BestMetric("val_iou", "max"))
    resumed.load_state_dict(old)
    assert (resumed.best.metric, resumed.best.mode, resumed.best.value) == ("val_iou", "max", 0.5)
    assert resumed.rebatch(4, 1, 16) == 8 and resumed.step_in_epoch == 4 and resumed.state_dict()["global_batch"] == 4

    best = BestMetric("val_loss", "min")
    warned = []
    assert best.offer({"val_loss": 0.4}, 10) and not best.offer({"val_loss": 0.45}, 11)
    assert not best.offer({"val_loss": float("nan")}, 12) and best.offer({"val_loss": 0.3}, 13)
    assert not best.offer({"other": 0.1}, 14, warn=warned.append) and "not among" in warned[0]
    assert best.summary() == {"metric": "val_loss", "value": 0.3, "step": 13}

    state = TrainState(global_batch=8)
    assert state.count_skip() == 1 and state.count_skip() == 2
    state.advance(skipped=True)
    state.advance(skipped=False)
    assert (state.global_step, state.samples_seen, state.nonfinite_streak, state.skipped_steps) == (2, 16, 0, 2)

    window = MetricWindow(lr=0.1)
    window.add_task_metrics({"mae": torch.tensor(2.0, dtype=torch.bfloat16)})
    window.add_task_metrics({"mae": 4.0})
    window.add_step(loss=1.0, lr=0.1, grad_norm=None, data_time=0.5, step_time=1.0)
    window.add_step(loss=None, lr=0.05, grad_norm=3.0, data_time=0.0, step_time=1.0)
    out = window.summary(global_batch=8, accumulation=1, skipped_steps=1)
    assert out["loss"] == 1.0 and out["lr"] == 0.05 and out["it_per_s"] == 1.0 and out["samples_per_s"] == 8.0
    assert out["data_wait_frac"] == 0.25 and out["grad_norm"] == 3.0 and out["mae"] == 3.0


def test_what_a_task_says_is_wrong_after_an_evaluation_is_logged_as_a_warning_with_its_step(tmp_path):
    from pointforge.tasks.toy import ToyTask

    class Collapsing(ToyTask):
        def health(self, metrics):
            return [f"val_loss {metrics['val_loss']:.3g}: collapsed, train again"] if "val_loss" in metrics else []

    cfg = make_cfg(tmp_path, "train.epochs=2", "train.eval_every=1")
    train(Collapsing(), cfg)
    warned = [line for line in (Path(cfg.run.dir) / "train.log").read_text().splitlines() if "collapsed" in line]
    assert len(warned) == 2 and "WARNING" in warned[0] and ": val_loss " in warned[0]
    steps = sorted(int(line.split("step ")[1].split(":")[0]) for line in warned)
    assert steps[0] > 0 and steps[1] == 2 * steps[0]
