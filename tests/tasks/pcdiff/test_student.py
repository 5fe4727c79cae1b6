"""The few-step PCDiff student: distilled by the engine from the session's tiny teacher, loaded and sampled
through the one path, resumed exactly, refused clearly.

The teacher is ``tiny_implant_models``' PCDiff (tests/conftest.py: tiny preset, T = 20, no prior, so
sampling starts from pure noise at t = 19). The student distils its DDIM-7 into one call in 6 engine steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import CheckpointError, ConfigError
from pointforge.implant.proposals import complete, proposal_sampler
from pointforge.inference import load
from pointforge.inference.pcdiff import LoadedPCDiff, load_pcdiff
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.tasks import get_task
from pointforge.tasks.pcdiff.frame import PriorSection
from pointforge.tasks.pcdiff.student import StudentConfig, student_sampler
from pointforge.train.checkpoint.format import load_checkpoint
from pointforge.train.engine import train
from tests.helpers import CONFIGS, quiet_config, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = CONFIGS / "pcdiff_student" / "tiny.yaml"
STEPS = 6  # 3 epochs of the teacher's 10 training cases at batch 4


def student_config(teacher: Path, run_dir: Path, *overrides: str):
    return quiet_config(
        "pcdiff_student",
        TINY,
        f"task.teacher={teacher}",
        f"run.dir={run_dir}",
        f"train.max_steps={STEPS}",
        "train.eval_every=3",
        "log.every_steps=1",
        "ckpt.every_minutes=0",
        *overrides,
    )


@pytest.fixture(scope="module")
def teacher(tiny_implant_models):
    """(prepared root, the teacher's checkpoint, the voxelizer's checkpoint)."""
    root, _, pc, vox = tiny_implant_models
    return root, pc, vox


@pytest.fixture(scope="module")
def distilled(teacher, tmp_path_factory) -> Path:
    """The run dir of a 1-call student trained for STEPS steps."""
    run_dir = tmp_path_factory.mktemp("student") / "run"
    train(get_task("pcdiff_student"), student_config(teacher[1], run_dir), console=False)
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_distilling_lowers_the_loss_and_beats_the_teachers_own_single_call(distilled):
    lines = metrics(distilled)
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.9 * np.mean(losses[:2]), losses
    # The student starts as the teacher, so its gap started at the teacher's own one-call gap.
    val = [x for x in lines if "val_teacher_gap" in x][-1]
    assert val["val_teacher_gap"] < 0.6 * val["val_teacher_own_gap"], val


def test_the_checkpoint_records_a_student_and_load_pcdiff_knows_it(distilled, teacher):
    path = distilled / "checkpoints" / "latest.pt"
    ckpt = load_checkpoint(path)
    section = ckpt["config"]["task"]
    assert ckpt["task"] == "pcdiff_student"
    assert (section["calls"], section["teacher_sampler"], section["teacher_steps"]) == (1, "ddim", 7)
    assert section["teacher"] == str(teacher[1]) and section["teacher_task"]["model"] == "tiny"

    student = load_pcdiff(path)
    plain = load_pcdiff(teacher[1])
    assert student.student is not None and student.student.calls == 1 and plain.student is None
    assert student.config == plain.config  # the teacher's: how it conditions and where sampling starts
    assert student.schedule is not None and torch.equal(student.schedule.betas, plain.schedule.betas)
    generic = load(path, "cpu")
    assert isinstance(generic, LoadedPCDiff) and generic.student == student.student


def proposals(loaded: LoadedPCDiff, points: np.ndarray, sampler: str, steps: int, seed: int, n: int = 4):
    chosen = proposal_sampler(sampler, steps, loaded.schedule, loaded.config.prior, loaded.student)
    generator = torch.Generator().manual_seed(seed)
    return complete(points, loaded.model, chosen, n, config=loaded.config, generator=generator)


def rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)))


def test_one_call_of_the_student_lands_closer_to_the_teacher_than_one_call_of_the_teacher(distilled, teacher):
    """Through the generate path (load_pcdiff → proposal_sampler → complete), the same seed: the same
    condition and noise; the student maps each noise to the teacher's output for that noise."""
    root = teacher[0]
    data = PreparedDataset(root)
    points = np.asarray(data.points(data.split("val")[0].defective), dtype=np.float64)
    student = load_pcdiff(distilled / "checkpoints" / "latest.pt")
    plain = load_pcdiff(teacher[1])
    target = proposals(plain, points, "ddim", 7, seed=3)
    one_call_student = proposals(student, points, "ddim", 1, seed=3)
    one_call_teacher = proposals(plain, points, "ddim", 1, seed=3)
    assert rms(one_call_student, target) < 0.9 * rms(one_call_teacher, target)

    # Different noise, different proposals, spread as the teacher's are.
    other_seed = proposals(student, points, "ddim", 1, seed=4)
    assert rms(other_seed, one_call_student) > 0.1 * rms(target[0], target[1])

    def spread(x):
        return float(np.mean([rms(x[i], x[j]) for i in range(len(x)) for j in range(i + 1, len(x))]))

    assert 0.5 < spread(one_call_student) / spread(target) < 2.0


def test_a_resumed_distillation_ends_where_an_uninterrupted_one_does(distilled, teacher, tmp_path):
    run_dir = tmp_path / "run"
    train(get_task("pcdiff_student"), student_config(teacher[1], run_dir, "train.max_steps=4"), console=False)
    train(get_task("pcdiff_student"), student_config(teacher[1], run_dir), resume="auto", console=False)
    straight = load_checkpoint(distilled / "checkpoints" / "latest.pt")["model"]
    resumed = load_checkpoint(run_dir / "checkpoints" / "latest.pt")["model"]
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_generate_takes_the_student_and_refuses_steps_it_was_not_distilled_for(distilled, teacher, tmp_path):
    root, _, vox = teacher
    data = PreparedDataset(root)
    source = Path(data.meta(data.split("test")[0].defective)["source"])
    student = distilled / "checkpoints" / "latest.pt"
    out = tmp_path / "case"
    args = ("generate", source, "--pcdiff", student, "--voxelizer", vox, "-n", 2)
    result = run_cli(*args, "--out", out, "--steps", 1)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert '"calls": 1' in json.dumps(report), report

    for extra, fragment in (
        (("--steps", 2), "asks a 1-call student of ddim-7 for more calls than it was distilled for"),
        (("--sampler", "dpm++2m"), "use --sampler ddim"),
    ):
        result = run_cli(*args, "--out", tmp_path / "refused", *extra)
        # main() turns a UserError into one red line (test_cli.py); here it arrives raw.
        message = str(result.exception)
        assert isinstance(result.exception, ConfigError) and fragment in message and "\n" not in message, message
        assert not (tmp_path / "refused" / "report.json").exists()


def test_a_two_call_student_steps_on_a_trailing_grid_from_the_teachers_start():
    schedule = NoiseSchedule.from_name("linear", 1e-4, 0.02, 1000)
    cfg = StudentConfig(teacher="t.pt", calls=2)
    assert student_sampler(cfg, schedule, None).timesteps.tolist() == [999, 500]
    prior = PriorSection(start_step=400)
    assert student_sampler(cfg, schedule, prior).timesteps.tolist() == [400, 200]


def test_refusals_are_one_clear_line(distilled, teacher, tmp_path):
    def refused(error, fragment, *overrides):
        with pytest.raises(error) as caught:
            cfg = quiet_config("pcdiff_student", TINY, f"run.dir={tmp_path / 'never'}", *overrides)
            get_task("pcdiff_student").configure(cfg.task)
        message = str(caught.value)
        assert fragment in message and "\n" not in message, message

    refused(ConfigError, "config key 'task.teacher' is not set")
    refused(ConfigError, "no such file", f"task.teacher={tmp_path / 'missing.pt'}")
    refused(CheckpointError, "a checkpoint of task 'voxelizer', not a PCDiff", f"task.teacher={teacher[2]}")
    student = distilled / "checkpoints" / "latest.pt"
    refused(CheckpointError, "a checkpoint of task 'pcdiff_student', not a PCDiff", f"task.teacher={student}")
    refused(
        ConfigError, "must exceed 'task.calls'", f"task.teacher={teacher[1]}", "task.calls=2", "task.teacher_steps=2"
    )
    refused(ConfigError, "task.teacher_steps", f"task.teacher={teacher[1]}", "task.teacher_steps=50")  # T = 20

    missing = f"task.teacher={tmp_path / 'missing.pt'}"
    result = run_cli("train", "pcdiff_student", "--config", "tiny", missing, f"run.dir={tmp_path / 'never'}")
    assert isinstance(result.exception, ConfigError) and "no such file" in str(result.exception)
    assert not (tmp_path / "never").exists()
