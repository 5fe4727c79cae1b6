"""The few-step student under real torchrun: 2 CPU ranks (gloo), a two-call student of a teacher that
samples from its prior (the atlas estimate noised to ``prior.start_step``), then sampled through
the generate path from that start.

The teacher is trained here for two steps (its quality does not matter: the test checks where
sampling starts and that two ranks train and evaluate the student together). The job runs in a
session of its own and every process of it is killed in a ``finally`` block.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.implant.proposals import complete, proposal_sampler
from pointforge.inference.pcdiff import load_pcdiff
from pointforge.tasks import get_task
from pointforge.train.engine import train
from tests.helpers import CONFIGS, Job, quiet_config, torch_threads, torchrun_command

pytestmark = pytest.mark.dist


def test_two_ranks_distil_a_teacher_that_starts_from_its_prior(tmp_path, synthetic_skulls):
    teacher_cfg = quiet_config(
        "pcdiff",
        CONFIGS / "pcdiff" / "tiny.yaml",
        f"run.dir={tmp_path / 'teacher'}",
        f"task.data_root={synthetic_skulls}",
        "task.synthetic=null",
        "task.frame.scale=0.5",
        "task.prior.start_step=10",
        "task.diffusion.timesteps=20",
        "task.diffusion.beta_start=5e-3",
        "task.diffusion.beta_end=0.25",
        "train.max_steps=2",
        "train.eval_every=0",
        "ckpt.every_minutes=0",
    )
    with torch_threads(1):
        teacher = train(get_task("pcdiff"), teacher_cfg, console=False).checkpoint

    run_dir = tmp_path / "student"
    overrides = [
        f"task.teacher={teacher}", f"run.dir={run_dir}", "task.calls=2", "task.teacher_steps=5",
        "train.max_steps=2", "train.eval_every=1", "log.every_steps=1", "log.progress=off", "perf.threads=1",
        "log.tensorboard=false", "ckpt.every_minutes=0",
    ]  # fmt: skip
    job = Job(torchrun_command("pcdiff_student", CONFIGS / "pcdiff_student" / "tiny.yaml", overrides), tmp_path, "job")
    try:
        code = job.wait(240)
        out = job.output()
    finally:
        job.stop()
    assert code == 0, out[-4000:]
    assert "world size       2 (gloo)" in out
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "finished" and status["global_step"] == 2, status
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert any(math.isfinite(x.get("val_teacher_gap", math.nan)) for x in lines)

    # Generation starts the student where its teacher starts: the prior's step, then halfway down.
    student = load_pcdiff(run_dir / "checkpoints" / "latest.pt")
    assert student.student is not None and student.config.prior is not None
    sampler = proposal_sampler("ddim", None, student.schedule, student.config.prior, student.student)
    assert sampler.timesteps.tolist() == [10, 5]
    data = PreparedDataset(synthetic_skulls)
    case = data.split("val")[0]
    points = np.asarray(data.points(case.defective), dtype=np.float64)
    spacing = data.meta(case.defective)["spacing"]
    with torch_threads(1):
        found = complete(
            points, student.model, sampler, 2, config=student.config, spacing=spacing,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    assert found.shape == (2, 128, 3) and np.isfinite(found).all() and not np.allclose(found[0], found[1])
