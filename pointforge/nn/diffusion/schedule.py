"""The discrete noise schedule of Gaussian diffusion (PCDiff) and its tables.

A :class:`NoiseSchedule` holds the forward process for ``T`` steps (betas,
cumulative alphas, posterior coefficients), noises clean points
(:meth:`NoiseSchedule.q_sample`) and turns a network's output into its noise
and clean-point estimates (:meth:`NoiseSchedule.eps_and_x0`), whatever the
network predicts (ε, x0 or v).

Numerics follow upstream PCDiff so that its fixtures match: ``alphas_cumprod`` is
the float64 cumulative product cast to float32 and every other table is computed
in float32 from it. Float64 inputs get the same tables computed in float64.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.checks import check_int, check_real

__all__ = [
    "SCHEDULE_NAMES",
    "PREDICTIONS",
    "Timesteps",
    "make_betas",
    "rescale_zero_terminal_snr",
    "NoiseSchedule",
    "default_schedule",
]

SCHEDULE_NAMES = ("linear", "warm0.1", "warm0.2", "warm0.5", "cosine")
# What the network outputs for the generated points: the noise (upstream PCDiff), the
# clean points, or the velocity v = sqrt(ac) * eps - sqrt(1 - ac) * x0 (Salimans & Ho 2022).
PREDICTIONS = ("eps", "x0", "v")

Timesteps = Union[int, Sequence[int], Tensor]

_WARMUP_FRACTIONS = {"warm0.1": 0.1, "warm0.2": 0.2, "warm0.5": 0.5}


def make_betas(
    name: str = "linear",
    beta_start: float = 1e-4,
    beta_end: float = 0.02,
    num_timesteps: int = 1000,
) -> np.ndarray:
    """The float64 beta table of a named schedule, exactly as upstream builds it.

    ``linear``: ``linspace(beta_start, beta_end, T)``. ``warm0.1/0.2/0.5`` (PVD's):
    ``beta_end`` everywhere except a linear warm-up from ``beta_start`` over the
    first ``int(T * fraction)`` steps. ``cosine`` (Nichol & Dhariwal 2021, offset
    0.008, betas capped at 0.999) ignores ``beta_start``/``beta_end``.
    """
    if name not in SCHEDULE_NAMES:
        raise ConfigError(f"unknown noise schedule {name!r}; choose one of: {', '.join(SCHEDULE_NAMES)}")
    beta_start = check_real(beta_start, "beta_start")
    beta_end = check_real(beta_end, "beta_end")
    num_timesteps = check_int(num_timesteps, "num_timesteps", 2)
    if not 0.0 < beta_start <= beta_end < 1.0:
        raise ConfigError(
            f"betas must satisfy 0 < beta_start <= beta_end < 1, got beta_start={beta_start}, "
            f"beta_end={beta_end}; the paper uses 1e-4 and 0.02"
        )
    if name == "linear":
        return np.linspace(beta_start, beta_end, num_timesteps, dtype=np.float64)
    if name == "cosine":
        steps = np.arange(num_timesteps + 1, dtype=np.float64) / num_timesteps
        f = np.cos((steps + 0.008) / 1.008 * math.pi / 2) ** 2
        return np.clip(1.0 - f[1:] / f[:-1], 0.0, 0.999)
    betas = np.full(num_timesteps, beta_end, dtype=np.float64)
    warmup = int(num_timesteps * _WARMUP_FRACTIONS[name])
    betas[:warmup] = np.linspace(beta_start, beta_end, warmup, dtype=np.float64)
    return betas


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Betas whose last step leaves no signal (ᾱ_T = 0), the rest as close as can be.

    Lin et al. 2024 ("Common diffusion noise schedules and sample steps are
    flawed"): shift ``sqrt(ᾱ)`` so its last value is 0 and scale it so its first
    value is unchanged. Then the last training step sees pure noise, as sampling
    starts from pure noise, so nothing about the clean points (e.g. where they
    are) can leak into the noisiest inputs the network learns from. The last beta
    becomes 1; such a schedule needs ``x0`` or ``v`` prediction (ε says nothing
    about the clean points when no signal is left).
    """
    root = np.sqrt(np.cumprod(1.0 - np.asarray(betas, dtype=np.float64)))
    first, last = root[0], root[-1]
    root = (root - last) * first / (first - last)
    ac = root**2
    out = 1.0 - ac / np.concatenate([[1.0], ac[:-1]])
    out[-1] = 1.0
    return out


def _derived_tables(betas: Tensor, alphas: Tensor, ac: Tensor) -> dict[str, Tensor]:
    # Same expressions, same order as upstream, so float32 rounding matches its tables.
    acp = torch.cat([torch.ones(1, dtype=ac.dtype), ac[:-1]])
    posterior_variance = betas * (1.0 - acp) / (1.0 - ac)
    return {
        "betas": betas,
        "alphas_cumprod": ac,
        "alphas_cumprod_prev": acp,
        "sqrt_alphas_cumprod": torch.sqrt(ac),
        "sqrt_one_minus_alphas_cumprod": torch.sqrt(1.0 - ac),
        "log_one_minus_alphas_cumprod": torch.log(1.0 - ac),
        "sqrt_recip_alphas_cumprod": torch.sqrt(1.0 / ac),
        "sqrt_recipm1_alphas_cumprod": torch.sqrt(1.0 / ac - 1.0),
        "posterior_variance": posterior_variance,
        # The posterior variance is 0 at t = 0; upstream clips its log at 1e-20.
        "posterior_log_variance_clipped": torch.log(torch.clamp_min(posterior_variance, 1e-20)),
        "posterior_mean_coef1": betas * torch.sqrt(acp) / (1.0 - ac),
        "posterior_mean_coef2": (1.0 - acp) * torch.sqrt(alphas) / (1.0 - ac),
    }


class NoiseSchedule:
    """Discrete forward-process tables for ``T`` steps.

    The float32 tables are attributes named as upstream names them
    (``betas``, ``alphas_cumprod``, ``sqrt_recipm1_alphas_cumprod``, ...);
    ``betas_float64`` and ``alphas_cumprod_float64`` keep the exact values.
    """

    TABLE_NAMES = (
        "betas",
        "alphas_cumprod",
        "alphas_cumprod_prev",
        "sqrt_alphas_cumprod",
        "sqrt_one_minus_alphas_cumprod",
        "log_one_minus_alphas_cumprod",
        "sqrt_recip_alphas_cumprod",
        "sqrt_recipm1_alphas_cumprod",
        "posterior_variance",
        "posterior_log_variance_clipped",
        "posterior_mean_coef1",
        "posterior_mean_coef2",
    )

    def __init__(
        self,
        betas: Union[np.ndarray, Tensor, Sequence[float]],
        name: str = "custom",
        *,
        prediction: str = "eps",
    ):
        if prediction not in PREDICTIONS:
            raise ConfigError(f"unknown prediction {prediction!r}; choose one of: {', '.join(PREDICTIONS)}")
        if isinstance(betas, Tensor):
            betas = betas.detach().cpu().numpy()
        betas64 = np.asarray(betas, dtype=np.float64)
        if betas64.ndim != 1 or betas64.size < 2:
            raise ConfigError(f"betas must be a 1-D table of at least 2 steps, got shape {tuple(betas64.shape)}")
        inner = betas64[:-1]
        if not np.all(np.isfinite(betas64)) or not np.all((inner > 0) & (inner < 1)) or not 0 < betas64[-1] <= 1:
            raise ConfigError(
                "every beta must be finite and strictly between 0 and 1 "
                "(the last may be 1: a zero-terminal-SNR schedule)"
            )
        if betas64[-1] == 1 and prediction == "eps":
            raise ConfigError(
                "a zero-terminal-SNR schedule (last beta 1) needs prediction x0 or v: "
                "predicted noise says nothing about the points when no signal is left"
            )
        self.name = name
        self.prediction = prediction
        self.num_timesteps = int(betas64.size)
        ac64 = np.cumprod(1.0 - betas64)
        self.betas_float64 = torch.from_numpy(betas64)
        self.alphas_cumprod_float64 = torch.from_numpy(ac64)
        self._tables = {
            torch.float32: _derived_tables(
                torch.from_numpy(betas64).float(),
                torch.from_numpy(1.0 - betas64).float(),
                torch.from_numpy(ac64).float(),
            ),
            torch.float64: _derived_tables(
                torch.from_numpy(betas64.copy()),
                torch.from_numpy(1.0 - betas64),
                torch.from_numpy(ac64.copy()),
            ),
        }
        for key, value in self._tables[torch.float32].items():
            setattr(self, key, value)
        self._on_device: dict[tuple, Tensor] = {}

    @classmethod
    def from_name(
        cls,
        name: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
        num_timesteps: int = 1000,
        *,
        prediction: str = "eps",
        zero_terminal_snr: bool = False,
    ) -> "NoiseSchedule":
        """A named schedule (see :func:`make_betas`); defaults are the paper's.

        ``zero_terminal_snr`` rescales it (:func:`rescale_zero_terminal_snr`).
        """
        betas = make_betas(name, beta_start, beta_end, num_timesteps)
        if zero_terminal_snr:
            betas = rescale_zero_terminal_snr(betas)
        return cls(betas, name=name + ("+zsnr" if zero_terminal_snr else ""), prediction=prediction)

    def __repr__(self) -> str:
        return f"NoiseSchedule(name={self.name!r}, num_timesteps={self.num_timesteps}, prediction={self.prediction!r})"

    def snr(self, t: Tensor, like: Tensor) -> Tensor:
        """Signal-to-noise ratio ᾱ/(1 - ᾱ) at steps ``t``, shaped to broadcast against ``like``."""
        ac = self.coefficient("alphas_cumprod", t, like)
        return ac / (1.0 - ac)

    def table(self, name: str, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Table ``name`` on ``device``: float64 values for float64 work, float32 otherwise."""
        precision = torch.float64 if dtype == torch.float64 else torch.float32
        key = (name, torch.device(device), precision)
        cached = self._on_device.get(key)
        if cached is None:
            cached = self._tables[precision][name].to(device)
            self._on_device[key] = cached
        return cached

    def coefficient(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """``table[t]`` shaped ``[B, 1, ..., 1]`` to broadcast against ``like``."""
        values = self.table(name, like.device, like.dtype)[t]
        return values.to(like.dtype).reshape(t.shape[0], *([1] * (like.dim() - 1)))

    def timesteps_for(self, t: Timesteps, batch: int, device: torch.device) -> Tensor:
        """``t`` as an int64 ``[batch]`` tensor, checked to lie in ``[0, T - 1]``."""
        t = torch.as_tensor(t, device=device)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise DataError(f"timesteps must be integers, got dtype {t.dtype}")
        t = t.to(torch.int64)
        if t.dim() == 0:
            t = t.expand(batch)
        if t.shape != (batch,):
            raise DataError(f"timesteps must be a scalar or shaped [{batch}], got {tuple(t.shape)}")
        if batch and (int(t.min()) < 0 or int(t.max()) >= self.num_timesteps):
            raise DataError(
                f"timesteps must lie in [0, {self.num_timesteps - 1}], got values from {int(t.min())} to {int(t.max())}"
            )
        return t

    def q_sample(self, x0: Tensor, t: Timesteps, noise: Tensor) -> Tensor:
        """Diffuse ``x0`` to step ``t``: ``sqrt(ac[t]) * x0 + sqrt(1 - ac[t]) * noise``."""
        if noise.shape != x0.shape:
            raise DataError(f"noise shape {tuple(noise.shape)} differs from the points' {tuple(x0.shape)}")
        t = self.timesteps_for(t, x0.shape[0], x0.device)
        return self.diffuse(x0, t, noise)

    def diffuse(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """:meth:`q_sample` on checked inputs (``t`` int64 ``[B]`` in range, ``noise`` shaped as ``x0``).

        No check reads ``t`` back from the device: the training step calls this every step.
        """
        return (
            self.coefficient("sqrt_alphas_cumprod", t, x0) * x0
            + self.coefficient("sqrt_one_minus_alphas_cumprod", t, x0) * noise
        )

    def predict_x0(self, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        """The clean points implied by ``x_t`` and its noise estimate; no clipping."""
        return (
            self.coefficient("sqrt_recip_alphas_cumprod", t, x_t) * x_t
            - self.coefficient("sqrt_recipm1_alphas_cumprod", t, x_t) * eps
        )

    def eps_and_x0(self, model_output: Tensor, t: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        """The noise and clean-point estimates ``(eps, x0)`` a network output implies at ``x_t``.

        ``model_output`` is what the network predicts (``self.prediction``) for
        the points ``x_t`` at steps ``t``; both estimates are derived from it
        exactly. For ``x0``/``v`` this stays finite where ᾱ = 0 (a
        zero-terminal-SNR schedule's last step), which the ε form cannot.
        """
        out = model_output.to(x_t.dtype)
        if self.prediction == "eps":
            return out, self.predict_x0(x_t, t, out)
        signal = self.coefficient("sqrt_alphas_cumprod", t, x_t)
        noise = self.coefficient("sqrt_one_minus_alphas_cumprod", t, x_t)
        if self.prediction == "x0":
            return (x_t - signal * out) / noise, out
        return noise * x_t + signal * out, signal * x_t - noise * out


_DEFAULT_SCHEDULE: Optional[NoiseSchedule] = None


def default_schedule() -> NoiseSchedule:
    """The paper's schedule (linear, T = 1000, ε), built once."""
    global _DEFAULT_SCHEDULE
    if _DEFAULT_SCHEDULE is None:
        _DEFAULT_SCHEDULE = NoiseSchedule.from_name()
    return _DEFAULT_SCHEDULE
