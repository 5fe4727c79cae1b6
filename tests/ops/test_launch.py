"""pointforge launch: plans refused before anything starts, per-job GPUs/ports/env, real jobs on faked GPUs.

The end-to-end tests start real torchrun jobs on the CPU (POINTFORGE_FAKE_GPUS
makes the launcher believe in GPUs). Every process they start is killed in a
fixture's teardown, whatever the test's outcome.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pointforge.errors import CheckpointError, ConfigError, DeviceError
from pointforge.ops.host import FAKE_GPUS_ENV, GpuInventory, format_gpu_list, parse_gpu_list
from pointforge.ops.launch.plan import build_plan
from pointforge.ops.launch.spec import JobSpec, PlanSpec, job_from_mapping, load_plan, parse_job_flag
from pointforge.ops.launch.start import job_script, launch, start_plan
from pointforge.ops.launch.stop import jobs_in, stop_jobs
from pointforge.ops.monitor import collect_runs, render_text, snapshot
from pointforge.ops.runs import read_launch, run_state
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train import preflight
from pointforge.train.run_plan import make_plan
from tests.helpers import CONFIGS, QUIET, REPO, TOY_TINY, descendants, run_cli

TINY = TOY_TINY


def fake(n: int) -> GpuInventory:
    return GpuInventory(n, "fake")


def job(name: str, gpus=None, cpu=None, **extra) -> JobSpec:
    data = {"name": name, "task": "toy", "config": str(TINY), **extra}
    if gpus is not None:
        data["gpus"] = gpus
    if cpu is not None:
        data["cpu"] = cpu
    return job_from_mapping(data, "test")


# --------------------------------------------------------------------------- parsing


def test_gpu_lists_and_job_flags():
    assert parse_gpu_list("0-3,6", "t") == [0, 1, 2, 3, 6]
    assert parse_gpu_list([7], "t") == [7]
    assert parse_gpu_list(5, "t") == [5]
    assert format_gpu_list([0, 1, 2, 3, 6]) == "0-3,6"
    for bad, match in (
        ("0-2,2", "listed twice"),
        ("x", "not a GPU number"),
        ("3-1", "not a GPU number"),
        ([], "empty"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_gpu_list(bad, "t")
    spec = parse_job_flag("pc:toy:0-6:pointforge/configs/toy/tiny.yaml")
    assert (spec.name, spec.task, spec.gpus, spec.config) == (
        "pc",
        "toy",
        list(range(7)),
        "pointforge/configs/toy/tiny.yaml",
    )
    cpu = parse_job_flag("c:toy:cpu2")
    assert cpu.cpu == 2 and cpu.gpus == [] and cpu.config is None
    with pytest.raises(ConfigError, match="NAME:TASK:GPUS"):
        parse_job_flag("only:two")
    with pytest.raises(ConfigError, match="either gpus .* or cpu"):
        job_from_mapping({"name": "x", "task": "toy"}, "t")
    with pytest.raises(ConfigError, match="may not set CUDA_VISIBLE_DEVICES"):
        job_from_mapping({"name": "x", "task": "toy", "gpus": [0], "env": {"CUDA_VISIBLE_DEVICES": "3"}}, "t")


def test_plan_file_keys_are_checked(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("jobs:\n  - name: a\n    task: toy\n    gpu: [0]\n")
    with pytest.raises(ConfigError, match="unknown key 'gpu'; did you mean 'gpus'"):
        load_plan(plan)
    plan.write_text("jobz: []\n")
    with pytest.raises(ConfigError, match="unknown key 'jobz'"):
        load_plan(plan)


def test_example_plan_is_the_seven_plus_one_partition():
    spec = load_plan(CONFIGS / "launch" / "example.yaml")
    gpus = {j.name: j.gpus for j in spec.jobs}
    assert gpus == {"pcdiff": list(range(7)), "voxelizer": [7]}


def test_toy_rehearsal_plan_resolves_on_eight_faked_gpus(tmp_path):
    spec = load_plan(CONFIGS / "launch" / "toy.yaml")
    spec.runs_dir = str(tmp_path / "runs")
    plan = build_plan(spec, cwd=REPO, inventory=fake(8))
    assert plan.problems == []
    big, small = plan.jobs
    assert big.nproc == 7 and big.env_set["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6"
    assert small.nproc == 1 and small.env_set["CUDA_VISIBLE_DEVICES"] == "7"
    assert big.port != small.port
    assert big.config_path == small.config_path == CONFIGS / "toy" / "tiny.yaml"  # the preset name, resolved


def test_a_job_config_may_be_a_preset_name_and_a_typo_names_the_nearest(tmp_path):
    spec = PlanSpec(jobs=[job("a", cpu=1, config="tiny")], runs_dir=str(tmp_path / "runs"))
    (a,) = build_plan(spec, cwd=tmp_path, inventory=fake(0)).jobs
    assert a.config_path == CONFIGS / "toy" / "tiny.yaml" and str(a.config_path) in a.command
    spec = PlanSpec(jobs=[job("a", cpu=1, config="tinyy")], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="job a: --config tinyy: .*did you mean 'tiny'"):
        build_plan(spec, cwd=tmp_path, inventory=fake(0)).check()


# --------------------------------------------------------------------------- refusals (nothing starts)


def test_overlapping_gpus_are_refused_before_anything_starts(tmp_path):
    spec = PlanSpec(jobs=[job("pcdiff", gpus="0-6"), job("vox", gpus="6-7")], runs_dir=str(tmp_path / "runs"))
    plan = build_plan(spec, cwd=tmp_path, inventory=fake(8))
    with pytest.raises(ConfigError, match="jobs pcdiff and vox both use GPU 6; give each job its own GPUs"):
        plan.check()
    with pytest.raises(ConfigError):
        start_plan(plan)
    assert not (tmp_path / "runs").exists()


def test_missing_gpus_and_too_many_processes_are_refused(tmp_path):
    spec = PlanSpec(jobs=[job("a", gpus="7-8")], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(DeviceError, match="asks for GPU 8 but this machine has GPUs 0-7"):
        build_plan(spec, cwd=tmp_path, inventory=fake(8)).check()
    spec = PlanSpec(jobs=[job("a", gpus=[0], nproc=2)], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(DeviceError, match="nproc 2 needs 2 GPUs but the job has 1"):
        build_plan(spec, cwd=tmp_path, inventory=fake(8)).check()
    spec = PlanSpec(jobs=[job("a", gpus=[0])], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(DeviceError, match="no GPUs .*POINTFORGE_FAKE_GPUS"):
        build_plan(spec, cwd=tmp_path, inventory=GpuInventory(0, "none")).check()


def test_port_in_use_and_duplicate_names_and_dirs_are_refused(tmp_path):
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen(1)
    busy = holder.getsockname()[1]
    try:
        spec = PlanSpec(jobs=[job("a", gpus=[0], port=busy)], runs_dir=str(tmp_path / "runs"))
        with pytest.raises(ConfigError, match=f"rendezvous port {busy} is in use"):
            build_plan(spec, cwd=tmp_path, inventory=fake(2)).check()
    finally:
        holder.close()
    spec = PlanSpec(jobs=[job("a", gpus=[0]), job("a", gpus=[1])], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="two jobs are named a"):
        build_plan(spec, cwd=tmp_path, inventory=fake(2)).check()
    shared = str(tmp_path / "same")
    spec = PlanSpec(jobs=[job("a", gpus=[0], run_dir=shared), job("b", gpus=[1], run_dir=shared)])
    with pytest.raises(ConfigError, match="both write to"):
        build_plan(spec, cwd=tmp_path, inventory=fake(2)).check()


def test_run_dir_in_use_or_holding_checkpoints_is_refused(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    # A live run: this very process, recorded as rank 0 of a running job.
    (run_dir / "run.json").write_text(
        json.dumps(
            {
                "status": "running",
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started_at": time.time(),
                "task": "toy",
            }
        )
    )
    spec = PlanSpec(jobs=[job("a", gpus=[0])], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="is in use by a live job"):
        build_plan(spec, cwd=tmp_path, inventory=fake(1)).check()
    (run_dir / "run.json").unlink()
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="already holds checkpoints .* --resume auto"):
        build_plan(spec, cwd=tmp_path, inventory=fake(1)).check()
    plan = build_plan(spec, cwd=tmp_path, inventory=fake(1), resume="auto")
    assert plan.problems == [] and plan.jobs[0].command[-2:] == ["--resume", "auto"]


def test_config_errors_and_uneven_batches_are_refused_per_job(tmp_path):
    spec = PlanSpec(jobs=[job("a", gpus="0-1", overrides=["optim.lrr=1"])], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="job a: unknown config key 'optim.lrr'"):
        build_plan(spec, cwd=tmp_path, inventory=fake(2)).check()
    spec = PlanSpec(jobs=[job("a", gpus="0-2")], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="job a: data.global_batch=8 cannot be split evenly over 3 devices"):
        build_plan(spec, cwd=tmp_path, inventory=fake(3)).check()
    spec = PlanSpec(jobs=[job("a", gpus="0-1")], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="run_dir in the plan"):
        build_plan(spec, cwd=tmp_path, inventory=fake(2), extra_overrides=["run.dir=x"]).check()


def test_a_micro_batch_that_does_not_fit_is_refused_naming_the_largest_that_does(tmp_path, monkeypatch):
    spec = PlanSpec(
        jobs=[job("pc", cpu=1, task="pcdiff", config="tiny", overrides=["data.global_batch=8", "data.micro_batch=8"])],
        runs_dir=str(tmp_path / "runs"),
    )
    build_plan(spec, cwd=tmp_path, inventory=fake(0)).check()  # fits the real machine
    cfg = load_train_config("pcdiff", "tiny").task
    three = get_task("pcdiff").memory_estimate(cfg, 3)
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: three)
    with pytest.raises(ConfigError, match=r"job pc: .*set data.micro_batch=3 \(gradient accumulation keeps") as caught:
        build_plan(spec, cwd=tmp_path, inventory=fake(0)).check()
    # Activation checkpointing fits more of the tiny network's samples in the same memory.
    assert "set task.checkpoint_activations=true (then data.micro_batch=" in str(caught.value)


def test_torch_compile_is_refused_for_pcdiff_before_anything_starts(tmp_path):
    compiled = ["perf.compile=true"]
    spec = PlanSpec(jobs=[job("pc", cpu=1, task="pcdiff", config="tiny", overrides=compiled)], runs_dir=str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"job pc: perf.compile=true cannot train the pcdiff task: .*; set perf.compile=false"
    ):
        build_plan(spec, cwd=tmp_path, inventory=fake(0)).check()
    toy = PlanSpec(jobs=[job("toy", cpu=1, overrides=compiled)], runs_dir=str(tmp_path / "runs"))
    build_plan(toy, cwd=tmp_path, inventory=fake(0)).check()  # a task that compiles is not refused
    # The engine's plan (train, train --dry-run) refuses it the same way, before the first step.
    cfg = load_train_config("pcdiff", "tiny", compiled)
    with pytest.raises(ConfigError, match="cannot train the pcdiff task"):
        make_plan(
            get_task("pcdiff"), cfg, world_size=1, backend="gloo", devices=["cpu"], train_ds=[], val_ds=None, rank=0
        )
    assert preflight.check_compile(get_task("pcdiff"), False).ok


def test_real_gpus_refuse_a_pinned_device(tmp_path):
    spec = PlanSpec(jobs=[job("a", gpus=[5], overrides=["run.device=cuda:5"])], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(DeviceError, match=r"cuda:0 … cuda:0 \(each process takes cuda:LOCAL_RANK\)"):
        build_plan(spec, cwd=tmp_path, inventory=GpuInventory(8, "nvidia-smi")).check()


# --------------------------------------------------------------------------- the plan: GPU map, command, environment


def test_each_job_gets_its_own_devices_port_and_environment(tmp_path, monkeypatch):
    # A shell polluted by an earlier job: none of it may reach the new jobs.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    spec = PlanSpec(
        jobs=[
            job("pc", gpus="0-6", env={"EXTRA": "pc-only"}, overrides=["data.global_batch=14"]),
            job("vox", gpus=[7]),
        ],
        runs_dir=str(tmp_path / "runs"),
        env={"SHARED": "1"},
    )
    plan = build_plan(spec, cwd=tmp_path, inventory=GpuInventory(8, "nvidia-smi"))
    assert plan.problems == []
    pc, vox = plan.jobs
    assert pc.gpu_map() == [(g, f"cuda:{g}") for g in range(7)] and vox.gpu_map() == [(7, "cuda:0")]
    base = dict(os.environ)
    env_pc, env_vox = pc.environment(base), vox.environment(base)
    assert env_pc["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6" and env_vox["CUDA_VISIBLE_DEVICES"] == "7"
    assert env_pc["CUDA_DEVICE_ORDER"] == env_vox["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env_pc["EXTRA"] == "pc-only" and "EXTRA" not in env_vox
    assert env_pc["SHARED"] == env_vox["SHARED"] == "1"
    for env in (env_pc, env_vox):
        assert "MASTER_PORT" not in env and "TORCHELASTIC_RESTART_COUNT" not in env
    assert pc.port != vox.port
    assert f"--rdzv-endpoint=localhost:{pc.port}" in pc.command and "--nproc-per-node=7" in pc.command
    assert pc.command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "run.device=cpu" not in pc.command  # real GPUs: the job uses cuda:LOCAL_RANK
    text = plan.text()
    assert "physical 0-6: 0→cuda:0" in text and "7→cuda:0" in text
    assert "CUDA_VISIBLE_DEVICES='3' is not passed on" in text
    assert "without MASTER_PORT TORCHELASTIC_RESTART_COUNT" in text


def test_launch_and_train_nproc_build_torchrun_the_same_way(tmp_path, monkeypatch):
    from pointforge.train import torchrun

    root = torchrun.package_root()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", root]))
    spec = PlanSpec(
        jobs=[job("a", cpu=2, overrides=["train.epochs=2"], resume="auto")], runs_dir=str(tmp_path / "runs")
    )
    (a,) = build_plan(spec, cwd=tmp_path, inventory=fake(0)).jobs
    worker = torchrun.worker_args(
        "toy", config=TINY, overrides=["train.epochs=2", "run.device=cpu", f"run.dir={a.run_dir}"], resume="auto"
    )
    assert a.command == torchrun.torchrun_command(worker, nproc=2, endpoint=f"localhost:{a.port}", run_id="a")
    assert a.env_set["PYTHONPATH"] == os.pathsep.join([root, "/elsewhere"])  # this checkout first, once
    # train --nproc: the same worker module and arguments, a standalone rendezvous instead of a planned port.
    alone = torchrun.torchrun_command(worker, nproc=2)
    assert "--standalone" in alone and alone[-len(worker) - 2 :] == ["-m", torchrun.WORKER_MODULE, *worker]
    assert torchrun.worker_environment({"PYTHONPATH": root})["PYTHONPATH"] == root
    assert torchrun.worker_args("toy", config="c.yaml", overrides=["a=1"], wandb=True) == [
        "train",
        "toy",
        "--config",
        "c.yaml",
        "--wandb",
        "a=1",
    ]


def test_faked_gpus_run_on_the_cpu_and_say_so(tmp_path):
    spec = PlanSpec(jobs=[job("a", gpus="0-1"), job("c", cpu=2)], runs_dir=str(tmp_path / "runs"))
    plan = build_plan(spec, cwd=tmp_path, inventory=fake(2))
    a, c = plan.jobs
    assert "run.device=cpu" in a.command and a.nproc == 2 and a.env_set["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "run.device=cpu" in c.command and c.nproc == 2 and c.env_set["CUDA_VISIBLE_DEVICES"] == ""
    assert "faked" in plan.text()
    spec = PlanSpec(jobs=[job("g", gpus=[0], overrides=["run.device=cuda"])], runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match=r"job g runs on the CPU \(faked GPUs\) but overrides run.device=cuda"):
        build_plan(spec, cwd=tmp_path, inventory=fake(1)).check()
    script = job_script(a, tmp_path)
    assert "unset CUDA_VISIBLE_DEVICES" in script and "export CUDA_VISIBLE_DEVICES=0,1" in script
    assert script.rstrip().splitlines()[-1].startswith("exec ")


# --------------------------------------------------------------------------- real jobs


@pytest.fixture
def jobs_cleanup():
    """Run dirs registered here have every process of their jobs killed at teardown."""
    run_dirs: list[Path] = []
    yield run_dirs
    pids: set[int] = set()
    for run_dir in run_dirs:
        record = read_launch(run_dir) or {}
        if record.get("pid"):
            pids.add(int(record["pid"]))
            pids.update(descendants(int(record["pid"])))
        for rank in (run_dir / "ranks").glob("rank*.json"):
            try:
                pids.add(int(json.loads(rank.read_text())["pid"]))
            except (OSError, ValueError, KeyError):
                pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:  # reap our own children (the launched torchruns)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _metrics_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = [json.loads(line)["step"] for line in lines if line.strip()]
    return max(steps) if steps else -1


def _wait(predicate, timeout: float, what: str, run_dirs: list[Path]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    logs = "\n".join(
        f"--- {d}:\n" + ((d / "console.log").read_text()[-2000:] if (d / "console.log").exists() else "(no log)")
        for d in run_dirs
    )
    pytest.fail(f"timed out waiting for {what}\n{logs}")


@pytest.mark.dist
def test_two_jobs_launched_monitored_stopped_resumed_and_a_crash_shown(tmp_path, monkeypatch, jobs_cleanup):
    monkeypatch.setenv(FAKE_GPUS_ENV, "3")
    runs = tmp_path / "runs"
    slow = [*QUIET, "train.epochs=40", "log.every_steps=1", "task.step_delay_s=0.1"]
    spec = PlanSpec(jobs=[job("a", gpus=[0]), job("b", gpus=[1])], runs_dir=str(runs), env={"OMP_NUM_THREADS": "1"})
    a, b = runs / "a", runs / "b"
    jobs_cleanup += [a, b]
    plan, started = launch(spec, extra_overrides=slow)
    assert [s.name for s in started] == ["a", "b"] and all(s.pid for s in started)
    assert read_launch(a)["gpus"] == [0] and read_launch(b)["visible_devices"] == "1"
    _wait(lambda: _metrics_step(a) >= 2 and _metrics_step(b) >= 2, 90, "both jobs to train", [a, b])

    # Monitored: both running, each on its own (faked) GPU, with progress and a loss.
    states = {s.name: s for s in collect_runs([runs])}
    assert {n: s.status for n, s in states.items()} == {"a": "running", "b": "running"}
    assert states["a"].gpus == [0] and states["b"].gpus == [1]
    assert states["a"].step >= 2 and states["a"].loss is not None
    text = render_text(snapshot([runs]))
    assert "running" in text and "GPU 0 (faked)" in text

    # a stops gracefully: checkpoint, status "stopped", exit 0.
    refs = jobs_in(spec)
    results = stop_jobs(refs, "a", wait_s=60)
    assert results[0].action == "signalled" and results[0].status == "stopped", results[0].message
    stopped = run_state(a)
    assert stopped.status == "stopped" and Path(stopped.last_checkpoint).name == "latest.pt"
    stopped_step = stopped.step
    assert "stop requested (SIGTERM)" in (a / "train.log").read_text()

    # b dies without a word (kill -9 of its worker and torchrun): shown as crashed.
    worker = json.loads((b / "ranks" / "rank0.json").read_text())["pid"]
    os.kill(worker, signal.SIGKILL)
    os.kill(read_launch(b)["pid"], signal.SIGKILL)
    _wait(lambda: run_state(b).status == "crashed", 30, "b to show as crashed", [b])
    assert "crashed" in render_text(snapshot([runs]))

    # a resumes on two (faked) GPUs instead of one, and finishes.
    spec2 = PlanSpec(jobs=[job("a", gpus="1-2")], runs_dir=str(runs), env={"OMP_NUM_THREADS": "1"})
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        launch(spec2, extra_overrides=[*QUIET, "train.epochs=12"])
    launch(spec2, extra_overrides=[*QUIET, "train.epochs=12"], resume="auto")
    _wait(lambda: run_state(a).status in ("finished", "failed", "crashed"), 120, "a to finish after resuming", [a])
    final = run_state(a)
    assert final.status == "finished", (a / "console.log").read_text()[-3000:]
    assert final.step == final.total_steps == 12 * 8 and final.world_size == 2
    log = (a / "train.log").read_text()
    # Stopped at the last step of an epoch, the checkpoint is that epoch's step 8 of 8, not the next one's step 0.
    resumed = re.search(r"at epoch (\d+), step (\d+) \(step (\d+) of the epoch\)", log.split("resumed from", 1)[1])
    epoch, step, within = (int(g) for g in resumed.groups())
    assert step == stopped_step and 0 <= within <= 8 and epoch * 8 + within == stopped_step, resumed.group(0)
    assert "random streams are re-seeded" in log


@pytest.mark.dist
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tmux_session_has_a_window_per_job_and_a_monitor(tmp_path, monkeypatch, jobs_cleanup):
    sockets = Path(tempfile.mkdtemp(prefix="pftmux", dir="/tmp"))  # short: socket paths are limited to ~100 bytes
    monkeypatch.setenv("TMUX_TMPDIR", str(sockets))
    monkeypatch.delenv("TMUX", raising=False)
    monkeypatch.setenv(FAKE_GPUS_ENV, "1")
    spec = PlanSpec(jobs=[job("solo", gpus=[0])], runs_dir=str(tmp_path / "runs"), session="pftest")
    run_dir = tmp_path / "runs" / "solo"
    jobs_cleanup.append(run_dir)
    try:
        _, started = launch(spec, extra_overrides=[*QUIET, "train.epochs=1"], tmux=True)
        assert started[0].pid is not None and started[0].mode == "tmux"
        windows = subprocess.run(
            ["tmux", "list-windows", "-t", "pftest", "-F", "#W"], capture_output=True, text=True
        ).stdout.split()
        assert windows == ["solo", "monitor"]
        with pytest.raises(ConfigError, match="session named pftest already exists"):
            start_plan(
                build_plan(PlanSpec(jobs=[job("x", gpus=[0])], runs_dir=str(tmp_path / "r2"), session="pftest")),
                tmux=True,
            )
        _wait(lambda: run_state(run_dir).status == "finished", 240, "the tmux job to finish", [run_dir])
        # The window's output also went to the job's log.
        assert "finished: 8 steps" in (run_dir / "console.log").read_text()

        def monitor_shows_the_job() -> bool:
            pane = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", "pftest:monitor"], capture_output=True, text=True
            ).stdout
            return "solo" in pane and "runs (" in pane

        _wait(monitor_shows_the_job, 120, "the monitor window to show the job", [run_dir])
    finally:
        subprocess.run(["tmux", "kill-server"], capture_output=True)
        shutil.rmtree(sockets, ignore_errors=True)


def test_cli_dry_run_and_stop_without_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_GPUS_ENV, "8")
    monkeypatch.chdir(tmp_path)
    out = run_cli("launch", "--job", f"a:toy:0-1:{TINY}", "--job", f"b:toy:2:{TINY}", "--dry-run", "perf.threads=1")
    assert out.exit_code == 0, out.output
    assert "job a" in out.output and "job b" in out.output and "dry run: nothing started" in out.output
    assert "perf.threads=1" in out.output and not (tmp_path / "runs").exists()
    out = run_cli("launch", "--job", f"a:toy:0-1:{TINY}", "--job", f"b:toy:1:{TINY}", "--dry-run")
    assert isinstance(out.exception, ConfigError) and "both use GPU 1" in str(out.exception)
    out = run_cli("launch", "--stop", "all")
    assert isinstance(out.exception, ConfigError) and "no launched jobs found" in str(out.exception)
