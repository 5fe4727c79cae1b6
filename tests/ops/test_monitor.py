"""pointforge monitor: statuses (crashed included), progress and GPUs, read from files alone."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pointforge.errors import DataError
from pointforge.ops import host, monitor as mon
from pointforge.ops.runs import find_run_dirs, run_state
from tests.helpers import run_cli

HOST = socket.gethostname()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_run(
    run_dir: Path, status: str, pid: int, *, step: int = 12, started_at: float | None = None, **extra
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    record = {
        "status": status,
        "pid": pid,
        "host": HOST,
        "started_at": started_at if started_at is not None else now,
        "updated_at": now - 2,
        "task": "toy",
        "world_size": 1,
        "total_steps": 100,
        "steps_per_epoch": 10,
        "epochs": 10,
        "epoch": step // 10,
        "global_step": step,
        "metrics": {
            "train/loss": 0.5,
            "train/lr": 1e-3,
            "train/it_per_s": 4.0,
            "train/samples_per_s": 32.0,
            "val_loss": 0.4,
        },
        **extra,
    }
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def test_statuses_running_finished_stopped_failed_and_crashed(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs / "live", "running", os.getpid())
    write_run(runs / "gone", "running", dead_pid())
    write_run(runs / "done", "finished", dead_pid(), step=100)
    write_run(runs / "halted", "stopped", dead_pid(), step=40)
    write_run(runs / "broke", "failed", dead_pid(), error="training diverged")
    # A recycled pid: alive, but started after the run recorded itself.
    write_run(runs / "recycled", "running", os.getpid(), started_at=time.time() - 10**6)
    states = {s.name: s for s in mon.collect_runs([runs])}
    assert {n: s.status for n, s in states.items()} == {
        "broke": "failed",
        "done": "finished",
        "gone": "crashed",
        "halted": "stopped",
        "live": "running",
        "recycled": "crashed",
    }
    assert states["gone"].note == "the process is gone without a final status"
    live = states["live"]
    assert live.eta_s == pytest.approx((100 - 12) / 4.0) and live.loss == 0.5 and live.lr == 1e-3
    assert states["done"].eta_s is None
    text = mon.render_text(mon.Snapshot(list(states.values()), None))
    assert "crashed" in text and "gone: crashed: the process is gone without a final status" in text
    assert "12/100" in text and "00:22" in text  # ETA


def test_progress_comes_from_the_newest_metrics_and_checkpoint_age(tmp_path):
    run = write_run(tmp_path / "r", "running", os.getpid(), step=10)
    with open(run / "metrics.jsonl", "w") as fh:
        fh.write(
            json.dumps({"step": 10, "epoch": 1.0, "train/loss": 0.5, "train/lr": 1e-3, "train/it_per_s": 4.0}) + "\n"
        )
        fh.write(json.dumps({"step": 20, "epoch": 2.0, "val_loss": 0.3}) + "\n")
        fh.write(
            json.dumps({"step": 24, "epoch": 2.4, "train/loss": 0.25, "train/lr": 5e-4, "train/it_per_s": 8.0}) + "\n"
        )
    (run / "checkpoints").mkdir()
    ck = run / "checkpoints" / "latest.pt"
    ck.write_bytes(b"0" * 5000)
    os.utime(ck, (time.time() - 120, time.time() - 120))
    state = run_state(run)
    assert state.step == 24 and state.loss == 0.25 and state.lr == 5e-4 and state.it_per_s == 8.0
    assert state.eta_s == pytest.approx((100 - 24) / 8.0)
    assert Path(state.last_checkpoint) == ck and 115 < state.checkpoint_age_s < 200
    assert state.disk_bytes >= 5000
    row = mon.run_row(state)
    assert row["checkpoint"] == "latest.pt (2m ago)" and row["step"] == "24/100"


def test_launched_jobs_before_and_after_training_starts(tmp_path):
    def launched(run_dir: Path, pid: int | None, console: str = "") -> Path:
        run_dir.mkdir(parents=True)
        (run_dir / "launch.json").write_text(
            json.dumps(
                {
                    "name": run_dir.name,
                    "task": "toy",
                    "gpus": [3],
                    "host": HOST,
                    "launched_at": time.time() - 1,
                    "nproc": 1,
                    "faked_gpus": True,
                    "port": 29999,
                }
            )
        )
        if pid is not None:
            (run_dir / "launch.pid").write_text(str(pid))
        if console:
            (run_dir / "console.log").write_text(console)
        return run_dir

    # A real process whose command line says it is a launched job (the pid-reuse guard looks for that).
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "launch.sh"])
    try:
        starting = launched(tmp_path / "starting", holder.pid)
        # run.json left from before this launch: the job is resuming, not running that old run.
        write_run(starting, "stopped", dead_pid(), started_at=time.time() - 3600)
        launched(tmp_path / "failed", dead_pid(), "error: unknown config key 'optim.lrr'; did you mean 'optim.lr'?\n")
        launched(tmp_path / "crashed", dead_pid(), "Segmentation fault (core dumped)\n")
        launched(tmp_path / "fresh", None)
        states = {s.name: s for s in mon.collect_runs([tmp_path])}
        assert states["starting"].status == "starting" and states["starting"].step == 12  # last known progress shown
        assert states["failed"].status == "failed" and "optim.lrr" in states["failed"].error
        assert states["crashed"].status == "crashed"
        assert states["fresh"].status == "starting"  # pid not recorded yet, launched a second ago
        assert mon.run_row(states["crashed"])["devices"] == "GPU 3 (faked)"
    finally:
        holder.kill()
        holder.wait()


def test_logs_and_narrow_screens(tmp_path):
    run = write_run(tmp_path / "r", "finished", dead_pid(), step=100)
    (run / "train.log").write_text("".join(f"line {i}\n" for i in range(50)))
    snap = mon.Snapshot(mon.collect_runs([run]), None)
    text = mon.render_text(snap, log_lines=3)
    assert "line 47\nline 48\nline 49" in text and "line 46" not in text
    rows = [mon.run_row(s) for s in snap.runs]
    narrow = mon.fit_columns(rows, 60)
    assert narrow[:2] == ["run", "status"] and "updated" not in narrow and len(narrow) < len(rows[0])
    assert mon.fit_columns(rows, 400) == list(rows[0])


def test_missing_folder_and_run_discovery(tmp_path):
    with pytest.raises(DataError, match="no such folder"):
        mon.collect_runs([tmp_path / "nope"])
    write_run(tmp_path / "a" / "b" / "run1", "finished", 1)
    (tmp_path / "a" / "b" / "run1" / "checkpoints" / "x").mkdir(parents=True)
    write_run(tmp_path / "run2", "finished", 1)
    assert sorted(p.name for p in find_run_dirs(tmp_path)) == ["run1", "run2"]
    (tmp_path / "empty").mkdir()
    assert mon.collect_runs([tmp_path / "empty"]) == []


FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) printf '0, NVIDIA H100 80GB HBM3, GPU-aaa, 97, 61234, 81559, 64\\n1, NVIDIA H100 80GB HBM3, GPU-bbb, 0, 3, 81559, 31\\n' ;;
  --query-compute-apps=*) printf 'GPU-aaa, %s, 60000\\nGPU-aaa, 4242, 1000\\n' "$WORKER_PID" ;;
esac
"""


def test_gpu_table_maps_processes_to_jobs(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("WORKER_PID", str(os.getpid()))
    monkeypatch.delenv(host.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setattr(host, "_from_nvml", lambda: None)  # the nvidia-smi path, even where nvidia-ml-py is installed
    run = write_run(tmp_path / "runs" / "pcdiff", "running", os.getpid())
    (run / "ranks").mkdir()
    (run / "ranks" / "rank0.json").write_text(
        json.dumps({"pid": os.getpid(), "host": HOST, "rank": 0, "started_at": time.time()})
    )
    inventory = host.gpu_inventory()
    assert inventory.source == "nvidia-smi" and inventory.count == 2
    assert inventory.gpus[0].utilization_pct == 97 and inventory.gpus[0].temperature_c == 64
    snap = mon.snapshot([tmp_path / "runs"])
    text = mon.render_text(snap)
    assert f"pcdiff rank 0 (pid {os.getpid()}, 58.6 GB)" in text and "not ours (pid 4242" in text
    assert "idle" in text and "59.8/79.6 GB" in text
    as_json = snap.as_dict()
    assert as_json["gpus"]["gpus"][0]["processes"][0]["job"] == "pcdiff rank 0"


def test_no_gpu_information_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv(host.FAKE_GPUS_ENV, "4")
    write_run(tmp_path / "r", "finished", 1)
    assert "GPUs are faked (POINTFORGE_FAKE_GPUS=4)" in mon.render_text(mon.snapshot([tmp_path]))
    monkeypatch.delenv(host.FAKE_GPUS_ENV)
    monkeypatch.setattr(host, "_from_nvml", lambda: None)
    monkeypatch.setattr(host, "_from_smi", lambda: None)
    monkeypatch.setattr(host, "_from_proc", lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "no GPU information (NVML not available" in mon.render_text(mon.snapshot([tmp_path]))


def test_cli_json_and_table(tmp_path, monkeypatch):
    write_run(tmp_path / "runs" / "gone", "running", dead_pid())
    out = run_cli("monitor", str(tmp_path / "runs"), "--json", "--no-gpus")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["runs"][0]["status"] == "crashed"
    out = run_cli("monitor", str(tmp_path / "runs"), "--no-gpus", "--logs", "2")
    assert out.exit_code == 0 and "crashed" in out.output
