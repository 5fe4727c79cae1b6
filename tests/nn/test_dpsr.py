"""DPSR: the reference fixture, gradients, non-cubic grids, errors, and a sphere."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from pointforge.errors import ConfigError, DataError, UserError
from pointforge.nn.dpsr import DPSR, dpsr, dpsr_memory_bytes, psr_tanh_mse_loss
from pointforge.nn.dpsr_grid import interpolate, rasterize
from tests.helpers import FIXTURES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sap():
    data = torch.load(FIXTURES / "sap_dpsr.pt", weights_only=True)
    assert "DPSR" in data["notes"] and "psr_raw" in data["notes"]
    return data


CASE_NAMES = ["sphere_r32_s2", "sphere_r32_s10", "sphere_r64_s2", "sphere_r64_s10", "blob_r32_s2", "blob_r32_s10"]


def _case(sap, name):
    (case,) = [c for c in sap["cases"] if c["name"] == name]
    return case


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _grad_scale_tol(reference: torch.Tensor) -> float:
    # The reference's own float32 gradients differ from a float64 solve by ~4e-7
    # of their largest entry (grad_points reaches ~6.5), so gradients are held to
    # 1e-5 of their scale rather than to a fixed absolute number.
    return 1e-5 * reference.abs().max().item()


# ----------------------------------------------------------------------------
# The reference fixture, every entry.


def test_fixture_lists_the_cases_we_check(sap):
    assert [c["name"] for c in sap["cases"]] == CASE_NAMES
    assert "shape_as_points" in sap["source"]


@pytest.mark.parametrize("backend", ["plain", "compiled"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_fixture_solution_and_values_at_points(sap, name, backend):
    case = _case(sap, name)
    res, sig = tuple(case["res"]), case["sig"]
    points, normals = case["points"], case["normals"]
    psr = dpsr(points, normals, res, sig, backend=backend)
    assert psr.shape == case["psr"].shape and psr.dtype == torch.float32
    assert _max_err(psr, case["psr"]) < 1e-6
    assert _max_err(interpolate(psr, points), case["psr_at_points"]) < 1e-6

    raw = dpsr(points, normals, res, sig, shift=False, scale=False, backend=backend)
    if "psr_raw" in case:
        assert _max_err(raw, case["psr_raw"]) < 1e-7  # raw values are ~20x smaller than psr
    shift_only = dpsr(points, normals, res, sig, shift=True, scale=False, backend=backend)
    assert _max_err(shift_only, raw - case["stats"]["shift_offset"]) < 1e-7

    stats = case["stats"]
    at_points = interpolate(psr, points)[0]
    mid = tuple(r // 2 for r in res)
    ours = {
        "corner_value": psr[0, 0, 0, 0].item(),
        "mean_at_points": at_points.mean().item(),
        "std_at_points": at_points.std().item(),
        "min": psr.min().item(),
        "max": psr.max().item(),
        "center_value": psr[(0, *mid)].item(),
        "shift_offset": interpolate(raw, points).mean().item(),
        "raw_corner": raw[0, 0, 0, 0].item(),
        "raw_center": raw[(0, *mid)].item(),
        "scale_fv0": shift_only[0, 0, 0, 0].item(),
    }
    for key, value in ours.items():
        assert value == pytest.approx(stats[key], abs=1e-6), key
    assert (psr <= 0).double().mean().item() == stats["frac_le0"]

    if name.startswith("sphere"):
        # The spheres are centred at 0.5 with radius 0.3 (this reproduces the stored
        # inside fraction exactly). The blob's implicit function is not part of the
        # fixture (only its drawing parameters), so its two truth stats are not checked.
        axes = [torch.arange(r, dtype=torch.float64) / r for r in res]
        nodes = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1)
        inside = (nodes - 0.5).norm(dim=-1) <= 0.3
        assert inside.double().mean().item() == stats["true_inside_frac"]
        agreement = ((psr[0] <= 0) == inside).double().mean().item()
        assert agreement == pytest.approx(stats["sign_agreement"], abs=1e-12)


@pytest.mark.parametrize("backend", ["plain", "compiled"])
def test_fixture_float64_solve(sap, backend):
    case = _case(sap, "sphere_r32_s2")
    psr = dpsr(case["points_f64"], case["normals_f64"], tuple(case["res"]), case["sig"], backend=backend)
    assert psr.dtype == torch.float64
    assert _max_err(psr, case["psr_f64"]) < 1e-12


@pytest.mark.parametrize("backend", ["plain", "compiled"])
@pytest.mark.parametrize("name", [n for n in CASE_NAMES if "r32" in n])
def test_fixture_gradients(sap, name, backend):
    case = _case(sap, name)
    points = case["points"].clone().requires_grad_()
    normals = case["normals"].clone().requires_grad_()
    (dpsr(points, normals, tuple(case["res"]), case["sig"], backend=backend) * case["grad_weight"]).sum().backward()
    assert _max_err(points.grad, case["grad_points"]) < _grad_scale_tol(case["grad_points"])
    assert _max_err(normals.grad, case["grad_normals"]) < _grad_scale_tol(case["grad_normals"])


def test_fixture_tanh_mse_loss_and_gradients(sap):
    case = _case(sap, "sphere_r32_s2")
    assert torch.equal(case["tanh_mse_normals_in"], 0.9 * case["normals"])
    points = case["points"].clone().requires_grad_()
    normals = case["tanh_mse_normals_in"].clone().requires_grad_()
    psr = dpsr(points, normals, tuple(case["res"]), case["sig"])
    # The stored target is already tanh'd (the loss the fixture names is
    # mse(tanh(DPSR(...)), target)).
    loss = psr_tanh_mse_loss(psr, case["tanh_mse_target"], target_is_tanh=True)
    assert loss.item() == pytest.approx(case["tanh_mse_loss"].item(), rel=1e-6)
    loss.backward()
    assert _max_err(points.grad, case["tanh_mse_grad_points"]) < _grad_scale_tol(case["tanh_mse_grad_points"])
    assert _max_err(normals.grad, case["tanh_mse_grad_normals"]) < _grad_scale_tol(case["tanh_mse_grad_normals"])


def test_tanh_mse_loss_applies_tanh_to_the_indicator_target():
    pred = torch.tensor([[0.3, -0.2, 1.5]])
    target = torch.tensor([[0.5, -0.5, 0.5]])
    expected = ((torch.tanh(pred) - math.tanh(0.5) * torch.sign(target)) ** 2).mean()
    assert psr_tanh_mse_loss(pred, target).item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(DataError):
        psr_tanh_mse_loss(pred, target[:, :2])


def test_batched_call_equals_single_calls_and_inward_normals_flip_sign(sap):
    sphere, blob = _case(sap, "sphere_r32_s2"), _case(sap, "blob_r32_s2")
    points = torch.cat((sphere["points"], blob["points"]))
    normals = torch.cat((sphere["normals"], blob["normals"]))
    both = dpsr(points, normals, 32, 2)
    assert torch.equal(both[0], dpsr(sphere["points"], sphere["normals"], 32, 2)[0])
    assert torch.equal(both[1], dpsr(blob["points"], blob["normals"], 32, 2)[0])
    inward = dpsr(sphere["points"], -sphere["normals"], 32, 2)
    assert torch.equal(inward, -both[:1])
    assert inward[0, 0, 0, 0].item() == -0.5


# ----------------------------------------------------------------------------
# An independent evaluation of the formula, on non-cubic grids with odd sizes.


def _numpy_raw_solve(points: np.ndarray, normals: np.ndarray, res, sigma):
    """The notes' formula in float64 NumPy: explicit splat, pocketfft, no shared code."""
    raster = np.zeros((3, *res))
    for p, n in zip(points, normals):
        u = p * np.array(res)
        i0 = np.floor(u).astype(int)
        f = u - i0
        for bits in itertools.product((0, 1), repeat=3):
            w = np.prod([f[d] if b else 1 - f[d] for d, b in enumerate(bits)])
            node = tuple((i0[d] + b) % res[d] for d, b in enumerate(bits))
            raster[(slice(None), *node)] += w * n
    spectrum = np.fft.rfftn(raster, axes=(1, 2, 3))
    k = np.meshgrid(
        np.fft.fftfreq(res[0], 1 / res[0]),
        np.fft.fftfreq(res[1], 1 / res[1]),
        np.fft.rfftfreq(res[2], 1 / res[2]),
        indexing="ij",
    )
    omega = [2 * np.pi * kd for kd in k]
    gauss = np.exp(-0.5 * (2 * sigma * np.sqrt(sum(kd**2 for kd in k)) / res[0]) ** 2)
    lap = -sum(w**2 for w in omega) + 1e-6
    phi_hat = sum(-1j * omega[d] * spectrum[d] for d in range(3)) * gauss / lap
    phi_hat[0, 0, 0] = 0
    return np.fft.irfftn(phi_hat, s=res, axes=(0, 1, 2)), raster


def _sphere_cloud(n, center, radius, dtype=torch.float32):
    """n points spread evenly (Fibonacci lattice) on a sphere, with exact outward normals."""
    i = torch.arange(n, dtype=torch.float64) + 0.5
    polar = torch.arccos(1 - 2 * i / n)
    azimuth = math.pi * (1 + 5**0.5) * i
    normals = torch.stack(
        (torch.sin(polar) * torch.cos(azimuth), torch.sin(polar) * torch.sin(azimuth), torch.cos(polar)), 1
    )
    points = torch.tensor(center, dtype=torch.float64) + radius * normals
    return points.to(dtype)[None], normals.to(dtype)[None]


def _random_cloud(n, seed, dtype=torch.float64, margin=0.05):
    g = torch.Generator().manual_seed(seed)
    points = margin + (1 - 2 * margin) * torch.rand(1, n, 3, generator=g, dtype=dtype)
    normals = torch.randn(1, n, 3, generator=g, dtype=dtype)
    return points, normals


@pytest.mark.parametrize("res", [(6, 5, 8), (7, 6, 5), (8, 8, 6)])
def test_raw_solve_and_raster_match_an_independent_numpy_evaluation(res):
    points, normals = _random_cloud(40, seed=sum(res))
    expected, raster = _numpy_raw_solve(points[0].numpy(), normals[0].numpy(), res, sigma=2.0)
    ours = dpsr(points, normals, res, 2.0, shift=False, scale=False)[0]
    # Relative 1e-6, not 1e-15: like the reference, a float64 solve keeps the
    # Gaussian, 2*pi*k and the Laplacian rounded to float32.
    assert np.abs(ours.numpy() - expected).max() < 1e-6 * np.abs(expected).max()
    assert np.abs(rasterize(points, normals, res)[0].numpy() - raster).max() < 1e-12


def test_non_cubic_grid_is_consistent_under_axis_permutation():
    # Odd sizes: on even ones the reference (and so DPSR) keeps the Nyquist
    # derivative along the first two axes but drops it along the last, so the
    # field is not exactly symmetric under axis permutations there.
    points, normals = _sphere_cloud(2000, center=(0.47, 0.52, 0.5), radius=0.28)
    res = (15, 21, 19)
    psr = dpsr(points, normals, res, 2.0)
    # Swapping axes 1 and 2 keeps r0, which sets the Gaussian's width on every axis.
    swapped = dpsr(points[..., [0, 2, 1]], normals[..., [0, 2, 1]], (15, 19, 21), 2.0)
    assert _max_err(swapped, psr.transpose(2, 3)) < 1e-6
    # Without smoothing any permutation, axis 0 included, gives the permuted field.
    psr0 = dpsr(points, normals, res, 0.0)
    moved = dpsr(points[..., [2, 0, 1]], normals[..., [2, 0, 1]], (19, 15, 21), 0.0)
    assert _max_err(moved, psr0.permute(0, 3, 1, 2)) < 1e-6
    # The even-grid asymmetry is real and pinned: it is the reference's behaviour.
    even = dpsr(points, normals, (16, 24, 20), 2.0)
    even_swapped = dpsr(points[..., [0, 2, 1]], normals[..., [0, 2, 1]], (16, 20, 24), 2.0)
    assert _max_err(even_swapped, even.transpose(2, 3)) > 1e-3


def test_point_just_below_one_on_a_non_power_of_two_grid_lands_on_node_zero():
    x = 1.0 - 2.0**-24  # largest float32 below 1
    points = torch.tensor([[[x, 0.5, 0.25]]])
    raster = rasterize(points, torch.ones(1, 1, 1), (48, 8, 8))[0, 0]
    assert raster.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert raster[0, 4, 2].item() == pytest.approx(1.0, abs=1e-4)


# ----------------------------------------------------------------------------
# Gradients.


@pytest.mark.parametrize(
    ("shift", "scale", "backend"),
    [
        (True, True, "plain"),
        (True, True, "compiled"),
        (False, False, "compiled"),
        (True, False, "plain"),
        (False, True, "compiled"),
    ],
)
def test_gradcheck_points_and_normals(shift, scale, backend):
    points, normals = _random_cloud(7, seed=11)
    points.requires_grad_()
    normals.requires_grad_()

    def fn(p, n):
        return dpsr(p, n, (6, 5, 4), 1.5, shift=shift, scale=scale, backend=backend)

    assert torch.autograd.gradcheck(fn, (points, normals), eps=1e-7, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_plain_and_compiled_backends_agree_on_values_and_gradients():
    points, normals = _sphere_cloud(3000, center=(0.48, 0.5, 0.53), radius=0.3)
    weight = torch.randn(1, 40, 36, 33, generator=torch.Generator().manual_seed(0))
    results = []
    for backend in ("plain", "compiled"):
        p, n = points.clone().requires_grad_(), normals.clone().requires_grad_()
        psr = dpsr(p, n, (40, 36, 33), 2.0, backend=backend)
        (psr * weight).sum().backward()
        results.append((psr.detach(), p.grad, n.grad))
    (psr_t, gp_t, gn_t), (psr_s, gp_s, gn_s) = results
    assert _max_err(psr_t, psr_s) < 1e-6
    assert _max_err(gp_t, gp_s) < 1e-5 * gp_t.abs().max().item()
    assert _max_err(gn_t, gn_s) < 1e-5 * gn_t.abs().max().item()
    with pytest.raises(ConfigError, match="backend must be one of"):
        dpsr(points, normals, 16, backend="ducc")


def test_gradient_to_points_only_equals_the_full_gradient():
    points, normals = _random_cloud(50, seed=5, dtype=torch.float32)
    weight = torch.randn(1, 12, 10, 8, generator=torch.Generator().manual_seed(0))
    p1, n1 = points.clone().requires_grad_(), normals.clone().requires_grad_()
    (dpsr(p1, n1, (12, 10, 8)) * weight).sum().backward()
    p2 = points.clone().requires_grad_()
    (dpsr(p2, normals, (12, 10, 8)) * weight).sum().backward()
    assert torch.equal(p1.grad, p2.grad)
    n3 = normals.clone().requires_grad_()
    (dpsr(points, n3, (12, 10, 8)) * weight).sum().backward()
    assert torch.equal(n1.grad, n3.grad)


# ----------------------------------------------------------------------------
# Errors a user can cause.


@pytest.mark.parametrize(
    ("points", "what"),
    [
        (torch.tensor([[[0.5, 0.5, 1.0]]]), "[0, 1)"),
        (torch.tensor([[[0.5, -1e-4, 0.5]]]), "[0, 1)"),
        (torch.tensor([[[0.5, float("nan"), 0.5]]]), "NaN"),
        (torch.zeros(1, 0, 3), "empty"),
        (torch.zeros(4, 3) + 0.5, "shape (batch, n, 3)"),
    ],
)
def test_bad_points_raise_a_one_line_data_error(points, what):
    with pytest.raises(DataError) as info:
        dpsr(points, torch.ones_like(points), 16)
    assert what in str(info.value) and "\n" not in str(info.value)


def test_bad_normals_and_settings_raise_user_errors():
    points = torch.full((1, 4, 3), 0.5)
    with pytest.raises(DataError, match="NaN"):
        dpsr(points, torch.full_like(points, float("nan")), 16)
    with pytest.raises(DataError, match="normals"):
        dpsr(points, torch.ones(1, 5, 3), 16)
    for res in (1, (16, 16), (16, 16, 0), 16.5):
        with pytest.raises(ConfigError):
            dpsr(points, torch.ones_like(points), res)
    with pytest.raises(ConfigError, match="sigma"):
        DPSR(16, sigma=-1.0)
    with pytest.raises(DataError, match="corner"):
        dpsr(points, torch.zeros_like(points), 16)
    assert dpsr(points, torch.zeros_like(points), 16, scale=False).abs().max() == 0


def test_grid_too_large_for_the_memory_limit_raises_before_allocating():
    points, normals = _sphere_cloud(4, center=(0.5, 0.5, 0.5), radius=0.2)
    need = dpsr_memory_bytes(64, 4)
    with pytest.raises(ConfigError, match="memory limit") as info:
        dpsr(points, normals, 64, memory_limit=need - 1)
    assert "64x64x64" in str(info.value) and "\n" not in str(info.value)
    assert dpsr(points, normals, 64, memory_limit=need).shape == (1, 64, 64, 64)
    # 8192^3 needs ~ 6 TiB: refused against the machine's available memory, at once.
    with pytest.raises(ConfigError, match="memory available"):
        dpsr(points, normals, 8192)
    assert isinstance(info.value, UserError)


def test_module_checks_the_available_memory_once_per_solve_shape(monkeypatch):
    # A training run solves one shape every step: another process's passing peak must not stop it
    # mid-run (it did: a voxelizer run refused a 0.08 GiB solve at step 1,450). A new shape is checked.
    import pointforge.nn.dpsr as dpsr_module

    points, normals = _sphere_cloud(4, center=(0.5, 0.5, 0.5), radius=0.2)
    solver = DPSR(16, sigma=1.0)
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(dpsr_module, "available_memory_bytes", lambda device: free["bytes"])
    first = solver(points, normals)
    free["bytes"] = 1
    assert torch.equal(solver(points, normals), first)
    with pytest.raises(ConfigError, match="memory available"):
        solver(points.repeat(2, 1, 1), normals.repeat(2, 1, 1))
    with pytest.raises(ConfigError, match="memory available"):
        dpsr(points, normals, 16, sigma=1.0)  # the function has no memory of earlier solves
    with pytest.raises(ConfigError, match="memory limit"):
        DPSR(16, sigma=1.0, memory_limit=1)(points, normals)  # an explicit limit is checked every call


def test_memory_estimate_grows_with_the_grid_batch_and_gradients():
    f = dpsr_memory_bytes
    grid = 512**3 * 4
    assert f(256) * 7 < f(512) < f(256) * 9
    assert f(512, requires_grad=True) > f(512)
    assert f(512, batch=2) - f(512) >= 2 * grid
    assert f(256, dtype=torch.float64) > 1.9 * f(256)
    assert f(64, 10**7) > f(64, 10**5) > f(64)
    # At 512^3 the forward pass needs three grids' worth and forward+backward
    # six (incoming gradient included), where a straightforward solver needs ~20.
    assert f(512, 215_000) < 3.1 * grid
    assert f(512, 215_000, requires_grad=True) < 6.5 * grid


# ----------------------------------------------------------------------------
# A sphere with exact normals and no network.


def test_sphere_indicator_matches_the_ball():
    center, radius = (0.47, 0.52, 0.5), 0.28
    points, normals = _sphere_cloud(20_000, center, radius)
    psr = dpsr(points, normals, 64, 2.0)[0]
    axes = [torch.arange(64, dtype=torch.float64) / 64] * 3
    nodes = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1)
    ball = (nodes - torch.tensor(center, dtype=torch.float64)).norm(dim=-1) <= radius
    inside = psr <= 0
    iou = (inside & ball).sum().item() / (inside | ball).sum().item()
    assert iou >= 0.95
    assert psr[0, 0, 0].item() == 0.5
