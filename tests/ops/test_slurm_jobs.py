"""``pointforge slurm`` against a real Slurm: a one-host cluster with two node names (tests/slurm_cluster.py).

Every job is the toy task with tiny sizes on CPU (gloo), two nodes × one
process. Run them alone with ``pytest -m slurm``; without root or without
Slurm installed they skip with one line saying why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pointforge.ops.slurm.queue import QueuedJob, queued_jobs
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.checkpoint import format as ck
from pointforge.train.engine import train
from tests.helpers import QUIET, TOY_TINY, subprocess_env
from tests.slurm_cluster import SlurmCluster, skip_reason

pytestmark = [pytest.mark.slurm, pytest.mark.dist]

COMMON = ["data.global_batch=8", "task.dropout=0.0", "log.every_steps=1", "train.epochs=3"]
SLOW = ["task.step_delay_s=0.3", "ckpt.every_steps=2"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    found = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        found.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        found.stop()
        pytest.skip(f"Slurm did not start here: {err}")
    yield found
    found.stop()


def submit(cluster: SlurmCluster, run_dir: Path, *args: str, nodes: int = 2) -> str:
    plan = run_dir.parent / f"{run_dir.name}.yaml"
    plan.write_text(
        json.dumps(
            {"jobs": [{"name": run_dir.name, "task": "toy", "config": str(TOY_TINY), "cpu": 1, "max_restarts": 1}]}
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "pointforge",
        "slurm",
        str(plan),
        "--nodes",
        str(nodes),
        "--runs-dir",
        str(run_dir.parent),
    ]
    cmd += ["--allow-local-run-dir", *QUIET, *COMMON, *args]
    done = subprocess.run(cmd, env={**subprocess_env(), **cluster.env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "slurm.json").read_text())["job_id"]


def job_field(cluster: SlurmCluster, job_id: str, name: str) -> str:
    for item in cluster.run("scontrol", "show", "job", "-o", job_id, check=False).split():
        if item.startswith(name + "="):
            return item.split("=", 1)[1]
    return ""


def wait_until(predicate, timeout: float, what: str, run_dir: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in run_dir.glob("slurm-*.out"))
    pytest.fail(f"timed out waiting for {what}; job output:\n{logs}")


def ended_as(cluster: SlurmCluster, job_id: str, run_dir: Path, timeout: float = 120) -> str:
    """The state the job ended in; the job's output and the controller's log come with an unexpected one."""
    wait_until(lambda: cluster.job_state(job_id) in ENDED, timeout, f"job {job_id} to end", run_dir)
    state = cluster.job_state(job_id)
    if state != "COMPLETED":
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in run_dir.glob("slurm-*.out"))
        ctld = (cluster.root / "slurmctld.log").read_text(errors="replace")[-2000:]
        print(f"job {job_id} ended {state}; its output:\n{logs}\nslurmctld.log:\n{ctld}")
    return state


def logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.strip().startswith("{")]
    return int(steps[-1]) if steps else 0


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def weights(run_dir: Path) -> dict:
    return ck.load_checkpoint(run_dir / "checkpoints" / "latest.pt")["model"]


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] == b[key]).all(), key


@pytest.fixture(scope="module")
def two_nodes(cluster, tmp_path_factory) -> Path:
    """An uninterrupted 2-node run: the reference the interrupted ones must reproduce exactly."""
    run_dir = tmp_path_factory.mktemp("runs") / "whole"
    job_id = submit(cluster, run_dir)
    assert ended_as(cluster, job_id, run_dir) == "COMPLETED"
    return run_dir


def queued(cluster: SlurmCluster, run_dir: Path, monkeypatch) -> QueuedJob:
    """The job in ``run_dir`` as ``pointforge monitor`` reads it from the queue."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    return next(j for j in queued_jobs([run_dir]) if j.run_dir == str(run_dir))


def test_two_nodes_train_to_the_end_equal_to_one_process(cluster, two_nodes, tmp_path, monkeypatch):
    job = queued(cluster, two_nodes, monkeypatch)
    assert job.state == "COMPLETED" and job.nodes == "2 pf[1-2]" and job.name == "pointforge-whole"
    said = status(two_nodes)
    assert said["status"] == "finished" and said["world_size"] == 2 and said["global_step"] == 24
    single = load_train_config("toy", TOY_TINY, [*QUIET, *COMMON, f"run.dir={tmp_path / 'one'}"])
    assert train(get_task("toy"), single, console=False).global_step == 24
    for key, value in weights(two_nodes).items():
        torch.testing.assert_close(value, weights(tmp_path / "one")[key], rtol=1e-5, atol=1e-6)


def test_a_requeue_resumes_from_the_checkpoint_and_a_killed_worker_is_restarted_and_ends_equal(
    cluster, two_nodes, tmp_path, monkeypatch
):
    """Two recoveries in one job, each checked on its own, and the end equal to the uninterrupted run.

    1. Slurm's warning signal (USR1) at step 3: the job saves, is requeued, waits as pending and
       its second start resumes from the checkpoint (train.log says so).
    2. In that second start, after two more steps, SIGKILL of the rank on the second node: torchrun
       restarts the workers (``max_restarts: 1`` in the plan; run.json counts 1 restart in this
       start) and the run finishes at step 24 with the very weights of ``two_nodes``.
    """
    run_dir = tmp_path / "requeued"
    job_id = submit(cluster, run_dir, *SLOW)
    wait_until(lambda: logged_step(run_dir) >= 3, 60, "step 3", run_dir)
    # What Slurm sends before the time limit (--signal=B:USR1@SECONDS), sent now.
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    wait_until(lambda: job_field(cluster, job_id, "Restarts") == "1", 60, "the requeue", run_dir)
    # A requeued job waits (BeginTime) before it may start again; here it need not.
    wait_until(lambda: cluster.job_state(job_id) == "PENDING", 30, "the job pending again", run_dir)
    # Slurm may show the state a moment before the reason (seen on a loaded machine: "pending (requeued 1×)").
    shown = "pending (requeued 1×): BeginTime"
    wait_until(
        lambda: queued(cluster, run_dir, monkeypatch).shown_state == shown, 10, f"the queue to show {shown!r}", run_dir
    )
    stopped = status(run_dir)
    assert stopped["status"] == "stopped" and 3 <= stopped["global_step"] < 24
    # Slurm's delay also guards this: a job credential made in the same second as the revocation of the
    # last start's counts as revoked ("Job credential revoked"), so let the nodes settle and a second pass.
    cluster.wait_idle(30)
    time.sleep(1.5)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    # Steps past the stop are the second start's; ckpt.every_steps=2 has saved within them by then.
    wait_until(lambda: logged_step(run_dir) >= stopped["global_step"] + 3, 60, "the second start's steps", run_dir)
    victim = json.loads((run_dir / "ranks" / "rank1.json").read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    assert ended_as(cluster, job_id, run_dir) == "COMPLETED"
    said = status(run_dir)
    assert said["status"] == "finished" and said["restarts"] == 1 and said["global_step"] == 24
    log = (run_dir / "train.log").read_text()
    assert "stopped at epoch" in log and f"resumed from {run_dir / 'checkpoints' / 'latest.pt'}" in log
    assert_equal(weights(run_dir), weights(two_nodes))


def test_scancel_of_the_batch_shell_ends_with_a_checkpoint_and_exit_zero_and_one_node_continues(
    cluster, two_nodes, tmp_path
):
    run_dir = tmp_path / "cancelled"
    job_id = submit(cluster, run_dir, *SLOW)
    wait_until(lambda: logged_step(run_dir) >= 3, 60, "step 3", run_dir)
    cluster.run("scancel", "--batch", "--signal=TERM", job_id)
    assert ended_as(cluster, job_id, run_dir) == "COMPLETED"
    assert job_field(cluster, job_id, "ExitCode") == "0:0"
    said = status(run_dir)
    assert said["status"] == "stopped" and 3 <= said["global_step"] < 24
    saved = ck.load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert saved["progress"]["global_step"] == said["global_step"]
    # Continued on one node: the same global batch (8, now on one process) and LR, so the same weights.
    job_id = submit(cluster, run_dir, "--resume", "auto", nodes=1)
    assert ended_as(cluster, job_id, run_dir) == "COMPLETED"
    said = status(run_dir)
    assert said["status"] == "finished" and said["world_size"] == 1 and said["global_step"] == 24
    for key, value in weights(run_dir).items():
        torch.testing.assert_close(value, weights(two_nodes)[key], rtol=1e-5, atol=1e-6)
