"""The engine under real torchrun: 2 CPU ranks, gloo.

Each test starts real processes (torchrun, or ``pointforge train --nproc``),
always in a session of its own that is killed in a ``finally`` block, so a
failing test never leaves processes behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.checkpoint import format as ck
from pointforge.train.engine import train
from tests.helpers import QUIET, TOY_TINY, Job, run_to_end, torchrun_command

pytestmark = pytest.mark.dist

TINY = TOY_TINY
# Dropout makes the result depend on every rank's RNG stream, so exact equality
# after a resume proves those streams were restored.
# Evaluation on rank 0 only exercises the rank-0 hand-off in every run that uses it.
REFERENCE = ["task.dropout=0.2", "train.epochs=3", "data.global_batch=8", "log.every_steps=1", "task.eval_on=rank0"]


def torchrun_job(
    tmp_path: Path, name: str, overrides: list[str], *, resume: str | None = None, task: str = "toy"
) -> Job:
    cmd = torchrun_command(task, TINY, [*QUIET, *overrides])
    if resume:
        cmd += ["--resume", resume]
    return Job(cmd, tmp_path / "logs", name)


def launcher_job(
    tmp_path: Path, name: str, overrides: list[str], *, max_restarts: int = 0, resume: str | None = None
) -> Job:
    cmd = [
        sys.executable,
        "-m",
        "pointforge",
        "train",
        "toy",
        "--config",
        str(TINY),
        "--nproc",
        "2",
        "--max-restarts",
        str(max_restarts),
        *QUIET,
        *overrides,
        *(["--resume", resume] if resume else []),
    ]
    return Job(cmd, tmp_path / "logs", name)


def wait_for(predicate, timeout: float, job: Job, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        if job.proc.poll() is not None:
            pytest.fail(f"job ended before {what}; output:\n{job.output()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def run_json(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def logged_step(run_dir: Path) -> int:
    """The last step rank 0 logged (metrics.jsonl is appended at every log step; run.json is rate-limited)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ck.load_checkpoint(run_dir / "checkpoints" / "latest.pt")["model"]


def assert_equal_weights(a, b, *, exact: bool) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run that the interrupted ones must reproduce exactly."""
    tmp = tmp_path_factory.mktemp("reference")
    run_dir = tmp / "run"
    run_to_end(torchrun_job(tmp, "reference", [*REFERENCE, f"run.dir={run_dir}"]))
    return run_dir


def test_two_ranks_equal_one_rank_with_double_batch(tmp_path):
    """2 ranks × 4 per device (taken as 2 micro-batches under no_sync) == 1 rank × 8, after k = 6 steps.

    The run is ended by SIGTERM delivered to rank 1 alone during step 5: both
    ranks must agree to stop after that step, save, and exit 0.
    """
    common = ["data.global_batch=8", "task.dropout=0.0", "sched.name=constant"]
    out = run_to_end(
        torchrun_job(
            tmp_path,
            "ddp",
            [
                *common,
                "data.micro_batch=2",
                "task.sigterm_at_step=5",
                "task.sigterm_rank=1",
                f"run.dir={tmp_path / 'ddp'}",
            ],
            task="faulty_toy",
        )
    )
    assert "global 8 = 2 rank(s) × 2 per device × 2 accumulation steps" in out and "world size       2 (gloo)" in out
    status = run_json(tmp_path / "ddp")
    assert status["status"] == "stopped" and status["global_step"] == 6, status
    assert "stopped by a signal at epoch 0, step 6" in out  # rank 0 speaks; the signal reached rank 1
    single = load_train_config("toy", TINY, [*common, *QUIET, "train.max_steps=6", f"run.dir={tmp_path / 'single'}"])
    assert train(get_task("toy"), single, console=False).global_step == 6
    assert_equal_weights(weights(tmp_path / "ddp"), weights(tmp_path / "single"), exact=False)
    ranks = sorted(p.name for p in (tmp_path / "ddp" / "ranks").iterdir())
    assert ranks == ["rank0.json", "rank1.json"]


def test_a_time_based_schedule_sets_the_same_lr_on_every_rank(tmp_path):
    """Rank 0's training clock reaches every rank through the step's all-reduce: the replicas stay identical
    while the LR decays over minutes (a rank reading its own clock would drift off at the first step)."""
    logs = tmp_path / "weights"
    logs.mkdir()
    over = ["train.epochs=50", "train.max_minutes=0.01", "task.step_delay_s=0.1", "log.every_steps=1"]
    over += ["sched.name=linear", "sched.warmup_steps=0", "sched.horizon_minutes=0.01"]
    run_to_end(
        torchrun_job(
            tmp_path, "horizon", [*over, f"task.weights_log={logs}", f"run.dir={tmp_path / 'run'}"], task="faulty_toy"
        )
    )
    per_rank = [(logs / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert len(per_rank[0]) >= 4 and per_rank[0] == per_rank[1]  # same weights, to the last bit, at every step
    lrs = [json.loads(x).get("train/lr") for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [x for x in lrs if x is not None]
    assert lrs[0] > lrs[-1] and all(b <= a for a, b in zip(lrs, lrs[1:]))


def test_uneven_batches_fail_fast_with_the_divergence_message(tmp_path):
    job = torchrun_job(
        tmp_path,
        "uneven",
        ["train.epochs=3", "task.drop_batches_on_rank=1", "task.drop_from_epoch=1", f"run.dir={tmp_path / 'run'}"],
        task="faulty_toy",
    )
    try:
        code = job.wait(60)
        out = job.output()
    finally:
        job.stop()
    assert code != 0
    assert "ranks disagree on the number of optimizer steps in epoch 1 (rank 0: 8, rank 1: 7)" in out, out[-3000:]
    assert run_json(tmp_path / "run")["status"] == "failed"
    assert job.elapsed() < 45  # torch start-up included; a hang would last dist.timeout_s


def test_stalled_rank_ends_the_job_within_the_timeout_naming_it(tmp_path):
    job = torchrun_job(
        tmp_path,
        "stall",
        [
            "train.epochs=2",
            "dist.timeout_s=3",
            "log.every_steps=1",
            "task.stall_rank=1",
            "task.stall_step=3",
            "task.stall_s=5",
            f"run.dir={tmp_path / 'run'}",
        ],
        task="faulty_toy",
    )
    try:
        code = job.wait(60)
        out = job.output()
    finally:
        job.stop()
    assert code != 0
    assert "rank 0 failed while training (epoch 0, step 3)" in out, out[-3000:]
    assert re.search(r"rank 0 \(pid \d+ on \S+\): in backward \(gradient all-reduce\) at epoch 0, step 3", out), out[
        -3000:
    ]
    assert re.search(r"rank 1 \(pid \d+ on \S+\): in training_step \(forward\) at epoch 0, step 3 for [3-9] s", out)
    status = run_json(tmp_path / "run")
    assert status["status"] == "failed" and "rank 0 failed while training" in status["error"]


def test_sigterm_saves_exits_zero_and_a_resumed_run_restarts_a_killed_rank_and_matches_uninterrupted(
    tmp_path, reference_run
):
    """One run through both recoveries of ``pointforge train --nproc 2``, each checked on its own.

    1. SIGTERM to the launcher at step 3 or later: it saves, exits 0, run.json says stopped at that step.
    2. ``--resume auto --max-restarts 1``: the run resumes from that checkpoint; two steps later rank 1 is
       SIGKILLed, torchrun restarts the workers, they resume from the newest checkpoint (``ckpt.every_steps=2``)
       and the run finishes with 1 restart and the very weights of the uninterrupted reference run.
    """
    run_dir = tmp_path / "run"
    slow = [*REFERENCE, "task.step_delay_s=0.1", "ckpt.every_steps=2", f"run.dir={run_dir}"]
    job = launcher_job(tmp_path, "cut", slow)
    try:
        wait_for(lambda: logged_step(run_dir) >= 3, 60, job, "step 3")
        job.proc.send_signal(signal.SIGTERM)
        code = job.wait(60)
        out = job.output()
    finally:
        job.stop()
    assert code == 0, out[-3000:]
    status = run_json(run_dir)
    assert status["status"] == "stopped" and "stopped at step" in out
    stopped_at = status["global_step"]
    assert 3 <= stopped_at < 24
    saved = ck.load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert saved["progress"]["global_step"] == stopped_at and saved["rng"]["world_size"] == 2

    job = launcher_job(tmp_path, "kill", slow, max_restarts=1, resume="auto")
    try:
        # Steps past the stop are the resumed run's; a checkpoint within them is saved by then.
        wait_for(lambda: logged_step(run_dir) >= stopped_at + 3, 60, job, f"step {stopped_at + 3}")
        victim = json.loads((run_dir / "ranks" / "rank1.json").read_text())["pid"]
        os.kill(victim, signal.SIGKILL)
        code = job.wait(120)
        out = job.output()
    finally:
        job.stop()
    assert code == 0, out[-3000:]
    status = run_json(run_dir)
    assert status["status"] == "finished" and status["restarts"] == 1 and status["global_step"] == 24
    log = (run_dir / "train.log").read_text()
    resumed = [int(step) for step in re.findall(r"resumed from \S+ at epoch \d+, step (\d+)", log)]
    assert f"resumed from {run_dir / 'checkpoints' / 'latest.pt'}" in log
    assert len(resumed) == 2 and resumed[0] == stopped_at and stopped_at < resumed[1] < 24, log[-2000:]
    assert_equal_weights(weights(run_dir), weights(reference_run), exact=True)


def test_two_torchrun_agents_as_two_nodes_train_to_the_end_equal_to_one_agent(tmp_path, reference_run):
    """``--nnodes 2``: two agents (as on two nodes) meet at a c10d rendezvous on localhost, one worker each."""
    import socket

    from pointforge.train.torchrun import torchrun_command as agent_command, worker_args

    run_dir = tmp_path / "run"
    worker = worker_args("toy", config=TINY, overrides=[*QUIET, *REFERENCE, f"run.dir={run_dir}"])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = agent_command(worker, nproc=1, endpoint=f"localhost:{port}", run_id="two-nodes", nnodes=2)
    assert "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd
    agents = [Job(cmd, tmp_path / "logs", f"agent{i}") for i in range(2)]
    try:
        for agent in agents:
            assert agent.wait(120) == 0, agent.output()[-3000:]
    finally:
        for agent in agents:
            agent.stop()
    status = run_json(run_dir)
    assert status["status"] == "finished" and status["world_size"] == 2 and status["global_step"] == 24
    assert_equal_weights(weights(run_dir), weights(reference_run), exact=True)
