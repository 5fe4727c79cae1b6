"""The upsampler under real torchrun: 2 CPU ranks (gloo), clouds of uneven sizes, point-budget batches.

Both ranks start with no data: they race to write the synthetic pair set, and
the file lock must let exactly one of them build it. The job runs in a session
of its own and every process of it is killed in a ``finally`` block.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pointforge.data.batching import PointBudgetBatchSampler
from pointforge.data.pairs import UpsamplingPairs, read_manifest
from pointforge.tasks.upsampler import _split
from tests.helpers import REPO, Job, torchrun_command

pytestmark = pytest.mark.dist

TINY = REPO / "pointforge" / "configs" / "upsampler" / "tiny.yaml"


def run_torchrun(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    job = Job(cmd, cwd, "job")
    try:
        code = job.wait(timeout)
        return code, job.output()
    finally:
        job.stop()


def test_two_ranks_train_uneven_clouds_from_no_data_with_equal_steps(tmp_path):
    run_dir, data = tmp_path / "run", tmp_path / "data" / "set"
    overrides = [
        f"run.dir={run_dir}", f"task.data_root={data}", "log.progress=off", "perf.threads=1", "train.epochs=2",
        "log.every_steps=1", "data.global_batch=8", "data.micro_batch=2", "task.max_points=2500",
        "task.synthetic.pairs=12", "task.synthetic.min_points=100", "task.synthetic.max_points=1500",
    ]  # fmt: skip
    cmd = torchrun_command("upsampler", TINY, overrides)
    code, out = run_torchrun(cmd, tmp_path, timeout=180)
    assert code == 0, out[-4000:]
    assert "world size       2 (gloo)" in out and "× 2 accumulation steps" in out

    # One writer, one set: no temporary folder is left (only rank 0 logs at info level, so the
    # "writing" line shows once or, when rank 1 won the lock, not at all).
    assert out.count("writing 12 synthetic pairs") <= 1
    assert sorted(p.name for p in data.parent.iterdir()) == [".set.lock", "set"]

    # The run's steps are what the point-budget plan gives both ranks (the engine also checks they agree).
    entries, _ = _split(read_manifest(data / "pairs.csv"), 0.25, 0)
    sizes = UpsamplingPairs(entries).sparse_sizes
    assert sizes.max() > 5 * sizes.min()
    plans = [PointBudgetBatchSampler(sizes, 2500, max_clouds=2, world_size=2, rank=r, accumulation=2, seed=0, epoch=e)
             for r in range(2) for e in range(2)]  # fmt: skip
    steps = [len(p) // 2 for p in plans]
    assert len(set(steps[0::2])) == 1 and len(set(steps[1::2])) == 1
    for p in plans:
        assert all(len(b) == 1 or sizes[b].sum() <= 2500 for b in p)
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "finished" and status["global_step"] == steps[0] + steps[1], status
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank0.json", "rank1.json"]

    # No divergence: every logged loss finite, nothing skipped, validation finite.
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert len(losses) == status["global_step"] and all(math.isfinite(v) for v in losses)
    assert all(x.get("train/skipped_steps", 0) == 0 for x in lines)
    val = [x for x in lines if "val_chamfer" in x]
    assert len(val) == 2 and all(np.isfinite(x["val_chamfer"]) for x in val)
    assert "non-finite" not in out and "Traceback" not in out
