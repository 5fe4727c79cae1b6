"""bench/paper_pipeline.py: the ideal-output wrappers that stand in for random weights.

The benchmark itself (a 512³ case through the paper networks) takes minutes; what
decides whether its later stages see a realistic implant is tested here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pointforge.nn.diffusion.schedule import NoiseSchedule
from tests.helpers import shell_mask


@pytest.fixture(scope="module")
def paper(bench_module):
    return bench_module("paper_pipeline")


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x, t):
        self.calls += 1
        return torch.randn_like(x)


def test_the_ideal_denoiser_runs_the_network_and_returns_the_true_implants_noise(paper):
    schedule = NoiseSchedule(np.linspace(1e-4, 0.02, 50))
    rng = np.random.default_rng(0)
    skull = rng.random((200, 3)) * 40
    implant = rng.random((30, 3)) * 10 + 15
    net = Counting()
    ideal = paper.IdealDenoiser(net, schedule, implant, skull)
    x0 = ideal.x0[None].expand(4, -1, -1)
    noise = torch.randn(4, 3, 30, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0, 10, 30, 49])
    x_t = schedule.q_sample(x0, t, noise)
    cond = torch.zeros(4, 3, 200)
    eps = ideal(torch.cat([cond, x_t], dim=2), t)
    assert net.calls == 1 and eps.shape == (4, 3, 30)
    torch.testing.assert_close(eps, noise, atol=1e-3, rtol=1e-3)


def test_stencil_normals_point_out_of_the_bone(paper):
    shell = shell_mask((40, 40, 40), center=(20, 20, 20), radii=(14, 14, 14), thickness=3.0)
    outer = np.array([[20.0, 20.0, 34.0], [6.0, 20.0, 20.0]])  # on the outer surface: out is away from the centre
    inner = np.array([[20.0, 20.0, 9.0]])  # on the inner surface: out of the bone is towards the centre
    normals = paper._stencil_normals(shell, np.concatenate([outer, inner]))
    np.testing.assert_allclose(np.linalg.norm(normals, axis=1), 1.0, atol=1e-6)
    assert normals[0, 2] > 0.9 and normals[1, 0] < -0.9 and normals[2, 2] > 0.9


def test_the_read_stage_is_timed_on_the_reader_generate_case_calls(paper, tmp_path, monkeypatch):
    """The benchmark wraps generate_case's reader to mark the read stage's end: the wrapper must be what it calls
    (a renamed reader once left the benchmark failing before its first stage)."""
    from pointforge.data.volumes import Volume, write_volume
    from pointforge.implant import case

    monkeypatch.setattr(case, "read_skull_input", case.read_skull_input)  # restored after the test
    path = tmp_path / "skull.nrrd"
    write_volume(path, Volume(shell_mask((24, 24, 24), radii=(9, 9, 9), thickness=2.0)))
    clock = paper.StageClock()
    paper._timed_read(clock)
    volume, series = case.read_skull_input(path)
    assert "read" in clock.at and volume.data.any() and series is None


def test_the_random_student_loads_as_a_student_of_its_teacher_with_its_weights(paper, tmp_path):
    """The side-by-side run's default student: a pcdiff_student checkpoint that load_pcdiff reads as a
    one-call student of DDIM-7, with the teacher's task section and weights (so each call costs the same)."""
    from pointforge.inference.pcdiff import load_pcdiff

    teacher = paper.random_checkpoint("pcdiff", "tiny.yaml", tmp_path / "teacher.pt")
    student = load_pcdiff(paper.random_student(teacher, 2, tmp_path / "student.pt"))
    plain = load_pcdiff(teacher)
    assert student.student is not None and student.student.calls == 2 and plain.student is None
    assert (student.student.teacher_sampler, student.student.teacher_steps) == ("ddim", 7)
    assert student.config == plain.config
    for (name, a), (_, b) in zip(student.model.state_dict().items(), plain.model.state_dict().items()):
        assert torch.equal(a, b), name
