"""The ``task`` section of a PCDiff training config: its dataclasses and what they build.

:class:`PCDiffConfig` (data, model preset and its activation checkpointing, point
counts, formulation options)
with its sections :class:`~pointforge.data.cache.SyntheticSection`, :class:`DiffusionSection` and
:class:`EvalSection`; :func:`build_schedule` and :func:`build_eval_sampler`
turn the last two into a noise schedule and a sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pointforge.data.cache import SyntheticSection
from pointforge.errors import ConfigError
from pointforge.nn.diffusion.samplers.base import Sampler
from pointforge.nn.diffusion.samplers.registry import make_sampler
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.nn.pvcnn_config import get_preset
from pointforge.tasks.pcdiff.frame import FrameSection, PriorSection

__all__ = [
    "PRESET_POINTS",
    "DiffusionSection",
    "EvalSection",
    "PCDiffConfig",
    "build_schedule",
    "build_eval_sampler",
]

# Points per example (defective skull, implant) each PVCNN2 preset is laid out for.
PRESET_POINTS: dict[str, tuple[int, int]] = {
    "paper": (27_648, 3_072),
    "small": (3_456, 384),
    "tiny": (896, 128),
}


@dataclass
class DiffusionSection:
    """The noise schedule and what the network predicts.

    The defaults are upstream PCDiff's (Friedrich et al., MICCAI 2023: T = 1000,
    linear betas 1e-4 → 0.02, ε-prediction, plain MSE); the other values are the options measured in
    docs/experiments/pcdiff.md.
    """

    schedule: Literal["linear", "warm0.1", "warm0.2", "warm0.5", "cosine"] = "linear"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    timesteps: int = 1000
    prediction: Literal["eps", "x0", "v"] = "eps"
    zero_terminal_snr: bool = False  # rescale so the last step is pure noise (needs x0 or v)
    loss_weighting: Literal["natural", "min_snr", "trunc_snr"] = "natural"

    def validate(self, prefix: str) -> None:
        try:
            build_schedule(self)
        except ConfigError as err:
            raise ConfigError(f"config section '{prefix}': {err}") from None


@dataclass
class EvalSection:
    """How validation samples implants: a fast sampler, on at most ``max_cases`` cases."""

    sampler: Literal["ddpm", "ddim", "dpm++2m"] = "ddim"
    steps: int | None = 25  # null: the sampler's default (all T steps for ddpm)
    eta: float = 0.0  # ddim only
    max_cases: int | None = 8  # the first N validation cases (in cases.csv order); null = all
    seed: int = 0  # starting noise, the same at every evaluation
    save_samples: bool = True  # write samples.npz (voxel coordinates) under the run's eval/epoch-NNNN

    def validate(self, prefix: str) -> None:
        if self.max_cases is not None and self.max_cases < 1:
            raise ConfigError(f"config key '{prefix}.max_cases' must be at least 1 or null, got {self.max_cases}")
        if self.sampler == "ddpm" and self.steps is not None:
            raise ConfigError(
                f"config key '{prefix}.steps' must be null for the ddpm sampler (it runs all T steps); use ddim or dpm++2m for fewer"
            )
        if self.sampler != "ddim" and self.eta != 0.0:
            raise ConfigError(
                f"config key '{prefix}.eta' applies to the ddim sampler only; remove it for {self.sampler}"
            )


@dataclass
class PCDiffConfig:
    """The ``task`` section of a PCDiff training config."""

    data_root: str = "data/pcdiff/prepared"  # a prepared dataset (pointforge data prepare)
    synthetic: SyntheticSection | None = None  # build a synthetic dataset at data_root if none is there
    train_split: Literal["train", "val", "test"] = "train"
    val_split: Literal["train", "val", "test"] | None = "val"
    model: Literal["paper", "small", "tiny"] = "paper"  # PVCNN2 preset
    # Recompute PVCNN2's block activations in the backward pass instead of keeping them:
    # a larger batch fits, each step costs more (docs/experiments/benchmarks.md, "Activation checkpointing").
    checkpoint_activations: bool = False
    n_skull: int | None = None  # null: the preset's (PRESET_POINTS)
    n_implant: int | None = None
    rotate_degrees: float = 0.0  # training augmentation: random rotation within ± this about each axis
    data_seed: int = 0  # per-item subsampling and rotation: seeded by (data_seed, epoch, index)
    condition_mark: bool = False  # an input channel marking the skull points (1) and the implant's (0)
    mirror: bool = False  # training augmentation: half the examples mirrored left-right (array axis 0)
    frame: FrameSection | None = None  # diffuse in a local frame around the implant (completion_frame)
    prior: PriorSection | None = None  # start sampling from the atlas estimate of the implant (needs frame)
    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self) -> None:
        skull, implant = PRESET_POINTS.get(self.model, (None, None))
        if self.n_skull is None:
            self.n_skull = skull
        if self.n_implant is None:
            self.n_implant = implant

    @property
    def points(self) -> tuple[int, int]:
        """``(n_skull, n_implant)``; ``__post_init__`` has filled in the preset's for null."""
        assert self.n_skull is not None and self.n_implant is not None
        return self.n_skull, self.n_implant

    def validate(self, prefix: str) -> None:
        n_skull, n_implant = self.points
        if self.synthetic is not None:
            self.synthetic.check(
                f"{prefix}.synthetic", min_skulls=2, why=" (a training and a validation skull at least)"
            )
        if self.frame is not None:
            self.frame.check(f"{prefix}.frame")
            if self.rotate_degrees:
                raise ConfigError(
                    f"config key '{prefix}.rotate_degrees' must be 0 with '{prefix}.frame' (the atlas frame assumes aligned skulls)"
                )
        if self.prior is not None:
            if self.frame is None:
                raise ConfigError(
                    f"config key '{prefix}.prior' needs '{prefix}.frame' (the prior is the frame's atlas estimate)"
                )
            self.prior.check(f"{prefix}.prior", self.diffusion.timesteps)
            if self.eval.steps is not None and self.eval.steps > self.prior.start_step + 1:
                raise ConfigError(
                    f"config key '{prefix}.eval.steps' = {self.eval.steps} exceeds the {self.prior.start_step + 1} steps "
                    f"from '{prefix}.prior.start_step' to 0"
                )
        if n_skull < 1 or n_implant < 1:
            raise ConfigError(
                f"config keys '{prefix}.n_skull' and '{prefix}.n_implant' must be at least 1, got {self.n_skull} and {self.n_implant}"
            )
        need = get_preset(self.model).min_points
        if n_skull + n_implant < need:
            raise ConfigError(
                f"config keys '{prefix}.n_skull' + '{prefix}.n_implant' = {n_skull + n_implant} points, "
                f"but PVCNN2 preset '{self.model}' needs at least {need}"
            )
        if not 0.0 <= self.rotate_degrees <= 180.0:
            raise ConfigError(f"config key '{prefix}.rotate_degrees' must lie in [0, 180], got {self.rotate_degrees}")
        if self.val_split is not None and self.val_split == self.train_split:
            raise ConfigError(
                f"config keys '{prefix}.train_split' and '{prefix}.val_split' are both '{self.train_split}'; validate on another split or set val_split: null"
            )
        if self.eval.steps is not None and not 2 <= self.eval.steps <= self.diffusion.timesteps:
            raise ConfigError(
                f"config key '{prefix}.eval.steps' must be from 2 to {prefix}.diffusion.timesteps={self.diffusion.timesteps}, got {self.eval.steps}"
            )


def build_schedule(section: DiffusionSection) -> NoiseSchedule:
    return NoiseSchedule.from_name(
        section.schedule,
        section.beta_start,
        section.beta_end,
        section.timesteps,
        prediction=section.prediction,
        zero_terminal_snr=section.zero_terminal_snr,
    )


def build_eval_sampler(section: EvalSection, schedule: NoiseSchedule, prior: PriorSection | None = None) -> Sampler:
    """The validation sampler; with a ``prior`` it starts at the prior's step."""
    start = prior.start_step if prior is not None else None
    return make_sampler(section.sampler, section.steps, section.eta, schedule=schedule, start=start)
