"""``pointforge slurm`` without a cluster: the sbatch script (a pure function) and every refusal before submission."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pointforge.cli.entry import run
from pointforge.cli.main import app
from pointforge.errors import ConfigError
from pointforge.ops.slurm.queue import parse_jobs
from pointforge.ops.slurm.script import ENDPOINT, NNODES, RUN_ID, SlurmScript, sbatch_script
from pointforge.ops.slurm.submit import check_shared, filesystem_of
from tests.helpers import TOY_TINY, run_cli


def script(**changes) -> str:
    job = SlurmScript(
        name="pointforge-pc",
        run_dir="/shared/runs/pc",
        python="/opt/venv/bin/python",
        torchrun=[
            "python",
            "-m",
            "torch.distributed.run",
            f"--nnodes={NNODES}",
            f"--rdzv-endpoint={ENDPOINT}",
            f"--rdzv-id={RUN_ID}",
            "--nproc-per-node=4",
            "-m",
            "pointforge",
            "train",
            "pcdiff",
            "--resume",
            "auto",
        ],
        nodes=2,
        gpus_per_node=4,
        partition="gpu",
        account="lab",
        time_limit="1-00:00:00",
        signal_before_s=300,
        env={"PYTHONPATH": "/src/pointforge"},
    )
    for key, value in changes.items():
        setattr(job, key, value)
    return sbatch_script(job)


def test_the_script_runs_one_torchrun_agent_per_node_meeting_at_the_first_node():
    text = script()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --output=/shared/runs/pc/slurm-%j.out",
    ):
        assert line in text.splitlines(), line
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --ntasks-per-node=1 ")
    assert '--nnodes="$SLURM_JOB_NUM_NODES"' in srun and '--rdzv-id="$SLURM_JOB_ID"' in srun
    assert '--rdzv-endpoint="$first_addr:$((20000 + SLURM_JOB_ID % 20000))"' in srun
    assert srun.endswith("--resume auto &")
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "trap 'stop=requeue' USR1" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_a_cpu_job_asks_for_no_gpus_and_a_fixed_port_is_used():
    text = script(gpus_per_node=0, port=29400, partition=None, account=None, time_limit=None)
    assert "--gres" not in text and "--partition" not in text and "--account" not in text and "--time" not in text
    assert '"$first_addr:29400"' in text


def test_local_filesystems_are_not_shared_unless_allowed(tmp_path):
    assert filesystem_of(Path("/proc/self"))[0] == "proc"
    with pytest.raises(ConfigError, match="not a shared filesystem the nodes all see"):
        check_shared(tmp_path / "run", allow_local=False)
    assert "taken as shared" in check_shared(tmp_path / "run", allow_local=True)


def dry_run(tmp_path, *args):
    return run_cli(
        "slurm", "--job", "t:toy:cpu1:" + str(TOY_TINY), "--nodes", "2", "--runs-dir", tmp_path, "--dry-run", *args
    )


def test_dry_run_prints_the_plan_and_the_script_without_slurm(tmp_path):
    result = dry_run(tmp_path, "--allow-local-run-dir", "data.global_batch=8")
    assert result.exit_code == 0, result.output
    assert "2 node(s) × 1 per node = 2 (cpu)" in result.output
    assert "global batch   8: 4 per process" in result.output
    assert "learning rate  0.003" in result.output
    assert "#SBATCH --nodes=2" in result.output and "dry run: nothing submitted" in result.output
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    "args, said",
    [
        (["--allow-local-run-dir", "data.global_batch=9"], "cannot be split evenly over 2 devices"),
        (["--allow-local-run-dir", "optim.lrr=1"], "did you mean"),
        (["data.global_batch=8"], "not a shared filesystem"),
    ],
)
def test_mistakes_are_refused_in_one_line_before_submission(tmp_path, capsys, args, said):
    command = ["slurm", "--job", f"t:toy:cpu1:{TOY_TINY}", "--nodes", "2", "--runs-dir", str(tmp_path), "--dry-run"]
    assert run(app, [*command, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and err.startswith("error: ") and "\n" not in err, err
    assert not (tmp_path / "t").exists()


def test_every_problem_is_refused_at_once_in_one_line(tmp_path, capsys):
    """As ``pointforge launch`` refuses a plan: all problems collected, then one line naming each."""
    command = ["slurm", "--job", f"t:toy:cpu1:{TOY_TINY}", "--nodes", "2", "--runs-dir", str(tmp_path), "--dry-run"]
    assert run(app, [*command, "data.global_batch=9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "plan refused, nothing submitted (2 problems)" in err and "\n" not in err, err
    assert "cannot be split evenly over 2 devices" in err and "not a shared filesystem" in err, err


def test_no_sbatch_on_path_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run(app, ["slurm", "--job", "t:toy:cpu1", "--runs-dir", str(tmp_path), "--allow-local-run-dir"]) == 2
    assert "error: sbatch is not on PATH" in capsys.readouterr().err


SCONTROL = (
    "JobId=7 JobName=pointforge-pc UserId=root(0) JobState=PENDING Reason=BeginTime Requeue=1 Restarts=1 "
    "RunTime=00:00:00 TimeLimit=1-00:00:00 NodeList=(null) NumNodes=2 WorkDir=/shared/runs/pc\n"
    "JobId=8 JobName=pointforge-up JobState=RUNNING Reason=None Restarts=0 RunTime=01:30:05 "
    "TimeLimit=02:00:00 NodeList=gpu[01-02] NumNodes=2 WorkDir=/shared/runs/up\n"
    "JobId=9 JobName=other JobState=TIMEOUT Reason=TimeLimit Restarts=0 RunTime=00:05:00 TimeLimit=UNLIMITED "
    "NodeList=n1 NumNodes=1 WorkDir=/home/x\n"
)


def test_the_queue_is_read_with_state_nodes_and_time_left():
    pending, running, other = parse_jobs(SCONTROL)
    assert pending.shown_state == "pending (requeued 1×): BeginTime" and pending.nodes == "2"
    assert pending.time_left == "1-00:00:00"
    assert running.shown_state == "running" and running.nodes == "2 gpu[01-02]"
    assert running.elapsed == "01:30:05" and running.time_left == "00:29:55"
    assert other.shown_state == "timeout" and other.time_left == "unlimited"


def test_monitor_shows_slurm_jobs_beside_the_runs_with_their_progress(tmp_path):
    from pointforge.ops.monitor import Snapshot, render_text
    from pointforge.ops.runs import RunState

    run = RunState(run_dir=tmp_path, name="up", status="running", step=30, total_steps=100)
    jobs = parse_jobs(SCONTROL)[:2]
    jobs[1].run_dir = str(tmp_path)
    text = render_text(Snapshot(runs=[run], gpus=None, slurm=jobs), width=250)
    assert "Slurm jobs" in text and "pending (requeued 1×): BeginTime" in text
    line = next(line for line in text.splitlines() if " 8 " in line and "pointforge-up" in line)
    assert "30/100 (running)" in line and "00:29:55" in line
