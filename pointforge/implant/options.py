"""How ``pointforge generate`` runs a case: :class:`GenerateOptions`, checked once, when made."""

from __future__ import annotations

from dataclasses import dataclass

from pointforge.errors import ConfigError
from pointforge.nn.diffusion.samplers.registry import SAMPLER_NAMES

__all__ = ["GenerateOptions"]


@dataclass(frozen=True)
class GenerateOptions:
    """The options of one generate run, valid once made (ConfigError otherwise) and unchanged after.

    Frozen so that the check in ``__post_init__`` is the only one needed: every
    stage downstream takes the options as they are. Change one with
    :func:`dataclasses.replace`, which checks the new options again.
    """

    ensemble: int = 5
    sampler: str = "ddim"  # ddpm | ddim | dpm++2m
    steps: int | None = None  # None: proposals.GENERATE_STEPS (ddim 7), else the sampler's default; ddpm always all T
    seed: int = 0
    surface_points: int = 50_000  # defective-skull surface samples the conditioning is drawn from
    voxel_resolution: int | None = None  # DPSR solve grid; None: per case, voxelize.solve_resolution
    subsample: str = "random"  # how the conditioning points are drawn: random (as in training) or fps
    # Clean-up keeps every component of at least this fraction of the largest (1: the largest only, upstream's
    # chain). Safe below 1 because the candidate is already cut to the generated points' neighbourhood; 0.2
    # keeps both plates of a bilateral defect (docs/pcdiff.md, "Where the implant goes").
    components: float = 0.2
    # Clean-up keeps only candidate voxels this close (mm) to a generated implant point; None: the whole ball
    # around the points (upstream). On real skulls the excess far from the points set HD95 (docs/implant.md).
    reach_mm: float | None = None
    # Defective-skull points the voxelizer is given beside each proposal's implant points; None: as many as it
    # was trained on (at least PCDiff's n_skull). The density moves the solid (docs/implant.md, "Skull points").
    skull_points: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.ensemble, bool) or not isinstance(self.ensemble, int) or self.ensemble < 1:
            raise ConfigError(f"--ensemble must be a positive integer, got {self.ensemble!r}")
        if str(self.sampler).lower() not in SAMPLER_NAMES:
            raise ConfigError(f"unknown sampler {self.sampler!r}; choose one of: {', '.join(SAMPLER_NAMES)}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be a positive integer, got {self.steps}")
        if self.surface_points < 1000:
            raise ConfigError(f"surface_points must be at least 1000, got {self.surface_points}")
        if not 0 < self.components <= 1:
            raise ConfigError(f"--components must be a fraction in (0, 1], got {self.components}")
        if self.reach_mm is not None and not self.reach_mm > 0:
            raise ConfigError(f"--reach-mm must be a positive distance in mm, got {self.reach_mm}")
        if self.skull_points is not None and (
            isinstance(self.skull_points, bool) or not isinstance(self.skull_points, int) or self.skull_points < 64
        ):
            raise ConfigError(f"--skull-points must be an integer of at least 64, got {self.skull_points!r}")
        if self.subsample not in ("random", "fps"):
            raise ConfigError(f"subsample must be random or fps, got {self.subsample!r}")
