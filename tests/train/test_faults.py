"""Faults a long run meets, each provoked for real: a second writer, a full disk, a broken dataset.

Each test asserts the one-line message, the exit status and that what was on
disk before the fault is still there, unchanged.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pointforge.errors import DataError, DiskFullError, UserError
from pointforge.tasks import get_task
from pointforge.train.checkpoint import format as ck
from pointforge.train.data import unwrap_worker_error
from pointforge.train.engine import train
from pointforge.train.run_dir_lock import LOCK_FILE, RunDirInUse, RunDirLock, lock_holder
from tests.helpers import QUIET, TOY_TINY, Job, quiet_config, subprocess_env


def make_cfg(run_dir: Path, *overrides: str, task: str = "toy"):
    return quiet_config(task, TOY_TINY, f"run.dir={run_dir}", *overrides)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (the lock file aside) with a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def pointforge(capsys, *args) -> tuple[int, str]:
    """``pointforge ARGS`` in this process, ended the way the command ends: (exit status, all it printed)."""
    from pointforge.cli.entry import run
    from pointforge.cli.main import app

    capsys.readouterr()
    code = run(app, [str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out + out.err


# --------------------------------------------------------------------------- one writer per run dir


def test_lock_names_its_holder_and_is_free_once_released(tmp_path):
    first, second = RunDirLock(tmp_path), RunDirLock(tmp_path)
    assert lock_holder(tmp_path) is None
    with first:
        holder = lock_holder(tmp_path)
        assert holder is not None and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunDirInUse, match=rf"is in use by pid {os.getpid()} on host .*training since .* ago"):
            second.acquire()
        assert not second.held
    assert lock_holder(tmp_path) is None
    second.acquire()  # free again: the file is still there, the lock on it is not
    second.release()


def test_train_refuses_a_held_run_dir_and_leaves_it_untouched(tmp_path):
    run_dir = tmp_path / "run"
    train(get_task("toy"), make_cfg(run_dir, "train.epochs=1"))
    before = snapshot(run_dir)
    with RunDirLock(run_dir):
        with pytest.raises(RunDirInUse, match="continue with --resume auto, or choose another run.dir"):
            train(get_task("toy"), make_cfg(run_dir, "train.epochs=2"), resume="auto")
    assert snapshot(run_dir) == before
    assert train(get_task("toy"), make_cfg(run_dir, "train.epochs=2"), resume="auto").status == "finished"
    assert lock_holder(run_dir) is None  # released at the end of the run


def _wait_for(predicate, timeout: float, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the first job did not get there; output:\n{job.output()[-3000:]}")
        time.sleep(0.2)


def test_a_second_train_process_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "run"
    train(get_task("faulty_toy"), make_cfg(run_dir, "train.epochs=1", task="faulty_toy"))
    # The first job resumes and stalls in its first step (global step 8), holding the run dir.
    stall = ["task.stall_rank=0", "task.stall_step=8", "task.stall_s=120", "train.epochs=2"]
    base = [sys.executable, "-m", "pointforge", "train", "faulty_toy", "--config", str(TOY_TINY), *QUIET]
    first = Job([*base, f"run.dir={run_dir}", *stall, "--resume", "auto"], tmp_path, "first")
    try:
        _wait_for(lambda: (lock_holder(run_dir) or {}).get("pid") == first.proc.pid, 90, first)
        _wait_for(lambda: "resumed from" in (run_dir / "train.log").read_text(), 60, first)
        time.sleep(0.5)  # the status written before the first step
        before = snapshot(run_dir)
        second = subprocess.run(
            [*base, f"run.dir={run_dir}", "train.epochs=2", "--resume", "auto"],
            env=subprocess_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        lines = error_lines(second.stderr)
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"is in use by pid {first.proc.pid} on host {socket.gethostname()}, training since" in lines[0]
        assert snapshot(run_dir) == before
    finally:
        first.stop()  # SIGKILL: no chance to clean up
    assert lock_holder(run_dir) is None  # the kernel dropped the dead process's lock
    with RunDirLock(run_dir):
        pass


def test_launch_and_train_nproc_refuse_a_held_run_dir_with_the_same_line(tmp_path):
    from pointforge.ops.host import GpuInventory
    from pointforge.ops.launch.plan import build_plan
    from pointforge.ops.launch.spec import PlanSpec, job_from_mapping
    from pointforge.train.torchrun import run_torchrun

    run_dir = tmp_path / "runs" / "a"
    spec = PlanSpec(
        jobs=[job_from_mapping({"name": "a", "task": "toy", "config": str(TOY_TINY), "gpus": [0]}, "test")],
        runs_dir=str(tmp_path / "runs"),
    )
    with RunDirLock(run_dir):
        with pytest.raises(RunDirInUse, match=f"job a: run dir {run_dir} is in use by pid {os.getpid()}"):
            build_plan(spec, cwd=tmp_path, inventory=GpuInventory(1, "fake")).check()
        with pytest.raises(RunDirInUse, match=f"run dir {run_dir} is in use by pid {os.getpid()}"):
            run_torchrun(["train", "toy"], nproc=2, max_restarts=0, run_dir=run_dir)


# --------------------------------------------------------------------------- a full disk


class _FillingFile:
    """A file handle on a disk with ``room`` bytes left: the write past it raises ENOSPC, as the kernel's would."""

    def __init__(self, handle, room: int):
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.handle.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", *QUIET, "ckpt.keep_last=2"]
    assert pointforge(capsys, "train", "toy", "--config", TOY_TINY, *overrides, "train.epochs=1")[0] == 0
    before = snapshot(run_dir)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real_save(obj, _FillingFile(f, 4096), *a, **k))
    code, output = pointforge(
        capsys, "train", "toy", "--config", TOY_TINY, *overrides, "train.epochs=2", "--resume", "auto"
    )
    assert code == 2, output
    lines = error_lines(output)
    assert len(lines) == 1 and "Traceback" not in output, output
    assert "no space left on the device while writing checkpoint" in lines[0] and "free in" in lines[0]
    assert "lower ckpt.keep_last (now 2)" in lines[0] and "another run.dir" in lines[0]
    assert "the previous checkpoints are intact" in lines[0]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.pt", "epoch-0001.pt", "latest.pt"]  # no .tmp
    assert {k: v for k, v in snapshot(run_dir).items() if k.startswith("checkpoints")} == {
        k: v for k, v in before.items() if k.startswith("checkpoints")
    }
    assert ck.load_checkpoint(checkpoints / "latest.pt")["progress"]["epoch"] == 1


def test_a_copy_that_fills_the_disk_is_the_same_line(tmp_path, monkeypatch):
    files = ck.CheckpointFiles(tmp_path, keep_last=3)
    latest = files.write_latest({"x": torch.zeros(4096)})
    real_open = open

    def filling_open(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return _FillingFile(handle, 100) if "w" in mode and ".best.pt." in str(path) else handle

    import builtins

    monkeypatch.setattr(builtins, "open", filling_open)
    with pytest.raises(DiskFullError, match=r"while writing checkpoint .*best\.pt .*keep_last \(now 3\)"):
        files.copy_to(latest, files.best)
    monkeypatch.undo()
    assert sorted(p.name for p in files.folder.iterdir()) == ["latest.pt"]


def test_a_run_dir_too_small_for_its_checkpoints_is_refused_before_training(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(ck, "disk_free_bytes", lambda path: 100_000)
    with pytest.raises(DiskFullError, match=r"free for .* checkpoints need about .* more \(5 files × .*keep_last=2"):
        train(get_task("toy"), make_cfg(run_dir))
    assert not (run_dir / "checkpoints").exists()
    size = ck.estimate_checkpoint_bytes(torch.nn.Linear(10, 10), optimizer="adam", ema=True)
    assert size == 3 * 440 + 440 + 2**20  # weights, two Adam moments, EMA, 1 MiB of the rest
    assert ck.checkpoint_files_kept(3, every_epochs=1, epochs=2) == 5 and ck.checkpoint_files_kept(0, epochs=10) == 13


# --------------------------------------------------------------------------- a broken dataset


def test_an_error_in_a_loader_worker_is_its_own_line(tmp_path):
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir, "data.num_workers=1", "task.broken_index=5", task="faulty_toy")
    with pytest.raises(DataError) as caught:
        train(get_task("faulty_toy"), cfg)
    assert str(caught.value) == "sample 5: its file is gone; re-run `pointforge data prepare`"
    plain = unwrap_worker_error(
        ValueError(
            "Caught ValueError in DataLoader worker process 3.\nOriginal Traceback (most recent call last):\n"
            '  File "x.py", line 1, in f\nValueError: cannot reshape array of size 5 into shape (3,)\n'
        )
    )
    assert isinstance(plain, ValueError)
    assert str(plain) == "cannot reshape array of size 5 into shape (3,) (raised in DataLoader worker process 3)"
    assert unwrap_worker_error(ValueError("plain")) is None


@pytest.fixture(scope="module")
def prepared_copy(tmp_path_factory, synthetic_skulls) -> Path:
    source = synthetic_skulls
    copy = tmp_path_factory.mktemp("broken") / "prepared"
    shutil.copytree(source, copy)
    return copy


def test_a_deleted_point_file_stops_training_before_the_first_step(tmp_path, prepared_copy, capsys):
    from pointforge.data.skulls.prepared import PreparedDataset

    case = PreparedDataset(prepared_copy).split("train")[-1]
    missing = prepared_copy / case.implant
    missing.unlink()
    before = snapshot(prepared_copy)
    run_dir = tmp_path / "run"
    code, output = pointforge(
        capsys,
        "train",
        "pcdiff",
        "--config",
        TOY_TINY.parents[1] / "pcdiff" / "tiny.yaml",
        f"run.dir={run_dir}",
        f"task.data_root={prepared_copy}",
        *QUIET,
    )
    assert code == 2, output
    lines = error_lines(output)
    assert len(lines) == 1 and "Traceback" not in output, output
    assert lines[0] == (
        f"error: {missing}: missing or empty (1 of the 'train' split's files); "
        "re-run `pointforge data prepare` with the same --out to complete the dataset"
    )
    assert not (run_dir / "checkpoints").exists() and snapshot(prepared_copy) == before
    assert isinstance(DataError("x"), UserError)


# --------------------------------------------------------------------------- requests too large for memory


def test_a_micro_batch_too_large_for_the_device_is_refused_with_the_largest_that_fits(tmp_path, monkeypatch):
    from pointforge.errors import ConfigError
    from pointforge.tasks.toy import ToyTask
    from pointforge.train import preflight

    gib = 2**30
    monkeypatch.setattr(ToyTask, "memory_estimate", lambda self, cfg, micro_batch: micro_batch * 3 * gib)
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: 10 * gib)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as caught:
        train(get_task("toy"), make_cfg(run_dir))  # global_batch 8 on one device: 24 GiB
    assert str(caught.value) == (
        "a training step on 8 sample(s) per device needs about 24.0 GB on cpu, more than the 10.0 GB available; "
        "set data.micro_batch=3 (gradient accumulation keeps data.global_batch=8) or use more devices"
    )
    assert not (run_dir / "checkpoints").exists()
    assert train(get_task("toy"), make_cfg(run_dir, "data.micro_batch=3", "data.global_batch=6")).status == "finished"
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: gib)
    with pytest.raises(ConfigError, match="even for one sample; lower the task's point count or grid resolution"):
        train(get_task("toy"), make_cfg(tmp_path / "other"))
    with pytest.raises(DataError, match="the training set has 64 samples, fewer than data.global_batch=128"):
        train(get_task("toy"), make_cfg(tmp_path / "third", "data.global_batch=128"))
    assert not (tmp_path / "other" / "checkpoints").exists() and not (tmp_path / "third" / "checkpoints").exists()


def test_the_voxelizer_estimates_its_training_step_from_the_dpsr_solve():
    from pointforge.nn.dpsr import dpsr_memory_bytes
    from pointforge.tasks.configs import load_train_config
    from pointforge.tasks.voxelizer import VoxelizerTask

    cfg = load_train_config("voxelizer", TOY_TINY.parents[1] / "voxelizer" / "paper.yaml").task
    task = VoxelizerTask()
    one, two = task.memory_estimate(cfg, 1), task.memory_estimate(cfg, 2)
    res = cfg.network().dpsr_res
    assert one > dpsr_memory_bytes(res, cfg.n_points, batch=1, requires_grad=True) and two > one
    assert one > 4 * 2**30  # a 512³ solve with gradients: GiBs, not MiBs
