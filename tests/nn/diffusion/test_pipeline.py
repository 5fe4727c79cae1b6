"""The one denoising loop: conditioning kept, ensembles, dtypes, and samplers that never see the network."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.pipeline import denoise, repeat_for_ensemble, sample_ensemble
from pointforge.nn.diffusion.samplers.ddim import DDIMSampler
from pointforge.nn.diffusion.samplers.ddpm import DDPMSampler
from pointforge.nn.diffusion.samplers.dpmpp_2m import DPMSolverPP2MSampler
from pointforge.nn.diffusion.samplers.registry import SAMPLER_NAMES, make_sampler
from tests.nn.diffusion.common import N_COND, N_GEN, GaussianDenoiser, close, rms, seeded

# --------------------------------------------------------------------------- interface


class RecordingDenoiser(torch.nn.Module):
    """Learnable stand-in that records the conditioning part it is shown."""

    def __init__(self, n_generated):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(0.1))
        self.n_generated = n_generated
        self.conds, self.grad_enabled, self.batches = [], [], []

    def forward(self, x, t):
        self.conds.append(x[:, :, : -self.n_generated].clone())
        self.grad_enabled.append(torch.is_grad_enabled())
        self.batches.append(x.shape[0])
        return self.weight * x[:, :, -self.n_generated :]  # generated points only


SMALL = dict(n_cond=12, n_gen=5)
FAST_SAMPLERS = [DDPMSampler(), DDIMSampler(10, eta=0.7), DPMSolverPP2MSampler(10)]


@pytest.mark.parametrize("sampler", FAST_SAMPLERS, ids=lambda s: s.name)
def test_conditioning_points_never_change_and_no_graph_is_kept(sampler):
    cond = torch.randn(2, 3, SMALL["n_cond"], generator=torch.Generator().manual_seed(0))
    model = RecordingDenoiser(SMALL["n_gen"])
    progress = []
    out = denoise(
        model,
        sampler,
        cond,
        SMALL["n_gen"],
        generator=torch.Generator().manual_seed(1),
        progress=lambda done, total: progress.append((done, total)),
    )
    assert torch.equal(out[:, :, : SMALL["n_cond"]], cond)
    assert len(model.conds) == sampler.num_steps
    assert all(torch.equal(seen, cond) for seen in model.conds)
    assert not out.requires_grad and not any(model.grad_enabled)
    assert progress == [(i, sampler.num_steps) for i in range(1, sampler.num_steps + 1)]


def test_with_grad_the_chain_is_recorded_for_backpropagation():
    cond = torch.randn(2, 3, SMALL["n_cond"], generator=torch.Generator().manual_seed(0))
    model = RecordingDenoiser(SMALL["n_gen"])
    sampler = DDIMSampler(2, spacing="trailing")
    noise = torch.randn(2, 3, SMALL["n_gen"], generator=torch.Generator().manual_seed(1))
    out = denoise(model, sampler, cond, SMALL["n_gen"], noise=noise, grad=True)
    out[:, :, SMALL["n_cond"] :].square().sum().backward()
    assert model.grad_enabled == [True, True] and model.weight.grad is not None and model.weight.grad != 0
    with torch.no_grad():
        again = denoise(model, sampler, cond, SMALL["n_gen"], noise=noise)
    assert torch.equal(again, out.detach())


@pytest.mark.parametrize("sampler", FAST_SAMPLERS, ids=lambda s: s.name)
def test_sampling_is_deterministic_under_a_generator(sampler):
    cond = torch.randn(2, 3, SMALL["n_cond"], generator=torch.Generator().manual_seed(0))
    model = RecordingDenoiser(SMALL["n_gen"])

    def run(seed):
        return denoise(model, sampler, cond, SMALL["n_gen"], generator=seeded(seed))

    first, again, other = run(11), run(11), run(12)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    # The starting noise is the generator's first draw, so passing it explicitly
    # reproduces a deterministic sampler's run.
    if sampler.name != "ddpm" and getattr(sampler, "eta", 0.0) == 0.0:
        start = torch.randn(2, 3, SMALL["n_gen"], generator=torch.Generator().manual_seed(11))
        assert torch.equal(denoise(model, sampler, cond, SMALL["n_gen"], noise=start), first)


def test_ensemble_is_one_batched_pass_of_independent_members():
    cond = torch.randn(3, SMALL["n_cond"], generator=torch.Generator().manual_seed(0))
    model = RecordingDenoiser(SMALL["n_gen"])
    sampler = DDIMSampler(10)
    members = sample_ensemble(model, sampler, cond, SMALL["n_gen"], 4, generator=torch.Generator().manual_seed(2))
    assert members.shape == (4, 3, SMALL["n_cond"] + SMALL["n_gen"])
    assert set(model.batches) == {4} and len(model.batches) == sampler.num_steps
    assert all(torch.equal(member[:, : SMALL["n_cond"]], cond) for member in members)
    assert not torch.allclose(members[0], members[1])
    # Each member is what a run of its own would give from the same start.
    starts = torch.randn(4, 3, SMALL["n_gen"], generator=torch.Generator().manual_seed(2))
    alone = denoise(model, sampler, cond[None], SMALL["n_gen"], noise=starts[2:3])
    close(members[2], alone[0], rtol=1e-6, atol=1e-6)


def test_repeat_for_ensemble_keeps_each_case_together():
    cond = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    repeated = repeat_for_ensemble(cond, 3)
    assert repeated.shape == (6, 3, 4)
    assert torch.equal(repeated[:3], cond[:1].expand(3, -1, -1))
    assert torch.equal(repeated[3:], cond[1:].expand(3, -1, -1))
    assert repeat_for_ensemble(cond[0], 2).shape == (2, 3, 4)
    with pytest.raises(ConfigError, match="ensemble size"):
        repeat_for_ensemble(cond, 0)
    out = sample_ensemble(RecordingDenoiser(2), DDIMSampler(5), cond, 2, 3)
    assert out.shape == (2, 3, 3, 6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sampling_keeps_the_conditioning_dtype(gaussian_case, dtype):
    cond, noise, exact = gaussian_case
    model = GaussianDenoiser()
    out = denoise(model, DPMSolverPP2MSampler(20), cond.to(dtype), N_GEN, noise=noise.to(dtype))
    assert out.dtype == dtype
    assert torch.equal(out[:, :, :N_COND], cond.to(dtype))
    # Reduced precision is stepped in float32; float64 stays float64 throughout.
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert {d for _, d in model.calls} == {work_dtype}
    tolerance = 0.015 if dtype == torch.float64 else 0.03
    assert rms(out[:, :, N_COND:].double(), exact.double()) < tolerance


def test_sample_input_errors():
    model = RecordingDenoiser(4)
    sampler = DDIMSampler(5)
    with pytest.raises(DataError, match=r"\[B, C, N\]"):
        denoise(model, sampler, torch.zeros(3, 10), 4)
    with pytest.raises(DataError, match="initial noise"):
        denoise(model, sampler, torch.zeros(1, 3, 10), 4, noise=torch.zeros(1, 3, 5))
    with pytest.raises(ConfigError, match="n_generated"):
        denoise(model, sampler, torch.zeros(1, 3, 10), 0)
    with pytest.raises(ConfigError, match="denoiser returned"):
        denoise(lambda x, t: x[:, :2], sampler, torch.zeros(1, 3, 10), 4)


# --------------------------------------------------------------------------- samplers without the network


@pytest.mark.parametrize("sampler", FAST_SAMPLERS, ids=lambda s: s.name)
def test_a_sampler_steps_a_given_output_with_no_network_anywhere(sampler):
    # Only tensors go in: the step is the sampler's arithmetic on the output it is handed.
    sample = torch.randn(2, 3, SMALL["n_gen"], generator=seeded(0), dtype=torch.float64)
    output = torch.randn(2, 3, SMALL["n_gen"], generator=seeded(1), dtype=torch.float64)
    noise = torch.randn(2, 3, SMALL["n_gen"], generator=seeded(2), dtype=torch.float64)
    t = int(sampler.timesteps[0])
    first = sampler.step(output, t, sample, noise=noise)
    again = sampler.step(output.clone(), torch.tensor([t, t]), sample.clone(), noise=noise)
    assert first.prev_sample.shape == sample.shape and first.prev_sample.dtype == torch.float64
    assert torch.equal(first.prev_sample, again.prev_sample)
    # The estimates are the schedule's reading of the output, whichever sampler steps it.
    eps, x0 = sampler.schedule.eps_and_x0(output, torch.tensor([t, t]), sample)
    assert torch.equal(first.eps, eps)
    close(first.pred_x0, x0, rtol=1e-12)
    # A multistep sampler takes the last step's output back; the others ignore it.
    second = sampler.step(output, int(sampler.timesteps[1]), first.prev_sample, noise=noise, previous=first)
    assert torch.isfinite(second.prev_sample).all()


def test_one_trained_network_runs_under_every_sampler_through_the_one_loop():
    torch.manual_seed(0)
    network = torch.nn.Conv1d(3, 3, 1).double()  # a stand-in for a trained PVCNN2: any callable works
    calls = []

    def network_fn(x, t):
        calls.append(t.clone())
        return network(x)

    cond = torch.randn(2, 3, SMALL["n_cond"], generator=seeded(3), dtype=torch.float64)
    for name in SAMPLER_NAMES:
        sampler = make_sampler(name, None if name == "ddpm" else 8)
        calls.clear()
        out = denoise(network_fn, sampler, cond, SMALL["n_gen"], generator=seeded(4))
        assert out.shape == (2, 3, SMALL["n_cond"] + SMALL["n_gen"]) and torch.isfinite(out).all(), name
        assert torch.equal(out[:, :, : SMALL["n_cond"]], cond), name
        # The loop called the network once per sampler step, at the sampler's steps, in order.
        assert [int(t[0]) for t in calls] == sampler.timesteps.tolist(), name
